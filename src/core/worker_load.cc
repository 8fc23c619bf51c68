#include "eldr/core/worker_load.h"

#include <cmath>

#include "absl/strings/str_format.h"
#include "eldr/core/errors.h"

namespace eldr {

absl::Status ValidateLoadSnapshot(const LoadSnapshot& snapshot) {
  const struct {
    const char* name;
    double value;
    double max;
  } fields[] = {{"running", snapshot.running, kMaxReportedRequests},
                {"waiting", snapshot.waiting, kMaxReportedRequests},
                {"kv_usage", snapshot.kv_usage, 1.0}};
  for (const auto& field : fields) {
    if (!std::isfinite(field.value)) {
      return InvalidInput(RejectReason::kNonFinite,
                          absl::StrFormat("load snapshot: %s = %g is not finite", field.name, field.value));
    }
    if (field.value < 0) {
      return InvalidInput(RejectReason::kNegativeCount,
                          absl::StrFormat("load snapshot: %s = %g is negative", field.name, field.value));
    }
    if (field.value > field.max) {
      return InvalidInput(RejectReason::kOutOfRange, absl::StrFormat("load snapshot: %s = %g is above its limit %g",
                                                                     field.name, field.value, field.max));
    }
  }
  if (snapshot.taken_at == absl::InfinitePast() || snapshot.taken_at == absl::InfiniteFuture()) {
    return InvalidInput(RejectReason::kOutOfRange, "load snapshot: taken_at must be a finite time");
  }
  return absl::OkStatus();
}

WorkerLoadAccount::LeaseHandle WorkerLoadAccount::OnAcquire(absl::Time acquired, uint64_t lease_id) {
  const LeaseHandle lease = leases_.emplace(acquired, lease_id).first;
  if (snapshot_.has_value() && acquired > snapshot_->taken_at) {
    ++leases_after_snapshot_;
    if (first_after_snapshot_ == leases_.end() || *lease < *first_after_snapshot_) first_after_snapshot_ = lease;
  }
  return lease;
}

void WorkerLoadAccount::OnRelease(LeaseHandle lease) {
  if (snapshot_.has_value() && lease->first > snapshot_->taken_at) {
    --leases_after_snapshot_;
    if (lease == first_after_snapshot_) ++first_after_snapshot_;
  }
  leases_.erase(lease);
}

bool WorkerLoadAccount::OnReport(const LoadSnapshot& snapshot) {
  if (snapshot_.has_value() && snapshot.taken_at <= snapshot_->taken_at) return false;
  if (!snapshot_.has_value()) {
    first_after_snapshot_ = leases_.begin();
    leases_after_snapshot_ = leases();
  }
  snapshot_ = snapshot;
  // Leases the new snapshot already counts leave the "after" range.
  while (first_after_snapshot_ != leases_.end() && first_after_snapshot_->first <= snapshot.taken_at) {
    ++first_after_snapshot_;
    --leases_after_snapshot_;
  }
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

}  // namespace eldr
