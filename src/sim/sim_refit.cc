#include "sim/sim_refit.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"

namespace eldr::sim {

absl::StatusOr<std::unique_ptr<SimRefitDriver>> SimRefitDriver::Create(const CentroidArtifact& initial,
                                                                       const SimRefitOptions& options) {
  if (!(options.interval_s > 0) || !(options.window_s > 0) || options.max_iterations < 1 ||
      options.min_signatures_per_centroid < 1) {
    return absl::InvalidArgumentError(
        "refit: --refit_interval_s and --refit_window_s must be > 0, iterations and minimum "
        "signatures >= 1");
  }
  ELDR_RETURN_IF_ERROR(ValidateCentroidArtifact(initial));
  if (initial.workers.empty()) {
    return absl::InvalidArgumentError("refit: the initial artifact must name its workers");
  }
  ELDR_ASSIGN_OR_RETURN(SignatureTransform transform, SignatureTransform::Create(initial.spec));
  std::unique_ptr<SimRefitDriver> driver(new SimRefitDriver(options, std::move(transform)));

  std::vector<WorkerSpec> workers;
  for (const std::string& id : initial.workers) {
    WorkerSpec spec;
    spec.id = id;
    spec.address = absl::StrCat(id, ":8000");
    workers.push_back(std::move(spec));
  }
  RouterOptions host_options;
  host_options.policy = PolicyKind::kEldr;
  ELDR_ASSIGN_OR_RETURN(driver->host_, Router::Create(host_options, std::move(workers)));
  ELDR_RETURN_IF_ERROR(driver->host_->InstallCentroids(initial).status());

  RefitOptions refit;
  refit.window = absl::Microseconds(static_cast<int64_t>(options.window_s * 1e6));
  refit.interval = absl::ZeroDuration();  // no background thread: RefitNow at simulated times
  refit.min_signatures_per_centroid = options.min_signatures_per_centroid;
  refit.max_locality_decrease = options.max_locality_decrease;
  refit.min_experts_gain = options.min_experts_gain;
  refit.expert_picks = options.expert_picks;
  refit.max_iterations = options.max_iterations;
  refit.seed = options.seed;
  std::shared_ptr<double> clock_us = driver->clock_us_;
  refit.clock = [clock_us] { return absl::UnixEpoch() + absl::Microseconds(static_cast<int64_t>(*clock_us)); };
  ELDR_ASSIGN_OR_RETURN(driver->refitter_, OnlineRefitter::Create(refit, driver->host_.get()));
  return driver;
}

SimRefitDriver::~SimRefitDriver() {
  if (refitter_ != nullptr) refitter_->Stop();
}

void SimRefitDriver::Observe(absl::Span<const int16_t> counts, int layers, int experts, double now_us, double weight) {
  Observe(
      CountsInt16Le{layers, experts,
                    absl::string_view(reinterpret_cast<const char*>(counts.data()), counts.size() * sizeof(int16_t))},
      now_us, weight);
}

void SimRefitDriver::Observe(const SignatureInput& input, double now_us, double weight) {
  *clock_us_ = now_us;
  scratch_.resize(transform_.dim());
  if (!transform_.Apply(input, absl::MakeSpan(scratch_)).ok()) return;
  refitter_->Observe(scratch_, "", weight);
}

absl::StatusOr<std::optional<CentroidArtifact>> SimRefitDriver::Refit(double now_us) {
  *clock_us_ = now_us;
  const uint64_t completed_before = refitter_->stats().refits_completed;
  ELDR_RETURN_IF_ERROR(refitter_->RefitNow());
  const RefitStats stats = refitter_->stats();
  // RefitNow fails on a fit or install error and succeeds when it skipped for lack of data.
  if (stats.refits_completed == completed_before) return std::optional<CentroidArtifact>();
  ++refits_;
  ELDR_ASSIGN_OR_RETURN(CentroidArtifact artifact, host_->CurrentCentroids());
  return std::optional<CentroidArtifact>(std::move(artifact));
}

absl::Status SimRefitDriver::AddWorker(const std::string& id) {
  WorkerSpec spec;
  spec.id = id;
  spec.address = absl::StrCat(id, ":8000");
  return host_->UpsertWorker(spec).status();
}

absl::Status SimRefitDriver::DrainWorker(const std::string& id) { return host_->DrainWorker(id).status(); }

absl::Status SimRefitDriver::RemoveWorker(const std::string& id) { return host_->RemoveWorker(id).status(); }

}  // namespace eldr::sim
