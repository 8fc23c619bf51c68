// The centroid index: an exact SIMD scorer for small pools, a FAISS-fitted reduced space with exact
// re-scoring for large pools, sgemm for batches. See include/eldr/core/centroid_index.h.
//
// Three ideas carry the speed (measured in docs/benchmarks.md, "Routing core microbenchmarks"):
//  - Column compaction. A column that is zero in every centroid adds nothing to any score. With
//    count_idf signatures every expert that all calibration requests used has IDF weight 0, so its
//    column is zero everywhere (43% of the columns of the bundled DeepSeek-V2-Lite traces). Those
//    columns are dropped at build time and the query is gathered to the kept ones. Exact.
//  - 16-bit centroids with certified refinement. The scan reads bfloat16 rows (half the bytes of
//    fp32, and no conversion instruction: see PackBfloat16Row) or binary16 rows. Each row's
//    16-bit score differs from its exact score by at most a bound known from the query norm and
//    the row's rounding residual (RowStore), so only rows whose 16-bit score is within that bound
//    of the band edge (best - band_tau) can be decided differently than in fp32. When there are
//    such rows, they and the rows near the best are re-scored from an fp32 copy (RefineRows).
//    Band decisions are therefore those of fp32 scoring.
//  - Large pools: the query is projected on the principal axes of the centroids (fitted by
//    faiss::PCAMatrix), every centroid is scored in that reduced space, and the best candidates
//    are re-scored exactly as above.
#include "eldr/core/centroid_index.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "core/centroid_index_internal.h"
#include "core/scorer_kernels.h"
#include "core/signature_kernels.h"
#include "eldr/core/errors.h"
#include "faiss/IndexHNSW.h"
#include "faiss/VectorTransform.h"
#include "faiss/impl/FaissException.h"

namespace eldr {
namespace {

using internal::BestKernels;
using internal::ScorerKernels;

// Largest centroid matrix accepted (rows * dim): 2^28 floats = 1 GiB, far beyond any pool.
constexpr int64_t kMaxCells = int64_t{1} << 28;
// Compaction pays for its per-query gather only when it drops a noticeable share of columns.
constexpr double kCompactWhenKeptBelow = 0.9;

// ---- Aligned storage ----------------------------------------------------------------------------

template <typename T>
struct AlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}  // NOLINT(google-explicit-constructor)
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  // Unsized: clang only declares the sized aligned delete with -fsized-deallocation.
  void deallocate(T* p, size_t /*n*/) { ::operator delete(p, kAlignment); }
  template <typename U>
  bool operator==(const AlignedAllocator<U>&) const {
    return true;
  }
};
template <typename T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

// Row stride (in elements) that keeps every row 64-byte aligned.
template <typename T>
int PaddedStride(int cols) {
  constexpr int kPerLine = 64 / static_cast<int>(sizeof(T));
  return (cols + kPerLine - 1) / kPerLine * kPerLine;
}

// Per-thread scratch: Search is const and runs on many threads at once.
struct Scratch {
  AlignedVector<float> query;      // compacted query (Search), or the scaled kept query (SearchKept)
  AlignedVector<float> projected;  // reduced-space query
  std::vector<float> scores;
  std::vector<float> refined;
  std::vector<float> candidate_scores;
  std::vector<int> ids;
  std::vector<std::pair<float, int>> ranked;
  int ranked_front = 0;                              // ranked[0, ranked_front) are ranked's best (see RankRows)
  std::vector<std::pair<float, int>> rank_sample;    // RankRows' sample of the scores
  std::vector<std::pair<float, int>> select_buffer;  // internal::SelectBest's
  std::vector<char> seen;
  std::vector<int> refine_ids;
  std::vector<const float*> f32_rows;
  std::vector<const uint16_t*> h16_rows;
  std::vector<const int8_t*> i8_rows;
  AlignedVector<uint8_t> query8;    // the quantised query (8-bit scans)
  std::vector<int32_t> dots;        // 8-bit dot products
  std::vector<float> bounds;        // per scanned row: error bound of its scan score (ScanRows)
  std::vector<float> round_bounds;  // large pools: the bounds of every round's candidates
  bool scan_exact = false;          // the last ScanRows scored in fp32: nothing to refine
  bool has_decided = false;         // the last ScanRows had an 8-bit stage: `decided` is valid
  std::vector<char> decided;        // per scanned row: ruled out of the band by the 8-bit stage
  std::vector<int> undecided;       // the others, scored again in 16 bits
  std::vector<float> rescored;
  std::vector<char> round_decided;  // large pools: `decided` of every round's candidates
  int64_t refined_rows = 0;         // rows re-scored in fp32 by this thread (statistics)
  std::vector<float> faiss_distances;
  std::vector<faiss::Index::idx_t> faiss_labels;
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// ---- Column compaction --------------------------------------------------------------------------

class ColumnMap {
 public:
  // Keeps the columns that are non-zero in at least one of `rows` rows of `dim` floats.
  ColumnMap(const float* data, int rows, int dim) : dim_(dim) {
    std::vector<char> used(dim, 0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = data + r * dim;
      for (int i = 0; i < dim; ++i) used[i] |= row[i] != 0.f;
    }
    for (int i = 0; i < dim; ++i) {
      if (used[i]) kept_.push_back(i);
    }
    compact_ = static_cast<double>(kept_.size()) < kCompactWhenKeptBelow * dim;
    if (!compact_) {
      kept_.resize(dim);
      std::iota(kept_.begin(), kept_.end(), 0);
    }
    masks_.assign((dim + 15) / 16, 0);
    for (int i : kept_) masks_[i >> 4] |= static_cast<uint16_t>(1u << (i & 15));
    offsets_.assign(masks_.size(), 0);
    for (size_t c = 1; c < masks_.size(); ++c) {
      offsets_[c] = offsets_[c - 1] + __builtin_popcount(static_cast<unsigned>(masks_[c - 1]));
    }
    selection_ = ColumnSelection{dim_, masks_, offsets_, kept()};
  }
  ColumnMap(const ColumnMap&) = delete;
  ColumnMap& operator=(const ColumnMap&) = delete;

  // The kept columns as a ColumnSelection (views into this map): every column when none is dropped,
  // so that a route decision can take the kept-column path (SearchKept) whatever the centroids.
  const ColumnSelection* selection() const { return &selection_; }

  int dim() const { return dim_; }
  int kept() const { return static_cast<int>(kept_.size()); }
  bool compact() const { return compact_; }

  // The kept columns of one full-dimension vector (build time and batches).
  void Gather(const float* in, float* out) const {
    const int* columns = kept_.data();
    const int n = kept();
    for (int i = 0; i < n; ++i) out[i] = in[columns[i]];
  }

  // The query restricted to the kept columns (`query` itself when nothing is dropped, else its
  // gathered copy in `buffer`) and its norm over those columns.
  struct Prepared {
    const float* data;
    float norm;
    float max = -1;  // >= 0: every value lies in [0, max] (see SearchKept); else unknown
    // The query is data[i] * factor, each product rounded to float (SearchKept's unnormalised
    // values); 1: data is the query. norm and max are the scaled query's. ScaleQuery (or the 8-bit
    // scan, which scales on the way) writes the scaled query to scratch and sets 1.
    float factor = 1.f;
  };
  Prepared Prepare(const float* query, const ScorerKernels& kernels, AlignedVector<float>* buffer) const {
    if (!compact_) {
      float norm2 = 0;
      kernels.dot_rows_f32(&query, 1, query, dim_, &norm2);
      return {query, std::sqrt(std::max(0.f, norm2))};
    }
    if (static_cast<int>(buffer->size()) < kept() + 16) buffer->resize(kept() + 16);
    const float norm2 =
        kernels.gather_columns(query, dim_, masks_.data(), offsets_.data(), kept_.data(), kept(), buffer->data());
    return {buffer->data(), std::sqrt(std::max(0.f, norm2))};
  }

 private:
  int dim_;
  bool compact_ = false;
  std::vector<int> kept_;
  std::vector<uint16_t> masks_;  // bit i % 16 of masks_[i / 16]: column i is kept
  std::vector<int> offsets_;     // kept columns before each 16-column chunk
  ColumnSelection selection_;
};

// ---- Row storage --------------------------------------------------------------------------------

// Rows restricted to the kept columns: fp32 (always, for refinement and batches) and optionally
// a 16-bit copy for the scan, binary16 or paired-layout bfloat16. Rows are 64-byte aligned.
class RowStore {
 public:
  // `half`: also keep a reduced-precision copy in `format` for the scan; with kInt8, an 8-bit copy
  // whose undecided rows are scanned again from a `second_stage` (kBfloat16 or kBinary16) copy.
  RowStore(const float* data, int rows, int dim, const ColumnMap& columns, bool half, HalfFormat format,
           HalfFormat second_stage = HalfFormat::kBfloat16)
      : rows_(rows), cols_(columns.kept()) {
    const int stride32 = PaddedStride<float>(cols_);
    f32_.assign(static_cast<size_t>(rows) * stride32, 0.f);
    f32_rows_.resize(rows);
    for (int r = 0; r < rows; ++r) {
      float* dst = f32_.data() + static_cast<size_t>(r) * stride32;
      columns.Gather(data + static_cast<int64_t>(r) * dim, dst);
      // Subnormal floats (below 1.2e-38) would send every multiply through a microcode assist,
      // ~50x slower; as zeros they move a score by less than 1.2e-38 per column.
      for (int i = 0; i < cols_; ++i) {
        if (std::fabs(dst[i]) < std::numeric_limits<float>::min()) dst[i] = 0.f;
      }
      f32_rows_[r] = dst;
    }
    if (!half) return;
    format_ = format;
    // fp32 accumulation: at most n additions per path, gamma_n = n u / (1 - n u), u = 2^-24.
    const double u = std::ldexp(1.0, -24);
    const double n = internal::AccumulationDepth(cols_);
    gamma_ = n * u / (1 - n * u);
    if (format_ == HalfFormat::kInt8) {
      // The 8-bit scan is a first stage: rows it cannot rule out are scored again from the 16-bit
      // copy (ScanRows), so both are kept.
      BuildInt8(rows);
      format_ = second_stage;
    }
    const int stride16 =
        format_ == HalfFormat::kBfloat16 ? internal::PairedBfloat16Elements(cols_) : PaddedStride<uint16_t>(cols_);
    h16_.assign(static_cast<size_t>(rows) * stride16, 0);
    h16_rows_.resize(rows);
    error_factor_.resize(rows);
    max_error_factor_ = 0;
    const double gamma = gamma_;
    for (int r = 0; r < rows; ++r) {
      uint16_t* dst = h16_.data() + static_cast<size_t>(r) * stride16;
      const float* src = f32_rows_[r];
      double residual2 = 0, norm2 = 0;
      if (format_ == HalfFormat::kBfloat16) {
        internal::PackBfloat16Row(src, cols_, dst);
        for (int i = 0; i < cols_; ++i) {
          const double d = static_cast<double>(internal::PairedBfloat16At(dst, i)) - src[i];
          residual2 += d * d;
          norm2 += static_cast<double>(src[i]) * src[i];
        }
      } else {
        internal::FloatsToHalves(src, cols_, dst);
        for (int i = 0; i < cols_; ++i) {
          const double d = static_cast<double>(internal::HalfToFloat(dst[i])) - src[i];
          residual2 += d * d;
          norm2 += static_cast<double>(src[i]) * src[i];
        }
      }
      h16_rows_[r] = dst;
      // |16-bit score - exact| + |fp32 score - exact| <= |q| * factor, where
      //  - the rounding to 16 bits adds exactly q . (h - c), at most |q| |h - c| (Cauchy-Schwarz;
      //    the residual norm is computed here exactly, subnormals included);
      //  - each of the two fp32 accumulations errs by at most gamma_n * sum |q_i x_i|
      //    <= gamma_n |q| |x|, with |h| <= |c| + |h - c|.
      // 2% slack covers the rounding of the factor itself.
      const double residual = std::sqrt(residual2);
      const double norm = std::sqrt(norm2);
      error_factor_[r] = static_cast<float>((residual + gamma * (2 * norm + residual)) * 1.02);
      max_error_factor_ = std::max(max_error_factor_, error_factor_[r]);
    }
  }

  // Rows longer than this are never scanned in 8 bits: padded * 255 * 127 must fit the int32
  // sums of DotRowsU8S8Fn.
  static constexpr int kMaxInt8Columns = 65536 - 64;

  int rows() const { return rows_; }
  int cols() const { return cols_; }
  // Whether the scan reads a reduced-precision copy (16- or 8-bit) whose scores need bounds.
  bool half() const { return !h16_rows_.empty() || !i8_rows_.empty(); }
  bool int8() const { return !i8_rows_.empty(); }
  // kInt8 for an 8-bit first stage (then ScanHalf reads bfloat16), else the 16-bit format.
  HalfFormat format() const { return int8() ? HalfFormat::kInt8 : format_; }
  // Error bound of row r's 16-bit score per unit of query norm (see the constructor).
  float error_factor(int r) const { return error_factor_[r]; }
  float max_error_factor() const { return max_error_factor_; }
  const float* const* f32_rows() const { return f32_rows_.data(); }
  const uint16_t* const* h16_rows() const { return h16_rows_.data(); }
  const float* f32_row(int r) const { return f32_rows_[r]; }
  const uint16_t* h16_row(int r) const { return h16_rows_[r]; }

  // 8-bit scan of rows `ids` (null: 0..n-1) against `q` (cols() floats, norm q_norm): scores and
  // their error bounds (see BuildInt8) into `scores` and scratch->bounds. Returns false when the
  // query cannot be quantised (a negative or non-finite value): nothing is written then.
  // The query is q[i] * factor; `scaled` (cols() floats) receives those products when not null
  // (the later stages read them).
  bool ScanInt8(const ScorerKernels& kernels, const float* q, float factor, float* scaled, float q_norm, float q_max,
                const int* ids, int n, Scratch* scratch, float* scores) const {
    const int padded = PaddedStride<int8_t>(cols_);
    if (static_cast<int>(scratch->query8.size()) < padded) scratch->query8.resize(padded);
    float q_scale = 0, residual2 = 0, quantised2 = 0;
    if (!kernels.quantise_query(q, factor, cols_, padded, kernels.int8_query_max, q_max, scratch->query8.data(), scaled,
                                &q_scale, &residual2, &quantised2)) {
      return false;
    }
    scratch->i8_rows.resize(n);
    for (int i = 0; i < n; ++i) scratch->i8_rows[i] = i8_rows_[ids == nullptr ? i : ids[i]];
    scratch->dots.resize(n);
    kernels.dot_rows_u8s8(scratch->i8_rows.data(), n, scratch->query8.data(), padded, scratch->dots.data());
    const double residual = std::sqrt(std::max(0.f, residual2));
    const double quantised = std::sqrt(std::max(0.f, quantised2));
    scratch->bounds.resize(n);
    for (int i = 0; i < n; ++i) {
      const int r = ids == nullptr ? i : ids[i];
      scores[i] = static_cast<float>(scratch->dots[i]) * (q_scale * i8_scale_[r]);
      // |8-bit score - exact| + |fp32 score - exact| <= (see BuildInt8)
      //   |q'| |e_r| + |q' - q| |c_r|      (the two quantisations, Cauchy-Schwarz)
      //   + 3 u |q'| |c'_r|                (int32 -> float and two products, each rounding once)
      //   + gamma_n |q| |c_r|              (the fp32 re-scoring's accumulation),
      // with 2% slack for the rounding of the bound itself.
      scratch->bounds[i] =
          static_cast<float>((quantised * i8_residual_[r] + residual * f32_norm_[r] +
                              3 * std::ldexp(1.0, -24) * quantised * i8_norm_[r] + gamma_ * q_norm * f32_norm_[r]) *
                             1.02);
    }
    return true;
  }

  // Scores n rows given by pointers from the 16-bit copy.
  void ScanHalf(const ScorerKernels& kernels, const uint16_t* const* rows, int n, const float* q, float* scores) const {
    if (format_ == HalfFormat::kBfloat16) {
      kernels.dot_rows_bf16(rows, n, q, cols_, scores);
    } else {
      kernels.dot_rows_f16(rows, n, q, cols_, scores);
    }
  }

 private:
  int rows_;
  int cols_;
  HalfFormat format_ = HalfFormat::kBfloat16;
  // The 8-bit copy: row r is i8_rows_[r] (values in [-127, 127], zero-padded to a multiple of 64),
  // standing for i8_scale_[r] * values. i8_residual_[r] = |scaled values - c_r|, i8_norm_[r] =
  // |scaled values|, f32_norm_[r] = |c_r| (computed in double at build time).
  void BuildInt8(int rows) {
    const int padded = PaddedStride<int8_t>(cols_);
    i8_.assign(static_cast<size_t>(rows) * padded, 0);
    i8_rows_.resize(rows);
    i8_scale_.resize(rows);
    i8_residual_.resize(rows);
    i8_norm_.resize(rows);
    f32_norm_.resize(rows);
    for (int r = 0; r < rows; ++r) {
      const float* src = f32_rows_[r];
      int8_t* dst = i8_.data() + static_cast<size_t>(r) * padded;
      float largest = 0;
      for (int i = 0; i < cols_; ++i) largest = std::max(largest, std::fabs(src[i]));
      const float scale = largest > 0 ? largest / 127.f : 1.f;
      double residual2 = 0, norm2 = 0, scaled2 = 0;
      for (int i = 0; i < cols_; ++i) {
        const int level = std::clamp(static_cast<int>(std::nearbyint(src[i] / scale)), -127, 127);
        dst[i] = static_cast<int8_t>(level);
        const double value = static_cast<double>(level) * scale;
        residual2 += (value - src[i]) * (value - src[i]);
        norm2 += static_cast<double>(src[i]) * src[i];
        scaled2 += value * value;
      }
      i8_rows_[r] = dst;
      i8_scale_[r] = scale;
      i8_residual_[r] = std::sqrt(residual2);
      i8_norm_[r] = std::sqrt(scaled2);
      f32_norm_[r] = std::sqrt(norm2);
    }
  }

  double gamma_ = 0;
  AlignedVector<int8_t> i8_;
  std::vector<const int8_t*> i8_rows_;
  std::vector<float> i8_scale_;
  std::vector<double> i8_residual_, i8_norm_, f32_norm_;
  std::vector<float> error_factor_;
  float max_error_factor_ = 0;
  AlignedVector<float> f32_;
  AlignedVector<uint16_t> h16_;
  std::vector<const float*> f32_rows_;
  std::vector<const uint16_t*> h16_rows_;
};

// Where a kept query of `cols` values is scaled to: scratch->query (Search uses it for its
// compacted query, SearchKept for the scaled one).
float* ScaledQueryBuffer(int cols, Scratch* scratch) {
  if (static_cast<int>(scratch->query.size()) < cols + 16) scratch->query.resize(cols + 16);
  return scratch->query.data();
}

// Writes a prepared query with a factor other than 1 (SearchKept's unnormalised values) scaled
// into ScaledQueryBuffer, and makes `query` point there with factor 1.
void ScaleQuery(int cols, ColumnMap::Prepared* query, Scratch* scratch) {
  if (query->factor == 1.f) return;
  float* scaled = ScaledQueryBuffer(cols, scratch);
  internal::BestSignatureKernels().scale(query->data, static_cast<size_t>(cols), query->factor, scaled);
  query->data = scaled;
  query->factor = 1.f;
}

// Scans rows `ids` (n of them; null means rows 0..n-1) of `store` against the prepared query
// (norm q_norm): reduced-precision scores with their error bounds in scratch->bounds when the
// store has a 16- or 8-bit copy, fp32 scores otherwise (and scratch->scan_exact). A query with a
// factor is scaled first (ScaleQuery; the 8-bit stage does it on the way): on return `query` has
// factor 1.
//
// With an 8-bit copy the scan has two stages. The 8-bit scores s8_j come with bounds b8_j; m8 =
// max_j (s8_j - b8_j) is at most the exact best score. A row with s8_j + b8_j < m8 - band_tau - B16
// (B16: the largest bfloat16 bound) lies below the band edge by more than any later score of the
// best row can err, so it keeps its 8-bit score and is marked decided (scratch->decided; RefineRows
// skips it); the others, the best among them, are scored again in bfloat16 with their bounds.
void ScanRows(const RowStore& store, const ScorerKernels& kernels, ColumnMap::Prepared* query, const int* ids, int n,
              float band_tau, Scratch* scratch, float* scores) {
  const int cols = store.cols();
  const float q_norm = query->norm;
  scratch->scan_exact = false;
  scratch->has_decided = false;
  if (store.int8()) {
    float* scaled = query->factor != 1.f ? ScaledQueryBuffer(cols, scratch) : nullptr;
    if (store.ScanInt8(kernels, query->data, query->factor, scaled, q_norm, query->max, ids, n, scratch, scores)) {
      if (scaled != nullptr) {
        query->data = scaled;
        query->factor = 1.f;
      }
      const float* q = query->data;
      float floor = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < n; ++i) floor = std::max(floor, scores[i] - scratch->bounds[i]);
      const float out_below = floor - band_tau - q_norm * store.max_error_factor();
      scratch->decided.assign(n, 0);
      scratch->h16_rows.clear();
      scratch->undecided.clear();
      for (int i = 0; i < n; ++i) {
        if (scores[i] + scratch->bounds[i] < out_below) {
          scratch->decided[i] = 1;
        } else {
          scratch->undecided.push_back(i);
          scratch->h16_rows.push_back(store.h16_row(ids == nullptr ? i : ids[i]));
        }
      }
      scratch->has_decided = true;
      const int m = static_cast<int>(scratch->undecided.size());
      scratch->rescored.resize(m);
      store.ScanHalf(kernels, scratch->h16_rows.data(), m, q, scratch->rescored.data());
      for (int k = 0; k < m; ++k) {
        const int i = scratch->undecided[k];
        scores[i] = scratch->rescored[k];
        scratch->bounds[i] = q_norm * store.error_factor(ids == nullptr ? i : ids[i]);
      }
      return;
    }
  }
  ScaleQuery(cols, query, scratch);
  const float* q = query->data;
  if (!store.half() || store.int8()) {  // fp32 rows, or a query the 8-bit scan cannot take
    scratch->scan_exact = true;
    scratch->bounds.assign(n, 0.f);
    if (ids == nullptr) {
      kernels.dot_rows_f32(store.f32_rows(), n, q, cols, scores);
      return;
    }
    scratch->f32_rows.resize(n);
    for (int i = 0; i < n; ++i) scratch->f32_rows[i] = store.f32_row(ids[i]);
    kernels.dot_rows_f32(scratch->f32_rows.data(), n, q, cols, scores);
    return;
  }
  scratch->bounds.resize(n);
  for (int i = 0; i < n; ++i) scratch->bounds[i] = q_norm * store.error_factor(ids == nullptr ? i : ids[i]);
  if (ids == nullptr) {
    store.ScanHalf(kernels, store.h16_rows(), n, q, scores);
    return;
  }
  scratch->h16_rows.resize(n);
  for (int i = 0; i < n; ++i) scratch->h16_rows[i] = store.h16_row(ids[i]);
  store.ScanHalf(kernels, scratch->h16_rows.data(), n, q, scores);
}

// After ScanRows with reduced-precision scores: re-scores in fp32 what is needed for every row to
// fall on the same side of the band edge as with fp32 scores. Row j's scan score is within b_j =
// scratch->bounds[j] of its exact score (and the fp32 score too, the bound covers both), B = max
// b_j, m is the best scan score, tau = band_tau and e = m - tau the scan's edge (the fp32 edge is
// within B of it):
//  - a row more than b_j + B from e is decided: its fp32 score lies on the same side of the fp32
//    edge. When every row is, nothing is re-scored (the common case) and every score is within
//    b_j of exact.
//  - otherwise the rows within b_j + 2B of e are re-scored, and so are the rows with score
//    >= m - 2B: the true best row is among them (its scan score is >= its exact score - B >=
//    m - 2B) and every other row's scan score is below the fp32 score of the best, so the best
//    returned score, and the edge the caller derives from it, are those of fp32 scoring (the extra
//    B covers the edge moving from e to the fp32 one).
void RefineRows(const RowStore& store, const ScorerKernels& kernels, const float* q, const int* ids, int n,
                float band_tau, Scratch* scratch, float* scores) {
  if (scratch->scan_exact || n == 0) return;
  const float* bounds = scratch->bounds.data();
  // Rows the 8-bit stage decided (see ScanRows) take no part.
  const bool has_decided = scratch->has_decided;
  const char* decided = scratch->decided.data();
  auto open = [&](int i) { return !has_decided || decided[i] == 0; };
  float max_bound = 0;
  float best = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) {
    if (!open(i)) continue;
    best = std::max(best, scores[i]);
    max_bound = std::max(max_bound, bounds[i]);
  }
  const float edge = best - band_tau;
  // NaN scores (a non-finite query) compare false everywhere: they count as near the edge and
  // are re-scored, harmlessly.
  bool any_near_edge = false;
  for (int i = 0; i < n && !any_near_edge; ++i) {
    any_near_edge = open(i) && !(std::fabs(scores[i] - edge) > bounds[i] + max_bound);
  }
  if (!any_near_edge) return;
  const float top_floor = best - 2 * max_bound;
  scratch->refine_ids.clear();
  for (int i = 0; i < n; ++i) {
    if (!open(i)) continue;
    if (!(scores[i] < top_floor) || !(std::fabs(scores[i] - edge) > bounds[i] + 2 * max_bound)) {
      scratch->refine_ids.push_back(i);
    }
  }
  const int m = static_cast<int>(scratch->refine_ids.size());
  scratch->refined_rows += m;
  scratch->f32_rows.resize(m);
  for (int k = 0; k < m; ++k) {
    const int i = scratch->refine_ids[k];
    scratch->f32_rows[k] = store.f32_row(ids == nullptr ? i : ids[i]);
  }
  scratch->refined.resize(m);
  kernels.dot_rows_f32(scratch->f32_rows.data(), m, q, store.cols(), scratch->refined.data());
  for (int k = 0; k < m; ++k) scores[scratch->refine_ids[k]] = scratch->refined[k];
}

// SearchKept's argument check: the query holds the index's kept columns.
absl::Status CheckKeptQuery(const ColumnMap& columns, absl::Span<const float> kept_query) {
  const ColumnSelection* selection = columns.selection();
  if (static_cast<int64_t>(kept_query.size()) < int64_t{selection->kept} + 16) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("kept query has %d values, the centroid index keeps %d columns (plus 16 of "
                                        "room)",
                                        kept_query.size(), selection->kept));
  }
  return absl::OkStatus();
}

absl::Status CheckQuery(absl::Span<const float> query, int dim) {
  if (static_cast<int64_t>(query.size()) != dim) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("query has %d values, the centroid index has dimension %d", query.size(), dim));
  }
  return absl::OkStatus();
}

absl::Status CheckBatch(absl::Span<const float> queries, int n, absl::Span<float> scores, int rows, int dim) {
  if (n < 0) return InvalidInput(RejectReason::kGeometry, absl::StrCat("negative batch size ", n));
  if (static_cast<int64_t>(queries.size()) != static_cast<int64_t>(n) * dim) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("batch of %d queries of dimension %d needs %d values, got %d", n, dim,
                                        static_cast<int64_t>(n) * dim, queries.size()));
  }
  if (static_cast<int64_t>(scores.size()) != static_cast<int64_t>(n) * rows) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("batch of %d queries against %d rows needs %d scores, got %d", n, rows,
                                        static_cast<int64_t>(n) * rows, scores.size()));
  }
  return absl::OkStatus();
}

// Batched exact scores through sgemm over the kept columns (queries gathered first when columns
// were dropped).
absl::Status ScoreBatchCompacted(const RowStore& store, const ColumnMap& columns, absl::Span<const float> queries,
                                 int n, absl::Span<float> scores) {
  ELDR_RETURN_IF_ERROR(CheckBatch(queries, n, scores, store.rows(), columns.dim()));
  if (n == 0) return absl::OkStatus();
  const int cols = store.cols();
  const int stride = PaddedStride<float>(cols);
  const float* b = store.f32_row(0);
  if (!columns.compact()) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, store.rows(), cols, 1.f, queries.data(), cols, b, stride,
                0.f, scores.data(), store.rows());
    return absl::OkStatus();
  }
  std::vector<float> gathered(static_cast<size_t>(n) * cols);
  for (int i = 0; i < n; ++i) {
    columns.Gather(queries.data() + static_cast<int64_t>(i) * columns.dim(),
                   gathered.data() + static_cast<int64_t>(i) * cols);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, store.rows(), cols, 1.f, gathered.data(), cols, b, stride,
              0.f, scores.data(), store.rows());
  return absl::OkStatus();
}

// Whether the scan kernels are the portable ones (no AVX2: ELDR_SIMD=scalar or an old CPU). Their
// 16- and 8-bit scans decode one value at a time, 11-15x slower than their fp32 scan (48 x 128,
// K = 16: fp32 8.2 us, bfloat16 124 us, binary16 90 us, int8 45 us), so kAuto scans fp32 there.
bool PortableKernelsOnly() { return BestKernels().level == internal::SimdLevel::kScalar; }

// ---- Exact index --------------------------------------------------------------------------------

class ExactIndex final : public CentroidIndex {
 public:
  ExactIndex(const float* centroids, int rows, int dim, const CentroidIndexOptions& options)
      : dim_(dim),
        band_tau_(static_cast<float>(options.band_tau)),
        columns_(centroids, rows, dim),
        store_(centroids, rows, dim, columns_, ScanInHalf(options, columns_.kept()),
               ScanFormat(options, rows, columns_.kept())) {}

  // kAuto: the 8-bit first stage from kInt8MinRows rows on, where the CPU has vector integer dot
  // products (AVX2 or AVX-512), else bfloat16 (see kShortRowColumns for when no reduced copy is
  // scanned at all). kInt8 rows too long for the int32 sums fall back to bfloat16. Measured with
  // eldr-microbench on 48 x 128 (docs/benchmarks.md): with AVX-512 VNNI 8 bits is 7-8% faster at
  // 16 rows (2.13-2.19 against 2.32-2.40 us, 2026-12-06; the two tied on 2026-12-01) and 17-19%
  // slower at 8; with AVX2 it is 13% faster at 16 and 11% slower at 8.
  static constexpr int kInt8MinRows = 16;
  static HalfFormat ScanFormat(const CentroidIndexOptions& options, int rows, int kept_columns) {
    if (options.half_format == HalfFormat::kAuto) {
      const bool vector_int8 = static_cast<int>(BestKernels().level) >= static_cast<int>(internal::SimdLevel::kAvx2);
      return vector_int8 && rows >= kInt8MinRows && kept_columns <= RowStore::kMaxInt8Columns ? HalfFormat::kInt8
                                                                                              : HalfFormat::kBfloat16;
    }
    if (options.half_format == HalfFormat::kInt8 && kept_columns > RowStore::kMaxInt8Columns) {
      return HalfFormat::kBfloat16;
    }
    return options.half_format;
  }

  // kAuto: rows shorter than this many kept columns (8 KB in fp32) are scanned in fp32. Measured
  // (docs/benchmarks.md): for 26 x 64 signatures (~950 kept columns) the fp32 scan beats both
  // 16-bit scans at every pool size, for 48 x 128 (~4,500) bfloat16 wins from K = 16 on.
  static constexpr int kShortRowColumns = 2048;
  static bool ScanInHalf(const CentroidIndexOptions& options, int kept_columns) {
    if (!options.half_precision) return false;
    if (options.half_format != HalfFormat::kAuto) return true;
    return kept_columns >= kShortRowColumns && !PortableKernelsOnly();
  }

  int rows() const override { return store_.rows(); }
  int dim() const override { return dim_; }
  absl::string_view kind() const override {
    if (!store_.half()) return "exact";
    switch (store_.format()) {
      case HalfFormat::kInt8:
        return "exact_int8";
      case HalfFormat::kBinary16:
        return "exact_fp16";
      default:
        return "exact_bf16";
    }
  }

  absl::Status Search(absl::Span<const float> query, std::vector<ScoredRow>* out) const override {
    ELDR_RETURN_IF_ERROR(CheckQuery(query, dim_));
    Scratch& scratch = ThreadScratch();
    const ColumnMap::Prepared q = columns_.Prepare(query.data(), BestKernels(), &scratch.query);
    SearchPrepared(q, &scratch, out);
    return absl::OkStatus();
  }

  const ColumnSelection* kept_columns() const override { return columns_.selection(); }

  absl::Status SearchKept(absl::Span<const float> kept_values, float value_scale, float kept_norm, float kept_max,
                          std::vector<ScoredRow>* out) const override {
    ELDR_RETURN_IF_ERROR(CheckKeptQuery(columns_, kept_values));
    SearchPrepared(ColumnMap::Prepared{kept_values.data(), kept_norm, kept_max, value_scale}, &ThreadScratch(), out);
    return absl::OkStatus();
  }

  absl::Status ScoreBatch(absl::Span<const float> queries, int n, absl::Span<float> scores) const override {
    return ScoreBatchCompacted(store_, columns_, queries, n, scores);
  }

 private:
  // Scores the prepared (kept-column) query against every row.
  void SearchPrepared(ColumnMap::Prepared q, Scratch* scratch, std::vector<ScoredRow>* out) const {
    const ScorerKernels& kernels = BestKernels();
    const int n = store_.rows();
    scratch->scores.resize(n);
    ScanRows(store_, kernels, &q, nullptr, n, band_tau_, scratch, scratch->scores.data());
    RefineRows(store_, kernels, q.data, nullptr, n, band_tau_, scratch, scratch->scores.data());
    out->resize(n);
    for (int r = 0; r < n; ++r) (*out)[r] = ScoredRow{r, scratch->scores[r]};
  }

  int dim_;
  float band_tau_;
  ColumnMap columns_;
  RowStore store_;
};

// ---- Large pools: FAISS-fitted reduced space ----------------------------------------------------

// Runs `fn` and turns every exception (FAISS throws faiss::FaissException, std::bad_alloc, ...)
// into an INTERNAL status naming `what`.
template <typename Fn>
absl::Status CatchFaiss(absl::string_view what, Fn&& fn) {
  try {
    fn();
  } catch (const faiss::FaissException& e) {
    return absl::InternalError(absl::StrCat(what, ": FAISS error: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(what, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, ": unknown exception"));
  }
  return absl::OkStatus();
}

// FAISS wraps every search in `#pragma omp parallel`, even for a single query, and each thread of
// the team allocates its own visited table: pure overhead for one query. One thread for the
// duration of the call, restored afterwards so the caller's OpenMP setting is untouched.
class SingleOmpThread {
 public:
  SingleOmpThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleOmpThread() { omp_set_num_threads(saved_); }
  SingleOmpThread(const SingleOmpThread&) = delete;
  SingleOmpThread& operator=(const SingleOmpThread&) = delete;

 private:
  int saved_;
};

// Candidates come from the inner products y . a_j in the PCA space, where y = A q is the projected
// query and a_j = A (c_j - mean) the projected centred centroids. Then
//   q . c_j = q . mean + y . a_j + q . r_j,
// r_j being the part of c_j - mean outside the kept principal axes: q . mean is the same for every
// row, so y . a_j ranks the rows up to the residuals. The query is deliberately not centred (as an
// IndexPreTransform would do): centring adds -(A mean) . a_j, a bias that differs per row.
class ReducedIndex final : public CentroidIndex {
 public:
  static absl::StatusOr<std::unique_ptr<ReducedIndex>> Create(const float* centroids, int rows, int dim,
                                                              const CentroidIndexOptions& options) {
    auto index = std::unique_ptr<ReducedIndex>(new ReducedIndex(centroids, rows, dim, options));
    ELDR_RETURN_IF_ERROR(index->Fit());
    return index;
  }

  int rows() const override { return store_.rows(); }
  int dim() const override { return dim_; }
  absl::string_view kind() const override { return hnsw_ ? "faiss_pca_hnsw" : "faiss_pca_flat"; }

  absl::Status Search(absl::Span<const float> query, std::vector<ScoredRow>* out) const override {
    ELDR_RETURN_IF_ERROR(CheckQuery(query, dim_));
    Scratch& scratch = ThreadScratch();
    return SearchPrepared(columns_.Prepare(query.data(), BestKernels(), &scratch.query), &scratch, out);
  }

  const ColumnSelection* kept_columns() const override { return columns_.selection(); }

  absl::Status SearchKept(absl::Span<const float> kept_values, float value_scale, float kept_norm, float kept_max,
                          std::vector<ScoredRow>* out) const override {
    ELDR_RETURN_IF_ERROR(CheckKeptQuery(columns_, kept_values));
    Scratch& scratch = ThreadScratch();
    // Every stage reads the query: scaled once, first.
    ColumnMap::Prepared prepared{kept_values.data(), kept_norm, kept_max, value_scale};
    ScaleQuery(store_.cols(), &prepared, &scratch);
    return SearchPrepared(prepared, &scratch, out);
  }

  absl::Status ScoreBatch(absl::Span<const float> queries, int n, absl::Span<float> scores) const override {
    return ScoreBatchCompacted(store_, columns_, queries, n, scores);
  }

 private:
  // The search proper, on the prepared (kept-column) query.
  absl::Status SearchPrepared(const ColumnMap::Prepared& prepared, Scratch* scratch_ptr,
                              std::vector<ScoredRow>* out) const {
    Scratch& scratch = *scratch_ptr;
    const ScorerKernels& kernels = BestKernels();
    const float* q = prepared.data;
    const int rows = store_.rows();

    // Project: y = A q, one dot product per principal axis.
    const int reduced = reduced_dims_;
    if (static_cast<int>(scratch.projected.size()) < reduced_stride_) {
      scratch.projected.resize(reduced_stride_);
    }
    float* y = scratch.projected.data();
    std::fill(y, y + reduced_stride_, 0.f);
    if (!ProjectInt8(kernels, prepared, &scratch, y)) {
      kernels.dot_rows_f32(axes_f32_rows_.data(), reduced, q, store_.cols(), y);
    }

    // Candidates in the reduced space, the best first, in rounds: `candidates_` first; then, as long
    // as the lower half (by reduced score) of what was fetched still reaches into the band, twice
    // as many, up to max_candidates_. A large band thus costs proportionally more instead of
    // being cut at a fixed count.
    int fetched = 0;
    int want = candidates_;
    int scored = 0;
    scratch.candidate_scores.clear();
    if (!hnsw_) {
      scratch.scores.resize(rows);
      kernels.accumulate_panels(reduced_panels_.data(), reduced, rows, y, scratch.scores.data());
      RankRows(scratch.scores.data(), rows, std::min({rows, max_candidates_, 2 * candidates_}), &scratch);
    }
    scratch.ids.clear();
    float best = -std::numeric_limits<float>::infinity();
    std::vector<float>& round_bounds = scratch.round_bounds;
    round_bounds.clear();
    std::vector<char>& round_decided = scratch.round_decided;
    round_decided.clear();
    bool any_exact = false;
    while (true) {
      if (hnsw_) {
        ELDR_RETURN_IF_ERROR(SearchHnsw(y, want, &scratch));
      } else {
        SelectNext(fetched, want, scratch.ranked_front, &scratch);
        for (int k = fetched; k < want; ++k) scratch.ids.push_back(scratch.ranked[k].second);
      }
      fetched = static_cast<int>(scratch.ids.size());
      // Score the new candidates (HNSW with a larger k returns the earlier ones first).
      scratch.candidate_scores.resize(fetched);
      ColumnMap::Prepared scanned = prepared;  // factor 1 (SearchKept scaled it): ScanRows keeps it
      ScanRows(store_, kernels, &scanned, scratch.ids.data() + scored, fetched - scored, band_tau_, &scratch,
               scratch.candidate_scores.data() + scored);
      // Bounds and 8-bit decisions accumulate over the rounds, in candidate order (RefineRows
      // reads them all).
      round_bounds.insert(round_bounds.end(), scratch.bounds.begin(), scratch.bounds.end());
      if (scratch.has_decided) {
        round_decided.insert(round_decided.end(), scratch.decided.begin(), scratch.decided.end());
      } else {
        round_decided.resize(round_decided.size() + (fetched - scored), 0);
      }
      any_exact |= scratch.scan_exact;
      for (int k = scored; k < fetched; ++k) best = std::max(best, scratch.candidate_scores[k]);
      scored = fetched;
      if (fetched >= std::min(rows, max_candidates_) || fetched < want) break;
      bool band_continues = false;
      for (int k = fetched / 2; k < fetched; ++k) {
        band_continues |= scratch.candidate_scores[k] >= best - band_tau_;
      }
      if (!band_continues) break;
      want = std::min({2 * want, rows, max_candidates_});
    }

    // Exact decisions at full dimension.
    float* exact = scratch.candidate_scores.data();
    // A round scanned in fp32 (a query the 8-bit scan cannot take) scanned them all in fp32.
    scratch.scan_exact = any_exact;
    scratch.has_decided = true;
    scratch.bounds.swap(round_bounds);
    scratch.decided.swap(round_decided);
    RefineRows(store_, kernels, q, scratch.ids.data(), fetched, band_tau_, &scratch, exact);
    scratch.bounds.swap(round_bounds);
    scratch.decided.swap(round_decided);
    out->resize(fetched);
    for (int k = 0; k < fetched; ++k) (*out)[k] = ScoredRow{scratch.ids[k], exact[k]};
    return absl::OkStatus();
  }

  ReducedIndex(const float* centroids, int rows, int dim, const CentroidIndexOptions& options)
      : dim_(dim),
        band_tau_(static_cast<float>(options.band_tau)),
        columns_(centroids, rows, dim),
        store_(centroids, rows, dim, columns_, CandidatesInHalf(options), CandidateFormat(options, columns_.kept()),
               HalfFormat::kBinary16),
        options_(options) {}

  // kAuto with the portable kernels: fp32 (see PortableKernelsOnly).
  static bool CandidatesInHalf(const CentroidIndexOptions& options) {
    return options.half_precision && (options.half_format != HalfFormat::kAuto || !PortableKernelsOnly());
  }
  // kAuto: binary16 (see CentroidIndexOptions::half_format).
  static HalfFormat CandidateFormat(const CentroidIndexOptions& options, int kept_columns) {
    if (options.half_format == HalfFormat::kAuto) return HalfFormat::kBinary16;
    if (options.half_format == HalfFormat::kInt8 && kept_columns > RowStore::kMaxInt8Columns) {
      return HalfFormat::kBinary16;
    }
    return options.half_format;
  }

  absl::Status Fit() {
    const int rows = store_.rows();
    const int cols = store_.cols();
    const int dims = options_.reduced_dims > 0 ? options_.reduced_dims : std::clamp(rows / 16, 32, 64);
    const int candidates = options_.candidates > 0 ? options_.candidates : std::clamp(rows / 20, 32, 64);
    reduced_dims_ = std::max(1, std::min({dims, rows, cols}));
    candidates_ = std::max(1, std::min(candidates, rows));
    max_candidates_ = std::max(candidates_, std::min(options_.max_candidates, rows));
    reduced_stride_ = PaddedStride<float>(reduced_dims_);

    // Dense compacted copy for FAISS.
    std::vector<float> dense(static_cast<size_t>(rows) * cols);
    for (int r = 0; r < rows; ++r) {
      std::memcpy(dense.data() + static_cast<size_t>(r) * cols, store_.f32_row(r), sizeof(float) * cols);
    }
    std::vector<float> projected(static_cast<size_t>(rows) * reduced_dims_);
    std::vector<float> axes;
    ELDR_RETURN_IF_ERROR(CatchFaiss("PCA fit on the centroids", [&] {
      faiss::PCAMatrix pca(cols, reduced_dims_, /*eigen_power=*/0.f, /*random_rotation=*/false);
      pca.train(rows, dense.data());
      pca.apply_noalloc(rows, dense.data(), projected.data());
      axes = pca.A;
    }));
    if (axes.size() != static_cast<size_t>(reduced_dims_) * cols) {
      return absl::InternalError(
          absl::StrFormat("PCA fit returned a %d-value matrix, expected %d x %d", axes.size(), reduced_dims_, cols));
    }

    // Principal axes as rows: fp32, and 8-bit (per-axis scale) when the centroids have a reduced-
    // precision copy. The axes only choose candidates, so their precision reaches no decision;
    // 8 bits read a quarter of the bytes, and the projection was a sixth of a K = 1024 decision.
    axes_f32_.assign(static_cast<size_t>(reduced_dims_) * PaddedStride<float>(cols), 0.f);
    for (int k = 0; k < reduced_dims_; ++k) {
      float* dst = axes_f32_.data() + static_cast<size_t>(k) * PaddedStride<float>(cols);
      std::memcpy(dst, axes.data() + static_cast<size_t>(k) * cols, sizeof(float) * cols);
      axes_f32_rows_.push_back(dst);
    }
    if (CandidatesInHalf(options_) && cols <= RowStore::kMaxInt8Columns) {
      const int padded = PaddedStride<int8_t>(cols);
      axes_i8_.assign(static_cast<size_t>(reduced_dims_) * padded, 0);
      axes_i8_scale_.resize(reduced_dims_);
      for (int k = 0; k < reduced_dims_; ++k) {
        const float* axis = axes_f32_rows_[k];
        int8_t* dst = axes_i8_.data() + static_cast<size_t>(k) * padded;
        float largest = 0;
        for (int i = 0; i < cols; ++i) largest = std::max(largest, std::fabs(axis[i]));
        const float scale = largest > 0 ? largest / 127.f : 1.f;
        for (int i = 0; i < cols; ++i) {
          dst[i] = static_cast<int8_t>(std::clamp(static_cast<int>(std::nearbyint(axis[i] / scale)), -127, 127));
        }
        axes_i8_scale_[k] = scale;
        axes_i8_rows_.push_back(dst);
      }
    }

    // Reduced centroids transposed in panels of 64 rows (internal::AccumulatePanelsFn): one
    // broadcast per axis scores 16 rows at once, and the scan reads the panels in order.
    reduced_panels_.assign(internal::PanelFloats(rows, reduced_dims_), 0.f);
    for (int r = 0; r < rows; ++r) {
      for (int k = 0; k < reduced_dims_; ++k) {
        reduced_panels_[internal::PanelIndex(r, k, reduced_dims_)] =
            projected[static_cast<size_t>(r) * reduced_dims_ + k];
      }
    }

    if (options_.use_hnsw) {
      ELDR_RETURN_IF_ERROR(CatchFaiss("HNSW build in the reduced space", [&] {
        auto hnsw =
            std::make_unique<faiss::IndexHNSWFlat>(reduced_dims_, options_.hnsw_neighbors, faiss::METRIC_INNER_PRODUCT);
        hnsw->hnsw.efConstruction = std::max(40, 2 * options_.hnsw_neighbors);
        hnsw->hnsw.efSearch = std::max(options_.hnsw_ef_search, candidates_);
        hnsw->add(rows, projected.data());
        hnsw_ = std::move(hnsw);
      }));
    }
    return absl::OkStatus();
  }

  // Fills scratch->ranked with the (score, row) pairs of `scores` (NaN, from a non-finite query,
  // ranks last), split at a threshold so that ranked[0, ranked_front) holds every pair scoring at
  // least the threshold and the rest score below it. The threshold is an order statistic of every
  // eighth score, chosen so that the front holds about 1.5 x `expected` pairs: the rounds that
  // fetch up to `expected` candidates then select within the front instead of all the rows (the
  // selection was a fifth of a K = 1024 decision). The split never changes which pairs are the
  // best: a front too small only sends a round back to the whole range (SelectNext).
  static void RankRows(const float* scores, int rows, int expected, Scratch* scratch) {
    std::vector<std::pair<float, int>>& ranked = scratch->ranked;
    ranked.resize(rows);
    auto rank_of = [](float score) { return std::isnan(score) ? -std::numeric_limits<float>::infinity() : score; };
    constexpr int kSampleStride = 8;
    const int sample_size = rows / kSampleStride;
    // The sample's order statistic expected to leave 1.5 x `expected` rows above it, plus two
    // for the sampling noise.
    const int sample_rank = (3 * expected + 2 * kSampleStride - 1) / (2 * kSampleStride) + 2;
    if (sample_rank >= sample_size / 2) {  // a small pool: the threshold would not save anything
      for (int r = 0; r < rows; ++r) ranked[r] = {rank_of(scores[r]), r};
      scratch->ranked_front = rows;
      return;
    }
    std::vector<std::pair<float, int>>& sample = scratch->rank_sample;
    sample.resize(sample_size);
    for (int i = 0; i < sample_size; ++i) sample[i] = {rank_of(scores[i * kSampleStride]), i};
    internal::SelectBest(sample.data(), sample_size, sample_rank, &scratch->select_buffer);
    float threshold = sample[0].first;  // the lowest of the sample's best sample_rank
    for (int i = 1; i < sample_rank; ++i) threshold = std::min(threshold, sample[i].first);
    // Branch-free two-ended fill: every pair is written at both ends and only the matching end's
    // cursor moves, so the later pairs overwrite the unused copies.
    int front = 0;
    int back = rows - 1;
    for (int r = 0; r < rows; ++r) {
      const std::pair<float, int> pair{rank_of(scores[r]), r};
      const bool above = pair.first >= threshold;
      ranked[front] = pair;
      ranked[back] = pair;
      front += above;
      back -= !above;
    }
    scratch->ranked_front = front;
  }

  // y = A q from the 8-bit axes and the query quantised to 8 bits, into y. False when there are no
  // 8-bit axes or the query cannot be quantised (a negative or non-finite value): the caller
  // projects in fp32 then.
  bool ProjectInt8(const ScorerKernels& kernels, const ColumnMap::Prepared& prepared, Scratch* scratch,
                   float* y) const {
    if (axes_i8_rows_.empty()) return false;
    const int cols = store_.cols();
    const int padded = PaddedStride<int8_t>(cols);
    if (static_cast<int>(scratch->query8.size()) < padded) scratch->query8.resize(padded);
    float q_scale = 0, residual2 = 0, quantised2 = 0;
    if (!kernels.quantise_query(prepared.data, prepared.factor, cols, padded, kernels.int8_query_max, prepared.max,
                                scratch->query8.data(), nullptr, &q_scale, &residual2, &quantised2)) {
      return false;
    }
    scratch->dots.resize(reduced_dims_);
    kernels.dot_rows_u8s8(axes_i8_rows_.data(), reduced_dims_, scratch->query8.data(), padded, scratch->dots.data());
    for (int k = 0; k < reduced_dims_; ++k) y[k] = static_cast<float>(scratch->dots[k]) * (q_scale * axes_i8_scale_[k]);
    return true;
  }

  // Rearranges (*ranked)[begin, n) so that [begin, end) holds its best entries, given that
  // (*ranked)[0, front) scores at least as high as the rest (RankRows), and that [end / 2, end)
  // holds the lower half of [0, end): the rounds only ever ask which half a candidate is in (the
  // band check reads the lower half), so a round costs two partitions and no sort.
  static void SelectNext(int begin, int end, int front, Scratch* scratch) {
    std::vector<std::pair<float, int>>& ranked = scratch->ranked;
    const int n = static_cast<int>(ranked.size());
    end = std::min(end, n);
    if (begin >= end) return;
    // Within the front when it holds [begin, end): its pairs beat every pair after it.
    const int limit = end <= front ? front : n;
    internal::SelectBest(ranked.data() + begin, limit - begin, end - begin, &scratch->select_buffer);
    const int half = end / 2;
    if (begin < half) internal::SelectBest(ranked.data() + begin, end - begin, half - begin, &scratch->select_buffer);
  }

  // The `k` nearest rows of the HNSW graph, best first, into scratch->ids.
  absl::Status SearchHnsw(const float* y, int k, Scratch* scratch) const {
    scratch->faiss_distances.resize(k);
    scratch->faiss_labels.resize(k);
    ELDR_RETURN_IF_ERROR(CatchFaiss("HNSW search", [&] {
      SingleOmpThread single;
      hnsw_->search(1, y, k, scratch->faiss_distances.data(), scratch->faiss_labels.data());
    }));
    // A larger k can reorder the earlier results; keep earlier candidates first so their scores
    // stay valid, then append the new ones.
    const int rows = store_.rows();
    scratch->seen.assign(rows, 0);
    for (int id : scratch->ids) scratch->seen[id] = 1;
    for (int i = 0; i < k; ++i) {
      const faiss::Index::idx_t label = scratch->faiss_labels[i];
      if (label < 0 || label >= rows || scratch->seen[label]) continue;
      scratch->seen[label] = 1;
      scratch->ids.push_back(static_cast<int>(label));
    }
    return absl::OkStatus();
  }

  int dim_;
  float band_tau_;
  ColumnMap columns_;
  RowStore store_;
  CentroidIndexOptions options_;
  int reduced_dims_ = 0;
  int reduced_stride_ = 0;
  int candidates_ = 0;
  int max_candidates_ = 0;
  AlignedVector<float> axes_f32_;
  std::vector<const float*> axes_f32_rows_;
  AlignedVector<int8_t> axes_i8_;  // empty: fp32 projection only
  std::vector<const int8_t*> axes_i8_rows_;
  std::vector<float> axes_i8_scale_;
  AlignedVector<float> reduced_panels_;
  std::unique_ptr<faiss::IndexHNSWFlat> hnsw_;
};

absl::Status ValidateBuildInput(absl::Span<const float> centroids, int rows, int dim,
                                const CentroidIndexOptions& options) {
  if (rows < 1) {
    return InvalidInput(RejectReason::kGeometry, absl::StrCat("a centroid index needs at least one row, got ", rows));
  }
  if (dim < 1) {
    return InvalidInput(RejectReason::kGeometry, absl::StrCat("centroid dimension must be positive, got ", dim));
  }
  if (static_cast<int64_t>(rows) * dim > kMaxCells) {
    return InvalidInput(RejectReason::kOversized,
                        absl::StrFormat("%d x %d centroids exceed the limit of %d values", rows, dim, kMaxCells));
  }
  if (static_cast<int64_t>(centroids.size()) != static_cast<int64_t>(rows) * dim) {
    return InvalidInput(RejectReason::kGeometry, absl::StrFormat("%d x %d centroids need %d values, got %d", rows, dim,
                                                                 static_cast<int64_t>(rows) * dim, centroids.size()));
  }
  for (size_t i = 0; i < centroids.size(); ++i) {
    if (!std::isfinite(centroids[i])) {
      return InvalidInput(RejectReason::kNonFinite,
                          absl::StrFormat("centroid row %d, column %d is not finite", static_cast<int64_t>(i / dim),
                                          static_cast<int64_t>(i % dim)));
    }
  }
  if (std::all_of(centroids.begin(), centroids.end(), [](float v) { return v == 0.f; })) {
    return InvalidInput(RejectReason::kMalformed, "every centroid is all zeros (centroids must be unit vectors)");
  }
  if (options.large_pool_min_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("CentroidIndexOptions.large_pool_min_rows must be >= 1, got ", options.large_pool_min_rows));
  }
  if (options.reduced_dims < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CentroidIndexOptions.reduced_dims must be >= 0 (0: automatic), got ", options.reduced_dims));
  }
  if (options.candidates < 0 || options.max_candidates < 1 || options.max_candidates < options.candidates) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CentroidIndexOptions.candidates must be >= 0 (0: automatic) and max_candidates >= "
                        "max(1, candidates), got %d and %d",
                        options.candidates, options.max_candidates));
  }
  if (!(options.band_tau >= 0 && options.band_tau <= 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CentroidIndexOptions.band_tau must be in [0, 2], got ", options.band_tau));
  }
  if (options.hnsw_neighbors < 2 || options.hnsw_ef_search < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CentroidIndexOptions.hnsw_neighbors must be >= 2 and hnsw_ef_search >= 1, "
                        "got %d and %d",
                        options.hnsw_neighbors, options.hnsw_ef_search));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t internal::RefinedRowsOnThisThread() { return ThreadScratch().refined_rows; }

void internal::SelectBest(std::pair<float, int>* pairs, int n, int k, std::vector<std::pair<float, int>>* buffer) {
  using Pair = std::pair<float, int>;
  auto better = [](const Pair& a, const Pair& b) { return a.first > b.first; };
  if (static_cast<int>(buffer->size()) < n) buffer->resize(n);
  Pair* tmp = buffer->data();
  // Moves the pairs of [lo, hi) that `keep` accepts to its front, in one branch-free pass: every
  // pair is written at both ends of `tmp` and only the matching end's cursor moves. Returns how
  // many were kept.
  auto split = [&](int lo, int hi, auto keep) {
    int front = 0;
    int back = hi - lo - 1;
    for (int i = lo; i < hi; ++i) {
      const Pair pair = pairs[i];
      const bool kept = keep(pair.first);
      tmp[front] = pair;
      tmp[back] = pair;
      front += kept;
      back -= !kept;
    }
    std::copy(tmp, tmp + (hi - lo), pairs + lo);
    return front;
  };
  int lo = 0;
  int hi = n;
  int rounds_left = 4;
  for (int m = n; m > 1; m /= 2) rounds_left += 2;
  // Invariant: pairs[0, lo) beat or tie every pair from lo on, pairs[hi, n) are beaten or tied by
  // every pair before hi, and lo <= k <= hi.
  while (hi - lo > 16 && lo < k && k < hi) {
    if (--rounds_left < 0) {
      std::nth_element(pairs + lo, pairs + k, pairs + hi, better);
      return;
    }
    float a = pairs[lo].first, b = pairs[lo + (hi - lo) / 2].first, c = pairs[hi - 1].first;
    if (a > b) std::swap(a, b);
    const float pivot = std::max(a, std::min(b, c));  // the median of the three
    const int above = lo + split(lo, hi, [pivot](float score) { return score > pivot; });
    if (above >= k) {
      hi = above;
      continue;
    }
    if (above > lo) {
      lo = above;
      continue;
    }
    // No pair beats the pivot, so it is the highest left: its ties come next, and they are
    // interchangeable (this pass also keeps a range of equal scores from looping).
    const int ties_end = above + split(above, hi, [pivot](float score) { return score >= pivot; });
    if (ties_end >= k) return;
    lo = ties_end;
  }
  if (lo < k && k < hi) std::sort(pairs + lo, pairs + hi, better);
}

absl::StatusOr<std::unique_ptr<CentroidIndex>> BuildCentroidIndexOfKind(CentroidIndexKind kind,
                                                                        absl::Span<const float> centroids, int rows,
                                                                        int dim, const CentroidIndexOptions& options) {
  ELDR_RETURN_IF_ERROR(ValidateBuildInput(centroids, rows, dim, options));
  std::unique_ptr<CentroidIndex> index;
  absl::Status status = CatchFaiss("building the centroid index", [&] {
    if (kind == CentroidIndexKind::kExact) {
      index = std::make_unique<ExactIndex>(centroids.data(), rows, dim, options);
    }
  });
  ELDR_RETURN_IF_ERROR(status);
  if (kind == CentroidIndexKind::kFaissReduced) {
    ELDR_ASSIGN_OR_RETURN(index, ReducedIndex::Create(centroids.data(), rows, dim, options));
  }
  return index;
}

absl::string_view ScoringKernelsName() { return BestKernels().name; }

absl::StatusOr<std::unique_ptr<CentroidIndex>> BuildCentroidIndex(absl::Span<const float> centroids, int rows, int dim,
                                                                  const CentroidIndexOptions& options) {
  const CentroidIndexKind kind =
      rows >= options.large_pool_min_rows ? CentroidIndexKind::kFaissReduced : CentroidIndexKind::kExact;
  return BuildCentroidIndexOfKind(kind, centroids, rows, dim, options);
}

void ScoreAllPairs(absl::Span<const float> a, int n, absl::Span<const float> b, int m, int d, absl::Span<float> c) {
  ABSL_RAW_CHECK(n >= 0 && m >= 0 && d >= 0, "ScoreAllPairs: negative size");
  ABSL_RAW_CHECK(static_cast<int64_t>(a.size()) >= static_cast<int64_t>(n) * d &&
                     static_cast<int64_t>(b.size()) >= static_cast<int64_t>(m) * d &&
                     static_cast<int64_t>(c.size()) >= static_cast<int64_t>(n) * m,
                 "ScoreAllPairs: a span is smaller than its stated size");
  if (n == 0 || m == 0) return;
  if (d == 0) {
    std::fill(c.begin(), c.begin() + static_cast<int64_t>(n) * m, 0.f);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, d, 1.f, a.data(), d, b.data(), d, 0.f, c.data(), m);
}

}  // namespace eldr
