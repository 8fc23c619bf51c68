#include "eldr/cluster/codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/scorer_kernels.h"
#include "eldr/cluster/crc32c.h"

namespace eldr::cluster {
namespace {

constexpr char kCentroidMagic[4] = {'E', 'L', 'D', 'C'};
constexpr char kSignatureMagic[4] = {'E', 'L', 'D', 'W'};
constexpr uint32_t kMaxSignatureValues = uint32_t{1} << 24;
constexpr float kLargestHalf = 65504.0f;  // the largest finite IEEE binary16 value

// The value layouts of a window signature (codec.h).
enum class WindowForm : uint8_t { kDenseFloat = 0, kSparseFloat = 1, kDenseHalf = 2, kSparseHalf = 3 };

// Little-endian writer.
class Writer {
 public:
  void Bytes(const void* data, size_t n) { out_.append(static_cast<const char*>(data), n); }
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) {
    for (int i = 0; i < 2; ++i) U8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void U32(uint32_t v) {
    for (int i = 0; i < 4; ++i) U8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void U64(uint64_t v) {
    for (int i = 0; i < 8; ++i) U8(static_cast<uint8_t>(v >> (8 * i)));
  }
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void F32(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    U32(bits);
  }
  void F64(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    U64(bits);
  }
  void Reserve(size_t n) { out_.reserve(n); }
  size_t size() const { return out_.size(); }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

// Little-endian reader over a checked range; every read fails (returns false) past the end.
class Reader {
 public:
  explicit Reader(absl::string_view bytes) : data_(bytes) {}
  bool Skip(size_t n) {
    if (data_.size() - pos_ < n) return false;
    pos_ += n;
    return true;
  }
  bool Bytes(size_t n, absl::string_view* out) {
    if (data_.size() - pos_ < n) return false;
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool U8(uint8_t* v) {
    if (data_.size() - pos_ < 1) return false;
    *v = static_cast<uint8_t>(data_[pos_++]);
    return true;
  }
  bool U16(uint16_t* v) {
    uint64_t x;
    if (!Le(2, &x)) return false;
    *v = static_cast<uint16_t>(x);
    return true;
  }
  bool U32(uint32_t* v) {
    uint64_t x;
    if (!Le(4, &x)) return false;
    *v = static_cast<uint32_t>(x);
    return true;
  }
  bool U64(uint64_t* v) { return Le(8, v); }
  bool I32(int32_t* v) {
    uint32_t x;
    if (!U32(&x)) return false;
    *v = static_cast<int32_t>(x);
    return true;
  }
  bool F32(float* v) {
    uint32_t bits;
    if (!U32(&bits)) return false;
    std::memcpy(v, &bits, sizeof(bits));
    return true;
  }
  bool F64(double* v) {
    uint64_t bits;
    if (!U64(&bits)) return false;
    std::memcpy(v, &bits, sizeof(bits));
    return true;
  }
  size_t remaining() const { return data_.size() - pos_; }

 private:
  bool Le(int n, uint64_t* v) {
    if (data_.size() - pos_ < static_cast<size_t>(n)) return false;
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    pos_ += n;
    *v = x;
    return true;
  }
  absl::string_view data_;
  size_t pos_ = 0;
};

uint32_t LoadU32(absl::string_view bytes, size_t offset) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[offset + i])) << (8 * i);
  return v;
}

absl::Status Truncated(absl::string_view what, absl::string_view field) {
  return absl::DataLossError(absl::StrCat(what, ": truncated at the ", field));
}

uint8_t VariantCode(SignatureVariant variant) {
  switch (variant) {
    case SignatureVariant::kCount:
      return 0;
    case SignatureVariant::kCountIdf:
      return 1;
    case SignatureVariant::kGateProb:
      return 2;
  }
  return 255;
}

// Checks magic, the version field (at offset 4, `version_bytes` wide), the checksum and returns the
// payload without its checksum.
absl::StatusOr<absl::string_view> CheckFrame(absl::string_view bytes, const char (&magic)[4], absl::string_view what,
                                             size_t min_size, uint32_t version, uint32_t found_version) {
  if (bytes.size() < min_size || std::memcmp(bytes.data(), magic, 4) != 0) {
    if (bytes.size() >= 4 && std::memcmp(bytes.data(), magic, 4) == 0) {
      return absl::DataLossError(absl::StrCat(what, ": ", bytes.size(), " bytes, shorter than any encoding"));
    }
    return absl::DataLossError(absl::StrCat(what, ": not an encoding (bad magic)"));
  }
  if (found_version != version) {
    return absl::UnimplementedError(
        absl::StrCat(what, ": encoding version ", found_version, " (this build reads version ", version, ")"));
  }
  const uint32_t stored = LoadU32(bytes, bytes.size() - 4);
  const uint32_t computed = Crc32c(bytes.substr(0, bytes.size() - 4));
  if (stored != computed) {
    return absl::DataLossError(
        absl::StrCat(what, ": checksum mismatch (stored ", absl::Hex(stored), ", computed ", absl::Hex(computed), ")"));
  }
  return bytes.substr(0, bytes.size() - 4);
}

}  // namespace

absl::StatusOr<std::string> EncodeCentroidArtifact(const CentroidArtifact& artifact) {
  absl::Status valid = ValidateCentroidArtifact(artifact);
  if (!valid.ok()) return valid;
  const SignatureSpec& spec = artifact.spec;
  size_t estimate =
      64 + spec.layer_mask.size() * 4 + spec.idf.size() * 4 + artifact.centroids.size() * 4 + artifact.model.size();
  for (const std::string& worker : artifact.workers) {
    if (worker.size() > 0xFFFF) {
      return absl::InvalidArgumentError(absl::StrCat("worker name of ", worker.size(), " bytes (at most 65535)"));
    }
    estimate += 2 + worker.size();
  }
  if (estimate > kMaxEncodedCentroidBytes || artifact.model.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("centroid set of about ", estimate, " bytes, over the limit of ", kMaxEncodedCentroidBytes));
  }
  Writer w;
  w.Reserve(estimate);
  w.Bytes(kCentroidMagic, 4);
  w.U32(kCentroidEncodingVersion);
  w.U32(0);  // total length, patched below
  w.I32(spec.layers);
  w.I32(spec.experts);
  w.U8(VariantCode(spec.variant));
  w.U8(0);
  w.U8(0);
  w.U8(0);
  w.U32(static_cast<uint32_t>(spec.layer_mask.size()));
  for (int layer : spec.layer_mask) w.I32(layer);
  w.U32(static_cast<uint32_t>(spec.idf.size()));
  for (float v : spec.idf) w.F32(v);
  w.I32(artifact.k);
  w.I32(artifact.dim());
  for (float v : artifact.centroids) w.F32(v);
  w.U32(static_cast<uint32_t>(artifact.workers.size()));
  for (const std::string& worker : artifact.workers) {
    w.U16(static_cast<uint16_t>(worker.size()));
    w.Bytes(worker.data(), worker.size());
  }
  w.U32(static_cast<uint32_t>(artifact.model.size()));
  w.Bytes(artifact.model.data(), artifact.model.size());
  w.U64(artifact.seed);
  const uint32_t total = static_cast<uint32_t>(w.size() + 4);
  std::string& out = w.str();
  for (int i = 0; i < 4; ++i) out[8 + i] = static_cast<char>(static_cast<uint8_t>(total >> (8 * i)));
  w.U32(Crc32c(out));
  return std::move(w.str());
}

absl::StatusOr<CentroidArtifact> DecodeCentroidArtifact(absl::string_view bytes) {
  constexpr absl::string_view kWhat = "centroid set";
  // magic, version, length, layers, experts, variant word, mask count, idf count, k, dim, workers,
  // model length, seed, checksum.
  constexpr size_t kMinSize = 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 4 + 8 + 4;
  if (bytes.size() > kMaxEncodedCentroidBytes) {
    return absl::DataLossError(absl::StrCat(kWhat, ": ", bytes.size(), " bytes, over the limit"));
  }
  const uint32_t version = bytes.size() >= 8 ? LoadU32(bytes, 4) : 0;
  absl::StatusOr<absl::string_view> payload =
      CheckFrame(bytes, kCentroidMagic, kWhat, kMinSize, kCentroidEncodingVersion, version);
  if (!payload.ok()) {
    // A length mismatch explains a checksum mismatch better (truncation): say so when it applies.
    if (payload.status().code() == absl::StatusCode::kDataLoss && bytes.size() >= 12 &&
        LoadU32(bytes, 8) != bytes.size() && std::memcmp(bytes.data(), kCentroidMagic, 4) == 0) {
      return absl::DataLossError(absl::StrCat(kWhat, ": length field says ", LoadU32(bytes, 8), " bytes, got ",
                                              bytes.size(), " (truncated or padded)"));
    }
    return payload.status();
  }
  if (LoadU32(bytes, 8) != bytes.size()) {
    return absl::DataLossError(
        absl::StrCat(kWhat, ": length field says ", LoadU32(bytes, 8), " bytes, got ", bytes.size()));
  }
  Reader r(*payload);
  r.Skip(12);
  CentroidArtifact artifact;
  SignatureSpec& spec = artifact.spec;
  uint8_t variant = 0;
  if (!r.I32(&spec.layers) || !r.I32(&spec.experts) || !r.U8(&variant) || !r.Skip(3)) {
    return Truncated(kWhat, "spec");
  }
  switch (variant) {
    case 0:
      spec.variant = SignatureVariant::kCount;
      break;
    case 1:
      spec.variant = SignatureVariant::kCountIdf;
      break;
    case 2:
      spec.variant = SignatureVariant::kGateProb;
      break;
    default:
      return absl::DataLossError(absl::StrCat(kWhat, ": unknown signature variant code ", variant));
  }
  uint32_t mask_count = 0;
  if (!r.U32(&mask_count) || r.remaining() / 4 < mask_count) return Truncated(kWhat, "layer mask");
  spec.layer_mask.resize(mask_count);
  for (int& layer : spec.layer_mask) r.I32(&layer);
  uint32_t idf_count = 0;
  if (!r.U32(&idf_count) || r.remaining() / 4 < idf_count) return Truncated(kWhat, "IDF weights");
  spec.idf.resize(idf_count);
  for (float& v : spec.idf) r.F32(&v);
  int32_t dim = 0;
  if (!r.I32(&artifact.k) || !r.I32(&dim)) return Truncated(kWhat, "row count");
  absl::Status spec_ok = ValidateSignatureSpec(spec);
  if (!spec_ok.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": invalid signature spec: ", spec_ok.message()));
  }
  if (dim != spec.dim()) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": rows of ", dim, " values, the spec's dimension is ", spec.dim()));
  }
  if (artifact.k < 1 || dim < 1) return absl::InvalidArgumentError(absl::StrCat(kWhat, ": k = ", artifact.k));
  const uint64_t values = static_cast<uint64_t>(artifact.k) * static_cast<uint64_t>(dim);
  if (r.remaining() / 4 < values) return Truncated(kWhat, "centroid rows");
  artifact.centroids.resize(values);
  for (float& v : artifact.centroids) r.F32(&v);
  uint32_t worker_count = 0;
  if (!r.U32(&worker_count)) return Truncated(kWhat, "worker names");
  if (worker_count != 0 && worker_count != static_cast<uint32_t>(artifact.k)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": ", worker_count, " worker names for ", artifact.k, " rows"));
  }
  artifact.workers.reserve(worker_count);
  for (uint32_t i = 0; i < worker_count; ++i) {
    uint16_t length = 0;
    absl::string_view name;
    if (!r.U16(&length) || !r.Bytes(length, &name)) return Truncated(kWhat, "worker names");
    artifact.workers.emplace_back(name);
  }
  uint32_t model_length = 0;
  absl::string_view model;
  if (!r.U32(&model_length) || !r.Bytes(model_length, &model)) return Truncated(kWhat, "model name");
  artifact.model = std::string(model);
  if (!r.U64(&artifact.seed)) return Truncated(kWhat, "seed");
  if (r.remaining() != 0) {
    return absl::DataLossError(absl::StrCat(kWhat, ": ", r.remaining(), " unexpected bytes before the checksum"));
  }
  absl::Status valid = ValidateCentroidArtifact(artifact);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat(kWhat, ": ", valid.message()));
  return artifact;
}

absl::StatusOr<std::string> EncodeWindowSignature(const WindowSignature& entry) {
  const size_t dim = entry.signature.size();
  if (dim == 0 || dim > kMaxSignatureValues) {
    return absl::InvalidArgumentError(absl::StrCat("window signature of ", dim, " values (1 to 2^24)"));
  }
  if (!std::isfinite(entry.decode_work)) return absl::InvalidArgumentError("window signature: non-finite decode work");
  uint64_t nonzero = 0;
  bool fits_half = true;
  for (float v : entry.signature) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError("window signature: non-finite value");
    if (v != 0.0f) ++nonzero;
    if (std::fabs(v) > kLargestHalf) fits_half = false;
  }
  // The smallest form: half precision whenever every value fits it; sparse pairs when fewer bytes.
  WindowForm form;
  uint64_t value_bytes;
  if (fits_half) {
    const bool sparse = dim <= 65536 && nonzero * 4 < dim * 2;
    form = sparse ? WindowForm::kSparseHalf : WindowForm::kDenseHalf;
    value_bytes = sparse ? nonzero * 4 : dim * 2;
  } else {
    const bool sparse = nonzero * 8 < dim * 4;
    form = sparse ? WindowForm::kSparseFloat : WindowForm::kDenseFloat;
    value_bytes = sparse ? nonzero * 8 : dim * 4;
  }
  const bool sparse = form == WindowForm::kSparseFloat || form == WindowForm::kSparseHalf;
  Writer w;
  w.Reserve(28 + value_bytes);
  w.Bytes(kSignatureMagic, 4);
  w.U8(static_cast<uint8_t>(kSignatureEncodingVersion));
  w.U8(static_cast<uint8_t>(form));
  w.U16(0);
  w.U32(static_cast<uint32_t>(dim));
  w.U32(static_cast<uint32_t>(sparse ? nonzero : dim));
  for (size_t i = 0; i < dim; ++i) {
    const float v = entry.signature[i];
    switch (form) {
      case WindowForm::kDenseFloat:
        w.F32(v);
        break;
      case WindowForm::kSparseFloat:
        if (v == 0.0f) break;
        w.U32(static_cast<uint32_t>(i));
        w.F32(v);
        break;
      case WindowForm::kDenseHalf:
        w.U16(eldr::internal::FloatToHalf(v));
        break;
      case WindowForm::kSparseHalf:
        if (v == 0.0f) break;
        w.U16(static_cast<uint16_t>(i));
        w.U16(eldr::internal::FloatToHalf(v));
        break;
    }
  }
  w.F64(entry.decode_work);
  w.U32(Crc32c(w.str()));
  return std::move(w.str());
}

absl::StatusOr<WindowSignature> DecodeWindowSignature(absl::string_view bytes) {
  constexpr absl::string_view kWhat = "window signature";
  constexpr size_t kMinSize = 4 + 4 + 4 + 4 + 8 + 4;
  const uint32_t version = bytes.size() >= 5 ? static_cast<uint8_t>(bytes[4]) : 0;
  absl::StatusOr<absl::string_view> payload =
      CheckFrame(bytes, kSignatureMagic, kWhat, kMinSize, kSignatureEncodingVersion, version);
  if (!payload.ok()) return payload.status();
  Reader r(*payload);
  r.Skip(5);
  uint8_t form = 0;
  uint32_t dim = 0;
  uint32_t n = 0;
  r.U8(&form);
  r.Skip(2);
  r.U32(&dim);
  r.U32(&n);
  if (dim == 0 || dim > kMaxSignatureValues) return absl::DataLossError(absl::StrCat(kWhat, ": dimension ", dim));
  WindowSignature entry;
  entry.signature.assign(dim, 0.0f);
  const bool dense =
      form == static_cast<uint8_t>(WindowForm::kDenseFloat) || form == static_cast<uint8_t>(WindowForm::kDenseHalf);
  const bool half =
      form == static_cast<uint8_t>(WindowForm::kDenseHalf) || form == static_cast<uint8_t>(WindowForm::kSparseHalf);
  if (form > static_cast<uint8_t>(WindowForm::kSparseHalf)) {
    return absl::DataLossError(absl::StrCat(kWhat, ": unknown form ", form));
  }
  if (form == static_cast<uint8_t>(WindowForm::kSparseHalf) && dim > 65536) {
    return absl::DataLossError(absl::StrCat(kWhat, ": 16-bit indices for dimension ", dim));
  }
  const size_t pair_bytes = dense ? (half ? 2 : 4) : (half ? 4 : 8);
  if (dense && n != dim) {
    return absl::DataLossError(absl::StrCat(kWhat, ": dense form with ", n, " of ", dim, " values"));
  }
  if (n > dim || r.remaining() / pair_bytes < n) return Truncated(kWhat, "values");
  int64_t previous = -1;
  for (uint32_t i = 0; i < n; ++i) {
    uint32_t index = i;
    if (!dense) {
      if (half) {
        uint16_t short_index = 0;
        r.U16(&short_index);
        index = short_index;
      } else {
        r.U32(&index);
      }
      if (index >= dim || static_cast<int64_t>(index) <= previous) {
        return absl::DataLossError(absl::StrCat(kWhat, ": sparse index ", index, " out of order or range"));
      }
      previous = index;
    }
    float value = 0;
    if (half) {
      uint16_t bits = 0;
      r.U16(&bits);
      value = eldr::internal::HalfToFloat(bits);
    } else {
      r.F32(&value);
    }
    entry.signature[index] = value;
  }
  if (!r.F64(&entry.decode_work)) return Truncated(kWhat, "decode work");
  if (r.remaining() != 0) {
    return absl::DataLossError(absl::StrCat(kWhat, ": ", r.remaining(), " unexpected bytes before the checksum"));
  }
  for (float v : entry.signature) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError(absl::StrCat(kWhat, ": non-finite value"));
  }
  if (!std::isfinite(entry.decode_work)) return absl::InvalidArgumentError(absl::StrCat(kWhat, ": non-finite work"));
  return entry;
}

}  // namespace eldr::cluster
