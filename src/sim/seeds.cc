#include "sim/seeds.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "sim/report.h"

namespace eldr::sim {
namespace {

bool IsLoadBalancer(const PolicySpec& policy) { return !policy.oracle && policy.kind != PolicyKind::kEldr; }

bool SameSetup(const ReplicaSetup& a, const ReplicaSetup& b) {
  return a.replicas == b.replicas && a.shared_state == b.shared_state;
}

const RunMetrics& MetricsOf(const ExperimentCell& cell, int phase) {
  return phase < 0 ? cell.run.metrics : cell.run.phases[phase].metrics;
}

std::string PhaseName(const ExperimentResult& run, int phase) {
  if (phase < 0) return "all";
  if (phase < static_cast<int>(run.drift.phase_labels.size())) return run.drift.phase_labels[phase];
  return absl::StrCat("phase", phase);
}

// Per-seed values of one figure, gathered and then reduced.
struct Samples {
  std::vector<double> tpot_p50, tpot_p90, tpot_p99, ttft_p50, ttft_p99, ttft_prefill_p50, ttft_prefill_p99;
  std::vector<double> distinct, imbalance, p50_vs, p99_vs;
};

// "12.34 ± 0.05" with `digits` decimals; empty when there is no value.
std::string Pm(const MeanSe& value, int digits, absl::string_view unit = "") {
  if (value.n == 0) return "";
  return absl::StrFormat("%.*f ± %.*f%s", digits, value.mean, digits, value.se, unit);
}

std::string PmSigned(const MeanSe& value) {
  if (value.n == 0) return "";
  return absl::StrFormat("%+.1f ± %.1f%%", value.mean, value.se);
}

// `text` right-aligned in `width` columns; "±" is two bytes in UTF-8 but one column.
std::string Right(const std::string& text, size_t width) {
  size_t columns = 0;
  for (unsigned char c : text) columns += (c & 0xC0) != 0x80 ? 1 : 0;
  return std::string(columns < width ? width - columns : 0, ' ') + text;
}

}  // namespace

absl::StatusOr<std::vector<uint64_t>> ParseSeeds(absl::string_view list) {
  std::vector<uint64_t> seeds;
  auto add = [&seeds](uint64_t seed) -> absl::Status {
    if (std::find(seeds.begin(), seeds.end(), seed) != seeds.end()) {
      return absl::InvalidArgumentError(absl::StrCat("--seeds: seed ", seed, " given twice"));
    }
    if (static_cast<int>(seeds.size()) >= kMaxSeeds) {
      return absl::InvalidArgumentError(absl::StrCat("--seeds: at most ", kMaxSeeds, " seeds"));
    }
    seeds.push_back(seed);
    return absl::OkStatus();
  };
  for (absl::string_view raw : absl::StrSplit(list, ',')) {
    const absl::string_view item = absl::StripAsciiWhitespace(raw);
    if (item.empty()) continue;
    const std::vector<absl::string_view> bounds = absl::StrSplit(item, absl::MaxSplits('-', 1));
    uint64_t first = 0, last = 0;
    const bool parsed = absl::SimpleAtoi(absl::StripAsciiWhitespace(bounds[0]), &first) &&
                        (bounds.size() == 1 || absl::SimpleAtoi(absl::StripAsciiWhitespace(bounds[1]), &last));
    if (bounds.size() == 1) last = first;
    if (!parsed || last < first) {
      return absl::InvalidArgumentError(
          absl::StrCat("--seeds: '", item, "' is not a seed or an increasing range such as 1-6"));
    }
    if (last - first >= static_cast<uint64_t>(kMaxSeeds)) {
      return absl::InvalidArgumentError(absl::StrCat("--seeds: at most ", kMaxSeeds, " seeds"));
    }
    for (uint64_t seed = first;; ++seed) {
      if (absl::Status added = add(seed); !added.ok()) return added;
      if (seed == last) break;
    }
  }
  if (seeds.empty()) return absl::InvalidArgumentError("--seeds: no seed given");
  return seeds;
}

MeanSe MeanAndStandardError(const std::vector<double>& values) {
  MeanSe out;
  out.n = static_cast<int>(values.size());
  if (out.n == 0) return out;
  double sum = 0;
  for (double v : values) sum += v;
  out.mean = sum / out.n;
  if (out.n < 2) return out;
  double squares = 0;
  for (double v : values) squares += (v - out.mean) * (v - out.mean);
  out.se = std::sqrt(squares / (out.n - 1)) / std::sqrt(static_cast<double>(out.n));
  return out;
}

absl::StatusOr<std::vector<AggregateCell>> AggregateSeeds(const std::vector<ExperimentResult>& runs) {
  if (runs.empty()) return absl::InvalidArgumentError("no run to aggregate");
  const ExperimentResult& first = runs.front();
  for (const ExperimentResult& run : runs) {
    bool same = run.cells.size() == first.cells.size();
    for (size_t c = 0; same && c < run.cells.size(); ++c) {
      const ExperimentCell& a = run.cells[c];
      const ExperimentCell& b = first.cells[c];
      same = a.rate == b.rate && a.policy.name == b.policy.name && SameSetup(a.setup, b.setup) &&
             a.run.phases.size() == b.run.phases.size();
    }
    if (!same) {
      return absl::FailedPreconditionError(
          "the seeds' runs differ in their rates, setups, policies or phases: they cannot be aggregated");
    }
  }
  const int phases = first.cells.empty() ? 0 : static_cast<int>(first.cells.front().run.phases.size());
  std::vector<AggregateCell> out;
  for (double rate : first.rates) {
    for (const ReplicaSetup& setup : first.setups) {
      for (int phase = -1; phase < phases; ++phase) {
        // Each seed's best load balancer of this group.
        std::vector<double> best_p50(runs.size(), std::numeric_limits<double>::infinity());
        std::vector<double> best_p99(runs.size(), std::numeric_limits<double>::infinity());
        bool any_baseline = false;
        for (size_t r = 0; r < runs.size(); ++r) {
          for (const ExperimentCell& cell : runs[r].cells) {
            if (cell.rate != rate || !SameSetup(cell.setup, setup) || !IsLoadBalancer(cell.policy)) continue;
            any_baseline = true;
            best_p50[r] = std::min(best_p50[r], MetricsOf(cell, phase).tpot_p50_ms);
            best_p99[r] = std::min(best_p99[r], MetricsOf(cell, phase).tpot_p99_ms);
          }
        }
        for (size_t c = 0; c < first.cells.size(); ++c) {
          const ExperimentCell& reference = first.cells[c];
          if (reference.rate != rate || !SameSetup(reference.setup, setup)) continue;
          Samples samples;
          for (size_t r = 0; r < runs.size(); ++r) {
            const RunMetrics& m = MetricsOf(runs[r].cells[c], phase);
            samples.tpot_p50.push_back(m.tpot_p50_ms);
            samples.tpot_p90.push_back(m.tpot_p90_ms);
            samples.tpot_p99.push_back(m.tpot_p99_ms);
            samples.ttft_p50.push_back(m.ttft_p50_ms);
            samples.ttft_p99.push_back(m.ttft_p99_ms);
            samples.ttft_prefill_p50.push_back(m.ttft_prefill_p50_ms);
            samples.ttft_prefill_p99.push_back(m.ttft_prefill_p99_ms);
            samples.distinct.push_back(m.distinct_experts_per_layer);
            samples.imbalance.push_back(m.load_imbalance);
            if (any_baseline) {
              samples.p50_vs.push_back(100 * (m.tpot_p50_ms / best_p50[r] - 1));
              samples.p99_vs.push_back(100 * (m.tpot_p99_ms / best_p99[r] - 1));
            }
          }
          AggregateCell cell;
          cell.rate = rate;
          cell.policy = reference.policy;
          cell.setup = setup;
          cell.phase = phase;
          cell.tpot_p50 = MeanAndStandardError(samples.tpot_p50);
          cell.tpot_p90 = MeanAndStandardError(samples.tpot_p90);
          cell.tpot_p99 = MeanAndStandardError(samples.tpot_p99);
          cell.ttft_p50 = MeanAndStandardError(samples.ttft_p50);
          cell.ttft_p99 = MeanAndStandardError(samples.ttft_p99);
          cell.ttft_prefill_p50 = MeanAndStandardError(samples.ttft_prefill_p50);
          cell.ttft_prefill_p99 = MeanAndStandardError(samples.ttft_prefill_p99);
          cell.distinct_experts_per_layer = MeanAndStandardError(samples.distinct);
          cell.load_imbalance = MeanAndStandardError(samples.imbalance);
          if (any_baseline && !IsLoadBalancer(reference.policy)) {
            cell.has_versus = true;
            cell.p50_vs_best_pct = MeanAndStandardError(samples.p50_vs);
            cell.p99_vs_best_pct = MeanAndStandardError(samples.p99_vs);
          }
          out.push_back(std::move(cell));
        }
        if (any_baseline) {
          AggregateCell best;
          best.rate = rate;
          best.policy.name = "best LB";
          best.setup = setup;
          best.phase = phase;
          best.best_baseline = true;
          best.tpot_p50 = MeanAndStandardError(best_p50);
          best.tpot_p99 = MeanAndStandardError(best_p99);
          out.push_back(std::move(best));
        }
      }
    }
  }
  return out;
}

std::string FormatSeedsTable(const MultiSeedResult& result) {
  const ExperimentResult& first = result.runs.front();
  std::string out;
  absl::StrAppend(&out, "workload (first seed): ", first.workload, "\n");
  absl::StrAppendFormat(&out, "router: %s\n", first.router);
  if (first.drift.scenario != DriftScenario::kNone) {
    absl::StrAppendFormat(&out, "drift: %s at arrival %d\n", DriftScenarioName(first.drift.scenario),
                          first.drift.change_arrival);
  }
  absl::StrAppendFormat(&out, "seeds: %s: every figure is the mean ± standard error over the %d seeds\n",
                        absl::StrJoin(result.seeds, ", "), result.seeds.size());
  const bool label_setups = first.setups.size() > 1 || (!first.setups.empty() && first.setups[0].replicas > 1);
  double rate = -1;
  int phase = -2;
  ReplicaSetup setup{-1, false};
  for (const AggregateCell& cell : result.cells) {
    if (cell.rate != rate) {
      rate = cell.rate;
      phase = -2;
      absl::StrAppendFormat(&out, "\nrate %g req/s\n", rate);
    }
    if (cell.phase != phase) {
      phase = cell.phase;
      setup = ReplicaSetup{-1, false};
      if (phase >= 0 || first.drift.scenario != DriftScenario::kNone) {
        absl::StrAppendFormat(&out, "-- %s\n",
                              phase < 0 ? "whole run" : absl::StrCat("phase ", PhaseName(first, phase)));
      }
      absl::StrAppendFormat(&out, "%-11s %16s %16s %16s %16s %16s %16s\n", "policy", "TPOT p50 ms", "TPOT p99 ms",
                            first.ttft == TtftDefinition::kPrefill ? "TTFT(pf) p50 ms" : "TTFT p50 ms",
                            first.ttft == TtftDefinition::kPrefill ? "TTFT(pf) p99 ms" : "TTFT p99 ms",
                            "p50 vs best LB", "p99 vs best LB");
    }
    if (label_setups && !SameSetup(cell.setup, setup)) {
      setup = cell.setup;
      absl::StrAppendFormat(&out, "[%s]\n", ReplicaSetupLabel(setup));
    }
    const bool prefill = first.ttft == TtftDefinition::kPrefill;
    absl::StrAppendFormat(&out, "%-11s %s %s %s %s %s %s\n", cell.policy.name, Right(Pm(cell.tpot_p50, 2), 16),
                          Right(Pm(cell.tpot_p99, 2), 16),
                          Right(Pm(prefill ? cell.ttft_prefill_p50 : cell.ttft_p50, 1), 16),
                          Right(Pm(prefill ? cell.ttft_prefill_p99 : cell.ttft_p99, 1), 16),
                          Right(cell.has_versus ? PmSigned(cell.p50_vs_best_pct) : "", 16),
                          Right(cell.has_versus ? PmSigned(cell.p99_vs_best_pct) : "", 16));
  }
  return out;
}

namespace {

// The aggregate figures of a cell, by key, in a fixed order (JSON and CSV).
std::vector<std::pair<std::string, const MeanSe*>> Figures(const AggregateCell& cell) {
  std::vector<std::pair<std::string, const MeanSe*>> figures = {
      {"tpot_p50_ms", &cell.tpot_p50},
      {"tpot_p90_ms", &cell.tpot_p90},
      {"tpot_p99_ms", &cell.tpot_p99},
      {"ttft_p50_ms", &cell.ttft_p50},
      {"ttft_p99_ms", &cell.ttft_p99},
      {"ttft_prefill_p50_ms", &cell.ttft_prefill_p50},
      {"ttft_prefill_p99_ms", &cell.ttft_prefill_p99},
      {"distinct_experts_per_layer", &cell.distinct_experts_per_layer},
      {"load_imbalance", &cell.load_imbalance},
      {"p50_vs_best_lb_pct", &cell.p50_vs_best_pct},
      {"p99_vs_best_lb_pct", &cell.p99_vs_best_pct},
  };
  return figures;
}

}  // namespace

nlohmann::json SeedsToJson(const MultiSeedResult& result) {
  const ExperimentResult& first = result.runs.front();
  nlohmann::json json;
  json["seeds"] = result.seeds;
  nlohmann::json cells = nlohmann::json::array();
  for (const AggregateCell& cell : result.cells) {
    nlohmann::json entry = {
        {"rate_rps", cell.rate},
        {"policy", cell.policy.name},
        {"best_load_balancer", cell.best_baseline},
        {"replicas", cell.setup.replicas},
        {"shared_state", cell.setup.shared_state},
        {"label", CellLabel(cell.policy.name, cell.setup)},
        {"phase", PhaseName(first, cell.phase)},
        {"seeds", cell.tpot_p50.n},
    };
    for (const auto& [key, value] : Figures(cell)) {
      if (value->n == 0) continue;
      entry[key + "_mean"] = value->mean;
      entry[key + "_se"] = value->se;
    }
    cells.push_back(std::move(entry));
  }
  json["aggregate"] = std::move(cells);
  nlohmann::json runs = nlohmann::json::array();
  for (const ExperimentResult& run : result.runs) runs.push_back(ToJson(run, false));
  json["runs"] = std::move(runs);
  return json;
}

std::string FormatSeedsCsv(const MultiSeedResult& result) {
  const ExperimentResult& first = result.runs.front();
  std::string out = "rate_rps,policy,replicas,shared_state,phase,seeds";
  AggregateCell empty;
  for (const auto& [key, value] : Figures(empty)) absl::StrAppend(&out, ",", key, "_mean,", key, "_se");
  absl::StrAppend(&out, "\n");
  for (const AggregateCell& cell : result.cells) {
    absl::StrAppendFormat(&out, "%g,%s,%d,%d,%s,%d", cell.rate, cell.policy.name, cell.setup.replicas,
                          cell.setup.shared_state ? 1 : 0, PhaseName(first, cell.phase), cell.tpot_p50.n);
    for (const auto& [key, value] : Figures(cell)) {
      if (value->n == 0) {
        absl::StrAppend(&out, ",,");
      } else {
        absl::StrAppendFormat(&out, ",%.4f,%.4f", value->mean, value->se);
      }
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

}  // namespace eldr::sim
