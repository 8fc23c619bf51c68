// Exactness of the balanced assignment: both min-cost-flow methods against a plain Hungarian
// algorithm on the replicated problem (each cluster j copied capacities[j] times).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "eldr/calib/calibration.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

using ::testing::HasSubstr;

// Minimum-cost assignment of n rows to distinct columns of an n x m matrix (n <= m), O(n^2 m):
// the shortest-augmenting-path Hungarian method with row and column potentials. Returns the total.
double HungarianMinCost(const std::vector<std::vector<double>>& a) {
  const int n = static_cast<int>(a.size());
  const int m = static_cast<int>(a[0].size());
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> u(n + 1, 0), v(m + 1, 0);
  std::vector<int> p(m + 1, 0), way(m + 1, 0);  // p[j]: row (1-based) matched to column j
  for (int i = 1; i <= n; ++i) {
    p[0] = i;
    int j0 = 0;
    std::vector<double> minv(m + 1, inf);
    std::vector<char> used(m + 1, 0);
    do {
      used[j0] = 1;
      const int i0 = p[j0];
      double delta = inf;
      int j1 = 0;
      for (int j = 1; j <= m; ++j) {
        if (used[j]) continue;
        const double cur = a[i0 - 1][j - 1] - u[i0] - v[j];
        if (cur < minv[j]) {
          minv[j] = cur;
          way[j] = j0;
        }
        if (minv[j] < delta) {
          delta = minv[j];
          j1 = j;
        }
      }
      for (int j = 0; j <= m; ++j) {
        if (used[j]) {
          u[p[j]] += delta;
          v[j] -= delta;
        } else {
          minv[j] -= delta;
        }
      }
      j0 = j1;
    } while (p[j0] != 0);
    do {
      const int j1 = way[j0];
      p[j0] = p[j1];
      j0 = j1;
    } while (j0 != 0);
  }
  double total = 0;
  for (int j = 1; j <= m; ++j) {
    if (p[j] != 0) total += a[p[j] - 1][j - 1];
  }
  return total;
}

double ReplicatedHungarian(const std::vector<double>& cost, int n, int k, const std::vector<int>& capacity) {
  std::vector<int> column_cluster;
  for (int j = 0; j < k; ++j) {
    for (int c = 0; c < std::min(capacity[j], n); ++c) column_cluster.push_back(j);
  }
  std::vector<std::vector<double>> a(n, std::vector<double>(column_cluster.size()));
  for (int i = 0; i < n; ++i) {
    for (size_t c = 0; c < column_cluster.size(); ++c) a[i][c] = cost[i * k + column_cluster[c]];
  }
  return HungarianMinCost(a);
}

struct Checked {
  double total = 0;
  std::vector<int> sizes;
};

Checked CheckFeasible(const std::vector<int>& assignment, const std::vector<double>& cost, int n, int k,
                      const std::vector<int>& capacity) {
  Checked out;
  out.sizes.assign(k, 0);
  EXPECT_EQ(assignment.size(), static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    EXPECT_GE(assignment[i], 0);
    EXPECT_LT(assignment[i], k);
    ++out.sizes[assignment[i]];
    out.total += cost[i * k + assignment[i]];
  }
  for (int j = 0; j < k; ++j) EXPECT_LE(out.sizes[j], capacity[j]) << "cluster " << j;
  return out;
}

// Random capacities summing to at least n, some of them zero.
std::vector<int> RandomCapacities(int n, int k, std::mt19937_64& rng) {
  std::vector<int> capacity(k, 0);
  for (int placed = 0; placed < n + static_cast<int>(rng() % 3); ++placed) ++capacity[rng() % k];
  return capacity;
}

TEST(BalancedAssignmentTest, MatchesHungarianOnRandomInstances) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> uniform(0.0, 2.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 30);
    const int k = 1 + static_cast<int>(rng() % 7);
    std::vector<double> cost(n * k);
    for (double& c : cost) c = uniform(rng);
    const std::vector<int> capacity = trial % 2 == 0 ? RandomCapacities(n, k, rng) : ClusterCapacities(n, k, {});
    const double optimum = ReplicatedHungarian(cost, n, k, capacity);
    // Integer scaling costs at most one grid step (2 / 2^30) per point.
    const double tolerance = n * 2.0 / (1 << 30) + 1e-12;
    for (AssignmentMethod method :
         {AssignmentMethod::kNetworkSimplex, AssignmentMethod::kClusterPaths, AssignmentMethod::kAuto}) {
      absl::StatusOr<std::vector<int>> assignment = SolveBalancedAssignment(cost, n, k, capacity, method);
      ASSERT_TRUE(assignment.ok()) << assignment.status();
      const Checked checked = CheckFeasible(*assignment, cost, n, k, capacity);
      EXPECT_NEAR(checked.total, optimum, tolerance)
          << "trial " << trial << " n=" << n << " k=" << k << " method " << static_cast<int>(method);
    }
  }
}

TEST(BalancedAssignmentTest, IntegerCostsWithTiesAreExactlyOptimal) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 35);
    const int k = 2 + static_cast<int>(rng() % 6);
    std::vector<double> cost(n * k);
    for (double& c : cost) c = static_cast<double>(rng() % 4);  // many ties
    const std::vector<int> capacity = RandomCapacities(n, k, rng);
    const double optimum = ReplicatedHungarian(cost, n, k, capacity);
    for (AssignmentMethod method : {AssignmentMethod::kNetworkSimplex, AssignmentMethod::kClusterPaths}) {
      absl::StatusOr<std::vector<int>> assignment = SolveBalancedAssignment(cost, n, k, capacity, method);
      ASSERT_TRUE(assignment.ok()) << assignment.status();
      EXPECT_EQ(CheckFeasible(*assignment, cost, n, k, capacity).total, optimum) << "trial " << trial;
    }
  }
}

TEST(BalancedAssignmentTest, HeterogeneousCapacitiesAgainstHungarian) {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> uniform(0.0, 2.0);
  const std::vector<double> weights = {1, 2, 1, 4};
  for (int trial = 0; trial < 50; ++trial) {
    const int n = 8 + static_cast<int>(rng() % 30);
    const int k = 4;
    const std::vector<int> capacity = ClusterCapacities(n, k, weights);
    std::vector<double> cost(n * k);
    for (double& c : cost) c = uniform(rng);
    const double optimum = ReplicatedHungarian(cost, n, k, capacity);
    absl::StatusOr<std::vector<int>> assignment = SolveBalancedAssignment(cost, n, k, capacity);
    ASSERT_TRUE(assignment.ok()) << assignment.status();
    const Checked checked = CheckFeasible(*assignment, cost, n, k, capacity);
    EXPECT_NEAR(checked.total, optimum, n * 2.0 / (1 << 30) + 1e-12);
  }
}

TEST(BalancedAssignmentTest, BothMethodsAgreeOnLargerSkewedInstances) {
  // Most points prefer the first clusters, so capacities bind hard and long chains of moves occur.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int trial = 0; trial < 4; ++trial) {
    const int n = 1500, k = 12;
    std::vector<double> cost(n * k);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < k; ++j) cost[i * k + j] = 0.1 * j + 0.5 * uniform(rng);
    }
    const std::vector<int> capacity = ClusterCapacities(n, k, {});
    absl::StatusOr<std::vector<int>> simplex =
        SolveBalancedAssignment(cost, n, k, capacity, AssignmentMethod::kNetworkSimplex);
    absl::StatusOr<std::vector<int>> paths =
        SolveBalancedAssignment(cost, n, k, capacity, AssignmentMethod::kClusterPaths);
    ASSERT_TRUE(simplex.ok() && paths.ok());
    const Checked a = CheckFeasible(*simplex, cost, n, k, capacity);
    const Checked b = CheckFeasible(*paths, cost, n, k, capacity);
    EXPECT_NEAR(a.total, b.total, n * 2.0 / (1 << 30));
    // 12 * 125 = 1500: capacities are tight, so every cluster is exactly full.
    EXPECT_EQ(b.sizes, capacity);
  }
}

TEST(BalancedAssignmentTest, DeterministicForTheSameInput) {
  std::mt19937_64 rng(9);
  std::vector<double> cost(400 * 8);
  for (double& c : cost) c = static_cast<double>(rng() % 5);
  const std::vector<int> capacity = ClusterCapacities(400, 8, {});
  const auto first = SolveBalancedAssignment(cost, 400, 8, capacity, AssignmentMethod::kClusterPaths);
  const auto second = SolveBalancedAssignment(cost, 400, 8, capacity, AssignmentMethod::kClusterPaths);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(*first, *second);
}

TEST(BalancedAssignmentTest, RejectsBadInput) {
  const std::vector<double> cost = {0, 1, 1, 0, 0.5, 0.5};
  EXPECT_THAT(SolveBalancedAssignment(cost, 3, 2, std::vector<int>{1, 1}).status().message(),
              HasSubstr("capacities sum to 2, fewer than the 3 points"));
  EXPECT_THAT(SolveBalancedAssignment(cost, 2, 2, std::vector<int>{2, 2}).status().message(),
              HasSubstr("expected n * k"));
  EXPECT_THAT(SolveBalancedAssignment(cost, 3, 2, std::vector<int>{2}).status().message(),
              HasSubstr("1 capacities for k = 2"));
  EXPECT_THAT(SolveBalancedAssignment(cost, 3, 2, std::vector<int>{-1, 4}).status().message(),
              HasSubstr("capacity of cluster 0 is -1"));
  std::vector<double> with_nan = cost;
  with_nan[3] = std::nan("");
  EXPECT_THAT(SolveBalancedAssignment(with_nan, 3, 2, std::vector<int>{2, 2}).status().message(),
              HasSubstr("cost of point 1 for cluster 1 is not finite"));
  EXPECT_FALSE(SolveBalancedAssignment({}, 0, 2, std::vector<int>{1, 1}).ok());
}

TEST(ClusterCapacitiesTest, EqualAndWeighted) {
  EXPECT_EQ(ClusterCapacities(100, 16, {}), std::vector<int>(16, 7));
  EXPECT_EQ(ClusterCapacities(96, 16, {}), std::vector<int>(16, 6));
  EXPECT_EQ(ClusterCapacities(100, 3, std::vector<double>{1, 2, 1}), (std::vector<int>{25, 50, 25}));
  EXPECT_EQ(ClusterCapacities(10, 3, std::vector<double>{1, 1, 1}), (std::vector<int>{4, 4, 4}));
  EXPECT_TRUE(ClusterCapacities(10, 2, std::vector<double>{1, 0}).empty());
  EXPECT_TRUE(ClusterCapacities(10, 2, std::vector<double>{1, -2}).empty());
  EXPECT_TRUE(ClusterCapacities(10, 3, std::vector<double>{1, 1}).empty());
  EXPECT_TRUE(ClusterCapacities(10, 0, {}).empty());
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<double> uniform(0.01, 10.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = static_cast<int>(rng() % 5000), k = 1 + static_cast<int>(rng() % 40);
    std::vector<double> weights(k);
    for (double& w : weights) w = uniform(rng);
    const std::vector<int> capacity = ClusterCapacities(n, k, weights);
    ASSERT_EQ(capacity.size(), static_cast<size_t>(k));
    const double total_weight = std::accumulate(weights.begin(), weights.end(), 0.0);
    int64_t sum = 0;
    for (int j = 0; j < k; ++j) {
      sum += capacity[j];
      EXPECT_GE(capacity[j], n * weights[j] / total_weight - 1e-6);          // at least its share
      EXPECT_LE(capacity[j], std::ceil(n * weights[j] / total_weight) + 1);  // and not much more
    }
    EXPECT_GE(sum, n);
  }
}

TEST(AlignCentroidsTest, RecoversAPermutationOfNoisyRows) {
  const int k = 9, dim = 32;
  std::mt19937_64 rng(4);
  std::normal_distribution<float> normal;
  std::vector<float> old_rows(k * dim), new_rows(k * dim);
  for (float& x : old_rows) x = normal(rng);
  std::vector<int> permutation(k);
  std::iota(permutation.begin(), permutation.end(), 0);
  std::shuffle(permutation.begin(), permutation.end(), rng);
  for (int i = 0; i < k; ++i) {
    for (int d = 0; d < dim; ++d) new_rows[permutation[i] * dim + d] = old_rows[i * dim + d] + 0.2f * normal(rng);
  }
  auto normalise = [&](std::vector<float>& rows) {
    for (int i = 0; i < k; ++i) {
      double s = 0;
      for (int d = 0; d < dim; ++d) s += rows[i * dim + d] * rows[i * dim + d];
      for (int d = 0; d < dim; ++d) rows[i * dim + d] /= std::sqrt(s);
    }
  };
  normalise(old_rows);
  normalise(new_rows);
  EXPECT_EQ(AlignCentroids(old_rows, new_rows, k, dim), permutation);

  // Rectangular: the old rows find their new rows among extra ones.
  std::vector<float> more = new_rows;
  std::vector<float> extra(3 * dim);
  for (float& x : extra) x = normal(rng);
  more.insert(more.end(), extra.begin(), extra.end());
  for (int i = k; i < k + 3; ++i) {
    double s = 0;
    for (int d = 0; d < dim; ++d) s += more[i * dim + d] * more[i * dim + d];
    for (int d = 0; d < dim; ++d) more[i * dim + d] /= std::sqrt(s);
  }
  EXPECT_EQ(AlignCentroids(old_rows, k, more, k + 3, dim), permutation);
  EXPECT_TRUE(AlignCentroids(more, k + 3, old_rows, k, dim).empty());
  EXPECT_TRUE(AlignCentroids(old_rows, new_rows, k + 1, dim).empty());
}

}  // namespace
}  // namespace eldr
