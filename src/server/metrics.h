// Prometheus metrics of the daemon (names, labels and meaning in docs/api.md, "Metrics").
//
// Served by the daemon's own HTTP endpoint (server/ops_http.h) through RenderText.
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
// AddCollectable is called by the owner during startup.
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

// What a RouteStream message asked for (eldr_route_stream_messages_total{kind}): a Route, a
// Complete, or neither (unparsable, or no oneof member set).
enum class StreamMessageKind { kRoute, kComplete, kNone };

// Bucket upper bounds of eldr_route_stream_batch_size: 0 (empty batches), then powers of two up
// to kMaxStreamBatchLimit.
const std::vector<double>& RouteStreamBatchSizeBuckets();

// Which credential check refused a call (eldr_auth_refused_total{plane}).
enum class AuthPlane { kAdmin, kData, kReporter };

class ServerMetrics {
 public:
  ServerMetrics();
  ~ServerMetrics();
  ServerMetrics(const ServerMetrics&) = delete;
  ServerMetrics& operator=(const ServerMetrics&) = delete;

  // For components that add their own metric families.
  prometheus::Registry& registry() { return *registry_; }
  // Adds a collectable read at every scrape (kept alive by the metrics object). Call before the
  // HTTP endpoint starts.
  void AddCollectable(std::shared_ptr<prometheus::Collectable> collectable);
  // Adds the scrape-time router state and process metrics. `router` must outlive every scrape:
  // the owner stops the HTTP endpoint before destroying the router.
  void AttachRouter(const Router* router);

  // ---- Request path ----
  void RecordRoute(const RouteResult& result, double seconds);
  // A Route that failed with `status` under the configured `policy`; counts the rejection reason
  // for input errors.
  void RecordRouteFailure(PolicyKind policy, const absl::Status& status, double seconds);
  void RecordRejected(RejectReason reason);
  void RecordComplete(bool released);
  void RecordLoadReport(bool accepted);
  // A centroid set offered through the one door (Router::InstallCentroids or a refusal before
  // it), by source: installed or rejected.
  void RecordCentroidInstall(CentroidSource source, bool installed);
  // A call refused by a credential check: `missing` credentials (UNAUTHENTICATED) or wrong ones
  // (PERMISSION_DENIED).
  void RecordAuthRefused(AuthPlane plane, bool missing);
  // ReportLoad streams: refused at a limit (`per_peer` or the total), or ended for idleness.
  void RecordReportStreamRefused(bool per_peer);
  void RecordReportStreamIdleEnded();
  void SetReportStreamsOpen(int64_t open);
  // RouteStream: streams open now; one answered message by kind and outcome (ok, or an error
  // answer); answers that a stream ending early could not deliver, by kind (their leases are
  // released).
  void SetRouteStreamsOpen(int64_t open);
  void RecordRouteStreamMessage(StreamMessageKind kind, bool ok);
  void RecordRouteStreamUndelivered(StreamMessageKind kind);
  // A RouteStreamBatch message answered with its `entries` answers (0 for an empty batch), or
  // refused whole for holding more than --max_stream_batch entries.
  void RecordRouteStreamBatch(int64_t entries);
  void RecordRouteStreamBatchRefused();
  // An errors_only message (a Complete or a batch of them) that succeeded, hence was not answered.
  void RecordRouteStreamUnanswered();
  // TLS rotations of the certificate files: installed, or refused (the old pair stays).
  void RecordTlsRotation(bool installed);

  // Everything a scrape returns, in the text exposition format (version 0.0.4).
  std::string RenderText() const;

 private:
  static constexpr int kNumPolicies = 5;
  static constexpr int kNumOutcomes = 5;
  static constexpr int kNumFallbacks = 8;
  static constexpr int kNumPlanes = 3;
  static constexpr int kNumStreamKinds = 3;

  std::vector<std::weak_ptr<prometheus::Collectable>> AllCollectables() const;

  std::shared_ptr<prometheus::Registry> registry_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_;

  std::array<std::array<prometheus::Counter*, kNumOutcomes>, kNumPolicies> route_requests_{};
  prometheus::Histogram* route_duration_ = nullptr;
  prometheus::Histogram* band_size_ = nullptr;
  prometheus::Histogram* similarity_ = nullptr;
  std::array<prometheus::Counter*, kNumFallbacks> fallbacks_{};
  std::vector<prometheus::Counter*> rejected_;  // by RejectReason, in AllRejectReasons() order
  prometheus::Counter* complete_ok_ = nullptr;
  prometheus::Counter* complete_not_found_ = nullptr;
  prometheus::Counter* reports_accepted_ = nullptr;
  prometheus::Counter* reports_rejected_ = nullptr;
  std::vector<std::array<prometheus::Counter*, 2>> installs_;  // [AllCentroidSources() index][installed]
  std::array<std::array<prometheus::Counter*, 2>, kNumPlanes> auth_refused_{};  // [plane][missing]
  prometheus::Counter* streams_refused_total_ = nullptr;
  prometheus::Counter* streams_refused_peer_ = nullptr;
  prometheus::Counter* streams_idle_ended_ = nullptr;
  prometheus::Gauge* streams_open_ = nullptr;
  prometheus::Gauge* route_streams_open_ = nullptr;
  std::array<std::array<prometheus::Counter*, 2>, kNumStreamKinds> stream_messages_{};  // [kind][ok]; null: impossible
  std::array<prometheus::Counter*, kNumStreamKinds> stream_undelivered_{};
  prometheus::Counter* stream_batches_answered_ = nullptr;
  prometheus::Counter* stream_batches_refused_ = nullptr;
  prometheus::Counter* stream_unanswered_ = nullptr;
  prometheus::Histogram* stream_batch_size_ = nullptr;
  prometheus::Counter* tls_installed_ = nullptr;
  prometheus::Counter* tls_refused_ = nullptr;
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_METRICS_H_
