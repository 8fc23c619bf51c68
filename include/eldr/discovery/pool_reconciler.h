// Turns the discovered workers (the desired pool) into changes on a pool (a Router, a proxy's
// prefill set), with a debounce so a flapping pod cannot cause a storm of pool changes (each of
// which may trigger a refit downstream).
//
// Rules, per worker id (the pod name):
//  - Transitions that stop routing are applied at once:
//      ready -> not ready or terminating: Drain (once; a draining worker is not drained again);
//      absent from the desired set: Remove;
//      a new uid for an applied id (the pod was replaced, e.g. a StatefulSet pod recreated with a
//      new IP): Remove the old one at once; the new one is then a new worker.
//  - Transitions that start routing are applied only once the worker's desired state (state,
//    spec, uid) has stayed unchanged for `settle`:
//      a new ready worker, not ready -> ready (un-drain), a changed address / capacity /
//      max_inflight / metrics_url of a ready worker: Upsert.
//    So a pod flapping ready/not-ready every 200 ms is drained once and upserted again only after
//    it stayed ready for `settle`.
//  - A worker that is not ready and not applied is not added at all (it cannot take routes).
//  - The first Update after construction applies its ready workers at once unless
//    settle_initial (a starting daemon has no history to debounce against).
//  - A sink call that fails is counted and retried by the first Tick at or after retry_interval
//    (doubling per consecutive failure of that worker, up to max_retry_interval), under the same
//    rules (so what it retries is what is due by then).
//
// Time is passed in by the caller (Update, Tick): the reconciler reads no clock, so tests drive
// it with a fake one. The caller Ticks at NextDeadline() (and may Tick more often).
//
// Thread-safety: none; the caller serialises every call (KubernetesDiscovery calls it, and so the
// sink, from one thread only).
#ifndef ELDR_DISCOVERY_POOL_RECONCILER_H_
#define ELDR_DISCOVERY_POOL_RECONCILER_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "eldr/core/router.h"
#include "eldr/discovery/pod.h"

namespace eldr::discovery {

// The pool the reconciler drives. Calls come from the reconciler's caller thread only.
class PoolSink {
 public:
  virtual ~PoolSink() = default;
  // Adds the worker, updates its spec, or makes a draining worker active again.
  virtual absl::Status Upsert(const WorkerSpec& spec) = 0;
  // No new routes to the worker; its in-flight work finishes.
  virtual absl::Status Drain(const std::string& id) = 0;
  // Forgets the worker.
  virtual absl::Status Remove(const std::string& id) = 0;
};

enum class PoolAction { kUpsert, kDrain, kRemove };
inline constexpr int kNumPoolActions = 3;
absl::string_view PoolActionLabel(PoolAction action);  // "upsert", "drain", "remove"

struct ReconcilerOptions {
  // How long a worker's desired state must stay unchanged before a transition that starts routing
  // to it is applied. Zero: at once.
  absl::Duration settle = absl::Seconds(1);
  // Debounce the first Update too (false: its ready workers are upserted at once).
  bool settle_initial = false;
  // A failed sink call is retried no sooner than this after the failure (> 0); each further
  // consecutive failure of the same worker doubles the wait, up to max_retry_interval.
  absl::Duration retry_interval = absl::Milliseconds(500);
  absl::Duration max_retry_interval = absl::Seconds(30);
  // Called after every sink call (on the caller's thread) with its result: for logs and metrics.
  std::function<void(PoolAction action, const std::string& id, const absl::Status& result)> on_change;
};

struct ReconcilerStats {
  std::array<int64_t, kNumPoolActions> applied{};  // successful sink calls, by PoolAction
  std::array<int64_t, kNumPoolActions> failed{};   // failed sink calls, by PoolAction
  size_t pending = 0;                              // workers with a transition not applied yet
};

class PoolReconciler {
 public:
  // What the sink was last told about a worker.
  struct Applied {
    WorkerSpec spec;
    std::string uid;
    bool draining = false;
  };

  // `sink` must outlive the reconciler.
  PoolReconciler(PoolSink* sink, ReconcilerOptions options);

  // The whole desired set (one entry per id; a later duplicate id is ignored) as seen at `now`.
  // Applies the stop-routing transitions at once and the settled start-routing ones.
  void Update(const std::vector<DiscoveredWorker>& desired, absl::Time now);
  // Applies what became due by `now`: settled transitions and retries.
  void Tick(absl::Time now);
  // When the next Tick has something to do; InfiniteFuture when nothing is pending.
  absl::Time NextDeadline() const;

  // The pool as the sink was told, by worker id.
  const std::map<std::string, Applied>& applied() const { return applied_; }
  ReconcilerStats stats() const;
  const ReconcilerOptions& options() const { return options_; }

 private:
  struct Desired {
    WorkerSpec spec;
    DiscoveredWorker::State state = DiscoveredWorker::State::kNotReady;
    std::string uid;
  };
  struct Entry {
    std::optional<Desired> desired;              // nullopt: absent from the desired set
    absl::Time since;                            // when `desired` last changed
    absl::Time retry_at = absl::InfinitePast();  // no sink call before this (after a failure)
    int failures = 0;                            // consecutive failed sink calls
  };

  // Brings one worker as close to its desired state as the rules allow at `now`; true when the
  // entry is finished with (nothing desired, nothing applied) and may be forgotten.
  bool Reconcile(const std::string& id, Entry& entry, absl::Time now);
  // Whether `entry` still has a transition to apply, and when it is due.
  std::optional<absl::Time> Due(const std::string& id, const Entry& entry) const;
  bool Call(PoolAction action, const std::string& id, const WorkerSpec* spec, Entry& entry, absl::Time now);

  PoolSink* const sink_;
  const ReconcilerOptions options_;
  bool first_update_ = true;
  std::map<std::string, Entry> entries_;
  std::map<std::string, Applied> applied_;
  ReconcilerStats stats_;
};

}  // namespace eldr::discovery

#endif  // ELDR_DISCOVERY_POOL_RECONCILER_H_
