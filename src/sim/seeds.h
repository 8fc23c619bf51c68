// Multi-seed reporting (eldr-sim --seeds): the whole experiment once per seed (workload split or
// generation, arrivals, calibration and refit all follow the seed), then, per (rate, router setup,
// policy, phase), the mean and the standard error over the seeds of each figure, and of each eldr
// variant's (and the oracle's) % difference from the best load balancer: the best of rr, random,
// jsq and p2c in that seed's own cell group, separately for the median and the P99, then averaged.
#ifndef ELDR_SIM_SEEDS_H_
#define ELDR_SIM_SEEDS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"
#include "sim/experiment.h"

namespace eldr::sim {

// "1-6", "1,2,3", "1-3,7": seeds in the order given, no duplicates, at most kMaxSeeds.
inline constexpr int kMaxSeeds = 1000;
absl::StatusOr<std::vector<uint64_t>> ParseSeeds(absl::string_view list);

// The mean of `values` and its standard error: the sample standard deviation (n - 1 in the
// denominator) over sqrt(n); 0 with one value. n = 0: all zero.
struct MeanSe {
  int n = 0;
  double mean = 0;
  double se = 0;
};
MeanSe MeanAndStandardError(const std::vector<double>& values);

// One aggregated cell. phase -1: the whole run; otherwise the index of DriftPlan::phase_labels.
// best_baseline: the row of the best load balancer itself (only tpot_p50 and tpot_p99 are set:
// the mean and standard error of each seed's best median and best P99).
struct AggregateCell {
  double rate = 0;
  PolicySpec policy;
  ReplicaSetup setup;
  int phase = -1;
  bool best_baseline = false;
  MeanSe tpot_p50, tpot_p90, tpot_p99, ttft_p50, ttft_p99, ttft_prefill_p50, ttft_prefill_p99;
  MeanSe distinct_experts_per_layer, load_imbalance;
  // Not a load balancer (eldr variants, the oracle), with load balancers in its group: the % by
  // which its median / P99 TPOT differs from the best load balancer's, 100 * (x / best - 1).
  bool has_versus = false;
  MeanSe p50_vs_best_pct, p99_vs_best_pct;
};

struct MultiSeedResult {
  std::vector<uint64_t> seeds;
  std::vector<ExperimentResult> runs;  // one per seed, in that order
  // Per rate, setup and phase (whole run first): the cells in run order, then the best_baseline row.
  std::vector<AggregateCell> cells;
};

// Aggregates `runs` (one per seed). Every run must hold the same cells (rates, setups, policies,
// phases) in the same order: FAILED_PRECONDITION otherwise.
absl::StatusOr<std::vector<AggregateCell>> AggregateSeeds(const std::vector<ExperimentResult>& runs);

// Text table: per rate (and per phase) one row per policy with "mean ± SE" of TPOT p50 / p99 and
// TTFT p50 / p99 (ms) and of the % difference from the best load balancer, then the best load
// balancer's own row; it says over which seeds.
std::string FormatSeedsTable(const MultiSeedResult& result);
// {"seeds": [...], "aggregate": [one object per AggregateCell: rate_rps, policy, replicas,
// shared_state, label, phase ("all" or the phase label), seeds, and for each figure X: X_mean and
// X_se (tpot_p50_ms, tpot_p90_ms, tpot_p99_ms, ttft_p50_ms, ttft_p99_ms, ttft_prefill_p50_ms,
// ttft_prefill_p99_ms, distinct_experts_per_layer, load_imbalance, p50_vs_best_lb_pct,
// p99_vs_best_lb_pct)], "runs": [ToJson of each seed's run, without samples]}.
nlohmann::json SeedsToJson(const MultiSeedResult& result);
// A header and one line per AggregateCell, the same keys as the JSON aggregate (empty fields for
// figures a row does not have).
std::string FormatSeedsCsv(const MultiSeedResult& result);

}  // namespace eldr::sim

#endif  // ELDR_SIM_SEEDS_H_
