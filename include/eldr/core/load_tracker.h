// Per-worker load as the router sees it: leases it handed out plus what workers report.
//
// A lease is taken for every routed request and released by its completion, or expires after a
// TTL so a lost completion cannot leak load forever. A worker's report is a snapshot with a
// timestamp: effective load = snapshot (running + waiting) + leases acquired after the snapshot.
// A snapshot older than the staleness limit is ignored (the lease count alone is used), so a
// worker whose reports stop is never treated as idle.
//
// Thread-safe: every method may be called from any thread.
#ifndef ELDR_LOAD_TRACKER_H_
#define ELDR_LOAD_TRACKER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "eldr/common/mutex.h"

namespace eldr {

struct LoadTrackerOptions {
  absl::Duration lease_ttl = absl::Minutes(10);       // a lease older than this expires
  absl::Duration snapshot_staleness = absl::Seconds(5);  // older snapshots are ignored
};

// What a decode worker reports (pushed over ReportLoad or scraped from its metrics).
struct LoadSnapshot {
  double running = 0;    // requests decoding
  double waiting = 0;    // requests queued
  double kv_usage = 0;   // fraction of KV cache in use, [0, 1]
  absl::Time taken_at;   // when the worker measured it
};

struct WorkerLoad {
  int64_t leases = 0;                    // live leases of this worker
  int64_t leases_since_snapshot = 0;     // of which acquired after the last fresh snapshot
  std::optional<LoadSnapshot> snapshot;  // last snapshot, fresh or not
  bool snapshot_fresh = false;
  double effective = 0;                  // the load policies see
};

// Rejects negative or non-finite running/waiting/kv_usage and an infinite taken_at
// (INVALID_ARGUMENT naming the field).
absl::Status ValidateLoadSnapshot(const LoadSnapshot& snapshot);

// One worker's load bookkeeping: the acquisition times of its live leases, its last snapshot and
// how many live leases were acquired after that snapshot, so the effective load reads in O(1).
// A building block for LoadTracker and the Router's worker table; not thread-safe by itself.
class WorkerLoadAccount {
 public:
  int64_t leases() const { return static_cast<int64_t>(lease_times_.size()); }

  // Records a lease acquired at `acquired`. Times may arrive slightly out of order (callers read
  // their own clocks before taking the lock).
  void OnAcquire(absl::Time acquired);
  // Forgets one lease acquired at `acquired` (no-op when there is none).
  void OnRelease(absl::Time acquired);
  // Stores `snapshot` unless an equally new or newer one is stored; returns whether it was stored.
  bool OnReport(const LoadSnapshot& snapshot);

  bool SnapshotFresh(absl::Time now, absl::Duration staleness) const;
  // Fresh snapshot: running + waiting + leases acquired after it; otherwise the lease count.
  double Effective(absl::Time now, absl::Duration staleness) const;
  WorkerLoad Describe(absl::Time now, absl::Duration staleness) const;

 private:
  std::vector<absl::Time> lease_times_;  // sorted ascending
  std::optional<LoadSnapshot> snapshot_;
  int64_t leases_after_snapshot_ = 0;
};

class LoadTracker {
 public:
  explicit LoadTracker(LoadTrackerOptions options = {});

  const LoadTrackerOptions& options() const { return options_; }

  // Registers a worker (idempotent). Loads of unknown workers are NOT_FOUND.
  void AddWorker(const std::string& worker);
  // Forgets a worker and releases its leases; returns how many were dropped.
  int64_t RemoveWorker(const std::string& worker);

  // Takes a lease on `worker` at `now`. NOT_FOUND for an unknown worker. Lease ids are unique and
  // never reused during the tracker's life.
  absl::StatusOr<uint64_t> Acquire(const std::string& worker, absl::Time now);
  // Releases a live lease and returns its worker. NOT_FOUND when it is unknown, already released
  // or expired: never a double release.
  absl::StatusOr<std::string> Release(uint64_t lease_id);
  // Expires leases acquired before now - lease_ttl; returns how many.
  int64_t ExpireLeases(absl::Time now);

  // Stores a snapshot. NOT_FOUND for an unknown worker; INVALID_ARGUMENT for negative or
  // non-finite values. A snapshot older than the stored one is ignored (reports can reorder).
  absl::Status Report(const std::string& worker, const LoadSnapshot& snapshot);

  // Effective loads of `workers` at `now`, in order (0 leases for unknown ones), under one lock.
  std::vector<double> EffectiveLoads(const std::vector<std::string>& workers, absl::Time now) const;
  absl::StatusOr<WorkerLoad> Get(const std::string& worker, absl::Time now) const;

  int64_t live_leases() const;
  int64_t expired_total() const;

 private:
  struct Lease {
    std::string worker;
    absl::Time acquired;
  };
  const LoadTrackerOptions options_;
  mutable Mutex mu_;
  uint64_t next_lease_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t expired_total_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, WorkerLoadAccount> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eldr

#endif  // ELDR_LOAD_TRACKER_H_
