// Load scraping inside the daemon: a BackgroundComponent that owns an eldr::LoadScraper
// (include/eldr/loadsignals/load_scraper.h) feeding the daemon's Router from the decode workers' Prometheus
// endpoints, logs their health changes, and exports per-worker scrape metrics.
//
// Targets come from the settings: each worker's `metrics_url` in the workers JSON file, overridden
// per worker by `worker_metrics` ("id=url,..."); with discovery=kubernetes, from each discovered
// worker's own metrics_url (its pod IP, worker_metrics_port and path). Only targets whose worker is in the Router's
// pool are scraped; the component follows the router's pool announcements, so a worker removed over the admin API stops
// being scraped (and its health is handed back) and is scraped again when it is added back.
//
// Metrics (label `worker`; `kind` is transport, http or malformed):
//   eldr_scrapes_total{worker,outcome="ok"}            successful scrapes
//   eldr_scrape_errors_total{worker,kind}              failed scrapes
//   eldr_scrape_rejected_reports_total{worker}         snapshots the Router refused
//   eldr_scrape_unhealthy_transitions_total{worker}    times the worker was marked unhealthy
//   eldr_scrape_healthy{worker}                        1 unless the scraper holds it unhealthy
//   eldr_scrape_last_success_age_seconds{worker}       -1 before the first success
//   eldr_scrape_duration_seconds{worker}               of the last completed scrape
// Routes that failed open (every worker unhealthy) are eldr_fallback_total{reason="all_unhealthy"}.
#ifndef ELDR_SERVER_LOAD_SCRAPE_COMPONENT_H_
#define ELDR_SERVER_LOAD_SCRAPE_COMPONENT_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "eldr/loadsignals/load_scraper.h"
#include "server/config.h"
#include "server/server.h"

namespace eldr::server {

// The configured targets (see above), in worker order. INVALID_ARGUMENT names the setting for a
// malformed `worker_metrics`, an id there that is not a configured worker, or a bad URL.
absl::StatusOr<std::vector<ScrapeTarget>> ScrapeTargetsFromOptions(const ServerOptions& options);

// For ServerExtensions::components. With no target configured the component does nothing (and
// exports nothing); configuration errors fail RouterServer::Create.
ComponentFactory LoadScrapeComponentFactory();

}  // namespace eldr::server

#endif  // ELDR_SERVER_LOAD_SCRAPE_COMPONENT_H_
