// The online refit window's storage (private to eldr_refit; include/eldr/refit/refit.h has the
// contract): signatures kept in IEEE half precision, densely or as a bitmap of their non-zero
// entries, whichever is smaller, in fixed-size chunks that are decoded to fp32 only a block at a
// time while a fit reads them.
//
// Encoding of one signature x (dim floats):
//  - a power-of-two row scale 2^e puts max|x_i| in [2^14, 2^15), so every entry at least
//    max|x| * 2^-28 lands in binary16's normal range; the scale is exact and undone exactly on
//    decode;
//  - h_i = binary16(x_i * 2^e), round to nearest even; decoded y_i = float(h_i) * 2^-e;
//  - stored either dense (dim halves) or as a bitmap (ceil(dim / 16) 16-bit words, bit i % 16 of
//    word i / 16 set where h_i is not zero) followed by the non-zero h_i in index order: the
//    bitmap is chosen when it is strictly smaller. Both decode to the same y.
// A row with an infinite or NaN entry is stored unscaled (the fit rejects it anyway).
// Error bound (for 2^-90 <= max|x| <= 2^90, where the scale is exact and never clamped):
// |y_i - x_i| <= max(2^-11 |x_i|, 2^-39 max|x|) for every i, zeros stay zeros. So the transformed
// unit signatures the window keeps lose at most 2^-11 relative in each entry (the norm moves by at
// most 2^-11, well inside the fit's 1e-3 unit check) and a cosine by at most about 2^-10.
//
// Why not index/value pairs: a pair costs two halves per non-zero, the bitmap one half plus one
// bit per entry, so the bitmap is smaller as soon as more than 1/16 of the entries are non-zero;
// a prompt token lights top_k of E experts in every kept layer (8 of 128: 1/16), so the prompt
// signatures the window sees are at least that dense outside masked layers.
//
// Thread-safety: a chunk is appended to under its owner's lock; rows already appended are
// immutable, so other threads may decode rows [0, n) once they have seen size() >= n under that
// lock (see OnlineRefitter::SnapshotWindow), while more rows are appended.
#ifndef ELDR_REFIT_SIGNATURE_CHUNK_H_
#define ELDR_REFIT_SIGNATURE_CHUNK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "eldr/calib/calibration.h"

namespace eldr::refit_internal {

enum class RowEncoding : uint8_t { kDense = 0, kBitmap = 1 };

// One signature encoded (into EncodeScratch's buffers): what SignatureChunk::Append stores.
struct EncodedSignature {
  RowEncoding encoding = RowEncoding::kDense;
  int exponent = 0;                     // e: entries were scaled by 2^e
  absl::Span<const uint16_t> elements;  // dense halves, or bitmap words then non-zero halves
};

// Reusable buffers of EncodeSignature (so that encoding allocates nothing in steady state).
struct EncodeScratch {
  std::vector<uint16_t> halves;  // the dense form
  std::vector<uint16_t> packed;  // the bitmap form
};

// Bitmap words of a dim-entry row.
inline size_t BitmapWords(int dim) { return (static_cast<size_t>(dim) + 15) / 16; }

// Encodes `row` as described above; the result views `scratch`, valid until its next use.
EncodedSignature EncodeSignature(absl::Span<const float> row, EncodeScratch* scratch);

// Decodes `encoded` (of a dim-entry row) into out[0, dim).
void DecodeSignature(const EncodedSignature& encoded, int dim, float* out);

// A fixed-capacity, append-only block of encoded signatures with their observation times.
class SignatureChunk {
 public:
  // Room for `capacity_elements` halves and at most `max_rows` rows; allocated (and touched) here,
  // never again, so a recycled chunk costs the appending thread no allocation.
  SignatureChunk(int dim, size_t capacity_elements, int max_rows);

  int dim() const { return dim_; }
  int size() const { return size_; }
  size_t used_elements() const { return used_; }
  // Bytes this chunk holds (its buffers' capacity), whether or not they are filled.
  size_t footprint_bytes() const;
  // The bytes of a chunk built with these arguments (footprint_bytes() of it).
  static size_t FootprintBytes(size_t capacity_elements, int max_rows);

  // Appends one encoded signature of dim() entries observed at `time`, with its fit weight (the
  // decode work it stands for; positive and finite); false (nothing written) when the chunk has
  // no room for it (rows or elements).
  bool Append(const EncodedSignature& encoded, absl::Time time, float weight = 1.0f);
  // Empties the chunk for reuse (keeps its buffers).
  void Clear();

  absl::Time time(int r) const { return rows_[r].time; }
  float weight(int r) const { return rows_[r].weight; }
  RowEncoding encoding(int r) const { return rows_[r].encoding; }
  // Halves row r occupies (dim() when dense).
  size_t row_elements(int r) const { return rows_[r].elements; }
  // Decodes row r into out[0, dim()).
  void Decode(int r, float* out) const;

 private:
  struct Row {
    absl::Time time;
    uint32_t offset = 0;    // first element in data_
    uint32_t elements = 0;  // elements it occupies
    float weight = 1.0f;
    int16_t exponent = 0;
    RowEncoding encoding = RowEncoding::kDense;
  };

  const int dim_;
  std::vector<uint16_t> data_;  // capacity_elements, the first used_ valid
  std::vector<Row> rows_;       // max_rows, the first size_ valid
  size_t used_ = 0;
  int size_ = 0;
};

// A fit decodes rows a block of at most this many fp32 bytes at a time (at least one row):
// 170 rows of 48 x 128, 630 of 26 x 64. Blocks this large keep the BLAS calls few.
inline constexpr size_t kDecodeBlockBytes = size_t{4} << 20;

// Ranges of rows of chunks, in order, read by a fit as one point set (eldr::PointRows), each
// block decoded into the caller's scratch. Keeps its chunks alive; reads only the rows it was
// given, which must be immutable (appended before the ranges were taken).
class SignatureRows final : public PointRows {
 public:
  // block_rows 0: as many as kDecodeBlockBytes holds.
  explicit SignatureRows(int block_rows = 0) : block_rows_(block_rows) {}

  int rows() const override { return rows_; }
  int dim() const override { return dim_; }
  int block_rows() const override;
  absl::Span<const float> Read(int begin, int count, std::vector<float>* scratch) const override;

  void set_dim(int dim) { dim_ = dim; }
  // Appends rows [first, first + count) of `chunk` (of dim() entries); nothing when count <= 0.
  void Add(std::shared_ptr<const SignatureChunk> chunk, int first, int count);
  // Drops the n oldest rows (all of them when n >= rows()).
  void DropOldest(int n);
  // Observation time of row i.
  absl::Time time(int i) const;
  // The fit weight of every row, in row order.
  std::vector<double> Weights() const;

 private:
  struct Range {
    std::shared_ptr<const SignatureChunk> chunk;
    int first = 0;
    int count = 0;
  };
  // The range holding row i (0 <= i < rows()).
  size_t RangeOf(int i) const;

  int block_rows_;
  std::vector<Range> ranges_;
  std::vector<int> starts_;  // first row of each range
  int rows_ = 0;
  int dim_ = 0;
};

}  // namespace eldr::refit_internal

#endif  // ELDR_REFIT_SIGNATURE_CHUNK_H_
