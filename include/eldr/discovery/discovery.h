// Kubernetes pod discovery for a worker pool: what eldr-router (decode pods) and eldr-proxy
// (prefill pods) run to keep their pool equal to the ready pods matching a label selector.
//
//   PodWatcher (thread "watcher"): LIST + WATCH pods -> PodSnapshot
//     -> WorkerFromPod per pod (MappingOptions, annotations) -> the desired workers
//   PoolReconciler (thread "reconciler"): desired workers -> Upsert / Drain / Remove on the sink,
//     debounced (ReconcilerOptions::settle), retried on sink errors.
//
// The sink is called from the reconciler thread only, one call at a time, never with a lock of
// this object held: it may take its time (a router mutation) without delaying the watch. Only the
// latest desired set matters: sets published while the reconciler is busy are coalesced.
// Nothing is ever removed from the pool because the API server is unreachable or answers garbage:
// the last known set stays until a LIST or watch says otherwise.
//
// Metrics (on the given registry, every series labelled role=<options.role>):
//   eldr_discovery_workers{state="ready|not_ready|terminating"}    gauge, the desired set
//   eldr_discovery_watch_restarts_total{reason="closed|gone|error|silence|parse"}
//   eldr_discovery_errors_total{kind="unreachable|http|auth|parse|annotation|sink"}: transport
//                                         failures, HTTP error statuses, 401/403 (or an unreadable
//                                         token file), invalid lists or events, problems of a pod's
//                                         mapping (an eldr.io/ annotation ignored, a running pod whose
//                                         port does not resolve: each counted once when it appears),
//                                         failed sink calls
//   eldr_discovery_last_sync_age_seconds  gauge: seconds since the last successful LIST, event or
//                                         bookmark (since Start before the first), updated every
//                                         second
//   eldr_discovery_pool_changes_total{action="upsert|drain|remove"}  successful sink calls
//   eldr_discovery_synced                 gauge 0/1, PodWatcherStats::synced
//
// Thread-safety: every method may be called from any thread (Start/Stop not concurrently with
// each other's destruction). The log callback is called from the watcher and reconciler threads,
// possibly at once.
#ifndef ELDR_DISCOVERY_DISCOVERY_H_
#define ELDR_DISCOVERY_DISCOVERY_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "eldr/discovery/kube_client.h"
#include "eldr/discovery/kube_config.h"
#include "eldr/discovery/pod.h"
#include "eldr/discovery/pod_watcher.h"
#include "eldr/discovery/pool_reconciler.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace eldr::discovery {

enum class LogSeverity { kInfo, kWarning, kError };
absl::string_view LogSeverityName(LogSeverity severity);  // "info", "warning", "error"

struct KubernetesDiscoveryOptions {
  KubeApiConfig api;
  KubeClientOptions client;
  // The namespace to watch; empty: api.namespace_ (the service account's or the context's).
  std::string namespace_;
  // Which pods are workers (required: an empty selector would take every pod of the namespace).
  std::string label_selector;
  MappingOptions mapping;
  // namespace_ and label_selector above override the watcher's own.
  PodWatcherOptions watcher;
  // on_change is set by the discovery (logs and metrics); one given here is called too.
  ReconcilerOptions reconciler;
  // The `role` label of the metrics ("decode" or "prefill"; any non-empty label value).
  std::string role = "decode";
  // Receives one line per event (list ok, watch restarted, errors, pool changes, annotation
  // problems). May be empty.
  std::function<void(LogSeverity severity, const std::string& message)> log;
};

struct DiscoveryStatus {
  bool started = false;
  bool synced = false;                  // PodWatcherStats::synced
  std::optional<absl::Time> last_sync;  // last successful LIST, event or bookmark
  std::string resource_version;
  std::array<int64_t, 3> workers{};  // the desired set by DiscoveredWorker::State (ready, not_ready, terminating)
  size_t pods = 0;                   // pods matched, workers or not
  size_t applied = 0;                // workers in the pool as the sink was told
  size_t pending = 0;                // workers with a transition waiting (settle or retry)
  std::string last_error;            // last failure (watch, list, sink), kept after recovery
  PodWatcherStats watcher;
  ReconcilerStats reconciler;
};

class KubernetesDiscovery {
 public:
  // `sink` must outlive the discovery; so must `registry` (may be null: no metrics).
  // INVALID_ARGUMENT for bad options (api, mapping, watcher, an empty label selector, no namespace
  // at all, an empty role); the errors of KubeClient::Create.
  static absl::StatusOr<std::unique_ptr<KubernetesDiscovery>> Create(KubernetesDiscoveryOptions options, PoolSink* sink,
                                                                     prometheus::Registry* registry);
  // Stops first.
  virtual ~KubernetesDiscovery() = default;

  // Starts both threads. FAILED_PRECONDITION when already started.
  virtual absl::Status Start() = 0;
  // Stops both threads within about a second, even mid-watch or mid-backoff (a sink call in
  // progress finishes first). Transitions still waiting are dropped; the pool keeps what was
  // applied. Idempotent.
  virtual void Stop() = 0;
  virtual DiscoveryStatus Status() const = 0;
};

}  // namespace eldr::discovery

#endif  // ELDR_DISCOVERY_DISCOVERY_H_
