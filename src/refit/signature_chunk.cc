// The refit window's compact signature storage (see signature_chunk.h for the encoding and its bound).
#include "refit/signature_chunk.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "core/scorer_kernels.h"

namespace eldr::refit_internal {
namespace {

// |e| never exceeds this, so 2^e and 2^-e are normal floats and every decoded value is exact.
constexpr int kMaxExponent = 105;

}  // namespace

EncodedSignature EncodeSignature(absl::Span<const float> row, EncodeScratch* scratch) {
  const internal::ScorerKernels& kernels = internal::BestKernels();
  const int dim = static_cast<int>(row.size());
  const uint32_t max_bits = kernels.max_magnitude_bits(row.data(), row.size());
  EncodedSignature encoded;
  if (max_bits > 0 && max_bits < 0x7f800000u) {  // a row with Inf or NaN is stored unscaled
    float max_abs;
    std::memcpy(&max_abs, &max_bits, sizeof(max_abs));
    int binary_exponent = 0;
    std::frexp(max_abs, &binary_exponent);  // max_abs in [2^(b - 1), 2^b)
    encoded.exponent = std::clamp(15 - binary_exponent, -kMaxExponent, kMaxExponent);
  }
  const size_t words = BitmapWords(dim);
  scratch->halves.resize(row.size());
  scratch->packed.resize(words + row.size() + 16);
  const size_t non_zero =
      kernels.encode_halves(row.data(), dim, std::ldexp(1.0f, encoded.exponent), scratch->halves.data(),
                            scratch->packed.data(), scratch->packed.data() + words);
  if (words + non_zero >= row.size()) {
    encoded.encoding = RowEncoding::kDense;
    encoded.elements = scratch->halves;
  } else {
    encoded.encoding = RowEncoding::kBitmap;
    encoded.elements = absl::MakeConstSpan(scratch->packed.data(), words + non_zero);
  }
  return encoded;
}

void DecodeSignature(const EncodedSignature& encoded, int dim, float* out) {
  const float unscale = std::ldexp(1.0f, -encoded.exponent);
  const size_t n = static_cast<size_t>(dim);
  if (encoded.encoding == RowEncoding::kDense) {
    internal::HalvesToFloats(encoded.elements.data(), n, out);
    for (size_t i = 0; i < n; ++i) out[i] *= unscale;
    return;
  }
  const size_t words = BitmapWords(dim);
  const size_t non_zero = encoded.elements.size() - words;
  // The non-zero values are converted into the tail of `out`, then expanded forward to their
  // indices (ExpandBitmapFn allows exactly that overlap).
  float* values = out + (n - non_zero);
  internal::HalvesToFloats(encoded.elements.data() + words, non_zero, values);
  internal::BestKernels().expand_bitmap(encoded.elements.data(), dim, values, out);
  for (size_t i = 0; i < n; ++i) out[i] *= unscale;
}

SignatureChunk::SignatureChunk(int dim, size_t capacity_elements, int max_rows)
    : dim_(dim), data_(capacity_elements), rows_(static_cast<size_t>(std::max(max_rows, 1))) {}

size_t SignatureChunk::FootprintBytes(size_t capacity_elements, int max_rows) {
  return sizeof(SignatureChunk) + capacity_elements * sizeof(uint16_t) +
         static_cast<size_t>(std::max(max_rows, 1)) * sizeof(Row);
}

size_t SignatureChunk::footprint_bytes() const {
  return sizeof(SignatureChunk) + data_.capacity() * sizeof(uint16_t) + rows_.capacity() * sizeof(Row);
}

bool SignatureChunk::Append(const EncodedSignature& encoded, absl::Time time, float weight) {
  const size_t elements = encoded.elements.size();
  if (static_cast<size_t>(size_) >= rows_.size() || elements > data_.size() - used_) return false;
  std::copy(encoded.elements.begin(), encoded.elements.end(), data_.begin() + static_cast<ptrdiff_t>(used_));
  Row& row = rows_[static_cast<size_t>(size_)];
  row.time = time;
  row.weight = weight;
  row.offset = static_cast<uint32_t>(used_);
  row.elements = static_cast<uint32_t>(elements);
  row.exponent = static_cast<int16_t>(encoded.exponent);
  row.encoding = encoded.encoding;
  used_ += elements;
  ++size_;
  return true;
}

void SignatureChunk::Clear() {
  used_ = 0;
  size_ = 0;
}

void SignatureChunk::Decode(int r, float* out) const {
  const Row& row = rows_[static_cast<size_t>(r)];
  EncodedSignature encoded;
  encoded.encoding = row.encoding;
  encoded.exponent = row.exponent;
  encoded.elements = absl::MakeConstSpan(data_).subspan(row.offset, row.elements);
  DecodeSignature(encoded, dim_, out);
}

absl::Span<const float> SignatureRows::Read(int begin, int count, std::vector<float>* scratch) const {
  const size_t dim = static_cast<size_t>(dim_);
  scratch->resize(static_cast<size_t>(count) * dim);
  if (count <= 0) return {};
  size_t s = RangeOf(begin);
  for (int i = 0; i < count; ++i) {
    while (begin + i >= starts_[s] + ranges_[s].count) ++s;
    const Range& range = ranges_[s];
    range.chunk->Decode(range.first + (begin + i - starts_[s]), scratch->data() + static_cast<size_t>(i) * dim);
  }
  return absl::MakeConstSpan(scratch->data(), static_cast<size_t>(count) * dim);
}

int SignatureRows::block_rows() const {
  if (block_rows_ > 0) return block_rows_;
  return static_cast<int>(std::max<size_t>(1, kDecodeBlockBytes / (sizeof(float) * std::max(dim_, 1))));
}

void SignatureRows::Add(std::shared_ptr<const SignatureChunk> chunk, int first, int count) {
  if (count <= 0) return;
  starts_.push_back(rows_);
  ranges_.push_back(Range{std::move(chunk), first, count});
  rows_ += count;
}

void SignatureRows::DropOldest(int n) {
  if (n <= 0) return;
  std::vector<Range> ranges = std::move(ranges_);
  const std::vector<int> starts = std::move(starts_);
  ranges_.clear();
  starts_.clear();
  rows_ = 0;
  for (size_t s = 0; s < ranges.size(); ++s) {
    const int skip = std::clamp(n - starts[s], 0, ranges[s].count);
    Add(std::move(ranges[s].chunk), ranges[s].first + skip, ranges[s].count - skip);
  }
}

absl::Time SignatureRows::time(int i) const {
  const size_t s = RangeOf(i);
  return ranges_[s].chunk->time(ranges_[s].first + (i - starts_[s]));
}

std::vector<double> SignatureRows::Weights() const {
  std::vector<double> weights;
  weights.reserve(static_cast<size_t>(rows_));
  for (const Range& range : ranges_) {
    for (int r = range.first; r < range.first + range.count; ++r) weights.push_back(range.chunk->weight(r));
  }
  return weights;
}

size_t SignatureRows::RangeOf(int i) const {
  return static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin()) - 1;
}

}  // namespace eldr::refit_internal
