// The daemon's operations HTTP endpoint (Triton-style: its own port, apart from the data plane):
//   GET /metrics  Prometheus text exposition of every metric the daemon exports
//   GET /healthz  200 "ok" while the process is alive and not shutting down (Kubernetes liveness)
//   GET /readyz   200 "ready" while the router is ready to route, else 503 (readiness)
// HEAD works on all three; any other method is 405, any other path 404 (eldr::http::HttpRouter).
// Served by eldr::http::HttpServer, asynchronous, with connection, header, body and time limits,
// so stray requests, port scans and idle or slow connections never disturb a scrape.
//
// Its own traffic is exported too (eldr_http_*), through the collector returned by StatsCollector().
//
// Thread-safety: Start and Stop are called by the owner; the callbacks run on the HTTP io threads.
#ifndef ELDR_SERVER_OPS_HTTP_H_
#define ELDR_SERVER_OPS_HTTP_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "eldr/http/http_server.h"
#include "prometheus/collectable.h"
#include "server/metrics.h"

namespace eldr::server {

class OpsHttpEndpoint {
 public:
  // Exports the counters of whatever endpoint is attached (none: nothing). Register it with
  // ServerMetrics before the endpoint starts; Start attaches, Stop detaches.
  static std::shared_ptr<prometheus::Collectable> StatsCollector();

  // Binds `options.listen` and serves. `ready` and `live` answer /readyz and /healthz.
  static absl::StatusOr<std::unique_ptr<OpsHttpEndpoint>> Start(http::HttpServerOptions options,
                                                                const ServerMetrics* metrics,
                                                                std::function<bool()> ready, std::function<bool()> live,
                                                                std::shared_ptr<prometheus::Collectable> stats);
  ~OpsHttpEndpoint();  // Stop()s

  int port() const { return server_->port(); }
  // Closes the listener and every connection (bounded, well under a second). Idempotent.
  void Stop();

 private:
  OpsHttpEndpoint(std::unique_ptr<http::HttpServer> server, std::shared_ptr<prometheus::Collectable> stats)
      : server_(std::move(server)), stats_(std::move(stats)) {}

  std::unique_ptr<http::HttpServer> server_;
  std::shared_ptr<prometheus::Collectable> stats_;
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_OPS_HTTP_H_
