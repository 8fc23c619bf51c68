// The routing facade: the one object a front end (gRPC server, simulator, tools) talks to.
//
// Route: transform the signature, score it against the current centroid set, read the workers'
// effective loads, let the policy pick, take a lease. Complete: release the lease.
//
// Every change of state goes through one method that says what it did (UpsertWorker: created or
// updated; RemoveWorker: the leases dropped; InstallCentroids: the new generation) and is announced
// to the registered RouterObservers, so components react to changes instead of polling for them.
// InstallCentroids is the one door for centroids: startup files, reloads, refits and every later
// source install through it, and observers see each install and each refusal with its source.
//
// Thread-safety: every method is safe to call from many threads at once. The centroid set
// (transform + index + row -> worker mapping) is immutable and swapped atomically by
// InstallCentroids: a Route that started before the swap finishes on the old set, later ones use
// the new set, and no Route ever waits for a set to be built. Worker table and loads are guarded
// by a mutex that is held only for the short decision itself, never for transform or scoring.
// Mutations (workers, centroids, health) are serialised among themselves, and their observer
// notifications are delivered in the order the mutations happened (see RouterObserver).
#ifndef ELDR_CORE_ROUTER_H_
#define ELDR_CORE_ROUTER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/centroid_index.h"
#include "eldr/core/policy.h"
#include "eldr/core/signature.h"
#include "eldr/core/worker_load.h"

namespace eldr {

struct WorkerSpec {
  std::string id;            // unique; see ValidateWorkerSpec
  std::string address;       // host:port the caller sends the KV handoff to
  double capacity = 1.0;     // capacity weight: load is divided by it, clusters scale with it
  int64_t max_inflight = 0;  // 0: no limit; at the limit a worker leaves the band (overload guard)
  std::string metrics_url;   // the worker's Prometheus page for load scraping; empty: none
};

// Limits of ValidateWorkerSpec.
inline constexpr size_t kMaxWorkerIdBytes = 253;       // a DNS name / Kubernetes pod name
inline constexpr size_t kMaxWorkerAddressBytes = 270;  // a DNS name, ':' and a port
inline constexpr size_t kMaxMetricsUrlBytes = 2048;
inline constexpr double kMinWorkerCapacity = 1e-3;
inline constexpr double kMaxWorkerCapacity = 1e6;
inline constexpr int64_t kMaxWorkerInflightLimit = 1'000'000'000;

// The one set of rules for a worker, used by the router, the config parser and every front end:
//  - id: 1 to kMaxWorkerIdBytes of letters, digits and . _ - : @ / +
//  - address: host:port, host a DNS name (letters, digits, '-', '_', '.'), a dotted IPv4 address
//    or a bracketed IPv6 address; port 1-65535. No spaces, control characters or schemes;
//  - capacity: finite, in [kMinWorkerCapacity, kMaxWorkerCapacity];
//  - max_inflight: in [0, kMaxWorkerInflightLimit];
//  - metrics_url: empty, or at most kMaxMetricsUrlBytes of printable ASCII without spaces
//    (the load scraper checks its scheme and form).
// INVALID_ARGUMENT (RejectReason kMalformed, or kOutOfRange for numbers) naming the worker and field.
absl::Status ValidateWorkerSpec(const WorkerSpec& spec);

enum class WorkerState { kActive, kDraining };

struct RouterOptions {
  PolicyKind policy = PolicyKind::kEldr;
  double tau = 0.1;                        // locality band width, in [0, 1]
  uint64_t seed = 0x5eed;                  // tie-breaking and sampling generator seed
  TieBreak tie_break = TieBreak::kRandom;  // among equally loaded workers (policy.h)
  // eldr's load-gap guard (PolicyInput::max_load_gap): when the band's least loaded worker carries
  // more than this many in-flight requests per unit of capacity above the routable workers' mean,
  // the request goes to the least loaded one (fallback "load_gap"). Finite, >= 0; 0: off.
  double max_load_gap = 0;
  LoadOptions load;            // lease TTL, snapshot staleness
  CentroidIndexOptions index;  // exact vs FAISS crossover and its parameters
  // Live leases at most (>= 1). At the limit a new route first releases the oldest live lease of
  // the pool (counted in RouterState::leases_evicted_total), so a caller that never completes
  // cannot grow the router's memory without bound and routing goes on.
  int64_t max_live_leases = 1'000'000;
};

// Where a centroid set came from: a closed set, used as a log field and a metric label.
enum class CentroidSource {
  kApi,        // an in-process caller (tools, simulator, tests)
  kStartup,    // the configured artifact at start
  kStateDir,   // the persisted refit state at start
  kSignal,     // SIGHUP
  kAdmin,      // the ReloadCentroids admin RPC
  kFileWatch,  // the watched artifact file changed
  kRefit,      // online refit
  kDiscovery,  // rows re-fitted to a discovered pool (a new pod takes the row of a gone one)
  kCluster,    // the generation the cluster's refit leader published (eldr/cluster, via Redis)
};
absl::string_view CentroidSourceLabel(CentroidSource source);  // "api", "startup", ...
absl::Span<const CentroidSource> AllCentroidSources();

// What Route is asked.
struct RouteInput {
  const SignatureInput* signature = nullptr;  // null: no signature (eldr falls back to jsq)
  absl::Time now;
  // Who asked (a peer address or an authenticated identity), passed to observers for per-client
  // accounting; may be empty. Not used by the decision.
  absl::string_view client;
  // Worker ids this route must not pick (a caller that failed to reach one re-routes without it).
  // Ids of no worker are ignored. Every eligible worker excluded: UNAVAILABLE.
  absl::Span<const std::string> exclude_workers;
  // Decide with this policy instead of RouterOptions::policy (the baseline arm of an A/B split).
  // The leases and loads are the same for every policy.
  std::optional<PolicyKind> policy;
};

// Limits on RouteInput::exclude_workers, checked by Route (INVALID_ARGUMENT, reason kOutOfRange).
inline constexpr size_t kMaxExcludedWorkers = 1024;
// How many leases dropped by RemoveWorker the router remembers, so that their late Complete is
// answered. Each costs about 50 bytes plus its worker id beyond 15 characters: about 1.6 MiB for
// pod names of ~20 characters, 5.5 MiB at most with ids of kMaxWorkerIdBytes.
inline constexpr size_t kRemovedLeasesRemembered = 16384;

struct RouteResult {
  std::string worker_id;
  std::string address;
  uint64_t lease_id = 0;                  // random, unguessable, never 0
  float similarity = 0;                   // best cosine score among eligible candidates (0 without locality)
  int band_size = 0;                      // eligible workers within tau of the best (0 without locality)
  PolicyKind policy = PolicyKind::kEldr;  // the policy that decided (jsq on fallback)
  FallbackReason fallback = FallbackReason::kNone;
  uint64_t centroid_generation = 0;
};

struct WorkerStatus {
  WorkerSpec spec;
  WorkerState state = WorkerState::kActive;
  bool healthy = true;
  bool has_centroid = false;
  WorkerLoad load;
};

struct RouterState {
  PolicyKind policy = PolicyKind::kEldr;
  double tau = 0;
  uint64_t centroid_generation = 0;  // 0: no centroids installed yet
  int centroid_rows = 0;
  std::string index_kind;
  std::vector<WorkerStatus> workers;  // in insertion order
  int64_t live_leases = 0;
  int64_t leases_expired_total = 0;
  int64_t leases_evicted_total = 0;  // released at the max_live_leases limit
  // Completes of leases that RemoveWorker had already dropped (answered with their worker).
  int64_t completes_after_removal_total = 0;
};

// Other router replicas' live leases on one worker (eldr/cluster's shared load): `live` in total,
// and of those `since_snapshot`, the ones each replica acquired after its own last fresh snapshot
// of the worker.
struct PeerLeaseCount {
  int64_t live = 0;
  int64_t since_snapshot = 0;
};

// What a mutation did, as returned to its caller and announced to observers.
enum class PoolChangeKind { kAdded, kUpdated, kDraining, kRemoved, kHealthChanged };
absl::string_view PoolChangeKindLabel(PoolChangeKind kind);  // "added", "updated", ...

struct PoolChange {
  PoolChangeKind kind = PoolChangeKind::kAdded;
  WorkerSpec spec;                           // after the change (kRemoved: as it was)
  WorkerState state = WorkerState::kActive;  // after the change (kRemoved: as it was)
  bool healthy = true;
  int64_t inflight = 0;  // live leases after the change (kRemoved: dropped)
};

struct CentroidInstall {
  uint64_t generation = 0;
  CentroidSource source = CentroidSource::kApi;
  int rows = 0;
  int dim = 0;
  std::string model;
  std::vector<std::string> workers;  // row owners, in row order
  // False when the set has the same transform (SameTransform) as the one it replaced.
  bool transform_changed = true;
};

// How a lease ended (RouterObserver::OnLeaseEnded).
enum class LeaseEndKind {
  kCompleted,      // Complete
  kExpired,        // ExpireLeases: older than the lease TTL
  kEvicted,        // released for a new route at RouterOptions::max_live_leases
  kWorkerRemoved,  // RemoveWorker dropped it
};
absl::string_view LeaseEndKindLabel(LeaseEndKind kind);  // "completed", "expired", ...

// One released lease: what its request cost the worker, as far as the router knows.
struct LeaseEnd {
  uint64_t lease_id = 0;
  std::string worker_id;
  LeaseEndKind kind = LeaseEndKind::kCompleted;
  // kCompleted: CompleteInput::output_tokens (0 when the caller reported none); otherwise 0.
  int64_t output_tokens = 0;
  // From the route that took the lease (RouteInput::now) to its end (CompleteInput::now, or the
  // `now` of ExpireLeases / the route that evicted it, or the wall clock for RemoveWorker); never
  // negative.
  absl::Duration held = absl::ZeroDuration();
  // True unless kind == kCompleted: nobody said how the request ended.
  bool expired = false;
};

// What Complete is told. output_tokens: the tokens the worker generated for the request, when
// the caller knows (0: not reported); negative is INVALID_ARGUMENT. now: when it completed (the
// hold time LeaseEnd::held is measured to it).
struct CompleteInput {
  uint64_t lease_id = 0;
  int64_t output_tokens = 0;
  absl::Time now;
};

// A routed request whose signature the transform accepted.
struct RoutedSignature {
  // The transformed, unit-norm signature; valid during the call only. Built on the first call when
  // the route was scored without it (SignatureScorer's fused path), so an observer that samples
  // signatures pays only for those it takes.
  absl::Span<const float> signature() const { return source != nullptr ? source->Get() : absl::Span<const float>(); }
  int signature_dim = 0;  // signature().size(), known without building it
  absl::string_view worker_id;
  uint64_t lease_id = 0;
  uint64_t centroid_generation = 0;
  absl::string_view client;  // RouteInput::client
  absl::Time at;

  // Where signature() comes from (set by the router).
  class Source {
   public:
    virtual absl::Span<const float> Get() const = 0;

   protected:
    ~Source() = default;
  };
  const Source* source = nullptr;
};

// Subscribers to the router's changes. Every method has an empty default.
//
// Pool and centroid notifications arrive after the change took effect, in the order the changes
// happened, with no router lock held, on the thread that made the change (or on a thread that is
// delivering earlier changes at that moment, which then delivers this one too). A callback may
// read the router and may even mutate it; the change it makes is delivered after the current one.
// It must not add or remove observers, and should hand slow work (a refit) to a thread of its own.
// OnSignatureRouted runs on the routing threads, concurrently, and must neither block nor mutate.
// OnLeaseEnded likewise runs on the data-plane threads (Complete, a Route that evicted a lease,
// ExpireLeases, RemoveWorker), after the lease is released and with no router lock held that
// routing waits on; it must neither block nor mutate. A lease's OnLeaseEnded follows its
// OnSignatureRouted (when it had one) except when the lease was expired or evicted by another
// thread before its route delivered OnSignatureRouted (a TTL or lease limit that small).
class RouterObserver {
 public:
  virtual ~RouterObserver() = default;
  virtual void OnPoolChanged(const PoolChange& /*change*/) {}
  virtual void OnCentroidsInstalled(const CentroidInstall& /*install*/) {}
  // An artifact InstallCentroids refused (the set in service stays). Front ends that refuse an
  // artifact before it reaches the router (unreadable file, parse error) report it the same way
  // through NotifyCentroidsRejected, so one observer sees every refusal.
  virtual void OnCentroidsRejected(CentroidSource /*source*/, const absl::Status& /*status*/) {}
  virtual void OnSignatureRouted(const RoutedSignature& /*routed*/) {}
  virtual void OnLeaseEnded(const LeaseEnd& /*ended*/) {}
};

class Router {
 public:
  static absl::StatusOr<std::unique_ptr<Router>> Create(RouterOptions options, std::vector<WorkerSpec> workers);
  virtual ~Router() = default;

  // Routes one request. Errors: INVALID_ARGUMENT (with a RejectReason) for a malformed signature;
  // UNAVAILABLE when no worker can take the request (empty pool, or every worker draining).
  // A zero signature, or one sent before any centroids are installed, takes the load-balancing
  // fallback (kZeroSignature / kNoCentroids). With every worker unhealthy the route fails open and
  // reports kAllUnhealthy (overriding the policy's own fallback reason).
  virtual absl::StatusOr<RouteResult> Route(const RouteInput& input) = 0;
  absl::StatusOr<RouteResult> Route(const SignatureInput* signature, absl::Time now) {
    RouteInput input;
    input.signature = signature;
    input.now = now;
    return Route(input);
  }
  absl::StatusOr<RouteResult> Route(const SignatureInput* signature) { return Route(signature, absl::Now()); }

  // Releases a lease and returns the id of the worker it was on; observers hear OnLeaseEnded
  // (kCompleted, with input.output_tokens and the hold time to input.now). NOT_FOUND when unknown,
  // already completed, expired or evicted; INVALID_ARGUMENT (kNegativeCount) for negative
  // output_tokens (the lease stays). A lease that RemoveWorker dropped while its request was in
  // flight (a pod deleted under traffic) is not the caller's error: its first Complete, within the
  // last kRemovedLeasesRemembered such leases, answers the removed worker's id and is counted in
  // RouterState::completes_after_removal_total (observers already heard kWorkerRemoved); a second
  // one is NOT_FOUND.
  virtual absl::StatusOr<std::string> Complete(const CompleteInput& input) = 0;
  absl::StatusOr<std::string> Complete(uint64_t lease_id, int64_t output_tokens = 0) {
    CompleteInput input;
    input.lease_id = lease_id;
    input.output_tokens = output_tokens;
    input.now = absl::Now();
    return Complete(input);
  }

  // The one door for centroids. Validates the artifact, maps its rows to workers (by its `workers`
  // names when present, otherwise row i -> i-th worker in insertion order), builds the index and
  // swaps it in; returns the new generation. The cheap checks (artifact, transform, row names
  // against the pool) run before the index is built. Errors: those of ValidateCentroidArtifact and
  // SignatureSpec (INVALID_ARGUMENT with a reason); FAILED_PRECONDITION (kUnknownWorker, or a count
  // mismatch) when the rows do not fit the pool. On error the current set stays in service and
  // observers get OnCentroidsRejected.
  virtual absl::StatusOr<uint64_t> InstallCentroids(const CentroidArtifact& artifact,
                                                    CentroidSource source = CentroidSource::kApi) = 0;
  // The artifact currently in service (with `workers` filled in), or NOT_FOUND.
  virtual absl::StatusOr<CentroidArtifact> CurrentCentroids() const = 0;
  // Tells observers that `source` produced an artifact that never reached InstallCentroids
  // (unreadable, unparsable); see RouterObserver::OnCentroidsRejected.
  virtual void NotifyCentroidsRejected(CentroidSource source, const absl::Status& status) = 0;

  // Adds a worker (kAdded) or updates address/capacity/limit of an existing one (kUpdated; a
  // draining worker that is upserted becomes active again). Errors: those of ValidateWorkerSpec.
  virtual absl::StatusOr<PoolChange> UpsertWorker(const WorkerSpec& spec) = 0;
  // No new routes to the worker; its leases finish normally. NOT_FOUND if unknown.
  virtual absl::StatusOr<PoolChange> DrainWorker(const std::string& id) = 0;
  // Removes the worker and drops its leases (PoolChange::inflight = how many; observers hear
  // OnLeaseEnded, kWorkerRemoved, for each, after the pool change). NOT_FOUND if unknown.
  virtual absl::StatusOr<PoolChange> RemoveWorker(const std::string& id) = 0;
  // Health as seen by a load source (scrape failures); unhealthy workers get no new routes unless
  // every worker is unhealthy (fail open). Observers hear of actual changes only. NOT_FOUND if
  // unknown.
  virtual absl::Status SetWorkerHealthy(const std::string& id, bool healthy) = 0;

  // A worker's load snapshot, received at `now`: ValidateLoadSnapshot's rules; a snapshot dated
  // after `now` (clock skew between hosts) is taken as measured at `now`, so it cannot stay fresh
  // too long and hide the leases acquired after it. An older snapshot than the stored one is
  // ignored (reports can reorder). Errors: INVALID_ARGUMENT with a reason naming the worker;
  // NOT_FOUND (kUnknownWorker) for a worker not in the pool.
  virtual absl::Status ReportLoad(const std::string& id, const LoadSnapshot& snapshot, absl::Time now) = 0;

  // Releases the leases acquired before now - lease_ttl, oldest first, in batches that hold the
  // routing mutex briefly each (routes go on in between); returns how many. Observers hear
  // OnLeaseEnded (kExpired) for each, between batches. The server calls it every second.
  virtual int64_t ExpireLeases(absl::Time now) = 0;

  // Replaces the other replicas' lease counts per worker (ids the pool does not have are ignored;
  // workers absent from `peers` count no peer leases). Effective load then adds, per worker:
  //   - with a fresh snapshot: the peers' `since_snapshot` only. The worker's report already
  //     counts every request that started before it, whichever replica routed it; the peers'
  //     snapshots of the same worker are at most a scrape interval apart from ours, so their
  //     since_snapshot approximates what ours does not include yet;
  //   - without one: the peers' `live` (our own lease count is all we add locally too).
  // The counts added show in WorkerLoad::peer_leases and WorkerLoad::effective (GetState). Not a
  // mutation: no observer hears of it. Holds the routing mutex for O(workers) lookups.
  virtual void SetPeerLeases(const absl::flat_hash_map<std::string, PeerLeaseCount>& peers) = 0;

  virtual RouterState GetState(absl::Time now) const = 0;
  virtual const RouterOptions& options() const = 0;

  // Observers (not owned) must outlive their registration. RemoveObserver returns once no callback
  // of `observer` runs any more. Neither may be called from inside a callback.
  virtual void AddObserver(RouterObserver* observer) = 0;
  virtual void RemoveObserver(RouterObserver* observer) = 0;
};

}  // namespace eldr

#endif  // ELDR_CORE_ROUTER_H_
