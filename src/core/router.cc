#include "eldr/core/router.h"

#include <sys/random.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "eldr/core/errors.h"
#include "eldr/core/signature_scorer.h"

namespace eldr {
namespace {

// Leases released per hold of the routing mutex by ExpireLeases: at about 250 ns each, a hold
// stays near 16 us, so a route that arrives during one waits little.
constexpr int64_t kExpiryBatch = 64;
// absl::Mutex lets a running thread take the lock back before a sleeping waiter wakes, so a loop
// of short holds can starve a route for its whole length (measured: 25-90 ms while a million
// leases expired; docs/benchmarks.md, "Lease expiry"). Between batches ExpireLeases therefore
// keeps off the lock while data-plane calls wait for it, at most this long, so it still
// progresses under a continuous stream of routes.
constexpr absl::Duration kExpiryYieldLimit = absl::Milliseconds(1);

constexpr CentroidSource kAllCentroidSources[] = {
    CentroidSource::kApi,    CentroidSource::kStartup,   CentroidSource::kStateDir,
    CentroidSource::kSignal, CentroidSource::kAdmin,     CentroidSource::kFileWatch,
    CentroidSource::kRefit,  CentroidSource::kDiscovery, CentroidSource::kCluster,
};

// Everything a route needs from a calibration, built once and never modified: Routes that hold a
// pointer to it keep using it safely while a newer set is swapped in.
struct CentroidSet {
  CentroidSet(uint64_t generation, CentroidArtifact artifact, SignatureTransform transform,
              std::unique_ptr<CentroidIndex> index)
      : generation(generation),
        artifact(std::move(artifact)),
        transform(std::move(transform)),
        index(std::move(index)),
        scorer(this->transform, *this->index) {}

  const uint64_t generation;
  const CentroidArtifact artifact;  // `workers` always filled: row i belongs to workers[i]
  const SignatureTransform transform;
  const std::unique_ptr<const CentroidIndex> index;
  const SignatureScorer scorer;  // over transform and index
};

struct WorkerEntry {
  WorkerSpec spec;
  WorkerState state = WorkerState::kActive;
  bool healthy = true;
  int index = 0;          // position in the insertion-ordered table
  int centroid_row = -1;  // its row in the current centroid set, -1 when it has none
  WorkerLoadAccount load;
  PeerLeaseCount peers;  // the other replicas' leases (SetPeerLeases)

  // The peers' leases that effective load adds (see Router::SetPeerLeases).
  int64_t PeerLeases(absl::Time now, absl::Duration staleness) const {
    return load.SnapshotFresh(now, staleness) ? peers.since_snapshot : peers.live;
  }
};

struct LeaseRecord {
  WorkerEntry* worker;
  WorkerLoadAccount::LeaseHandle handle;  // its place in the worker's account (acquisition time)
};

// Per-thread buffers for the part of a route that runs outside every lock, reused across calls so
// a route does not allocate once a thread has warmed up.
struct RouteScratch {
  SignatureScorer::Buffers signature;
  std::vector<ScoredRow> scored;
  std::vector<LeaseEnd> ended;  // leases a route or Complete released, told to observers after the lock
};

RouteScratch& ThreadScratch() {
  thread_local RouteScratch scratch;
  return scratch;
}

// Lease ids are capabilities (Complete takes nothing else), so they come from the kernel's
// cryptographic generator: unguessable, and unique across restarts and replicas with
// overwhelming probability. Drawn 256 at a time to keep the system call off most routes.
// Not thread-safe: used under the routing mutex.
class LeaseIdSource {
 public:
  uint64_t Next() {
    while (true) {
      if (next_ == buffer_.size()) Refill();
      const uint64_t id = buffer_[next_++];
      if (id != 0) return id;
    }
  }

 private:
  void Refill() {
    auto* bytes = reinterpret_cast<char*>(buffer_.data());
    size_t filled = 0;
    const size_t wanted = sizeof(buffer_);
    while (filled < wanted) {
      const ssize_t got = ::getrandom(bytes + filled, wanted - filled, 0);
      if (got > 0) {
        filled += static_cast<size_t>(got);
      } else if (got < 0 && errno != EINTR) {
        // getrandom cannot fail on a supported kernel once its pool is initialised; stay
        // correct (unique) anyway with a sequence mixed by SplitMix64.
        for (uint64_t& value : buffer_) value = SplitMix(fallback_state_ += 0x9E3779B97F4A7C15ULL);
        break;
      }
    }
    next_ = 0;
  }
  static uint64_t SplitMix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  std::array<uint64_t, 256> buffer_{};
  size_t next_ = 256;
  uint64_t fallback_state_ = reinterpret_cast<uintptr_t>(this);
};

absl::Status BadWorker(RejectReason reason, const WorkerSpec& spec, absl::string_view problem) {
  const std::string name = spec.id.size() <= kMaxWorkerIdBytes ? spec.id : spec.id.substr(0, 32) + "...";
  return InvalidInput(reason, absl::StrCat("worker '", absl::CHexEscape(name), "': ", problem));
}

absl::Status UnknownWorker(const std::string& id) {
  return MakeInputError(absl::StatusCode::kNotFound, RejectReason::kUnknownWorker,
                        absl::StrCat("unknown worker '", absl::CHexEscape(id), "'"));
}

bool IsIdChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' || c == ':' ||
         c == '@' || c == '/' || c == '+';
}

bool IsHostNameChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
}

// host:port with a DNS name, dotted IPv4 or [IPv6] host and a port in 1..65535.
absl::Status CheckAddress(const WorkerSpec& spec) {
  const std::string& address = spec.address;
  if (address.empty()) return BadWorker(RejectReason::kMalformed, spec, "address must not be empty");
  if (address.size() > kMaxWorkerAddressBytes) {
    return BadWorker(RejectReason::kMalformed, spec,
                     absl::StrCat("address is ", address.size(), " bytes; at most ", kMaxWorkerAddressBytes));
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return BadWorker(RejectReason::kMalformed, spec, "address must be host:port");
  }
  const absl::string_view host(address.data(), colon);
  const absl::string_view port_text = absl::string_view(address).substr(colon + 1);
  bool host_ok = false;
  if (host.front() == '[') {
    host_ok = host.size() > 2 && host.back() == ']' && std::all_of(host.begin() + 1, host.end() - 1, [](char c) {
                return absl::ascii_isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.';
              });
  } else {
    host_ok = host.front() != '.' && host.front() != '-' && std::all_of(host.begin(), host.end(), IsHostNameChar);
  }
  if (!host_ok) {
    return BadWorker(RejectReason::kMalformed, spec,
                     "address host must be a DNS name, an IPv4 address or a [bracketed] IPv6 address");
  }
  int port = 0;
  if (!std::all_of(port_text.begin(), port_text.end(), [](char c) { return absl::ascii_isdigit(c); }) ||
      port_text.size() > 5 || !absl::SimpleAtoi(port_text, &port) || port < 1 || port > 65535) {
    return BadWorker(RejectReason::kOutOfRange, spec, "address port must be a number in 1..65535");
  }
  return absl::OkStatus();
}

absl::Status ValidateRouterOptions(const RouterOptions& options) {
  if (!std::isfinite(options.max_load_gap) || options.max_load_gap < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("router: max_load_gap must be finite and >= 0, got %g", options.max_load_gap));
  }
  if (!std::isfinite(options.tau) || options.tau < 0 || options.tau > 1) {
    return absl::InvalidArgumentError(absl::StrFormat("router: tau must be in [0, 1], got %g", options.tau));
  }
  if (options.load.lease_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("router: lease TTL must be positive");
  }
  if (options.load.snapshot_staleness < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("router: snapshot staleness must not be negative");
  }
  if (options.max_live_leases < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("router: max_live_leases must be at least 1, got ", options.max_live_leases));
  }
  return absl::OkStatus();
}

class RouterImpl final : public Router {
 public:
  explicit RouterImpl(RouterOptions options) : options_(std::move(options)) {
    policies_[static_cast<size_t>(options_.policy)] = MakePolicy(options_.policy, options_.seed, options_.tie_break);
  }

  absl::StatusOr<RouteResult> Route(const RouteInput& input) override;
  using Router::Complete;
  absl::StatusOr<std::string> Complete(const CompleteInput& input) override;
  absl::StatusOr<uint64_t> InstallCentroids(const CentroidArtifact& artifact, CentroidSource source) override;
  absl::StatusOr<CentroidArtifact> CurrentCentroids() const override;
  void NotifyCentroidsRejected(CentroidSource source, const absl::Status& status) override;
  absl::StatusOr<PoolChange> UpsertWorker(const WorkerSpec& spec) override;
  absl::StatusOr<PoolChange> DrainWorker(const std::string& id) override;
  absl::StatusOr<PoolChange> RemoveWorker(const std::string& id) override;
  absl::Status SetWorkerHealthy(const std::string& id, bool healthy) override;
  absl::Status ReportLoad(const std::string& id, const LoadSnapshot& snapshot, absl::Time now) override;
  int64_t ExpireLeases(absl::Time now) override;
  void SetPeerLeases(const absl::flat_hash_map<std::string, PeerLeaseCount>& peers) override;
  RouterState GetState(absl::Time now) const override;
  const RouterOptions& options() const override { return options_; }
  void AddObserver(RouterObserver* observer) override;
  void RemoveObserver(RouterObserver* observer) override;

 private:
  std::shared_ptr<const CentroidSet> CurrentSet() const {
    absl::MutexLock lock(&set_mu_);
    return set_;
  }
  WorkerEntry* FindWorker(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second;
  }

  // The transform and the index search of a route, outside every lock: fills scratch.signature
  // (when accepted) and scratch.scored (when scores are wanted), or says why there are none.
  struct Scoring {
    bool accepted_signature = false;
    bool have_scores = false;
    FallbackReason no_scores_reason = FallbackReason::kNone;
  };
  absl::StatusOr<Scoring> ScoreSignature(const SignatureInput* signature, const CentroidSet* set,
                                         RouteScratch& scratch) const;
  // The decision and the lease, under mu_.
  absl::StatusOr<RouteResult> DecideLocked(const RouteInput& input, const CentroidSet* set, const Scoring& scoring,
                                           RouteScratch& scratch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t TakeLeaseLocked(WorkerEntry* worker, absl::Time now, std::vector<LeaseEnd>* ended)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RoutingPolicy& PolicyLocked(std::optional<PolicyKind> requested) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases a lease; when observers are registered and `ended` is not null, appends what
  // OnLeaseEnded will tell them (delivered by the caller once mu_ is released: DeliverLeaseEnds).
  void ReleaseLeaseLocked(absl::flat_hash_map<uint64_t, LeaseRecord>::iterator lease, LeaseEndKind kind, absl::Time now,
                          int64_t output_tokens, std::vector<LeaseEnd>* ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a lease RemoveWorker drops, forgetting the oldest beyond kRemovedLeasesRemembered.
  void RememberRemovedLeaseLocked(uint64_t lease_id, const std::string& worker_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases the pool's oldest live lease (the max_live_leases limit).
  void EvictOldestLeaseLocked(absl::Time now, std::vector<LeaseEnd>* ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells observers of `ended` (no router lock held) and empties it.
  void DeliverLeaseEnds(std::vector<LeaseEnd>* ended) ABSL_LOCKS_EXCLUDED(mu_);

  // Row names for `artifact` against the pool: its own `workers`, or the pool's ids in order.
  absl::StatusOr<std::vector<std::string>> RowOwnersLocked(const CentroidArtifact& artifact) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<uint64_t> RejectInstall(CentroidSource source, absl::Status status) ABSL_LOCKS_EXCLUDED(mutation_mu_);

  // Recomputes each worker's centroid row and the row -> worker table for `set` (may be null).
  void MapRows(const CentroidSet* set) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The worker index of `row` of `set`, for a route that scored against `set`. Normally the
  // precomputed table; a route that raced with a swap resolves the row by name.
  int WorkerOfRow(const CentroidSet& set, int row) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  PoolChange DescribeChangeLocked(PoolChangeKind kind, const WorkerEntry& worker) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Runs `mutate` under mutation_mu_ and mu_, publishes the change it returns and delivers it.
  absl::StatusOr<PoolChange> MutatePool(const std::function<absl::StatusOr<PoolChange>()>& mutate)
      ABSL_LOCKS_EXCLUDED(mutation_mu_, mu_);

  // Observer delivery (see RouterObserver). A mutation publishes its event while it still holds
  // mutation_mu_, so the queue is in mutation order; after releasing it the mutating thread
  // delivers the queue, unless another thread is delivering already (then that one delivers it
  // next). Callbacks therefore run without any router lock and may even mutate the router: their
  // own events join the queue behind the current one.
  using Event = std::variant<PoolChange, CentroidInstall, std::pair<CentroidSource, absl::Status>>;
  void Publish(Event event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutation_mu_) ABSL_LOCKS_EXCLUDED(events_mu_);
  void DeliverEvents() ABSL_LOCKS_EXCLUDED(mutation_mu_, events_mu_, mu_);
  template <typename Call>
  void ForEachObserver(const Call& call) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::ReaderMutexLock lock(&observers_mu_);
    for (RouterObserver* observer : observers_) call(*observer);
  }

  const RouterOptions options_;

  // Serialises every mutation (workers, health, centroids) and the publication of its event.
  absl::Mutex mutation_mu_ ABSL_ACQUIRED_BEFORE(events_mu_, mu_);
  uint64_t next_generation_ ABSL_GUARDED_BY(mutation_mu_) = 1;

  // Events published and not yet delivered, oldest first; `delivering_` while a thread delivers.
  absl::Mutex events_mu_;
  std::deque<Event> events_ ABSL_GUARDED_BY(events_mu_);
  bool delivering_ ABSL_GUARDED_BY(events_mu_) = false;

  // Observers; read-held while callbacks run, so RemoveObserver waits for them.
  absl::Mutex observers_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::vector<RouterObserver*> observers_ ABSL_GUARDED_BY(observers_mu_);
  std::atomic<bool> has_observers_{false};

  // Holds mu_ for a data-plane call (Route, Complete), counted in data_plane_waiting_ from before
  // it asks for the lock until it has it, so ExpireLeases can let it go first.
  class DataPlaneLock {
   public:
    explicit DataPlaneLock(RouterImpl* router) ABSL_EXCLUSIVE_LOCK_FUNCTION(router->mu_) : router_(router) {
      router_->data_plane_waiting_.fetch_add(1, std::memory_order_relaxed);
      router_->mu_.Lock();
      router_->data_plane_waiting_.fetch_sub(1, std::memory_order_relaxed);
    }
    ~DataPlaneLock() ABSL_UNLOCK_FUNCTION() { router_->mu_.Unlock(); }
    DataPlaneLock(const DataPlaneLock&) = delete;
    DataPlaneLock& operator=(const DataPlaneLock&) = delete;

   private:
    RouterImpl* const router_;
  };

  // Worker table, leases and the policy. Held for the decision itself only.
  mutable absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(set_mu_);
  // Data-plane calls waiting for mu_ (DataPlaneLock); read by ExpireLeases between batches.
  std::atomic<int> data_plane_waiting_{0};
  // One policy object per kind, each with its own generator: the configured one from the start,
  // the others made the first time a route asks for them (RouteInput::policy).
  std::array<std::unique_ptr<RoutingPolicy>, kPolicyKinds> policies_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<WorkerEntry>> workers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, WorkerEntry*> by_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, LeaseRecord> leases_ ABSL_GUARDED_BY(mu_);
  LeaseIdSource lease_ids_ ABSL_GUARDED_BY(mu_);
  int64_t expired_total_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evicted_total_ ABSL_GUARDED_BY(mu_) = 0;
  // Leases RemoveWorker dropped, with their worker, oldest first, at most kRemovedLeasesRemembered:
  // Complete answers them once (a request in flight when its pod was deleted).
  absl::flat_hash_map<uint64_t, std::string> removed_leases_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> removed_lease_order_ ABSL_GUARDED_BY(mu_);
  int64_t completes_after_removal_total_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int> row_to_worker_ ABSL_GUARDED_BY(mu_);  // for set generation mapped_generation_
  uint64_t mapped_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Decision buffers, reused under mu_.
  std::vector<WorkerLoadView> views_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> excluded_ ABSL_GUARDED_BY(mu_);  // per worker, for the route being decided
  std::vector<WorkerScore> candidates_ ABSL_GUARDED_BY(mu_);

  // The centroid set in service. Only ever held to copy or swap the pointer.
  mutable absl::Mutex set_mu_;
  std::shared_ptr<const CentroidSet> set_ ABSL_GUARDED_BY(set_mu_);
};

absl::StatusOr<RouterImpl::Scoring> RouterImpl::ScoreSignature(const SignatureInput* signature, const CentroidSet* set,
                                                               RouteScratch& scratch) const {
  Scoring scoring;
  if (signature == nullptr) {
    scoring.no_scores_reason = FallbackReason::kNoSignature;
    return scoring;
  }
  if (set == nullptr) {
    scoring.no_scores_reason = FallbackReason::kNoCentroids;
    return scoring;
  }
  // Other policies need no scores, but the signature is still validated (and observed).
  const bool wants_scores = options_.policy == PolicyKind::kEldr;
  scratch.scored.clear();
  const absl::Status scored = wants_scores ? set->scorer.Score(*signature, &scratch.signature, &scratch.scored)
                                           : set->scorer.Transform(*signature, &scratch.signature);
  if (!scored.ok()) {
    if (RejectReasonOf(scored) != RejectReason::kZeroSignature) return scored;
    scoring.no_scores_reason = FallbackReason::kZeroSignature;
    return scoring;
  }
  scoring.accepted_signature = true;
  scoring.have_scores = wants_scores;
  return scoring;
}

absl::StatusOr<RouteResult> RouterImpl::Route(const RouteInput& input) {
  if (input.exclude_workers.size() > kMaxExcludedWorkers) {
    return InvalidInput(RejectReason::kOutOfRange, absl::StrCat("a route may exclude at most ", kMaxExcludedWorkers,
                                                                " workers, got ", input.exclude_workers.size()));
  }
  RouteScratch& scratch = ThreadScratch();
  const std::shared_ptr<const CentroidSet> set = CurrentSet();
  ELDR_ASSIGN_OR_RETURN(const Scoring scoring, ScoreSignature(input.signature, set.get(), scratch));
  absl::StatusOr<RouteResult> result;
  {
    DataPlaneLock lock(this);
    result = DecideLocked(input, set.get(), scoring, scratch);
  }
  if (!scratch.ended.empty()) DeliverLeaseEnds(&scratch.ended);  // a lease evicted at the limit
  if (result.ok() && scoring.accepted_signature && has_observers_.load(std::memory_order_acquire)) {
    // Built only if an observer asks for it (SignatureScorer::Signature).
    struct LazySignature final : RoutedSignature::Source {
      LazySignature(const SignatureScorer& scorer, const SignatureInput& input, SignatureScorer::Buffers& buffers)
          : scorer(scorer), input(input), buffers(buffers) {}
      absl::Span<const float> Get() const override { return scorer.Signature(input, &buffers); }
      const SignatureScorer& scorer;
      const SignatureInput& input;
      SignatureScorer::Buffers& buffers;
    };
    const LazySignature lazy(set->scorer, *input.signature, scratch.signature);
    RoutedSignature routed;
    routed.source = &lazy;
    routed.signature_dim = set->transform.dim();
    routed.worker_id = result->worker_id;
    routed.lease_id = result->lease_id;
    routed.centroid_generation = result->centroid_generation;
    routed.client = input.client;
    routed.at = input.now;
    ForEachObserver([&](RouterObserver& observer) { observer.OnSignatureRouted(routed); });
  }
  return result;
}

absl::StatusOr<RouteResult> RouterImpl::DecideLocked(const RouteInput& input, const CentroidSet* set,
                                                     const Scoring& scoring, RouteScratch& scratch) {
  const int n = static_cast<int>(workers_.size());
  if (n == 0) return absl::UnavailableError("no decode workers are registered");
  // Workers the caller excluded; a set only when the list is long (usually it holds one id).
  absl::flat_hash_set<absl::string_view> excluded_set;
  if (input.exclude_workers.size() > 8) excluded_set.insert(input.exclude_workers.begin(), input.exclude_workers.end());
  const auto excluded = [&](const std::string& id) {
    if (input.exclude_workers.size() > 8) return excluded_set.contains(id);
    return std::find(input.exclude_workers.begin(), input.exclude_workers.end(), id) != input.exclude_workers.end();
  };
  excluded_.assign(static_cast<size_t>(n), false);
  bool any_active = false;
  bool any_active_healthy = false;
  bool any_excluded = false;
  for (int i = 0; i < n; ++i) {
    const WorkerEntry& worker = *workers_[i];
    if (!input.exclude_workers.empty() && excluded(worker.spec.id)) {
      excluded_[i] = true;
      any_excluded = true;
      continue;
    }
    const bool active = worker.state == WorkerState::kActive;
    any_active = any_active || active;
    any_active_healthy = any_active_healthy || (active && worker.healthy);
  }
  if (!any_active) {
    return absl::UnavailableError(any_excluded ? "every decode worker that could take the request is excluded"
                                               : "every decode worker is draining");
  }
  // Fail open: when health checks condemn every worker, routing by load beats refusing traffic.
  const bool fail_open = !any_active_healthy;

  views_.resize(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const WorkerEntry& worker = *workers_[i];
    WorkerLoadView& view = views_[i];
    view.load = worker.load.Effective(input.now, options_.load.snapshot_staleness) +
                static_cast<double>(worker.PeerLeases(input.now, options_.load.snapshot_staleness));
    view.capacity = worker.spec.capacity;
    view.max_inflight = worker.spec.max_inflight;
    view.eligible = !excluded_[i] && worker.state == WorkerState::kActive && (worker.healthy || fail_open);
  }
  FallbackReason no_scores_reason = scoring.no_scores_reason;
  candidates_.clear();
  if (scoring.have_scores) {
    for (const ScoredRow& scored : scratch.scored) {
      const int worker = WorkerOfRow(*set, scored.row);
      if (worker >= 0) candidates_.push_back(WorkerScore{worker, scored.score});
    }
    if (candidates_.empty()) no_scores_reason = FallbackReason::kNoEligibleCentroid;
  }

  PolicyInput policy_input;
  policy_input.workers = views_;
  policy_input.candidates = candidates_;
  policy_input.tau = options_.tau;
  policy_input.max_load_gap = options_.max_load_gap;
  policy_input.no_scores_reason = no_scores_reason;
  const PolicyDecision decision = PolicyLocked(input.policy).Pick(policy_input);
  if (decision.worker < 0 || decision.worker >= n) return absl::UnavailableError("no decode worker is eligible");

  WorkerEntry* chosen = workers_[decision.worker].get();
  RouteResult result;
  result.lease_id = TakeLeaseLocked(chosen, input.now, &scratch.ended);
  result.worker_id = chosen->spec.id;
  result.address = chosen->spec.address;
  result.similarity = decision.best_similarity;
  result.band_size = decision.band_size;
  result.policy = decision.used;
  result.fallback = fail_open ? FallbackReason::kAllUnhealthy : decision.fallback;
  result.centroid_generation = set != nullptr ? set->generation : 0;
  return result;
}

RoutingPolicy& RouterImpl::PolicyLocked(std::optional<PolicyKind> requested) {
  const PolicyKind kind = requested.value_or(options_.policy);
  std::unique_ptr<RoutingPolicy>& policy = policies_[static_cast<size_t>(kind)];
  // A seed of its own per kind, so the configured policy's sequence does not depend on whether
  // other kinds were asked for.
  if (policy == nullptr) policy = MakePolicy(kind, options_.seed + 1 + static_cast<uint64_t>(kind), options_.tie_break);
  return *policy;
}

uint64_t RouterImpl::TakeLeaseLocked(WorkerEntry* worker, absl::Time now, std::vector<LeaseEnd>* ended) {
  if (static_cast<int64_t>(leases_.size()) >= options_.max_live_leases) EvictOldestLeaseLocked(now, ended);
  uint64_t id = lease_ids_.Next();
  while (leases_.contains(id)) id = lease_ids_.Next();
  leases_.emplace(id, LeaseRecord{worker, worker->load.OnAcquire(now, id)});
  return id;
}

void RouterImpl::ReleaseLeaseLocked(absl::flat_hash_map<uint64_t, LeaseRecord>::iterator lease, LeaseEndKind kind,
                                    absl::Time now, int64_t output_tokens, std::vector<LeaseEnd>* ended) {
  if (ended != nullptr && has_observers_.load(std::memory_order_acquire)) {
    LeaseEnd& end = ended->emplace_back();
    end.lease_id = lease->first;
    end.worker_id = lease->second.worker->spec.id;
    end.kind = kind;
    end.output_tokens = kind == LeaseEndKind::kCompleted ? output_tokens : 0;
    end.held = std::max(absl::ZeroDuration(), now - lease->second.handle->first);
    end.expired = kind != LeaseEndKind::kCompleted;
  }
  lease->second.worker->load.OnRelease(lease->second.handle);
  leases_.erase(lease);
}

void RouterImpl::DeliverLeaseEnds(std::vector<LeaseEnd>* ended) {
  ForEachObserver([&](RouterObserver& observer) {
    for (const LeaseEnd& end : *ended) observer.OnLeaseEnded(end);
  });
  ended->clear();
}

void RouterImpl::RememberRemovedLeaseLocked(uint64_t lease_id, const std::string& worker_id) {
  if (removed_lease_order_.size() >= kRemovedLeasesRemembered) {
    removed_leases_.erase(removed_lease_order_.front());
    removed_lease_order_.pop_front();
  }
  removed_leases_.insert_or_assign(lease_id, worker_id);
  removed_lease_order_.push_back(lease_id);
}

void RouterImpl::EvictOldestLeaseLocked(absl::Time now, std::vector<LeaseEnd>* ended) {
  WorkerEntry* oldest = nullptr;
  for (const auto& worker : workers_) {
    if (worker->load.leases() == 0) continue;
    if (oldest == nullptr || *worker->load.Oldest() < *oldest->load.Oldest()) oldest = worker.get();
  }
  if (oldest == nullptr) return;
  auto lease = leases_.find(oldest->load.Oldest()->second);
  if (lease == leases_.end()) return;
  ReleaseLeaseLocked(lease, LeaseEndKind::kEvicted, now, 0, ended);
  ++evicted_total_;
}

int RouterImpl::WorkerOfRow(const CentroidSet& set, int row) const {
  if (row < 0 || row >= set.artifact.k) return -1;
  if (set.generation == mapped_generation_) {
    return row < static_cast<int>(row_to_worker_.size()) ? row_to_worker_[row] : -1;
  }
  auto it = by_id_.find(set.artifact.workers[row]);
  return it == by_id_.end() ? -1 : it->second->index;
}

void RouterImpl::MapRows(const CentroidSet* set) {
  for (auto& worker : workers_) worker->centroid_row = -1;
  row_to_worker_.clear();
  if (set == nullptr) {
    mapped_generation_ = 0;
    return;
  }
  row_to_worker_.assign(static_cast<size_t>(set->artifact.k), -1);
  for (int row = 0; row < set->artifact.k; ++row) {
    WorkerEntry* worker = FindWorker(set->artifact.workers[row]);
    if (worker == nullptr) continue;
    worker->centroid_row = row;
    row_to_worker_[row] = worker->index;
  }
  mapped_generation_ = set->generation;
}

absl::StatusOr<std::string> RouterImpl::Complete(const CompleteInput& input) {
  if (input.output_tokens < 0) {
    return InvalidInput(RejectReason::kNegativeCount,
                        absl::StrCat("output_tokens must not be negative, got ", input.output_tokens));
  }
  std::vector<LeaseEnd>& ended = ThreadScratch().ended;
  std::string worker;
  {
    DataPlaneLock lock(this);
    auto it = leases_.find(input.lease_id);
    if (it == leases_.end()) {
      auto removed = removed_leases_.find(input.lease_id);
      if (removed == removed_leases_.end()) {
        return absl::NotFoundError(absl::StrCat("lease ", input.lease_id, " is unknown, already completed or expired"));
      }
      // Its worker left the pool while the request was in flight; the lease already ended then.
      // (The id stays in removed_lease_order_ until it ages out; erasing it there is not needed.)
      worker = std::move(removed->second);
      removed_leases_.erase(removed);
      ++completes_after_removal_total_;
      return worker;
    }
    worker = it->second.worker->spec.id;
    ReleaseLeaseLocked(it, LeaseEndKind::kCompleted, input.now, input.output_tokens, &ended);
  }
  if (!ended.empty()) DeliverLeaseEnds(&ended);
  return worker;
}

absl::StatusOr<std::vector<std::string>> RouterImpl::RowOwnersLocked(const CentroidArtifact& artifact) const {
  if (artifact.workers.empty()) {
    if (artifact.k != static_cast<int>(workers_.size())) {
      return absl::FailedPreconditionError(
          absl::StrFormat("centroid artifact has k = %d unnamed rows but the router has %d workers; name the rows with "
                          "`workers` or make the counts match",
                          artifact.k, workers_.size()));
    }
    std::vector<std::string> owners;
    owners.reserve(workers_.size());
    for (const auto& worker : workers_) owners.push_back(worker->spec.id);
    return owners;
  }
  std::vector<std::string> unknown;
  for (const std::string& id : artifact.workers) {
    if (!by_id_.contains(id)) unknown.push_back(id);
  }
  if (!unknown.empty()) {
    const size_t shown = std::min<size_t>(unknown.size(), 8);
    return MakeInputError(
        absl::StatusCode::kFailedPrecondition, RejectReason::kUnknownWorker,
        absl::StrCat("centroid artifact names ", unknown.size(), " worker(s) the router does not know: ",
                     absl::StrJoin(unknown.begin(), unknown.begin() + shown, ", "),
                     unknown.size() > shown ? ", ..." : ""));
  }
  return artifact.workers;
}

absl::StatusOr<uint64_t> RouterImpl::RejectInstall(CentroidSource source, absl::Status status) {
  {
    absl::MutexLock mutation_lock(&mutation_mu_);
    Publish(std::make_pair(source, status));
  }
  DeliverEvents();
  return status;
}

void RouterImpl::Publish(Event event) {
  absl::MutexLock lock(&events_mu_);
  events_.push_back(std::move(event));
}

void RouterImpl::DeliverEvents() {
  {
    absl::MutexLock lock(&events_mu_);
    if (delivering_) return;  // the thread delivering now also delivers what we published
    delivering_ = true;
  }
  while (true) {
    Event event;
    {
      absl::MutexLock lock(&events_mu_);
      if (events_.empty()) {
        delivering_ = false;
        return;
      }
      event = std::move(events_.front());
      events_.pop_front();
    }
    ForEachObserver([&](RouterObserver& observer) {
      if (const auto* change = std::get_if<PoolChange>(&event)) {
        observer.OnPoolChanged(*change);
      } else if (const auto* install = std::get_if<CentroidInstall>(&event)) {
        observer.OnCentroidsInstalled(*install);
      } else {
        const auto& rejection = std::get<std::pair<CentroidSource, absl::Status>>(event);
        observer.OnCentroidsRejected(rejection.first, rejection.second);
      }
    });
  }
}

void RouterImpl::NotifyCentroidsRejected(CentroidSource source, const absl::Status& status) {
  (void)RejectInstall(source, status);
}

absl::StatusOr<uint64_t> RouterImpl::InstallCentroids(const CentroidArtifact& artifact, CentroidSource source) {
  // Cheap checks first: a malformed artifact, or one whose rows do not fit the pool, is refused
  // before any index is built (that can take seconds for thousands of long rows).
  if (absl::Status valid = ValidateCentroidArtifact(artifact); !valid.ok()) return RejectInstall(source, valid);
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(artifact.spec);
  if (!transform.ok()) return RejectInstall(source, transform.status());
  absl::Status fits;
  {
    absl::ReaderMutexLock lock(&mu_);
    fits = RowOwnersLocked(artifact).status();
  }
  if (!fits.ok()) return RejectInstall(source, fits);
  // The index certifies its decisions for the band width the router applies.
  CentroidIndexOptions index_options = options_.index;
  index_options.band_tau = options_.tau;
  absl::StatusOr<std::unique_ptr<CentroidIndex>> index =
      BuildCentroidIndex(artifact.centroids, artifact.k, artifact.dim(), index_options);
  if (!index.ok()) return RejectInstall(source, index.status());

  CentroidArtifact named = artifact;           // copied before locking: it can be megabytes
  std::shared_ptr<const CentroidSet> retired;  // destroyed after the locks are released
  CentroidInstall install;
  absl::Status refused;
  {
    absl::MutexLock mutation_lock(&mutation_mu_);
    absl::MutexLock lock(&mu_);
    // The pool may have changed while the index was built.
    absl::StatusOr<std::vector<std::string>> owners = RowOwnersLocked(named);
    if (!owners.ok()) {
      refused = owners.status();
      Publish(std::make_pair(source, refused));
    } else {
      named.workers = *std::move(owners);
      auto set = std::make_shared<const CentroidSet>(next_generation_++, std::move(named), *std::move(transform),
                                                     *std::move(index));
      {
        absl::MutexLock set_lock(&set_mu_);
        retired = std::move(set_);
        set_ = set;
      }
      MapRows(set.get());
      install.generation = set->generation;
      install.source = source;
      install.rows = set->artifact.k;
      install.dim = set->artifact.dim();
      install.model = set->artifact.model;
      install.workers = set->artifact.workers;
      install.transform_changed = retired == nullptr || !SameTransform(retired->artifact.spec, set->artifact.spec);
      Publish(install);
    }
  }
  DeliverEvents();
  if (!refused.ok()) return refused;
  return install.generation;
}

absl::StatusOr<CentroidArtifact> RouterImpl::CurrentCentroids() const {
  const std::shared_ptr<const CentroidSet> set = CurrentSet();
  if (set == nullptr) return absl::NotFoundError("no centroids are installed");
  return set->artifact;
}

PoolChange RouterImpl::DescribeChangeLocked(PoolChangeKind kind, const WorkerEntry& worker) const {
  PoolChange change;
  change.kind = kind;
  change.spec = worker.spec;
  change.state = worker.state;
  change.healthy = worker.healthy;
  change.inflight = worker.load.leases();
  return change;
}

absl::StatusOr<PoolChange> RouterImpl::MutatePool(const std::function<absl::StatusOr<PoolChange>()>& mutate) {
  absl::StatusOr<PoolChange> change;
  {
    absl::MutexLock mutation_lock(&mutation_mu_);
    {
      absl::MutexLock lock(&mu_);
      change = mutate();
    }
    if (change.ok()) Publish(*change);
  }
  if (change.ok()) DeliverEvents();
  return change;
}

absl::StatusOr<PoolChange> RouterImpl::UpsertWorker(const WorkerSpec& spec) {
  ELDR_RETURN_IF_ERROR(ValidateWorkerSpec(spec));
  return MutatePool([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<PoolChange> {
    if (WorkerEntry* existing = FindWorker(spec.id)) {
      existing->spec = spec;
      existing->state = WorkerState::kActive;
      return DescribeChangeLocked(PoolChangeKind::kUpdated, *existing);
    }
    auto entry = std::make_unique<WorkerEntry>();
    entry->spec = spec;
    entry->index = static_cast<int>(workers_.size());
    by_id_.emplace(spec.id, entry.get());
    workers_.push_back(std::move(entry));
    // The new worker may be named by the centroid set in service.
    MapRows(CurrentSet().get());
    return DescribeChangeLocked(PoolChangeKind::kAdded, *workers_.back());
  });
}

absl::StatusOr<PoolChange> RouterImpl::DrainWorker(const std::string& id) {
  return MutatePool([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<PoolChange> {
    WorkerEntry* worker = FindWorker(id);
    if (worker == nullptr) return UnknownWorker(id);
    worker->state = WorkerState::kDraining;
    return DescribeChangeLocked(PoolChangeKind::kDraining, *worker);
  });
}

absl::StatusOr<PoolChange> RouterImpl::RemoveWorker(const std::string& id) {
  std::vector<LeaseEnd> ended;
  const absl::Time now = absl::Now();
  absl::StatusOr<PoolChange> removed =
      MutatePool([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<PoolChange> {
        WorkerEntry* worker = FindWorker(id);
        if (worker == nullptr) return UnknownWorker(id);
        const PoolChange change = DescribeChangeLocked(PoolChangeKind::kRemoved, *worker);
        while (worker->load.leases() > 0) {
          auto lease = leases_.find(worker->load.Oldest()->second);
          if (lease == leases_.end()) break;  // cannot happen: every account entry has its record
          RememberRemovedLeaseLocked(lease->first, id);
          ReleaseLeaseLocked(lease, LeaseEndKind::kWorkerRemoved, now, 0, &ended);
        }
        by_id_.erase(id);
        workers_.erase(workers_.begin() + worker->index);
        for (int i = 0; i < static_cast<int>(workers_.size()); ++i) workers_[i]->index = i;
        MapRows(CurrentSet().get());
        return change;
      });
  if (!ended.empty()) DeliverLeaseEnds(&ended);
  return removed;
}

absl::Status RouterImpl::SetWorkerHealthy(const std::string& id, bool healthy) {
  bool changed = false;
  const absl::StatusOr<PoolChange> change =
      MutatePool([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<PoolChange> {
        WorkerEntry* worker = FindWorker(id);
        if (worker == nullptr) return UnknownWorker(id);
        changed = worker->healthy != healthy;
        worker->healthy = healthy;
        if (!changed) return absl::AlreadyExistsError("unchanged");  // nothing to announce
        return DescribeChangeLocked(PoolChangeKind::kHealthChanged, *worker);
      });
  if (!change.ok() && !absl::IsAlreadyExists(change.status())) return change.status();
  return absl::OkStatus();
}

absl::Status RouterImpl::ReportLoad(const std::string& id, const LoadSnapshot& snapshot, absl::Time now) {
  if (absl::Status valid = ValidateLoadSnapshot(snapshot); !valid.ok()) {
    return MakeInputError(valid.code(), RejectReasonOf(valid),
                          absl::StrCat("worker '", absl::CHexEscape(id), "': ", valid.message()));
  }
  LoadSnapshot clamped = snapshot;
  clamped.taken_at = std::min(snapshot.taken_at, now);
  absl::MutexLock lock(&mu_);
  WorkerEntry* worker = FindWorker(id);
  if (worker == nullptr) return UnknownWorker(id);
  worker->load.OnReport(clamped);
  return absl::OkStatus();
}

int64_t RouterImpl::ExpireLeases(absl::Time now) {
  const absl::Time cutoff = now - options_.load.lease_ttl;
  int64_t total = 0;
  std::vector<LeaseEnd> ended;
  while (true) {
    if (total > 0) {
      // Let the data-plane calls that wait for mu_ take it first; absl::Mutex wakes one on
      // Unlock, and this thread keeps off the lock until the count drops (or the limit passes).
      const absl::Time limit = absl::Now() + kExpiryYieldLimit;
      while (data_plane_waiting_.load(std::memory_order_relaxed) > 0 && absl::Now() < limit) {
        std::this_thread::yield();
      }
    }
    mu_.Lock();
    int64_t batch = 0;
    for (const auto& worker : workers_) {
      while (batch < kExpiryBatch && worker->load.leases() > 0 && worker->load.Oldest()->first < cutoff) {
        auto lease = leases_.find(worker->load.Oldest()->second);
        if (lease == leases_.end()) break;
        ReleaseLeaseLocked(lease, LeaseEndKind::kExpired, now, 0, &ended);
        ++batch;
      }
      if (batch == kExpiryBatch) break;
    }
    expired_total_ += batch;
    mu_.Unlock();
    if (!ended.empty()) DeliverLeaseEnds(&ended);
    total += batch;
    if (batch < kExpiryBatch) return total;
  }
}

void RouterImpl::SetPeerLeases(const absl::flat_hash_map<std::string, PeerLeaseCount>& peers) {
  absl::MutexLock lock(&mu_);
  for (const auto& worker : workers_) {
    const auto it = peers.find(worker->spec.id);
    // Negative counts (a confused peer) would make a worker look idler than it is: clamp.
    worker->peers = it == peers.end() ? PeerLeaseCount{}
                                      : PeerLeaseCount{std::max<int64_t>(0, it->second.live),
                                                       std::max<int64_t>(0, it->second.since_snapshot)};
  }
}

RouterState RouterImpl::GetState(absl::Time now) const {
  RouterState state;
  state.policy = options_.policy;
  state.tau = options_.tau;
  absl::MutexLock lock(&mu_);
  // Read under mu_: the set and the row mapping change together under it.
  const std::shared_ptr<const CentroidSet> set = CurrentSet();
  if (set != nullptr) {
    state.centroid_generation = set->generation;
    state.centroid_rows = set->artifact.k;
    state.index_kind = std::string(set->index->kind());
  }
  state.workers.reserve(workers_.size());
  for (const auto& worker : workers_) {
    WorkerStatus status;
    status.spec = worker->spec;
    status.state = worker->state;
    status.healthy = worker->healthy;
    status.has_centroid = worker->centroid_row >= 0;
    status.load = worker->load.Describe(now, options_.load.snapshot_staleness);
    status.load.peer_leases = worker->PeerLeases(now, options_.load.snapshot_staleness);
    status.load.effective += static_cast<double>(status.load.peer_leases);
    state.workers.push_back(std::move(status));
  }
  state.live_leases = static_cast<int64_t>(leases_.size());
  state.leases_expired_total = expired_total_;
  state.leases_evicted_total = evicted_total_;
  state.completes_after_removal_total = completes_after_removal_total_;
  return state;
}

void RouterImpl::AddObserver(RouterObserver* observer) {
  absl::MutexLock lock(&observers_mu_);
  observers_.push_back(observer);
  has_observers_.store(true, std::memory_order_release);
}

void RouterImpl::RemoveObserver(RouterObserver* observer) {
  absl::MutexLock lock(&observers_mu_);
  observers_.erase(std::remove(observers_.begin(), observers_.end(), observer), observers_.end());
  has_observers_.store(!observers_.empty(), std::memory_order_release);
}

}  // namespace

absl::string_view CentroidSourceLabel(CentroidSource source) {
  switch (source) {
    case CentroidSource::kApi:
      return "api";
    case CentroidSource::kStartup:
      return "startup";
    case CentroidSource::kStateDir:
      return "state_dir";
    case CentroidSource::kSignal:
      return "sighup";
    case CentroidSource::kAdmin:
      return "admin";
    case CentroidSource::kFileWatch:
      return "file_watch";
    case CentroidSource::kRefit:
      return "refit";
    case CentroidSource::kDiscovery:
      return "discovery";
    case CentroidSource::kCluster:
      return "cluster";
  }
  return "api";
}

absl::Span<const CentroidSource> AllCentroidSources() { return kAllCentroidSources; }

absl::string_view LeaseEndKindLabel(LeaseEndKind kind) {
  switch (kind) {
    case LeaseEndKind::kCompleted:
      return "completed";
    case LeaseEndKind::kExpired:
      return "expired";
    case LeaseEndKind::kEvicted:
      return "evicted";
    case LeaseEndKind::kWorkerRemoved:
      return "worker_removed";
  }
  return "completed";
}

absl::string_view PoolChangeKindLabel(PoolChangeKind kind) {
  switch (kind) {
    case PoolChangeKind::kAdded:
      return "added";
    case PoolChangeKind::kUpdated:
      return "updated";
    case PoolChangeKind::kDraining:
      return "draining";
    case PoolChangeKind::kRemoved:
      return "removed";
    case PoolChangeKind::kHealthChanged:
      return "health_changed";
  }
  return "updated";
}

absl::Status ValidateWorkerSpec(const WorkerSpec& spec) {
  if (spec.id.empty()) return InvalidInput(RejectReason::kMalformed, "worker id must not be empty");
  if (spec.id.size() > kMaxWorkerIdBytes) {
    return BadWorker(RejectReason::kMalformed, spec,
                     absl::StrCat("id is ", spec.id.size(), " bytes; at most ", kMaxWorkerIdBytes));
  }
  if (!std::all_of(spec.id.begin(), spec.id.end(), IsIdChar)) {
    return BadWorker(RejectReason::kMalformed, spec, "id may hold only letters, digits and . _ - : @ / +");
  }
  ELDR_RETURN_IF_ERROR(CheckAddress(spec));
  if (!std::isfinite(spec.capacity) || spec.capacity < kMinWorkerCapacity || spec.capacity > kMaxWorkerCapacity) {
    return BadWorker(RejectReason::kOutOfRange, spec,
                     absl::StrFormat("capacity must be a finite number in [%g, %g], got %g", kMinWorkerCapacity,
                                     kMaxWorkerCapacity, spec.capacity));
  }
  if (spec.max_inflight < 0 || spec.max_inflight > kMaxWorkerInflightLimit) {
    return BadWorker(RejectReason::kOutOfRange, spec,
                     absl::StrFormat("max_inflight must be in [0, %d] (0 = no limit), got %d", kMaxWorkerInflightLimit,
                                     spec.max_inflight));
  }
  if (spec.metrics_url.size() > kMaxMetricsUrlBytes ||
      !std::all_of(spec.metrics_url.begin(), spec.metrics_url.end(), [](char c) { return c > ' ' && c < 0x7f; })) {
    return BadWorker(
        RejectReason::kMalformed, spec,
        absl::StrCat("metrics_url must be at most ", kMaxMetricsUrlBytes, " bytes of printable ASCII without spaces"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Router>> Router::Create(RouterOptions options, std::vector<WorkerSpec> workers) {
  ELDR_RETURN_IF_ERROR(ValidateRouterOptions(options));
  absl::flat_hash_map<std::string, int> seen;
  for (int i = 0; i < static_cast<int>(workers.size()); ++i) {
    ELDR_RETURN_IF_ERROR(ValidateWorkerSpec(workers[i]));
    if (!seen.emplace(workers[i].id, i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate worker id '", workers[i].id, "' in the initial worker list"));
    }
  }
  auto router = std::make_unique<RouterImpl>(std::move(options));
  for (const WorkerSpec& spec : workers) ELDR_RETURN_IF_ERROR(router->UpsertWorker(spec).status());
  return std::unique_ptr<Router>(std::move(router));
}

}  // namespace eldr
