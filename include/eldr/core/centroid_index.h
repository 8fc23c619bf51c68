// Scoring a signature against the worker centroids (cosine similarity = dot product of unit
// vectors).
//
// One interface, implementations chosen by pool size (BuildCentroidIndex):
//  - small pools: an exact scorer of our own (AVX-512/AVX2 chosen at run time, scalar fallback;
//    a 16-bit scan with certified fp32 re-scoring near the band edge), because FAISS 1.7.3 as
//    packaged by Debian has no SIMD kernels and is 20-45x slower for one query;
//  - large pools: a PCA fitted on the centroids by FAISS, a flat scan (or FAISS HNSW) in that
//    reduced space for the top candidates, which are then re-scored exactly at full dimension.
// Batches of many signatures (simulator, refit, calibration) go through ScoreBatch (sgemm).
// Measurements behind every default: docs/benchmarks.md, "Routing core microbenchmarks".
#ifndef ELDR_CORE_CENTROID_INDEX_H_
#define ELDR_CORE_CENTROID_INDEX_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "eldr/core/column_selection.h"

namespace eldr {

struct ScoredRow {
  int row = 0;        // centroid row
  float score = 0.f;  // cosine similarity with the query (precision: see band_tau)
};

// The reduced-precision copy of the centroids that the scan reads (see half_precision).
// kInt8: 8-bit rows with one scale per row, scored with integer dot products against the query
// quantised per search to 8 bits (7 where the kernels sum product pairs in 16 bits); a query with
// a negative value is scanned in fp32 instead.
enum class HalfFormat { kAuto, kBfloat16, kBinary16, kInt8 };

struct CentroidIndexOptions {
  // Pools with at least this many centroids use the FAISS reduced-space index; smaller pools are
  // scored exactly. Default: the crossover measured by eldr-microbench (docs/benchmarks.md).
  int large_pool_min_rows = 128;
  // Large pools: dimensions kept by the PCA pre-transform (capped at the number of rows).
  // 0: automatic, rows / 16 clamped to [32, 64] (measured: 32 axes keep every decision of a
  // 256-worker pool, 1024 workers need 64).
  int reduced_dims = 0;
  // Large pools: candidates fetched in the reduced space (best first) and re-scored exactly.
  // While the lower half of the fetched candidates still reaches into the band (score >= best -
  // band_tau), twice as many are fetched, up to max_candidates: bands wider than that are cut to
  // the max_candidates rows nearest in the reduced space. 0: automatic, rows / 20 clamped to
  // [32, 64].
  int candidates = 0;
  int max_candidates = 256;
  // Large pools: HNSW instead of a flat scan in the reduced space.
  bool use_hnsw = false;
  // Large pools with use_hnsw: graph degree (faiss M) and search beam (efSearch, raised to at
  // least `candidates`).
  int hnsw_neighbors = 32;
  int hnsw_ef_search = 64;
  // Scan a 16-bit copy of the centroids (half the bytes read per query). Rows whose 16-bit score
  // could be decided differently than in fp32 (see band_tau) are re-scored from an fp32 copy, so
  // decisions are those of fp32 scoring.
  bool half_precision = true;
  // The reduced-precision format. bfloat16 scans fastest where rows stream from cache (no
  // conversion instruction), but its error bound (~4e-3 for unit vectors) sends ~5x more rows to
  // fp32 re-scoring than binary16 (~5e-4). kInt8 reads half the bytes again and does 64 products
  // per instruction with AVX-512 VNNI (32 with AVX2), but its bound is ~10x bfloat16's, so it is a
  // first stage: rows it cannot rule out of the band are scored again from a bfloat16 copy, then
  // refined as usual. kAuto: for the exact scorer fp32 when rows have fewer than 2,048 non-zero
  // columns (short rows scan fastest in fp32), else kInt8 from 16 rows on (AVX-512 or AVX2),
  // else bfloat16; binary16 for the large-pool candidates, whose rows are gathered from memory
  // anyway (docs/benchmarks.md).
  HalfFormat half_format = HalfFormat::kAuto;
  // The locality band width the caller applies to the scores (Router: RouterOptions::tau), in
  // [0, 2]. With half_precision, every row lies on the same side of best - band_tau as with fp32
  // scores (which match a double-precision reference except within ~1e-5 of the edge): 16-bit
  // scores carry a certified error bound b (for unit vectors about 4e-3 with bfloat16, 5e-4 with
  // binary16), and when a row's 16-bit score is within 3b of the 16-bit edge, the rows near the
  // edge and near the best are re-scored in fp32 (then the best score is exact too). Otherwise
  // scores, the best included, are within b of fp32. With kInt8, a row the 8-bit stage rules out
  // keeps its 8-bit score (within its larger bound, and below the band edge by more than that).
  // For another tau the same bound holds.
  double band_tau = 0.1;
};

// Immutable once built; every method is const and thread-safe.
class CentroidIndex {
 public:
  virtual ~CentroidIndex() = default;

  virtual int rows() const = 0;
  virtual int dim() const = 0;
  // "exact", "exact_bf16", "exact_fp16", "faiss_pca_flat", "faiss_pca_hnsw": for logs and
  // benchmarks.
  virtual absl::string_view kind() const = 0;

  // Scores one unit query (dim() finite floats). Fills `out` with the scores of a candidate set
  // that contains the best-scoring rows: every row for the exact scorer, the top candidates
  // re-scored at full dimension for large pools. Band decisions at CentroidIndexOptions::band_tau
  // are those of fp32 scoring (see there). Order unspecified. INVALID_ARGUMENT (RejectReason
  // kGeometry) on a wrong dimension; INTERNAL if FAISS fails (HNSW). Uses per-thread scratch
  // buffers: no allocation in steady state except inside FAISS HNSW.
  virtual absl::Status Search(absl::Span<const float> query, std::vector<ScoredRow>* out) const = 0;

  // The columns Search restricts every query to: those non-zero in some centroid where the index
  // drops the others, else every column (kept == dim). Null where the index has no kept-column
  // search (SearchKept). A view, valid as long as the index.
  virtual const ColumnSelection* kept_columns() const { return nullptr; }

  // Search for a unit query given by its kept columns only (SignatureTransform::ApplyKept writes
  // them in one pass, without the full-dimension vector), before normalisation: the query is
  // kept_values[i] * value_scale, each product rounded to float (exactly what scaling the values in
  // place would store). The index scales as part of a pass it makes anyway where it can (the 8-bit
  // scan), so a route decision reads the query once less. `kept_values` holds
  // kept_columns()->kept values followed by at least 16 floats of room, `kept_norm` is the norm of
  // the scaled query. `kept_max` >= 0 promises that every scaled value lies in [0, kept_max] (the
  // 8-bit scan then skips its checking pass); negative: unknown. The results are those of Search
  // on the full scaled query. FAILED_PRECONDITION when kept_columns() is null; INVALID_ARGUMENT
  // (kGeometry) when the span is too short.
  virtual absl::Status SearchKept(absl::Span<const float> /*kept_values*/, float /*value_scale*/, float /*kept_norm*/,
                                  float /*kept_max*/, std::vector<ScoredRow>* /*out*/) const {
    return absl::FailedPreconditionError("this centroid index has no kept-column search");
  }

  // Exact scores of n queries against every row: scores[i * rows() + j]. Queries are row-major
  // n x dim(). Uses BLAS sgemm; for the simulator, refit and calibration.
  virtual absl::Status ScoreBatch(absl::Span<const float> queries, int n, absl::Span<float> scores) const = 0;
};

// Builds the index for `rows` unit centroids of `dim` floats (row-major). Validates dimensions and
// finiteness (INVALID_ARGUMENT with a RejectReason) and the options (INVALID_ARGUMENT); FAISS
// exceptions become INTERNAL errors, never escape. Columns that are zero in every centroid (e.g.
// experts whose IDF weight is 0) are dropped internally: they add nothing to any score.
absl::StatusOr<std::unique_ptr<CentroidIndex>> BuildCentroidIndex(absl::Span<const float> centroids, int rows, int dim,
                                                                  const CentroidIndexOptions& options);

// The instruction-set path every index of this process scans with, chosen at the first use from
// the CPU and the ELDR_SIMD / ELDR_VNNI environment variables: "scalar", "avx2", "avx2+avx_vnni",
// "avx512" or "avx512+vnni". For logs and benchmark labels.
absl::string_view ScoringKernelsName();

// Forces one implementation regardless of pool size (benchmarks and tests).
enum class CentroidIndexKind { kExact, kFaissReduced };
absl::StatusOr<std::unique_ptr<CentroidIndex>> BuildCentroidIndexOfKind(CentroidIndexKind kind,
                                                                        absl::Span<const float> centroids, int rows,
                                                                        int dim, const CentroidIndexOptions& options);

// C = A * B^T for row-major A [n x d] and B [m x d] (BLAS sgemm): the batched cosine scores of
// unit rows, C row-major [n x m]. Shared by the index, calibration and refit. Preconditions
// (checked; a violation is a programming error and aborts with a message): n, m, d >= 0 and the
// spans hold at least n*d, m*d and n*m values. OpenBLAS may use several threads for large inputs.
void ScoreAllPairs(absl::Span<const float> a, int n, absl::Span<const float> b, int m, int d, absl::Span<float> c);

}  // namespace eldr

#endif  // ELDR_CORE_CENTROID_INDEX_H_
