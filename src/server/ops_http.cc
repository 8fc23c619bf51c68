#include "server/ops_http.h"

#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/prometheus_util.h"

namespace eldr::server {
namespace {

constexpr char kPrometheusTextType[] = "text/plain; version=0.0.4; charset=utf-8";

// eldr_http_* from the attached server's counters, read at scrape time.
class HttpStatsCollector final : public prometheus::Collectable {
 public:
  void Attach(const http::HttpServer* server) {
    absl::MutexLock lock(&mu_);
    server_ = server;
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    absl::MutexLock lock(&mu_);
    if (server_ == nullptr) return {};
    const http::HttpServerStats stats = server_->stats();
    using prometheus::MetricType;
    auto requests =
        MetricFamily("eldr_http_requests_total", "Requests answered by the operations HTTP endpoint, by status class.",
                     MetricType::Counter);
    AddSample(&requests, static_cast<double>(stats.responses_2xx), {MetricLabel("code", "2xx")});
    AddSample(&requests, static_cast<double>(stats.responses_4xx), {MetricLabel("code", "4xx")});
    AddSample(&requests, static_cast<double>(stats.responses_5xx), {MetricLabel("code", "5xx")});
    auto connections = MetricFamily("eldr_http_connections_total",
                                    "Connections of the operations HTTP endpoint: accepted, refused (over "
                                    "--metrics_max_connections), timed_out (idle or too slow).",
                                    MetricType::Counter);
    AddSample(&connections, static_cast<double>(stats.connections_accepted), {MetricLabel("outcome", "accepted")});
    AddSample(&connections, static_cast<double>(stats.connections_refused), {MetricLabel("outcome", "refused")});
    AddSample(&connections, static_cast<double>(stats.connections_timed_out), {MetricLabel("outcome", "timed_out")});
    auto bad = MetricFamily("eldr_http_bad_requests_total",
                            "Requests refused before routing: malformed (400) or over a size limit (413/414/431).",
                            MetricType::Counter);
    AddSample(&bad, static_cast<double>(stats.malformed_requests), {MetricLabel("reason", "malformed")});
    AddSample(&bad, static_cast<double>(stats.oversized_requests), {MetricLabel("reason", "oversized")});
    std::vector<prometheus::MetricFamily> out;
    out.push_back(std::move(requests));
    out.push_back(std::move(connections));
    out.push_back(std::move(bad));
    out.push_back(SingleSample("eldr_http_open_connections", "Open connections of the operations HTTP endpoint.",
                               MetricType::Gauge, static_cast<double>(stats.open_connections)));
    return out;
  }

 private:
  mutable absl::Mutex mu_;
  const http::HttpServer* server_ ABSL_GUARDED_BY(mu_) = nullptr;
};

http::HttpResponse TextResponse(int status, std::string body) {
  http::HttpResponse response;
  response.status = status;
  response.body = std::move(body);
  response.headers.emplace_back("Cache-Control", "no-store");
  return response;
}

}  // namespace

std::shared_ptr<prometheus::Collectable> OpsHttpEndpoint::StatsCollector() {
  return std::make_shared<HttpStatsCollector>();
}

absl::StatusOr<std::unique_ptr<OpsHttpEndpoint>> OpsHttpEndpoint::Start(
    http::HttpServerOptions options, const ServerMetrics* metrics, std::function<bool()> ready,
    std::function<bool()> live, std::shared_ptr<prometheus::Collectable> stats) {
  http::HttpRouter routes;
  routes.Handle("/metrics", {"GET"}, [metrics](const http::HttpRequest&) {
    http::HttpResponse response = TextResponse(200, metrics->RenderText());
    response.content_type = kPrometheusTextType;
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
  if (auto* collector = dynamic_cast<HttpStatsCollector*>(stats.get())) collector->Attach(server->get());
  return std::unique_ptr<OpsHttpEndpoint>(new OpsHttpEndpoint(*std::move(server), std::move(stats)));
}

OpsHttpEndpoint::~OpsHttpEndpoint() { Stop(); }

void OpsHttpEndpoint::Stop() {
  if (auto* collector = dynamic_cast<HttpStatsCollector*>(stats_.get())) collector->Attach(nullptr);
  if (server_ != nullptr) server_->Stop();
}

}  // namespace eldr::server
