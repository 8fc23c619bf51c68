#include "eldr/trace/trace.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/errors.h"

namespace eldr {
namespace {

constexpr char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicLength = 6;

absl::Status NpyError(const std::string& name, absl::string_view what) {
  return InvalidInput(RejectReason::kMalformed, absl::StrCat(name, ": ", what));
}

// Item size of the little-endian / byte-order-free dtypes we read; 0 when unsupported.
int ItemSize(absl::string_view dtype) {
  static constexpr struct {
    const char* descr;
    int size;
  } kSupported[] = {{"|u1", 1}, {"|i1", 1}, {"|b1", 1}, {"<u1", 1}, {"<i1", 1}, {"<i2", 2}, {"<u2", 2},
                    {"<i4", 4}, {"<u4", 4}, {"<i8", 8}, {"<u8", 8}, {"<f4", 4}, {"<f8", 8}};
  for (const auto& entry : kSupported) {
    if (dtype == entry.descr) return entry.size;
  }
  return 0;
}

// A parser for the header's Python dict literal, e.g.
// {'descr': '<i8', 'fortran_order': False, 'shape': (14,), }
class HeaderParser {
 public:
  HeaderParser(absl::string_view text, const std::string& name) : text_(text), name_(name) {}

  absl::Status Parse(std::string* descr, bool* fortran_order, std::vector<int64_t>* shape) {
    bool have_descr = false, have_order = false, have_shape = false;
    SkipSpace();
    if (!Consume('{')) return Error("header is not a dict");
    while (true) {
      SkipSpace();
      if (Consume('}')) break;
      std::string key;
      ELDR_RETURN_IF_ERROR(ParseString(&key));
      SkipSpace();
      if (!Consume(':')) return Error(absl::StrCat("expected ':' after key '", key, "'"));
      SkipSpace();
      if (key == "descr") {
        ELDR_RETURN_IF_ERROR(ParseString(descr));
        have_descr = true;
      } else if (key == "fortran_order") {
        ELDR_RETURN_IF_ERROR(ParseBool(fortran_order));
        have_order = true;
      } else if (key == "shape") {
        ELDR_RETURN_IF_ERROR(ParseShape(shape));
        have_shape = true;
      } else {
        return Error(absl::StrCat("unexpected header key '", key, "'"));
      }
      SkipSpace();
      if (Consume(',')) continue;
      SkipSpace();
      if (Consume('}')) break;
      return Error("expected ',' or '}' in header");
    }
    if (!have_descr || !have_order || !have_shape) {
      return Error("header lacks one of 'descr', 'fortran_order', 'shape'");
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return NpyError(name_, absl::StrCat("bad .npy header (", what, ")"));
  }
  void SkipSpace() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool Consume(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  absl::Status ParseString(std::string* out) {
    if (pos_ >= text_.size() || (text_[pos_] != '\'' && text_[pos_] != '"')) {
      return Error("expected a quoted string");
    }
    const char quote = text_[pos_++];
    const size_t end = text_.find(quote, pos_);
    if (end == absl::string_view::npos) return Error("unterminated string");
    *out = std::string(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return absl::OkStatus();
  }
  absl::Status ParseBool(bool* out) {
    if (absl::StartsWith(text_.substr(pos_), "True")) {
      *out = true;
      pos_ += 4;
      return absl::OkStatus();
    }
    if (absl::StartsWith(text_.substr(pos_), "False")) {
      *out = false;
      pos_ += 5;
      return absl::OkStatus();
    }
    return Error("fortran_order must be True or False");
  }
  absl::Status ParseShape(std::vector<int64_t>* shape) {
    shape->clear();
    if (!Consume('(')) return Error("shape must be a tuple");
    while (true) {
      SkipSpace();
      if (Consume(')')) return absl::OkStatus();
      int64_t value = 0;
      size_t digits = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        if (value > (std::numeric_limits<int64_t>::max() - 9) / 10) return Error("shape too large");
        value = value * 10 + (text_[pos_++] - '0');
        ++digits;
      }
      // Python 2 era files may write long integers as 12L.
      Consume('L');
      if (digits == 0) return Error("shape entries must be non-negative integers");
      shape->push_back(value);
      SkipSpace();
      if (Consume(',')) continue;
      SkipSpace();
      if (Consume(')')) return absl::OkStatus();
      return Error("expected ',' or ')' in shape");
    }
  }

  absl::string_view text_;
  const std::string& name_;
  size_t pos_ = 0;
};

template <typename T>
T ReadLittleEndian(const uint8_t* data) {
  T value;
  std::memcpy(&value, data, sizeof(T));
  return value;
}

}  // namespace

int64_t NpyArray::elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<NpyArray> ParseNpy(absl::Span<const uint8_t> bytes, const std::string& name) {
  if (bytes.size() < kNpyMagicLength + 2 || std::memcmp(bytes.data(), kNpyMagic, kNpyMagicLength) != 0) {
    return NpyError(name, "not a .npy file (bad magic)");
  }
  const int major = bytes[6];
  size_t header_length = 0;
  size_t header_start = 0;
  if (major == 1) {
    if (bytes.size() < 10) return NpyError(name, "truncated .npy preamble");
    header_length = ReadLittleEndian<uint16_t>(bytes.data() + 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return NpyError(name, "truncated .npy preamble");
    header_length = ReadLittleEndian<uint32_t>(bytes.data() + 8);
    header_start = 12;
  } else {
    return NpyError(name, absl::StrCat("unsupported .npy format version ", major, ".", bytes[7]));
  }
  if (bytes.size() - header_start < header_length) {
    return NpyError(name, absl::StrFormat("truncated .npy header: declares %d bytes, file has %d", header_length,
                                          bytes.size() - header_start));
  }
  const absl::string_view header(reinterpret_cast<const char*>(bytes.data() + header_start), header_length);
  NpyArray array;
  bool fortran_order = false;
  ELDR_RETURN_IF_ERROR(HeaderParser(header, name).Parse(&array.dtype, &fortran_order, &array.shape));
  if (fortran_order) return NpyError(name, "Fortran-order arrays are not supported (need C order)");
  if (!array.dtype.empty() && array.dtype[0] == '>') {
    return NpyError(name, absl::StrCat("big-endian dtype '", array.dtype, "' is not supported"));
  }
  const int item_size = ItemSize(array.dtype);
  if (item_size == 0) {
    return NpyError(
        name, absl::StrCat("unsupported dtype '", array.dtype, "' (supported: integers, <f4, <f8, little-endian)"));
  }
  const size_t data_start = header_start + header_length;
  const uint64_t available = bytes.size() - data_start;
  uint64_t elements = 1;
  for (int64_t d : array.shape) {
    if (d != 0 && elements > available / static_cast<uint64_t>(d)) {
      return NpyError(name, absl::StrFormat("truncated data: shape (%s) needs more than the %d "
                                            "bytes present",
                                            absl::StrJoin(array.shape, ", "), available));
    }
    elements *= static_cast<uint64_t>(d);
  }
  const uint64_t needed = elements * static_cast<uint64_t>(item_size);
  if (needed != available) {
    return NpyError(name, absl::StrFormat("%s data: shape (%s) of %s needs %d bytes, file has %d",
                                          needed > available ? "truncated" : "unexpected trailing",
                                          absl::StrJoin(array.shape, ", "), array.dtype, needed, available));
  }
  array.data.assign(bytes.begin() + data_start, bytes.end());
  return array;
}

absl::StatusOr<NpyArray> ReadNpy(const std::string& path) {
  ELDR_ASSIGN_OR_RETURN(std::string contents, ReadFile(path));
  return ParseNpy(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(contents.data()), contents.size()), path);
}

absl::StatusOr<ExpertTrace> LoadExpertTrace(const std::string& dir, int experts) {
  if (experts < 1 || experts > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadExpertTrace: experts must be in [1, 256] for uint8 ids, got ", experts));
  }
  namespace fs = std::filesystem;
  std::error_code error;
  fs::directory_iterator it(dir, error);
  if (error) {
    return absl::NotFoundError(absl::StrCat("cannot list trace folder ", dir, ": ", error.message()));
  }
  constexpr absl::string_view kTopkSuffix = "_topk.npy";
  std::vector<std::string> domains;
  for (const fs::directory_entry& entry : it) {
    const std::string file = entry.path().filename().string();
    if (absl::EndsWith(file, kTopkSuffix) && file.size() > kTopkSuffix.size()) {
      domains.push_back(file.substr(0, file.size() - kTopkSuffix.size()));
    }
  }
  if (domains.empty()) {
    return absl::NotFoundError(absl::StrCat("no <domain>_topk.npy files in ", dir));
  }
  std::sort(domains.begin(), domains.end());

  ExpertTrace trace;
  trace.experts = experts;
  trace.domains = domains;
  for (int d = 0; d < static_cast<int>(domains.size()); ++d) {
    const std::string topk_path = absl::StrCat(dir, "/", domains[d], "_topk.npy");
    const std::string offsets_path = absl::StrCat(dir, "/", domains[d], "_offsets.npy");
    ELDR_ASSIGN_OR_RETURN(NpyArray topk, ReadNpy(topk_path));
    ELDR_ASSIGN_OR_RETURN(NpyArray offsets, ReadNpy(offsets_path));
    if (topk.dtype != "|u1" && topk.dtype != "<u1") {
      return NpyError(topk_path, absl::StrCat("expected uint8 expert ids, got dtype ", topk.dtype));
    }
    if (topk.shape.size() != 3 || topk.shape[1] < 1 || topk.shape[2] < 1) {
      return NpyError(topk_path, absl::StrCat("expected shape [tokens, layers, top_k], got (",
                                              absl::StrJoin(topk.shape, ", "), ")"));
    }
    const int64_t tokens = topk.shape[0];
    const int layers = static_cast<int>(topk.shape[1]);
    const int top_k = static_cast<int>(topk.shape[2]);
    if (d == 0) {
      trace.layers = layers;
      trace.top_k = top_k;
    } else if (layers != trace.layers || top_k != trace.top_k) {
      return NpyError(topk_path, absl::StrFormat("geometry %d layers x top-%d differs from the "
                                                 "other domains' %d x top-%d",
                                                 layers, top_k, trace.layers, trace.top_k));
    }
    if (top_k > experts) {
      return NpyError(topk_path, absl::StrFormat("top_k %d exceeds %d experts", top_k, experts));
    }
    const uint8_t max_id = topk.data.empty() ? 0 : *std::max_element(topk.data.begin(), topk.data.end());
    if (!topk.data.empty() && max_id >= experts) {
      return NpyError(topk_path, absl::StrFormat("expert id %d is not below %d experts", max_id, experts));
    }
    if (offsets.dtype != "<i8" || offsets.shape.size() != 1 || offsets.shape[0] < 2) {
      return NpyError(offsets_path, absl::StrCat("expected int64 offsets [sequences + 1], got ", offsets.dtype, " (",
                                                 absl::StrJoin(offsets.shape, ", "), ")"));
    }
    const int64_t count = offsets.shape[0];
    std::vector<int64_t> bounds(count);
    std::memcpy(bounds.data(), offsets.data.data(), count * sizeof(int64_t));
    if (bounds.front() != 0 || bounds.back() != tokens) {
      return NpyError(offsets_path, absl::StrFormat("offsets must start at 0 and end at the %d "
                                                    "tokens of %s_topk.npy, got %d .. %d",
                                                    tokens, domains[d], bounds.front(), bounds.back()));
    }
    const size_t token_bytes = static_cast<size_t>(layers) * top_k;
    for (int64_t s = 0; s + 1 < count; ++s) {
      if (bounds[s + 1] <= bounds[s]) {
        return NpyError(offsets_path, absl::StrFormat("offsets must increase strictly, but "
                                                      "offsets[%d] = %d follows %d",
                                                      s + 1, bounds[s + 1], bounds[s]));
      }
      if (bounds[s + 1] - bounds[s] > std::numeric_limits<int>::max()) {
        return NpyError(offsets_path, absl::StrFormat("sequence %d is too long", s));
      }
      TraceSequence sequence;
      sequence.domain = d;
      sequence.index_in_domain = static_cast<int>(s);
      sequence.tokens = static_cast<int>(bounds[s + 1] - bounds[s]);
      sequence.topk.assign(topk.data.begin() + bounds[s] * token_bytes,
                           topk.data.begin() + bounds[s + 1] * token_bytes);
      trace.sequences.push_back(std::move(sequence));
    }
  }
  return trace;
}

void AccumulateCounts(const ExpertTrace& trace, const TraceSequence& seq, int begin, int end,
                      absl::Span<int32_t> counts) {
  const size_t cells = static_cast<size_t>(trace.layers) * trace.experts;
  if (counts.size() != cells) return;
  begin = std::max(begin, 0);
  end = std::min(end, seq.tokens);
  const size_t token_bytes = static_cast<size_t>(trace.layers) * trace.top_k;
  if (seq.topk.size() < static_cast<size_t>(seq.tokens) * token_bytes) return;
  for (int t = begin; t < end; ++t) {
    const uint8_t* token = seq.topk.data() + static_cast<size_t>(t) * token_bytes;
    for (int l = 0; l < trace.layers; ++l) {
      int32_t* row = counts.data() + static_cast<size_t>(l) * trace.experts;
      for (int j = 0; j < trace.top_k; ++j) {
        const uint8_t expert = token[l * trace.top_k + j];
        if (expert < trace.experts) ++row[expert];
      }
    }
  }
}

int PrefillTokens(int tokens, double prefill_fraction) {
  if (!std::isfinite(prefill_fraction)) prefill_fraction = 0;
  // Round half to even (the default rounding mode), as Python's round() and NumPy do.
  const double wanted = std::nearbyint(prefill_fraction * tokens);
  const int clamped = static_cast<int>(std::clamp(wanted, 0.0, static_cast<double>(tokens)));
  return std::max(1, std::min(tokens - 1, clamped));
}

}  // namespace eldr
