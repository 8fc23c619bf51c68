// eldr-sim: replays requests through the routing code onto simulated decode workers and compares
// routing policies (docs/evaluation.md).
//
//   eldr-sim --trace data/esft-routing --prefill_fraction 0.5
//   eldr-sim --synthetic 48x128x8 --domains 4 --rates 20,40,60 --plot sim.png
//   eldr-sim --trace data/esft-routing --router grpc://127.0.0.1:50051
//   eldr-sim --synthetic 48x128x8 --replicas 1,3,16 --shared_state both
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "sim/experiment.h"
#include "sim/report.h"
#include "sim/routing_backend.h"
#include "sim/seeds.h"
#include "sim/workload.h"

extern char** environ;

namespace {
const eldr::sim::ClusterOptions kCluster;
const eldr::sim::SyntheticOptions kSynthetic;
const eldr::sim::TraceWorkloadOptions kTrace;
const eldr::sim::SimRefitOptions kRefit;
const eldr::sim::ReplicaOptions kReplica;
}  // namespace

// ---- Workload ----
ABSL_FLAG(std::string, trace, "", "Folder of real expert traces (<task>_topk.npy + <task>_offsets.npy)");
ABSL_FLAG(double, prefill_fraction, kTrace.prefill_fraction,
          "Real traces: share of each sequence that is the prompt; the rest are decode steps");
ABSL_FLAG(int, experts, kTrace.experts, "Real traces: routed experts of the traced model");
ABSL_FLAG(double, calibration_fraction, kTrace.calibration_fraction,
          "Real traces: share of each domain's sequences used only to calibrate eldr's centroids");
ABSL_FLAG(std::string, synthetic, "", "Synthetic workload geometry LAYERSxEXPERTSxTOPK, e.g. 48x128x8 (Qwen3-30B-A3B)");
ABSL_FLAG(int, domains, kSynthetic.domains, "Synthetic: number of domains");
ABSL_FLAG(int, topics_per_domain, kSynthetic.topics_per_domain, "Synthetic: topics inside each domain");
ABSL_FLAG(double, locality, kSynthetic.locality,
          "Synthetic: strength of domain and topic structure (0 = none; 1 = the published structure)");
ABSL_FLAG(int, calibration_requests, kSynthetic.calibration_requests,
          "Synthetic: requests generated only to calibrate eldr's centroids");
ABSL_FLAG(double, prompt_tokens_mean, kSynthetic.prompt_tokens_mean, "Synthetic: mean prompt tokens");
ABSL_FLAG(double, output_tokens_mean, kSynthetic.output_tokens_mean, "Synthetic: mean output tokens");
ABSL_FLAG(int, requests, kSynthetic.requests, "Arrivals simulated per rate");

// ---- Cluster and cost model ----
ABSL_FLAG(int, decoders, 0, "Decode workers; 0: 16, or with --router the daemon's number of active workers");
ABSL_FLAG(int, prefill_workers, kCluster.prefill_workers, "Prefill servers");
ABSL_FLAG(int, max_batch, kCluster.max_batch, "Continuous batching limit of a decode worker");
ABSL_FLAG(int64_t, kv_budget_tokens, kCluster.kv_budget_tokens, "KV cache of a decode worker, tokens");
ABSL_FLAG(double, t_fixed_us, kCluster.cost.t_fixed_us, "Decode step: fixed cost, us");
ABSL_FLAG(double, t_token_us, kCluster.cost.t_token_us, "Decode step: cost per token in the batch, us");
ABSL_FLAG(double, t_expert_us, kCluster.cost.t_expert_us,
          "Decode step: cost per distinct expert per layer (weight load), us");
ABSL_FLAG(double, prefill_fixed_us, kCluster.cost.prefill_fixed_us, "Prefill: fixed cost, us");
ABSL_FLAG(double, prefill_token_us, kCluster.cost.prefill_token_us, "Prefill: cost per prompt token, us");
ABSL_FLAG(double, kv_transfer_us, kCluster.cost.kv_transfer_us, "KV handoff prefill -> decode, us");

// ---- Policies and router ----
ABSL_FLAG(std::string, policies, "rr,random,jsq,p2c,eldr,eldr_refit",
          "Policies to compare: rr, random, jsq, p2c, eldr, eldr_refit, oracle. oracle knows each request's domain "
          "label: every domain gets a group of workers in proportion to its share of the decode work of the arrivals "
          "(per drift phase), and a request goes to the least-loaded worker of its domain's group (an upper bound on "
          "what locality can give; one router only)");
ABSL_FLAG(double, tau, 0.1, "eldr locality band width (in-process routers; a daemon uses its own)");
ABSL_FLAG(std::string, ttft, "decode",
          "TTFT in the table: decode (arrival to the end of the first decode step) or prefill (the reference "
          "implementation's: arrival to the end of prefill, whose first token its proxy delivers); JSON and CSV carry "
          "both");
ABSL_FLAG(std::string, tie_break, "random",
          "Among equally loaded workers (in-process routers): random, or lowest_index (the reference implementation's "
          "rule)");
ABSL_FLAG(int64_t, max_inflight, -1,
          "Overload guard of the in-process routers (WorkerSpec::max_inflight): a worker with this "
          "many in-flight requests leaves eldr's band. -1: --max_batch; 0: no guard");
ABSL_FLAG(double, max_load_gap, 4,
          "Load-gap guard of the in-process routers (RouterOptions::max_load_gap; 4 is eldr-router's "
          "--eldr_max_load_gap default): eldr sends a request to the least loaded worker when its band's pick carries "
          "more than this many in-flight requests above the pool's mean. 0: off");
ABSL_FLAG(std::string, variant, "count_idf",
          "Signature variant: count, count_idf or gate_prob (synthetic workloads: prompts' gate-probability sums)");
ABSL_FLAG(bool, select_layers, true, "Calibration: greedy layer-mask search");
ABSL_FLAG(bool, weight_by_decode_tokens, true,
          "Calibration: balance the clusters by each request's decode tokens (decode work) rather "
          "than by request counts; IDF and the layer mask count every request once");
ABSL_FLAG(std::string, mask_rule, "global_maximum",
          "Calibration: layer mask from the greedy curve, global_maximum (the reference's rule) or first_decrease");
ABSL_FLAG(bool, balanced, true, "Calibration: capacity-balanced k-means; false: plain spherical k-means");
ABSL_FLAG(std::string, router, "",
          "grpc://HOST:PORT of a running eldr-router: every Route and Complete of the policies it "
          "serves goes to it; empty: the routing library in this process");
ABSL_FLAG(
    std::string, router_admin, "",
    "grpc://HOST:PORT of that eldr-router's RouterAdmin listener (its --admin_listen); empty: the --router address");
ABSL_FLAG(uint64_t, router_seed, 0x5eed, "Tie-breaking seed of the in-process routers (eldr-router's default)");
ABSL_FLAG(double, rpc_timeout_s, 10, "Deadline of each RPC to the router, seconds");
ABSL_FLAG(double, pace, 0,
          "With --router: replay the cells the daemon routes at this many simulated seconds per wall-clock second "
          "(each event waits for its simulated time / pace), so that the daemon's wall-clock timers (online refit "
          "interval and window, the refit's 250 ms settle after a pool change) see the simulated timeline; 0: as fast "
          "as the daemon answers (~35x simulated time on the real traces here)");
ABSL_FLAG(double, refit_interval_s, kRefit.interval_s, "eldr_refit: simulated seconds between refits");
ABSL_FLAG(double, refit_window_s, kRefit.window_s, "eldr_refit: rolling window of signatures, seconds");
ABSL_FLAG(double, refit_max_locality_decrease, kRefit.max_locality_decrease,
          "eldr_refit: the install guard's locality bound, as eldr-router --refit_max_locality_decrease");
ABSL_FLAG(double, refit_min_experts_gain, kRefit.min_experts_gain,
          "eldr_refit: the install guard's locality bound, as eldr-router --refit_min_experts_gain");
ABSL_FLAG(double, refit_expert_picks, kRefit.expert_picks,
          "eldr_refit: the locality bound's step model, as eldr-router --refit_expert_picks");

// ---- Drift ----
ABSL_FLAG(std::string, drift, "none",
          "Workload change during each run, at --drift_at of the arrivals, reported per phase (before / after) and "
          "overall: none; mix_shift (the first half of the domains take --drift_dominant_share of the arrivals "
          "before the change, the other half after it); new_domain (--drift_new_domain is left out of the "
          "calibration split and of the arrivals before the change, then arrives in its natural share); "
          "pool_change (decode-N joins and decode-0 is drained, then removed once empty, through the router's "
          "elastic pool; eldr_refit refits for the new pool, static eldr keeps its centroids; with --router through "
          "RouterAdmin UpsertWorker / DrainWorker / RemoveWorker: the daemon's first worker is drained, it needs a "
          "static pool (--workers, not --discovery=kubernetes), and its pool is restored after each run). "
          "In mix_shift and new_domain each phase's arrival rate is scaled so that it offers the decode work per "
          "second of the undrifted mix at --rates");
ABSL_FLAG(double, drift_at, eldr::sim::DriftOptions().change_fraction,
          "Drift: the change point as a fraction of the arrivals (between --warmup_fraction and "
          "1 - --cooldown_fraction)");
ABSL_FLAG(double, drift_dominant_share, eldr::sim::DriftOptions().dominant_share,
          "Drift mix_shift: the dominant domains' share of the arrivals, in (0, 1)");
ABSL_FLAG(std::string, drift_new_domain, "", "Drift new_domain: the domain that appears; empty: the last one");
ABSL_FLAG(std::string, drift_calibration, "pool",
          "Drift mix_shift: what eldr's centroids are calibrated on: pool (the calibration split in its natural "
          "mix) or before (the split subsampled to the mix before the change: calibrated on the traffic of the "
          "day, which then shifts)");

// ---- Router replicas ----
ABSL_FLAG(std::string, replicas, "1",
          "Router replica counts to compare, e.g. 1,3,16: R in-process eldr::Routers over the same decode "
          "workers, each routing 1/R of the arrivals (several eldr-router replicas, or one sidecar per prefill pod)");
ABSL_FLAG(std::string, shared_state, "",
          "With R > 1: on (replicas share lease counts and one refitter, as eldr-router --cluster_redis), off "
          "(each counts its own leases and refits alone), or both; empty: both");
ABSL_FLAG(double, replica_sync_ms, kReplica.sync_period_ms,
          "Shared state: simulated ms between lease-count syncs (eldr-router's cluster load interval)");
ABSL_FLAG(std::string, replica_sync_phases, "aligned",
          "Shared state: aligned (every replica syncs at the same instants) or staggered (replica r of R "
          "at r/R of a period later, as replicas whose timers started at different times)");
ABSL_FLAG(double, replica_install_lag_ms, -1,
          "Shared state, eldr_refit: simulated ms after the leader before the other replicas install a refitted "
          "set; -1: --replica_sync_ms");
ABSL_FLAG(std::string, replica_assignment, std::string(eldr::sim::ReplicaAssignmentName(kReplica.assignment)),
          "Which replica routes an arrival: modulo (arrival index mod R) or random (seeded by --seed)");

// ---- Run ----
ABSL_FLAG(std::string, rates, "",
          "Comma-separated arrival rates, requests/s; empty: 30%, 55% and 80% of the estimated capacity");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the workload, arrivals, split and calibration");
ABSL_FLAG(std::string, seeds, "",
          "Run the whole experiment once per seed, e.g. 1-6 or 1,2,3 (instead of --seed), and report per policy, "
          "rate and phase the mean and standard error over the seeds of TPOT and TTFT and of the % difference from "
          "the best load balancer (the best of rr/random/jsq/p2c in each seed, then averaged). Without --rates, every "
          "seed runs at the first seed's default rates. --plot and --centroids_out use the first seed's run");
ABSL_FLAG(double, warmup_fraction, kCluster.warmup_fraction, "Share of first arrivals not measured");
ABSL_FLAG(double, cooldown_fraction, kCluster.cooldown_fraction, "Share of last arrivals not measured");

// ---- Output ----
ABSL_FLAG(bool, json, false, "Print one JSON object on stdout instead of the table");
ABSL_FLAG(bool, csv, false, "Print CSV on stdout instead of the table");
ABSL_FLAG(std::string, json_out, "", "Also write the JSON object to this file");
ABSL_FLAG(std::string, centroids_out, "",
          "Also write eldr's centroids, calibrated on the calibration split, to this file (a centroid artifact "
          "eldr-router loads; rows in pool order)");
ABSL_FLAG(std::string, csv_out, "", "Also write the CSV to this file");
ABSL_FLAG(std::string, plot, "", "Write the figure (PNG: TPOT CDFs, median/P99 bars) to this file");
ABSL_FLAG(std::string, plot_script, ELDR_SIM_DEFAULT_PLOT_SCRIPT, "The plotting script");
ABSL_FLAG(std::string, python, "/usr/bin/python3", "Python with matplotlib, for --plot");
ABSL_FLAG(bool, quiet, false, "No progress lines on stderr");

namespace {

int Fail(const std::string& message) {
  std::cerr << "eldr-sim: " << message << "\n";
  return 2;
}

int Fail(const absl::Status& status) { return Fail(std::string(status.message())); }

// Runs `argv` (no shell) and waits; returns its exit status or a message.
absl::Status RunCommand(const std::vector<std::string>& argv) {
  std::vector<char*> raw;
  for (const std::string& arg : argv) raw.push_back(const_cast<char*>(arg.c_str()));
  raw.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, raw[0], nullptr, nullptr, raw.data(), environ);
  if (spawned != 0) {
    return absl::UnavailableError(absl::StrCat("cannot start ", argv[0], ": ", std::strerror(spawned)));
  }
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return absl::InternalError("waitpid failed");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat(absl::StrJoin(argv, " "), " failed (status ", status, ")"));
  }
  return absl::OkStatus();
}

absl::Status DrawFigure(const eldr::sim::ExperimentResult& result, const std::string& png) {
  char data_path[] = "/tmp/eldr-sim-plot-XXXXXX";
  const int fd = mkstemp(data_path);
  if (fd < 0) return absl::InternalError("cannot create a temporary file for the figure data");
  close(fd);
  const std::string text = eldr::sim::ToJson(result, /*with_samples=*/true).dump();
  absl::Status status = eldr::WriteFileAtomically(data_path, text);
  if (status.ok()) {
    status =
        RunCommand({absl::GetFlag(FLAGS_python), absl::GetFlag(FLAGS_plot_script), "--input", data_path, "--out", png});
  }
  std::remove(data_path);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Simulates a prefill/decode-disaggregated MoE pool and compares decode routing policies.\n"
      "  eldr-sim --trace DIR [--prefill_fraction F]   real expert traces\n"
      "  eldr-sim --synthetic LxExK [--domains N]      synthetic workload\n"
      "See docs/evaluation.md.");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    return Fail(absl::StrCat("unexpected argument '", positional[1], "' (flags are --name=value)"));
  }
  const bool quiet = absl::GetFlag(FLAGS_quiet);
  auto log = [quiet](const std::string& line) {
    if (!quiet) std::cerr << line << std::endl;
  };

  // Workload.
  const std::string trace_dir = absl::GetFlag(FLAGS_trace);
  const std::string geometry = absl::GetFlag(FLAGS_synthetic);
  if (trace_dir.empty() == geometry.empty()) {
    return Fail("give exactly one workload: --trace DIR (real traces) or --synthetic LxExK");
  }
  const int requests = absl::GetFlag(FLAGS_requests);
  if (requests < 20) return Fail("--requests must be >= 20");
  eldr::sim::SyntheticOptions synthetic_geometry;
  if (!geometry.empty()) {
    if (absl::Status parsed = eldr::sim::ParseGeometry(geometry, &synthetic_geometry); !parsed.ok()) {
      return Fail(parsed);
    }
  }
  if (!trace_dir.empty()) {
    const double fraction = absl::GetFlag(FLAGS_prefill_fraction);
    if (!(fraction > 0 && fraction < 1)) {
      return Fail(absl::StrCat("--prefill_fraction must be in (0, 1), got ", fraction));
    }
  }

  // Everything else is checked before the workload is built (a synthetic one takes seconds).
  eldr::sim::ExperimentOptions options;
  const int decoders_flag = absl::GetFlag(FLAGS_decoders);
  if (decoders_flag < 0) return Fail("--decoders must be >= 0 (0: the default)");
  options.cluster.decoders = decoders_flag > 0 ? decoders_flag : kCluster.decoders;
  options.cluster.prefill_workers = absl::GetFlag(FLAGS_prefill_workers);
  options.cluster.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.cluster.kv_budget_tokens = absl::GetFlag(FLAGS_kv_budget_tokens);
  options.cluster.cost.t_fixed_us = absl::GetFlag(FLAGS_t_fixed_us);
  options.cluster.cost.t_token_us = absl::GetFlag(FLAGS_t_token_us);
  options.cluster.cost.t_expert_us = absl::GetFlag(FLAGS_t_expert_us);
  options.cluster.cost.prefill_fixed_us = absl::GetFlag(FLAGS_prefill_fixed_us);
  options.cluster.cost.prefill_token_us = absl::GetFlag(FLAGS_prefill_token_us);
  options.cluster.cost.kv_transfer_us = absl::GetFlag(FLAGS_kv_transfer_us);
  options.cluster.warmup_fraction = absl::GetFlag(FLAGS_warmup_fraction);
  options.cluster.cooldown_fraction = absl::GetFlag(FLAGS_cooldown_fraction);
  if (absl::Status valid = eldr::sim::ValidateClusterOptions(options.cluster); !valid.ok()) {
    return Fail(valid);
  }
  absl::StatusOr<std::vector<eldr::sim::PolicySpec>> policies = eldr::sim::ParsePolicies(absl::GetFlag(FLAGS_policies));
  if (!policies.ok()) return Fail(policies.status());
  options.policies = *policies;
  if (const std::string rates = absl::GetFlag(FLAGS_rates); !rates.empty()) {
    absl::StatusOr<std::vector<double>> parsed = eldr::sim::ParseRates(rates);
    if (!parsed.ok()) return Fail(parsed.status());
    options.rates = *parsed;
  }
  options.requests = requests;
  options.tau = absl::GetFlag(FLAGS_tau);
  absl::StatusOr<eldr::TieBreak> tie_break = eldr::ParseTieBreak(absl::GetFlag(FLAGS_tie_break));
  if (!tie_break.ok()) return Fail(tie_break.status());
  options.tie_break = *tie_break;
  absl::StatusOr<eldr::sim::TtftDefinition> ttft = eldr::sim::ParseTtftDefinition(absl::GetFlag(FLAGS_ttft));
  if (!ttft.ok()) return Fail(ttft.status());
  options.ttft = *ttft;
  options.seed = absl::GetFlag(FLAGS_seed);
  options.router_seed = absl::GetFlag(FLAGS_router_seed);
  options.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  if (options.max_inflight == -1) options.max_inflight = options.cluster.max_batch;
  if (options.max_inflight < 0) return Fail("--max_inflight must be -1 (= --max_batch), 0 (none) or positive");
  options.max_load_gap = absl::GetFlag(FLAGS_max_load_gap);
  if (!std::isfinite(options.max_load_gap) || options.max_load_gap < 0) {
    return Fail("--max_load_gap must be finite and >= 0 (0: off)");
  }
  absl::StatusOr<eldr::SignatureVariant> variant = eldr::ParseSignatureVariant(absl::GetFlag(FLAGS_variant));
  if (!variant.ok()) return Fail(absl::StrCat("--variant: ", variant.status().message()));
  if (*variant == eldr::SignatureVariant::kGateProb && !trace_dir.empty()) {
    return Fail(
        "--variant gate_prob needs gate probabilities, which the real traces do not carry (expert ids only); "
        "use a --synthetic workload, or count / count_idf");
  }
  options.variant = *variant;
  options.cluster.gate_prob_signatures = *variant == eldr::SignatureVariant::kGateProb;
  options.select_layers = absl::GetFlag(FLAGS_select_layers);
  options.weight_by_decode_tokens = absl::GetFlag(FLAGS_weight_by_decode_tokens);
  options.balanced = absl::GetFlag(FLAGS_balanced);
  absl::StatusOr<eldr::LayerMaskRule> mask_rule = eldr::ParseLayerMaskRule(absl::GetFlag(FLAGS_mask_rule));
  if (!mask_rule.ok()) return Fail(mask_rule.status());
  options.mask_rule = *mask_rule;
  options.refit.interval_s = absl::GetFlag(FLAGS_refit_interval_s);
  options.refit.window_s = absl::GetFlag(FLAGS_refit_window_s);
  options.refit.max_locality_decrease = absl::GetFlag(FLAGS_refit_max_locality_decrease);
  options.refit.min_experts_gain = absl::GetFlag(FLAGS_refit_min_experts_gain);
  options.refit.expert_picks = absl::GetFlag(FLAGS_refit_expert_picks);
  if (!(options.refit.interval_s > 0) || !(options.refit.window_s > 0)) {
    return Fail("--refit_interval_s and --refit_window_s must be > 0");
  }
  absl::StatusOr<std::vector<int>> replica_counts = eldr::sim::ParseReplicaCounts(absl::GetFlag(FLAGS_replicas));
  if (!replica_counts.ok()) return Fail(replica_counts.status());
  absl::StatusOr<std::vector<eldr::sim::ReplicaSetup>> setups =
      eldr::sim::ExpandReplicaSetups(*replica_counts, absl::GetFlag(FLAGS_shared_state));
  if (!setups.ok()) return Fail(setups.status());
  options.setups = *setups;
  absl::StatusOr<eldr::sim::ReplicaAssignment> assignment =
      eldr::sim::ParseReplicaAssignment(absl::GetFlag(FLAGS_replica_assignment));
  if (!assignment.ok()) return Fail(assignment.status());
  options.replica.assignment = *assignment;
  options.replica.sync_period_ms = absl::GetFlag(FLAGS_replica_sync_ms);
  if (!(options.replica.sync_period_ms > 0)) return Fail("--replica_sync_ms must be > 0");
  if (const std::string phases = absl::GetFlag(FLAGS_replica_sync_phases); phases == "staggered") {
    options.replica.staggered_sync = true;
  } else if (phases != "aligned") {
    return Fail(absl::StrCat("--replica_sync_phases: '", phases, "' (expected aligned or staggered)"));
  }
  options.replica.install_lag_ms = absl::GetFlag(FLAGS_replica_install_lag_ms);
  if (options.replica.install_lag_ms == -1) options.replica.install_lag_ms = options.replica.sync_period_ms;
  if (!(options.replica.install_lag_ms >= 0)) {
    return Fail("--replica_install_lag_ms must be -1 (= --replica_sync_ms) or >= 0");
  }
  options.daemon_pace = absl::GetFlag(FLAGS_pace);
  if (!(options.daemon_pace >= 0) || std::isinf(options.daemon_pace)) return Fail("--pace must be finite and >= 0");
  if (options.daemon_pace > 0 && absl::GetFlag(FLAGS_router).empty()) {
    return Fail("--pace paces the cells a daemon routes: it needs --router");
  }
  options.rpc_timeout_s = absl::GetFlag(FLAGS_rpc_timeout_s);
  if (!(options.rpc_timeout_s > 0)) return Fail("--rpc_timeout_s must be > 0");
  if (const std::string router = absl::GetFlag(FLAGS_router); !router.empty()) {
    for (const eldr::sim::ReplicaSetup& setup : options.setups) {
      if (setup.replicas > 1) return Fail("--replicas > 1 runs in-process router replicas: drop --router");
    }
    absl::StatusOr<std::string> target = eldr::sim::ParseGrpcTarget(router);
    if (!target.ok()) return Fail(target.status());
    options.grpc_target = *target;
    options.grpc_admin_target = options.grpc_target;
    if (const std::string admin = absl::GetFlag(FLAGS_router_admin); !admin.empty()) {
      absl::StatusOr<std::string> admin_target = eldr::sim::ParseGrpcTarget(admin);
      if (!admin_target.ok()) return Fail(admin_target.status());
      options.grpc_admin_target = *admin_target;
    }
    // Without an explicit --decoders, simulate as many decode workers as the daemon routes to.
    if (decoders_flag == 0) {
      absl::StatusOr<eldr::sim::DaemonInfo> daemon =
          eldr::sim::QueryDaemon(options.grpc_target, options.grpc_admin_target, options.rpc_timeout_s);
      if (!daemon.ok()) return Fail(daemon.status());
      options.cluster.decoders = static_cast<int>(daemon->worker_ids.size());
    }
  }
  const bool json = absl::GetFlag(FLAGS_json), csv = absl::GetFlag(FLAGS_csv);
  if (json && csv) return Fail("--json and --csv both print on stdout: pick one (or use --csv_out)");
  absl::StatusOr<eldr::sim::DriftScenario> scenario = eldr::sim::ParseDriftScenario(absl::GetFlag(FLAGS_drift));
  if (!scenario.ok()) return Fail(scenario.status());
  options.drift.scenario = *scenario;
  options.drift.change_fraction = absl::GetFlag(FLAGS_drift_at);
  options.drift.dominant_share = absl::GetFlag(FLAGS_drift_dominant_share);
  options.drift.new_domain = absl::GetFlag(FLAGS_drift_new_domain);
  const std::string drift_calibration = absl::GetFlag(FLAGS_drift_calibration);
  if (drift_calibration != "pool" && drift_calibration != "before") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--drift_calibration must be pool or before, got '", drift_calibration, "'")));
  }
  options.drift.calibrate_before = drift_calibration == "before";
  std::vector<uint64_t> seeds = {absl::GetFlag(FLAGS_seed)};
  if (const std::string list = absl::GetFlag(FLAGS_seeds); !list.empty()) {
    if (absl::GetFlag(FLAGS_seed) != 1) return Fail("give --seed or --seeds, not both");
    absl::StatusOr<std::vector<uint64_t>> parsed = eldr::sim::ParseSeeds(list);
    if (!parsed.ok()) return Fail(parsed.status());
    seeds = *parsed;
  }

  options.log = log;
  // One experiment per seed: the workload (trace split or generation), arrivals, calibration and
  // refit follow the seed.
  std::vector<eldr::sim::ExperimentResult> runs;
  for (const uint64_t seed : seeds) {
    absl::StatusOr<eldr::sim::Workload> workload;
    if (!trace_dir.empty()) {
      eldr::sim::TraceWorkloadOptions trace;
      trace.dir = trace_dir;
      trace.experts = absl::GetFlag(FLAGS_experts);
      trace.prefill_fraction = absl::GetFlag(FLAGS_prefill_fraction);
      trace.calibration_fraction = absl::GetFlag(FLAGS_calibration_fraction);
      trace.seed = seed;
      workload = eldr::sim::LoadTraceWorkload(trace);
    } else {
      eldr::sim::SyntheticOptions synthetic = synthetic_geometry;
      synthetic.domains = absl::GetFlag(FLAGS_domains);
      synthetic.topics_per_domain = absl::GetFlag(FLAGS_topics_per_domain);
      synthetic.locality = absl::GetFlag(FLAGS_locality);
      synthetic.requests = requests;
      synthetic.calibration_requests = absl::GetFlag(FLAGS_calibration_requests);
      synthetic.prompt_tokens_mean = absl::GetFlag(FLAGS_prompt_tokens_mean);
      synthetic.output_tokens_mean = absl::GetFlag(FLAGS_output_tokens_mean);
      synthetic.seed = seed;
      log("generating the synthetic workload");
      const auto start = std::chrono::steady_clock::now();
      workload = eldr::sim::GenerateSyntheticWorkload(synthetic);
      log(absl::StrFormat("generated in %.1f s",
                          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
    }
    if (!workload.ok()) return Fail(workload.status());
    if (seeds.size() > 1) log(absl::StrCat("seed ", seed));
    log(absl::StrCat("workload: ", workload->description));
    options.seed = seed;
    absl::StatusOr<eldr::sim::ExperimentResult> run = eldr::sim::RunExperiment(*workload, options);
    if (!run.ok()) return Fail(run.status());
    // Every seed at the same rates (the first seed's defaults unless --rates), so cells aggregate.
    if (options.rates.empty()) options.rates = run->rates;
    runs.push_back(*std::move(run));
  }
  const eldr::sim::ExperimentResult& first = runs.front();

  // Outputs.
  if (const std::string path = absl::GetFlag(FLAGS_centroids_out); !path.empty()) {
    if (first.centroids.k == 0) return Fail(absl::InvalidArgumentError("--centroids_out needs policy eldr"));
    if (absl::Status s = eldr::SaveCentroidArtifact(first.centroids, path); !s.ok()) return Fail(s);
  }
  std::string json_text, csv_text, table_text;
  if (seeds.size() == 1) {
    json_text = eldr::sim::ToJson(first, false).dump(2);
    csv_text = eldr::sim::FormatCsv(first);
    table_text = eldr::sim::FormatTable(first);
  } else {
    eldr::sim::MultiSeedResult multi;
    multi.seeds = seeds;
    absl::StatusOr<std::vector<eldr::sim::AggregateCell>> cells = eldr::sim::AggregateSeeds(runs);
    if (!cells.ok()) return Fail(cells.status());
    multi.cells = *std::move(cells);
    multi.runs = std::move(runs);
    json_text = eldr::sim::SeedsToJson(multi).dump(2);
    csv_text = eldr::sim::FormatSeedsCsv(multi);
    table_text = eldr::sim::FormatSeedsTable(multi);
    runs = std::move(multi.runs);
  }
  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    if (absl::Status s = eldr::WriteFileAtomically(path, json_text + "\n"); !s.ok()) return Fail(s);
  }
  if (const std::string path = absl::GetFlag(FLAGS_csv_out); !path.empty()) {
    if (absl::Status s = eldr::WriteFileAtomically(path, csv_text); !s.ok()) return Fail(s);
  }
  if (json) {
    std::cout << json_text << "\n";
  } else if (csv) {
    std::cout << csv_text;
  } else {
    std::cout << table_text;
  }
  if (const std::string png = absl::GetFlag(FLAGS_plot); !png.empty()) {
    if (absl::Status drawn = DrawFigure(runs.front(), png); !drawn.ok()) return Fail(drawn);
    (json || csv ? std::cerr : std::cout) << "figure written to " << png << "\n";
  }
  return 0;
}
