// Per-worker load as the router sees it: the leases it handed out plus what the worker reports.
//
// A lease is taken for every routed request and released by its completion, or expires after a
// TTL so a lost completion cannot leak load forever. A worker's report is a snapshot with a
// timestamp: effective load = snapshot (running + waiting) + live leases acquired after the
// snapshot was taken. A snapshot older than the staleness limit is ignored (the lease count alone
// is used), so a worker whose reports stop is never treated as idle.
#ifndef ELDR_CORE_WORKER_LOAD_H_
#define ELDR_CORE_WORKER_LOAD_H_

#include <cstdint>
#include <optional>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace eldr {

struct LoadOptions {
  absl::Duration lease_ttl = absl::Minutes(10);          // a lease older than this expires
  absl::Duration snapshot_staleness = absl::Seconds(5);  // older snapshots are ignored
};

// What a decode worker reports (pushed over ReportLoad or scraped from its metrics).
struct LoadSnapshot {
  double running = 0;   // requests decoding
  double waiting = 0;   // requests queued
  double kv_usage = 0;  // fraction of KV cache in use, [0, 1]
  absl::Time taken_at;  // when the worker measured it
};

// Largest running or waiting count a report may carry: far above any engine's batch, and small
// enough that sums of loads stay exact and finite.
inline constexpr double kMaxReportedRequests = 1e9;

// The rules every load report obeys, whatever its transport (ReportLoad stream, scrape):
// running and waiting finite in [0, kMaxReportedRequests], kv_usage finite in [0, 1], taken_at a
// finite time. InvalidInput (eldr/core/errors.h) naming the field, with reason kNonFinite,
// kNegativeCount or kOutOfRange.
absl::Status ValidateLoadSnapshot(const LoadSnapshot& snapshot);

struct WorkerLoad {
  int64_t leases = 0;                    // live leases of this worker
  int64_t leases_since_snapshot = 0;     // of which acquired after the last fresh snapshot
  std::optional<LoadSnapshot> snapshot;  // last snapshot, fresh or not
  bool snapshot_fresh = false;
  // Other router replicas' leases counted in `effective` (Router::SetPeerLeases); 0 alone.
  int64_t peer_leases = 0;
  double effective = 0;  // the load policies see
};

// One worker's load bookkeeping: its live leases ordered by acquisition time, its last snapshot,
// and how many live leases were acquired after that snapshot, so that the effective load reads in
// O(1), a lease is added or released in O(log n), a newer snapshot costs amortised O(1) per lease
// it absorbs, and the oldest leases can be expired in order. Not thread-safe: the Router guards
// its accounts with its routing mutex.
class WorkerLoadAccount {
 public:
  // Identifies one live lease within the account (valid until it is released).
  using LeaseHandle = std::set<std::pair<absl::Time, uint64_t>>::const_iterator;

  WorkerLoadAccount() = default;
  // Handles point into the account: it is never copied or moved.
  WorkerLoadAccount(const WorkerLoadAccount&) = delete;
  WorkerLoadAccount& operator=(const WorkerLoadAccount&) = delete;

  int64_t leases() const { return static_cast<int64_t>(leases_.size()); }

  // Records lease `lease_id` acquired at `acquired`. Times may arrive slightly out of order
  // (callers read their clocks before taking the lock); ids must be unique within the account.
  LeaseHandle OnAcquire(absl::Time acquired, uint64_t lease_id);
  // Forgets a live lease.
  void OnRelease(LeaseHandle lease);
  // Stores `snapshot` unless an equally new or newer one is stored; returns whether it was stored.
  bool OnReport(const LoadSnapshot& snapshot);

  // The live lease acquired first; only valid when leases() > 0.
  LeaseHandle Oldest() const { return leases_.begin(); }

  bool SnapshotFresh(absl::Time now, absl::Duration staleness) const;
  // Fresh snapshot: running + waiting + leases acquired after it; otherwise the lease count.
  double Effective(absl::Time now, absl::Duration staleness) const;
  WorkerLoad Describe(absl::Time now, absl::Duration staleness) const;

 private:
  std::set<std::pair<absl::Time, uint64_t>> leases_;  // (acquired, lease id), oldest first
  std::optional<LoadSnapshot> snapshot_;
  // With a snapshot: the first lease acquired after it (end() when none), and how many live
  // leases from there on. The snapshot time only grows, so the cursor only moves forward.
  LeaseHandle first_after_snapshot_ = leases_.end();
  int64_t leases_after_snapshot_ = 0;
};

}  // namespace eldr

#endif  // ELDR_CORE_WORKER_LOAD_H_
