#include "eldr/core/load_tracker.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace eldr {

// ---- WorkerLoadAccount -------------------------------------------------------------------------

void WorkerLoadAccount::OnAcquire(absl::Time acquired) {
  lease_times_.insert(std::upper_bound(lease_times_.begin(), lease_times_.end(), acquired),
                      acquired);
  if (snapshot_.has_value() && acquired > snapshot_->taken_at) ++leases_after_snapshot_;
}

void WorkerLoadAccount::OnRelease(absl::Time acquired) {
  auto it = std::lower_bound(lease_times_.begin(), lease_times_.end(), acquired);
  if (it == lease_times_.end() || *it != acquired) return;
  lease_times_.erase(it);
  if (snapshot_.has_value() && acquired > snapshot_->taken_at) --leases_after_snapshot_;
}

bool WorkerLoadAccount::OnReport(const LoadSnapshot& snapshot) {
  if (snapshot_.has_value() && snapshot.taken_at <= snapshot_->taken_at) return false;
  snapshot_ = snapshot;
  leases_after_snapshot_ = static_cast<int64_t>(
      lease_times_.end() -
      std::upper_bound(lease_times_.begin(), lease_times_.end(), snapshot.taken_at));
  return true;
}

bool WorkerLoadAccount::SnapshotFresh(absl::Time now, absl::Duration staleness) const {
  return snapshot_.has_value() && now - snapshot_->taken_at <= staleness;
}

double WorkerLoadAccount::Effective(absl::Time now, absl::Duration staleness) const {
  if (!SnapshotFresh(now, staleness)) return static_cast<double>(leases());
  return snapshot_->running + snapshot_->waiting + static_cast<double>(leases_after_snapshot_);
}

WorkerLoad WorkerLoadAccount::Describe(absl::Time now, absl::Duration staleness) const {
  WorkerLoad load;
  load.leases = leases();
  load.snapshot = snapshot_;
  load.snapshot_fresh = SnapshotFresh(now, staleness);
  load.leases_since_snapshot = load.snapshot_fresh ? leases_after_snapshot_ : 0;
  load.effective = Effective(now, staleness);
  return load;
}

absl::Status ValidateLoadSnapshot(const LoadSnapshot& snapshot) {
  const struct {
    const char* name;
    double value;
  } fields[] = {{"running", snapshot.running},
                {"waiting", snapshot.waiting},
                {"kv_usage", snapshot.kv_usage}};
  for (const auto& field : fields) {
    if (!std::isfinite(field.value) || field.value < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "load snapshot: %s = %g must be finite and >= 0", field.name, field.value));
    }
  }
  if (snapshot.taken_at == absl::InfinitePast() || snapshot.taken_at == absl::InfiniteFuture()) {
    return absl::InvalidArgumentError("load snapshot: taken_at must be a finite time");
  }
  return absl::OkStatus();
}

// ---- LoadTracker -------------------------------------------------------------------------------

LoadTracker::LoadTracker(LoadTrackerOptions options) : options_(options) {}

void LoadTracker::AddWorker(const std::string& worker) {
  MutexLock lock(&mu_);
  workers_.try_emplace(worker);
}

int64_t LoadTracker::RemoveWorker(const std::string& worker) {
  MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  const int64_t dropped = it->second.leases();
  workers_.erase(it);
  if (dropped > 0) {
    absl::erase_if(leases_, [&worker](const auto& entry) { return entry.second.worker == worker; });
  }
  return dropped;
}

absl::StatusOr<uint64_t> LoadTracker::Acquire(const std::string& worker, absl::Time now) {
  MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("load tracker: unknown worker '", worker, "'"));
  }
  const uint64_t id = next_lease_++;
  leases_.emplace(id, Lease{worker, now});
  it->second.OnAcquire(now);
  return id;
}

absl::StatusOr<std::string> LoadTracker::Release(uint64_t lease_id) {
  MutexLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return absl::NotFoundError(
        absl::StrCat("lease ", lease_id, " is unknown, already released or expired"));
  }
  std::string worker = std::move(it->second.worker);
  const absl::Time acquired = it->second.acquired;
  leases_.erase(it);
  if (auto w = workers_.find(worker); w != workers_.end()) w->second.OnRelease(acquired);
  return worker;
}

int64_t LoadTracker::ExpireLeases(absl::Time now) {
  MutexLock lock(&mu_);
  const absl::Time cutoff = now - options_.lease_ttl;
  int64_t expired = 0;
  for (auto it = leases_.begin(); it != leases_.end();) {
    const Lease& lease = it->second;
    if (lease.acquired >= cutoff) {
      ++it;
      continue;
    }
    if (auto w = workers_.find(lease.worker); w != workers_.end()) w->second.OnRelease(lease.acquired);
    ++expired;
    leases_.erase(it++);  // erasing does not invalidate the other iterators
  }
  expired_total_ += expired;
  return expired;
}

absl::Status LoadTracker::Report(const std::string& worker, const LoadSnapshot& snapshot) {
  absl::Status valid = ValidateLoadSnapshot(snapshot);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker '", worker, "': ", valid.message()));
  }
  MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("load tracker: unknown worker '", worker, "'"));
  }
  it->second.OnReport(snapshot);
  return absl::OkStatus();
}

std::vector<double> LoadTracker::EffectiveLoads(const std::vector<std::string>& workers,
                                                absl::Time now) const {
  std::vector<double> loads(workers.size(), 0.0);
  MutexLock lock(&mu_);
  for (size_t i = 0; i < workers.size(); ++i) {
    auto it = workers_.find(workers[i]);
    if (it != workers_.end()) loads[i] = it->second.Effective(now, options_.snapshot_staleness);
  }
  return loads;
}

absl::StatusOr<WorkerLoad> LoadTracker::Get(const std::string& worker, absl::Time now) const {
  MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("load tracker: unknown worker '", worker, "'"));
  }
  return it->second.Describe(now, options_.snapshot_staleness);
}

int64_t LoadTracker::live_leases() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(leases_.size());
}

int64_t LoadTracker::expired_total() const {
  MutexLock lock(&mu_);
  return expired_total_;
}

}  // namespace eldr
