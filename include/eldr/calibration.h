// Offline calibration (DESIGN.md, algorithm steps 1 and 2) and the pieces online refit reuses:
// IDF weights, greedy layer mask, balanced spherical k-means with an exact capacity-constrained
// assignment solved as min-cost flow.
#ifndef ELDR_CALIBRATION_H_
#define ELDR_CALIBRATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "eldr/centroid_artifact.h"
#include "eldr/signature.h"
#include "eldr/trace.h"

namespace eldr {

// ---- Balanced assignment --------------------------------------------------------------------------
// Assigns n points to k clusters minimising total cost, with cluster j holding at most
// capacities[j] points (sum of capacities >= n). Exact: solved as a transportation problem by
// min-cost flow on integer-scaled costs. cost is row-major n x k. Returns the cluster of each point.
absl::StatusOr<std::vector<int>> SolveBalancedAssignment(absl::Span<const double> cost, int n, int k,
                                                         absl::Span<const int> capacities);

// Integer capacities for n points over clusters with relative weights (empty: equal weights):
// proportional, rounded up so that they sum to at least n; equal weights give ceil(n / k) each.
std::vector<int> ClusterCapacities(int n, int k, absl::Span<const double> weights);

// ---- Balanced spherical k-means -----------------------------------------------------------------
struct BalancedKMeansOptions {
  int clusters = 16;
  std::vector<double> capacity_weights;  // empty: equal; else `clusters` positive weights
  uint64_t seed = 0;                     // k-means++ seeding
  int max_iterations = 50;
  // Warm start (online refit): clusters * dim unit rows used instead of k-means++ seeding.
  std::vector<float> initial_centroids;
};

struct BalancedKMeansResult {
  std::vector<float> centroids;   // clusters * dim unit rows
  std::vector<int> assignment;    // cluster of each point
  std::vector<int> sizes;         // points per cluster (each <= its capacity)
  double objective = 0;           // total cosine distance (1 - cos) of the final assignment
  int iterations = 0;
};

// points: n unit rows of dim floats. INVALID_ARGUMENT when n < clusters, non-finite values, or
// bad weights.
absl::StatusOr<BalancedKMeansResult> FitBalancedKMeans(absl::Span<const float> points, int n, int dim,
                                                       const BalancedKMeansOptions& options);

// Aligns new centroids to old identities: the permutation p (new row p[i] takes old row i's worker)
// maximising total similarity, by an exact K x K assignment. Both are k * dim row-major.
std::vector<int> AlignCentroids(absl::Span<const float> old_centroids,
                                absl::Span<const float> new_centroids, int k, int dim);

// ---- Calibration data set -----------------------------------------------------------------------
// N captured requests: prefill counts [N][L][E], optionally decode counts [N][L][E] (used by the
// layer-mask search) and gate-probability sums [N][L][E] (variant gate_prob).
struct CalibrationData {
  int layers = 0;
  int experts = 0;
  int n = 0;
  std::vector<int32_t> prefill_counts;
  std::vector<int32_t> decode_counts;   // empty when unknown (then no layer-mask search)
  std::vector<float> gate_prob_sums;    // empty unless captured
  std::vector<int> labels;              // optional ground-truth label per request (e.g. domain)
};

// Requests from the bundled trace format: the first PrefillTokens(tokens, prefill_fraction) tokens
// of each selected sequence are the prompt, the rest its decode tokens. `sequences` indexes
// trace.sequences; empty selects all. labels = domain.
absl::StatusOr<CalibrationData> CalibrationDataFromTrace(const ExpertTrace& trace,
                                                         double prefill_fraction,
                                                         absl::Span<const int> sequences);

// Captured counts files (format in docs/calibration.md). Errors name the file and the record.
absl::StatusOr<CalibrationData> ReadCaptureFiles(const std::vector<std::string>& paths, int layers,
                                                 int experts);

// ---- Full calibration ---------------------------------------------------------------------------
struct CalibrationOptions {
  int clusters = 16;
  SignatureVariant variant = SignatureVariant::kCountIdf;
  std::vector<double> capacity_weights;   // empty: equal
  std::vector<std::string> worker_ids;    // optional names for the rows (size clusters)
  uint64_t seed = 0;
  bool select_layers = true;              // greedy mask when decode counts are present
  int mask_pairs = 30000;                 // random request pairs for the Spearman search
  int max_iterations = 50;
  std::string model;
};

struct LayerMaskStep {
  int layer = 0;          // layer added at this step
  double correlation = 0; // Spearman correlation with the layers chosen so far
};

struct CalibrationReport {
  double objective = 0;
  std::vector<int> cluster_sizes;
  std::vector<int> layer_mask;
  double mask_correlation = 0;            // at the peak
  std::vector<LayerMaskStep> mask_steps;  // every greedy step
  int iterations = 0;
  double seconds_idf = 0, seconds_mask = 0, seconds_kmeans = 0, seconds_total = 0;
  std::vector<int> assignment;            // cluster of each calibration request
};

struct CalibrationResult {
  CentroidArtifact artifact;
  CalibrationReport report;
};

absl::StatusOr<CalibrationResult> Calibrate(const CalibrationData& data,
                                            const CalibrationOptions& options);

}  // namespace eldr

#endif  // ELDR_CALIBRATION_H_
