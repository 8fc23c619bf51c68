// Prometheus metrics of the daemon (names, labels and meaning in docs/api.md, "Metrics").
//
// Two kinds of metrics:
//  - event metrics updated on the request path (route counts and latency, rejections, fallbacks,
//    completions, reports, reloads, admin refusals). Every labelled series is created up front and
//    its Counter/Histogram pointer cached in a flat array indexed by enum, so a Route does a few
//    atomic increments and one histogram observation: no map lookup, no string building;
//  - state metrics read at scrape time from Router::GetState (per-worker in-flight, reported load
//    and its age, centroid generation, live and expired leases) and from /proc (process_*), so
//    workers that come and go need no bookkeeping and cost nothing between scrapes.
//
// Extension: other components register their own families in registry() (or a Collectable with
// AddCollectable) and they appear on the same /metrics page.
//
// Thread-safety: Record* methods may be called from any thread concurrently. AttachRouter,
// AddCollectable and Start/StopExposer are called by the owner during startup/shutdown.
#ifndef ELDR_SERVER_METRICS_H_
#define ELDR_SERVER_METRICS_H_

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "eldr/core/errors.h"
#include "eldr/core/policy.h"
#include "eldr/core/router.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace eldr::server {

// Outcome label of eldr_route_requests_total.
enum class RouteOutcome {
  kOk,           // routed by the configured policy
  kFallback,     // routed, but by the fallback (fallback_reason set)
  kInvalid,      // rejected input (INVALID_ARGUMENT / RESOURCE_EXHAUSTED)
  kUnavailable,  // no worker could take it
  kError,        // anything else
};
absl::string_view RouteOutcomeLabel(RouteOutcome outcome);

// Bucket upper bounds of eldr_route_duration_seconds: 1 us .. 10 ms, denser where decisions land.
const std::vector<double>& RouteDurationBuckets();

class ServerMetrics {
 public:
  ServerMetrics();
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // For components that add their own metric families.
  prometheus::Registry& registry() { return *registry_; }
  // Adds a collectable read at every scrape (kept alive by the metrics object).
  void AddCollectable(std::shared_ptr<prometheus::Collectable> collectable);
  // Adds the scrape-time router state and process metrics. `router` must outlive every scrape:
  // the owner stops the exposer before destroying the router.
  void AttachRouter(const Router* router);

  // Serves /metrics on `listen` (host:port; port 0 picks one) and returns the bound port.
  absl::StatusOr<int> StartExposer(const std::string& listen);
  void StopExposer();

  // ---- Request path ----
  void RecordRoute(const RouteResult& result, double seconds);
  // A Route that failed with `status` under the configured `policy`; counts the rejection reason
  // for input errors.
  void RecordRouteFailure(PolicyKind policy, const absl::Status& status, double seconds);
  void RecordRejected(RejectReason reason);
  void RecordComplete(bool released);
  void RecordLoadReport(bool accepted);
  void RecordReload(bool ok);
  // Admin RPCs refused by the token check: `missing` token (UNAUTHENTICATED) or wrong one.
  void RecordAdminRefused(bool missing);

  // Everything a scrape would return, in the text exposition format (tests, debugging).
  std::string RenderText() const;

 private:
  static constexpr int kNumPolicies = 5;
  static constexpr int kNumOutcomes = 5;
  static constexpr int kNumFallbacks = 7;
  static constexpr int kNumRejectReasons = 9;

  std::vector<std::weak_ptr<prometheus::Collectable>> AllCollectables() const;

  std::shared_ptr<prometheus::Registry> registry_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_;
  std::unique_ptr<prometheus::Exposer> exposer_;

  std::array<std::array<prometheus::Counter*, kNumOutcomes>, kNumPolicies> route_requests_{};
  prometheus::Histogram* route_duration_ = nullptr;
  prometheus::Histogram* band_size_ = nullptr;
  prometheus::Histogram* similarity_ = nullptr;
  std::array<prometheus::Counter*, kNumFallbacks> fallbacks_{};
  std::array<prometheus::Counter*, kNumRejectReasons> rejected_{};
  prometheus::Counter* complete_ok_ = nullptr;
  prometheus::Counter* complete_not_found_ = nullptr;
  prometheus::Counter* reports_accepted_ = nullptr;
  prometheus::Counter* reports_rejected_ = nullptr;
  prometheus::Counter* reloads_ok_ = nullptr;
  prometheus::Counter* reloads_error_ = nullptr;
  prometheus::Counter* admin_unauthenticated_ = nullptr;
  prometheus::Counter* admin_permission_denied_ = nullptr;
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_METRICS_H_
