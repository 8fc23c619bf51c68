#include "sim/report.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace eldr::sim {
namespace {

bool IsLoadBalancer(const PolicySpec& policy) { return !policy.oracle && policy.kind != PolicyKind::kEldr; }

// A cell's figures over the whole run (phase -1) or over one phase.
const RunMetrics& MetricsOf(const ExperimentCell& cell, int phase) {
  if (phase < 0 || phase >= static_cast<int>(cell.run.phases.size())) return cell.run.metrics;
  return cell.run.phases[phase].metrics;
}

std::string PhaseLabel(const ExperimentResult& result, int phase) {
  if (phase < 0) return "all";
  if (phase < static_cast<int>(result.drift.phase_labels.size())) return result.drift.phase_labels[phase];
  return absl::StrCat("phase", phase);
}

// The best (lowest) median and P99 TPOT among the load balancers at `rate`; infinity when none ran.
struct Baseline {
  double p50 = std::numeric_limits<double>::infinity();
  double p99 = std::numeric_limits<double>::infinity();
  std::string p50_policy, p99_policy;
};

bool SameSetup(const ReplicaSetup& a, const ReplicaSetup& b) {
  return a.replicas == b.replicas && a.shared_state == b.shared_state;
}

// The best load balancer among the cells of `rate` and `setup`: R replicas of eldr are compared
// with R replicas of each load balancer (sharing state or not as eldr's).
Baseline BestBaseline(const ExperimentResult& result, double rate, const ReplicaSetup& setup, int phase) {
  Baseline best;
  for (const ExperimentCell& cell : result.cells) {
    if (cell.rate != rate || !SameSetup(cell.setup, setup) || !IsLoadBalancer(cell.policy)) continue;
    const RunMetrics& m = MetricsOf(cell, phase);
    if (m.tpot_p50_ms < best.p50) {
      best.p50 = m.tpot_p50_ms;
      best.p50_policy = cell.policy.name;
    }
    if (m.tpot_p99_ms < best.p99) {
      best.p99 = m.tpot_p99_ms;
      best.p99_policy = cell.policy.name;
    }
  }
  return best;
}

// The rows of `rate` and `setup` over the whole run (phase -1) or one phase.
void AppendRows(const ExperimentResult& result, double rate, const ReplicaSetup& setup, int phase, std::string* out) {
  const Baseline best = BestBaseline(result, rate, setup, phase);
  for (const ExperimentCell& cell : result.cells) {
    if (cell.rate != rate || !SameSetup(cell.setup, setup)) continue;
    const RunMetrics& m = MetricsOf(cell, phase);
    std::string versus;
    if (!IsLoadBalancer(cell.policy) && std::isfinite(best.p50)) {
      versus = absl::StrFormat("%+.1f%% / %+.1f%%", 100 * (m.tpot_p50_ms / best.p50 - 1),
                               100 * (m.tpot_p99_ms / best.p99 - 1));
    }
    absl::StrAppendFormat(out, "%-11s %8.2f %8.2f %8.2f %9.1f %9.1f %9.1f %9.2f %7.1f %15s\n", cell.policy.name,
                          m.tpot_p50_ms, m.tpot_p90_ms, m.tpot_p99_ms,
                          result.ttft == TtftDefinition::kPrefill ? m.ttft_prefill_p50_ms : m.ttft_p50_ms,
                          result.ttft == TtftDefinition::kPrefill ? m.ttft_prefill_p99_ms : m.ttft_p99_ms,
                          m.distinct_experts_per_layer, m.load_imbalance, m.mean_batch, versus);
  }
  if (std::isfinite(best.p50)) {
    absl::StrAppendFormat(out, "best load balancer: p50 %s %.2f ms, p99 %s %.2f ms\n", best.p50_policy, best.p50,
                          best.p99_policy, best.p99);
  }
}

// The phases of the first cell of `rate` (every cell of a rate has the same arrivals and phases).
const std::vector<PhaseResult>* PhasesOf(const ExperimentResult& result, double rate) {
  for (const ExperimentCell& cell : result.cells) {
    if (cell.rate == rate && !cell.run.phases.empty()) return &cell.run.phases;
  }
  return nullptr;
}

nlohmann::json MetricsJson(const RunMetrics& m) {
  return {
      {"tpot_p50_ms", m.tpot_p50_ms},
      {"tpot_p90_ms", m.tpot_p90_ms},
      {"tpot_p99_ms", m.tpot_p99_ms},
      {"ttft_p50_ms", m.ttft_p50_ms},
      {"ttft_p99_ms", m.ttft_p99_ms},
      {"ttft_prefill_p50_ms", m.ttft_prefill_p50_ms},
      {"ttft_prefill_p99_ms", m.ttft_prefill_p99_ms},
      {"distinct_experts_per_layer", m.distinct_experts_per_layer},
      {"load_imbalance", m.load_imbalance},
      {"mean_batch", m.mean_batch},
      {"decode_tokens_per_s", m.decode_tokens_per_s},
      {"measured_requests", m.measured_requests},
      {"mean_similarity", m.mean_similarity},
      {"mean_band_size", m.mean_band_size},
  };
}

void AppendCsvRow(const ExperimentCell& cell, const RunMetrics& m, const std::string* phase, std::string* out) {
  absl::StrAppendFormat(out, "%g,%s,%.4f,%.4f,%.4f,%.3f,%.3f,%.3f,%.4f,%.3f,%.1f,%d,%d,%d,%.3f,%.3f", cell.rate,
                        cell.policy.name, m.tpot_p50_ms, m.tpot_p90_ms, m.tpot_p99_ms, m.ttft_p50_ms, m.ttft_p99_ms,
                        m.distinct_experts_per_layer, m.load_imbalance, m.mean_batch, m.decode_tokens_per_s,
                        m.measured_requests, cell.setup.replicas, cell.setup.shared_state ? 1 : 0,
                        m.ttft_prefill_p50_ms, m.ttft_prefill_p99_ms);
  if (phase != nullptr) absl::StrAppend(out, ",", *phase);
  absl::StrAppend(out, "\n");
}

std::string LoadLabel(double rate, double capacity) {
  if (capacity <= 0) return "";
  return absl::StrFormat("%.0f%% of the estimated capacity %.1f req/s", 100 * rate / capacity, capacity);
}

}  // namespace

std::string FormatTable(const ExperimentResult& result) {
  std::string out;
  absl::StrAppend(&out, "workload: ", result.workload, "\n");
  absl::StrAppendFormat(&out,
                        "structure: one-domain batches of %d touch %.1f%% fewer distinct experts than "
                        "mixed ones (%.1f vs %.1f per layer); prompt/decode correlation %.2f\n",
                        result.locality.batch, 100 * result.locality.same_domain_reduction,
                        result.locality.same_domain_distinct, result.locality.mixed_distinct,
                        result.locality.prompt_decode_correlation);
  absl::StrAppendFormat(&out, "router: %s\n", result.router);
  if (result.drift.scenario != DriftScenario::kNone) {
    absl::StrAppendFormat(&out, "drift: %s at arrival %d%s\n", DriftScenarioName(result.drift.scenario),
                          result.drift.change_arrival,
                          result.drift.scenario == DriftScenario::kPoolChange
                              ? absl::StrCat(" (", result.drift.add_worker, " joins, ", result.drift.drain_worker,
                                             " is drained and removed)")
                              : "");
  }
  // One block of rows per router setup, labelled, unless the only setup is one router.
  const bool label_setups = result.setups.size() > 1 || (!result.setups.empty() && result.setups[0].replicas > 1);
  if (label_setups) {
    absl::StrAppendFormat(&out,
                          "router replicas: arrivals assigned by %s; shared state = lease counts synced every %g ms "
                          "(%s) and one refitter whose sets followers install %g ms later\n",
                          ReplicaAssignmentName(result.replica.assignment), result.replica.sync_period_ms,
                          result.replica.staggered_sync ? "staggered" : "aligned", result.replica.install_lag_ms);
  }
  for (double rate : result.rates) {
    absl::StrAppendFormat(&out, "\nrate %g req/s (%s)\n", rate, LoadLabel(rate, result.capacity.requests_per_s));
    absl::StrAppendFormat(&out, "%-11s %8s %8s %8s %9s %9s %9s %9s %7s %15s\n", "policy", "TPOT p50", "p90", "p99 ms",
                          "TTFT p50", "p99 ms", "experts/", "load", "batch", "vs best LB");
    absl::StrAppendFormat(&out, "%-11s %8s %8s %8s %9s %9s %9s %9s %7s %15s\n", "", "", "", "",
                          result.ttft == TtftDefinition::kPrefill ? "(prefill)" : "", "", "layer", "imbalance", "",
                          "p50 / p99");
    const std::vector<PhaseResult>* phases = PhasesOf(result, rate);
    for (int phase = -1; phase < (phases == nullptr ? 0 : static_cast<int>(phases->size())); ++phase) {
      if (phase >= 0) {
        const PhaseResult& span = (*phases)[phase];
        absl::StrAppendFormat(&out, "-- phase %s: arrivals %d-%d, %.1f-%.1f s\n", PhaseLabel(result, phase),
                              span.first_arrival, span.end_arrival - 1, span.start_s, span.end_s);
      } else if (phases != nullptr) {
        absl::StrAppend(&out, "-- whole run\n");
      }
      for (const ReplicaSetup& setup : result.setups) {
        if (label_setups) absl::StrAppendFormat(&out, "[%s]\n", ReplicaSetupLabel(setup));
        AppendRows(result, rate, setup, phase, &out);
      }
    }
  }
  return out;
}

nlohmann::json ToJson(const ExperimentResult& result, bool with_samples) {
  nlohmann::json json;
  json["workload"] = result.workload;
  json["locality"] = {
      {"batch", result.locality.batch},
      {"same_domain_distinct_per_layer", result.locality.same_domain_distinct},
      {"mixed_distinct_per_layer", result.locality.mixed_distinct},
      {"same_domain_reduction", result.locality.same_domain_reduction},
      {"prompt_decode_correlation", result.locality.prompt_decode_correlation},
  };
  json["capacity"] = {
      {"requests_per_s", result.capacity.requests_per_s},
      {"batch", result.capacity.batch},
      {"step_ms", result.capacity.step_ms},
      {"mixed_distinct_per_layer", result.capacity.mixed_distinct},
      {"mean_decode_steps", result.capacity.mean_decode_steps},
  };
  json["calibration"] = {
      {"requests", result.calibration_requests},           {"points", result.calibration_points},
      {"layer_mask", result.calibration.layer_mask},       {"mask_correlation", result.calibration.mask_correlation},
      {"cluster_sizes", result.calibration.cluster_sizes}, {"signature_dim", result.signature_dim},
  };
  json["router"] = result.router;
  json["ttft_definition"] = std::string(TtftDefinitionName(result.ttft));
  json["tau"] = result.tau;
  json["rates"] = result.rates;
  nlohmann::json setups = nlohmann::json::array();
  for (const ReplicaSetup& setup : result.setups) {
    setups.push_back({{"replicas", setup.replicas}, {"shared_state", setup.shared_state}});
  }
  json["router_setups"] = std::move(setups);
  json["replica_options"] = {
      {"assignment", std::string(ReplicaAssignmentName(result.replica.assignment))},
      {"sync_period_ms", result.replica.sync_period_ms},
      {"sync_phases", result.replica.staggered_sync ? "staggered" : "aligned"},
      {"install_lag_ms", result.replica.install_lag_ms},
  };
  nlohmann::json results = nlohmann::json::array();
  for (const ExperimentCell& cell : result.cells) {
    const RunMetrics& m = cell.run.metrics;
    nlohmann::json entry = {
        {"rate_rps", cell.rate},
        {"policy", cell.policy.name},
        {"oracle", cell.policy.oracle},
        {"replicas", cell.setup.replicas},
        {"shared_state", cell.setup.shared_state},
        {"label", CellLabel(cell.policy.name, cell.setup)},
        {"router", cell.backend},
        {"refits", cell.run.refits},
        {"fallbacks", cell.run.fallbacks},
        {"routes_per_replica", cell.run.routes_per_replica},
        {"replica_syncs", cell.run.replica_syncs},
    };
    entry.update(MetricsJson(m));
    if (with_samples) entry["tpot_ms_samples"] = m.tpot_ms;
    if (!cell.run.phases.empty()) {
      nlohmann::json phases = nlohmann::json::array();
      for (size_t p = 0; p < cell.run.phases.size(); ++p) {
        const PhaseResult& phase = cell.run.phases[p];
        nlohmann::json item = MetricsJson(phase.metrics);
        item["phase"] = PhaseLabel(result, static_cast<int>(p));
        item["first_arrival"] = phase.first_arrival;
        item["end_arrival"] = phase.end_arrival;
        item["start_s"] = phase.start_s;
        item["end_s"] = phase.end_s;
        phases.push_back(std::move(item));
      }
      entry["phases"] = std::move(phases);
    }
    results.push_back(std::move(entry));
  }
  json["results"] = std::move(results);
  if (result.drift.scenario != DriftScenario::kNone) {
    json["drift"] = {
        {"scenario", std::string(DriftScenarioName(result.drift.scenario))},
        {"change_arrival", result.drift.change_arrival},
        {"phases", result.drift.phase_labels},
        {"phase_domain_shares", result.drift.phase_domain_shares},
        {"phase_rate_scale", result.drift.phase_rate_scale},
        {"excluded_domain", result.drift.excluded_domain < 0
                                ? nlohmann::json(nullptr)
                                : nlohmann::json(result.domains[result.drift.excluded_domain])},
        {"calibration_domain_shares", result.drift.calibration_domain_shares.empty()
                                          ? nlohmann::json(nullptr)
                                          : nlohmann::json(result.drift.calibration_domain_shares)},
        {"add_worker", result.drift.add_worker},
        {"drain_worker", result.drift.drain_worker},
        {"domains", result.domains},
    };
  }
  return json;
}

std::string FormatCsv(const ExperimentResult& result) {
  const bool with_phases = result.drift.scenario != DriftScenario::kNone;
  std::string out =
      "rate_rps,policy,tpot_p50_ms,tpot_p90_ms,tpot_p99_ms,ttft_p50_ms,ttft_p99_ms,"
      "distinct_experts_per_layer,load_imbalance,mean_batch,decode_tokens_per_s,measured_requests,replicas,"
      "shared_state,ttft_prefill_p50_ms,ttft_prefill_p99_ms";
  absl::StrAppend(&out, with_phases ? ",phase\n" : "\n");
  for (const ExperimentCell& cell : result.cells) {
    const std::string all = "all";
    AppendCsvRow(cell, cell.run.metrics, with_phases ? &all : nullptr, &out);
    for (size_t p = 0; p < cell.run.phases.size(); ++p) {
      const std::string label = PhaseLabel(result, static_cast<int>(p));
      AppendCsvRow(cell, cell.run.phases[p].metrics, &label, &out);
    }
  }
  return out;
}

}  // namespace eldr::sim
