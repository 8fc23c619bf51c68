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
//   eldr_refit_window_clients, eldr_refit_signatures_sampled_out_total,
//   eldr_refit_signatures_client_limited_total, eldr_refit_rows_bounded_total{bound}.
#ifndef ELDR_SERVER_REFIT_COMPONENT_H_
#define ELDR_SERVER_REFIT_COMPONENT_H_

#include "server/config.h"
#include "server/server.h"

namespace eldr::server {

// True when the settings ask for online refit (see above).
bool RefitEnabled(const ServerOptions& options);

// For ServerExtensions::components: the refit component, or none when RefitEnabled is false.
ComponentFactory RefitComponentFactory();

}  // namespace eldr::server

#endif  // ELDR_SERVER_REFIT_COMPONENT_H_
