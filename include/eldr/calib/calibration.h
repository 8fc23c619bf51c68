// Offline calibration (docs/calibration.md) and the pieces online refit reuses:
// IDF weights, greedy layer mask, balanced spherical k-means with an exact capacity-constrained
// assignment solved as min-cost flow. docs/calibration.md describes the method and the formats.
//
// Thread-safety: every function is a pure computation over its arguments (no global state), safe
// to call from several threads at once. Results are deterministic for a given input and seed.
#ifndef ELDR_CALIB_CALIBRATION_H_
#define ELDR_CALIB_CALIBRATION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/signature.h"
#include "eldr/trace/trace.h"

namespace eldr {

// ---- Balanced assignment --------------------------------------------------------------------------
// Assigns n points to k clusters minimising total cost, with cluster j holding at most
// capacities[j] points (sum of capacities >= n). Exact: solved as a transportation problem by
// min-cost flow on integer-scaled costs. cost is row-major n x k. Returns the cluster of each point.
//
// Scaling: each row is shifted by its minimum (which changes no assignment's rank, since every point
// is assigned exactly once) and the shifted costs are rounded to integers on a grid of
// (largest shifted cost) / 2^30. The result is an exact optimum of that integer problem, so its real
// total cost exceeds the real optimum by at most n * (largest shifted cost) / 2^30 (1e-9 per point
// for cosine distances). Ties are broken deterministically: the same input gives the same output.
//
// Errors: INVALID_ARGUMENT for n < 1, k < 1, sizes that do not match, a negative capacity,
// capacities summing to less than n, or a non-finite cost.
absl::StatusOr<std::vector<int>> SolveBalancedAssignment(absl::Span<const double> cost, int n, int k,
                                                         absl::Span<const int> capacities);

// The two exact min-cost-flow algorithms behind SolveBalancedAssignment. Both solve the same integer
// problem and return assignments of equal total cost (ties may be broken differently).
enum class AssignmentMethod {
  // kClusterPaths: measured 10 to 30 times faster than kNetworkSimplex from 1,000 x 16 up
  // (docs/benchmarks.md, "Calibration").
  kAuto,
  // LEMON's NetworkSimplex on the full bipartite graph: a supply of 1 per point, an arc per
  // (point, cluster), cluster -> sink arcs of capacity capacities[j]. O(n * k) arcs; kept as the
  // independent reference the tests cross-check against.
  kNetworkSimplex,
  // Successive shortest paths that exploit k << n: points are added one by one; a point whose
  // cheapest cluster (under the current dual prices) has room is placed directly, otherwise a
  // Dijkstra over the k clusters (edge a -> b = cheapest move of a point from a to b, kept in lazy
  // heaps) finds the cheapest chain of moves ending in a cluster with room. Integer costs and
  // potentials: exact. O(n * k) memory; each conflict costs O(k^2).
  kClusterPaths,
};

absl::StatusOr<std::vector<int>> SolveBalancedAssignment(absl::Span<const double> cost, int n, int k,
                                                         absl::Span<const int> capacities, AssignmentMethod method);

// ---- Weighted balanced assignment ----------------------------------------------------------------
// Points that carry integer weights ("units", e.g. quantised decode work): cluster j holds at most
// capacities[j] units (sum of capacities >= sum of units). The exact problem is the transportation
// problem in which a point's units may be split between clusters: it is solved exactly (same
// integer scaling and solvers as SolveBalancedAssignment) on the replicated problem, one row per
// unit. A point then goes wholly to the cluster that received most of its units (ties: the cheaper
// one); an optimal split touches few points (a basic optimum splits at most k - 1), so a cluster
// exceeds its capacity by at most the units of the split points rounded into it. Points of 0 units
// take no capacity and go to their cheapest cluster.
//
// Errors: those of SolveBalancedAssignment (with the units' sum for n), a units vector whose size
// is not n, a negative unit count, more than kMaxAssignmentUnits units in all.
inline constexpr int64_t kMaxAssignmentUnits = int64_t{1} << 22;
struct WeightedAssignment {
  std::vector<int> assignment;         // cluster of each point
  std::vector<int> units_per_cluster;  // n * k: the exact split optimum, units of point i in cluster j
  int split_points = 0;                // points whose units the optimum split between clusters
};
absl::StatusOr<WeightedAssignment> SolveWeightedBalancedAssignment(absl::Span<const double> cost, int n, int k,
                                                                   absl::Span<const int> units,
                                                                   absl::Span<const int> capacities,
                                                                   AssignmentMethod method = AssignmentMethod::kAuto);

// Integer capacities for n points over clusters with relative weights (empty: equal weights):
// proportional, rounded up so that they sum to at least n; equal weights give ceil(n / k) each.
// Returns an empty vector when n < 0, k < 1, or weights is neither empty nor k finite positive values.
std::vector<int> ClusterCapacities(int n, int k, absl::Span<const double> weights);

// ---- Balanced spherical k-means -----------------------------------------------------------------
struct BalancedKMeansOptions {
  int clusters = 16;
  std::vector<double> capacity_weights;  // empty: equal; else `clusters` positive weights
  uint64_t seed = 0;                     // k-means++ seeding
  int max_iterations = 50;
  // Stop when an iteration lowers the objective by at most this fraction of it. The last
  // iterations of a large fit trade a handful of boundary points for gains of 1e-5 and less; 0
  // iterates until the assignment is exactly stable.
  double tolerance = 1e-4;
  // Warm start (online refit): clusters * dim unit rows used instead of k-means++ seeding.
  std::vector<float> initial_centroids;
  // k-means++ runs on a seeded uniform sample of at most this many points (all points when n is
  // not larger; 0: always all points). Seeding costs one pass over the sample per cluster, so a
  // sample keeps it bounded for large n; the balanced iterations then use every point.
  int seeding_sample = 4096;
  AssignmentMethod assignment_method = AssignmentMethod::kAuto;
  // Weights of the points (e.g. the decode work each request caused: its output tokens), n finite
  // values >= 0 with a positive sum; empty: every point weighs 1 (the unweighted fit). With
  // weights, a cluster's capacity bounds the sum of its points' weights (capacity_weights still
  // scale the capacities), the objective is the weighted sum of cosine distances, and a centroid
  // is the renormalised weighted mean of its points. The balance is solved exactly on weights
  // quantised to integer units (SolveWeightedBalancedAssignment): a point of mean weight is
  // weight_resolution units (fewer, down to 1, when n * resolution * clusters would exceed 2^23
  // cells); a point below half a unit takes no capacity.
  std::vector<double> point_weights;
  int weight_resolution = 8;
};

struct BalancedKMeansResult {
  std::vector<float> centroids;                 // clusters * dim unit rows
  std::vector<int> assignment;                  // cluster of each point
  std::vector<int> sizes;                       // points per cluster (each <= its capacity)
  std::vector<int> capacities;                  // the capacity of each cluster (ClusterCapacities; weighted: units)
  double objective = 0;                         // total (weighted) cosine distance (1 - cos) of the final assignment
  int iterations = 0;                           // assignment steps run
  bool converged = false;                       // stopped by stability or tolerance, not by max_iterations
  std::vector<double> objective_per_iteration;  // after each assignment step
  // Weighted fits (empty / 0 otherwise): the sum of the weights of each cluster's points, the
  // weight of one unit of capacity (capacities are in units), and the points the last exact
  // optimum split between clusters before they were rounded to one.
  std::vector<double> cluster_weights;
  double unit_weight = 0;
  int split_points = 0;
  // Seconds per phase: seeding (k-means++ or warm start), scoring (sgemm), assignment (min-cost
  // flow), update (renormalised means).
  double seconds_seeding = 0, seconds_scoring = 0, seconds_assignment = 0, seconds_update = 0;
};

// The points of a fit, read a block of rows at a time, so that a compact store (the online refit
// window keeps half-precision rows, src/refit/signature_chunk.h) is decoded to fp32 only one
// block at a time instead of as a whole n x dim matrix. Implementations must be safe to Read from
// one thread while no one modifies the rows read.
class PointRows {
 public:
  virtual ~PointRows() = default;
  virtual int rows() const = 0;
  virtual int dim() const = 0;
  // The block size (rows) a pass should use: all rows for a dense matrix (one view, one sgemm),
  // a few dozen for a store that decodes (its fp32 scratch is block_rows() * dim floats). >= 1.
  virtual int block_rows() const = 0;
  // Rows [begin, begin + count) as count * dim row-major floats: a view into the storage, or into
  // `scratch` (resized as needed) after decoding them there. Valid until the next Read with the
  // same scratch. Requires 0 <= begin, count >= 0, begin + count <= rows().
  virtual absl::Span<const float> Read(int begin, int count, std::vector<float>* scratch) const = 0;
};

// A dense row-major n x dim fp32 matrix (not copied: it must outlive the view).
class DensePointRows final : public PointRows {
 public:
  DensePointRows(absl::Span<const float> points, int n, int dim) : points_(points), n_(n), dim_(dim) {}
  int rows() const override { return n_; }
  int dim() const override { return dim_; }
  int block_rows() const override { return n_ > 0 ? n_ : 1; }
  absl::Span<const float> Read(int begin, int count, std::vector<float>* scratch) const override;

 private:
  absl::Span<const float> points_;
  int n_, dim_;
};

// scores[i * k + c] = cosine of point i and centroid c (k * dim unit rows), for every point, one
// block (PointRows::block_rows) at a time; `scratch` as in PointRows::Read.
void ScorePointRows(const PointRows& points, absl::Span<const float> centroids, int k, absl::Span<float> scores,
                    std::vector<float>* scratch);

// points: n unit rows of dim floats (norm within 1e-3 of 1). Iterates: exact balanced assignment
// against the current centroids, then each centroid becomes the renormalised mean of its points
// (an emptied cluster is re-seeded at the worst-served point), until an assignment repeats the
// previous one, the objective improves by at most `tolerance` (relative), or max_iterations. The
// result always pairs the returned centroids with their exact balanced assignment. Unweighted, the objective never
// increases between iterations. Deterministic for a given input and seed. INVALID_ARGUMENT when n < clusters, sizes
// mismatch, non-finite values, rows that are not unit, bad weights or a bad warm start.
absl::StatusOr<BalancedKMeansResult> FitBalancedKMeans(absl::Span<const float> points, int n, int dim,
                                                       const BalancedKMeansOptions& options);
// The same fit on points read block by block (n = points.rows(), dim = points.dim()). Memory
// beyond the points: n * k scores and costs, k * dim sums, and block_rows() * dim floats of scratch
// (k-means++ seeding of a source that decodes reads its sample the same way, once per cluster).
// On a DensePointRows it computes exactly what the overload above computes.
absl::StatusOr<BalancedKMeansResult> FitBalancedKMeans(const PointRows& points, const BalancedKMeansOptions& options);

// Aligns new centroids to old identities: the permutation p (new row p[i] takes old row i's worker)
// maximising total similarity, by an exact K x K assignment. Both are k * dim row-major.
// Returns an empty vector when the sizes do not match k * dim.
std::vector<int> AlignCentroids(absl::Span<const float> old_centroids, absl::Span<const float> new_centroids, int k,
                                int dim);

// Rectangular form for elastic pools (old_k <= new_k): p[i] is the distinct new row that old row i's
// worker takes, maximising total similarity; the new_k - old_k rows no old row takes are free for
// added workers. Returns an empty vector when old_k > new_k or the sizes do not match.
std::vector<int> AlignCentroids(absl::Span<const float> old_centroids, int old_k, absl::Span<const float> new_centroids,
                                int new_k, int dim);

// ---- Calibration data set -----------------------------------------------------------------------
// N captured requests: prefill counts [N][L][E], optionally decode counts [N][L][E] (used by the
// layer-mask search) and gate-probability sums [N][L][E] (variant gate_prob).
struct CalibrationData {
  int layers = 0;
  int experts = 0;
  int n = 0;
  std::vector<int32_t> prefill_counts;
  std::vector<int32_t> decode_counts;    // empty when unknown (then no layer-mask search)
  std::vector<float> gate_prob_sums;     // empty unless captured
  std::vector<int> labels;               // optional ground-truth label per request (e.g. domain)
  std::vector<std::string> label_names;  // optional name of each label value (e.g. domain names)
};

// Checks sizes against n * layers * experts, non-negative counts, finite non-negative gate sums and
// labels in [0, label_names.size()) when names are given. The message names the first bad record.
absl::Status ValidateCalibrationData(const CalibrationData& data);

// The requests `indices` of `data` (in that order), labels and names included.
CalibrationData SelectRequests(const CalibrationData& data, absl::Span<const int> indices);

// Seeded split into (calibration, held-out). Stratified by label when labels are present: each
// label contributes round(fraction * its count) held-out requests (at least one request of every
// label stays in calibration). fraction in [0, 1).
struct CalibrationSplit {
  CalibrationData calibration;
  CalibrationData holdout;
  std::vector<int> calibration_indices;  // into the input
  std::vector<int> holdout_indices;
};
absl::StatusOr<CalibrationSplit> SplitCalibrationData(const CalibrationData& data, double holdout_fraction,
                                                      uint64_t seed);

// Requests from the bundled trace format: the first PrefillTokens(tokens, prefill_fraction) tokens
// of each selected sequence are the prompt, the rest its decode tokens. `sequences` indexes
// trace.sequences; empty selects all. labels = domain.
absl::StatusOr<CalibrationData> CalibrationDataFromTrace(const ExpertTrace& trace, double prefill_fraction,
                                                         absl::Span<const int> sequences);

// Captured counts files (format in docs/calibration.md). Errors name the file and the record.
// Two framings are accepted: the ELDR capture format (a header with magic "ELDRCAPT", version,
// layers, experts and flags, then length-prefixed records that may carry decode counts, gate sums
// and a label), and the reference engine's plain frames (little-endian uint32 byte size =
// layers * experts * 2, then that many bytes of int16 little-endian counts [L][E]). layers and
// experts: the expected geometry; 0 takes it from the files' headers (plain frames then fail, as
// they carry no geometry). Every file must agree on geometry and on which parts records carry.
absl::StatusOr<CalibrationData> ReadCaptureFiles(const std::vector<std::string>& paths, int layers, int experts);

// Writes `data` in the ELDR capture format (atomically). Counts are stored as int16 when every
// value fits, as int32 otherwise. With reference_framing, writes the reference's plain frames of
// prefill counts only (int16; INVALID_ARGUMENT when a count exceeds 32767).
struct CaptureWriteOptions {
  bool reference_framing = false;
};
absl::Status WriteCaptureFile(const std::string& path, const CalibrationData& data,
                              const CaptureWriteOptions& options = {});
// The bytes WriteCaptureFile writes.
absl::StatusOr<std::string> SerializeCaptureFile(const CalibrationData& data, const CaptureWriteOptions& options = {});

// ---- Full calibration ---------------------------------------------------------------------------
struct CalibrationOptions {
  int clusters = 16;
  SignatureVariant variant = SignatureVariant::kCountIdf;
  std::vector<double> capacity_weights;  // empty: equal
  std::vector<std::string> worker_ids;   // optional names for the rows (size clusters)
  uint64_t seed = 0;
  bool select_layers = true;  // greedy mask (count_idf, decode counts present)
  int mask_pairs = 30000;     // random request pairs for the Spearman search
  int max_iterations = 50;
  double tolerance = 1e-4;  // see BalancedKMeansOptions
  std::string model;
  int seeding_sample = 4096;  // see BalancedKMeansOptions
};

struct LayerMaskStep {
  int layer = 0;           // layer added at this step
  double correlation = 0;  // Spearman correlation with the layers chosen so far
};

struct CalibrationReport {
  double objective = 0;
  std::vector<int> cluster_sizes;
  std::vector<int> cluster_capacities;
  std::vector<int> layer_mask;
  double mask_correlation = 0;            // at the peak
  std::vector<LayerMaskStep> mask_steps;  // every greedy step
  double all_layers_correlation = 0;      // the same correlation with every layer kept
  int mask_pairs = 0;                     // request pairs the correlations were measured on
  int iterations = 0;
  bool converged = false;
  std::vector<double> objective_per_iteration;
  double seconds_idf = 0, seconds_mask = 0, seconds_kmeans = 0, seconds_total = 0;
  double seconds_signatures = 0;  // transforming every request
  // k-means phases (see BalancedKMeansResult).
  double seconds_seeding = 0, seconds_scoring = 0, seconds_assignment = 0, seconds_update = 0;
  // Requests left out because their signature is all zero on the chosen layers (no direction).
  std::vector<int> excluded_requests;
  std::vector<int> assignment;  // cluster of each calibration request (-1: excluded)
};

struct CalibrationResult {
  CentroidArtifact artifact;
  CalibrationReport report;
};

// Errors: INVALID_ARGUMENT naming the problem (see ValidateCalibrationData; fewer usable requests
// than clusters; variant gate_prob without gate sums; weights or worker ids of the wrong count).
absl::StatusOr<CalibrationResult> Calibrate(const CalibrationData& data, const CalibrationOptions& options);

// The greedy layer-mask search on its own (Calibrate runs it for count_idf when decode counts are
// present). idf: all layers' weights [layers][experts] (ComputeIdf). Pairs of distinct requests are
// all pairs when n * (n - 1) / 2 <= max_pairs, otherwise max_pairs seeded random pairs.
struct LayerMaskSearchResult {
  std::vector<int> layer_mask;       // sorted
  std::vector<LayerMaskStep> steps;  // in the order layers were added
  double correlation = 0;            // at the peak (the last step)
  double all_layers_correlation = 0;
  int pairs = 0;
};
absl::StatusOr<LayerMaskSearchResult> SearchLayerMask(const CalibrationData& data, absl::Span<const float> idf,
                                                      int max_pairs, uint64_t seed);

// Spearman rank correlation (average ranks for ties); 0 when either side is constant.
double SpearmanCorrelation(absl::Span<const double> x, absl::Span<const double> y);

// ---- Evaluation (docs/calibration.md, "Verifying") ---------------------------------------------
struct CalibrationEvaluation {
  // Purity of the calibration clusters against labels: sum over clusters of the count of its most
  // common label, divided by the requests assigned. 0 without labels.
  double purity = 0;
  std::vector<std::vector<int>> cluster_label_counts;  // [cluster][label]
  std::vector<int> cluster_majority_label;             // -1 for an empty cluster
  // Calibration requests whose nearest centroid is the cluster the balanced assignment gave them.
  double calibration_nearest_agreement = 0;
  int holdout_requests = 0;  // held-out requests with a usable signature
  // Held-out routing agreement, two views:
  //  - assignment: the held-out request's nearest centroid equals its cluster in an exact balanced
  //    assignment of calibration + held-out requests together against the fitted centroids (the
  //    same capacity weights): would routing have put it where calibration would have;
  //  - label: the nearest centroid's majority calibration label equals the request's own label.
  double holdout_assignment_agreement = 0;
  double holdout_label_agreement = 0;
  double holdout_purity = 0;  // purity of the held-out requests grouped by nearest centroid
};

// holdout may be null (no held-out figures). Label figures need labels on both sets.
absl::StatusOr<CalibrationEvaluation> EvaluateCalibration(const CalibrationResult& result,
                                                          const CalibrationData& calibration,
                                                          const CalibrationData* holdout,
                                                          const CalibrationOptions& options);

// The report as pretty JSON (docs/calibration.md lists the keys). evaluation may be null.
std::string CalibrationReportJson(const CalibrationResult& result, const CalibrationOptions& options,
                                  const CalibrationEvaluation* evaluation, const CalibrationData& calibration);

}  // namespace eldr

#endif  // ELDR_CALIB_CALIBRATION_H_
