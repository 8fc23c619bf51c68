// Online refit inside the daemon: a BackgroundComponent owning an eldr::OnlineRefitter
// (include/eldr/refit/refit.h), which keeps the Router's centroids current as traffic drifts and as
// workers come and go, persists them under state_dir, and exports its counters.
//
// Enabled when refit_interval > 0 or state_dir is set. At Start it creates the refitter (which
// subscribes to the router: routed signatures feed its window, announced pool changes and reloads
// reach it without polling), then installs the persisted centroids through the one door
// (CentroidSource::kStateDir) when they match the configured artifact's transform, so a restart
// keeps what was learned while the configured artifact stays the calibrated anchor of the drift
// bound, and starts the refitter's thread. Every refit is logged (refit_installed at info,
// refit_failed at warning, skips at debug); installs are also logged and counted by the server's
// observer like any other source.
//
// Metrics (read from RefitStats at scrape time):
//   eldr_refits_started_total, eldr_refits_completed_total, eldr_refits_failed_total,
//   eldr_refits_skipped_total, eldr_refit_last_duration_seconds, eldr_refit_window_signatures,
//   eldr_refit_window_bytes, eldr_refit_window_capacity_signatures, eldr_refit_window_clients,
//   eldr_refit_signatures_sampled_out_total, eldr_refit_signatures_client_limited_total,
//   eldr_refit_rows_bounded_total{bound}.
#ifndef ELDR_SERVER_REFIT_COMPONENT_H_
#define ELDR_SERVER_REFIT_COMPONENT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

#include "server/config.h"
#include "server/server.h"

namespace eldr::server {

// True when the settings ask for online refit (see above).
bool RefitEnabled(const ServerOptions& options);

// Whether this replica may refit now. Shared with the cluster component (cluster_component.h),
// which closes it on followers: the refitter then skips its refits (RefitOptions::may_refit), so
// only the cluster's refit leader fits and publishes. Open by default (no cluster).
//
// It also carries the shared refit window into the refitter: while the refit component runs, the
// cluster component hands it the signatures the other replicas appended (leader only).
class RefitGate {
 public:
  using Observer = std::function<void(absl::Span<const float> signature, absl::string_view client)>;

  std::atomic<bool> open{true};

  // Set by the refit component while its refitter runs (null: none).
  void SetObserver(Observer observer) {
    absl::MutexLock lock(&mu_);
    observer_ = std::move(observer);
  }
  // Offers a signature to the refitter's window; false when no refitter runs.
  bool Observe(absl::Span<const float> signature, absl::string_view client) {
    absl::MutexLock lock(&mu_);
    if (!observer_) return false;
    observer_(signature, client);
    return true;
  }

 private:
  absl::Mutex mu_;
  Observer observer_ ABSL_GUARDED_BY(mu_);
};

// For ServerExtensions::components: the refit component, or none when RefitEnabled is false.
// `gate` (may be null: always refit) is asked before each refit and before its install.
ComponentFactory RefitComponentFactory(std::shared_ptr<RefitGate> gate = nullptr);

}  // namespace eldr::server

#endif  // ELDR_SERVER_REFIT_COMPONENT_H_
