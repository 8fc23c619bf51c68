// eldr-refit-bench: the online refit's fit on its compact window (half precision, decoded block by
// block; src/refit/signature_chunk.h) against the fit on the same signatures in fp32, the way the
// window kept them before (an n x dim float matrix, copied whole for every fit).
//
// Data: --source=synthetic (clustered counts of --geometry, calib/synthetic_data.h) or trace (the
// bundled real traces, every sequence cut at 20 prompt fractions). A calibration on separate
// requests gives the centroids in service (the warm start); the window's --window_signatures
// requests are transformed with its transform and fed, spread evenly over one refit window, to a
// real OnlineRefitter (unbounded movement, so that the fits themselves are compared):
//  - compact, all: a byte budget large enough for every signature (the encoding alone);
//  - compact, budget: --window_bytes (the default budget: the even sample it holds);
//  - fp32: the same signatures copied into one matrix and fitted by FitBalancedKMeans, aligned
//    like a refit (AlignCentroids).
// Each fit starts from the calibrated centroids and runs --repeats times (median wall time). Quality
// is measured on the whole fp32 window for every set of centroids: the balanced assignment's mean
// cosine similarity, the share of the busiest zone under pure locality (nearest centroid), the
// largest cosine distance of a row from the fp32 fit's row, and the points assigned differently.
// Prints one JSON object per variant.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "calib/synthetic_data.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/centroid_index.h"
#include "eldr/core/router.h"
#include "eldr/core/signature.h"
#include "eldr/refit/refit.h"
#include "eldr/trace/trace.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, source, "synthetic", "synthetic (clustered counts of --geometry) or trace (--trace_dir).");
ABSL_FLAG(std::string, geometry, "48x128", "Layers x experts of --source=synthetic.");
ABSL_FLAG(std::string, trace_dir, "data/esft-routing", "Bundled traces for --source=trace.");
ABSL_FLAG(int, workers, 16, "Centroids (decode workers).");
ABSL_FLAG(int, window_signatures, 4096, "Signatures in the window (--refit_max_window_signatures).");
ABSL_FLAG(int64_t, window_bytes, eldr::RefitOptions{}.max_window_bytes,
          "Byte budget of the 'budget' variant (--refit_window_bytes).");
ABSL_FLAG(int, repeats, 3, "Fits per variant (the median wall time is reported).");
ABSL_FLAG(uint64_t, seed, 7, "Seed of the data and the calibration.");

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0 : values[values.size() / 2];
}

double Cosine(absl::Span<const float> a, absl::Span<const float> b) {
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    dot += static_cast<double>(a[i]) * b[i];
    na += static_cast<double>(a[i]) * a[i];
    nb += static_cast<double>(b[i]) * b[i];
  }
  return dot / std::sqrt(na * nb);
}

// Calibration requests and window requests of one data source.
struct Requests {
  eldr::CalibrationData calibration;
  eldr::CalibrationData window;
  std::string label;
};

absl::StatusOr<Requests> MakeRequests(int window_signatures, uint64_t seed) {
  Requests out;
  const std::string source = absl::GetFlag(FLAGS_source);
  if (source == "synthetic") {
    const std::vector<std::string> parts = absl::StrSplit(absl::GetFlag(FLAGS_geometry), 'x');
    eldr::SyntheticDataOptions options;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &options.layers) ||
        !absl::SimpleAtoi(parts[1], &options.experts)) {
      return absl::InvalidArgumentError("--geometry must be LAYERSxEXPERTS");
    }
    options.requests = 4096;
    options.seed = seed;
    out.calibration = eldr::MakeSyntheticCalibrationData(options);
    options.requests = window_signatures;
    options.seed = seed + 1;  // other requests of the same domains
    out.window = eldr::MakeSyntheticCalibrationData(options);
    out.label = absl::StrCat("synthetic ", absl::GetFlag(FLAGS_geometry));
    return out;
  }
  if (source != "trace") return absl::InvalidArgumentError("--source must be synthetic or trace");
  absl::StatusOr<eldr::ExpertTrace> trace = eldr::LoadExpertTrace(absl::GetFlag(FLAGS_trace_dir));
  if (!trace.ok()) return trace.status();
  // Calibrate on three prompt fractions; the window cycles through 20 (2% to 93%).
  for (const double fraction : {0.3, 0.5, 0.7}) {
    absl::StatusOr<eldr::CalibrationData> part = eldr::CalibrationDataFromTrace(*trace, fraction, {});
    if (!part.ok()) return part.status();
    if (out.calibration.n == 0) {
      out.calibration = *std::move(part);
      continue;
    }
    out.calibration.prefill_counts.insert(out.calibration.prefill_counts.end(), part->prefill_counts.begin(),
                                          part->prefill_counts.end());
    out.calibration.n += part->n;
  }
  out.calibration.decode_counts.clear();
  out.calibration.labels.clear();
  out.calibration.label_names.clear();
  out.window.layers = trace->layers;
  out.window.experts = trace->experts;
  for (int f = 0; out.window.n < window_signatures; f = (f + 1) % 20) {
    absl::StatusOr<eldr::CalibrationData> part = eldr::CalibrationDataFromTrace(*trace, 0.02 + 0.048 * f, {});
    if (!part.ok()) return part.status();
    const int take = std::min(part->n, window_signatures - out.window.n);
    const size_t cells = static_cast<size_t>(trace->layers) * trace->experts;
    out.window.prefill_counts.insert(out.window.prefill_counts.end(), part->prefill_counts.begin(),
                                     part->prefill_counts.begin() + static_cast<ptrdiff_t>(take * cells));
    out.window.n += take;
  }
  out.label = absl::StrCat("trace ", trace->layers, "x", trace->experts);
  return out;
}

// Quality of `centroids` (k rows) on the fp32 window.
struct Quality {
  double mean_similarity = 0;  // of the balanced assignment
  double busiest_zone = 0;     // share of the window nearest to one centroid, times k
  std::vector<int> assignment;
};

Quality Measure(const std::vector<float>& points, int n, int dim, const std::vector<float>& centroids, int k) {
  Quality quality;
  eldr::BalancedKMeansOptions options;
  options.clusters = k;
  options.initial_centroids = centroids;
  options.max_iterations = 1;  // the assignment to these centroids, no update
  absl::StatusOr<eldr::BalancedKMeansResult> assigned = eldr::FitBalancedKMeans(points, n, dim, options);
  if (assigned.ok()) {
    quality.mean_similarity = 1 - assigned->objective / n;
    quality.assignment = assigned->assignment;
  }
  std::vector<float> scores(static_cast<size_t>(n) * k);
  eldr::ScoreAllPairs(points, n, centroids, k, dim, absl::MakeSpan(scores));
  std::vector<int> nearest(k, 0);
  for (int i = 0; i < n; ++i) {
    const float* row = scores.data() + static_cast<size_t>(i) * k;
    ++nearest[std::max_element(row, row + k) - row];
  }
  quality.busiest_zone = static_cast<double>(*std::max_element(nearest.begin(), nearest.end())) * k / n;
  return quality;
}

// The rows of `artifact` as one k * dim vector in the order of `workers`.
std::vector<float> RowsInOrder(const eldr::CentroidArtifact& artifact, const std::vector<std::string>& workers) {
  std::vector<float> rows;
  for (const std::string& id : workers) {
    const int r =
        static_cast<int>(std::find(artifact.workers.begin(), artifact.workers.end(), id) - artifact.workers.begin());
    const auto row = artifact.row(r);
    rows.insert(rows.end(), row.begin(), row.end());
  }
  return rows;
}

struct Variant {
  std::string name;
  std::vector<float> centroids;  // in the calibrated artifact's worker order
  std::vector<double> seconds;
  int signatures = 0;
  int64_t window_bytes = 0;
  int iterations = 0;
  double observe_us = 0;  // per signature offered to the window (admission, encoding, eviction)
};

// The real refitter on a window fed `points` spread over one window length, under `budget`.
absl::StatusOr<Variant> RefitterVariant(const std::string& name, const eldr::CentroidArtifact& artifact,
                                        const std::vector<float>& points, int n, int64_t budget, int repeats) {
  const int dim = artifact.dim();
  std::vector<eldr::WorkerSpec> workers;
  for (const std::string& id : artifact.workers) {
    eldr::WorkerSpec spec;
    spec.id = id;
    spec.address = id + ":9000";
    workers.push_back(std::move(spec));
  }
  absl::StatusOr<std::unique_ptr<eldr::Router>> router = eldr::Router::Create(eldr::RouterOptions{}, workers);
  if (!router.ok()) return router.status();
  if (absl::StatusOr<uint64_t> installed = (*router)->InstallCentroids(artifact); !installed.ok()) {
    return installed.status();
  }
  absl::Time now = absl::FromUnixSeconds(1'000'000);
  Variant variant;
  variant.name = name;
  eldr::RefitOptions options;
  options.interval = absl::ZeroDuration();
  options.max_window_signatures = n;
  options.max_window_bytes = budget;
  options.max_step_distance = 2;
  options.max_drift_distance = 2;
  // The install guard still predicts both sets (its cost is part of a refit's time) but refuses
  // nothing: the fit is what is measured, and a refit of the calibration's own traffic would be
  // refused (the synthetic data's predicted imbalance rises from 1.00 to 1.14).
  options.max_imbalance_increase = 1000;
  options.max_churn = 1;
  options.min_experts_gain = -1;
  options.clock = [&now] { return now; };
  options.on_refit = [&variant](const eldr::RefitOutcome& outcome) {
    if (outcome.kind != eldr::RefitOutcome::Kind::kInstalled) return;
    variant.seconds.push_back(outcome.seconds);
    variant.signatures = outcome.window_signatures;
    variant.iterations = outcome.iterations;
  };
  absl::StatusOr<std::unique_ptr<eldr::OnlineRefitter>> refitter = eldr::OnlineRefitter::Create(options, router->get());
  if (!refitter.ok()) return refitter.status();
  const absl::Duration step = options.window / n;
  const auto observe_started = Clock::now();
  for (int i = 0; i < n; ++i) {
    now += step;
    (*refitter)->Observe(absl::MakeConstSpan(points).subspan(static_cast<size_t>(i) * dim, dim), "bench");
  }
  variant.observe_us = std::chrono::duration<double, std::micro>(Clock::now() - observe_started).count() / n;
  variant.window_bytes = (*refitter)->stats().window_bytes;
  for (int r = 0; r < repeats; ++r) {
    // Every fit starts from the calibration (an install of the same transform keeps the window).
    if (absl::StatusOr<uint64_t> reset = (*router)->InstallCentroids(artifact, eldr::CentroidSource::kAdmin);
        !reset.ok()) {
      return reset.status();
    }
    if (absl::Status status = (*refitter)->RefitNow(); !status.ok()) return status;
  }
  if (variant.seconds.size() != static_cast<size_t>(repeats)) {
    return absl::InternalError(absl::StrCat(name, ": refit not installed: ", (*refitter)->stats().last_error));
  }
  absl::StatusOr<eldr::CentroidArtifact> fitted = (*router)->CurrentCentroids();
  if (!fitted.ok()) return fitted.status();
  variant.centroids = RowsInOrder(*fitted, artifact.workers);
  return variant;
}

// What the fp32 window did per refit: copy the window into one matrix, fit, align.
absl::StatusOr<Variant> Fp32Variant(const eldr::CentroidArtifact& artifact, const std::vector<float>& points, int n,
                                    int repeats) {
  const int dim = artifact.dim();
  const eldr::RefitOptions defaults;
  Variant variant;
  variant.name = "fp32";
  variant.signatures = n;
  variant.window_bytes = static_cast<int64_t>(points.size() * sizeof(float));
  variant.observe_us = -1;  // not measured: the fp32 window's copy per signature is not rebuilt here
  for (int r = 0; r < repeats; ++r) {
    const auto started = Clock::now();
    const std::vector<float> snapshot = points;
    eldr::BalancedKMeansOptions options;
    options.clusters = artifact.k;
    options.max_iterations = defaults.max_iterations;
    options.tolerance = defaults.tolerance;
    options.initial_centroids = artifact.centroids;
    absl::StatusOr<eldr::BalancedKMeansResult> fit = eldr::FitBalancedKMeans(snapshot, n, dim, options);
    if (!fit.ok()) return fit.status();
    const std::vector<int> row_of = eldr::AlignCentroids(artifact.centroids, fit->centroids, artifact.k, dim);
    variant.centroids.clear();
    for (int t = 0; t < artifact.k; ++t) {
      variant.centroids.insert(variant.centroids.end(),
                               fit->centroids.begin() + static_cast<ptrdiff_t>(row_of[t]) * dim,
                               fit->centroids.begin() + static_cast<ptrdiff_t>(row_of[t] + 1) * dim);
    }
    variant.seconds.push_back(std::chrono::duration<double>(Clock::now() - started).count());
    variant.iterations = fit->iterations;
  }
  return variant;
}

int Run() {
  const int n = absl::GetFlag(FLAGS_window_signatures);
  const int k = absl::GetFlag(FLAGS_workers);
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  absl::StatusOr<Requests> requests = MakeRequests(n, absl::GetFlag(FLAGS_seed));
  if (!requests.ok()) {
    std::fprintf(stderr, "eldr-refit-bench: %s\n", std::string(requests.status().message()).c_str());
    return 1;
  }
  eldr::CalibrationOptions calibration;
  calibration.clusters = k;
  calibration.seed = absl::GetFlag(FLAGS_seed);
  calibration.select_layers = false;
  for (int w = 0; w < k; ++w) calibration.worker_ids.push_back(absl::StrCat("w", w));
  absl::StatusOr<eldr::CalibrationResult> calibrated = eldr::Calibrate(requests->calibration, calibration);
  if (!calibrated.ok()) {
    std::fprintf(stderr, "eldr-refit-bench: calibration: %s\n", std::string(calibrated.status().message()).c_str());
    return 1;
  }
  const eldr::CentroidArtifact& artifact = calibrated->artifact;
  absl::StatusOr<eldr::SignatureTransform> transform = eldr::SignatureTransform::Create(artifact.spec);
  if (!transform.ok()) return 1;
  const int dim = transform->dim();
  const size_t cells = static_cast<size_t>(requests->window.layers) * requests->window.experts;
  std::vector<float> points;
  int m = 0;
  std::vector<float> row(dim);
  for (int i = 0; i < requests->window.n; ++i) {
    const eldr::SignatureInput input =
        eldr::CountsInt32{requests->window.layers, requests->window.experts,
                          absl::MakeConstSpan(requests->window.prefill_counts).subspan(i * cells, cells)};
    if (!transform->Apply(input, absl::MakeSpan(row)).ok()) continue;  // all zero on the mask
    points.insert(points.end(), row.begin(), row.end());
    ++m;
  }

  std::vector<absl::StatusOr<Variant>> variants;
  variants.push_back(Fp32Variant(artifact, points, m, repeats));
  variants.push_back(RefitterVariant("compact, all", artifact, points, m, int64_t{1} << 40, repeats));
  variants.push_back(
      RefitterVariant("compact, budget", artifact, points, m, absl::GetFlag(FLAGS_window_bytes), repeats));
  for (const auto& variant : variants) {
    if (!variant.ok()) {
      std::fprintf(stderr, "eldr-refit-bench: %s\n", std::string(variant.status().message()).c_str());
      return 1;
    }
  }
  const Variant& reference = *variants[0];
  const Quality reference_quality = Measure(points, m, dim, reference.centroids, k);
  for (const auto& variant : variants) {
    const Quality quality = Measure(points, m, dim, variant->centroids, k);
    double worst = 0;
    for (int r = 0; r < k; ++r) {
      const auto at = [&](const std::vector<float>& rows) {
        return absl::MakeConstSpan(rows).subspan(static_cast<size_t>(r) * dim, dim);
      };
      worst = std::max(worst, 1 - Cosine(at(variant->centroids), at(reference.centroids)));
    }
    int differ = 0;
    for (int i = 0; i < m && i < static_cast<int>(quality.assignment.size()); ++i) {
      differ += quality.assignment[i] != reference_quality.assignment[i];
    }
    Json out;
    out["data"] = requests->label;
    out["dim"] = dim;
    out["k"] = k;
    out["variant"] = variant->name;
    out["signatures"] = variant->signatures;
    out["window_bytes"] = variant->window_bytes;
    out["bytes_per_signature"] = variant->signatures > 0 ? variant->window_bytes / variant->signatures : 0;
    out["fit_seconds_median"] = Median(variant->seconds);
    out["observe_us_per_signature"] = variant->observe_us;
    out["iterations"] = variant->iterations;
    out["mean_similarity"] = quality.mean_similarity;
    out["busiest_zone_over_fair"] = quality.busiest_zone;
    out["max_row_distance_to_fp32"] = worst;
    out["assignments_differing_from_fp32"] = differ;
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Online refit: the fit on the compact window against the fp32 window.");
  absl::ParseCommandLine(argc, argv);
  return Run();
}
