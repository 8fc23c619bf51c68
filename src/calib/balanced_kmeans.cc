// Balanced spherical k-means: k-means++ seeding (or a warm start), then alternate the exact
// capacity-constrained assignment and renormalised means.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "calib/calib_internal.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_index.h"

namespace eldr {
namespace {

using Clock = std::chrono::steady_clock;

// Normalises `row` in place; false when its norm is zero or not finite.
bool NormaliseRow(float* row, int dim) {
  double sum = 0;
  for (int d = 0; d < dim; ++d) sum += static_cast<double>(row[d]) * row[d];
  if (!(sum > 0) || !std::isfinite(sum)) return false;
  const float inverse = static_cast<float>(1.0 / std::sqrt(sum));
  for (int d = 0; d < dim; ++d) row[d] *= inverse;
  return true;
}

// Calls fn(begin, count, rows) for consecutive blocks of `points` (PointRows::block_rows each,
// the last one shorter), `rows` holding count * dim floats; stops early and returns the first
// error fn returns.
template <typename Fn>
absl::Status ForEachBlock(const PointRows& points, std::vector<float>* scratch, Fn fn) {
  const int n = points.rows();
  const int block = std::max(1, points.block_rows());
  for (int begin = 0; begin < n; begin += block) {
    const int count = std::min(block, n - begin);
    if (absl::Status status = fn(begin, count, points.Read(begin, count, scratch)); !status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status ValidatePoints(const PointRows& points, std::vector<float>* scratch) {
  const int dim = points.dim();
  return ForEachBlock(points, scratch, [dim](int begin, int count, absl::Span<const float> rows) -> absl::Status {
    for (int r = 0; r < count; ++r) {
      const int i = begin + r;
      const float* row = rows.data() + static_cast<size_t>(r) * dim;
      double sum = 0;
      for (int d = 0; d < dim; ++d) {
        if (!std::isfinite(row[d])) {
          return absl::InvalidArgumentError(
              absl::StrCat("balanced k-means: point ", i, " has a non-finite value at index ", d));
        }
        sum += static_cast<double>(row[d]) * row[d];
      }
      if (std::abs(std::sqrt(sum) - 1.0) > 1e-3) {
        return absl::InvalidArgumentError(
            absl::StrCat("balanced k-means: point ", i, " has norm ", std::sqrt(sum), "; points must be unit rows"));
      }
    }
    return absl::OkStatus();
  });
}

// The rows `sample` (indices into `base`, any order) of `base`, read through it one block at a
// time.
class SampledRows final : public PointRows {
 public:
  SampledRows(const PointRows& base, const std::vector<int>& sample) : base_(base), sample_(sample) {}
  int rows() const override { return static_cast<int>(sample_.size()); }
  int dim() const override { return base_.dim(); }
  int block_rows() const override { return base_.block_rows(); }
  absl::Span<const float> Read(int begin, int count, std::vector<float>* scratch) const override {
    const size_t dim = static_cast<size_t>(base_.dim());
    scratch->resize(static_cast<size_t>(count) * dim);
    std::vector<float> row_scratch;
    for (int r = 0; r < count; ++r) {
      const absl::Span<const float> row = base_.Read(sample_[begin + r], 1, &row_scratch);
      std::copy(row.begin(), row.end(), scratch->begin() + static_cast<ptrdiff_t>(r * dim));
    }
    return absl::MakeConstSpan(*scratch);
  }

 private:
  const PointRows& base_;
  const std::vector<int>& sample_;
};

// k-means++ for cosine distance: the first centre uniformly, each next one with probability
// proportional to 1 - (best cosine to the centres so far), i.e. to the squared Euclidean distance
// between unit vectors. Runs on a seeded sample of the points.
std::vector<float> SeedKMeansPlusPlus(const PointRows& points, int clusters, int sample_limit, uint64_t seed,
                                      std::vector<float>* scratch) {
  const int n = points.rows();
  const int dim = points.dim();
  std::mt19937_64 rng(seed);
  std::vector<int> sample(n);
  std::iota(sample.begin(), sample.end(), 0);
  if (sample_limit > 0 && n > sample_limit) {
    for (int i = 0; i < sample_limit; ++i) {
      const int j = i + static_cast<int>(UniformUnit(rng) * (n - i));
      std::swap(sample[i], sample[std::min(j, n - 1)]);
    }
    sample.resize(sample_limit);
    std::sort(sample.begin(), sample.end());
  }
  const int s = static_cast<int>(sample.size());
  // A sample that fits in one block (always, for a dense matrix) is gathered once; a larger one of
  // a decoding store is read again in blocks for every cluster, so seeding never holds more than
  // a block of it in fp32.
  const SampledRows sampled_rows(points, sample);
  std::vector<float> gathered;
  std::optional<DensePointRows> gathered_rows;
  const PointRows* sampled = &sampled_rows;
  if (s <= points.block_rows()) {
    sampled_rows.Read(0, s, &gathered);
    sampled = &gathered_rows.emplace(gathered, s, dim);
  }

  std::vector<float> centroids(static_cast<size_t>(clusters) * dim);
  std::vector<char> chosen(s, 0);
  std::vector<double> distance(s, 0.0);  // 1 - best cosine so far, clamped at 0
  std::vector<float> similarity(s);
  int pick = std::min(static_cast<int>(UniformUnit(rng) * s), s - 1);
  for (int c = 0; c < clusters; ++c) {
    if (c > 0) {
      double total = 0;
      for (int i = 0; i < s; ++i) total += chosen[i] ? 0.0 : distance[i];
      pick = -1;
      if (total > 0) {
        double target = UniformUnit(rng) * total;
        for (int i = 0; i < s; ++i) {
          if (chosen[i] || distance[i] <= 0) continue;
          pick = i;
          target -= distance[i];
          if (target < 0) break;
        }
      }
      if (pick < 0) {  // every remaining point coincides with a centre: take the first unused one
        pick = static_cast<int>(std::find(chosen.begin(), chosen.end(), 0) - chosen.begin());
        if (pick >= s) pick = c % s;  // fewer sampled points than clusters cannot happen (s >= k)
      }
    }
    chosen[pick] = 1;
    float* centre = centroids.data() + static_cast<size_t>(c) * dim;
    const absl::Span<const float> picked = sampled->Read(pick, 1, scratch);
    std::copy(picked.begin(), picked.end(), centre);
    ScorePointRows(*sampled, absl::Span<const float>(centre, dim), 1, absl::MakeSpan(similarity), scratch);
    for (int i = 0; i < s; ++i) {
      const double d = std::max(0.0, 1.0 - static_cast<double>(similarity[i]));
      distance[i] = c == 0 ? d : std::min(distance[i], d);
    }
  }
  return centroids;
}

// Checks FitBalancedKMeans's sizes and options: clusters and dim >= 1, n >= clusters, a finite
// tolerance >= 0, max_iterations >= 1.
absl::Status ValidateKMeansArguments(int n, int dim, const BalancedKMeansOptions& options) {
  const int k = options.clusters;
  if (k < 1) return absl::InvalidArgumentError(absl::StrCat("balanced k-means: clusters = ", k, ", need >= 1"));
  if (dim < 1) return absl::InvalidArgumentError(absl::StrCat("balanced k-means: dim = ", dim, ", need >= 1"));
  if (n < k) {
    return absl::InvalidArgumentError(
        absl::StrCat("balanced k-means: ", n, " points for ", k, " clusters; need at least one point per cluster"));
  }
  if (!(options.tolerance >= 0) || !std::isfinite(options.tolerance)) {
    return absl::InvalidArgumentError(
        absl::StrCat("balanced k-means: tolerance = ", options.tolerance, ", need a finite value >= 0"));
  }
  if (options.max_iterations < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("balanced k-means: max_iterations = ", options.max_iterations, ", need >= 1"));
  }
  return absl::OkStatus();
}

// Largest replicated assignment (units * clusters cells) a weighted fit quantises to.
constexpr int64_t kMaxWeightedCells = int64_t{1} << 23;

// Integer units of weighted points (BalancedKMeansOptions::point_weights).
struct PointUnits {
  std::vector<int> units;  // per point
  int64_t total = 0;
  double unit_weight = 0;
};

// Quantises the weights: a point of mean weight gets `resolution` units (fewer, down to 1, when
// n * resolution * k cells would exceed kMaxWeightedCells), each point round(weight / unit).
absl::StatusOr<PointUnits> QuantiseWeights(const std::vector<double>& weights, int n, int k, int resolution) {
  if (weights.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("balanced k-means: ", weights.size(), " point weights for ", n, " points"));
  }
  if (resolution < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("balanced k-means: weight_resolution = ", resolution, ", need >= 1"));
  }
  double total = 0;
  for (int i = 0; i < n; ++i) {
    if (!std::isfinite(weights[i]) || weights[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("balanced k-means: weight of point ", i, " is ", weights[i], "; need a finite value >= 0"));
    }
    total += weights[i];
  }
  if (!(total > 0) || !std::isfinite(total)) {
    return absl::InvalidArgumentError("balanced k-means: the point weights sum to zero (or overflow)");
  }
  const int64_t cells_per_resolution = static_cast<int64_t>(n) * k;
  const int effective = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(resolution, kMaxWeightedCells / std::max<int64_t>(1, cells_per_resolution))));
  PointUnits result;
  result.unit_weight = total / (static_cast<double>(n) * effective);
  result.units.resize(n);
  for (int i = 0; i < n; ++i) {
    result.units[i] = static_cast<int>(std::llround(weights[i] / result.unit_weight));
    result.total += result.units[i];
  }
  if (result.total == 0) {  // cannot happen (the units of the mean sum to n * effective), but be safe
    return absl::InvalidArgumentError("balanced k-means: every point weight rounds to zero units");
  }
  return result;
}

// Validates the arguments, then the points, and returns the capacity of each cluster
// (ClusterCapacities; in units for a weighted fit, whose units `units` receives).
absl::StatusOr<std::vector<int>> ValidatedCapacities(const PointRows& points, const BalancedKMeansOptions& options,
                                                     std::vector<float>* scratch, std::optional<PointUnits>* units) {
  const int n = points.rows();
  if (absl::Status status = ValidateKMeansArguments(n, points.dim(), options); !status.ok()) return status;
  const int k = options.clusters;
  int64_t balanced_amount = n;
  if (!options.point_weights.empty()) {
    absl::StatusOr<PointUnits> quantised = QuantiseWeights(options.point_weights, n, k, options.weight_resolution);
    if (!quantised.ok()) return quantised.status();
    balanced_amount = quantised->total;
    units->emplace(*std::move(quantised));
  }
  std::vector<int> capacity = ClusterCapacities(static_cast<int>(balanced_amount), k, options.capacity_weights);
  if (capacity.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("balanced k-means: capacity weights must be empty or ", k,
                                                   " finite positive values (got ", options.capacity_weights.size(),
                                                   ")"));
  }
  if (absl::Status status = ValidatePoints(points, scratch); !status.ok()) return status;
  return capacity;
}

// The warm-start centroids (clusters * dim values), each row normalised; fails on a wrong size
// or a zero or non-finite row.
absl::StatusOr<std::vector<float>> WarmStartCentroids(const std::vector<float>& initial, int k, int dim) {
  if (initial.size() != static_cast<size_t>(k) * dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("balanced k-means: warm start has ", initial.size(),
                     " values, expected clusters * dim = ", static_cast<int64_t>(k) * dim));
  }
  std::vector<float> centroids = initial;
  for (int c = 0; c < k; ++c) {
    if (!NormaliseRow(centroids.data() + static_cast<size_t>(c) * dim, dim)) {
      return absl::InvalidArgumentError(
          absl::StrCat("balanced k-means: warm-start centroid ", c, " is zero or not finite"));
    }
  }
  return centroids;
}

// The starting centroids: the normalised warm start when one is given, else k-means++ seeds.
absl::StatusOr<std::vector<float>> InitialCentroids(const PointRows& points, const BalancedKMeansOptions& options,
                                                    std::vector<float>* scratch) {
  if (!options.initial_centroids.empty()) {
    return WarmStartCentroids(options.initial_centroids, options.clusters, points.dim());
  }
  return SeedKMeansPlusPlus(points, options.clusters, options.seeding_sample, options.seed, scratch);
}

// Total cost (cosine distance, weighted when `weights` is not empty) of assigning the n points to
// `assignment` under the [point][cluster] costs.
double AssignmentObjective(const std::vector<double>& cost, const std::vector<int>& assignment, int n, int k,
                           const std::vector<double>& weights) {
  double objective = 0;
  for (int i = 0; i < n; ++i) {
    objective += (weights.empty() ? 1.0 : weights[i]) * cost[static_cast<size_t>(i) * k + assignment[i]];
  }
  return objective;
}

// Moves each centroid to the renormalised (weighted, when `weights` is not empty) mean of its
// assigned points; a cluster whose points all weigh 0 takes their plain mean; an empty cluster (or
// one whose points cancel out) restarts at the next worst-served point.
void MoveCentroidsToMeans(const PointRows& points, int k, const std::vector<int>& assignment,
                          const std::vector<double>& cost, const std::vector<double>& weights,
                          std::vector<float>* centroids, std::vector<float>* scratch) {
  const int n = points.rows();
  const int dim = points.dim();
  std::vector<float> sums(static_cast<size_t>(k) * dim, 0.0f);
  std::vector<int> sizes(k, 0);
  std::vector<double> weight_of(k, 0.0);
  ForEachBlock(points, scratch, [&](int begin, int count, absl::Span<const float> rows) {
    for (int r = 0; r < count; ++r) {
      const int i = begin + r;
      const float* x = rows.data() + static_cast<size_t>(r) * dim;
      float* sum = sums.data() + static_cast<size_t>(assignment[i]) * dim;
      const float w = weights.empty() ? 1.0f : static_cast<float>(weights[i]);
      for (int d = 0; d < dim; ++d) sum[d] += w * x[d];
      ++sizes[assignment[i]];
      weight_of[assignment[i]] += w;
    }
    return absl::OkStatus();
  }).IgnoreError();  // the callback never fails
  if (!weights.empty()) {
    // Clusters holding only weightless points: their plain mean instead.
    std::vector<char> plain(k, 0);
    bool any = false;
    for (int c = 0; c < k; ++c) {
      if (sizes[c] > 0 && !(weight_of[c] > 0)) plain[c] = any = 1;
    }
    if (any) {
      ForEachBlock(points, scratch, [&](int begin, int count, absl::Span<const float> rows) {
        for (int r = 0; r < count; ++r) {
          if (!plain[assignment[begin + r]]) continue;
          const float* x = rows.data() + static_cast<size_t>(r) * dim;
          float* sum = sums.data() + static_cast<size_t>(assignment[begin + r]) * dim;
          for (int d = 0; d < dim; ++d) sum[d] += x[d];
        }
        return absl::OkStatus();
      }).IgnoreError();  // the callback never fails
    }
  }
  std::vector<int> worst_served;  // lazily: points by decreasing cost of their assignment
  size_t next_reseed = 0;
  for (int c = 0; c < k; ++c) {
    float* centre = sums.data() + static_cast<size_t>(c) * dim;
    if (sizes[c] > 0 && NormaliseRow(centre, dim)) {
      std::copy_n(centre, dim, centroids->data() + static_cast<size_t>(c) * dim);
      continue;
    }
    if (worst_served.empty()) {
      worst_served.resize(n);
      std::iota(worst_served.begin(), worst_served.end(), 0);
      std::stable_sort(worst_served.begin(), worst_served.end(), [&](int a, int b) {
        return cost[static_cast<size_t>(a) * k + assignment[a]] > cost[static_cast<size_t>(b) * k + assignment[b]];
      });
    }
    const int point = worst_served[next_reseed++ % worst_served.size()];
    const absl::Span<const float> row = points.Read(point, 1, scratch);
    std::copy(row.begin(), row.end(), centroids->begin() + static_cast<ptrdiff_t>(static_cast<size_t>(c) * dim));
  }
}

}  // namespace

absl::Span<const float> DensePointRows::Read(int begin, int count, std::vector<float>* /*scratch*/) const {
  return points_.subspan(static_cast<size_t>(begin) * dim_, static_cast<size_t>(count) * dim_);
}

void ScorePointRows(const PointRows& points, absl::Span<const float> centroids, int k, absl::Span<float> scores,
                    std::vector<float>* scratch) {
  const int dim = points.dim();
  ForEachBlock(points, scratch, [&](int begin, int count, absl::Span<const float> rows) {
    ScoreAllPairs(rows, count, centroids, k, dim,
                  scores.subspan(static_cast<size_t>(begin) * k, static_cast<size_t>(count) * k));
    return absl::OkStatus();
  }).IgnoreError();  // the callback never fails
}

absl::StatusOr<BalancedKMeansResult> FitBalancedKMeans(absl::Span<const float> points, int n, int dim,
                                                       const BalancedKMeansOptions& options) {
  if (absl::Status status = ValidateKMeansArguments(n, dim, options); !status.ok()) return status;
  if (points.size() != static_cast<size_t>(n) * dim) {
    return absl::InvalidArgumentError(absl::StrCat("balanced k-means: ", points.size(),
                                                   " values, expected n * dim = ", static_cast<int64_t>(n) * dim));
  }
  return FitBalancedKMeans(DensePointRows(points, n, dim), options);
}

absl::StatusOr<BalancedKMeansResult> FitBalancedKMeans(const PointRows& points, const BalancedKMeansOptions& options) {
  const int n = points.rows();
  const int dim = points.dim();
  std::vector<float> scratch;  // one block of decoded rows (unused by a dense matrix)
  std::optional<PointUnits> units;
  absl::StatusOr<std::vector<int>> validated = ValidatedCapacities(points, options, &scratch, &units);
  if (!validated.ok()) return validated.status();
  const std::vector<int> capacity = *std::move(validated);
  const int k = options.clusters;

  BalancedKMeansResult result;
  result.capacities = capacity;

  Clock::time_point phase = Clock::now();
  absl::StatusOr<std::vector<float>> seeded = InitialCentroids(points, options, &scratch);
  if (!seeded.ok()) return seeded.status();
  std::vector<float> centroids = *std::move(seeded);
  result.seconds_seeding = SecondsSince(phase);

  std::vector<float> scores(static_cast<size_t>(n) * k);
  std::vector<double> cost(static_cast<size_t>(n) * k);
  std::vector<int> assignment, previous;
  double previous_objective = 0;
  for (int iteration = 0; iteration < options.max_iterations; ++iteration) {
    phase = Clock::now();
    ScorePointRows(points, centroids, k, absl::MakeSpan(scores), &scratch);
    for (size_t i = 0; i < cost.size(); ++i) cost[i] = 1.0 - static_cast<double>(scores[i]);
    result.seconds_scoring += SecondsSince(phase);

    phase = Clock::now();
    if (units.has_value()) {
      absl::StatusOr<WeightedAssignment> solved =
          SolveWeightedBalancedAssignment(cost, n, k, units->units, capacity, options.assignment_method);
      if (!solved.ok()) return solved.status();
      assignment = std::move(solved->assignment);
      result.split_points = solved->split_points;
    } else {
      absl::StatusOr<std::vector<int>> solved =
          SolveBalancedAssignment(cost, n, k, capacity, options.assignment_method);
      if (!solved.ok()) return solved.status();
      assignment = *std::move(solved);
    }
    result.seconds_assignment += SecondsSince(phase);

    const double objective = AssignmentObjective(cost, assignment, n, k, options.point_weights);
    result.objective = objective;
    result.objective_per_iteration.push_back(objective);
    result.iterations = iteration + 1;
    // Stable assignment: the means would not move. Improvement within tolerance: further steps
    // only trade boundary points (tolerance 0 still stops when nothing improves, as steps can then
    // only swap points between equally good assignments).
    if (assignment == previous ||
        (iteration > 0 && previous_objective - objective <= options.tolerance * previous_objective + 1e-12 * n)) {
      result.converged = true;
      break;
    }
    if (iteration + 1 == options.max_iterations) break;  // keep centroids consistent with the assignment
    previous_objective = objective;

    phase = Clock::now();
    MoveCentroidsToMeans(points, k, assignment, cost, options.point_weights, &centroids, &scratch);
    previous = assignment;
    result.seconds_update += SecondsSince(phase);
  }

  result.sizes.assign(k, 0);
  for (int c : assignment) ++result.sizes[c];
  if (units.has_value()) {
    result.unit_weight = units->unit_weight;
    result.cluster_weights.assign(k, 0.0);
    for (int i = 0; i < n; ++i) result.cluster_weights[assignment[i]] += options.point_weights[i];
  }
  result.assignment = std::move(assignment);
  result.centroids = std::move(centroids);
  return result;
}

}  // namespace eldr
