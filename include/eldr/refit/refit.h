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
// Admission to the window is bounded twice: a token bucket of the window's capacity per window
// (under sustained traffic the window is an even sample of the whole window, not its newest
// fraction of a second), and a fair share per client (RouteInput::client): while n clients are
// active, one client may fill at most 1/n of the window (and never more than max_client_share),
// so a single caller cannot replace everyone else's traffic with its own. The capacity is
// max_window_signatures, or fewer when max_window_bytes holds fewer signatures of the size the
// window's signatures have on average (RefitStats::window_capacity).
//
// Storage (src/refit/signature_chunk.h): each admitted signature is kept in IEEE half precision
// under an exact power-of-two row scale (every entry within 2^-11 relative of the fp32 value,
// entries below 2^-28 of the row's largest within 2^-39 of it absolutely), densely or as a bitmap
// of its non-zero entries when that is smaller, in chunks of at most 256 KiB. The chunks the
// window holds (a recycled spare included) never exceed max_window_bytes: opening a chunk beyond
// it evicts the oldest signatures first. A fit reads the window in blocks decoded to fp32 (at most
// 4 MiB of scratch), never as a whole fp32 matrix.
//
// Persistence: after every installed refit the artifact is written atomically to
// StatePath(state_dir), and LoadStartupCentroids prefers it at start over the configured artifact
// when both describe the same transform, so a restart keeps what was learned.
//
// Thread-safety: every method may be called from any thread. Observe takes one short mutex and
// encodes an admitted signature into a preallocated chunk (1-3 us for 48 x 128 with AVX-512 or
// AVX2; chunks are recycled, so the routing thread does not allocate or zero-fill in steady state); refits are
// serialised among themselves and never hold that mutex while fitting. A fit pins the chunks it reads; chunks the
// window evicts meanwhile are freed when the fit ends (so memory may exceed max_window_bytes by the signatures admitted
// during one fit).
#ifndef ELDR_REFIT_REFIT_H_
#define ELDR_REFIT_REFIT_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/router.h"

namespace eldr {

namespace refit_internal {
class SignatureChunk;
class SignatureRows;
struct EncodeScratch;
struct EncodedSignature;
}  // namespace refit_internal

// The smallest RefitOptions::max_window_bytes accepted.
inline constexpr int64_t kMinRefitWindowBytes = int64_t{1} << 20;

// Why the install guard kept the centroids in service (RefitOutcome::Kind::kRefused).
enum class RefitRefusal {
  kNone,
  kImbalance,  // the candidate's predicted work imbalance exceeds the current set's by more than allowed
  kChurn,      // more of the window's signatures would change worker than max_churn allows
  kLocality,   // the candidate predicts neither a locality nor an experts-per-step gain (see RefitOptions)
};
// "none", "imbalance", "churn", "locality"
absl::string_view RefitRefusalLabel(RefitRefusal refusal);

// The install guard's prediction for one centroid set on the refit window: every window signature
// carries its weight (the decode work it stood for) to its nearest row, or, with the router's band
// width tau > 0, spread over the rows of its band (score >= best - tau) in proportion to their
// workers' capacity, as the router's least-loaded pick within the band spreads it in expectation.
struct SetPrediction {
  // Max over mean of the zones' work shares, each zone's summed weight divided by its worker's
  // capacity weight: 1 is perfectly balanced; 2 means one worker gets twice the mean share.
  double imbalance = 0;
  // Weighted mean cosine similarity of each signature to its nearest row.
  double locality = 0;
  // Predicted distinct experts per layer that one decode step of a worker loads, averaged over
  // the zones by their work (0 when not predicted: PredictionModel::experts_per_layer 0). A zone's
  // batch draws PredictionModel::expert_picks experts per layer from the mix of its signatures'
  // squared entries (each signature's share of that layer's picks, weighted by its work and, with
  // a band, spread as the work is); a column drawn with probability p over the picks is loaded
  // with probability 1 - exp(-picks * p). The cost that locality is for: a decode step's time
  // grows with the distinct experts it loads.
  double experts_per_step = 0;
};

// How PredictSet models the router and the decode steps.
struct PredictionModel {
  // The router's band width tau: a signature's work spreads over the rows within tau of its best,
  // by capacity, as the least-loaded pick spreads it (0: nearest row only).
  double band = 0;
  // Columns per layer of the signatures (the calibrated experts per layer E; rows are
  // [layer][expert]); 0: experts_per_step is not predicted.
  int experts_per_layer = 0;
  // Expert picks per layer in one decode step of one worker: sequences per step times the model's
  // experts per token (see RefitOptions::expert_picks).
  double expert_picks = 128;
};

// What one refit did, for the owner's logs (RefitOptions::on_refit).
struct RefitOutcome {
  // kRefused: a fit succeeded but the install guard kept the set in service (`refusal` says why).
  enum class Kind { kInstalled, kSkipped, kFailed, kRefused } kind = Kind::kSkipped;
  std::string reason;          // why it was skipped, failed or refused; empty when installed
  uint64_t generation = 0;     // kInstalled: the router's new generation
  int rows = 0;                // kInstalled: centroid rows now in service
  int window_signatures = 0;   // signatures the fit used
  int iterations = 0;          // k-means iterations of the fit (0 when there was none)
  bool converged = false;      // the fit stopped at its tolerance
  int rows_step_bounded = 0;   // rows the per-refit bound held back
  int rows_drift_bounded = 0;  // rows the total-drift bound held back
  double seconds = 0;          // wall time of the refit
  bool pool_change = false;    // triggered by a pool change (else periodic or RefitNow)
  // The install guard (when a fit ran and the set in service has rows of active workers; else
  // `guarded` is false and the figures are 0). current: the rows in service of the workers that
  // stay (its imbalance over every target worker: one added without a row would get no work);
  // candidate: the fitted, aligned and bounded rows. churn: the fraction of the window's
  // signatures that the current rows place firmly (nearest row ahead of the next by more than the
  // router's band width tau; the others the router already spreads by load) and whose nearest
  // worker the candidate changes.
  bool guarded = false;
  SetPrediction current;
  SetPrediction candidate;
  double churn = 0;
  bool churn_exempt = false;  // a pool-change refit: churn and locality are reported but not bounded
  // Beyond max_churn the rows move only this fraction of their fitted rotation (1/2, 1/4, 1/8:
  // the largest within both bounds); 1 when not limited. fitted_churn: the churn of the full fit
  // when it was limited.
  double movement_fraction = 1;
  double fitted_churn = 0;
  // The guard's reason to refuse (kRefused; or kInstalled after a pool change, when only the rows
  // of workers that left were dropped instead of the refused fit).
  RefitRefusal refusal = RefitRefusal::kNone;
  double window_weight = 0;  // summed weight of the signatures the fit used
};

struct RefitOptions {
  // Signatures older than this leave the window.
  absl::Duration window = absl::Seconds(60);
  // Time between periodic refits; zero or infinite: no periodic refit (pool changes and RefitNow
  // still refit).
  absl::Duration interval = absl::Seconds(10);
  // Signatures kept at most, and the tokens of the admission bucket, refilled at this many per
  // `window` (fewer when max_window_bytes holds fewer).
  int max_window_signatures = 4096;
  // Bytes the window's storage may hold (at least kMinRefitWindowBytes). The default holds about
  // 1,600 dense 48 x 128 signatures (12 KiB each in half precision) or all 4,096 of a sparser kind
  // (bitmap rows: a 48 x 128 signature with a quarter of its entries non-zero takes about 3.8 KiB),
  // and keeps the daemon with refit on within about 64 MB (docs/benchmarks.md). Signatures so large
  // that one chunk of them exceeds the budget are never admitted (counted as sampled out).
  int64_t max_window_bytes = int64_t{20} << 20;
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
  // Decode-work weights. A signature routed by the router (OnSignatureRouted) and admitted to the
  // window waits, pending, until its lease ends (OnLeaseEnded), then joins the window with the
  // weight of the decode work it caused:
  //  - Complete reported output tokens: that many;
  //  - Complete without tokens: the lease's hold seconds times the decode rate, the tokens per
  //    second of the leases that reported both (a running ratio that forgets with a half-life of
  //    about 180 leases), or default_tokens_per_second until one did;
  //  - the lease expired, was evicted or its worker removed: default_output_tokens (0: the
  //    signature is dropped instead).
  // A weight is at least 1. Signatures offered through Observe (no lease: the cluster's shared
  // window, the simulator, tools) join at once, weighted by the mean of the weights measured so
  // far (default_output_tokens before any, or 1 when that is 0), unless a weight is given.
  double default_output_tokens = 256;
  double default_tokens_per_second = 50;
  // Pending signatures kept at most, by count and by bytes of their encoded rows; beyond either
  // the oldest pending signature is dropped (RefitStats::pending_dropped).
  int max_pending_signatures = 4096;
  int64_t max_pending_bytes = int64_t{8} << 20;
  // The install guard (see SetPrediction): a fitted set is installed only when its predicted
  // imbalance is at most the current set's plus max_imbalance_increase, and when at most
  // max_churn of the window's signatures change their nearest worker (RefitOutcome::churn: firmly
  // placed signatures only; a refit triggered by, or
  // reconciling, a pool change is exempt from the churn bound: moving zones is what it is for).
  // Beyond max_churn every row is first moved only part of its way (half, a quarter, an eighth of
  // its rotation from the row in service; the largest part within both bounds is installed).
  // Otherwise the set in service stays (RefitOutcome::Kind::kRefused). max_churn 1: no bound.
  double max_imbalance_increase = 0.05;
  double max_churn = 0.5;
  // The locality bound: a fitted set is installed only when it predicts a gain in locality by
  // one of two measures, else it is refused (RefitRefusal::kLocality): its predicted mean best
  // similarity (SetPrediction::locality) is at most max_locality_decrease below the current
  // set's, or it predicts at least min_experts_gain (a fraction) fewer experts per decode step
  // (SetPrediction::experts_per_step). A refit that evens the work out by cutting zones through
  // groups of similar requests, or only moves zones around, costs more experts per step than the
  // load-gap guard's spills do: on a skewed synthetic mix such refits lost 1-3 points of median
  // TPOT against the calibrated set, and every one of them failed both tests. A refit that follows
  // a shift of the traffic away from what the centroids were calibrated on passes one or the other
  // (docs/evaluation.md, "The locality bound"). Exempt: a refit that reconciles a pool change, and
  // one after the workers' capacity weights changed from those of the last install (resizing
  // zones costs locality by design). max_locality_decrease in [0, 1] (1: the bound is off);
  // min_experts_gain in [-1, 1) (-1: the bound is off; negative values accept that fraction more).
  double max_locality_decrease = 0;
  double min_experts_gain = 0.005;
  // PredictionModel::expert_picks of the guard: sequences in one worker's decode step times the
  // model's experts per token (16 x 8 by default; DeepSeek-V2-Lite routes 6 per token, Mixtral 2).
  // Only the comparison of two sets uses it; > 0.
  double expert_picks = 128;
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
  int64_t window_bytes = 0;          // gauge: bytes of the window's storage now (<= max_window_bytes)
  // gauge: signatures the window admits per window length now: max_window_signatures, or what
  // max_window_bytes holds at the window's mean signature size when that is fewer
  int64_t window_capacity = 0;
  int64_t window_clients = 0;  // gauge: clients with signatures admitted in the last window
  uint64_t signatures_observed = 0;
  uint64_t signatures_sampled_out = 0;     // not admitted: the window's token bucket was empty
  uint64_t signatures_client_limited = 0;  // not admitted: their client had used its share
  // Decode-work weights: signatures that joined the window weighted by the output tokens Complete
  // reported, by hold time, or by default_output_tokens (lease not completed); offered without a
  // lease (Observe); dropped from pending (bound) or because their lease ended unmeasured with
  // default_output_tokens 0.
  uint64_t weights_output_tokens = 0;  // (Observe with a weight counts here too)
  uint64_t weights_hold_time = 0;
  uint64_t weights_default = 0;
  uint64_t weights_unleased = 0;
  uint64_t pending_dropped = 0;
  int64_t pending_signatures = 0;       // gauge: admitted signatures waiting for their lease to end
  int64_t pending_bytes = 0;            // gauge
  double window_weight = 0;             // gauge: summed weight of the window's signatures
  double decode_tokens_per_second = 0;  // gauge: the hold-time rule's rate now
  // The install guard: refusals by reason, and the figures of the last guarded refit.
  uint64_t refits_refused_imbalance = 0;
  uint64_t refits_refused_churn = 0;
  uint64_t refits_refused_locality = 0;
  uint64_t refits_churn_limited = 0;  // installed with the movement limited by max_churn
  // A refit has been guarded yet (the figures below are set). The figures are those of the last
  // guarded refit whose outcome (installed, refused, skipped, failed) is counted.
  bool guarded = false;
  SetPrediction current_prediction;
  SetPrediction candidate_prediction;
  double last_churn = 0;
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
  // options (non-positive window or window size, a byte budget below kMinRefitWindowBytes,
  // negative interval, minimum or max_iterations below 1, negative tolerance, a share outside
  // (0, 1], a bound outside (0, 2], a state folder that cannot be created). Does not start the background thread.
  static absl::StatusOr<std::unique_ptr<OnlineRefitter>> Create(RefitOptions options, Router* router);
  ~OnlineRefitter() override;  // Stop()s and unsubscribes

  OnlineRefitter(const OnlineRefitter&) = delete;
  OnlineRefitter& operator=(const OnlineRefitter&) = delete;

  // Offers one request's transformed signature (unit vector of the transform in service) to the
  // window, on behalf of `client` (empty: an anonymous client), joining at once (no lease to wait
  // for) with `weight` (positive; without one, the unleased default of RefitOptions). A signature
  // of another dimension than the window's (a reload changed the transform) restarts the window.
  void Observe(absl::Span<const float> signature, absl::string_view client);
  void Observe(absl::Span<const float> signature, absl::string_view client, double weight);

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

  // Empties the window and the pending signatures.
  void ResetWindow();

  // The install guard's figures for `rows` (k unit rows of points.dim()) on `points` weighted by
  // `weights` (empty: 1 each), with `capacity` (k weights; empty: 1 each); `nearest`, when not
  // null, receives each point's nearest row, and `margin` how far its nearest row's similarity
  // leads the next one's (2 with one row). `model`: the router's band and the decode step's
  // geometry (PredictionModel). Decodes each block of points once, for the scores and for the
  // experts per step.
  // Exposed for tests and tools.
  static SetPrediction PredictSet(const PointRows& points, absl::Span<const double> weights,
                                  absl::Span<const float> rows, int k, absl::Span<const double> capacity,
                                  const PredictionModel& model, std::vector<int>* nearest = nullptr,
                                  std::vector<double>* margin = nullptr);

  RefitStats stats() const;

  // RouterObserver.
  // Admits the signature (as Observe) and keeps it pending until its lease ends.
  void OnSignatureRouted(const RoutedSignature& routed) override;
  // The pending signature of the lease joins the window with its decode-work weight.
  void OnLeaseEnded(const LeaseEnd& ended) override;
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

  // The window is a queue of append-only chunks (refit_internal::SignatureChunk); only the newest
  // is appended to, and rows once appended never change, so a snapshot copies the chunk pointers
  // and row ranges under window_mu_ and a fit decodes the rows outside it: Observe never waits for
  // a fit, and nothing copies the whole window. The oldest rows are evicted one at a time (the
  // front chunk's first front_skip_ rows are gone); a chunk is released once all its rows are.
  using Chunk = refit_internal::SignatureChunk;
  // A client's admission account (fair share of the window).
  struct ClientBucket {
    double tokens = 0;
    absl::Time refilled_at;
    absl::Time last_admitted;
  };
  // What a refit fits: the target workers (kept rows first, then workers without a row), the
  // warm-start rows and the window's points.
  struct RefitPlan;
  // An admitted signature waiting for its lease to end.
  struct PendingSignature {
    std::vector<uint16_t> elements;
    uint8_t encoding = 0;  // refit_internal::RowEncoding
    int exponent = 0;
    int dim = 0;
    absl::Time routed_at;
  };
  // How a joining signature's weight was determined (RefitStats counters).
  enum class WeightSource { kOutputTokens, kHoldTime, kDefault, kUnleased };

  absl::Status Refit(bool pool_change) ABSL_LOCKS_EXCLUDED(fit_mu_);
  // The (worker, capacity weight) pairs of the last installed refit's workers, sorted; before the
  // first install, those of the first guarded refit (empty until then). The locality bound exempts
  // a refit whose workers' capacities differ (GuardInstall).
  std::vector<std::pair<std::string, double>> capacities_at_install_ ABSL_GUARDED_BY(fit_mu_);
  // The plan's first `count` targets with their capacity weights, sorted by worker.
  static std::vector<std::pair<std::string, double>> SortedCapacities(const RefitPlan& plan, size_t count);
  // One refit: reconcile rows with the active workers, fit, align, bound, install, persist.
  absl::Status RefitLocked(bool pool_change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  absl::StatusOr<RefitPlan> PlanRefit(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  // k-means on the plan's points, warm-started and aligned to the plan's targets.
  absl::StatusOr<std::vector<float>> FitAligned(const RefitPlan& plan, RefitOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  // Applies max_step_distance / max_drift_distance to `rows` (the plan's targets, in order).
  void BoundMovement(const RefitPlan& plan, std::vector<float>* rows, RefitOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
  // The newest signatures younger than the window (at most max_window_signatures), oldest first,
  // of the window's dimension.
  refit_internal::SignatureRows SnapshotWindow(absl::Time now) ABSL_LOCKS_EXCLUDED(window_mu_);
  // Window bookkeeping, all under window_mu_; chunks that leave the window go to `released`
  // (freed by the caller once the lock is released).
  void RestartWindow(int dim, std::vector<std::shared_ptr<Chunk>>* released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  void EvictOldestRow(std::vector<std::shared_ptr<Chunk>>* released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  void OpenChunk(std::vector<std::shared_ptr<Chunk>>* released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  void UpdateWindowCapacity(size_t last_elements) ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  int64_t WindowBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  // Whether `client` may add one more signature now (its fair share).
  bool AdmitClient(absl::string_view client, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  // Observation bookkeeping and admission (token bucket, then client share) of a dim-entry
  // signature; restarts the window for a new dimension. True: admitted (a token taken).
  bool AdmitLocked(int dim, absl::string_view client, absl::Time now, std::vector<std::shared_ptr<Chunk>>* released)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  // Appends an encoded signature of window_dim_ entries with `weight` at `now`, then evicts by age
  // and count.
  void AppendLocked(const refit_internal::EncodedSignature& encoded, float weight, absl::Time now,
                    std::vector<std::shared_ptr<Chunk>>* released) ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  // Drops the oldest pending signature (counted).
  void DropOldestPendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  void ClearPendingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  // The weight of a signature offered without a lease.
  double UnleasedWeightLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  void CountWeightLocked(WeightSource source) ABSL_EXCLUSIVE_LOCKS_REQUIRED(window_mu_);
  // Stats bookkeeping; each returns the status the refit reports to its caller.
  absl::Status RecordFailure(const absl::Status& status, RefitOutcome outcome) ABSL_LOCKS_EXCLUDED(stats_mu_);
  absl::Status RecordSkip(const std::string& why, RefitOutcome outcome) ABSL_LOCKS_EXCLUDED(stats_mu_);
  absl::Status RecordRefusal(RefitRefusal refusal, RefitOutcome outcome) ABSL_LOCKS_EXCLUDED(stats_mu_);
  // Counts a refusal and sets the outcome's refusal and reason.
  void NoteRefusal(RefitRefusal refusal, RefitOutcome* outcome) ABSL_LOCKS_EXCLUDED(stats_mu_);
  // Publishes a guarded outcome's figures into the stats. Called under the same lock as the
  // outcome's counter, so a reader never sees a refit's figures before its installation, refusal,
  // skip or failure is counted.
  void PublishGuardFiguresLocked(const RefitOutcome& outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(stats_mu_);
  // The install guard: fills the outcome's predictions and churn for `rows` (the plan's targets,
  // in order) against the kept rows in service; the reason to refuse them, if any. It publishes
  // nothing: the Record* functions publish the figures with the outcome.
  // Beyond the churn bound it first limits the movement (`rows` then holds the limited rows).
  std::optional<RefitRefusal> GuardInstall(const RefitPlan& plan, std::vector<float>* rows, bool pool_change,
                                           RefitOutcome* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(fit_mu_);
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
  // Chunk geometry for window_dim_: halves per chunk, its footprint, and how many fit the budget.
  size_t chunk_elements_ ABSL_GUARDED_BY(window_mu_) = 0;
  size_t chunk_bytes_ ABSL_GUARDED_BY(window_mu_) = 0;
  size_t max_chunks_ ABSL_GUARDED_BY(window_mu_) = 0;
  std::vector<std::shared_ptr<Chunk>> chunks_ ABSL_GUARDED_BY(window_mu_);  // oldest first
  int front_skip_ ABSL_GUARDED_BY(window_mu_) = 0;  // evicted rows at the start of chunks_.front()
  int64_t window_rows_ ABSL_GUARDED_BY(window_mu_) = 0;
  int64_t window_elements_ ABSL_GUARDED_BY(window_mu_) = 0;  // halves the window's rows occupy
  // Signatures admitted per window (RefitStats::window_capacity).
  double window_capacity_ ABSL_GUARDED_BY(window_mu_) = 0;
  std::unique_ptr<refit_internal::EncodeScratch> encode_scratch_ ABSL_GUARDED_BY(window_mu_);
  uint64_t observed_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t sampled_out_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t client_limited_ ABSL_GUARDED_BY(window_mu_) = 0;
  // Admission token bucket (see RefitOptions::max_window_signatures); starts full.
  double admission_tokens_ ABSL_GUARDED_BY(window_mu_) = -1;  // < 0: not started
  absl::Time admission_refilled_at_ ABSL_GUARDED_BY(window_mu_);
  absl::flat_hash_map<std::string, ClientBucket> clients_ ABSL_GUARDED_BY(window_mu_);
  int64_t active_clients_ ABSL_GUARDED_BY(window_mu_) = 0;
  absl::Time clients_counted_at_ ABSL_GUARDED_BY(window_mu_) = absl::InfinitePast();
  // An evicted chunk kept for reuse, so opening a chunk does not cost the routing thread an
  // allocation and zero-fill of a whole chunk.
  std::shared_ptr<Chunk> spare_chunk_ ABSL_GUARDED_BY(window_mu_);
  double window_weight_ ABSL_GUARDED_BY(window_mu_) = 0;  // summed weight of the window's rows

  // Pending signatures by lease id, and their lease ids in admission order (ids of signatures
  // that left already are skipped lazily; the queue is compacted when mostly such ids).
  absl::flat_hash_map<uint64_t, PendingSignature> pending_ ABSL_GUARDED_BY(window_mu_);
  std::deque<uint64_t> pending_order_ ABSL_GUARDED_BY(window_mu_);
  int64_t pending_bytes_ ABSL_GUARDED_BY(window_mu_) = 0;
  std::vector<std::vector<uint16_t>> pending_buffers_ ABSL_GUARDED_BY(window_mu_);  // recycled
  // The hold-time rule's running ratio (decayed sums of tokens and seconds), and the decayed sum
  // and count of measured weights (the unleased default).
  double rate_tokens_ ABSL_GUARDED_BY(window_mu_) = 0;
  double rate_seconds_ ABSL_GUARDED_BY(window_mu_) = 0;
  double measured_weight_sum_ ABSL_GUARDED_BY(window_mu_) = 0;
  double measured_weight_count_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t weights_output_tokens_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t weights_hold_time_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t weights_default_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t weights_unleased_ ABSL_GUARDED_BY(window_mu_) = 0;
  uint64_t pending_dropped_ ABSL_GUARDED_BY(window_mu_) = 0;

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
