// Where the simulator's routing decisions come from: the routing library in the same process
// (eldr::Router, exactly what eldr-router runs), or a running eldr-router daemon over gRPC.
//
// The simulator owns simulated time; a backend only sees the order of Route and Complete calls.
// Both backends see the same calls for the same seed, so a daemon started with the same settings
// makes the same decisions as the in-process router (tested by tests/sim).
#ifndef ELDR_SIM_ROUTING_BACKEND_H_
#define ELDR_SIM_ROUTING_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/policy.h"
#include "eldr/core/router.h"

namespace eldr::sim {

struct RouteCall {
  int64_t request_id = 0;
  int layers = 0;
  int experts = 0;
  absl::Span<const int16_t> prompt_counts;  // [layers][experts]
  // [layers][experts] gate-probability sums; when non-empty the backend routes on them (variant
  // gate_prob) instead of the counts.
  absl::Span<const float> prompt_gate_sums;
  int prompt_tokens = 0;
  int domain = -1;  // the request's domain label (Workload::domains); only the oracle reads it
};

struct RouteDecision {
  int worker = -1;  // index into the backend's worker_ids()
  uint64_t lease_id = 0;
  float similarity = 0;
  int band_size = 0;
  std::string fallback;  // empty when the configured policy decided
};

// Not thread-safe: one simulation drives one backend at a time.
class RoutingBackend {
 public:
  virtual ~RoutingBackend() = default;

  // e.g. "in-process eldr::Router" or "eldr-router at grpc://127.0.0.1:5000".
  virtual std::string Describe() const = 0;
  virtual PolicyKind policy() const = 0;
  virtual double tau() const = 0;
  // The decode workers, in the order the simulator indexes them. Only grows: a worker added by
  // AddWorker takes the next index, and a removed worker keeps its index (never chosen again).
  virtual const std::vector<std::string>& worker_ids() const = 0;

  // Called before each simulated run; simulated time restarts at 0 in every run.
  virtual void StartRun() = 0;
  virtual absl::StatusOr<RouteDecision> Route(const RouteCall& call, double now_us) = 0;
  virtual absl::Status Complete(uint64_t lease_id, int64_t output_tokens, double now_us) = 0;
  // Puts `artifact` in service (its `workers` must name the backend's workers).
  virtual absl::Status InstallCentroids(const CentroidArtifact& artifact) = 0;

  // Router replicas (SimulateReplicatedRun with shared load) need these two; only the in-process
  // backend has them, the others answer UNIMPLEMENTED.
  // The router's state at simulated time `now_us` (Router::GetState): its own leases per worker
  // and the effective load its policies see.
  virtual absl::StatusOr<RouterState> GetState(double now_us);
  // Router::SetPeerLeases: the other replicas' leases per worker id.
  virtual absl::Status SetPeerLeases(const absl::flat_hash_map<std::string, PeerLeaseCount>& peers);

  // The elastic pool (the pool_change drift scenario), as eldr-router's discovery drives it:
  // Router::UpsertWorker (the worker joins with the backend's overload guard; returns its index in
  // worker_ids(); ALREADY_EXISTS when the id is in worker_ids() already), Router::DrainWorker (no
  // new routes, its leases finish) and Router::RemoveWorker (the worker keeps its index and is never
  // chosen again). The in-process router, the oracle and the gRPC backend (RouterAdmin
  // UpsertWorker, DrainWorker, RemoveWorker) have them; the default answers UNIMPLEMENTED.
  virtual absl::StatusOr<int> AddWorker(const std::string& id);
  virtual absl::Status DrainWorker(const std::string& id);
  virtual absl::Status RemoveWorker(const std::string& id);
  // Undoes the pool changes made through this backend, so that a run starts from the pool the
  // backend started with: workers it added are removed, drained or removed workers it started with
  // rejoin with their original settings, in their starting order (tie-breaking follows the pool
  // order), and worker_ids() is the starting list again. A backend that
  // outlives one run (the daemon serves every cell of its policy) needs it; those made for one cell
  // do not, and answer OK without doing anything.
  virtual absl::Status RestorePool();

  // The decode work share of each domain (indexed like Workload::domains, any scale) in the traffic
  // about to come: the oracle partitions its workers by it; every other backend ignores it.
  virtual absl::Status SetDomainShares(const std::vector<double>& shares);
};

// An eldr::Router in this process with `policy`, `tau` and the tie-breaking seed `router_seed`,
// over workers "decode-0" .. "decode-{workers-1}", each with the overload guard `max_inflight`
// (0: none), ties among equally loaded workers broken by `tie_break`. Simulated time is passed to the router as
// absl::Time, advancing monotonically across runs.
// `max_load_gap`: RouterOptions::max_load_gap (0: off).
absl::StatusOr<std::unique_ptr<RoutingBackend>> MakeInProcessBackend(PolicyKind policy, double tau,
                                                                     uint64_t router_seed, int workers,
                                                                     int64_t max_inflight,
                                                                     TieBreak tie_break = TieBreak::kRandom,
                                                                     double max_load_gap = 0);

// The oracle policy (not a router policy: it reads RouteCall::domain, the label no router sees).
// Every domain with a positive share (SetDomainShares) gets a group of the active workers, sized
// by DomainGroups; a request goes to the least-loaded worker of its domain's group (load: its own
// leases, routed and not completed), ties broken by `tie_break` (random: from `seed`). A request of
// a domain without a group (share 0) goes to the least-loaded active worker. The groups are
// recomputed at every SetDomainShares and pool change. Workers "decode-0" .. "decode-{workers-1}".
// An upper bound on what locality can give: it never mistakes a request's domain and never spills.
absl::StatusOr<std::unique_ptr<RoutingBackend>> MakeOracleBackend(int workers, uint64_t seed, TieBreak tie_break);

// The oracle's groups: for `workers` workers (indices 0.., in order) and each domain's decode work
// share (any scale), the workers of each domain; empty for a domain whose share is not positive,
// and all empty when none is. The workers are apportioned by highest averages: each in turn goes
// to the domain that would have the most work per worker (share / (seats + 1); ties: the lower
// domain index), and the seated domains own disjoint contiguous blocks in domain order. A domain
// left without a worker (more domains than workers, or a small share) shares the block with the
// least work per worker at that point (largest such domain first), so no worker idles while a
// large domain's group is overloaded.
std::vector<std::vector<int>> DomainGroups(const std::vector<double>& shares, int workers);

// What a running daemon says about itself (RouterAdmin.GetState).
struct DaemonInfo {
  std::string target;        // host:port of the data plane (Route, Complete)
  std::string admin_target;  // host:port of RouterAdmin (GetState, ReloadCentroids)
  PolicyKind policy = PolicyKind::kEldr;
  double tau = 0;
  std::vector<std::string> worker_ids;
  std::vector<std::string> addresses;  // per worker, host:port
  std::vector<double> capacities;      // per worker
  std::vector<int64_t> max_inflight;   // per worker, 0: no overload guard
  int64_t live_leases = 0;
  uint64_t centroid_generation = 0;
};

// Parses "grpc://HOST:PORT" (the scheme is required). INVALID_ARGUMENT saying what is wrong.
absl::StatusOr<std::string> ParseGrpcTarget(const std::string& url);

// Connects to eldr-router at `target` (host:port, plaintext) and reads its state; UNAVAILABLE naming
// the target when it does not answer within `timeout_s`.
absl::StatusOr<DaemonInfo> QueryDaemon(const std::string& target, const std::string& admin_target, double timeout_s);

// Every Route and Complete of the run goes to the daemon (DecodeRouter, synchronous stub); centroids
// are installed with RouterAdmin.ReloadCentroids (inline JSON), and the pool is changed with
// RouterAdmin.UpsertWorker, DrainWorker and RemoveWorker. Those answer FAILED_PRECONDITION when the
// daemon's pool follows Kubernetes (--discovery=kubernetes): pool_change needs a static pool
// (--workers). An added worker gets the address "sim-<id>:8000" (nothing connects to it: the
// simulator only routes) and the capacity and overload guard of the daemon's first worker.
// A failed admin RPC surfaces as its status code with "<RPC> at <admin target> failed: <message>".
absl::StatusOr<std::unique_ptr<RoutingBackend>> MakeGrpcBackend(const DaemonInfo& daemon, double rpc_timeout_s);

}  // namespace eldr::sim

#endif  // ELDR_SIM_ROUTING_BACKEND_H_
