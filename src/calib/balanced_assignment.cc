// Exact capacity-constrained assignment (a transportation problem) by min-cost flow, two ways:
// LEMON's NetworkSimplex on the bipartite graph, and successive shortest paths over the k clusters.
// Both run on the same integer-scaled costs, so both return optimal solutions of the same problem.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "eldr/calib/calibration.h"
#include "lemon/network_simplex.h"
#include "lemon/static_graph.h"

namespace eldr {
namespace {

// Largest scaled cost. Shifted costs are rounded onto [0, kCostGrid].
constexpr double kCostGrid = static_cast<double>(int64_t{1} << 30);
// NetworkSimplex runs with double potentials: keep every potential an integer below 2^53 (its
// artificial arcs cost (max cost + 1) * nodes), so its arithmetic stays exact.
constexpr double kDoubleExactLimit = static_cast<double>(int64_t{1} << 49);

struct IntegerProblem {
  int n = 0;
  int k = 0;
  std::vector<int32_t> cost;  // n * k, each row shifted to start at 0, in [0, kCostGrid]
  std::vector<int> capacity;  // k, each clamped to n
};

absl::StatusOr<IntegerProblem> MakeIntegerProblem(absl::Span<const double> cost, int n, int k,
                                                  absl::Span<const int> capacities) {
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("balanced assignment: n = ", n, ", need >= 1"));
  if (k < 1) return absl::InvalidArgumentError(absl::StrCat("balanced assignment: k = ", k, ", need >= 1"));
  if (cost.size() != static_cast<size_t>(n) * static_cast<size_t>(k)) {
    return absl::InvalidArgumentError(absl::StrCat("balanced assignment: cost has ", cost.size(),
                                                   " values, expected n * k = ", static_cast<int64_t>(n) * k));
  }
  if (capacities.size() != static_cast<size_t>(k)) {
    return absl::InvalidArgumentError(
        absl::StrCat("balanced assignment: ", capacities.size(), " capacities for k = ", k, " clusters"));
  }
  IntegerProblem problem;
  problem.n = n;
  problem.k = k;
  problem.capacity.resize(k);
  int64_t total_capacity = 0;
  for (int j = 0; j < k; ++j) {
    if (capacities[j] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("balanced assignment: capacity of cluster ", j, " is ", capacities[j]));
    }
    problem.capacity[j] = std::min(capacities[j], n);
    total_capacity += problem.capacity[j];
  }
  if (total_capacity < n) {
    return absl::InvalidArgumentError(
        absl::StrCat("balanced assignment: capacities sum to ", total_capacity, ", fewer than the ", n, " points"));
  }
  // Shift each row to start at 0 and find the widest row.
  std::vector<double> row_min(n);
  double widest = 0;
  for (int i = 0; i < n; ++i) {
    const double* row = cost.data() + static_cast<size_t>(i) * k;
    double lo = row[0], hi = row[0];
    for (int j = 0; j < k; ++j) {
      if (!std::isfinite(row[j])) {
        return absl::InvalidArgumentError(
            absl::StrCat("balanced assignment: cost of point ", i, " for cluster ", j, " is not finite"));
      }
      lo = std::min(lo, row[j]);
      hi = std::max(hi, row[j]);
    }
    row_min[i] = lo;
    widest = std::max(widest, hi - lo);
  }
  const double grid = std::min(kCostGrid, std::floor(kDoubleExactLimit / (static_cast<double>(n) + k + 2)));
  const double scale = widest > 0 ? grid / widest : 0.0;
  problem.cost.resize(cost.size());
  for (int i = 0; i < n; ++i) {
    const double* row = cost.data() + static_cast<size_t>(i) * k;
    int32_t* out = problem.cost.data() + static_cast<size_t>(i) * k;
    // Non-negative, so adding 0.5 and truncating rounds to nearest (and vectorises, unlike llround).
    for (int j = 0; j < k; ++j) out[j] = static_cast<int32_t>((row[j] - row_min[i]) * scale + 0.5);
  }
  return problem;
}

// ---- LEMON NetworkSimplex on the full bipartite graph ------------------------------------------
absl::StatusOr<std::vector<int>> SolveByNetworkSimplex(const IntegerProblem& problem) {
  const int n = problem.n, k = problem.k;
  const int sink = n + k;
  std::vector<std::pair<int, int>> arcs;
  arcs.reserve(static_cast<size_t>(n) * k + k);
  // StaticDigraph wants arcs ordered by source: points first, then clusters.
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < k; ++j) arcs.emplace_back(i, n + j);
  }
  for (int j = 0; j < k; ++j) arcs.emplace_back(n + j, sink);
  lemon::StaticDigraph graph;
  graph.build(n + k + 1, arcs.begin(), arcs.end());

  lemon::StaticDigraph::ArcMap<double> arc_cost(graph);
  lemon::StaticDigraph::ArcMap<int> arc_upper(graph);
  lemon::StaticDigraph::NodeMap<int> supply(graph, 0);
  int arc = 0;
  for (int i = 0; i < n; ++i) {
    supply[graph.node(i)] = 1;
    for (int j = 0; j < k; ++j, ++arc) {
      arc_cost[graph.arc(arc)] = static_cast<double>(problem.cost[static_cast<size_t>(i) * k + j]);
      arc_upper[graph.arc(arc)] = 1;
    }
  }
  for (int j = 0; j < k; ++j, ++arc) {
    arc_cost[graph.arc(arc)] = 0;
    arc_upper[graph.arc(arc)] = problem.capacity[j];
  }
  supply[graph.node(sink)] = -n;

  lemon::NetworkSimplex<lemon::StaticDigraph, int, double> simplex(graph);
  simplex.costMap(arc_cost).upperMap(arc_upper).supplyMap(supply);
  const auto outcome = simplex.run();
  if (outcome != lemon::NetworkSimplex<lemon::StaticDigraph, int, double>::OPTIMAL) {
    // Capacities were checked to cover n, so this means a broken invariant, not bad input.
    return absl::InternalError("balanced assignment: network simplex found no optimal flow");
  }
  std::vector<int> assignment(n, -1);
  arc = 0;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < k; ++j, ++arc) {
      if (simplex.flow(graph.arc(arc)) > 0) assignment[i] = j;
    }
    if (assignment[i] < 0) return absl::InternalError("balanced assignment: a point carries no flow");
  }
  return assignment;
}

// ---- Successive shortest paths over the clusters ------------------------------------------------
//
// The flow network: source -> point (1) -> cluster (cost c[i][j]) -> sink (capacity[j]). Points are
// added one at a time; after each addition the flow is a min-cost flow for the points added so far
// (the classic row-by-row argument of the Hungarian method). Any residual path from a new point to
// the sink alternates clusters and moved points, so it lives on a graph of k + 1 nodes:
//   new point -> cluster j          cost c[new][j]
//   cluster a -> cluster b          cost min over points p in a of (c[p][b] - c[p][a])  (move p)
//   cluster a -> sink               cost 0, when a has room
// Potentials pi (reduced cost of u -> v = cost + pi[u] - pi[v] >= 0 on every residual arc) make
// Dijkstra valid; they are updated as pi += min(dist, dist[sink]) and shifted so pi[sink] = 0. A
// cluster that has room and some points then has pi = 0 exactly, so a new point whose cheapest
// reduced cluster is such a cluster goes there directly: the shortest path is that single arc.
class ClusterPathSolver {
 public:
  explicit ClusterPathSolver(const IntegerProblem& problem)
      : n_(problem.n),
        k_(problem.k),
        cost_(problem.cost.data()),
        capacity_(problem.capacity),
        load_(k_, 0),
        assignment_(n_, -1),
        pi_(k_ + 1, 0),
        heaps_built_(k_, 0),
        heaps_(static_cast<size_t>(k_) * k_),
        dist_(k_ + 1),
        prev_(k_ + 1),
        via_(k_ + 1),
        settled_(k_ + 1) {}

  std::vector<int> Solve() {
    for (int i = 0; i < n_; ++i) Place(i);
    return std::move(assignment_);
  }

 private:
  static constexpr int64_t kInfinity = std::numeric_limits<int64_t>::max() / 4;

  // A candidate move of `point` out of the heap's cluster a into cluster b, valid while the point
  // is in a. A point that leaves a and comes back finds its old entries valid again, which is
  // right: the move's cost depends only on the point and the two clusters.
  struct Move {
    int32_t delta;  // c[point][b] - c[point][a], within +-kCostGrid
    int32_t point;
  };
  // std heaps are max-heaps: "less" means "comes out later". Cheapest delta first, then lowest id.
  struct LaterMove {
    bool operator()(const Move& x, const Move& y) const {
      return x.delta != y.delta ? x.delta > y.delta : x.point > y.point;
    }
  };

  const int32_t* Row(int point) const { return cost_ + static_cast<size_t>(point) * k_; }
  std::vector<Move>& Heap(int a, int b) { return heaps_[static_cast<size_t>(a) * k_ + b]; }

  // Heaps of moves out of cluster a are built on first use, from the points it holds then.
  void EnsureHeaps(int a) {
    if (heaps_built_[a]) return;
    heaps_built_[a] = 1;
    for (int p = 0; p < n_; ++p) {
      if (assignment_[p] != a) continue;
      const int32_t* row = Row(p);
      for (int b = 0; b < k_; ++b) {
        if (b != a) Heap(a, b).push_back(Move{row[b] - row[a], p});
      }
    }
    for (int b = 0; b < k_; ++b) {
      if (b != a) std::make_heap(Heap(a, b).begin(), Heap(a, b).end(), LaterMove());
    }
  }

  // Puts `point` into `cluster` (loads are the caller's business).
  void Put(int point, int cluster) {
    assignment_[point] = cluster;
    if (!heaps_built_[cluster]) return;
    const int32_t* row = Row(point);
    for (int b = 0; b < k_; ++b) {
      if (b == cluster) continue;
      std::vector<Move>& heap = Heap(cluster, b);
      heap.push_back(Move{row[b] - row[cluster], point});
      std::push_heap(heap.begin(), heap.end(), LaterMove());
    }
  }

  // The cheapest valid move a -> b, or kInfinity; drops stale entries on the way.
  int64_t CheapestMove(int a, int b, int* point) {
    std::vector<Move>& heap = Heap(a, b);
    while (!heap.empty()) {
      const Move& top = heap.front();
      if (assignment_[top.point] == a) {
        *point = top.point;
        return top.delta;
      }
      std::pop_heap(heap.begin(), heap.end(), LaterMove());
      heap.pop_back();
    }
    return kInfinity;
  }

  void Place(int i) {
    const int32_t* row = Row(i);
    const int sink = k_;
    int cheapest = 0;
    int64_t cheapest_label = kInfinity;
    for (int j = 0; j < k_; ++j) {
      const int64_t label = row[j] - pi_[j];
      if (label < cheapest_label) {
        cheapest_label = label;
        cheapest = j;
      }
    }
    if (load_[cheapest] < capacity_[cheapest] && pi_[cheapest] == pi_[sink]) {
      ++load_[cheapest];
      Put(i, cheapest);
      return;
    }

    // Dijkstra from the new point over clusters 0..k-1 and the sink k (dense: k is small).
    for (int j = 0; j < k_; ++j) {
      dist_[j] = row[j] - pi_[j];
      prev_[j] = -1;  // reached directly from the new point
      settled_[j] = 0;
    }
    dist_[sink] = kInfinity;
    prev_[sink] = -1;
    settled_[sink] = 0;
    for (;;) {
      int u = -1;
      for (int v = 0; v <= k_; ++v) {
        if (!settled_[v] && (u < 0 || dist_[v] < dist_[u])) u = v;
      }
      settled_[u] = 1;
      if (u == sink) break;
      if (load_[u] < capacity_[u]) {
        const int64_t via_sink = dist_[u] + pi_[u] - pi_[sink];
        if (via_sink < dist_[sink]) {
          dist_[sink] = via_sink;
          prev_[sink] = u;
        }
      }
      if (load_[u] == 0) continue;
      EnsureHeaps(u);
      for (int v = 0; v < k_; ++v) {
        if (v == u || settled_[v]) continue;
        int point = -1;
        const int64_t delta = CheapestMove(u, v, &point);  // kInfinity when a holds no point
        if (delta == kInfinity) continue;
        const int64_t candidate = dist_[u] + delta + pi_[u] - pi_[v];
        if (candidate < dist_[v]) {
          dist_[v] = candidate;
          prev_[v] = u;
          via_[v] = point;
        }
      }
    }

    // Potentials: pi += min(dist, dist[sink]), then shift so pi[sink] stays 0. Unsettled clusters
    // (dist >= dist[sink]) are unchanged.
    const int64_t to_sink = dist_[sink];
    for (int v = 0; v < k_; ++v) {
      if (settled_[v]) pi_[v] += dist_[v] - to_sink;
    }

    // Augment: the path's last cluster gains a point; every earlier cluster passes one along.
    int v = prev_[sink];
    ++load_[v];
    while (prev_[v] != -1) {
      const int u = prev_[v];
      Put(via_[v], v);
      v = u;
    }
    Put(i, v);
  }

  const int n_;
  const int k_;
  const int32_t* cost_;
  const std::vector<int> capacity_;
  std::vector<int> load_;
  std::vector<int> assignment_;
  std::vector<int64_t> pi_;  // clusters 0..k-1, sink k
  std::vector<char> heaps_built_;
  std::vector<std::vector<Move>> heaps_;  // [a * k + b]: moves from cluster a to cluster b
  // Dijkstra scratch.
  std::vector<int64_t> dist_;
  std::vector<int> prev_;
  std::vector<int> via_;
  std::vector<char> settled_;
};

}  // namespace

absl::StatusOr<std::vector<int>> SolveBalancedAssignment(absl::Span<const double> cost, int n, int k,
                                                         absl::Span<const int> capacities, AssignmentMethod method) {
  absl::StatusOr<IntegerProblem> problem = MakeIntegerProblem(cost, n, k, capacities);
  if (!problem.ok()) return problem.status();
  if (method == AssignmentMethod::kNetworkSimplex) return SolveByNetworkSimplex(*problem);
  return ClusterPathSolver(*problem).Solve();
}

absl::StatusOr<std::vector<int>> SolveBalancedAssignment(absl::Span<const double> cost, int n, int k,
                                                         absl::Span<const int> capacities) {
  return SolveBalancedAssignment(cost, n, k, capacities, AssignmentMethod::kAuto);
}

absl::StatusOr<WeightedAssignment> SolveWeightedBalancedAssignment(absl::Span<const double> cost, int n, int k,
                                                                   absl::Span<const int> units,
                                                                   absl::Span<const int> capacities,
                                                                   AssignmentMethod method) {
  if (n >= 1 && units.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("weighted balanced assignment: ", units.size(), " unit counts for n = ", n, " points"));
  }
  int64_t total_units = 0;
  for (int i = 0; i < static_cast<int>(units.size()); ++i) {
    if (units[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("weighted balanced assignment: point ", i, " has ", units[i], " units"));
    }
    total_units += units[i];
  }
  if (total_units > kMaxAssignmentUnits) {
    return absl::InvalidArgumentError(absl::StrCat("weighted balanced assignment: ", total_units,
                                                   " units in all, more than the ", kMaxAssignmentUnits,
                                                   " one solve takes"));
  }
  // The replicated problem: one row per unit (a point's units share its cost row). Points of no
  // unit take no capacity: they go to their cheapest cluster.
  std::vector<double> replicated;
  std::vector<int> owner;
  replicated.reserve(static_cast<size_t>(total_units) * std::max(k, 0));
  owner.reserve(static_cast<size_t>(total_units));
  if (n >= 1 && k >= 1 && cost.size() == static_cast<size_t>(n) * k) {
    for (int i = 0; i < n; ++i) {
      for (int u = 0; u < units[i]; ++u) {
        replicated.insert(replicated.end(), cost.begin() + static_cast<ptrdiff_t>(i) * k,
                          cost.begin() + static_cast<ptrdiff_t>(i + 1) * k);
        owner.push_back(i);
      }
    }
  }
  // Validation of n, k, sizes, capacities and finiteness is MakeIntegerProblem's (through the
  // unweighted solve); an all-zero weighting still checks the costs.
  WeightedAssignment result;
  if (total_units == 0) {
    absl::StatusOr<IntegerProblem> checked = MakeIntegerProblem(cost, n, k, std::vector<int>(k > 0 ? k : 0, n));
    if (!checked.ok()) return checked.status();
  } else {
    absl::StatusOr<std::vector<int>> solved =
        SolveBalancedAssignment(replicated, static_cast<int>(total_units), k, capacities, method);
    if (!solved.ok()) return solved.status();
    result.units_per_cluster.assign(static_cast<size_t>(n) * k, 0);
    for (size_t r = 0; r < owner.size(); ++r)
      ++result.units_per_cluster[static_cast<size_t>(owner[r]) * k + (*solved)[r]];
  }
  result.assignment.assign(n, -1);
  for (int i = 0; i < n; ++i) {
    const double* row = cost.data() + static_cast<size_t>(i) * k;
    int best = -1;
    for (int j = 0; j < k; ++j) {
      const int held = units[i] == 0 ? 0 : result.units_per_cluster[static_cast<size_t>(i) * k + j];
      if (units[i] > 0 && held == 0) continue;
      if (best < 0) {
        best = j;
        continue;
      }
      const int best_held = units[i] == 0 ? 0 : result.units_per_cluster[static_cast<size_t>(i) * k + best];
      if (held > best_held || (held == best_held && row[j] < row[best])) best = j;
    }
    result.assignment[i] = best;
    if (units[i] > 0 && result.units_per_cluster[static_cast<size_t>(i) * k + best] < units[i]) ++result.split_points;
  }
  return result;
}

std::vector<int> ClusterCapacities(int n, int k, absl::Span<const double> weights) {
  if (n < 0 || k < 1) return {};
  if (weights.empty()) return std::vector<int>(k, (n + k - 1) / k);
  if (weights.size() != static_cast<size_t>(k)) return {};
  long double total = 0;
  for (double w : weights) {
    if (!std::isfinite(w) || w <= 0) return {};
    total += w;
  }
  std::vector<int> capacity(k);
  std::vector<long double> remainder(k);
  int64_t sum = 0;
  for (int j = 0; j < k; ++j) {
    const long double share = static_cast<long double>(n) * weights[j] / total;
    capacity[j] = static_cast<int>(std::min<long double>(std::ceil(share), n));
    remainder[j] = capacity[j] - share;  // slack of rounding up; tiny or negative from rounding error
    sum += capacity[j];
  }
  // Floating-point error can leave an exact share one short of its ceiling; give the missing places
  // to the clusters whose rounding left the least slack.
  while (sum < n) {
    int j = static_cast<int>(std::min_element(remainder.begin(), remainder.end()) - remainder.begin());
    ++capacity[j];
    remainder[j] += 1;
    ++sum;
  }
  return capacity;
}

std::vector<int> AlignCentroids(absl::Span<const float> old_centroids, int old_k, absl::Span<const float> new_centroids,
                                int new_k, int dim) {
  if (old_k < 1 || old_k > new_k || dim < 1 || old_centroids.size() != static_cast<size_t>(old_k) * dim ||
      new_centroids.size() != static_cast<size_t>(new_k) * dim) {
    return {};
  }
  // Old rows are the "points", new rows the "clusters" of capacity 1; cost = cosine distance.
  std::vector<double> cost(static_cast<size_t>(old_k) * new_k);
  for (int i = 0; i < old_k; ++i) {
    const float* a = old_centroids.data() + static_cast<size_t>(i) * dim;
    for (int j = 0; j < new_k; ++j) {
      const float* b = new_centroids.data() + static_cast<size_t>(j) * dim;
      double dot = 0;
      for (int d = 0; d < dim; ++d) dot += static_cast<double>(a[d]) * b[d];
      cost[static_cast<size_t>(i) * new_k + j] = std::isfinite(dot) ? 1.0 - dot : 2.0;
    }
  }
  std::vector<int> capacity(new_k, 1);
  absl::StatusOr<std::vector<int>> assignment = SolveBalancedAssignment(cost, old_k, new_k, capacity);
  if (!assignment.ok()) return {};
  return *std::move(assignment);
}

std::vector<int> AlignCentroids(absl::Span<const float> old_centroids, absl::Span<const float> new_centroids, int k,
                                int dim) {
  return AlignCentroids(old_centroids, k, new_centroids, k, dim);
}

}  // namespace eldr
