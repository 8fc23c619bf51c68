// The Prometheus metrics of eldr-proxy (names, labels and meaning: docs/proxy.md, "Metrics").
//
// Labels are low-cardinality: `policy` is the policy that decided a request's decode worker
// (eldr-router's answer: eldr, jsq, rr, random, p2c; or "static" when the proxy picked from its
// own list), `decision` how (locality: eldr by signature; fallback: eldr-router fell back to load;
// baseline: the A/B baseline arm; static: the router could not be reached), `endpoint`
// completions or chat, `outcome` a closed set.
//
// Thread-safety: every method may be called from any thread.
#ifndef ELDR_PROXY_PROXY_METRICS_H_
#define ELDR_PROXY_PROXY_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace eldr::proxy {

// eldr_proxy_requests_total{endpoint, outcome}.
enum class RequestOutcome {
  kOk,             // the engine's answer went to the client to its end (whatever its status)
  kClientError,    // refused before any upstream call: 400, 413
  kOverloaded,     // refused: max_in_flight, or draining (503)
  kUpstreamError,  // an engine or the routing failed (502, 503, 504, or an error mid-stream)
  kClientGone,     // the client left before the end
};

class ProxyMetrics {
 public:
  ProxyMetrics();
  ProxyMetrics(const ProxyMetrics&) = delete;
  ProxyMetrics& operator=(const ProxyMetrics&) = delete;

  void RecordRequest(absl::string_view endpoint, RequestOutcome outcome);
  // Latencies the proxy observes of one answered request (seconds); ttft/tpot < 0: not measured
  // (a non-streamed answer, fewer than two tokens).
  void RecordLatency(absl::string_view policy, absl::string_view decision, double ttft, double tpot, double e2e,
                     int64_t output_tokens);
  void RecordPrefillRetry();
  void RecordDecodeReroute();
  void RecordStaticRoute();
  // eldr_proxy_router_calls_total{method="route|complete", code="OK|UNAVAILABLE|..."}.
  void RecordRouterCall(absl::string_view method, absl::string_view code);
  // The RouteStream transport of the router client: eldr_proxy_router_stream_opens_total (calls
  // started), eldr_proxy_router_streams_open (gauge), eldr_proxy_router_unary_fallbacks_total{
  // reason="unimplemented|reconnecting"} (messages sent unary instead).
  void RecordRouterStreamOpen();
  void SetRouterStreamsOpen(int64_t open);
  void RecordRouterUnaryFallback(absl::string_view reason);
  // eldr_proxy_signatures_total{source="eldr_expert_counts|eldr_sig|none|invalid|refused"}.
  void RecordSignature(absl::string_view source);
  // eldr_proxy_upstream_errors_total{phase="prefill|decode", kind="connect|timeout|http_4xx|
  // http_5xx|malformed|mid_stream|slow_client"}.
  void RecordUpstreamError(absl::string_view phase, absl::string_view kind);
  void SetInFlight(int64_t in_flight);

  // Scrape-time families of other components (prefill loads, the HTTP servers, process_*).
  void AddCollectable(std::shared_ptr<prometheus::Collectable> collectable);
  std::string RenderText() const;
  // For components that register their own families (service discovery's eldr_discovery_*).
  prometheus::Registry& registry() { return *registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& ttft_;
  prometheus::Family<prometheus::Histogram>& tpot_;
  prometheus::Family<prometheus::Histogram>& e2e_;
  prometheus::Family<prometheus::Counter>& output_tokens_;
  prometheus::Counter& prefill_retries_;
  prometheus::Counter& decode_reroutes_;
  prometheus::Counter& static_routes_;
  prometheus::Family<prometheus::Counter>& router_calls_;
  prometheus::Family<prometheus::Counter>& signatures_;
  prometheus::Family<prometheus::Counter>& upstream_errors_;
  prometheus::Counter& router_stream_opens_;
  prometheus::Gauge& router_streams_open_;
  prometheus::Family<prometheus::Counter>& router_unary_fallbacks_;
  prometheus::Gauge& in_flight_;
  mutable absl::Mutex collectables_mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_ ABSL_GUARDED_BY(collectables_mu_);
};

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_PROXY_METRICS_H_
