#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_artifact.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class CaptureFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("capture_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  void WriteBytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

  static CalibrationData Sample(int n, int layers, int experts, int32_t scale) {
    CalibrationData data;
    data.layers = layers;
    data.experts = experts;
    data.n = n;
    for (int i = 0; i < n * layers * experts; ++i) {
      data.prefill_counts.push_back((i * 7 % 13) * scale);
      data.decode_counts.push_back(i * 3 % 5);
    }
    for (int r = 0; r < n; ++r) data.labels.push_back(r % 3);
    return data;
  }

  std::filesystem::path dir_;
};

TEST_F(CaptureFileTest, RoundTripWithDecodeCountsAndLabels) {
  const CalibrationData data = Sample(5, 3, 4, 1);
  ASSERT_TRUE(WriteCaptureFile(Path("a.cap"), data).ok());
  absl::StatusOr<CalibrationData> read = ReadCaptureFiles({Path("a.cap")}, 0, 0);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->n, 5);
  EXPECT_EQ(read->layers, 3);
  EXPECT_EQ(read->experts, 4);
  EXPECT_EQ(read->prefill_counts, data.prefill_counts);
  EXPECT_EQ(read->decode_counts, data.decode_counts);
  EXPECT_EQ(read->labels, data.labels);
  EXPECT_TRUE(read->gate_prob_sums.empty());
  // int16 counts: header 24 bytes, then per record 4 + 2 * (12 + 12) + 4 bytes.
  EXPECT_EQ(std::filesystem::file_size(Path("a.cap")), 24u + 5u * (4 + 48 + 4));
}

TEST_F(CaptureFileTest, LargeCountsSwitchToInt32AndGateSumsRoundTrip) {
  CalibrationData data = Sample(3, 2, 5, 10000);  // up to 120000: beyond int16
  data.decode_counts.clear();
  data.labels.clear();
  for (int i = 0; i < 30; ++i) data.gate_prob_sums.push_back(0.25f * i);
  ASSERT_TRUE(WriteCaptureFile(Path("wide.cap"), data).ok());
  absl::StatusOr<CalibrationData> read = ReadCaptureFiles({Path("wide.cap")}, 2, 5);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->prefill_counts, data.prefill_counts);
  EXPECT_EQ(read->gate_prob_sums, data.gate_prob_sums);
  EXPECT_TRUE(read->decode_counts.empty());
}

TEST_F(CaptureFileTest, ReferencePlainFramesNeedTheGeometry) {
  const CalibrationData data = Sample(4, 3, 4, 1);
  CaptureWriteOptions reference;
  reference.reference_framing = true;
  ASSERT_TRUE(WriteCaptureFile(Path("plain.bin"), data, reference).ok());
  EXPECT_EQ(std::filesystem::file_size(Path("plain.bin")), 4u * (4 + 24));
  absl::StatusOr<CalibrationData> read = ReadCaptureFiles({Path("plain.bin")}, 3, 4);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->prefill_counts, data.prefill_counts);
  EXPECT_TRUE(read->decode_counts.empty());
  EXPECT_THAT(ReadCaptureFiles({Path("plain.bin")}, 0, 0).status().message(),
              AllOf(HasSubstr(Path("plain.bin")), HasSubstr("pass --layers and --experts")));
  // A plain frame of 24 bytes cannot be L=4, E=4 (32 bytes).
  EXPECT_THAT(
      ReadCaptureFiles({Path("plain.bin")}, 4, 4).status().message(),
      AllOf(HasSubstr("record 0 (byte offset 0)"), HasSubstr("frame of 24 bytes"), HasSubstr("expected 32 bytes")));
}

TEST_F(CaptureFileTest, SeveralFilesConcatenate) {
  const CalibrationData a = Sample(2, 3, 4, 1);
  const CalibrationData b = Sample(3, 3, 4, 2);
  ASSERT_TRUE(WriteCaptureFile(Path("a.cap"), a).ok());
  ASSERT_TRUE(WriteCaptureFile(Path("b.cap"), b).ok());
  absl::StatusOr<CalibrationData> read = ReadCaptureFiles({Path("a.cap"), Path("b.cap")}, 3, 4);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->n, 5);
  std::vector<int32_t> expected = a.prefill_counts;
  expected.insert(expected.end(), b.prefill_counts.begin(), b.prefill_counts.end());
  EXPECT_EQ(read->prefill_counts, expected);
}

TEST_F(CaptureFileTest, TruncatedRecordNamesFileAndRecord) {
  const CalibrationData data = Sample(4, 3, 4, 1);
  absl::StatusOr<std::string> bytes = SerializeCaptureFile(data);
  ASSERT_TRUE(bytes.ok());
  WriteBytes(Path("cut.cap"), bytes->substr(0, bytes->size() - 7));
  const absl::Status status = ReadCaptureFiles({Path("cut.cap")}, 0, 0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr(Path("cut.cap")), HasSubstr("record 3"), HasSubstr("truncated")));
  WriteBytes(Path("cut2.cap"), bytes->substr(0, 24 + 2));
  EXPECT_THAT(ReadCaptureFiles({Path("cut2.cap")}, 0, 0).status().message(),
              AllOf(HasSubstr("record 0"), HasSubstr("truncated frame length")));
  WriteBytes(Path("header.cap"), bytes->substr(0, 12));
  EXPECT_THAT(ReadCaptureFiles({Path("header.cap")}, 0, 0).status().message(), HasSubstr("truncated header"));
}

TEST_F(CaptureFileTest, WrongGeometryAndHeaderProblems) {
  const CalibrationData data = Sample(2, 3, 4, 1);
  ASSERT_TRUE(WriteCaptureFile(Path("a.cap"), data).ok());
  EXPECT_THAT(ReadCaptureFiles({Path("a.cap")}, 26, 64).status().message(),
              AllOf(HasSubstr(Path("a.cap")), HasSubstr("geometry L=3 E=4 does not match the expected L=26 E=64")));
  std::string bytes = *SerializeCaptureFile(data);
  std::string bad_version = bytes;
  bad_version[8] = 9;
  WriteBytes(Path("v9.cap"), bad_version);
  EXPECT_THAT(ReadCaptureFiles({Path("v9.cap")}, 0, 0).status().message(),
              HasSubstr("unsupported capture format version 9"));
  std::string bad_flags = bytes;
  bad_flags[20] = static_cast<char>(0x80);
  WriteBytes(Path("flags.cap"), bad_flags);
  EXPECT_THAT(ReadCaptureFiles({Path("flags.cap")}, 0, 0).status().message(), HasSubstr("unknown flag bits 0x80"));
  std::string zero_layers = bytes;
  zero_layers[12] = 0;
  WriteBytes(Path("zero.cap"), zero_layers);
  EXPECT_THAT(ReadCaptureFiles({Path("zero.cap")}, 0, 0).status().message(), HasSubstr("bad geometry in the header"));
  // Files that disagree on what records carry.
  CalibrationData no_decode = data;
  no_decode.decode_counts.clear();
  ASSERT_TRUE(WriteCaptureFile(Path("b.cap"), no_decode).ok());
  EXPECT_THAT(ReadCaptureFiles({Path("a.cap"), Path("b.cap")}, 0, 0).status().message(),
              AllOf(HasSubstr(Path("b.cap")), HasSubstr("all capture files must agree")));
  // Nothing at all.
  WriteBytes(Path("empty.bin"), "");
  EXPECT_THAT(ReadCaptureFiles({Path("empty.bin")}, 3, 4).status().message(), HasSubstr("hold no records"));
  EXPECT_THAT(ReadCaptureFiles({Path("missing.cap")}, 3, 4).status().message(), HasSubstr("missing.cap"));
  EXPECT_FALSE(ReadCaptureFiles({}, 3, 4).ok());
}

TEST_F(CaptureFileTest, BadValuesNameTheRecord) {
  CalibrationData data = Sample(3, 2, 2, 1);
  std::string bytes = *SerializeCaptureFile(data);
  // Record 1's first prefill count (int16) becomes -2: header 24 + record 0 (4 + 2*8 + 4 = 24) + 4.
  bytes[24 + 24 + 4] = static_cast<char>(0xfe);
  bytes[24 + 24 + 5] = static_cast<char>(0xff);
  WriteBytes(Path("neg.cap"), bytes);
  EXPECT_THAT(ReadCaptureFiles({Path("neg.cap")}, 0, 0).status().message(),
              AllOf(HasSubstr("record 1"), HasSubstr("negative prefill count -2 at layer 0, expert 0")));

  CalibrationData gate = Sample(2, 2, 2, 1);
  gate.gate_prob_sums = std::vector<float>(8, 0.5f);
  std::string gate_bytes = *SerializeCaptureFile(gate);
  WriteBytes(Path("gate.cap"), gate_bytes);
  ASSERT_TRUE(ReadCaptureFiles({Path("gate.cap")}, 0, 0).ok());
  // Record 1's gate sum at (layer 1, expert 1) becomes NaN. Record: 4 + 8 + 8 + 16 + 4 = 40 bytes.
  const float nan = std::nanf("");
  std::memcpy(&gate_bytes[24 + 40 + 4 + 8 + 8 + 12], &nan, 4);
  WriteBytes(Path("nan.cap"), gate_bytes);
  EXPECT_THAT(ReadCaptureFiles({Path("nan.cap")}, 0, 0).status().message(),
              AllOf(HasSubstr("record 1"), HasSubstr("layer 1, expert 1 is not finite")));
}

TEST_F(CaptureFileTest, WriterRejectsInvalidDataAndLeavesNothing) {
  CalibrationData data = Sample(2, 2, 2, 1);
  data.prefill_counts[5] = -1;
  EXPECT_THAT(WriteCaptureFile(Path("x.cap"), data).message(), HasSubstr("request 1: negative prefill count"));
  EXPECT_FALSE(std::filesystem::exists(Path("x.cap")));
  CalibrationData big = Sample(2, 2, 2, 5000);
  CaptureWriteOptions reference;
  reference.reference_framing = true;
  EXPECT_THAT(WriteCaptureFile(Path("y.bin"), big, reference).message(), HasSubstr("exceeds 32767"));
  EXPECT_FALSE(std::filesystem::exists(Path("y.bin")));
}

}  // namespace
}  // namespace eldr
