// Online refit (docs/calibration.md, "Online refit") and elastic pools: keep the worker centroids
// of a running Router current as traffic drifts and as workers come and go.
//
// The refitter is a RouterObserver of the router it is created for (it subscribes in Create and
// unsubscribes when destroyed):
//  - every routed signature is offered to a rolling window (OnSignatureRouted -> Observe);
//  - a pool change (a worker added, drained, removed, re-activated) schedules a reconciling refit
//    on the refitter's thread, after a short settle delay that coalesces a burst of changes;
//  - centroids installed by anyone else (a reload) become the new calibration: the window is
//    emptied when their transform differs, and they are the anchor the drift bound measures from.
// Every `interval` the background thread fits balanced spherical k-means on the window,
// warm-started from the centroids in service, with each worker's capacity weight scaling its
// cluster's capacity; aligns the new rows to worker identities by an exact assignment
// (AlignCentroids), so every worker keeps the zone closest to its old one; bounds how far each row
// moves (per refit, and in total from the calibrated anchor); and installs them through the one
// door, Router::InstallCentroids(..., CentroidSource::kRefit). A Route never waits for a fit: the
// fit runs on a copy of the window and the swap is the router's atomic one.
//
// Which workers own a row after a refit: the router's active (not draining) workers. So a refit
// also reconciles the pool: an added worker receives a centroid (seeded by splitting the most
// spread-out cluster, then refined by the fit with K+1 clusters), and a removed or draining
// worker's row disappears and its zone is absorbed by the others (fit with K-1).
//
// Admission to the window is bounded twice: a token bucket of max_window_signatures per window
// (under sustained traffic the window is an even sample of the whole window, not its newest
// fraction of a second), and a fair share per client (RouteInput::client): while n clients are
// active, one client may fill at most 1/n of the window (and never more than max_client_share),
// so a single caller cannot replace everyone else's traffic with its own.
//
// Persistence: after every installed refit the artifact is written atomically to
// StatePath(state_dir), and LoadStartupCentroids prefers it at start over the configured artifact
// when both describe the same transform, so a restart keeps what was learned.
//
// Thread-safety: every method may be called from any thread. Observe takes one short mutex and
// copies an admitted signature into a preallocated chunk (chunks are recycled, so the routing
// thread does not allocate or zero-fill in steady state); refits are serialised among themselves
// and never hold that mutex while fitting.
#ifndef ELDR_REFIT_REFIT_H_
#define ELDR_REFIT_REFIT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/router.h"

namespace eldr {

// What one refit did, for the owner's logs (RefitOptions::on_refit).
struct RefitOutcome {
  enum class Kind { kInstalled, kSkipped, kFailed } kind = Kind::kSkipped;
  std::string reason;          // why it was skipped or failed; empty when installed
  uint64_t generation = 0;     // kInstalled: the router's new generation
  int rows = 0;                // kInstalled: centroid rows now in service
  int window_signatures = 0;   // signatures the fit used
  int iterations = 0;          // k-means iterations of the fit (0 when there was none)
  bool converged = false;      // the fit stopped at its tolerance
  int rows_step_bounded = 0;   // rows the per-refit bound held back
  int rows_drift_bounded = 0;  // rows the total-drift bound held back
  double seconds = 0;          // wall time of the refit
  bool pool_change = false;    // triggered by a pool change (else periodic or RefitNow)
};

struct RefitOptions {
  // Signatures older than this leave the window.
  absl::Duration window = absl::Seconds(60);
  // Time between periodic refits; zero or infinite: no periodic refit (pool changes and RefitNow
  // still refit).
  absl::Duration interval = absl::Seconds(10);
  // Signatures kept (memory: this * dim * 4 bytes; 4096 x 6144 floats = 100 MB), and the tokens of
  // the admission bucket, refilled at this many per `window`.
  int max_window_signatures = 4096;
  // Largest fraction of the window one client may hold, on top of the fair share (1/n of the
  // window while n clients are active). In (0, 1].
  double max_client_share = 1.0;
  // A fit needs at least this many window signatures per centroid; with fewer a periodic refit is
  // skipped (counted in refits_skipped) and a worker addition fails with FAILED_PRECONDITION.
  int min_signatures_per_centroid = 16;
  int max_iterations = 20;
  // k-means stopping tolerance (BalancedKMeansOptions::tolerance). Looser than offline calibration:
  // the next refit continues from these centroids anyway.
  double tolerance = 1e-3;
  // How far (cosine distance, 1 - cos) one refit may move a worker's row, and how far a row may be
  // from the calibrated anchor (the last centroids installed by anything but a refit) in total.
  // A row the fit moves further is rotated towards its fitted position only that far. 2 disables
  // a bound (no two unit vectors are further apart).
  double max_step_distance = 0.15;
  double max_drift_distance = 0.5;
  // After a pool change, how long the refitter waits for more changes before it reconciles once.
  absl::Duration pool_change_settle = absl::Milliseconds(250);
  uint64_t seed = 0;
  // Folder for the persisted centroids (StatePath); created if missing. Empty: no persistence.
  std::string state_dir;
  // Time source for the window (tests and the simulator inject one). Empty: absl::Now.
  std::function<absl::Time()> clock;
  // Called after every refit with what it did (on the refitting thread). Empty: none.
  std::function<void(const RefitOutcome&)> on_refit;
  // Asked before every refit and again right before its install: false skips it (counted in
  // refits_skipped, reason "refit paused: ..."), so only one replica of a cluster refits (the
  // daemon's cluster component answers true on the refit leader only). Called on the refitting
  // thread; must be quick. Empty: always refit.
  std::function<bool()> may_refit;
};

// Counters for the server to export as metrics (monotonic unless noted).
struct RefitStats {
  uint64_t refits_started = 0;
  uint64_t refits_completed = 0;     // fitted and installed
  uint64_t refits_failed = 0;        // a fit or install error (last_error says which)
  uint64_t refits_skipped = 0;       // too few signatures, no centroids yet, or replaced meanwhile
  uint64_t persist_failures = 0;     // installed, but the state file could not be written
  uint64_t rows_step_bounded = 0;    // rows held back by max_step_distance
  uint64_t rows_drift_bounded = 0;   // rows held back by max_drift_distance
  double last_fit_seconds = 0;       // wall time of the last completed refit (fit + align + install)
  uint64_t centroid_generation = 0;  // the router's generation after the last completed refit
  int64_t window_signatures = 0;     // gauge: signatures in the window now
  int64_t window_clients = 0;        // gauge: clients with signatures admitted in the last window
  uint64_t signatures_observed = 0;
  uint64_t signatures_sampled_out = 0;                // not admitted: the window's token bucket was empty
  uint64_t signatures_client_limited = 0;             // not admitted: their client had used its share
  std::string last_error;                             // why the last refit failed or was skipped; empty on success
  absl::Time last_refit_time = absl::InfinitePast();  // of the last completed refit
};

// What LoadStartupCentroids chose.
struct StartupCentroids {
  CentroidArtifact artifact;
  bool from_state = false;  // true: the persisted state; false: the configured artifact
  std::string note;         // why the state was not used, when it exists but was not
};

class OnlineRefitter final : public RouterObserver {
 public:
  // `router` must outlive the refitter; the refitter subscribes to it. INVALID_ARGUMENT for bad
  // options (non-positive window or window size, negative interval, minimum or max_iterations
  // below 1, negative tolerance, a share outside (0, 1], a bound outside (0, 2], a state folder
  // that cannot be created). Does not start the background thread.
  static absl::StatusOr<std::unique_ptr<OnlineRefitter>> Create(RefitOptions options, Router* router);
  ~OnlineRefitter() override;  // Stop()s and unsubscribes

  OnlineRefitter(const OnlineRefitter&) = delete;
  OnlineRefitter& operator=(const OnlineRefitter&) = delete;

  // Offers one routed request's transformed signature (unit vector of the transform in service) to
  // the window, on behalf of `client` (empty: an anonymous client). A signature of another
  // dimension than the window's (a reload changed the transform) restarts the window.
  void Observe(absl::Span<const float> signature, absl::string_view client);

  // Starts the background thread (periodic refits and pool reconciliation); idempotent. The
  // thread runs at SCHED_IDLE (nice 19 where refused), so fits yield the CPU to routing threads.
  void Start();
  // Stops and joins the thread; a refit in progress finishes first. Idempotent.
  void Stop();

  // One refit now, in the calling thread (serialised with the background one). OK also when the
  // refit was skipped for lack of data; the stats tell which.
  absl::Status RefitNow();

  // Pool changes, refitted at once in the calling thread (the background thread does the same
  // on its own after the router announced a change). OnWorkerAdded: FAILED_PRECONDITION when the
  // worker is unknown or draining, or when the window is too small to give it a zone (a later
  // refit retries; the worker gets traffic only through fallbacks meanwhile). OnWorkerRemoved:
  // FAILED_PRECONDITION when the worker is still active; with too small a window the worker's row
  // is just dropped and the nearest remaining zones absorb its traffic.
  absl::Status OnWorkerAdded(const std::string& worker_id);
  absl::Status OnWorkerRemoved(const std::string& worker_id);

  // Empties the window.
  void ResetWindow();

  RefitStats stats() const;

  // RouterObserver.
  void OnSignatureRouted(const RoutedSignature& routed) override;
  void OnPoolChanged(const PoolChange& change) override;
  void OnCentroidsInstalled(const CentroidInstall& install) override;

  // state_dir + "/centroids.json".
  static std::string StatePath(const std::string& state_dir);

  // The centroids to start with: the persisted state when it exists, loads, and has the same
  // transform (SameTransform) as the configured artifact (or no artifact is configured); otherwise
  // the configured artifact. Rows of the state naming workers outside `worker_ids` are dropped
  // (empty `worker_ids`: keep all); a state left with no rows is not used. Either path may be
  // empty. Errors: the configured artifact's load error when the state is not used; NOT_FOUND when
  // neither is given or present.
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
  // A client's admission account (fair share of the window).
  struct ClientBucket {
    double tokens = 0;
    absl::Time refilled_at;
    absl::Time last_admitted;
  };
  // What a refit fits: the target workers (kept rows first, then workers without a row), the
  // warm-start rows and the window's points.
  struct RefitPlan;

  absl::Status Refit(bool pool_change) ABSL_LOCKS_EXCLUDED(fit_mu_);
  // One refit: reconcile rows with the active workers, fit, align, bound, install, persist.
  absl::Status RefitLocked(bool pool_change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  absl::StatusOr<RefitPlan> PlanRefit(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  // k-means on the plan's points, warm-started and aligned to the plan's targets.
  absl::StatusOr<std::vector<float>> FitAligned(const RefitPlan& plan, RefitOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  // Applies max_step_distance / max_drift_distance to `rows` (the plan's targets, in order).
  void BoundMovement(const RefitPlan& plan, std::vector<float>* rows, RefitOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  // Copies the newest signatures younger than the window (at most max_window_signatures) into
  // `points`, oldest first; sets `dim` to the window's dimension; returns how many.
  int SnapshotWindow(absl::Time now, std::vector<float>* points, int* dim) ABSL_LOCKS_EXCLUDED(window_mu_);
  // Whether `client` may add one more signature now (its fair share).
  bool AdmitClient(absl::string_view client, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  // Stats bookkeeping; each returns the status the refit reports to its caller.
  absl::Status RecordFailure(const absl::Status& status, RefitOutcome outcome) ABSL_LOCKS_EXCLUDED(stats_mu_);
  absl::Status RecordSkip(const std::string& why, RefitOutcome outcome) ABSL_LOCKS_EXCLUDED(stats_mu_);
  absl::Time Now() const { return options_.clock ? options_.clock() : absl::Now(); }
  void RunBackground() ABSL_LOCKS_EXCLUDED(thread_mu_);

  const RefitOptions options_;
  Router* const router_;

  // Serialises refits (background thread, RefitNow, pool changes).
  absl::Mutex fit_mu_;
  // Calibrated anchor rows by worker (the last non-refit install; a worker that got its first zone
  // from a refit is anchored there). Its own mutex: installs by others update it from inside the
  // router's notification, where fit_mu_ may be held by a refit waiting to install.
  absl::Mutex anchors_mu_;
  absl::flat_hash_map<std::string, std::vector<float>> anchors_ ABSL_GUARDED_BY(anchors_mu_);

  // Installs by anyone else than this refitter; a refit that started before one is discarded.
  std::atomic<uint64_t> external_installs_{0};

  mutable absl::Mutex window_mu_;
  int window_dim_ ABSL_GUARDED_BY(window_mu_) = 0;
  std::vector<std::shared_ptr<Chunk>> chunks_ ABSL_GUARDED_BY(window_mu_);  // oldest first
  int64_t window_rows_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t observed_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t sampled_out_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t client_limited_ ABSL_GUARDED_BY(window_mu_) = 0;
  // Admission token bucket (see RefitOptions::max_window_signatures); starts full.
  double admission_tokens_ ABSL_GUARDED_BY(window_mu_) = -1;  // < 0: not started
  absl::Time admission_refilled_at_ ABSL_GUARDED_BY(window_mu_);
  absl::flat_hash_map<std::string, ClientBucket> clients_ ABSL_GUARDED_BY(window_mu_);
  int64_t active_clients_ ABSL_GUARDED_BY(window_mu_) = 0;
  absl::Time clients_counted_at_ ABSL_GUARDED_BY(window_mu_) = absl::InfinitePast();
  // An evicted chunk kept for reuse, so a full chunk does not cost an allocation and zero-fill of
  // kChunkRows * dim floats on the routing thread.
  std::shared_ptr<Chunk> spare_chunk_ ABSL_GUARDED_BY(window_mu_);

  mutable absl::Mutex stats_mu_;
  RefitStats stats_ ABSL_GUARDED_BY(stats_mu_);

  // The background thread: started and joined under lifecycle_mu_, woken by thread_cv_ for
  // shutdown and for pool changes.
  absl::Mutex lifecycle_mu_ ABSL_ACQUIRED_BEFORE(thread_mu_);
  std::thread thread_ ABSL_GUARDED_BY(lifecycle_mu_);
  absl::Mutex thread_mu_;
  absl::CondVar thread_cv_;
  bool stopping_ ABSL_GUARDED_BY(thread_mu_) = false;
  bool pool_changed_ ABSL_GUARDED_BY(thread_mu_) = false;
};

}  // namespace eldr

#endif  // ELDR_REFIT_REFIT_H_
