#include "eldr/trace/trace.h"
#include "eldr/common/file.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "eldr/core/centroid_artifact.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/process.h"

namespace eldr {
namespace {

using ::testing::HasSubstr;

std::string DataDir() {
  const char* dir = std::getenv("ELDR_DATA_DIR");
  return absl::StrCat(dir != nullptr ? dir : "data", "/esft-routing");
}

// A .npy file: magic, version, little-endian header length, header padded with spaces to a
// multiple of 64 bytes and ended by a newline, then the data.
std::string Npy(const std::string& header_dict, const std::string& data, int major = 1) {
  const size_t preamble = major == 1 ? 10 : 12;
  std::string header = header_dict;
  while ((preamble + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string out("\x93NUMPY", 6);
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  const uint32_t length = static_cast<uint32_t>(header.size());
  out.push_back(static_cast<char>(length & 0xff));
  out.push_back(static_cast<char>((length >> 8) & 0xff));
  if (major != 1) {
    out.push_back(static_cast<char>((length >> 16) & 0xff));
    out.push_back(static_cast<char>(length >> 24));
  }
  return out + header + data;
}

absl::StatusOr<NpyArray> Parse(const std::string& bytes, const std::string& name = "test.npy") {
  return ParseNpy(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), name);
}

std::string Int64Data(const std::vector<int64_t>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * 8);
}

void ExpectError(const absl::StatusOr<NpyArray>& result, const std::string& text) {
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("test.npy"));
  EXPECT_THAT(std::string(result.status().message()), HasSubstr(text));
}

TEST(NpyTest, ParsesVersionsOneAndTwo) {
  const std::string data = Int64Data({0, 5, 9});
  for (int major : {1, 2}) {
    absl::StatusOr<NpyArray> array =
        Parse(Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", data, major));
    ASSERT_TRUE(array.ok()) << array.status();
    EXPECT_EQ(array->dtype, "<i8");
    EXPECT_EQ(array->shape, (std::vector<int64_t>{3}));
    EXPECT_EQ(array->elements(), 3);
    EXPECT_EQ(array->data.size(), 24u);
  }
  absl::StatusOr<NpyArray> matrix = Parse(Npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3), }", "abcdef"));
  ASSERT_TRUE(matrix.ok()) << matrix.status();
  EXPECT_EQ(matrix->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(matrix->data[5], 'f');
  absl::StatusOr<NpyArray> scalar = Parse(Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (), }", "abcd"));
  ASSERT_TRUE(scalar.ok()) << scalar.status();
  EXPECT_EQ(scalar->elements(), 1);
}

TEST(NpyTest, RejectsBrokenFilesWithClearErrors) {
  const std::string good_header = "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }";
  const std::string data = Int64Data({0, 5, 9});
  ExpectError(Parse("PK\x03\x04 not numpy"), "bad magic");
  ExpectError(Parse(std::string("\x93NUMPY\x01", 7)), "bad magic");
  std::string truncated_header = Npy(good_header, data).substr(0, 40);
  ExpectError(Parse(truncated_header), "truncated .npy header");
  ExpectError(Parse(Npy(good_header, data.substr(0, 20))), "truncated data");
  ExpectError(Parse(Npy(good_header, data + "x")), "unexpected trailing data");
  ExpectError(Parse(Npy("{'descr': '<c8', 'fortran_order': False, 'shape': (3,), }", data)), "unsupported dtype '<c8'");
  ExpectError(Parse(Npy("{'descr': '>i8', 'fortran_order': False, 'shape': (3,), }", data)), "big-endian");
  ExpectError(Parse(Npy("{'descr': '<i8', 'fortran_order': True, 'shape': (3,), }", data)), "Fortran-order");
  ExpectError(Parse(Npy("{'descr': '<i8', 'shape': (3,), }", data)), "lacks one of");
  ExpectError(Parse(Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (3,,), }", data)), "bad .npy header");
  ExpectError(Parse(Npy("{'descr': '<i8', 'fortran_order': False, 'shape': [3], }", data)), "shape must be a tuple");
  ExpectError(Parse(Npy("['descr']", data)), "header is not a dict");
  ExpectError(Parse(Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (99999999999, 99999999999), }", data)),
              "truncated data");
  std::string bad_version = Npy(good_header, data);
  bad_version[6] = 9;
  ExpectError(Parse(bad_version), "unsupported .npy format version 9");
}

TEST(NpyTest, EveryTruncationAndByteFlipIsHandled) {
  const std::string good =
      Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (2, 3), }", Int64Data({1, 2, 3, 4, 5, 6}));
  ASSERT_TRUE(Parse(good).ok());
  for (size_t length = 0; length < good.size(); ++length) {
    EXPECT_FALSE(Parse(good.substr(0, length)).ok()) << length;
  }
  // Flipping any single byte of the preamble or header never crashes; most flips are errors.
  for (size_t at = 0; at < 128; ++at) {
    for (int bit : {0x01, 0x20, 0x80}) {
      std::string corrupt = good;
      corrupt[at] = static_cast<char>(corrupt[at] ^ bit);
      const absl::StatusOr<NpyArray> result = Parse(corrupt);
      if (result.ok()) EXPECT_EQ(result->data.size(), static_cast<size_t>(result->elements()) * 8);
    }
  }
}

TEST(NpyTest, ReadNpyNamesTheMissingFile) {
  const absl::StatusOr<NpyArray> missing = ReadNpy("/nonexistent/thing.npy");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/thing.npy"));
}

TEST(ExpertTraceTest, LoadsTheBundledTraces) {
  absl::StatusOr<ExpertTrace> trace = LoadExpertTrace(DataDir());
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_EQ(trace->layers, 26);
  EXPECT_EQ(trace->experts, 64);
  EXPECT_EQ(trace->top_k, 6);
  EXPECT_EQ(trace->domains, (std::vector<std::string>{"intent", "law", "summary", "translation"}));
  // Sequence and token counts of the data README.
  const int expected_sequences[] = {127, 33, 13, 40};
  const int64_t expected_tokens[] = {8222, 8327, 8479, 8251};
  std::vector<int> sequences(4, 0);
  std::vector<int64_t> tokens(4, 0);
  for (const TraceSequence& seq : trace->sequences) {
    EXPECT_EQ(seq.index_in_domain, sequences[seq.domain]);
    ++sequences[seq.domain];
    tokens[seq.domain] += seq.tokens;
    EXPECT_EQ(seq.topk.size(), static_cast<size_t>(seq.tokens) * 26 * 6);
  }
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(sequences[d], expected_sequences[d]) << trace->domains[d];
    EXPECT_EQ(tokens[d], expected_tokens[d]) << trace->domains[d];
  }
}

TEST(ExpertTraceTest, AccumulateCountsConservesTokens) {
  absl::StatusOr<ExpertTrace> trace = LoadExpertTrace(DataDir());
  ASSERT_TRUE(trace.ok()) << trace.status();
  const TraceSequence& seq = trace->sequences[5];
  const int prefill = PrefillTokens(seq.tokens, 0.5);
  std::vector<int32_t> counts(26 * 64, 0);
  AccumulateCounts(*trace, seq, 0, prefill, absl::MakeSpan(counts));
  for (int l = 0; l < 26; ++l) {
    const int sum = std::accumulate(counts.begin() + l * 64, counts.begin() + (l + 1) * 64, 0);
    EXPECT_EQ(sum, prefill * 6) << "layer " << l;
  }
  // The rest of the sequence adds the remaining tokens; out-of-range bounds are clamped.
  AccumulateCounts(*trace, seq, prefill, seq.tokens + 100, absl::MakeSpan(counts));
  EXPECT_EQ(std::accumulate(counts.begin(), counts.begin() + 64, 0), seq.tokens * 6);
  // The first token's choices are exactly its top-k ids.
  std::vector<int32_t> first(26 * 64, 0);
  AccumulateCounts(*trace, seq, 0, 1, absl::MakeSpan(first));
  for (int j = 0; j < 6; ++j) EXPECT_GE(first[seq.topk[j]], 1);
  std::vector<int32_t> wrong_size(10, 0);
  AccumulateCounts(*trace, seq, 0, 5, absl::MakeSpan(wrong_size));
  EXPECT_EQ(wrong_size, std::vector<int32_t>(10, 0));
}

TEST(ExpertTraceTest, PrefillTokens) {
  EXPECT_EQ(PrefillTokens(100, 0.5), 50);
  EXPECT_EQ(PrefillTokens(47, 0.5), 24);  // 23.5 -> 24 (half to even)
  EXPECT_EQ(PrefillTokens(49, 0.5), 24);  // 24.5 -> 24 (half to even, like Python)
  EXPECT_EQ(PrefillTokens(10, 0.0), 1);   // at least one prompt token
  EXPECT_EQ(PrefillTokens(10, 1.0), 9);   // at least one generated token
  EXPECT_EQ(PrefillTokens(1, 0.5), 1);
  EXPECT_EQ(PrefillTokens(10, std::nan("")), 1);
}

// A temporary folder of trace files.
class TraceDir : public eldr::testing::TempDir {
 public:
  void Write(const std::string& name, const std::string& bytes) {
    ASSERT_TRUE(WriteFileAtomically(File(name), bytes).ok());
  }
};

TEST(ExpertTraceTest, LoadErrorsNameTheFile) {
  EXPECT_EQ(LoadExpertTrace("/nonexistent/trace").status().code(), absl::StatusCode::kNotFound);
  TraceDir empty;
  EXPECT_THAT(std::string(LoadExpertTrace(empty.path()).status().message()), HasSubstr("no <domain>_topk.npy files"));

  // 3 tokens, 2 layers, top-2; ids below 4.
  const std::string topk = Npy("{'descr': '|u1', 'fortran_order': False, 'shape': (3, 2, 2), }",
                               std::string("\x00\x01\x02\x03\x01\x02\x00\x03\x03\x02\x01\x00", 12));
  TraceDir missing_offsets;
  missing_offsets.Write("x_topk.npy", topk);
  EXPECT_THAT(std::string(LoadExpertTrace(missing_offsets.path(), 4).status().message()), HasSubstr("x_offsets.npy"));

  TraceDir good;
  good.Write("x_topk.npy", topk);
  good.Write("x_offsets.npy", Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", Int64Data({0, 1, 3})));
  absl::StatusOr<ExpertTrace> loaded = LoadExpertTrace(good.path(), 4);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->sequences.size(), 2u);
  EXPECT_EQ(loaded->sequences[1].tokens, 2);
  const absl::Status too_few_experts = LoadExpertTrace(good.path(), 3).status();
  EXPECT_THAT(std::string(too_few_experts.message()), HasSubstr("expert id 3 is not below 3"));
  EXPECT_THAT(std::string(too_few_experts.message()), HasSubstr("x_topk.npy"));

  TraceDir bad_offsets;
  bad_offsets.Write("x_topk.npy", topk);
  bad_offsets.Write("x_offsets.npy",
                    Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }", Int64Data({0, 2, 2})));
  EXPECT_THAT(std::string(LoadExpertTrace(bad_offsets.path(), 4).status().message()), HasSubstr("end at the 3 tokens"));
  bad_offsets.Write("x_offsets.npy",
                    Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (4,), }", Int64Data({0, 2, 2, 3})));
  EXPECT_THAT(std::string(LoadExpertTrace(bad_offsets.path(), 4).status().message()), HasSubstr("increase strictly"));
  bad_offsets.Write("x_offsets.npy", Npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }",
                                         std::string("\0\0\0\0\3\0\0\0", 8)));
  EXPECT_THAT(std::string(LoadExpertTrace(bad_offsets.path(), 4).status().message()),
              HasSubstr("expected int64 offsets"));
}

}  // namespace
}  // namespace eldr
