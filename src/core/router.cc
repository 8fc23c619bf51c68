#include "eldr/core/router.h"

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "eldr/core/errors.h"
#include "eldr/common/mutex.h"

namespace eldr {
namespace {

// Everything a route needs from a calibration, built once and never modified: Routes that hold a
// pointer to it keep using it safely while a newer set is swapped in.
struct CentroidSet {
  CentroidSet(uint64_t generation, CentroidArtifact artifact, SignatureTransform transform,
              std::unique_ptr<CentroidIndex> index)
      : generation(generation),
        artifact(std::move(artifact)),
        transform(std::move(transform)),
        index(std::move(index)) {}

  const uint64_t generation;
  const CentroidArtifact artifact;  // `workers` always filled: row i belongs to workers[i]
  const SignatureTransform transform;
  const std::unique_ptr<const CentroidIndex> index;
};

struct WorkerEntry {
  WorkerSpec spec;
  WorkerState state = WorkerState::kActive;
  bool healthy = true;
  int index = 0;          // position in the insertion-ordered table
  int centroid_row = -1;  // its row in the current centroid set, -1 when it has none
  WorkerLoadAccount load;
};

struct LeaseRecord {
  WorkerEntry* worker;
  absl::Time acquired;
};

// Per-thread buffers for the part of a route that runs outside every lock, reused across calls so
// a route does not allocate once a thread has warmed up.
struct RouteScratch {
  std::vector<float> signature;
  std::vector<ScoredRow> scored;
};

RouteScratch& ThreadScratch() {
  thread_local RouteScratch scratch;
  return scratch;
}

absl::Status ValidateWorkerSpec(const WorkerSpec& spec) {
  if (spec.id.empty()) return absl::InvalidArgumentError("worker id must not be empty");
  if (!std::isfinite(spec.capacity) || spec.capacity <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker '%s': capacity must be a finite number > 0, got %g", spec.id, spec.capacity));
  }
  if (spec.max_inflight < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "worker '%s': max_inflight must be >= 0 (0 = no limit), got %d", spec.id,
        spec.max_inflight));
  }
  return absl::OkStatus();
}

absl::Status ValidateRouterOptions(const RouterOptions& options) {
  if (!std::isfinite(options.tau) || options.tau < 0 || options.tau > 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("router: tau must be in [0, 1], got %g", options.tau));
  }
  if (options.load.lease_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("router: lease TTL must be positive");
  }
  if (options.load.snapshot_staleness < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("router: snapshot staleness must not be negative");
  }
  return absl::OkStatus();
}

class RouterImpl final : public Router {
 public:
  explicit RouterImpl(RouterOptions options)
      : options_(std::move(options)), policy_(MakePolicy(options_.policy, options_.seed)) {}

  absl::StatusOr<RouteResult> Route(const SignatureInput* signature, absl::Time now) override;
  absl::Status Complete(uint64_t lease_id) override { return CompleteLease(lease_id).status(); }
  absl::StatusOr<std::string> CompleteLease(uint64_t lease_id) override;
  absl::Status InstallCentroids(const CentroidArtifact& artifact) override;
  absl::StatusOr<CentroidArtifact> CurrentCentroids() const override;
  absl::Status UpsertWorker(const WorkerSpec& spec) override;
  absl::Status DrainWorker(const std::string& id) override;
  absl::Status RemoveWorker(const std::string& id) override;
  absl::Status SetWorkerHealthy(const std::string& id, bool healthy) override;
  absl::Status ReportLoad(const std::string& id, const LoadSnapshot& snapshot) override;
  int64_t ExpireLeases(absl::Time now) override;
  RouterState GetState(absl::Time now) const override;
  const RouterOptions& options() const override { return options_; }

 private:
  std::shared_ptr<const CentroidSet> CurrentSet() const {
    MutexLock lock(&set_mu_);
    return set_;
  }
  WorkerEntry* FindWorker(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = by_id_.find(id);
    return it == by_id_.end() ? nullptr : it->second;
  }
  // Recomputes each worker's centroid row and the row -> worker table for `set` (may be null).
  void MapRows(const CentroidSet* set) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The worker index of `row` of `set`, for a route that scored against `set`. Normally the
  // precomputed table; a route that raced with a swap resolves the row by name.
  int WorkerOfRow(const CentroidSet& set, int row) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const RouterOptions options_;

  // Serialises InstallCentroids so generations are swapped in the order they are numbered.
  Mutex install_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  // Worker table, leases and the policy. Held for the decision itself only.
  mutable Mutex mu_ ABSL_ACQUIRED_BEFORE(set_mu_);
  std::unique_ptr<RoutingPolicy> policy_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<WorkerEntry>> workers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, WorkerEntry*> by_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, LeaseRecord> leases_ ABSL_GUARDED_BY(mu_);
  uint64_t next_lease_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t expired_total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<int> row_to_worker_ ABSL_GUARDED_BY(mu_);  // for set generation mapped_generation_
  uint64_t mapped_generation_ ABSL_GUARDED_BY(mu_) = 0;
  // Decision buffers, reused under mu_.
  std::vector<WorkerLoadView> views_ ABSL_GUARDED_BY(mu_);
  std::vector<ScoredRow> candidates_ ABSL_GUARDED_BY(mu_);

  // The centroid set in service. Only ever held to copy or swap the pointer.
  mutable Mutex set_mu_;
  std::shared_ptr<const CentroidSet> set_ ABSL_GUARDED_BY(set_mu_);
};

absl::StatusOr<RouteResult> RouterImpl::Route(const SignatureInput* signature, absl::Time now) {
  RouteScratch& scratch = ThreadScratch();
  const std::shared_ptr<const CentroidSet> set = CurrentSet();
  const bool wants_scores = options_.policy == PolicyKind::kEldr;

  // Transform and score outside every lock.
  FallbackReason no_scores_reason = FallbackReason::kNone;
  bool accepted_signature = false;
  bool have_scores = false;
  if (signature == nullptr) {
    no_scores_reason = FallbackReason::kNoSignature;
  } else if (set == nullptr) {
    no_scores_reason = FallbackReason::kNoCentroids;
  } else {
    scratch.signature.resize(static_cast<size_t>(set->transform.dim()));
    const absl::Status transformed = set->transform.Apply(*signature, absl::MakeSpan(scratch.signature));
    if (transformed.ok()) {
      accepted_signature = true;
      if (wants_scores) {
        scratch.scored.clear();
        const absl::Status searched = set->index->Search(scratch.signature, &scratch.scored);
        if (!searched.ok()) {
          return absl::InternalError(
              absl::StrCat("centroid index search failed: ", searched.message()));
        }
        have_scores = true;
      }
    } else if (RejectReasonOf(transformed) == RejectReason::kZeroSignature) {
      no_scores_reason = FallbackReason::kZeroSignature;
    } else {
      return transformed;
    }
  }

  RouteResult result;
  {
    MutexLock lock(&mu_);
    const int n = static_cast<int>(workers_.size());
    if (n == 0) return absl::UnavailableError("no decode workers are registered");
    bool any_active = false;
    bool any_active_healthy = false;
    for (const auto& worker : workers_) {
      const bool active = worker->state == WorkerState::kActive;
      any_active = any_active || active;
      any_active_healthy = any_active_healthy || (active && worker->healthy);
    }
    if (!any_active) return absl::UnavailableError("every decode worker is draining");
    // Fail open: when health checks condemn every worker, routing by load beats refusing traffic.
    const bool fail_open = !any_active_healthy;

    views_.resize(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      const WorkerEntry& worker = *workers_[i];
      WorkerLoadView& view = views_[i];
      view.load = worker.load.Effective(now, options_.load.snapshot_staleness);
      view.capacity = worker.spec.capacity;
      view.max_inflight = worker.spec.max_inflight;
      view.eligible = worker.state == WorkerState::kActive && (worker.healthy || fail_open);
    }
    candidates_.clear();
    if (have_scores) {
      for (const ScoredRow& scored : scratch.scored) {
        const int worker = WorkerOfRow(*set, scored.row);
        if (worker >= 0) candidates_.push_back(ScoredRow{worker, scored.score});
      }
      if (candidates_.empty()) no_scores_reason = FallbackReason::kNoEligibleCentroid;
    }

    PolicyInput input;
    input.workers = views_;
    input.scores = candidates_;
    input.tau = options_.tau;
    input.no_scores_reason = no_scores_reason;
    const PolicyDecision decision = policy_->Pick(input);
    if (decision.worker < 0 || decision.worker >= n) {
      return absl::UnavailableError("no decode worker is eligible");
    }

    WorkerEntry* chosen = workers_[decision.worker].get();
    const uint64_t lease_id = next_lease_++;
    leases_.emplace(lease_id, LeaseRecord{chosen, now});
    chosen->load.OnAcquire(now);

    result.worker_id = chosen->spec.id;
    result.address = chosen->spec.address;
    result.lease_id = lease_id;
    result.similarity = decision.best_similarity;
    result.band_size = decision.band_size;
    result.policy = decision.used;
    result.fallback = fail_open ? FallbackReason::kAllUnhealthy : decision.fallback;
    result.centroid_generation = set != nullptr ? set->generation : 0;
  }

  if (accepted_signature && options_.on_signature) {
    options_.on_signature(scratch.signature, result.worker_id);
  }
  return result;
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

absl::StatusOr<std::string> RouterImpl::CompleteLease(uint64_t lease_id) {
  MutexLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return absl::NotFoundError(
        absl::StrCat("lease ", lease_id, " is unknown, already completed or expired"));
  }
  it->second.worker->load.OnRelease(it->second.acquired);
  std::string worker = it->second.worker->spec.id;
  leases_.erase(it);
  return worker;
}

absl::Status RouterImpl::InstallCentroids(const CentroidArtifact& artifact) {
  ELDR_RETURN_IF_ERROR(ValidateCentroidArtifact(artifact));
  ELDR_ASSIGN_OR_RETURN(SignatureTransform transform, SignatureTransform::Create(artifact.spec));
  // The index certifies its decisions for the band width the router applies.
  CentroidIndexOptions index_options = options_.index;
  index_options.band_tau = options_.tau;
  ELDR_ASSIGN_OR_RETURN(std::unique_ptr<CentroidIndex> index,
                        BuildCentroidIndex(artifact.centroids, artifact.k, artifact.dim(),
                                           index_options));

  CentroidArtifact named = artifact;  // copied before locking: it can be megabytes
  MutexLock install_lock(&install_mu_);
  std::shared_ptr<const CentroidSet> retired;  // destroyed after mu_ is released
  {
    MutexLock lock(&mu_);
    if (named.workers.empty()) {
      if (named.k != static_cast<int>(workers_.size())) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "centroid artifact has k = %d unnamed rows but the router has %d workers; name the "
            "rows with `workers` or make the counts match",
            named.k, workers_.size()));
      }
      for (const auto& worker : workers_) named.workers.push_back(worker->spec.id);
    } else {
      std::vector<std::string> unknown;
      for (const std::string& id : named.workers) {
        if (FindWorker(id) == nullptr) unknown.push_back(id);
      }
      if (!unknown.empty()) {
        return MakeInputError(
            absl::StatusCode::kFailedPrecondition, RejectReason::kUnknownWorker,
            absl::StrCat("centroid artifact names workers the router does not know: ",
                         absl::StrJoin(unknown, ", ")));
      }
    }
    auto set = std::make_shared<const CentroidSet>(next_generation_++, std::move(named),
                                                   std::move(transform), std::move(index));
    {
      MutexLock set_lock(&set_mu_);
      retired = std::move(set_);
      set_ = set;
    }
    MapRows(set.get());
  }
  return absl::OkStatus();
}

absl::StatusOr<CentroidArtifact> RouterImpl::CurrentCentroids() const {
  const std::shared_ptr<const CentroidSet> set = CurrentSet();
  if (set == nullptr) return absl::NotFoundError("no centroids are installed");
  return set->artifact;
}

absl::Status RouterImpl::UpsertWorker(const WorkerSpec& spec) {
  ELDR_RETURN_IF_ERROR(ValidateWorkerSpec(spec));
  MutexLock lock(&mu_);
  if (WorkerEntry* existing = FindWorker(spec.id)) {
    existing->spec = spec;
    existing->state = WorkerState::kActive;
    return absl::OkStatus();
  }
  auto entry = std::make_unique<WorkerEntry>();
  entry->spec = spec;
  entry->index = static_cast<int>(workers_.size());
  by_id_.emplace(spec.id, entry.get());
  workers_.push_back(std::move(entry));
  // The new worker may be named by the centroid set in service.
  MapRows(CurrentSet().get());
  return absl::OkStatus();
}

absl::Status RouterImpl::DrainWorker(const std::string& id) {
  MutexLock lock(&mu_);
  WorkerEntry* worker = FindWorker(id);
  if (worker == nullptr) return absl::NotFoundError(absl::StrCat("unknown worker '", id, "'"));
  worker->state = WorkerState::kDraining;
  return absl::OkStatus();
}

absl::Status RouterImpl::RemoveWorker(const std::string& id) {
  MutexLock lock(&mu_);
  WorkerEntry* worker = FindWorker(id);
  if (worker == nullptr) return absl::NotFoundError(absl::StrCat("unknown worker '", id, "'"));
  if (worker->load.leases() > 0) {
    absl::erase_if(leases_, [worker](const auto& entry) { return entry.second.worker == worker; });
  }
  by_id_.erase(id);
  workers_.erase(workers_.begin() + worker->index);
  for (int i = 0; i < static_cast<int>(workers_.size()); ++i) workers_[i]->index = i;
  MapRows(CurrentSet().get());
  return absl::OkStatus();
}

absl::Status RouterImpl::SetWorkerHealthy(const std::string& id, bool healthy) {
  MutexLock lock(&mu_);
  WorkerEntry* worker = FindWorker(id);
  if (worker == nullptr) return absl::NotFoundError(absl::StrCat("unknown worker '", id, "'"));
  worker->healthy = healthy;
  return absl::OkStatus();
}

absl::Status RouterImpl::ReportLoad(const std::string& id, const LoadSnapshot& snapshot) {
  absl::Status valid = ValidateLoadSnapshot(snapshot);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker '", id, "': ", valid.message()));
  }
  MutexLock lock(&mu_);
  WorkerEntry* worker = FindWorker(id);
  if (worker == nullptr) return absl::NotFoundError(absl::StrCat("unknown worker '", id, "'"));
  worker->load.OnReport(snapshot);
  return absl::OkStatus();
}

int64_t RouterImpl::ExpireLeases(absl::Time now) {
  MutexLock lock(&mu_);
  const absl::Time cutoff = now - options_.load.lease_ttl;
  int64_t expired = 0;
  absl::erase_if(leases_, [&](const auto& entry) {
    const LeaseRecord& lease = entry.second;
    if (lease.acquired >= cutoff) return false;
    lease.worker->load.OnRelease(lease.acquired);
    ++expired;
    return true;
  });
  expired_total_ += expired;
  return expired;
}

RouterState RouterImpl::GetState(absl::Time now) const {
  RouterState state;
  state.policy = options_.policy;
  state.tau = options_.tau;
  MutexLock lock(&mu_);
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
    state.workers.push_back(std::move(status));
  }
  state.live_leases = static_cast<int64_t>(leases_.size());
  state.leases_expired_total = expired_total_;
  return state;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Router>> Router::Create(RouterOptions options,
                                                       std::vector<WorkerSpec> workers) {
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
  for (const WorkerSpec& spec : workers) ELDR_RETURN_IF_ERROR(router->UpsertWorker(spec));
  return std::unique_ptr<Router>(std::move(router));
}

}  // namespace eldr
