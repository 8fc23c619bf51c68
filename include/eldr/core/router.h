// The routing facade: the one object a front end (gRPC server, simulator, tools) talks to.
//
// Route: transform the signature, score it against the current centroid set, read the workers'
// effective loads, let the policy pick, take a lease. Complete: release the lease.
//
// Thread-safety: every method is safe to call from many threads at once. The centroid set
// (transform + index + row -> worker mapping) is immutable and swapped atomically by
// InstallCentroids: a Route that started before the swap finishes on the old set, later ones use
// the new set, and no Route ever waits for a set to be built. Worker table and loads are guarded
// by a mutex that is held only for the short decision itself, never for transform or scoring.
#ifndef ELDR_ROUTER_H_
#define ELDR_ROUTER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/centroid_index.h"
#include "eldr/core/load_tracker.h"
#include "eldr/core/policy.h"
#include "eldr/core/signature.h"

namespace eldr {

struct WorkerSpec {
  std::string id;           // unique, non-empty
  std::string address;      // host:port the caller sends the KV handoff to (opaque to the router)
  double capacity = 1.0;    // capacity weight (> 0): load is divided by it, clusters scale with it
  int64_t max_inflight = 0; // 0: no limit; at the limit a worker leaves the band (overload guard)
  std::string metrics_url;  // the worker's Prometheus page for load scraping; empty: none (opaque to the router)
};

enum class WorkerState { kActive, kDraining };

struct RouterOptions {
  PolicyKind policy = PolicyKind::kEldr;
  double tau = 0.1;                       // locality band width, in [0, 1]
  uint64_t seed = 0x5eed;                 // tie-breaking and sampling generator seed
  LoadTrackerOptions load;                // lease TTL, snapshot staleness
  CentroidIndexOptions index;             // exact vs FAISS crossover and its parameters
  // Called (outside any router lock, on the routing thread) with every accepted, transformed
  // signature and the worker it was routed to; used by online refit to keep its rolling window.
  // The span is valid only during the call (copy it to keep it). May be empty.
  std::function<void(absl::Span<const float> signature, const std::string& worker)> on_signature;
};

struct RouteResult {
  std::string worker_id;
  std::string address;
  uint64_t lease_id = 0;
  float similarity = 0;   // best cosine score among eligible candidates (0 without locality)
  int band_size = 0;      // eligible workers within tau of the best (0 without locality)
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
};

class Router {
 public:
  static absl::StatusOr<std::unique_ptr<Router>> Create(RouterOptions options,
                                                        std::vector<WorkerSpec> workers);
  virtual ~Router() = default;

  // Routes one request. `signature` may be null (no signature: eldr falls back to jsq).
  // Errors: INVALID_ARGUMENT (with a RejectReason) for a malformed signature; UNAVAILABLE when no
  // worker can take the request (empty pool, or every worker draining). A zero signature is not
  // an error: the result says fallback = kZeroSignature.
  // A zero signature, or one sent before any centroids are installed, takes the load-balancing
  // fallback (kZeroSignature / kNoCentroids). With every worker unhealthy the route fails open and
  // reports kAllUnhealthy (overriding the policy's own fallback reason).
  virtual absl::StatusOr<RouteResult> Route(const SignatureInput* signature, absl::Time now) = 0;
  absl::StatusOr<RouteResult> Route(const SignatureInput* signature) { return Route(signature, absl::Now()); }

  // Releases a lease. NOT_FOUND when unknown, already completed or expired.
  virtual absl::Status Complete(uint64_t lease_id) = 0;
  // Complete that also returns the id of the worker whose lease was released (the API's
  // CompleteResponse.worker_id). Same errors.
  virtual absl::StatusOr<std::string> CompleteLease(uint64_t lease_id) = 0;

  // Validates the artifact, maps its rows to workers (by its `workers` names when present,
  // otherwise row i -> i-th worker in insertion order; a count mismatch is FAILED_PRECONDITION
  // saying so), builds the index and swaps it in. On error the current set stays in service.
  virtual absl::Status InstallCentroids(const CentroidArtifact& artifact) = 0;
  // The artifact currently in service (with `workers` filled in), or NOT_FOUND.
  virtual absl::StatusOr<CentroidArtifact> CurrentCentroids() const = 0;

  // Adds a worker or updates address/capacity/limit of an existing one (a draining worker that is
  // upserted becomes active again). INVALID_ARGUMENT for an empty id or capacity <= 0.
  virtual absl::Status UpsertWorker(const WorkerSpec& spec) = 0;
  // No new routes to the worker; its leases finish normally. NOT_FOUND if unknown.
  virtual absl::Status DrainWorker(const std::string& id) = 0;
  // Removes the worker and its leases. NOT_FOUND if unknown.
  virtual absl::Status RemoveWorker(const std::string& id) = 0;
  // Health as seen by a load source (scrape failures); unhealthy workers get no new routes unless
  // every worker is unhealthy (fail open). NOT_FOUND if unknown.
  virtual absl::Status SetWorkerHealthy(const std::string& id, bool healthy) = 0;

  // A worker's load snapshot (see LoadTracker::Report).
  virtual absl::Status ReportLoad(const std::string& id, const LoadSnapshot& snapshot) = 0;
  // Expires old leases; returns how many. Call periodically (the server does it every second).
  virtual int64_t ExpireLeases(absl::Time now) = 0;

  virtual RouterState GetState(absl::Time now) const = 0;
  virtual const RouterOptions& options() const = 0;
};

}  // namespace eldr

#endif  // ELDR_ROUTER_H_
