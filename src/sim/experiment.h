// One eldr-sim invocation: calibrate eldr's centroids on the workload's calibration split, then run
// every (rate, router setup, policy) triple on the identical arrival sequence of that rate (with a
// drift scenario: the drifted sequence and the scenario's schedule, drift.h). Every triple gets
// routers of its own (tie-breaking seeded with router_seed), so no policy's results depend on which
// other policies ran, or in what order.
#ifndef ELDR_SIM_EXPERIMENT_H_
#define ELDR_SIM_EXPERIMENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/policy.h"
#include "eldr/core/signature.h"
#include "sim/drift.h"
#include "sim/simulator.h"
#include "sim/workload.h"

namespace eldr::sim {

// A policy under test: a router policy, optionally with online refit ("eldr_refit"), or the
// domain oracle ("oracle", MakeOracleBackend: kind kJsq, not a load balancer).
struct PolicySpec {
  std::string name;
  PolicyKind kind = PolicyKind::kEldr;
  bool refit = false;
  bool oracle = false;
};

// Parses a comma-separated list of rr, random, jsq, p2c, eldr, eldr_refit, oracle (no duplicates).
absl::StatusOr<std::vector<PolicySpec>> ParsePolicies(absl::string_view list);
// Parses a comma-separated list of positive rates (requests per second).
absl::StatusOr<std::vector<double>> ParseRates(absl::string_view list);

// An arrangement of routers under test: one router, or R replicas over the same decode workers, each
// routing 1/R of the arrivals, with or without the state eldr_cluster shares through Redis.
struct ReplicaSetup {
  int replicas = 1;
  // With R > 1. On: shared load (SyncReplicaLeases every sync period) and, for eldr_refit, one
  // refitter for the pool whose sets every replica installs. Off: each replica counts its own
  // leases only and refits alone on its share of the traffic.
  bool shared_state = false;
};
// "1 router", "16 replicas, shared state", "16 replicas, no shared state".
std::string ReplicaSetupLabel(const ReplicaSetup& setup);
// A policy's label in a setup: its name with one router, else e.g. "eldr R16 shared",
// "jsq R3 unshared".
std::string CellLabel(const std::string& policy, const ReplicaSetup& setup);

// Parses a comma-separated list of replica counts (1 to kMaxReplicas, no duplicates).
inline constexpr int kMaxReplicas = 1024;
absl::StatusOr<std::vector<int>> ParseReplicaCounts(absl::string_view list);
// The setups of `counts` in their order: R = 1 once; every R > 1 with shared state, without it, or
// both (in that order) as `shared_state` says: "on", "off", "both", or empty (both).
absl::StatusOr<std::vector<ReplicaSetup>> ExpandReplicaSetups(const std::vector<int>& counts,
                                                              absl::string_view shared_state);

// Which TTFT the table shows (the JSON and CSV carry both).
enum class TtftDefinition {
  kDecode,   // arrival to the end of the first decode step (the first token the decode worker sends)
  kPrefill,  // the reference implementation's: arrival to the end of prefill (its first token)
};
// "decode", "prefill"; INVALID_ARGUMENT otherwise.
absl::StatusOr<TtftDefinition> ParseTtftDefinition(absl::string_view name);
absl::string_view TtftDefinitionName(TtftDefinition definition);

struct ExperimentOptions {
  ClusterOptions cluster;
  std::vector<PolicySpec> policies;
  std::vector<double> rates;                      // empty: DefaultRates of the estimated capacity
  int requests = 4000;                            // arrivals per rate
  double tau = 0.1;                               // in-process routers; a daemon uses its own
  int64_t max_inflight = 0;                       // in-process routers' per-worker overload guard (0: none)
  double max_load_gap = 0;                        // in-process routers' RouterOptions::max_load_gap
  uint64_t seed = 1;                              // arrivals, calibration, refit
  uint64_t router_seed = 0x5eed;                  // in-process routers' tie-breaking (eldr-router's default)
  TieBreak tie_break = TieBreak::kRandom;         // in-process routers' rule among equally loaded workers
  TtftDefinition ttft = TtftDefinition::kDecode;  // what the table's TTFT columns show
  SignatureVariant variant = SignatureVariant::kCountIdf;
  bool select_layers = true;  // greedy layer mask during calibration
  // Calibration's balance by decode tokens (CalibrationOptions::weight_by_decode_tokens).
  bool weight_by_decode_tokens = true;
  LayerMaskRule mask_rule = LayerMaskRule::kGlobalMaximum;
  bool balanced = true;  // false: plain spherical k-means (the cluster-balance ablation)
  SimRefitOptions refit;
  DriftOptions drift;  // the workload's change during each run (drift.h); none by default
  // Router setups, each run on every rate and policy; replicas > 1 need in-process routers (no
  // grpc_target). The replicas of one setup get tie-breaking seeds derived from router_seed
  // (replica 0: router_seed itself) and, refitting alone, refit seeds derived from `seed`.
  std::vector<ReplicaSetup> setups = {ReplicaSetup{}};
  // Assignment rule (its seed is `seed`), sync period and follower install lag of every setup with
  // R > 1; shared_load is set per setup from ReplicaSetup::shared_state.
  ReplicaOptions replica;
  std::string grpc_target;        // host:port of a running eldr-router; empty: in-process
  std::string grpc_admin_target;  // host:port of its RouterAdmin; empty: grpc_target
  double rpc_timeout_s = 10;
  // ClusterOptions::replay_pace for the cells the daemon routes (the others, in-process, replay
  // as fast as they can); 0: no pacing.
  double daemon_pace = 0;
  std::function<void(const std::string&)> log;  // progress lines (may be empty)
};

struct CapacityEstimate {
  int batch = 0;              // tokens per step at saturation (max batch or KV bound)
  double mixed_distinct = 0;  // distinct experts per layer of a random batch of that size
  double step_ms = 0;         // step time of such a batch
  double mean_decode_steps = 0;
  double requests_per_s = 0;  // decoders * batch / step / mean decode steps
};

// Decode capacity of the pool under load-only routing: every worker at its batch limit with
// batches drawn at random. Deterministic for `seed`.
CapacityEstimate EstimateCapacity(const Workload& workload, const ClusterOptions& cluster, uint64_t seed);
// Light, moderate and heavy load: 30%, 55% and 80% of the capacity, two significant digits.
std::vector<double> DefaultRates(const CapacityEstimate& capacity);

struct ExperimentCell {
  double rate = 0;
  PolicySpec policy;
  ReplicaSetup setup;
  std::string backend;  // which router decided
  RunResult run;
};

struct ExperimentResult {
  TtftDefinition ttft = TtftDefinition::kDecode;  // the table's TTFT columns
  std::string workload;
  std::vector<std::string> domains;  // the workload's domain names
  LocalityStats locality;
  CapacityEstimate capacity;
  CalibrationReport calibration;
  int calibration_requests = 0;  // requests of the calibration split
  int calibration_points = 0;    // requests k-means clustered (those with a non-zero signature)
  int signature_dim = 0;
  std::string router;  // in-process, or the daemon's description
  double tau = 0;
  std::vector<double> rates;
  DriftPlan drift;                    // the scenario as resolved (none: no phases)
  std::vector<ReplicaSetup> setups;   // as given
  ReplicaOptions replica;             // as given (no on_sync)
  std::vector<ExperimentCell> cells;  // rate-major, then setups, then policies, each in the given order
  // eldr's centroids as calibrated on the calibration split (rows unnamed: the pool's order);
  // empty (k == 0) when no eldr policy ran.
  CentroidArtifact centroids;
};

absl::StatusOr<ExperimentResult> RunExperiment(const Workload& workload, const ExperimentOptions& options);

}  // namespace eldr::sim

#endif  // ELDR_SIM_EXPERIMENT_H_
