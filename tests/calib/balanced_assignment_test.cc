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

// The splittable weighted problem solved independently: successive shortest paths with
// Bellman-Ford on the unreplicated network source -> point (supply units[i]) -> cluster (cost) ->
// sink (capacity), augmenting by the path's bottleneck. Returns the optimal total cost.
double TransportationMinCost(const std::vector<double>& cost, int n, int k, const std::vector<int>& units,
                             const std::vector<int>& capacity) {
  // Nodes: 0 source, 1..n points, n+1..n+k clusters, n+k+1 sink.
  const int nodes = n + k + 2, source = 0, sink = n + k + 1;
  struct Arc {
    int to;
    int capacity;
    double cost;
    int reverse;
  };
  std::vector<std::vector<Arc>> graph(nodes);
  auto add = [&](int from, int to, int cap, double c) {
    graph[from].push_back(Arc{to, cap, c, static_cast<int>(graph[to].size())});
    graph[to].push_back(Arc{from, 0, -c, static_cast<int>(graph[from].size()) - 1});
  };
  int supply = 0;
  for (int i = 0; i < n; ++i) {
    add(source, 1 + i, units[i], 0);
    supply += units[i];
    for (int j = 0; j < k; ++j) add(1 + i, 1 + n + j, units[i], cost[i * k + j]);
  }
  for (int j = 0; j < k; ++j) add(1 + n + j, sink, capacity[j], 0);
  double total = 0;
  while (supply > 0) {
    std::vector<double> dist(nodes, std::numeric_limits<double>::infinity());
    std::vector<std::pair<int, int>> parent(nodes, {-1, -1});
    dist[source] = 0;
    for (int round = 0; round < nodes; ++round) {
      bool changed = false;
      for (int u = 0; u < nodes; ++u) {
        if (dist[u] == std::numeric_limits<double>::infinity()) continue;
        for (size_t a = 0; a < graph[u].size(); ++a) {
          const Arc& arc = graph[u][a];
          if (arc.capacity > 0 && dist[u] + arc.cost < dist[arc.to] - 1e-12) {
            dist[arc.to] = dist[u] + arc.cost;
            parent[arc.to] = {u, static_cast<int>(a)};
            changed = true;
          }
        }
      }
      if (!changed) break;
    }
    if (parent[sink].first < 0) return std::numeric_limits<double>::infinity();
    int bottleneck = supply;
    for (int v = sink; v != source; v = parent[v].first) {
      bottleneck = std::min(bottleneck, graph[parent[v].first][parent[v].second].capacity);
    }
    for (int v = sink; v != source; v = parent[v].first) {
      Arc& arc = graph[parent[v].first][parent[v].second];
      arc.capacity -= bottleneck;
      graph[v][arc.reverse].capacity += bottleneck;
    }
    total += bottleneck * dist[sink];
    supply -= bottleneck;
  }
  return total;
}

TEST(WeightedBalancedAssignmentTest, SplitOptimumMatchesAnIndependentTransportationSolver) {
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<double> uniform(0.0, 2.0);
  int split_instances = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 25);
    const int k = 1 + static_cast<int>(rng() % 6);
    std::vector<double> cost(n * k);
    for (double& c : cost) c = uniform(rng);
    std::vector<int> units(n);
    int total_units = 0;
    for (int& u : units) total_units += (u = static_cast<int>(rng() % 7));  // zeros included
    if (total_units == 0) units[0] = total_units = 3;
    const std::vector<int> capacity =
        trial % 2 == 0 ? RandomCapacities(total_units, k, rng) : ClusterCapacities(total_units, k, {});
    const double optimum = TransportationMinCost(cost, n, k, units, capacity);
    const double tolerance = total_units * 2.0 / (1 << 30) + 1e-9;
    for (AssignmentMethod method : {AssignmentMethod::kNetworkSimplex, AssignmentMethod::kClusterPaths}) {
      absl::StatusOr<WeightedAssignment> solved = SolveWeightedBalancedAssignment(cost, n, k, units, capacity, method);
      ASSERT_TRUE(solved.ok()) << solved.status();
      ASSERT_EQ(solved->units_per_cluster.size(), static_cast<size_t>(n * k));
      double total = 0;
      std::vector<int> load(k, 0), rounded_load(k, 0), split_units(k, 0);
      int splits = 0;
      for (int i = 0; i < n; ++i) {
        int held = 0, most = 0, clusters_used = 0;
        for (int j = 0; j < k; ++j) {
          const int u = solved->units_per_cluster[i * k + j];
          ASSERT_GE(u, 0);
          held += u;
          most = std::max(most, u);
          clusters_used += u > 0;
          load[j] += u;
          total += u * cost[i * k + j];
        }
        EXPECT_EQ(held, units[i]) << "every unit of point " << i << " is placed";
        const int a = solved->assignment[i];
        ASSERT_GE(a, 0);
        ASSERT_LT(a, k);
        if (units[i] == 0) {
          // A weightless point goes to its cheapest cluster.
          EXPECT_EQ(cost[i * k + a], *std::min_element(cost.begin() + i * k, cost.begin() + (i + 1) * k));
        } else {
          EXPECT_EQ(solved->units_per_cluster[i * k + a], most) << "a point goes where most of its units went";
        }
        rounded_load[a] += units[i];
        if (clusters_used > 1) {
          ++splits;
          split_units[a] += units[i];
        }
      }
      EXPECT_EQ(solved->split_points, splits);
      split_instances += splits > 0;
      for (int j = 0; j < k; ++j) {
        EXPECT_LE(load[j], capacity[j]) << "the split optimum respects every capacity";
        EXPECT_LE(rounded_load[j], capacity[j] + split_units[j]) << "rounding overshoots by split points only";
      }
      EXPECT_NEAR(total, optimum, tolerance) << "trial " << trial << " n=" << n << " k=" << k;
    }
  }
  EXPECT_GT(split_instances, 0) << "the instances must exercise split points";
}

TEST(WeightedBalancedAssignmentTest, UnitWeightsAreTheUnweightedProblem) {
  std::mt19937_64 rng(29);
  std::uniform_real_distribution<double> uniform(0.0, 2.0);
  const int n = 40, k = 5;
  std::vector<double> cost(n * k);
  for (double& c : cost) c = uniform(rng);
  const std::vector<int> capacity = ClusterCapacities(n, k, {});
  absl::StatusOr<WeightedAssignment> weighted =
      SolveWeightedBalancedAssignment(cost, n, k, std::vector<int>(n, 1), capacity);
  absl::StatusOr<std::vector<int>> plain = SolveBalancedAssignment(cost, n, k, capacity);
  ASSERT_TRUE(weighted.ok() && plain.ok());
  EXPECT_EQ(weighted->assignment, *plain);
  EXPECT_EQ(weighted->split_points, 0);
}

TEST(WeightedBalancedAssignmentTest, RejectsBadInput) {
  const std::vector<double> cost(6, 0.5);
  const std::vector<int> capacity = {3, 3};
  EXPECT_THAT(SolveWeightedBalancedAssignment(cost, 3, 2, {1, 1}, capacity).status().message(),
              HasSubstr("2 unit counts for n = 3"));
  EXPECT_THAT(SolveWeightedBalancedAssignment(cost, 3, 2, {1, -1, 1}, capacity).status().message(),
              HasSubstr("point 1 has -1 units"));
  EXPECT_THAT(SolveWeightedBalancedAssignment(cost, 3, 2, {4, 4, 4}, capacity).status().message(),
              HasSubstr("capacities sum to 6"));
  std::vector<double> bad = cost;
  bad[3] = std::nan("");
  EXPECT_THAT(SolveWeightedBalancedAssignment(bad, 3, 2, {0, 0, 0}, capacity).status().message(),
              HasSubstr("not finite"));
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
