#include "proxy_metrics.h"

#include <map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/text_serializer.h"

namespace eldr::proxy {
namespace {

absl::string_view OutcomeLabel(RequestOutcome outcome) {
  switch (outcome) {
    case RequestOutcome::kOk:
      return "ok";
    case RequestOutcome::kClientError:
      return "client_error";
    case RequestOutcome::kOverloaded:
      return "overloaded";
    case RequestOutcome::kUpstreamError:
      return "upstream_error";
    case RequestOutcome::kClientGone:
      return "client_gone";
  }
  return "upstream_error";
}

// Time to first token and end to end: 5 ms .. 10 min; time per output token: 1 ms .. 2 s.
const prometheus::Histogram::BucketBoundaries& TtftBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600};
  return *buckets;
}
const prometheus::Histogram::BucketBoundaries& TpotBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.001, 0.0025, 0.005, 0.0075, 0.01,  0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025, 0.0275, 0.03,
      0.035, 0.04,   0.05,  0.06,   0.075, 0.1,    0.15,  0.2,    0.3,  0.5,    0.75,  1,      2};
  return *buckets;
}

}  // namespace

ProxyMetrics::ProxyMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("eldr_proxy_requests_total")
                    .Help("Completions and chat requests by endpoint and outcome.")
                    .Register(*registry_)),
      ttft_(prometheus::BuildHistogram()
                .Name("eldr_proxy_ttft_seconds")
                .Help("Time to first token the proxy observes (streamed answers), by deciding policy and decision.")
                .Register(*registry_)),
      tpot_(prometheus::BuildHistogram()
                .Name("eldr_proxy_tpot_seconds")
                .Help("Time per output token after the first (streamed answers of two tokens or more).")
                .Register(*registry_)),
      e2e_(prometheus::BuildHistogram()
               .Name("eldr_proxy_e2e_seconds")
               .Help("Request arrival to the answer's last byte.")
               .Register(*registry_)),
      output_tokens_(prometheus::BuildCounter()
                         .Name("eldr_proxy_output_tokens_total")
                         .Help("Tokens generated (usage, else counted events), by deciding policy and decision.")
                         .Register(*registry_)),
      prefill_retries_(prometheus::BuildCounter()
                           .Name("eldr_proxy_prefill_retries_total")
                           .Help("Prefill attempts after the first (another instance after a failure).")
                           .Register(*registry_)
                           .Add({})),
      decode_reroutes_(prometheus::BuildCounter()
                           .Name("eldr_proxy_decode_reroutes_total")
                           .Help("Decode workers re-routed after one could not be reached before its answer.")
                           .Register(*registry_)
                           .Add({})),
      static_routes_(prometheus::BuildCounter()
                         .Name("eldr_proxy_static_routes_total")
                         .Help("Requests whose decode worker the proxy picked itself (eldr-router unreachable).")
                         .Register(*registry_)
                         .Add({})),
      router_calls_(prometheus::BuildCounter()
                        .Name("eldr_proxy_router_calls_total")
                        .Help("Calls to eldr-router by method and gRPC status code.")
                        .Register(*registry_)),
      signatures_(prometheus::BuildCounter()
                      .Name("eldr_proxy_signatures_total")
                      .Help("Expert signatures of prefill answers by source: eldr_expert_counts, eldr_sig, none, "
                            "invalid (dropped by the proxy), refused (rejected by the router).")
                      .Register(*registry_)),
      upstream_errors_(prometheus::BuildCounter()
                           .Name("eldr_proxy_upstream_errors_total")
                           .Help("Failures of engine calls by phase (prefill, decode) and kind.")
                           .Register(*registry_)),
      router_stream_opens_(prometheus::BuildCounter()
                               .Name("eldr_proxy_router_stream_opens_total")
                               .Help("RouteStream calls the proxy opened to eldr-router (--router_api=stream): one "
                                     "at the first request, one more after each stream that ended.")
                               .Register(*registry_)
                               .Add({})),
      router_streams_open_(prometheus::BuildGauge()
                               .Name("eldr_proxy_router_streams_open")
                               .Help("RouteStream calls to eldr-router open now.")
                               .Register(*registry_)
                               .Add({})),
      router_unary_fallbacks_(prometheus::BuildCounter()
                                  .Name("eldr_proxy_router_unary_fallbacks_total")
                                  .Help("Route and Complete messages sent as unary RPCs although --router_api=stream, "
                                        "by reason: unimplemented (the router has no RouteStream), reconnecting (the "
                                        "stream is waiting to be re-opened).")
                                  .Register(*registry_)),
      in_flight_(prometheus::BuildGauge()
                     .Name("eldr_proxy_in_flight")
                     .Help("Requests in flight.")
                     .Register(*registry_)
                     .Add({})) {}

void ProxyMetrics::RecordRequest(absl::string_view endpoint, RequestOutcome outcome) {
  requests_.Add({{"endpoint", std::string(endpoint)}, {"outcome", std::string(OutcomeLabel(outcome))}}).Increment();
}

void ProxyMetrics::RecordLatency(absl::string_view policy, absl::string_view decision, double ttft, double tpot,
                                 double e2e, int64_t output_tokens) {
  const std::map<std::string, std::string> labels = {{"policy", std::string(policy)},
                                                     {"decision", std::string(decision)}};
  if (ttft >= 0) ttft_.Add(labels, TtftBuckets()).Observe(ttft);
  if (tpot >= 0) tpot_.Add(labels, TpotBuckets()).Observe(tpot);
  if (e2e >= 0) e2e_.Add(labels, TtftBuckets()).Observe(e2e);
  if (output_tokens > 0) output_tokens_.Add(labels).Increment(static_cast<double>(output_tokens));
}

void ProxyMetrics::RecordPrefillRetry() { prefill_retries_.Increment(); }
void ProxyMetrics::RecordDecodeReroute() { decode_reroutes_.Increment(); }
void ProxyMetrics::RecordStaticRoute() { static_routes_.Increment(); }

void ProxyMetrics::RecordRouterCall(absl::string_view method, absl::string_view code) {
  router_calls_.Add({{"method", std::string(method)}, {"code", std::string(code)}}).Increment();
}

void ProxyMetrics::RecordRouterStreamOpen() { router_stream_opens_.Increment(); }
void ProxyMetrics::SetRouterStreamsOpen(int64_t open) { router_streams_open_.Set(static_cast<double>(open)); }
void ProxyMetrics::RecordRouterUnaryFallback(absl::string_view reason) {
  router_unary_fallbacks_.Add({{"reason", std::string(reason)}}).Increment();
}

void ProxyMetrics::RecordSignature(absl::string_view source) {
  signatures_.Add({{"source", std::string(source)}}).Increment();
}

void ProxyMetrics::RecordUpstreamError(absl::string_view phase, absl::string_view kind) {
  upstream_errors_.Add({{"phase", std::string(phase)}, {"kind", std::string(kind)}}).Increment();
}

void ProxyMetrics::SetInFlight(int64_t in_flight) { in_flight_.Set(static_cast<double>(in_flight)); }

void ProxyMetrics::AddCollectable(std::shared_ptr<prometheus::Collectable> collectable) {
  absl::MutexLock lock(&collectables_mu_);
  collectables_.push_back(std::move(collectable));
}

std::string ProxyMetrics::RenderText() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  std::vector<std::shared_ptr<prometheus::Collectable>> others;
  {
    absl::MutexLock lock(&collectables_mu_);
    others = collectables_;
  }
  for (const auto& collectable : others) {
    std::vector<prometheus::MetricFamily> more = collectable->Collect();
    families.insert(families.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace eldr::proxy
