// Drift scenarios: workloads that change during a run (docs/evaluation.md, "Drift").
//
//  - mix_shift: the domains' shares of the arrivals change at the change point. Before it, the
//    first half of the domains (floor(D / 2), in the workload's order) take dominant_share of the
//    arrivals, split evenly, and the others the rest, split evenly; after it, the roles swap.
//  - new_domain: one domain (default: the workload's last) is left out of the calibration split
//    and of the arrivals before the change point; after it, arrivals are drawn from the whole
//    evaluation pool (every domain in its natural share, the new one included).
//  - pool_change: the arrivals are those without drift; at the change point a worker joins
//    ("decode-{decoders}") and "decode-0" is drained, then removed once its last request completes,
//    through the router's elastic-pool path (RunSchedule).
//
// Every scenario has two phases, "before" and "after", split at arrival change_fraction * requests.
// In the mix scenarios each phase's arrival rate is the given rate scaled by (mean decode tokens of
// the evaluation pool) / (mean decode tokens of the phase's mix), so every phase offers the decode
// work per second of the undrifted workload at that rate: the load level stays what the rate says
// while the mix changes. Arrivals are deterministic for the seed and identical for every policy.
#ifndef ELDR_SIM_DRIFT_H_
#define ELDR_SIM_DRIFT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "eldr/calib/calibration.h"
#include "sim/simulator.h"
#include "sim/workload.h"

namespace eldr::sim {

enum class DriftScenario { kNone, kMixShift, kNewDomain, kPoolChange };
// "none", "mix_shift", "new_domain", "pool_change"; INVALID_ARGUMENT naming them otherwise.
absl::StatusOr<DriftScenario> ParseDriftScenario(absl::string_view name);
absl::string_view DriftScenarioName(DriftScenario scenario);

struct DriftOptions {
  DriftScenario scenario = DriftScenario::kNone;
  // The change point, as a fraction of the arrivals; it must leave measured arrivals on both sides
  // (warmup_fraction < change_fraction < 1 - cooldown_fraction).
  double change_fraction = 0.5;
  // mix_shift: the dominant domains' share of the arrivals, in (0, 1).
  double dominant_share = 0.9;
  // new_domain: the domain that appears (a name of Workload::domains); empty: the last one.
  std::string new_domain;
  // mix_shift: calibrate on the mix of the phase before the change (the calibration split
  // subsampled to its domain shares: an operator who calibrated on the traffic of the day, which
  // then shifted) instead of the split's natural mix (false, the default: calibrated on a mix that
  // both phases depart from).
  bool calibrate_before = false;
};

// A scenario resolved for one workload and run length.
struct DriftPlan {
  DriftScenario scenario = DriftScenario::kNone;
  int change_arrival = -1;  // first arrival of the "after" phase; -1 without drift
  // mix scenarios: each phase's request share per domain (summing to 1) and rate scale.
  std::vector<std::vector<double>> phase_domain_shares;
  std::vector<double> phase_rate_scale;
  std::vector<std::string> phase_labels;  // "before", "after"; empty without drift
  int excluded_domain = -1;               // new_domain: kept out of the calibration split
  // mix_shift with calibrate_before: the domain shares the calibration split is subsampled to
  // (WithDomainShares); empty: the split as it is.
  std::vector<double> calibration_domain_shares;
  std::string add_worker, drain_worker;  // pool_change
};

// Checks `options` against the workload and the cluster (a scenario needs two domains, or for
// pool_change two decoders) and resolves it. INVALID_ARGUMENT saying what is wrong.
absl::StatusOr<DriftPlan> PlanDrift(const Workload& workload, const DriftOptions& options, int requests, int decoders,
                                    const ClusterOptions& cluster);

// The arrivals of one rate: MakeArrivals without a mix scenario; otherwise `count` arrivals whose
// unit-rate exponential gaps (the same stream as MakeArrivals) are scaled by 1 / (rate * the phase's
// rate scale), each picking a domain by the phase's shares and then a request of that domain:
// uniformly (pools sampled with replacement) or the domain's next request not yet used, in pool
// order, starting over once all were used (the synthetic pool).
std::vector<Arrival> MakeDriftArrivals(const Workload& workload, const DriftPlan& plan, double rate_per_s, int count,
                                       uint64_t seed);

// The run schedule of the plan: the phase boundary, and the pool change of pool_change.
RunSchedule ScheduleFor(const DriftPlan& plan);

// `data` without the requests labelled `domain` (unchanged when domain < 0).
CalibrationData WithoutDomain(const CalibrationData& data, int domain);

// The largest subset of `data` whose domains (labels) come in proportion to `shares` (one per
// domain, summing to 1): each domain's first floor(T * share) requests, T as large as every domain
// allows. Unchanged when `shares` is empty or `data` has no labels.
CalibrationData WithDomainShares(const CalibrationData& data, const std::vector<double>& shares);

}  // namespace eldr::sim

#endif  // ELDR_SIM_DRIFT_H_
