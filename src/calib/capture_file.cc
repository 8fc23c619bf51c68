// Capture files: per-request expert counts as captured during prefill (docs/calibration.md,
// "Capture file format"). Two framings: the ELDR format with a header, and the reference engine's
// plain length-prefixed frames of int16 counts.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "eldr/calib/calibration.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"

namespace eldr {
namespace {

constexpr char kMagic[8] = {'E', 'L', 'D', 'R', 'C', 'A', 'P', 'T'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 24;  // magic, version, layers, experts, flags
// Record flags: which parts follow the prefill counts, and the count width.
constexpr uint32_t kHasDecode = 1u << 0;
constexpr uint32_t kHasLabel = 1u << 1;
constexpr uint32_t kInt32Counts = 1u << 2;
constexpr uint32_t kHasGateSums = 1u << 3;
constexpr uint32_t kKnownFlags = kHasDecode | kHasLabel | kInt32Counts | kHasGateSums;
// Upper bound on one geometry's size, so a corrupt header cannot ask for absurd allocations.
constexpr uint64_t kMaxCellsPerRequest = uint64_t{1} << 24;

uint32_t LoadU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
void AppendU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

struct Layout {
  uint32_t flags = 0;
  size_t cells = 0;  // layers * experts
  size_t count_bytes() const { return (flags & kInt32Counts) ? 4 : 2; }
  size_t record_bytes() const {
    size_t bytes = cells * count_bytes();
    if (flags & kHasDecode) bytes += cells * count_bytes();
    if (flags & kHasGateSums) bytes += cells * 4;
    if (flags & kHasLabel) bytes += 4;
    return bytes;
  }
};

// Appends one record's counts (int16 or int32 little-endian) to `out`, failing on negatives.
absl::Status DecodeCounts(const char* p, const Layout& layout, int experts, const char* what, std::vector<int32_t>& out,
                          const std::string& where) {
  for (size_t c = 0; c < layout.cells; ++c) {
    int32_t v;
    if (layout.count_bytes() == 2) {
      v = static_cast<int16_t>(
          static_cast<uint16_t>(static_cast<uint8_t>(p[2 * c]) | (static_cast<uint8_t>(p[2 * c + 1]) << 8)));
    } else {
      v = static_cast<int32_t>(LoadU32(p + 4 * c));
    }
    if (v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": negative ", what, " count ", v, " at layer ", c / experts, ", expert ", c % experts));
    }
    out.push_back(v);
  }
  return absl::OkStatus();
}

struct FileContents {
  int layers = 0;
  int experts = 0;
  uint32_t flags = 0;
  bool has_header = false;
};

absl::Status ParseOne(const std::string& path, absl::string_view bytes, int expected_layers, int expected_experts,
                      FileContents* info, CalibrationData* data) {
  size_t offset = 0;
  Layout layout;
  if (bytes.size() >= sizeof(kMagic) && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0) {
    if (bytes.size() < kHeaderBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": truncated header (", bytes.size(), " bytes, need ", kHeaderBytes, ")"));
    }
    const uint32_t version = LoadU32(bytes.data() + 8);
    const uint32_t layers = LoadU32(bytes.data() + 12);
    const uint32_t experts = LoadU32(bytes.data() + 16);
    const uint32_t flags = LoadU32(bytes.data() + 20);
    if (version != kVersion) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported capture format version ", version,
                                                     " (this build reads version ", kVersion, ")"));
    }
    if (flags & ~kKnownFlags) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": unknown flag bits 0x", absl::Hex(flags & ~kKnownFlags), " in the header"));
    }
    if (layers < 1 || experts < 1 || static_cast<uint64_t>(layers) * experts > kMaxCellsPerRequest) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad geometry in the header: L=", layers, " E=", experts));
    }
    if ((expected_layers > 0 && static_cast<int>(layers) != expected_layers) ||
        (expected_experts > 0 && static_cast<int>(experts) != expected_experts)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": geometry L=", layers, " E=", experts,
                                                     " does not match the expected L=", expected_layers,
                                                     " E=", expected_experts));
    }
    info->layers = static_cast<int>(layers);
    info->experts = static_cast<int>(experts);
    info->flags = flags;
    info->has_header = true;
    layout.flags = flags;
    offset = kHeaderBytes;
  } else {
    if (expected_layers < 1 || expected_experts < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(path,
                       ": no ELDR capture header (magic \"ELDRCAPT\"); reading it as the reference's plain "
                       "frames needs the geometry: pass --layers and --experts"));
    }
    info->layers = expected_layers;
    info->experts = expected_experts;
    info->flags = 0;
    info->has_header = false;
  }
  layout.cells = static_cast<size_t>(info->layers) * info->experts;
  const size_t record_bytes = layout.record_bytes();

  for (int record = 0; offset < bytes.size(); ++record) {
    const std::string where = absl::StrCat(path, ": record ", record, " (byte offset ", offset, ")");
    if (bytes.size() - offset < 4) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": truncated frame length (", bytes.size() - offset, " bytes left)"));
    }
    const uint32_t frame = LoadU32(bytes.data() + offset);
    if (frame != record_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": frame of ", frame, " bytes does not match the geometry L=", info->layers, " E=", info->experts,
          " (expected ", record_bytes, " bytes", info->has_header ? "" : " = L * E * 2", ")"));
    }
    if (bytes.size() - offset - 4 < record_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": truncated: the frame says ", frame, " bytes, ", bytes.size() - offset - 4, " remain"));
    }
    const char* p = bytes.data() + offset + 4;
    absl::Status status = DecodeCounts(p, layout, info->experts, "prefill", data->prefill_counts, where);
    if (!status.ok()) return status;
    p += layout.cells * layout.count_bytes();
    if (layout.flags & kHasDecode) {
      status = DecodeCounts(p, layout, info->experts, "decode", data->decode_counts, where);
      if (!status.ok()) return status;
      p += layout.cells * layout.count_bytes();
    }
    if (layout.flags & kHasGateSums) {
      for (size_t c = 0; c < layout.cells; ++c) {
        const uint32_t raw = LoadU32(p + 4 * c);
        float v;
        std::memcpy(&v, &raw, sizeof(v));
        if (!std::isfinite(v) || v < 0) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": gate-probability sum ", v, " at layer ",
                                                         c / info->experts, ", expert ", c % info->experts, " is ",
                                                         std::isfinite(v) ? "negative" : "not finite"));
        }
        data->gate_prob_sums.push_back(v);
      }
      p += layout.cells * 4;
    }
    if (layout.flags & kHasLabel) {
      const int32_t label = static_cast<int32_t>(LoadU32(p));
      if (label < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": negative label ", label));
      data->labels.push_back(label);
    }
    ++data->n;
    offset += 4 + record_bytes;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CalibrationData> ReadCaptureFiles(const std::vector<std::string>& paths, int layers, int experts) {
  if (paths.empty()) return absl::InvalidArgumentError("no capture files given");
  if (layers < 0 || experts < 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad expected geometry L=", layers, " E=", experts));
  }
  CalibrationData data;
  FileContents first;
  std::string first_path;
  for (const std::string& path : paths) {
    absl::StatusOr<std::string> bytes = ReadFile(path);
    if (!bytes.ok()) return bytes.status();
    FileContents info;
    absl::Status status = ParseOne(path, *bytes, layers, experts, &info, &data);
    if (!status.ok()) return status;
    if (first_path.empty()) {
      first = info;
      first_path = path;
      // Plain frames (or a header) fixed the geometry: later files must match it.
      layers = info.layers;
      experts = info.experts;
      data.layers = info.layers;
      data.experts = info.experts;
    } else if ((info.flags & ~kInt32Counts) != (first.flags & ~kInt32Counts)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": its records carry different parts (flags 0x",
                                                     absl::Hex(info.flags), ") than ", first_path, " (flags 0x",
                                                     absl::Hex(first.flags), "); all capture files must agree"));
    }
  }
  if (data.n == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capture files hold no records (", paths.size(), " file(s), first: ", paths.front(), ")"));
  }
  return data;
}

absl::StatusOr<std::string> SerializeCaptureFile(const CalibrationData& data, const CaptureWriteOptions& options) {
  if (absl::Status s = ValidateCalibrationData(data); !s.ok()) return s;
  const size_t cells = static_cast<size_t>(data.layers) * data.experts;
  if (cells > kMaxCellsPerRequest) return absl::InvalidArgumentError("capture file: geometry too large");
  std::string out;
  auto append_counts = [&](const int32_t* values, bool wide) {
    for (size_t c = 0; c < cells; ++c) {
      if (wide) {
        AppendU32(out, static_cast<uint32_t>(values[c]));
      } else {
        out.push_back(static_cast<char>(values[c] & 0xff));
        out.push_back(static_cast<char>((values[c] >> 8) & 0xff));
      }
    }
  };
  auto fits_int16 = [](const std::vector<int32_t>& v) {
    for (int32_t x : v) {
      if (x > std::numeric_limits<int16_t>::max()) return false;
    }
    return true;
  };

  if (options.reference_framing) {
    if (!fits_int16(data.prefill_counts)) {
      return absl::InvalidArgumentError(
          "capture file: a prefill count exceeds 32767, which the reference's int16 frames cannot hold");
    }
    out.reserve(data.n * (4 + 2 * cells));
    for (int r = 0; r < data.n; ++r) {
      AppendU32(out, static_cast<uint32_t>(2 * cells));
      append_counts(data.prefill_counts.data() + r * cells, false);
    }
    return out;
  }

  uint32_t flags = 0;
  if (!data.decode_counts.empty()) flags |= kHasDecode;
  if (!data.labels.empty()) flags |= kHasLabel;
  if (!data.gate_prob_sums.empty()) flags |= kHasGateSums;
  const bool wide = !fits_int16(data.prefill_counts) || !fits_int16(data.decode_counts);
  if (wide) flags |= kInt32Counts;
  Layout layout;
  layout.flags = flags;
  layout.cells = cells;
  out.reserve(kHeaderBytes + data.n * (4 + layout.record_bytes()));
  out.append(kMagic, sizeof(kMagic));
  AppendU32(out, kVersion);
  AppendU32(out, static_cast<uint32_t>(data.layers));
  AppendU32(out, static_cast<uint32_t>(data.experts));
  AppendU32(out, flags);
  for (int r = 0; r < data.n; ++r) {
    AppendU32(out, static_cast<uint32_t>(layout.record_bytes()));
    append_counts(data.prefill_counts.data() + r * cells, wide);
    if (flags & kHasDecode) append_counts(data.decode_counts.data() + r * cells, wide);
    if (flags & kHasGateSums) {
      for (size_t c = 0; c < cells; ++c) {
        uint32_t raw;
        std::memcpy(&raw, &data.gate_prob_sums[r * cells + c], sizeof(raw));
        AppendU32(out, raw);
      }
    }
    if (flags & kHasLabel) AppendU32(out, static_cast<uint32_t>(data.labels[r]));
  }
  return out;
}

absl::Status WriteCaptureFile(const std::string& path, const CalibrationData& data,
                              const CaptureWriteOptions& options) {
  absl::StatusOr<std::string> bytes = SerializeCaptureFile(data, options);
  if (!bytes.ok()) return bytes.status();
  return WriteFileAtomically(path, *bytes);
}

}  // namespace eldr
