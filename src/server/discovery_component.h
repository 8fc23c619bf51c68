// Kubernetes discovery inside the daemon (discovery=kubernetes): a BackgroundComponent that owns an
// eldr::discovery::KubernetesDiscovery (include/eldr/discovery/discovery.h) watching the decode
// pods that match decode_selector, and applies what it finds to the daemon's Router:
//
//   ready pod (stable for discovery_settle)   UpsertWorker: id = pod name, address = pod IP:worker_port,
//                                            metrics_url from worker_metrics_port/path, capacity and
//                                            max_inflight from the eldr.io/* annotations
//   not ready, or terminating                DrainWorker: no new routes, its leases finish
//   deleted (or replaced: a new uid)         RemoveWorker
//
// The pool then reaches every other part of the daemon the usual way (RouterObserver): the load
// scraper follows it, refit gives a new worker a zone and absorbs a removed one, readiness turns
// true with the first active worker. Nothing is removed because the API server is unreachable,
// slow or answers garbage: the last known pool stays in service (eldr_discovery_errors_total,
// eldr_discovery_last_sync_age_seconds say so).
//
// Centroids: pod names are not known when the centroids are calibrated, so the configured
// artifact (`centroids`) is installed once the pods of the first list joined (at most 5 s after the
// first one), its rows fitted to the pool
// (CentroidLoaderOptions::fit_rows_to_pool: rows named after a pod keep it, the others go to the
// pods in pool order). Without online refit, a pod that joins later takes a row of the configured
// artifact that no worker holds (one that was left over, or whose pod is gone), and a pod that
// leaves frees its row; with refit, refit's elastic pool does that from the traffic (see
// refit_component.h).
//
// Metrics: those of KubernetesDiscovery with role="decode" (eldr_discovery_*), on the daemon's
// registry.
#ifndef ELDR_SERVER_DISCOVERY_COMPONENT_H_
#define ELDR_SERVER_DISCOVERY_COMPONENT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/discovery/discovery.h"
#include "server/config.h"
#include "server/server.h"

namespace eldr::server {

// The KubernetesDiscovery settings of `options` (API server configuration from the kubeconfig or
// the in-cluster service account, selector, namespace, port mapping, settle time).
// INVALID_ARGUMENT / NOT_FOUND naming the setting or file that is wrong.
absl::StatusOr<discovery::KubernetesDiscoveryOptions> KubernetesDiscoveryOptionsFrom(const ServerOptions& options);

// The artifact in service with its rows re-fitted to the pool: rows whose worker is not in `pool`
// (worker ids) are freed; every worker of `takers` (in order; active workers) without a row takes
// the row of `configured` named after it when no kept row holds it, else the first row of
// `configured` that no kept row holds. Nullopt when nothing changes (or nothing
// can: no row would be left, or `configured` has another transform than `current`).
std::optional<CentroidArtifact> RefitRowsToPool(const CentroidArtifact& current, const CentroidArtifact& configured,
                                                const std::vector<std::string>& pool,
                                                const std::vector<std::string>& takers);

// For ServerExtensions::components: the discovery component, or none when discovery=static.
ComponentFactory DiscoveryComponentFactory();

}  // namespace eldr::server

#endif  // ELDR_SERVER_DISCOVERY_COMPONENT_H_
