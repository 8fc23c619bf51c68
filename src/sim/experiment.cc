#include "sim/experiment.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "sim/distinct_experts.h"
#include "sim/random.h"
#include "sim/routing_backend.h"

namespace eldr::sim {

absl::StatusOr<TtftDefinition> ParseTtftDefinition(absl::string_view name) {
  if (name == "decode") return TtftDefinition::kDecode;
  if (name == "prefill") return TtftDefinition::kPrefill;
  return absl::InvalidArgumentError(absl::StrCat("--ttft must be decode or prefill, got '", name, "'"));
}

absl::string_view TtftDefinitionName(TtftDefinition definition) {
  return definition == TtftDefinition::kPrefill ? "prefill" : "decode";
}
namespace {

constexpr uint64_t kStreamCapacity = 11;
constexpr int kLocalityBatch = 16;  // the batch size of the published same-domain measurement

double RoundTwoSignificant(double x) {
  if (x <= 0) return x;
  const double scale = std::pow(10.0, std::floor(std::log10(x)) - 1);
  return std::round(x / scale) * scale;
}

CentroidArtifact WithWorkers(const CentroidArtifact& artifact, const std::vector<std::string>& ids) {
  CentroidArtifact named = artifact;
  named.workers = ids;
  return named;
}

// Replica r's seed derived from `base`: replica 0 keeps `base` (one router is unchanged), the
// others get well-mixed seeds of their own.
uint64_t ReplicaSeed(uint64_t base, int replica) {
  return replica == 0 ? base : Rng::Mix(base ^ Rng::Mix(static_cast<uint64_t>(replica)));
}

// Passes `line` to options.log when one is set.
void Log(const ExperimentOptions& options, const std::string& line) {
  if (options.log) options.log(line);
}

// Checks the cluster, policies, request count and tau of `options` against `workload`.
absl::Status ValidateExperiment(const Workload& workload, const ExperimentOptions& options) {
  ELDR_RETURN_IF_ERROR(ValidateClusterOptions(options.cluster));
  if (options.policies.empty()) return absl::InvalidArgumentError("--policies: no policy given");
  if (options.requests < 20) return absl::InvalidArgumentError("--requests must be >= 20");
  if (!(options.tau >= 0 && options.tau <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--tau must be in [0, 1], got ", options.tau));
  }
  if (workload.pool.empty()) return absl::InvalidArgumentError("the workload has no request");
  if (!workload.sample_with_replacement && static_cast<int>(workload.pool.size()) < options.requests) {
    return absl::InvalidArgumentError("the synthetic pool is smaller than --requests");
  }
  if (options.setups.empty()) return absl::InvalidArgumentError("--replicas: no router setup given");
  for (const ReplicaSetup& setup : options.setups) {
    if (setup.replicas < 1 || setup.replicas > kMaxReplicas) {
      return absl::InvalidArgumentError(absl::StrCat("--replicas must be in [1, ", kMaxReplicas, "]"));
    }
    if (setup.replicas > 1 && !options.grpc_target.empty()) {
      return absl::InvalidArgumentError(
          "--replicas > 1 runs in-process router replicas: it cannot be combined with --router");
    }
  }
  for (const PolicySpec& policy : options.policies) {
    if (!policy.oracle) continue;
    for (const ReplicaSetup& setup : options.setups) {
      if (setup.replicas > 1) {
        return absl::InvalidArgumentError("policy oracle runs with one router only: drop it or use --replicas 1");
      }
    }
  }
  if (!(options.daemon_pace >= 0) || std::isinf(options.daemon_pace)) {
    return absl::InvalidArgumentError("--pace must be finite and >= 0");
  }
  if (!(options.replica.sync_period_ms > 0)) return absl::InvalidArgumentError("--replica_sync_ms must be > 0");
  if (!(options.replica.install_lag_ms >= 0)) {
    return absl::InvalidArgumentError("--replica_install_lag_ms must be >= 0");
  }
  return absl::OkStatus();
}

// Fills result->locality, capacity and rates (options.rates, else DefaultRates) and logs them.
void MeasureWorkloadAndCapacity(const Workload& workload, const ExperimentOptions& options, ExperimentResult* result) {
  result->locality = MeasureWorkloadLocality(workload, kLocalityBatch, 400, 20000, options.seed);
  Log(options,
      absl::StrFormat(
          "workload structure: a batch of %d decode tokens of one domain touches %.1f distinct experts "
          "per layer, of mixed domains %.1f (%.1f%% fewer); prompt/decode correlation %.2f (Spearman, %d pairs)",
          kLocalityBatch, result->locality.same_domain_distinct, result->locality.mixed_distinct,
          100 * result->locality.same_domain_reduction, result->locality.prompt_decode_correlation,
          result->locality.pairs));
  result->capacity = EstimateCapacity(workload, options.cluster, options.seed);
  result->rates = options.rates.empty() ? DefaultRates(result->capacity) : options.rates;
  Log(options,
      absl::StrFormat("estimated decode capacity %.1f req/s (%d workers x batch %d, step %.1f ms at %.1f distinct "
                      "experts/layer, %.0f decode tokens per request)",
                      result->capacity.requests_per_s, options.cluster.decoders, result->capacity.batch,
                      result->capacity.step_ms, result->capacity.mixed_distinct, result->capacity.mean_decode_steps));
}

// The routers of one cell: what it routes with, and those created for it alone.
struct CellRouters {
  std::vector<RoutingBackend*> replicas;
  std::vector<std::unique_ptr<RoutingBackend>> owned;
  bool daemon = false;  // the cell is routed by the daemon
};

// The routers of one invocation: the daemon (when options.grpc_target names one), and in-process
// routers made for each cell.
class RouterPool {
 public:
  explicit RouterPool(const ExperimentOptions& options) : options_(options) {}

  // Connects to the daemon (its worker count must match; differences are logged) or, without a
  // target, stays in-process; records the router's description and tau in `result`.
  absl::Status ConnectDaemon(ExperimentResult* result) {
    if (options_.grpc_target.empty()) {
      result->router = absl::StrFormat("in-process eldr::Router (tau %g)", options_.tau);
      result->tau = options_.tau;
      return absl::OkStatus();
    }
    ELDR_ASSIGN_OR_RETURN(DaemonInfo info, QueryDaemon(options_.grpc_target,
                                                       options_.grpc_admin_target.empty() ? options_.grpc_target
                                                                                          : options_.grpc_admin_target,
                                                       options_.rpc_timeout_s));
    if (static_cast<int>(info.worker_ids.size()) != options_.cluster.decoders) {
      return absl::FailedPreconditionError(
          absl::StrFormat("eldr-router at %s has %d active decode workers but the simulation has %d: pass "
                          "--decoders %d or start the router with %d workers",
                          info.target, info.worker_ids.size(), options_.cluster.decoders, info.worker_ids.size(),
                          options_.cluster.decoders));
    }
    for (size_t i = 0; i < info.max_inflight.size(); ++i) {
      if (info.max_inflight[i] != options_.max_inflight) {
        Log(options_,
            absl::StrFormat("note: eldr-router's worker %s has max_inflight %d, the in-process routers %d: decisions "
                            "differ once a worker reaches the smaller limit",
                            info.worker_ids[i], info.max_inflight[i], options_.max_inflight));
        break;
      }
    }
    if (info.live_leases > 0) {
      Log(options_, absl::StrFormat("warning: eldr-router at %s already holds %d leases; they count as load",
                                    info.target, info.live_leases));
    }
    ELDR_ASSIGN_OR_RETURN(daemon_, MakeGrpcBackend(info, options_.rpc_timeout_s));
    result->router = daemon_->Describe();
    result->tau = daemon_->tau();
    for (const PolicySpec& policy : options_.policies) {
      if (policy.kind != daemon_->policy() || policy.oracle) {
        Log(options_, absl::StrFormat("note: %s runs in-process: the daemon serves policy %s only", policy.name,
                                      PolicyKindName(daemon_->policy())));
      }
    }
    return absl::OkStatus();
  }

  // The routers of one cell of `policy` in `setup`: the daemon when it serves the policy's kind
  // (one router); otherwise routers created for this cell alone, so that no cell depends on which
  // policies, rates or setups ran before it: one in-process router (or the oracle) seeded with
  // router_seed, or R replicas, replica r seeded with ReplicaSeed(router_seed, r).
  absl::StatusOr<CellRouters> ForCell(const ReplicaSetup& setup, const PolicySpec& policy) {
    CellRouters routers;
    if (setup.replicas == 1 && !policy.oracle && daemon_ != nullptr && daemon_->policy() == policy.kind) {
      // The daemon outlives the cell: a pool change of the previous cell is undone first.
      ELDR_RETURN_IF_ERROR(daemon_->RestorePool());
      routers.replicas.push_back(daemon_.get());
      routers.daemon = true;
      return routers;
    }
    for (int r = 0; r < setup.replicas; ++r) {
      const uint64_t seed = ReplicaSeed(options_.router_seed, r);
      absl::StatusOr<std::unique_ptr<RoutingBackend>> created =
          policy.oracle ? MakeOracleBackend(options_.cluster.decoders, seed, options_.tie_break)
                        : MakeInProcessBackend(policy.kind, options_.tau, seed, options_.cluster.decoders,
                                               options_.max_inflight, options_.tie_break, options_.max_load_gap);
      if (!created.ok()) return created.status();
      routers.replicas.push_back(created->get());
      routers.owned.push_back(*std::move(created));
    }
    return routers;
  }

  // Leaves the daemon's pool as the invocation found it (a pool_change run's worker removed, its
  // drained worker back); OK without a daemon.
  absl::Status Finish() { return daemon_ == nullptr ? absl::OkStatus() : daemon_->RestorePool(); }

 private:
  const ExperimentOptions& options_;
  std::unique_ptr<RoutingBackend> daemon_;
};

// `schedule` with its pool change named in `backend`'s workers. The plan drains the first worker of
// the pool ("decode-0" of the in-process routers) and adds "decode-N"; a daemon names its workers
// itself, so there the first of its workers is drained and the added one is "decode-N" unless the
// daemon has that id, then the first free "decode-N-sim<i>".
RunSchedule ScheduleForPool(const RunSchedule& schedule, const RoutingBackend* backend) {
  if (schedule.pool_change_arrival < 0) return schedule;
  const std::vector<std::string>& ids = backend->worker_ids();
  RunSchedule named = schedule;
  named.drain_worker = ids.front();
  const auto taken = [&ids](const std::string& id) { return std::find(ids.begin(), ids.end(), id) != ids.end(); };
  for (int i = 1; taken(named.add_worker); ++i) named.add_worker = absl::StrCat(schedule.add_worker, "-sim", i);
  return named;
}

// Calibrates eldr's centroids on the calibration split (weighted by decode tokens when asked),
// records the report and sizes in `result` and logs them.
absl::StatusOr<CentroidArtifact> CalibrateCentroids(const Workload& workload, const ExperimentOptions& options,
                                                    ExperimentResult* result) {
  CalibrationOptions calibration;
  calibration.clusters = options.cluster.decoders;
  calibration.variant = options.variant;
  calibration.seed = options.seed;
  calibration.select_layers = options.select_layers;
  calibration.mask_rule = options.mask_rule;
  calibration.weight_by_decode_tokens = options.weight_by_decode_tokens;
  calibration.balanced = options.balanced;
  calibration.model = workload.description;
  const auto start = std::chrono::steady_clock::now();
  const CalibrationData data = WithDomainShares(WithoutDomain(workload.calibration, result->drift.excluded_domain),
                                                result->drift.calibration_domain_shares);
  absl::StatusOr<CalibrationResult> calibrated = Calibrate(data, calibration);
  if (!calibrated.ok()) {
    return absl::Status(calibrated.status().code(), absl::StrCat("calibrating eldr's centroids on ", data.n,
                                                                 " requests: ", calibrated.status().message()));
  }
  CentroidArtifact centroids = calibrated->artifact;
  result->calibration = calibrated->report;
  result->calibration_requests = data.n;
  result->calibration_points = data.n - static_cast<int>(calibrated->report.excluded_requests.size());
  result->signature_dim = centroids.dim();
  Log(options, absl::StrFormat(
                   "calibrated %d centroids on %d requests disjoint from the evaluated ones%s: %d of %d layers "
                   "kept (correlation %.3f), dimension %d, %.1f s",
                   centroids.k, data.n,
                   calibrated->report.weighting != "none" ? " (balanced by decode tokens)"
                                                          : (options.balanced ? "" : " (unbalanced)"),
                   centroids.spec.masked_layers(), workload.layers, calibrated->report.mask_correlation,
                   centroids.dim(), std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
  return centroids;
}

// Simulates `arrivals` at `rate` under `policy` on the routers of `setup` (for eldr: installs the
// centroids named after the workers into every replica, plus for eldr_refit one refit driver for
// the pool, or one per replica without shared state) and logs the TPOT.
absl::StatusOr<ExperimentCell> RunCell(const Workload& workload, const std::vector<Arrival>& arrivals,
                                       const RunSchedule& schedule, const ExperimentOptions& options, double rate,
                                       const PolicySpec& policy, const ReplicaSetup& setup,
                                       const CentroidArtifact& centroids,
                                       const std::vector<RoutingBackend*>& replicas) {
  ReplicaRouters routers;
  routers.replicas = replicas;
  std::vector<std::unique_ptr<SimRefitDriver>> refits;
  if (policy.kind == PolicyKind::kEldr && !policy.oracle) {
    const CentroidArtifact named = WithWorkers(centroids, replicas.front()->worker_ids());
    for (RoutingBackend* replica : replicas) ELDR_RETURN_IF_ERROR(replica->InstallCentroids(named));
    if (policy.refit) {
      const int drivers = setup.shared_state ? 1 : setup.replicas;
      for (int d = 0; d < drivers; ++d) {
        SimRefitOptions refit_options = options.refit;
        refit_options.seed = ReplicaSeed(options.seed, d);
        ELDR_ASSIGN_OR_RETURN(std::unique_ptr<SimRefitDriver> refit, SimRefitDriver::Create(named, refit_options));
        routers.refits.push_back(refit.get());
        refits.push_back(std::move(refit));
      }
    }
  }
  ReplicaOptions replica = options.replica;
  replica.assignment_seed = options.seed;
  replica.shared_load = setup.shared_state;
  const std::string label = CellLabel(policy.name, setup);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<RunResult> run =
      SimulateReplicatedRun(workload, arrivals, options.cluster, routers, replica, schedule);
  if (!run.ok()) {
    return absl::Status(run.status().code(),
                        absl::StrFormat("rate %g, policy %s: %s", rate, label, run.status().message()));
  }
  Log(options, absl::StrFormat("rate %g req/s, %-10s TPOT p50 %.2f ms  (%.1f s)", rate, label, run->metrics.tpot_p50_ms,
                               std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
  ExperimentCell cell;
  cell.rate = rate;
  cell.policy = policy;
  cell.setup = setup;
  cell.backend = replicas.size() == 1
                     ? replicas.front()->Describe()
                     : absl::StrFormat("%d replicas of %s", replicas.size(), replicas.front()->Describe());
  cell.run = *std::move(run);
  return cell;
}

}  // namespace

std::string ReplicaSetupLabel(const ReplicaSetup& setup) {
  if (setup.replicas == 1) return "1 router";
  return absl::StrFormat("%d replicas, %s", setup.replicas, setup.shared_state ? "shared state" : "no shared state");
}

std::string CellLabel(const std::string& policy, const ReplicaSetup& setup) {
  if (setup.replicas == 1) return policy;
  return absl::StrFormat("%s R%d %s", policy, setup.replicas, setup.shared_state ? "shared" : "unshared");
}

absl::StatusOr<std::vector<int>> ParseReplicaCounts(absl::string_view list) {
  std::vector<int> counts;
  for (absl::string_view raw : absl::StrSplit(list, ',')) {
    const absl::string_view text = absl::StripAsciiWhitespace(raw);
    if (text.empty()) continue;
    int count = 0;
    if (!absl::SimpleAtoi(text, &count) || count < 1 || count > kMaxReplicas) {
      return absl::InvalidArgumentError(
          absl::StrCat("--replicas: '", text, "' is not a replica count in [1, ", kMaxReplicas, "]"));
    }
    if (std::find(counts.begin(), counts.end(), count) != counts.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--replicas: ", count, " given twice"));
    }
    counts.push_back(count);
  }
  if (counts.empty()) return absl::InvalidArgumentError("--replicas: no replica count given");
  return counts;
}

absl::StatusOr<std::vector<ReplicaSetup>> ExpandReplicaSetups(const std::vector<int>& counts,
                                                              absl::string_view shared_state) {
  std::vector<bool> modes;
  if (shared_state.empty() || shared_state == "both") {
    modes = {true, false};
  } else if (shared_state == "on") {
    modes = {true};
  } else if (shared_state == "off") {
    modes = {false};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--shared_state: '", shared_state, "' (expected on, off or both)"));
  }
  std::vector<ReplicaSetup> setups;
  for (int count : counts) {
    if (count == 1) {
      setups.push_back(ReplicaSetup{1, false});
      continue;
    }
    for (bool shared : modes) setups.push_back(ReplicaSetup{count, shared});
  }
  return setups;
}

absl::StatusOr<std::vector<PolicySpec>> ParsePolicies(absl::string_view list) {
  std::vector<PolicySpec> policies;
  for (absl::string_view raw : absl::StrSplit(list, ',')) {
    const absl::string_view name = absl::StripAsciiWhitespace(raw);
    if (name.empty()) continue;
    PolicySpec spec;
    spec.name = std::string(name);
    if (name == "eldr_refit") {
      spec.kind = PolicyKind::kEldr;
      spec.refit = true;
    } else if (name == "oracle") {
      spec.kind = PolicyKind::kJsq;
      spec.oracle = true;
    } else {
      absl::StatusOr<PolicyKind> kind = ParsePolicyKind(name);
      if (!kind.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("--policies: unknown policy '", name,
                                                       "' (expected rr, random, jsq, p2c, eldr, eldr_refit, oracle)"));
      }
      spec.kind = *kind;
    }
    for (const PolicySpec& seen : policies) {
      if (seen.name == spec.name) {
        return absl::InvalidArgumentError(absl::StrCat("--policies: '", name, "' given twice"));
      }
    }
    policies.push_back(std::move(spec));
  }
  if (policies.empty()) return absl::InvalidArgumentError("--policies: no policy given");
  return policies;
}

absl::StatusOr<std::vector<double>> ParseRates(absl::string_view list) {
  std::vector<double> rates;
  for (absl::string_view raw : absl::StrSplit(list, ',')) {
    const absl::string_view text = absl::StripAsciiWhitespace(raw);
    if (text.empty()) continue;
    double rate = 0;
    if (!absl::SimpleAtod(text, &rate) || !std::isfinite(rate) || rate <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--rates: '", text, "' is not a positive number of requests per second"));
    }
    rates.push_back(rate);
  }
  if (rates.empty()) return absl::InvalidArgumentError("--rates: no rate given");
  return rates;
}

CapacityEstimate EstimateCapacity(const Workload& workload, const ClusterOptions& cluster, uint64_t seed) {
  CapacityEstimate estimate;
  double decode_steps = 0, kv_tokens = 0;
  for (const SimRequest& request : workload.pool) {
    decode_steps += request.decode_steps;
    kv_tokens += request.prompt_tokens + request.decode_steps;
  }
  const double pool = static_cast<double>(workload.pool.size());
  estimate.mean_decode_steps = decode_steps / pool;
  const int kv_bound = static_cast<int>(cluster.kv_budget_tokens / (kv_tokens / pool));
  estimate.batch = std::max(1, std::min(cluster.max_batch, kv_bound));

  Rng rng = Rng::ForStream(seed, kStreamCapacity);
  DistinctExpertCounter counter(workload.layers, workload.experts, workload.top_k);
  constexpr int kSamples = 200;
  double distinct = 0;
  for (int s = 0; s < kSamples; ++s) {
    counter.Reset();
    for (int i = 0; i < estimate.batch; ++i) {
      const SimRequest& request = workload.pool[rng.Below(workload.pool.size())];
      counter.AddToken(workload.DecodeToken(request, static_cast<int>(rng.Below(request.decode_steps))));
    }
    distinct += static_cast<double>(counter.DistinctAllLayers());
  }
  distinct /= kSamples;
  estimate.mixed_distinct = distinct / workload.layers;
  const double step_us = DecodeStepUs(cluster.cost, estimate.batch, static_cast<int64_t>(std::lround(distinct)));
  estimate.step_ms = step_us / 1e3;
  estimate.requests_per_s = cluster.decoders * estimate.batch / (step_us / 1e6) / estimate.mean_decode_steps;
  return estimate;
}

std::vector<double> DefaultRates(const CapacityEstimate& capacity) {
  return {RoundTwoSignificant(0.30 * capacity.requests_per_s), RoundTwoSignificant(0.55 * capacity.requests_per_s),
          RoundTwoSignificant(0.80 * capacity.requests_per_s)};
}

absl::StatusOr<ExperimentResult> RunExperiment(const Workload& workload, const ExperimentOptions& options) {
  ELDR_RETURN_IF_ERROR(ValidateExperiment(workload, options));
  ExperimentResult result;
  result.ttft = options.ttft;
  result.workload = workload.description;
  result.domains = workload.domains;
  result.setups = options.setups;
  result.replica = options.replica;
  result.replica.on_sync = nullptr;
  MeasureWorkloadAndCapacity(workload, options, &result);
  ELDR_ASSIGN_OR_RETURN(
      result.drift, PlanDrift(workload, options.drift, options.requests, options.cluster.decoders, options.cluster));
  const RunSchedule schedule = ScheduleFor(result.drift);
  if (result.drift.scenario != DriftScenario::kNone) {
    Log(options, absl::StrFormat("drift %s: the change at arrival %d of %d", DriftScenarioName(result.drift.scenario),
                                 result.drift.change_arrival, options.requests));
  }

  // Routers: the daemon, or routers made for each cell (RouterPool::ForCell).
  RouterPool routers(options);
  ELDR_RETURN_IF_ERROR(routers.ConnectDaemon(&result));

  // Centroids, calibrated on the calibration split only.
  CentroidArtifact centroids;
  const bool needs_centroids = std::any_of(options.policies.begin(), options.policies.end(), [](const PolicySpec& p) {
    return p.kind == PolicyKind::kEldr && !p.oracle;
  });
  if (needs_centroids) {
    ELDR_ASSIGN_OR_RETURN(centroids, CalibrateCentroids(workload, options, &result));
    result.centroids = centroids;
  }

  for (double rate : result.rates) {
    const std::vector<Arrival> arrivals =
        MakeDriftArrivals(workload, result.drift, rate, options.requests, options.seed);
    for (const ReplicaSetup& setup : options.setups) {
      for (const PolicySpec& policy : options.policies) {
        ELDR_ASSIGN_OR_RETURN(CellRouters cell_routers, routers.ForCell(setup, policy));
        ExperimentOptions cell_options = options;
        if (cell_routers.daemon) cell_options.cluster.replay_pace = options.daemon_pace;
        ELDR_ASSIGN_OR_RETURN(ExperimentCell cell,
                              RunCell(workload, arrivals, ScheduleForPool(schedule, cell_routers.replicas.front()),
                                      cell_options, rate, policy, setup, centroids, cell_routers.replicas));
        result.cells.push_back(std::move(cell));
      }
    }
  }
  ELDR_RETURN_IF_ERROR(routers.Finish());
  return result;
}

}  // namespace eldr::sim
