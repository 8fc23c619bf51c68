// Online refit driven at simulated times (DESIGN.md, algorithm step 4), for the eldr_refit policy.
//
// The daemon refits on a background thread at wall-clock intervals; a simulation must refit at
// simulated instants to stay deterministic, so this driver runs the same steps synchronously:
// keep a rolling window of the transformed signatures of routed requests, fit balanced spherical
// k-means warm-started from the centroids in service (eldr::FitBalancedKMeans), align the new rows
// to the workers by the exact K x K assignment (eldr::AlignCentroids), and hand the artifact back
// for the caller to install (in-process or over gRPC). The signature transform (layer mask, IDF)
// stays the calibrated one; only centroids move.
#ifndef ELDR_SIM_SIM_REFIT_H_
#define ELDR_SIM_SIM_REFIT_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "eldr/centroid_artifact.h"
#include "eldr/signature.h"

namespace eldr::sim {

struct SimRefitOptions {
  double interval_s = 5;    // simulated seconds between refits
  double window_s = 30;     // signatures older than this are dropped from the window
  int max_iterations = 10;  // k-means iterations per refit (warm start converges fast)
  // A refit needs at least this many signatures per centroid in the window.
  int min_signatures_per_centroid = 4;
  uint64_t seed = 1;
};

// Not thread-safe.
class SimRefitDriver {
 public:
  // `initial` is the calibrated artifact in service when the run starts (workers named).
  static absl::StatusOr<SimRefitDriver> Create(const CentroidArtifact& initial,
                                               const SimRefitOptions& options);

  const SimRefitOptions& options() const { return options_; }

  // Adds a routed request's prompt counts ([layers][experts] int16) at simulated time `now_us`.
  // Signatures that the transform rejects (e.g. all zero on the masked layers) are skipped.
  void Observe(absl::Span<const int16_t> counts, int layers, int experts, double now_us);

  // Refits on the signatures of (now - window, now]. Returns the aligned new artifact, or nullopt
  // when the window holds too few signatures. The result becomes the warm start of the next refit.
  absl::StatusOr<std::optional<CentroidArtifact>> Refit(double now_us);

  int refits() const { return refits_; }
  int window_size() const { return static_cast<int>(window_.size()); }

 private:
  SimRefitDriver(CentroidArtifact current, SignatureTransform transform, SimRefitOptions options)
      : current_(std::move(current)), transform_(std::move(transform)), options_(options) {}

  struct Observation {
    double time_us;
    std::vector<float> signature;
  };

  CentroidArtifact current_;
  SignatureTransform transform_;
  SimRefitOptions options_;
  std::deque<Observation> window_;
  int refits_ = 0;
};

}  // namespace eldr::sim

#endif  // ELDR_SIM_SIM_REFIT_H_
