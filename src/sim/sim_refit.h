// Online refit driven at simulated times, for the eldr_refit policy.
//
// The product's refitter (eldr::OnlineRefitter, include/eldr/refit/refit.h) does the work: a rolling
// window of transformed signatures, a balanced k-means fit warm-started from the centroids in
// service, alignment of the new rows to the workers, installation. eldr-router runs it on a
// background thread at wall-clock intervals; a simulation must refit at simulated instants to stay
// deterministic, so this driver gives the refitter a simulated clock and calls RefitNow() from a
// simulated event.
//
// The refitter installs into a private "host" eldr::Router that holds only centroids; after each
// completed refit the driver hands the new artifact to the caller, which installs it where routing
// happens (the in-process router, or a daemon over gRPC with ReloadCentroids). The same refits thus
// serve both modes, and in-process and gRPC runs stay identical.
#ifndef ELDR_SIM_SIM_REFIT_H_
#define ELDR_SIM_SIM_REFIT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/router.h"
#include "eldr/core/signature.h"
#include "eldr/refit/refit.h"

namespace eldr::sim {

struct SimRefitOptions {
  double interval_s = 5;    // simulated seconds between refits
  double window_s = 30;     // signatures older than this leave the window
  int max_iterations = 20;  // k-means iterations per refit (the refitter's default)
  // A refit needs at least this many signatures per centroid in the window (the refitter's default).
  int min_signatures_per_centroid = 16;
  // The install guard's locality bound (RefitOptions::max_locality_decrease and min_experts_gain;
  // the refitter's defaults).
  double max_locality_decrease = RefitOptions().max_locality_decrease;
  double min_experts_gain = RefitOptions().min_experts_gain;
  double expert_picks = RefitOptions().expert_picks;  // its step model (RefitOptions::expert_picks)
  uint64_t seed = 1;
};

// Not thread-safe.
class SimRefitDriver {
 public:
  // `initial` is the calibrated artifact in service when the run starts, its `workers` naming the
  // pool's workers.
  static absl::StatusOr<std::unique_ptr<SimRefitDriver>> Create(const CentroidArtifact& initial,
                                                                const SimRefitOptions& options);
  ~SimRefitDriver();

  const SimRefitOptions& options() const { return options_; }

  // Adds a routed request's prompt counts ([layers][experts] int16) at simulated time `now_us`.
  // Signatures the transform rejects (e.g. all zero on the masked layers) are skipped, as the
  // router skips them.
  // `weight`: the decode work the request caused (its output tokens; the daemon's refitter weighs
  // a signature by what Complete reports when its lease ends).
  void Observe(absl::Span<const int16_t> counts, int layers, int experts, double now_us, double weight);
  // The same for a signature of any input form (e.g. gate-probability sums).
  void Observe(const SignatureInput& input, double now_us, double weight);

  // Refits at simulated time `now_us`. Returns the new artifact, or nullopt when the refitter
  // skipped (too few signatures in the window).
  absl::StatusOr<std::optional<CentroidArtifact>> Refit(double now_us);

  int refits() const { return refits_; }

  // The pool change of the routers this driver refits for, applied to the refitter's router
  // (Router::UpsertWorker, DrainWorker, RemoveWorker): the next Refit reconciles the rows with the
  // active workers, as eldr-router's refitter does after a pool change (refit.h, "elastic pools").
  absl::Status AddWorker(const std::string& id);
  absl::Status DrainWorker(const std::string& id);
  absl::Status RemoveWorker(const std::string& id);

 private:
  SimRefitDriver(SimRefitOptions options, SignatureTransform transform)
      : options_(options), transform_(std::move(transform)) {}

  SimRefitOptions options_;
  SignatureTransform transform_;
  std::shared_ptr<double> clock_us_ = std::make_shared<double>(0);
  std::unique_ptr<Router> host_;
  std::unique_ptr<OnlineRefitter> refitter_;
  std::vector<float> scratch_;
  int refits_ = 0;
};

}  // namespace eldr::sim

#endif  // ELDR_SIM_SIM_REFIT_H_
