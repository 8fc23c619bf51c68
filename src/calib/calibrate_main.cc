// eldr-calibrate: fits the worker centroids the router loads, from captured per-request expert
// counts or from the bundled real traces (docs/calibration.md). With --benchmark, times calibration
// on synthetic clustered data over a grid of sizes (docs/benchmarks.md, "Calibration").
//
// Exit codes: 0 success; 1 bad input or a failed calibration (nothing written); 2 bad usage.
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "calib/calib_internal.h"
#include "calib/signatures.h"
#include "calib/synthetic_data.h"
#include "eldr/calib/calibration.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/router.h"
#include "eldr/core/signature.h"
#include "eldr/refit/refit.h"
#include "eldr/trace/trace.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, trace, "",
          "Folder of real expert traces (<domain>_topk.npy + <domain>_offsets.npy), e.g. data/esft-routing");
ABSL_FLAG(double, prefill_fraction, 0.5,
          "With --trace: the first fraction of each sequence is its prompt, the rest its decode tokens");
ABSL_FLAG(std::vector<std::string>, captures, {},
          "Capture files (comma-separated; further file arguments after the flags are added too)");
ABSL_FLAG(int, layers, 0, "Expected MoE layers; required for the reference's plain frames (0: from headers)");
ABSL_FLAG(int, experts, 0,
          "Expected routed experts per layer; required for plain frames (0: from headers; traces: 64)");
ABSL_FLAG(int, clusters, 16, "Number of centroids K (one per decode worker)");
ABSL_FLAG(std::string, variant, "count_idf", "Signature variant: count, count_idf or gate_prob");
ABSL_FLAG(std::vector<std::string>, capacities, {},
          "Relative capacity weight of each worker, w1,w2,... (K values; empty: equal)");
ABSL_FLAG(std::vector<std::string>, workers, {},
          "Worker ids naming the centroid rows, id1,id2,... (K values; empty: unnamed rows)");
ABSL_FLAG(uint64_t, seed, 0, "Seed of k-means++, pair sampling and the held-out split");
ABSL_FLAG(std::string, out, "", "Artifact to write (JSON the router loads); written atomically");
ABSL_FLAG(std::string, report, "", "Report to write (JSON); written atomically");
ABSL_FLAG(double, holdout_fraction, 0.0,
          "Fraction of requests held out of the fit to measure routing agreement (stratified by label)");
ABSL_FLAG(int, max_iterations, 50, "Most balanced k-means iterations");
ABSL_FLAG(double, tolerance, 1e-4,
          "Stop k-means when an iteration improves the objective by at most this fraction (0: until "
          "the assignment is stable)");
ABSL_FLAG(int, mask_pairs, 30000, "Request pairs for the layer-mask Spearman search");
ABSL_FLAG(bool, select_layers, true,
          "Greedy layer mask (variants count_idf and gate_prob, with decode counts); false keeps every layer");
ABSL_FLAG(std::string, mask_rule, "global_maximum",
          "Layer mask from the greedy curve: global_maximum (all L steps, keep the prefix up to the "
          "maximum: the reference's rule) or first_decrease (stop at the first step that does not "
          "raise the correlation)");
ABSL_FLAG(bool, weight_by_decode_tokens, true,
          "Balance the clustering by each request's decode tokens (captures with decode counts): each "
          "worker's zone gets an equal share of the decode work; IDF and the layer mask count every "
          "request once");
ABSL_FLAG(int, weight_resolution, 8,
          "Weighted balance: integer units per request of mean weight in the exact assignment");
ABSL_FLAG(bool, balanced, true,
          "Capacity-balanced k-means; false: plain spherical k-means (the cluster-balance ablation)");
ABSL_FLAG(int, seeding_sample, 4096, "k-means++ runs on a sample of at most this many requests (0: all)");
ABSL_FLAG(std::string, model, "", "Model name stored in the artifact");
ABSL_FLAG(std::string, write_captures, "",
          "Also write the loaded requests as an ELDR capture file (e.g. to turn traces into captures)");
ABSL_FLAG(bool, benchmark, false, "Time calibration on synthetic clustered data instead (no artifact)");
ABSL_FLAG(std::vector<std::string>, benchmark_sizes, std::vector<std::string>({"1000", "10000", "100000"}),
          "--benchmark: request counts N");
ABSL_FLAG(std::vector<std::string>, benchmark_clusters, std::vector<std::string>({"16", "64"}),
          "--benchmark: cluster counts K");
ABSL_FLAG(std::vector<std::string>, benchmark_geometries, std::vector<std::string>({"26x64", "48x128"}),
          "--benchmark: signature geometries LxE (dimensions 1664 and 6144)");
ABSL_FLAG(int, benchmark_domains, 32, "--benchmark: latent domains in the synthetic data");
ABSL_FLAG(int, benchmark_refit_window, 2000, "--benchmark: window size of the refit timing");
ABSL_FLAG(std::string, benchmark_json, "", "--benchmark: also write the results as JSON here");
ABSL_FLAG(bool, fix_blas_kernels, true,
          "When OpenBLAS does not recognise the CPU and falls back to its generic SSE3 kernels while "
          "the CPU has AVX-512 or AVX2, restart with OPENBLAS_CORETYPE set to the matching kernels "
          "(4x faster scoring); an explicit OPENBLAS_CORETYPE is always respected");

namespace eldr {
namespace {

constexpr int kExitBadInput = 1;
constexpr int kExitUsage = 2;

int Fail(int code, const absl::Status& status) {
  std::cerr << "eldr-calibrate: error: " << status.message() << "\n";
  return code;
}
int UsageError(const std::string& message) {
  std::cerr << "eldr-calibrate: " << message << "\n(see --help)\n";
  return kExitUsage;
}

absl::StatusOr<std::vector<int>> ParseInts(const std::vector<std::string>& items, const char* flag) {
  std::vector<int> out;
  for (const std::string& item : items) {
    int value;
    if (!absl::SimpleAtoi(item, &value) || value < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": '", item, "' is not a positive integer"));
    }
    out.push_back(value);
  }
  return out;
}

// ---- Calibration -------------------------------------------------------------------------------

int RunCalibration(const std::vector<std::string>& extra_captures) {
  const std::string trace_dir = absl::GetFlag(FLAGS_trace);
  std::vector<std::string> captures = absl::GetFlag(FLAGS_captures);
  captures.insert(captures.end(), extra_captures.begin(), extra_captures.end());
  if (trace_dir.empty() == captures.empty()) {
    return UsageError(trace_dir.empty() ? "give the input: --trace DIR or --captures FILE..."
                                        : "give either --trace or --captures, not both");
  }
  const std::string out_path = absl::GetFlag(FLAGS_out);
  if (out_path.empty() && absl::GetFlag(FLAGS_write_captures).empty()) {
    return UsageError("--out FILE is required (where to write the artifact)");
  }

  CalibrationOptions options;
  options.clusters = absl::GetFlag(FLAGS_clusters);
  if (options.clusters < 1) return UsageError("--clusters must be >= 1");
  absl::StatusOr<SignatureVariant> variant = ParseSignatureVariant(absl::GetFlag(FLAGS_variant));
  if (!variant.ok()) return UsageError(absl::StrCat("--variant: ", variant.status().message()));
  options.variant = *variant;
  for (const std::string& item : absl::GetFlag(FLAGS_capacities)) {
    double weight;
    if (!absl::SimpleAtod(item, &weight) || !std::isfinite(weight) || weight <= 0) {
      return UsageError(absl::StrCat("--capacities: '", item, "' is not a positive number"));
    }
    options.capacity_weights.push_back(weight);
  }
  if (!options.capacity_weights.empty() && options.capacity_weights.size() != static_cast<size_t>(options.clusters)) {
    return UsageError(absl::StrCat("--capacities has ", options.capacity_weights.size(),
                                   " weights for --clusters=", options.clusters));
  }
  options.worker_ids = absl::GetFlag(FLAGS_workers);
  if (!options.worker_ids.empty() && options.worker_ids.size() != static_cast<size_t>(options.clusters)) {
    return UsageError(
        absl::StrCat("--workers has ", options.worker_ids.size(), " ids for --clusters=", options.clusters));
  }
  options.seed = absl::GetFlag(FLAGS_seed);
  options.max_iterations = absl::GetFlag(FLAGS_max_iterations);
  options.tolerance = absl::GetFlag(FLAGS_tolerance);
  if (!(options.tolerance >= 0) || !std::isfinite(options.tolerance)) return UsageError("--tolerance must be >= 0");
  options.mask_pairs = absl::GetFlag(FLAGS_mask_pairs);
  options.select_layers = absl::GetFlag(FLAGS_select_layers);
  absl::StatusOr<LayerMaskRule> mask_rule = ParseLayerMaskRule(absl::GetFlag(FLAGS_mask_rule));
  if (!mask_rule.ok()) return UsageError(absl::StrCat("--mask_rule: ", mask_rule.status().message()));
  options.mask_rule = *mask_rule;
  options.weight_by_decode_tokens = absl::GetFlag(FLAGS_weight_by_decode_tokens);
  options.weight_resolution = absl::GetFlag(FLAGS_weight_resolution);
  if (options.weight_resolution < 1) return UsageError("--weight_resolution must be >= 1");
  options.balanced = absl::GetFlag(FLAGS_balanced);
  options.seeding_sample = absl::GetFlag(FLAGS_seeding_sample);
  options.model = absl::GetFlag(FLAGS_model);
  if (options.max_iterations < 1) return UsageError("--max_iterations must be >= 1");
  if (options.mask_pairs < 2) return UsageError("--mask_pairs must be >= 2");
  const double holdout_fraction = absl::GetFlag(FLAGS_holdout_fraction);
  if (!(holdout_fraction >= 0 && holdout_fraction < 1)) return UsageError("--holdout_fraction must be in [0, 1)");

  // ---- Input ----
  const auto load_start = std::chrono::steady_clock::now();
  absl::StatusOr<CalibrationData> data;
  if (!trace_dir.empty()) {
    const int experts = absl::GetFlag(FLAGS_experts) > 0 ? absl::GetFlag(FLAGS_experts) : 64;
    absl::StatusOr<ExpertTrace> trace = LoadExpertTrace(trace_dir, experts);
    if (!trace.ok()) return Fail(kExitBadInput, trace.status());
    data = CalibrationDataFromTrace(*trace, absl::GetFlag(FLAGS_prefill_fraction), {});
  } else {
    data = ReadCaptureFiles(captures, absl::GetFlag(FLAGS_layers), absl::GetFlag(FLAGS_experts));
  }
  if (!data.ok()) return Fail(kExitBadInput, data.status());
  if (absl::Status valid = ValidateCalibrationData(*data); !valid.ok()) return Fail(kExitBadInput, valid);
  const double load_seconds = SecondsSince(load_start);
  std::cout << absl::StrFormat("loaded %d requests, L=%d E=%d%s%s in %.2f s\n", data->n, data->layers, data->experts,
                               data->decode_counts.empty() ? "" : ", with decode counts",
                               data->labels.empty() ? "" : ", labelled", load_seconds);

  if (const std::string path = absl::GetFlag(FLAGS_write_captures); !path.empty()) {
    if (absl::Status written = WriteCaptureFile(path, *data); !written.ok()) return Fail(kExitBadInput, written);
    std::cout << "wrote " << data->n << " requests to " << path << "\n";
    if (out_path.empty()) return 0;
  }

  // ---- Split, fit, evaluate ----
  absl::StatusOr<CalibrationSplit> split = SplitCalibrationData(*data, holdout_fraction, options.seed);
  if (!split.ok()) return Fail(kExitBadInput, split.status());
  absl::StatusOr<CalibrationResult> result = Calibrate(split->calibration, options);
  if (!result.ok()) return Fail(kExitBadInput, result.status());
  absl::StatusOr<CalibrationEvaluation> evaluation =
      EvaluateCalibration(*result, split->calibration, split->holdout.n > 0 ? &split->holdout : nullptr, options);
  if (!evaluation.ok()) return Fail(kExitBadInput, evaluation.status());

  // ---- Outputs: the report first, the artifact last, so a failure leaves no artifact ----
  const std::string report_path = absl::GetFlag(FLAGS_report);
  if (!report_path.empty()) {
    const std::string json = CalibrationReportJson(*result, options, &*evaluation, split->calibration);
    if (absl::Status written = WriteFileAtomically(report_path, json); !written.ok()) {
      return Fail(kExitBadInput, written);
    }
  }
  if (absl::Status saved = SaveCentroidArtifact(result->artifact, out_path); !saved.ok()) {
    if (!report_path.empty()) {
      std::error_code ignored;
      std::filesystem::remove(report_path, ignored);
    }
    return Fail(kExitBadInput, saved);
  }

  const CalibrationReport& report = result->report;
  std::cout << absl::StrFormat(
      "calibrated K=%d on %d requests (%d held out): objective %.4f, %d iterations%s, %.2f s\n", options.clusters,
      split->calibration.n, split->holdout.n, report.objective, report.iterations,
      report.converged ? " (converged)" : "", report.seconds_total);
  std::cout << "cluster sizes: " << absl::StrJoin(report.cluster_sizes, ",") << "\n";
  if (report.weighting != "none") {
    std::vector<std::string> work;
    for (double w : report.cluster_weights) work.push_back(absl::StrFormat("%.0f", w));
    std::cout << "cluster decode work (" << report.weighting << "): " << absl::StrJoin(work, ",") << "\n";
  }
  if (!report.mask_steps.empty()) {
    std::cout << absl::StrFormat("layer mask (%d layers, %s): %s; Spearman %.4f (all layers %.4f)\n",
                                 report.layer_mask.size(), LayerMaskRuleName(report.mask_rule),
                                 absl::StrJoin(report.layer_mask, ","), report.mask_correlation,
                                 report.all_layers_correlation);
    std::vector<std::string> curve;
    for (size_t i = 0; i < report.mask_steps.size(); ++i) {
      curve.push_back(absl::StrFormat("%s+%d:%.4f", static_cast<int>(i) == report.mask_peak_step ? "*" : "",
                                      report.mask_steps[i].layer, report.mask_steps[i].correlation));
    }
    std::cout << "layer curve (step: +layer:Spearman, * = kept up to here): " << absl::StrJoin(curve, " ") << "\n";
  }
  if (!split->calibration.labels.empty()) {
    std::cout << absl::StrFormat("purity %.4f", evaluation->purity);
    if (evaluation->holdout_requests > 0) {
      std::cout << absl::StrFormat("; held-out agreement: assignment %.4f, label %.4f",
                                   evaluation->holdout_assignment_agreement, evaluation->holdout_label_agreement);
    }
    std::cout << "\n";
  }
  std::cout << "wrote " << out_path << (report_path.empty() ? "" : " and " + report_path) << "\n";
  return 0;
}

// ---- Benchmark ---------------------------------------------------------------------------------

int RunBenchmark() {
  absl::StatusOr<std::vector<int>> sizes = ParseInts(absl::GetFlag(FLAGS_benchmark_sizes), "benchmark_sizes");
  absl::StatusOr<std::vector<int>> clusters = ParseInts(absl::GetFlag(FLAGS_benchmark_clusters), "benchmark_clusters");
  if (!sizes.ok()) return UsageError(std::string(sizes.status().message()));
  if (!clusters.ok()) return UsageError(std::string(clusters.status().message()));
  std::vector<std::pair<int, int>> geometries;
  for (const std::string& item : absl::GetFlag(FLAGS_benchmark_geometries)) {
    std::vector<std::string> parts = absl::StrSplit(item, 'x');
    int layers = 0, experts = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &layers) || !absl::SimpleAtoi(parts[1], &experts) ||
        layers < 1 || experts < 1) {
      return UsageError(absl::StrCat("--benchmark_geometries: '", item, "' is not LxE"));
    }
    geometries.emplace_back(layers, experts);
  }
  const int domains = absl::GetFlag(FLAGS_benchmark_domains);
  const int window = absl::GetFlag(FLAGS_benchmark_refit_window);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  nlohmann::ordered_json results = nlohmann::ordered_json::array();

  std::cout << "calibration on synthetic clustered counts (" << domains
            << " latent domains; IDF + signatures + balanced k-means; no layer search)\n";
  for (const auto& [layers, experts] : geometries) {
    for (int n : *sizes) {
      SyntheticDataOptions synthetic;
      synthetic.requests = n;
      synthetic.layers = layers;
      synthetic.experts = experts;
      synthetic.domains = domains;
      synthetic.seed = seed + 1;
      const auto generated = std::chrono::steady_clock::now();
      const CalibrationData data = MakeSyntheticCalibrationData(synthetic);
      const double generate_seconds = SecondsSince(generated);
      for (int k : *clusters) {
        CalibrationOptions options;
        options.clusters = k;
        options.seed = seed;
        options.select_layers = false;
        options.max_iterations = absl::GetFlag(FLAGS_max_iterations);
        options.tolerance = absl::GetFlag(FLAGS_tolerance);
        options.seeding_sample = absl::GetFlag(FLAGS_seeding_sample);
        absl::StatusOr<CalibrationResult> result = Calibrate(data, options);
        if (!result.ok()) return Fail(kExitBadInput, result.status());
        const CalibrationReport& r = result->report;
        std::cout << absl::StrFormat(
            "N=%-6d K=%-3d dim=%-5d (%dx%d): total %7.2f s | idf %.2f signatures %.2f kmeans %.2f "
            "(seeding %.2f scoring %.2f assignment %.2f update %.2f) | %d iterations%s | objective/N "
            "%.4f | data generation %.1f s\n",
            n, k, layers * experts, layers, experts, r.seconds_total, r.seconds_idf, r.seconds_signatures,
            r.seconds_kmeans, r.seconds_seeding, r.seconds_scoring, r.seconds_assignment, r.seconds_update,
            r.iterations, r.converged ? " (converged)" : "", r.objective / n, generate_seconds);
        std::cout.flush();
        results.push_back({{"kind", "calibrate"},
                           {"n", n},
                           {"k", k},
                           {"layers", layers},
                           {"experts", experts},
                           {"dim", layers * experts},
                           {"seconds_total", r.seconds_total},
                           {"seconds_idf", r.seconds_idf},
                           {"seconds_signatures", r.seconds_signatures},
                           {"seconds_kmeans", r.seconds_kmeans},
                           {"seconds_seeding", r.seconds_seeding},
                           {"seconds_scoring", r.seconds_scoring},
                           {"seconds_assignment", r.seconds_assignment},
                           {"seconds_update", r.seconds_update},
                           {"iterations", r.iterations},
                           {"converged", r.converged},
                           {"objective", r.objective},
                           {"objective_per_iteration", r.objective_per_iteration}});
      }
    }
  }

  // Refit: a window of fresh signatures, warm-started from centroids fitted on earlier traffic,
  // then aligned to the old rows: what OnlineRefitter does every interval.
  if (window > 0) {
    std::cout << "refit of a " << window << "-signature window (warm start + alignment)\n";
    for (const auto& [layers, experts] : geometries) {
      for (int k : *clusters) {
        if (window < k) continue;
        SyntheticDataOptions synthetic;
        synthetic.requests = 2 * window;
        synthetic.layers = layers;
        synthetic.experts = experts;
        synthetic.domains = domains;
        synthetic.seed = seed + 7;
        const CalibrationData data = MakeSyntheticCalibrationData(synthetic);
        CalibrationOptions options;
        options.clusters = k;
        options.seed = seed;
        options.select_layers = false;
        absl::StatusOr<CalibrationResult> initial = Calibrate(SelectRequests(data,
                                                                             [&] {
                                                                               std::vector<int> first(window);
                                                                               for (int i = 0; i < window; ++i)
                                                                                 first[i] = i;
                                                                               return first;
                                                                             }()),
                                                              options);
        if (!initial.ok()) return Fail(kExitBadInput, initial.status());
        absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(initial->artifact.spec);
        if (!transform.ok()) return Fail(kExitBadInput, transform.status());
        std::vector<int> second(window);
        for (int i = 0; i < window; ++i) second[i] = window + i;
        std::vector<int> usable;
        absl::StatusOr<std::vector<float>> points =
            TransformRequests(SelectRequests(data, second), *transform, &usable);
        if (!points.ok()) return Fail(kExitBadInput, points.status());
        const int dim = transform->dim();
        // The product's refitter on a router of k workers, fed the window and refitted once: the
        // figure is exactly what a daemon's refit costs (fit, alignment, bounds, install).
        std::vector<WorkerSpec> pool;
        for (int w = 0; w < k; ++w) pool.push_back(WorkerSpec{absl::StrCat("w", w), absl::StrCat("w", w, ":8000")});
        absl::StatusOr<std::unique_ptr<Router>> router = Router::Create(RouterOptions{}, pool);
        if (!router.ok()) return Fail(kExitBadInput, router.status());
        if (absl::StatusOr<uint64_t> g = (*router)->InstallCentroids(initial->artifact); !g.ok()) {
          return Fail(kExitBadInput, g.status());
        }
        RefitOptions refit_options;
        refit_options.interval = absl::ZeroDuration();
        refit_options.max_window_signatures = window;
        refit_options.min_signatures_per_centroid = 1;
        RefitOutcome outcome;
        refit_options.on_refit = [&outcome](const RefitOutcome& o) { outcome = o; };
        absl::StatusOr<std::unique_ptr<OnlineRefitter>> refitter = OnlineRefitter::Create(refit_options, router->get());
        if (!refitter.ok()) return Fail(kExitBadInput, refitter.status());
        for (size_t r = 0; r < usable.size(); ++r) {
          (*refitter)->Observe(absl::MakeConstSpan(*points).subspan(r * dim, dim), "benchmark");
        }
        const auto start = std::chrono::steady_clock::now();
        if (absl::Status refit = (*refitter)->RefitNow(); !refit.ok()) return Fail(kExitBadInput, refit);
        const double seconds = SecondsSince(start);
        if (outcome.kind != RefitOutcome::Kind::kInstalled) {
          return Fail(kExitBadInput,
                      absl::InternalError(absl::StrCat("benchmark refit did not install: ", outcome.reason)));
        }
        std::cout << absl::StrFormat(
            "window=%d K=%-3d dim=%-5d: refit %6.1f ms (%d iterations%s; %d rows held back by the movement bounds)\n",
            window, k, dim, seconds * 1e3, outcome.iterations, outcome.converged ? ", converged" : "",
            outcome.rows_step_bounded + outcome.rows_drift_bounded);
        std::cout.flush();
        results.push_back({{"kind", "refit"},
                           {"window", window},
                           {"k", k},
                           {"dim", dim},
                           {"seconds", seconds},
                           {"iterations", outcome.iterations},
                           {"converged", outcome.converged}});
      }
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_benchmark_json); !path.empty()) {
    if (absl::Status written = WriteFileAtomically(path, results.dump(2) + "\n"); !written.ok()) {
      return Fail(kExitBadInput, written);
    }
  }
  return 0;
}

// Debian's OpenBLAS 0.3.21 (DYNAMIC_ARCH) does not know recent Xeon models (e.g. family 6 model
// 207) and then runs its generic "Prescott" kernels: sgemm at a quarter of the speed the CPU
// offers. OpenBLAS picks its kernels when the library loads, so the only fix from inside is to
// restart with OPENBLAS_CORETYPE set. Returns only when no restart is needed or it failed.
void RestartWithMatchingBlasKernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  using CoreName = char* (*)();
  auto core_name = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (core_name == nullptr) return;  // not OpenBLAS
  const std::string core = core_name();
  if (core != "Prescott" && core != "Core2" && core != "Penryn" && core != "Dunnington" && core != "Nehalem") return;
  const char* better = nullptr;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl")) {
    better = "SKYLAKEX";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    better = "HASWELL";
  }
  if (better == nullptr) return;
  std::cerr << "eldr-calibrate: OpenBLAS chose its generic " << core << " kernels on a CPU with "
            << (std::string(better) == "SKYLAKEX" ? "AVX-512" : "AVX2")
            << "; restarting with OPENBLAS_CORETYPE=" << better << " (--nofix_blas_kernels to keep them)\n";
  setenv("OPENBLAS_CORETYPE", better, 1);
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // exec failed: carry on with the slow kernels
}

}  // namespace
}  // namespace eldr

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Fits the worker centroids eldr-router loads.\n"
      "  eldr-calibrate --trace data/esft-routing --prefill_fraction 0.5 --clusters 16 --out centroids.json\n"
      "  eldr-calibrate --captures a.cap,b.cap --clusters 8 --capacities 1,1,2,2,1,1,2,2 --out centroids.json\n"
      "  eldr-calibrate --benchmark");
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_fix_blas_kernels)) eldr::RestartWithMatchingBlasKernels(argv);
  std::vector<std::string> extra(positional.begin() + 1, positional.end());
  if (absl::GetFlag(FLAGS_benchmark)) {
    if (!extra.empty()) return eldr::UsageError(absl::StrCat("unexpected argument '", extra.front(), "'"));
    return eldr::RunBenchmark();
  }
  if (!extra.empty() && !absl::GetFlag(FLAGS_trace).empty()) {
    return eldr::UsageError(absl::StrCat("unexpected argument '", extra.front(), "' (with --trace)"));
  }
  return eldr::RunCalibration(extra);
}
