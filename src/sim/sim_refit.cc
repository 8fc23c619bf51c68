#include "sim/sim_refit.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "eldr/calibration.h"

namespace eldr::sim {

absl::StatusOr<SimRefitDriver> SimRefitDriver::Create(const CentroidArtifact& initial,
                                                      const SimRefitOptions& options) {
  if (!(options.interval_s > 0) || !(options.window_s > 0) || options.max_iterations < 1 ||
      options.min_signatures_per_centroid < 1) {
    return absl::InvalidArgumentError(
        "refit: --refit_interval_s and --refit_window_s must be > 0, iterations and minimum "
        "signatures >= 1");
  }
  ELDR_RETURN_IF_ERROR(ValidateCentroidArtifact(initial));
  ELDR_ASSIGN_OR_RETURN(SignatureTransform transform, SignatureTransform::Create(initial.spec));
  return SimRefitDriver(initial, std::move(transform), options);
}

void SimRefitDriver::Observe(absl::Span<const int16_t> counts, int layers, int experts,
                             double now_us) {
  Observation observation;
  observation.time_us = now_us;
  observation.signature.resize(transform_.dim());
  const SignatureInput input = CountsInt16Le{
      layers, experts,
      absl::string_view(reinterpret_cast<const char*>(counts.data()), counts.size() * sizeof(int16_t))};
  if (!transform_.Apply(input, absl::MakeSpan(observation.signature)).ok()) return;
  window_.push_back(std::move(observation));
}

absl::StatusOr<std::optional<CentroidArtifact>> SimRefitDriver::Refit(double now_us) {
  const double oldest = now_us - options_.window_s * 1e6;
  while (!window_.empty() && window_.front().time_us <= oldest) window_.pop_front();
  const int k = current_.k;
  const int n = static_cast<int>(window_.size());
  if (n < k * options_.min_signatures_per_centroid) return std::optional<CentroidArtifact>();

  const int dim = current_.dim();
  std::vector<float> points(static_cast<size_t>(n) * dim);
  for (int i = 0; i < n; ++i) {
    std::copy(window_[i].signature.begin(), window_[i].signature.end(),
              points.begin() + static_cast<size_t>(i) * dim);
  }
  BalancedKMeansOptions fit;
  fit.clusters = k;
  fit.seed = options_.seed + static_cast<uint64_t>(refits_);
  fit.max_iterations = options_.max_iterations;
  fit.initial_centroids = current_.centroids;
  absl::StatusOr<BalancedKMeansResult> result = FitBalancedKMeans(points, n, dim, fit);
  if (!result.ok()) {
    return absl::Status(result.status().code(),
                        absl::StrCat("refit on ", n, " signatures: ", result.status().message()));
  }
  // new row permutation[i] takes the worker of old row i.
  const std::vector<int> permutation = AlignCentroids(current_.centroids, result->centroids, k, dim);
  CentroidArtifact next = current_;
  for (int i = 0; i < k; ++i) {
    std::copy(result->centroids.begin() + static_cast<size_t>(permutation[i]) * dim,
              result->centroids.begin() + static_cast<size_t>(permutation[i] + 1) * dim,
              next.centroids.begin() + static_cast<size_t>(i) * dim);
  }
  current_ = next;
  ++refits_;
  return std::optional<CentroidArtifact>(std::move(next));
}

}  // namespace eldr::sim
