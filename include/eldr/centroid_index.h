// Scoring a signature against the worker centroids (cosine similarity = dot product of unit vectors).
//
// One interface, implementations chosen by pool size (BuildCentroidIndex):
//  - small pools: an exact scorer of our own (vectorised, optionally half-precision centroids),
//    because FAISS 1.7.3 as packaged by Debian has no SIMD kernels and is ~20x slower for one query;
//  - large pools: FAISS, a PCA pre-transform fitted on the centroids with flat or HNSW search for
//    the top candidates, which are then re-scored exactly at full dimension.
// Batches of many signatures (simulator, refit, calibration) go through ScoreBatch (sgemm).
#ifndef ELDR_CENTROID_INDEX_H_
#define ELDR_CENTROID_INDEX_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace eldr {

struct ScoredRow {
  int row = 0;        // centroid row
  float score = 0.f;  // exact cosine similarity with the query
};

struct CentroidIndexOptions {
  // Pools with at least this many centroids use the FAISS reduced-space index; smaller pools are
  // scored exactly. Default: the crossover measured by eldr-microbench (docs/benchmarks.md).
  int large_pool_min_rows = 128;
  // Large pools: dimensions kept by the PCA pre-transform (capped at the number of rows).
  int reduced_dims = 64;
  // Large pools: candidates fetched in the reduced space and re-scored exactly.
  int candidates = 48;
  // Large pools: HNSW instead of a flat scan in the reduced space.
  bool use_hnsw = false;
  // Exact scorer: store centroids in half precision (halves the bytes read per query; scores
  // differ from fp32 by < 1e-3 on unit vectors).
  bool half_precision = true;
};

// Immutable once built; every method is const and thread-safe.
class CentroidIndex {
 public:
  virtual ~CentroidIndex() = default;

  virtual int rows() const = 0;
  virtual int dim() const = 0;
  // "exact", "exact_fp16", "faiss_pca_flat", "faiss_pca_hnsw": for logs and benchmarks.
  virtual absl::string_view kind() const = 0;

  // Scores one unit query (dim() floats). Fills `out` with exact scores of a candidate set that
  // contains the best-scoring rows: every row for the exact scorer, the re-scored top candidates
  // for large pools. Order unspecified. INVALID_ARGUMENT on a wrong dimension.
  virtual absl::Status Search(absl::Span<const float> query, std::vector<ScoredRow>* out) const = 0;

  // Exact scores of n queries against every row: scores[i * rows() + j]. Queries are row-major
  // n x dim(). Uses BLAS sgemm; for the simulator, refit and calibration.
  virtual absl::Status ScoreBatch(absl::Span<const float> queries, int n,
                                  absl::Span<float> scores) const = 0;
};

// Builds the index for `rows` unit centroids of `dim` floats (row-major). Validates dimensions and
// finiteness; FAISS exceptions become INTERNAL errors, never escape.
absl::StatusOr<std::unique_ptr<CentroidIndex>> BuildCentroidIndex(absl::Span<const float> centroids,
                                                                  int rows, int dim,
                                                                  const CentroidIndexOptions& options);

// Forces one implementation regardless of pool size (benchmarks and tests).
enum class CentroidIndexKind { kExact, kFaissReduced };
absl::StatusOr<std::unique_ptr<CentroidIndex>> BuildCentroidIndexOfKind(
    CentroidIndexKind kind, absl::Span<const float> centroids, int rows, int dim,
    const CentroidIndexOptions& options);

// C = A * B^T for row-major A [n x d] and B [m x d] (BLAS sgemm): the batched cosine scores of
// unit rows. Shared by the index, calibration and refit.
void ScoreAllPairs(absl::Span<const float> a, int n, absl::Span<const float> b, int m, int d,
                   absl::Span<float> c);

}  // namespace eldr

#endif  // ELDR_CENTROID_INDEX_H_
