#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "eldr/calib/calibration.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

using ::testing::HasSubstr;

struct Planted {
  std::vector<float> points;  // n * dim unit rows
  std::vector<int> truth;     // planted cluster of each point
  std::vector<float> centres;
};

// `sizes[c]` points around each of sizes.size() random unit centres, with Gaussian noise.
Planted MakePlanted(const std::vector<int>& sizes, int dim, float noise, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  Planted p;
  const int k = static_cast<int>(sizes.size());
  p.centres.resize(k * dim);
  for (float& x : p.centres) x = normal(rng);
  auto normalise = [dim](float* row) {
    double s = 0;
    for (int d = 0; d < dim; ++d) s += row[d] * row[d];
    for (int d = 0; d < dim; ++d) row[d] = static_cast<float>(row[d] / std::sqrt(s));
  };
  for (int c = 0; c < k; ++c) normalise(&p.centres[c * dim]);
  for (int c = 0; c < k; ++c) {
    for (int i = 0; i < sizes[c]; ++i) {
      std::vector<float> row(dim);
      for (int d = 0; d < dim; ++d) row[d] = p.centres[c * dim + d] + noise * normal(rng);
      normalise(row.data());
      p.points.insert(p.points.end(), row.begin(), row.end());
      p.truth.push_back(c);
    }
  }
  return p;
}

// Fraction of points whose cluster's majority planted label is their own.
double Purity(const std::vector<int>& assignment, const std::vector<int>& truth, int k) {
  std::vector<std::map<int, int>> counts(k);
  for (size_t i = 0; i < truth.size(); ++i) ++counts[assignment[i]][truth[i]];
  int majority = 0;
  for (const auto& c : counts) {
    int best = 0;
    for (const auto& [label, count] : c) best = std::max(best, count);
    majority += best;
  }
  return static_cast<double>(majority) / truth.size();
}

TEST(BalancedKMeansTest, RecoversBalancedPlantedClusters) {
  const Planted p = MakePlanted(std::vector<int>(6, 50), 40, 0.15f, 1);
  BalancedKMeansOptions options;
  options.clusters = 6;
  options.seed = 3;
  absl::StatusOr<BalancedKMeansResult> fit = FitBalancedKMeans(p.points, 300, 40, options);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_TRUE(fit->converged);
  EXPECT_EQ(fit->sizes, std::vector<int>(6, 50));
  EXPECT_DOUBLE_EQ(Purity(fit->assignment, p.truth, 6), 1.0);
  for (int c = 0; c < 6; ++c) {
    double norm = 0;
    for (int d = 0; d < 40; ++d) norm += fit->centroids[c * 40 + d] * fit->centroids[c * 40 + d];
    EXPECT_NEAR(norm, 1.0, 1e-5);
  }
}

TEST(BalancedKMeansTest, SameSeedSameResult) {
  const Planted p = MakePlanted({80, 30, 60, 20, 10}, 24, 0.4f, 2);
  const int n = static_cast<int>(p.truth.size());
  BalancedKMeansOptions options;
  options.clusters = 5;
  options.seed = 42;
  const auto a = FitBalancedKMeans(p.points, n, 24, options);
  const auto b = FitBalancedKMeans(p.points, n, 24, options);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->assignment, b->assignment);
  EXPECT_EQ(a->centroids, b->centroids);
  EXPECT_EQ(a->objective, b->objective);
  EXPECT_EQ(a->iterations, b->iterations);
}

TEST(BalancedKMeansTest, CapacitiesBindOnUnbalancedData) {
  // One planted cluster holds most points, but no fitted cluster may exceed ceil(n / k).
  const Planted p = MakePlanted({200, 20, 20, 20}, 16, 0.3f, 5);
  const int n = 260;
  BalancedKMeansOptions options;
  options.clusters = 4;
  options.seed = 1;
  absl::StatusOr<BalancedKMeansResult> fit = FitBalancedKMeans(p.points, n, 16, options);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_EQ(fit->capacities, std::vector<int>(4, 65));
  for (int s : fit->sizes) EXPECT_LE(s, 65);
  EXPECT_EQ(std::accumulate(fit->sizes.begin(), fit->sizes.end(), 0), n);
}

TEST(BalancedKMeansTest, HeterogeneousWeightsScaleClusterSizes) {
  const Planted p = MakePlanted(std::vector<int>(4, 100), 16, 0.5f, 6);
  BalancedKMeansOptions options;
  options.clusters = 4;
  options.capacity_weights = {1, 1, 2, 4};
  absl::StatusOr<BalancedKMeansResult> fit = FitBalancedKMeans(p.points, 400, 16, options);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_EQ(fit->capacities, (std::vector<int>{50, 50, 100, 200}));
  // Capacities are tight (they sum to n), so every cluster is filled to its weight's share.
  EXPECT_EQ(fit->sizes, fit->capacities);
}

TEST(BalancedKMeansTest, WeightsBalanceWorkNotCounts) {
  // Four planted clusters of 100 points; the first one's requests carry 5x the decode work. An
  // unweighted fit gives each cluster 100 points (a quarter of the count, 5/8 of the work for the
  // heavy one); the weighted fit bounds every cluster's work by a quarter of the total.
  const int n = 400, dim = 16, k = 4;
  const Planted p = MakePlanted(std::vector<int>(4, 100), dim, 0.4f, 8);
  std::vector<double> weights(n);
  for (int i = 0; i < n; ++i) weights[i] = p.truth[i] == 0 ? 50.0 : 10.0;
  const double total = 100 * 50.0 + 300 * 10.0;
  BalancedKMeansOptions options;
  options.clusters = k;
  options.seed = 3;
  absl::StatusOr<BalancedKMeansResult> plain = FitBalancedKMeans(p.points, n, dim, options);
  options.point_weights = weights;
  absl::StatusOr<BalancedKMeansResult> weighted = FitBalancedKMeans(p.points, n, dim, options);
  ASSERT_TRUE(plain.ok() && weighted.ok()) << plain.status() << weighted.status();

  auto work_of = [&](const std::vector<int>& assignment) {
    std::vector<double> work(k, 0);
    for (int i = 0; i < n; ++i) work[assignment[i]] += weights[i];
    return work;
  };
  const std::vector<double> plain_work = work_of(plain->assignment);
  const std::vector<double> weighted_work = work_of(weighted->assignment);
  EXPECT_GT(*std::max_element(plain_work.begin(), plain_work.end()), 0.45 * total);
  ASSERT_EQ(weighted->cluster_weights.size(), static_cast<size_t>(k));
  const double unit = weighted->unit_weight;
  EXPECT_NEAR(unit, total / (n * options.weight_resolution), 1e-9);
  for (int c = 0; c < k; ++c) {
    EXPECT_DOUBLE_EQ(weighted->cluster_weights[c], weighted_work[c]);
    // Capacity in units, plus at most the split points' work rounded into it (one point here).
    EXPECT_LE(weighted_work[c], weighted->capacities[c] * unit + 50.0 * (weighted->split_points)) << "cluster " << c;
  }
  EXPECT_LT(*std::max_element(weighted_work.begin(), weighted_work.end()), 0.3 * total);
  // The heavy planted cluster is spread: its points no longer share one fitted cluster.
  std::set<int> heavy_clusters;
  for (int i = 0; i < n; ++i) {
    if (p.truth[i] == 0) heavy_clusters.insert(weighted->assignment[i]);
  }
  EXPECT_GE(heavy_clusters.size(), 2u);
}

TEST(BalancedKMeansTest, EqualWeightsAtResolutionOneReproduceTheUnweightedFit) {
  const Planted p = MakePlanted({60, 50, 40}, 12, 0.5f, 9);
  BalancedKMeansOptions options;
  options.clusters = 3;
  options.seed = 4;
  absl::StatusOr<BalancedKMeansResult> plain = FitBalancedKMeans(p.points, 150, 12, options);
  options.point_weights.assign(150, 2.5);
  options.weight_resolution = 1;
  absl::StatusOr<BalancedKMeansResult> weighted = FitBalancedKMeans(p.points, 150, 12, options);
  ASSERT_TRUE(plain.ok() && weighted.ok());
  EXPECT_EQ(weighted->assignment, plain->assignment);
  ASSERT_EQ(weighted->centroids.size(), plain->centroids.size());
  for (size_t i = 0; i < plain->centroids.size(); ++i) {
    EXPECT_NEAR(weighted->centroids[i], plain->centroids[i], 1e-6) << i;  // scaled sums round differently
  }
  EXPECT_NEAR(weighted->objective, 2.5 * plain->objective, 1e-6 * plain->objective);
}

TEST(BalancedKMeansTest, RejectsBadWeights) {
  const Planted p = MakePlanted({10, 10}, 8, 0.3f, 10);
  BalancedKMeansOptions options;
  options.clusters = 2;
  options.point_weights.assign(19, 1.0);
  EXPECT_THAT(FitBalancedKMeans(p.points, 20, 8, options).status().message(), HasSubstr("19 point weights"));
  options.point_weights.assign(20, 1.0);
  options.point_weights[4] = -1;
  EXPECT_THAT(FitBalancedKMeans(p.points, 20, 8, options).status().message(), HasSubstr("weight of point 4"));
  options.point_weights.assign(20, 0.0);
  EXPECT_THAT(FitBalancedKMeans(p.points, 20, 8, options).status().message(), HasSubstr("sum to zero"));
  options.point_weights.assign(20, 1.0);
  options.weight_resolution = 0;
  EXPECT_THAT(FitBalancedKMeans(p.points, 20, 8, options).status().message(), HasSubstr("weight_resolution"));
}

TEST(BalancedKMeansTest, ObjectiveNeverIncreases) {
  const Planted p = MakePlanted({70, 50, 40, 30, 30, 20, 10, 10}, 20, 0.8f, 8);
  BalancedKMeansOptions options;
  options.clusters = 8;
  options.seed = 11;
  options.max_iterations = 100;
  absl::StatusOr<BalancedKMeansResult> fit = FitBalancedKMeans(p.points, 260, 20, options);
  ASSERT_TRUE(fit.ok()) << fit.status();
  ASSERT_GE(fit->objective_per_iteration.size(), 2u);
  for (size_t i = 1; i < fit->objective_per_iteration.size(); ++i) {
    EXPECT_LE(fit->objective_per_iteration[i], fit->objective_per_iteration[i - 1] + 1e-6) << "iteration " << i;
  }
  EXPECT_EQ(fit->objective, fit->objective_per_iteration.back());
  // The reported objective is the cosine distance of the final assignment to the final centroids.
  double recomputed = 0;
  for (int i = 0; i < 260; ++i) {
    double dot = 0;
    for (int d = 0; d < 20; ++d) dot += p.points[i * 20 + d] * fit->centroids[fit->assignment[i] * 20 + d];
    recomputed += 1 - dot;
  }
  EXPECT_NEAR(fit->objective, recomputed, 1e-3);
}

TEST(BalancedKMeansTest, WarmStartFromTheTruthConvergesAtOnce) {
  const Planted p = MakePlanted(std::vector<int>(5, 40), 30, 0.1f, 9);
  BalancedKMeansOptions options;
  options.clusters = 5;
  options.initial_centroids = p.centres;
  absl::StatusOr<BalancedKMeansResult> fit = FitBalancedKMeans(p.points, 200, 30, options);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_LE(fit->iterations, 2);
  EXPECT_EQ(fit->assignment, p.truth);  // warm start keeps row identities
}

TEST(BalancedKMeansTest, SeedingSampleStillCoversLargeInputs) {
  const Planted p = MakePlanted(std::vector<int>(8, 300), 12, 0.2f, 10);
  BalancedKMeansOptions options;
  options.clusters = 8;
  options.seeding_sample = 200;
  absl::StatusOr<BalancedKMeansResult> fit = FitBalancedKMeans(p.points, 2400, 12, options);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_GT(Purity(fit->assignment, p.truth, 8), 0.95);
}

// Rows served through PointRows a few at a time, copied into the caller's scratch (as a store
// that decodes would), to check that the blocked passes compute what the dense ones do.
class CopiedBlocks final : public PointRows {
 public:
  CopiedBlocks(const std::vector<float>& points, int dim, int block) : points_(points), dim_(dim), block_(block) {}
  int rows() const override { return static_cast<int>(points_.size()) / dim_; }
  int dim() const override { return dim_; }
  int block_rows() const override { return block_; }
  absl::Span<const float> Read(int begin, int count, std::vector<float>* scratch) const override {
    ++reads_;
    scratch->assign(points_.begin() + static_cast<ptrdiff_t>(begin) * dim_,
                    points_.begin() + static_cast<ptrdiff_t>(begin + count) * dim_);
    return *scratch;
  }
  int reads() const { return reads_; }

 private:
  const std::vector<float>& points_;
  const int dim_, block_;
  mutable int reads_ = 0;
};

// Blocks of 7 rows: scoring, means, validation and k-means++ seeding on a sample larger than a
// block (read again per cluster) all go through Read, and the fit is the dense one.
TEST(BalancedKMeansTest, BlockwiseReadingMatchesTheDenseFit) {
  const Planted p = MakePlanted({70, 50, 40, 30, 30, 20}, 20, 0.6f, 12);
  const int n = static_cast<int>(p.truth.size());
  BalancedKMeansOptions options;
  options.clusters = 6;
  options.seed = 5;
  options.seeding_sample = 100;
  options.tolerance = 0;
  const absl::StatusOr<BalancedKMeansResult> dense = FitBalancedKMeans(p.points, n, 20, options);
  const CopiedBlocks blocks(p.points, 20, 7);
  const absl::StatusOr<BalancedKMeansResult> blocked = FitBalancedKMeans(blocks, options);
  ASSERT_TRUE(dense.ok() && blocked.ok());
  EXPECT_GT(blocks.reads(), 6 * (100 / 7) + dense->iterations * (n / 7));
  EXPECT_EQ(blocked->assignment, dense->assignment);
  EXPECT_EQ(blocked->iterations, dense->iterations);
  ASSERT_EQ(blocked->centroids.size(), dense->centroids.size());
  for (size_t i = 0; i < dense->centroids.size(); ++i) EXPECT_NEAR(blocked->centroids[i], dense->centroids[i], 1e-6);
  EXPECT_NEAR(blocked->objective, dense->objective, 1e-4);
  // Errors name the same point as the dense path.
  std::vector<float> bad = p.points;
  bad[20 * 9 + 3] = std::nanf("");
  EXPECT_THAT(FitBalancedKMeans(CopiedBlocks(bad, 20, 7), options).status().message(),
              HasSubstr("point 9 has a non-finite value at index 3"));
}

TEST(BalancedKMeansTest, RejectsBadInput) {
  const Planted p = MakePlanted({5, 5}, 4, 0.1f, 1);
  BalancedKMeansOptions options;
  options.clusters = 16;
  EXPECT_THAT(FitBalancedKMeans(p.points, 10, 4, options).status().message(), HasSubstr("10 points for 16 clusters"));
  options.clusters = 2;
  EXPECT_THAT(FitBalancedKMeans(p.points, 11, 4, options).status().message(), HasSubstr("expected n * dim"));
  std::vector<float> bad = p.points;
  bad[4 * 3 + 1] = std::nanf("");
  EXPECT_THAT(FitBalancedKMeans(bad, 10, 4, options).status().message(),
              HasSubstr("point 3 has a non-finite value at index 1"));
  bad = p.points;
  for (int d = 0; d < 4; ++d) bad[4 * 2 + d] *= 3;
  EXPECT_THAT(FitBalancedKMeans(bad, 10, 4, options).status().message(), HasSubstr("point 2 has norm"));
  options.capacity_weights = {1, 0};
  EXPECT_THAT(FitBalancedKMeans(p.points, 10, 4, options).status().message(), HasSubstr("capacity weights"));
  options.capacity_weights = {};
  options.initial_centroids = std::vector<float>(7, 0.5f);
  EXPECT_THAT(FitBalancedKMeans(p.points, 10, 4, options).status().message(), HasSubstr("warm start has 7"));
  options.initial_centroids = std::vector<float>(8, 0.0f);
  EXPECT_THAT(FitBalancedKMeans(p.points, 10, 4, options).status().message(),
              HasSubstr("warm-start centroid 0 is zero"));
}

}  // namespace
}  // namespace eldr
