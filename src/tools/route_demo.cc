// eldr-route-demo: routes the bundled real MoE traces through the core library (eldr_core) and
// prints what it decided and how fast.
//
// Requests are the sequences of data/esft-routing (DeepSeek-V2-Lite, four task domains). Each
// request's signature is the expert counts of its prompt (the first --prefill_fraction of the
// sequence), sent as int16 little-endian bytes exactly as a prefill engine would. Every policy sees
// the same arrival order; --inflight requests are kept in flight (the oldest completes when a new
// one is routed), so loads differ between workers and the locality band matters.
//
// Centroids: by default one per domain, the mean signature of the domain's even-numbered
// sequences (a stand-in for a calibration run); --centroids loads a calibration artifact instead.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/router.h"
#include "eldr/core/signature.h"
#include "eldr/trace/trace.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, data_dir, "data/esft-routing", "Folder of <domain>_topk.npy / _offsets.npy");
ABSL_FLAG(std::string, centroids, "", "Calibration artifact (JSON) to route with; default: per-domain mean signatures");
ABSL_FLAG(std::string, policies, "eldr,rr,random,jsq,p2c", "Comma-separated policies to compare");
ABSL_FLAG(double, tau, 0.1, "Locality band width of the eldr policy, in [0, 1]");
ABSL_FLAG(double, prefill_fraction, 0.5, "Share of each sequence treated as the prompt");
ABSL_FLAG(int, inflight, 16, "Requests kept in flight; the oldest completes when a new one arrives");
ABSL_FLAG(int, max_inflight, 6,
          "Per-worker in-flight limit of the overload guard (0 = none): a band whose members are all "
          "at the limit spills to the least loaded worker");
ABSL_FLAG(int, rounds, 20, "Passes over all requests (each in a new shuffled order)");
ABSL_FLAG(uint64_t, seed, 7, "Seed of the arrival order and of the policies' tie-breaking");
ABSL_FLAG(std::string, json_out, "", "Also write the results as JSON to this file");

namespace eldr {
namespace {

struct Request {
  int domain = 0;
  std::string counts_int16;  // [layers][experts] little-endian, what the engine sends
};

struct PolicyReport {
  std::string policy;
  std::vector<std::vector<int64_t>> routed;  // [domain][worker]
  std::map<std::string, int64_t> fallbacks;
  std::vector<double> latency_us;  // one per Route call
  int64_t band_total = 0;
  int64_t band_decisions = 0;
};

std::string Int16Le(const std::vector<int32_t>& counts) {
  std::string bytes;
  bytes.reserve(counts.size() * 2);
  for (int32_t c : counts) {
    const uint16_t u = static_cast<uint16_t>(std::min<int32_t>(c, INT16_MAX));
    bytes.push_back(static_cast<char>(u & 0xff));
    bytes.push_back(static_cast<char>(u >> 8));
  }
  return bytes;
}

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t index = static_cast<size_t>(std::ceil(q * values.size())) - 1;
  return values[std::min(index, values.size() - 1)];
}

// Per-domain mean signatures of the even-numbered sequences, count_idf over every layer with IDF
// from the same sequences.
absl::StatusOr<CentroidArtifact> DomainMeanCentroids(const ExpertTrace& trace,
                                                     const std::vector<std::vector<int32_t>>& counts) {
  const size_t cells = static_cast<size_t>(trace.layers) * trace.experts;
  std::vector<int32_t> fit;
  int fit_n = 0;
  for (size_t i = 0; i < trace.sequences.size(); ++i) {
    if (trace.sequences[i].index_in_domain % 2 != 0) continue;
    fit.insert(fit.end(), counts[i].begin(), counts[i].end());
    ++fit_n;
  }
  CentroidArtifact artifact;
  artifact.spec.layers = trace.layers;
  artifact.spec.experts = trace.experts;
  artifact.spec.variant = SignatureVariant::kCountIdf;
  artifact.spec.idf = ComputeIdf(fit, fit_n, trace.layers, trace.experts);
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(artifact.spec);
  if (!transform.ok()) return transform.status();
  const int k = static_cast<int>(trace.domains.size());
  std::vector<double> sums(static_cast<size_t>(k) * cells, 0.0);
  std::vector<float> signature(cells);
  for (size_t i = 0; i < trace.sequences.size(); ++i) {
    const TraceSequence& seq = trace.sequences[i];
    if (seq.index_in_domain % 2 != 0) continue;
    const absl::Status status =
        transform->Apply(CountsInt32{trace.layers, trace.experts, counts[i]}, absl::MakeSpan(signature));
    if (!status.ok()) return status;
    for (size_t c = 0; c < cells; ++c) sums[seq.domain * cells + c] += signature[c];
  }
  artifact.k = k;
  artifact.centroids.resize(sums.size());
  for (int d = 0; d < k; ++d) {
    double norm = 0;
    for (size_t c = 0; c < cells; ++c) norm += sums[d * cells + c] * sums[d * cells + c];
    norm = std::sqrt(norm);
    for (size_t c = 0; c < cells; ++c) {
      artifact.centroids[d * cells + c] = static_cast<float>(sums[d * cells + c] / norm);
    }
  }
  for (int d = 0; d < k; ++d) artifact.workers.push_back(absl::StrCat("w", d));
  artifact.model = "DeepSeek-V2-Lite (ESFT traces), per-domain means";
  return artifact;
}

absl::StatusOr<PolicyReport> RunPolicy(PolicyKind policy, const CentroidArtifact& artifact, const ExpertTrace& trace,
                                       const std::vector<Request>& requests,
                                       const std::vector<std::vector<int>>& orders) {
  RouterOptions options;
  options.policy = policy;
  options.tau = absl::GetFlag(FLAGS_tau);
  options.seed = absl::GetFlag(FLAGS_seed);
  std::vector<WorkerSpec> workers;
  for (const std::string& id : artifact.workers) {
    workers.push_back(WorkerSpec{id, absl::StrCat(id, ".decode.local:8000"), 1.0, absl::GetFlag(FLAGS_max_inflight)});
  }
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Create(options, workers);
  if (!router.ok()) return router.status();
  if (absl::Status status = (*router)->InstallCentroids(artifact).status(); !status.ok()) return status;

  PolicyReport report;
  report.policy = std::string(PolicyKindName(policy));
  report.routed.assign(trace.domains.size(), std::vector<int64_t>(workers.size(), 0));
  std::map<std::string, int> worker_index;
  for (size_t w = 0; w < workers.size(); ++w) worker_index[workers[w].id] = static_cast<int>(w);
  const size_t inflight = static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_inflight)));
  std::deque<uint64_t> in_flight;
  for (const std::vector<int>& order : orders) {
    for (int r : order) {
      const Request& request = requests[r];
      const SignatureInput input = CountsInt16Le{trace.layers, trace.experts, request.counts_int16};
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<RouteResult> result = (*router)->Route(&input);
      const auto stop = std::chrono::steady_clock::now();
      if (!result.ok()) return result.status();
      report.latency_us.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
      ++report.routed[request.domain][worker_index[result->worker_id]];
      if (result->fallback != FallbackReason::kNone) {
        ++report.fallbacks[std::string(FallbackReasonLabel(result->fallback))];
      }
      if (result->band_size > 0) {
        report.band_total += result->band_size;
        ++report.band_decisions;
      }
      in_flight.push_back(result->lease_id);
      while (in_flight.size() > inflight) {
        if (absl::Status done = (*router)->Complete(in_flight.front()).status(); !done.ok()) return done;
        in_flight.pop_front();
      }
    }
  }
  for (uint64_t lease : in_flight) {
    if (absl::Status done = (*router)->Complete(lease).status(); !done.ok()) return done;
  }
  return report;
}

// Share of each worker's requests that belong to its most common domain (1 = every worker serves
// a single domain), and max / mean requests per worker.
void Summarise(const PolicyReport& report, double* purity, double* imbalance) {
  const size_t workers = report.routed.empty() ? 0 : report.routed[0].size();
  int64_t total = 0, majority = 0, busiest = 0;
  for (size_t w = 0; w < workers; ++w) {
    int64_t on_worker = 0, top = 0;
    for (const auto& per_domain : report.routed) {
      on_worker += per_domain[w];
      top = std::max(top, per_domain[w]);
    }
    total += on_worker;
    majority += top;
    busiest = std::max(busiest, on_worker);
  }
  *purity = total > 0 ? static_cast<double>(majority) / total : 0;
  *imbalance = total > 0 ? static_cast<double>(busiest) * workers / total : 0;
}

int Main() {
  const std::string data_dir = absl::GetFlag(FLAGS_data_dir);
  absl::StatusOr<ExpertTrace> trace = LoadExpertTrace(data_dir);
  if (!trace.ok()) {
    std::cerr << "eldr-route-demo: " << trace.status() << "\n";
    return 1;
  }
  const double prefill_fraction = absl::GetFlag(FLAGS_prefill_fraction);
  const size_t cells = static_cast<size_t>(trace->layers) * trace->experts;
  std::vector<std::vector<int32_t>> counts;
  std::vector<Request> requests;
  for (const TraceSequence& seq : trace->sequences) {
    std::vector<int32_t> c(cells, 0);
    AccumulateCounts(*trace, seq, 0, PrefillTokens(seq.tokens, prefill_fraction), absl::MakeSpan(c));
    requests.push_back(Request{seq.domain, Int16Le(c)});
    counts.push_back(std::move(c));
  }

  CentroidArtifact artifact;
  std::string centroid_source;
  if (const std::string path = absl::GetFlag(FLAGS_centroids); !path.empty()) {
    absl::StatusOr<CentroidArtifact> loaded = LoadCentroidArtifact(path);
    if (!loaded.ok()) {
      std::cerr << "eldr-route-demo: " << loaded.status() << "\n";
      return 1;
    }
    artifact = *std::move(loaded);
    if (artifact.workers.empty()) {
      for (int r = 0; r < artifact.k; ++r) artifact.workers.push_back(absl::StrCat("w", r));
    }
    centroid_source = absl::StrCat(path, " (", artifact.model, ")");
  } else {
    absl::StatusOr<CentroidArtifact> built = DomainMeanCentroids(*trace, counts);
    if (!built.ok()) {
      std::cerr << "eldr-route-demo: " << built.status() << "\n";
      return 1;
    }
    artifact = *std::move(built);
    centroid_source = "per-domain mean signatures of the even-numbered sequences";
  }

  std::vector<PolicyKind> policies;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_policies), ',', absl::SkipEmpty())) {
    absl::StatusOr<PolicyKind> kind = ParsePolicyKind(name);
    if (!kind.ok()) {
      std::cerr << "eldr-route-demo: " << kind.status().message() << "\n";
      return 1;
    }
    policies.push_back(*kind);
  }

  // One arrival sequence shared by every policy.
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::vector<std::vector<int>> orders(rounds);
  for (auto& order : orders) {
    order.resize(requests.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::shuffle(order.begin(), order.end(), rng);
  }

  std::cout << absl::StrFormat("ELDR route demo: %d real requests from %s (%s), %d MoE layers x %d experts, top-%d\n",
                               requests.size(), data_dir, absl::StrJoin(trace->domains, ", "), trace->layers,
                               trace->experts, trace->top_k);
  std::cout << absl::StrFormat(
      "signature: %s over %d of %d layers, prompt = first %.0f%% of each sequence, sent as int16 "
      "counts\n",
      SignatureVariantName(artifact.spec.variant), artifact.spec.masked_layers(), trace->layers,
      100 * prefill_fraction);
  std::cout << absl::StrFormat("centroids: %d workers, %s\n", artifact.k, centroid_source);
  std::cout << absl::StrFormat(
      "load: %d requests in flight (the oldest completes first), per-worker limit %d; %d rounds in "
      "shuffled order\n\n",
      absl::GetFlag(FLAGS_inflight), absl::GetFlag(FLAGS_max_inflight), rounds);

  nlohmann::json json_report = nlohmann::json::array();
  std::vector<std::string> summary_lines;
  for (PolicyKind policy : policies) {
    absl::StatusOr<PolicyReport> report = RunPolicy(policy, artifact, *trace, requests, orders);
    if (!report.ok()) {
      std::cerr << "eldr-route-demo: policy " << PolicyKindName(policy) << ": " << report.status() << "\n";
      return 1;
    }
    const size_t workers = artifact.workers.size();
    std::cout << "policy " << report->policy;
    if (policy == PolicyKind::kEldr) std::cout << absl::StrFormat(" (tau %.2f)", absl::GetFlag(FLAGS_tau));
    std::cout << "\n  " << absl::StrFormat("%-12s", "domain");
    for (const std::string& w : artifact.workers) std::cout << absl::StrFormat("%8s", w);
    std::cout << "\n";
    for (size_t d = 0; d < trace->domains.size(); ++d) {
      std::cout << "  " << absl::StrFormat("%-12s", trace->domains[d]);
      for (size_t w = 0; w < workers; ++w) std::cout << absl::StrFormat("%8d", report->routed[d][w]);
      std::cout << "\n";
    }
    double purity = 0, imbalance = 0;
    Summarise(*report, &purity, &imbalance);
    std::string fallbacks = "none";
    if (!report->fallbacks.empty()) {
      fallbacks = absl::StrJoin(report->fallbacks, ", ", absl::PairFormatter(" "));
    }
    const double p50 = Percentile(report->latency_us, 0.50);
    const double p90 = Percentile(report->latency_us, 0.90);
    const double p99 = Percentile(report->latency_us, 0.99);
    const double max = Percentile(report->latency_us, 1.0);
    std::cout << absl::StrFormat("  worker purity %.3f, load imbalance (max/mean) %.2f", purity, imbalance);
    if (report->band_decisions > 0) {
      std::cout << absl::StrFormat(", mean band size %.2f",
                                   static_cast<double>(report->band_total) / report->band_decisions);
    }
    std::cout << absl::StrFormat("\n  fallbacks: %s\n", fallbacks);
    std::cout << absl::StrFormat(
        "  decision latency (Route: transform + scoring + band + pick + lease), us: p50 %.2f  "
        "p90 %.2f  p99 %.2f  max %.1f  (%d decisions)\n\n",
        p50, p90, p99, max, report->latency_us.size());
    summary_lines.push_back(absl::StrFormat("  %-8s %8.3f %10.2f %9.2f %9.2f   %s", report->policy, purity, imbalance,
                                            p50, p99, fallbacks));
    json_report.push_back({{"policy", report->policy},
                           {"routed", report->routed},
                           {"purity", purity},
                           {"imbalance", imbalance},
                           {"fallbacks", report->fallbacks},
                           {"latency_us", {{"p50", p50}, {"p90", p90}, {"p99", p99}, {"max", max}}}});
  }
  std::cout << "summary (purity: share of each worker's requests from its most common domain)\n";
  std::cout << absl::StrFormat("  %-8s %8s %10s %9s %9s   %s\n", "policy", "purity", "imbalance", "p50 us", "p99 us",
                               "fallbacks");
  for (const std::string& line : summary_lines) std::cout << line << "\n";

  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    nlohmann::json doc = {{"requests", requests.size()},
                          {"domains", trace->domains},
                          {"workers", artifact.workers},
                          {"tau", absl::GetFlag(FLAGS_tau)},
                          {"inflight", absl::GetFlag(FLAGS_inflight)},
                          {"rounds", rounds},
                          {"policies", json_report}};
    if (absl::Status status = WriteFileAtomically(path, doc.dump(2) + "\n"); !status.ok()) {
      std::cerr << "eldr-route-demo: " << status << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace eldr

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Routes the bundled real MoE traces through the ELDR core library and prints the decisions "
      "and their latency.\nUsage: eldr-route-demo [--data_dir=data/esft-routing] [--policies=...]");
  absl::ParseCommandLine(argc, argv);
  return eldr::Main();
}
