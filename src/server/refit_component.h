// Online refit inside the daemon: a BackgroundComponent owning an eldr::OnlineRefitter
// (include/eldr/refit/refit.h) that keeps the Router's centroids current as traffic drifts and as
// workers come and go, persists them under `state_dir`, and exports its counters.
//
// Enabled when refit_interval_s > 0 or state_dir is set. At Start it installs the persisted
// centroids (OnlineRefitter::LoadStartupCentroids) when they match the configured artifact's
// transform, so a restart keeps what was learned; then it attaches the refitter to the router's
// signature callback and starts the periodic refit.
//
// Pool changes and reloads are picked up by a watcher thread that polls the Router every 250 ms
// (the same pattern as the load scraper), so the admin RPCs need no refit-specific code: a worker
// that became active gets OnWorkerAdded, one that was removed or started draining gets
// OnWorkerRemoved, and a centroid generation the refitter did not install (a reload) empties the
// window when it changed the transform. Errors there are logged, never surfaced to an RPC.
//
// Metrics (read from RefitStats at scrape time):
//   eldr_refits_started_total, eldr_refits_completed_total, eldr_refits_failed_total,
//   eldr_refits_skipped_total, eldr_refit_last_duration_seconds, eldr_refit_window_signatures.
#ifndef ELDR_SERVER_REFIT_COMPONENT_H_
#define ELDR_SERVER_REFIT_COMPONENT_H_

#include "server/config.h"
#include "server/server.h"

namespace eldr::server {

// True when the settings ask for online refit (see above).
bool RefitEnabled(const ServerOptions& options);

// When RefitEnabled(options): sets extensions->on_signature to the refitter's feed and appends the
// refit component's factory. Otherwise leaves `extensions` unchanged. on_signature must be unset.
void AddRefitComponent(const ServerOptions& options, ServerExtensions* extensions);

}  // namespace eldr::server

#endif  // ELDR_SERVER_REFIT_COMPONENT_H_
