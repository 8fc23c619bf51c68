// Online refit (DESIGN.md, algorithm step 4) and elastic pools: keep the worker centroids of a
// running Router current as traffic drifts and as workers come and go.
//
// The refitter keeps a rolling window of recent transformed signatures (fed by
// RouterOptions::on_signature through Observe). Every `interval` a background thread fits balanced
// spherical k-means on the window, warm-started from the centroids in service, with each worker's
// capacity weight scaling its cluster's capacity; aligns the new rows to worker identities by an
// exact assignment (AlignCentroids), so every worker keeps the zone closest to its old one; and
// swaps them in with Router::InstallCentroids (same transform, rows named by worker). A Route never
// waits for a fit: the fit runs on a copy of the window and the swap is the router's atomic one.
//
// Which workers own a row after a refit: the router's active (not draining) workers. So a refit
// also reconciles the pool: an added worker receives a centroid (seeded by splitting the most
// spread-out cluster, then refined by the fit with K+1 clusters), and a removed or draining
// worker's row disappears and its zone is absorbed by the others (fit with K-1). OnWorkerAdded /
// OnWorkerRemoved run that reconciliation at once, from the last window, also when periodic refit
// is off.
//
// Persistence: after every installed refit the artifact is written atomically to
// StatePath(state_dir), and LoadStartupCentroids prefers it at start over the configured artifact
// when both describe the same transform, so a restart keeps what was learned.
//
// Thread-safety: every method may be called from any thread. Observe takes one short mutex and
// copies an admitted signature into a preallocated chunk (chunks are recycled, so the routing
// thread does not allocate or zero-fill in steady state); refits are serialised among themselves
// and never hold that mutex while fitting.
#ifndef ELDR_REFIT_H_
#define ELDR_REFIT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/router.h"

namespace eldr {

struct RefitOptions {
  // Signatures older than this leave the window.
  absl::Duration window = absl::Seconds(60);
  // Time between periodic refits; zero or infinite: no periodic refit (OnWorkerAdded /
  // OnWorkerRemoved / RefitNow still work).
  absl::Duration interval = absl::Seconds(10);
  // Signatures kept (memory: this * dim * 4 bytes; 4096 x 6144 floats = 100 MB). Admission is a
  // token bucket of this many tokens refilled at max_window_signatures per `window`: a burst of up
  // to this many is kept whole, and under sustained traffic faster than the refill the window is
  // an even sample of the whole `window` (not only its newest fraction of a second).
  int max_window_signatures = 4096;
  // A fit needs at least this many window signatures per centroid; with fewer a periodic refit is
  // skipped (counted in refits_skipped) and a worker addition fails with FAILED_PRECONDITION.
  int min_signatures_per_centroid = 16;
  int max_iterations = 20;
  // k-means stopping tolerance (BalancedKMeansOptions::tolerance). Looser than offline calibration:
  // the next refit continues from these centroids anyway.
  double tolerance = 1e-3;
  uint64_t seed = 0;
  // Folder for the persisted centroids (StatePath); created if missing. Empty: no persistence.
  std::string state_dir;
  // Time source for the window (tests inject one). Empty: absl::Now.
  std::function<absl::Time()> clock;
};

// Counters for the server to export as metrics (monotonic unless noted).
struct RefitStats {
  uint64_t refits_started = 0;
  uint64_t refits_completed = 0;  // fitted and installed
  uint64_t refits_failed = 0;     // a fit or install error (last_error says which)
  uint64_t refits_skipped = 0;    // too few signatures, no centroids yet, or replaced meanwhile
  uint64_t persist_failures = 0;  // installed, but the state file could not be written
  double last_fit_seconds = 0;    // wall time of the last completed refit (fit + align + install)
  uint64_t centroid_generation = 0;  // the router's generation after the last completed refit
  int64_t window_signatures = 0;     // gauge: signatures in the window now
  uint64_t signatures_observed = 0;
  uint64_t signatures_sampled_out = 0;  // observed but not admitted (the window's token bucket was empty)
  std::string last_error;            // why the last refit failed or was skipped; empty on success
  absl::Time last_refit_time = absl::InfinitePast();  // of the last completed refit
};

// What LoadStartupCentroids chose.
struct StartupCentroids {
  CentroidArtifact artifact;
  bool from_state = false;  // true: the persisted state; false: the configured artifact
  std::string note;         // why the state was not used, when it exists but was not
};

class OnlineRefitter {
 public:
  // `router` must outlive the refitter. INVALID_ARGUMENT for bad options (non-positive window or
  // window size, negative interval, minimum or max_iterations below 1, negative tolerance, a state
  // folder that cannot be created). Does not start the background thread.
  static absl::StatusOr<std::unique_ptr<OnlineRefitter>> Create(RefitOptions options, Router* router);
  ~OnlineRefitter();  // Stop()s

  OnlineRefitter(const OnlineRefitter&) = delete;
  OnlineRefitter& operator=(const OnlineRefitter&) = delete;

  // Adds one routed request's transformed signature (unit vector of the transform in service) to
  // the window. `worker` is where it was routed: the fit clusters by signature alone, the
  // parameter exists so Observe matches RouterOptions::on_signature. A signature of another
  // dimension than the window's (a reload changed the transform) restarts the window.
  void Observe(absl::Span<const float> signature, const std::string& worker);

  // Starts the periodic refit thread (no-op when the interval is zero/infinite or it runs already).
  // The thread runs at nice +10, so fits yield the CPU to routing threads.
  void Start();
  // Stops and joins the thread; a refit in progress finishes first. Idempotent.
  void Stop();

  // One refit now, in the calling thread (serialised with the background one). OK also when the
  // refit was skipped for lack of data; the stats tell which.
  absl::Status RefitNow();

  // Pool changes. Call after the router learnt of the change (UpsertWorker / DrainWorker /
  // RemoveWorker). Both refit from the current window at once. OnWorkerAdded: FAILED_PRECONDITION
  // when the worker is unknown or draining, or when the window is too small to give it a zone (a
  // later periodic refit retries; the worker gets traffic only through fallbacks meanwhile).
  // OnWorkerRemoved: FAILED_PRECONDITION when the worker is still active; with too small a window
  // the worker's row is just dropped and the nearest remaining zones absorb its traffic.
  absl::Status OnWorkerAdded(const std::string& worker_id);
  absl::Status OnWorkerRemoved(const std::string& worker_id);

  // Empties the window (e.g. after a reload installed a different transform).
  void ResetWindow();

  RefitStats stats() const;

  // state_dir + "/centroids.json".
  static std::string StatePath(const std::string& state_dir);

  // The centroids to start with: the persisted state when it exists, loads, and has the same
  // transform (layers, experts, variant, layer mask, IDF) as the configured artifact (or no
  // artifact is configured); otherwise the configured artifact. Rows of the state naming workers
  // outside `worker_ids` are dropped (empty `worker_ids`: keep all); a state left with no rows is
  // not used. Either path may be empty. Errors: the configured artifact's load error when the
  // state is not used; NOT_FOUND when neither is given or present.
  static absl::StatusOr<StartupCentroids> LoadStartupCentroids(const std::string& state_dir,
                                                               const std::string& configured_path,
                                                               const std::vector<std::string>& worker_ids);

 private:
  OnlineRefitter(RefitOptions options, Router* router);

  // The window is a queue of chunks of up to kChunkRows signatures. Only the newest chunk is ever
  // written; a full chunk is immutable, so a snapshot copies the chunk pointers under window_mu_
  // and the rows themselves outside it, and Observe never waits for a copy of the whole window.
  struct Chunk {
    std::vector<float> rows;        // kChunkRows * dim, the first `count` rows valid
    std::vector<absl::Time> times;  // observation time of each valid row
    int count = 0;
  };
  static constexpr int kChunkRows = 32;

  absl::Status Refit() ABSL_LOCKS_EXCLUDED(fit_mu_);
  // One refit: reconcile rows with the active workers, fit, align, install, persist.
  absl::Status RefitLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  // Copies the newest signatures younger than the window (at most max_window_signatures) into
  // `points`, oldest first; sets `dim` to the window's dimension; returns how many.
  int SnapshotWindow(absl::Time now, std::vector<float>* points, int* dim) ABSL_LOCKS_EXCLUDED(window_mu_);
  // Stats bookkeeping; each returns the status the refit reports to its caller.
  absl::Status RecordFailure(const absl::Status& status) ABSL_LOCKS_EXCLUDED(stats_mu_);
  absl::Status RecordSkip(const std::string& why) ABSL_LOCKS_EXCLUDED(stats_mu_);
  absl::Time Now() const { return options_.clock ? options_.clock() : absl::Now(); }
  void RunPeriodic() ABSL_LOCKS_EXCLUDED(thread_mu_);

  const RefitOptions options_;
  Router* const router_;

  // Serialises refits (periodic thread, RefitNow, pool changes).
  absl::Mutex fit_mu_;

  mutable absl::Mutex window_mu_;
  int window_dim_ ABSL_GUARDED_BY(window_mu_) = 0;
  std::vector<std::shared_ptr<Chunk>> chunks_ ABSL_GUARDED_BY(window_mu_);  // oldest first
  int64_t window_rows_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t observed_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t sampled_out_ ABSL_GUARDED_BY(window_mu_) = 0;
  // Admission token bucket (see RefitOptions::max_window_signatures); starts full.
  double admission_tokens_ ABSL_GUARDED_BY(window_mu_) = -1;  // < 0: not started
  absl::Time admission_refilled_at_ ABSL_GUARDED_BY(window_mu_);
  // An evicted chunk kept for reuse, so a full chunk does not cost an allocation and zero-fill of
  // kChunkRows * dim floats on the routing thread.
  std::shared_ptr<Chunk> spare_chunk_ ABSL_GUARDED_BY(window_mu_);

  mutable absl::Mutex stats_mu_;
  RefitStats stats_ ABSL_GUARDED_BY(stats_mu_);

  // The periodic thread: started and joined under lifecycle_mu_, woken for shutdown by thread_cv_.
  absl::Mutex lifecycle_mu_ ABSL_ACQUIRED_BEFORE(thread_mu_);
  std::thread thread_ ABSL_GUARDED_BY(lifecycle_mu_);
  absl::Mutex thread_mu_;
  absl::CondVar thread_cv_;
  bool stopping_ ABSL_GUARDED_BY(thread_mu_) = false;
};

// Breaks the construction cycle between a Router (which takes its on_signature callback at
// creation) and the OnlineRefitter (which needs the Router): give the router Callback(), create
// the refitter, then Attach it. Copies of the callback stay valid after the slot is destroyed (they
// share its state); a detached slot drops signatures. Thread-safe.
class RefitObserverSlot {
 public:
  RefitObserverSlot();
  std::function<void(absl::Span<const float>, const std::string&)> Callback() const;
  // nullptr detaches (do so before destroying the refitter while the router still routes).
  void Attach(OnlineRefitter* refitter);

 private:
  struct Shared {
    absl::Mutex mu;  // readers: in-flight callbacks; writer: Attach, which so waits for them
    OnlineRefitter* refitter ABSL_GUARDED_BY(mu) = nullptr;
  };
  std::shared_ptr<Shared> shared_;
};

}  // namespace eldr

#endif  // ELDR_REFIT_H_
