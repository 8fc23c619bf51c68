// One eldr-sim invocation: calibrate eldr's centroids on the workload's calibration split, then run
// every (rate, policy) pair on the identical arrival sequence of that rate.
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
#include "sim/simulator.h"
#include "sim/workload.h"

namespace eldr::sim {

// A policy under test: a router policy, optionally with online refit ("eldr_refit").
struct PolicySpec {
  std::string name;
  PolicyKind kind = PolicyKind::kEldr;
  bool refit = false;
};

// Parses a comma-separated list of rr, random, jsq, p2c, eldr, eldr_refit (no duplicates).
absl::StatusOr<std::vector<PolicySpec>> ParsePolicies(absl::string_view list);
// Parses a comma-separated list of positive rates (requests per second).
absl::StatusOr<std::vector<double>> ParseRates(absl::string_view list);

// The calibration set with each request repeated in proportion to its decode tokens (the tenth
// percentile of decode lengths is one copy; at most 64 copies), so that balanced k-means balances
// decode work per worker instead of request counts. Unchanged without decode counts.
CalibrationData WeightByDecodeTokens(const CalibrationData& data);

struct ExperimentOptions {
  ClusterOptions cluster;
  std::vector<PolicySpec> policies;
  std::vector<double> rates;      // empty: DefaultRates of the estimated capacity
  int requests = 4000;            // arrivals per rate
  double tau = 0.1;               // in-process routers; a daemon uses its own
  int64_t max_inflight = 0;       // in-process routers' per-worker overload guard (0: none)
  uint64_t seed = 1;              // arrivals, calibration, refit
  uint64_t router_seed = 0x5eed;  // in-process routers' tie-breaking (eldr-router's default)
  SignatureVariant variant = SignatureVariant::kCountIdf;
  bool select_layers = true;            // greedy layer mask during calibration
  bool weight_by_decode_tokens = true;  // calibrate on WeightByDecodeTokens(calibration split)
  SimRefitOptions refit;
  std::string grpc_target;        // host:port of a running eldr-router; empty: in-process
  std::string grpc_admin_target;  // host:port of its RouterAdmin; empty: grpc_target
  double rpc_timeout_s = 10;
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
  std::string backend;  // which router decided
  RunResult run;
};

struct ExperimentResult {
  std::string workload;
  LocalityStats locality;
  CapacityEstimate capacity;
  CalibrationReport calibration;
  int calibration_requests = 0;  // requests of the calibration split
  int calibration_points = 0;    // points k-means saw (more with weight_by_decode_tokens)
  int signature_dim = 0;
  std::string router;  // in-process, or the daemon's description
  double tau = 0;
  std::vector<double> rates;
  std::vector<ExperimentCell> cells;  // rate-major, policies in the given order
  // eldr's centroids as calibrated on the calibration split (rows unnamed: the pool's order);
  // empty (k == 0) when no eldr policy ran.
  CentroidArtifact centroids;
};

absl::StatusOr<ExperimentResult> RunExperiment(const Workload& workload, const ExperimentOptions& options);

}  // namespace eldr::sim

#endif  // ELDR_SIM_EXPERIMENT_H_
