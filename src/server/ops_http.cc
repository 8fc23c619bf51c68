#include "server/ops_http.h"

#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "eldr/metrics/prometheus.h"

namespace eldr::server {
namespace {

http::HttpResponse TextResponse(int status, std::string body) {
  http::HttpResponse response;
  response.status = status;
  response.body = std::move(body);
  response.headers.emplace_back("Cache-Control", "no-store");
  return response;
}

}  // namespace

std::shared_ptr<prometheus::Collectable> OpsHttpEndpoint::StatsCollector() {
  return std::make_shared<metrics::HttpServerCollector>("eldr_http", "the operations HTTP endpoint");
}

absl::StatusOr<std::unique_ptr<OpsHttpEndpoint>> OpsHttpEndpoint::Start(
    http::HttpServerOptions options, const ServerMetrics* metrics, std::function<bool()> ready,
    std::function<bool()> live, std::shared_ptr<prometheus::Collectable> stats) {
  http::HttpRouter routes;
  routes.Handle("/metrics", {"GET"}, [metrics](const http::HttpRequest&) {
    http::HttpResponse response = TextResponse(200, metrics->RenderText());
    response.content_type = metrics::kPrometheusTextType;
    return response;
  });
  routes.Handle("/healthz", {"GET"}, [live](const http::HttpRequest&) {
    return live() ? TextResponse(200, "ok\n") : TextResponse(503, "shutting down\n");
  });
  routes.Handle("/readyz", {"GET"}, [ready](const http::HttpRequest&) {
    return ready() ? TextResponse(200, "ready\n") : TextResponse(503, "not ready\n");
  });
  const std::string listen = options.listen;
  absl::StatusOr<std::unique_ptr<http::HttpServer>> server =
      http::HttpServer::Create(std::move(options), std::move(routes));
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat("metrics_listen ", listen, ": ", server.status().message()));
  }
  if (absl::Status started = (*server)->Start(); !started.ok()) {
    return absl::Status(started.code(), absl::StrCat("metrics_listen ", listen, ": ", started.message()));
  }
  if (auto* collector = dynamic_cast<metrics::HttpServerCollector*>(stats.get())) collector->Attach(server->get());
  return std::unique_ptr<OpsHttpEndpoint>(new OpsHttpEndpoint(*std::move(server), std::move(stats)));
}

OpsHttpEndpoint::~OpsHttpEndpoint() { Stop(); }

void OpsHttpEndpoint::Stop() {
  if (auto* collector = dynamic_cast<metrics::HttpServerCollector*>(stats_.get())) collector->Attach(nullptr);
  if (server_ != nullptr) server_->Stop();
}

}  // namespace eldr::server
