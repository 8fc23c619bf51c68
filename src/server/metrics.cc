#include "server/metrics.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "eldr/metrics/prometheus.h"
#include "prometheus/family.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"
#include "server/config.h"

namespace eldr::server {

using metrics::AddSample;
using metrics::MetricFamily;
using metrics::MetricLabel;
using metrics::MetricLabels;
using metrics::SingleSample;
namespace {

constexpr PolicyKind kPolicyKinds[] = {PolicyKind::kEldr, PolicyKind::kRoundRobin, PolicyKind::kRandom,
                                       PolicyKind::kJsq, PolicyKind::kP2c};
constexpr RouteOutcome kOutcomes[] = {RouteOutcome::kOk, RouteOutcome::kFallback, RouteOutcome::kInvalid,
                                      RouteOutcome::kUnavailable, RouteOutcome::kError};
constexpr FallbackReason kFallbackReasons[] = {
    FallbackReason::kNone,        FallbackReason::kNoSignature,        FallbackReason::kZeroSignature,
    FallbackReason::kNoCentroids, FallbackReason::kNoEligibleCentroid, FallbackReason::kOverload,
    FallbackReason::kLoadGap,     FallbackReason::kAllUnhealthy};

template <typename Enum, size_t N>
size_t IndexOf(const Enum (&all)[N], Enum value, size_t fallback) {
  for (size_t i = 0; i < N; ++i) {
    if (all[i] == value) return i;
  }
  return fallback;
}

// Per-worker and centroid state, read from the router at scrape time.
class RouterStateCollector : public prometheus::Collectable {
 public:
  explicit RouterStateCollector(const Router* router) : router_(router) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    const absl::Time now = absl::Now();
    const RouterState state = router_->GetState(now);

    auto inflight =
        MetricFamily("eldr_worker_inflight", "Live leases (routed, not completed) per worker.", MetricType::Gauge);
    auto effective =
        MetricFamily("eldr_worker_effective_load",
                     "Load the policy sees per worker: fresh report + leases since it, or leases.", MetricType::Gauge);
    auto reported = MetricFamily("eldr_worker_reported_load",
                                 "Last reported running + waiting requests per worker (absent: never reported).",
                                 MetricType::Gauge);
    auto kv =
        MetricFamily("eldr_worker_reported_kv_usage",
                     "Last reported KV cache usage fraction per worker (absent: never reported).", MetricType::Gauge);
    auto age = MetricFamily("eldr_worker_report_age_seconds",
                            "Age of the last load report per worker (absent: never reported).", MetricType::Gauge);
    auto healthy = MetricFamily("eldr_worker_healthy", "1 when the worker is healthy, 0 when marked unhealthy.",
                                MetricType::Gauge);
    auto draining =
        MetricFamily("eldr_worker_draining", "1 while the worker is draining (no new routes).", MetricType::Gauge);
    for (const WorkerStatus& w : state.workers) {
      std::vector<prometheus::ClientMetric::Label> labels = {MetricLabel("worker", w.spec.id)};
      AddSample(&inflight, static_cast<double>(w.load.leases), labels);
      AddSample(&effective, w.load.effective, labels);
      AddSample(&healthy, w.healthy ? 1 : 0, labels);
      AddSample(&draining, w.state == WorkerState::kDraining ? 1 : 0, labels);
      if (w.load.snapshot.has_value()) {
        AddSample(&reported, w.load.snapshot->running + w.load.snapshot->waiting, labels);
        AddSample(&kv, w.load.snapshot->kv_usage, labels);
        AddSample(&age, absl::ToDoubleSeconds(now - w.load.snapshot->taken_at), labels);
      }
    }

    auto generation = MetricFamily("eldr_centroid_generation",
                                   "Generation of the centroid set in service (0: none loaded).", MetricType::Gauge);
    AddSample(&generation, static_cast<double>(state.centroid_generation));
    auto rows = MetricFamily("eldr_centroid_rows", "Centroid rows in service.", MetricType::Gauge);
    AddSample(&rows, state.centroid_rows);
    auto workers = MetricFamily("eldr_workers", "Workers in the pool.", MetricType::Gauge);
    AddSample(&workers, static_cast<double>(state.workers.size()));
    auto live = MetricFamily("eldr_live_leases", "Leases not yet completed or expired.", MetricType::Gauge);
    AddSample(&live, static_cast<double>(state.live_leases));
    auto expired =
        MetricFamily("eldr_leases_expired_total",
                     "Leases released by expiry (their Complete never came within --lease_ttl).", MetricType::Counter);
    AddSample(&expired, static_cast<double>(state.leases_expired_total));
    auto evicted =
        MetricFamily("eldr_leases_evicted_total",
                     "Leases released at the --max_live_leases limit (the oldest of the pool).", MetricType::Counter);
    AddSample(&evicted, static_cast<double>(state.leases_evicted_total));
    auto after_removal = MetricFamily("eldr_completes_after_removal_total",
                                      "Completes of leases whose worker had left the pool while the request was in "
                                      "flight (answered OK; the lease had ended at the removal).",
                                      MetricType::Counter);
    AddSample(&after_removal, static_cast<double>(state.completes_after_removal_total));

    std::vector<prometheus::MetricFamily> out;
    out.reserve(14);
    for (auto* f : {&inflight, &effective, &reported, &kv, &age, &healthy, &draining, &generation, &rows, &workers,
                    &live, &expired, &evicted, &after_removal}) {
      out.push_back(std::move(*f));
    }
    return out;
  }

 private:
  const Router* router_;
};

}  // namespace

absl::string_view RouteOutcomeLabel(RouteOutcome outcome) {
  switch (outcome) {
    case RouteOutcome::kOk:
      return "ok";
    case RouteOutcome::kFallback:
      return "fallback";
    case RouteOutcome::kInvalid:
      return "invalid";
    case RouteOutcome::kUnavailable:
      return "unavailable";
    case RouteOutcome::kError:
      return "error";
  }
  return "error";
}

const std::vector<double>& RouteStreamBatchSizeBuckets() {
  static const auto* buckets = [] {
    auto* out = new std::vector<double>{0};
    for (int64_t size = 1; size <= kMaxStreamBatchLimit; size *= 2) out->push_back(static_cast<double>(size));
    return out;
  }();
  return *buckets;
}

const std::vector<double>& RouteDurationBuckets() {
  static const auto* buckets = new std::vector<double>{
      // Bounds whose shortest decimal form round-trips, so `le` labels print cleanly.
      1e-6, 2e-6, 3e-6, 5e-6, 7.5e-6, 1e-5, 1.5e-5, 2e-5, 3e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2};
  return *buckets;
}

ServerMetrics::ServerMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  static_assert(std::size(kPolicyKinds) == kNumPolicies);
  static_assert(std::size(kOutcomes) == kNumOutcomes);
  static_assert(std::size(kFallbackReasons) == kNumFallbacks);
  auto& requests = prometheus::BuildCounter()
                       .Name("eldr_route_requests_total")
                       .Help(
                           "Route requests (unary RPCs and RouteStream messages) by the policy that decided "
                           "(the configured one when the route failed) and outcome: ok, fallback, invalid, "
                           "unavailable, error.")
                       .Register(*registry_);
  for (size_t p = 0; p < kNumPolicies; ++p) {
    for (size_t o = 0; o < kNumOutcomes; ++o) {
      route_requests_[p][o] = &requests.Add({{"policy", std::string(PolicyKindName(kPolicyKinds[p]))},
                                             {"outcome", std::string(RouteOutcomeLabel(kOutcomes[o]))}});
    }
  }
  route_duration_ = &prometheus::BuildHistogram()
                         .Name("eldr_route_duration_seconds")
                         .Help(
                             "Server-side Route decision time: from the decoded request to the "
                             "filled response (transform, scoring, policy, lease).")
                         .Register(*registry_)
                         .Add({}, RouteDurationBuckets());
  band_size_ = &prometheus::BuildHistogram()
                    .Name("eldr_band_size")
                    .Help(
                        "Workers in the locality band (within tau of the best similarity) per "
                        "locality decision.")
                    .Register(*registry_)
                    .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128});
  similarity_ = &prometheus::BuildHistogram()
                     .Name("eldr_route_similarity")
                     .Help(
                         "Best cosine similarity between signature and an eligible centroid per "
                         "locality decision.")
                     .Register(*registry_)
                     .Add({}, prometheus::Histogram::BucketBoundaries{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9,
                                                                      0.95, 0.98, 1.0});
  auto& fallbacks = prometheus::BuildCounter()
                        .Name("eldr_fallback_total")
                        .Help("Routes that did not follow the configured policy, by reason.")
                        .Register(*registry_);
  for (size_t i = 0; i < kNumFallbacks; ++i) {
    if (kFallbackReasons[i] == FallbackReason::kNone) continue;
    fallbacks_[i] = &fallbacks.Add({{"reason", std::string(FallbackReasonLabel(kFallbackReasons[i]))}});
  }
  auto& rejected = prometheus::BuildCounter()
                       .Name("eldr_rejected_total")
                       .Help(
                           "Rejected inputs (signatures, load reports, artifacts, admin requests) by "
                           "reason.")
                       .Register(*registry_);
  for (RejectReason reason : AllRejectReasons()) {
    rejected_.push_back(&rejected.Add({{"reason", std::string(RejectReasonLabel(reason))}}));
  }
  auto& completes = prometheus::BuildCounter()
                        .Name("eldr_complete_requests_total")
                        .Help(
                            "Complete RPCs by outcome: released, or not_found (unknown, already "
                            "completed, expired or evicted lease).")
                        .Register(*registry_);
  complete_ok_ = &completes.Add({{"outcome", "released"}});
  complete_not_found_ = &completes.Add({{"outcome", "not_found"}});
  auto& reports = prometheus::BuildCounter()
                      .Name("eldr_load_reports_total")
                      .Help("Load snapshots received over ReportLoad, by outcome.")
                      .Register(*registry_);
  reports_accepted_ = &reports.Add({{"outcome", "accepted"}});
  reports_rejected_ = &reports.Add({{"outcome", "rejected"}});
  auto& installs = prometheus::BuildCounter()
                       .Name("eldr_centroid_reloads_total")
                       .Help(
                           "Centroid sets offered through the one door, by source (startup, state_dir, "
                           "sighup, admin, file_watch, refit, discovery, cluster, api) and outcome (ok: "
                           "installed, error: refused, the set in service stays).")
                       .Register(*registry_);
  for (CentroidSource source : AllCentroidSources()) {
    const std::string label(CentroidSourceLabel(source));
    installs_.push_back({&installs.Add({{"source", label}, {"outcome", "error"}}),
                         &installs.Add({{"source", label}, {"outcome", "ok"}})});
  }
  auto& refused = prometheus::BuildCounter()
                      .Name("eldr_admin_refused_total")
                      .Help("Admin RPCs refused by the bearer-token check, by status code.")
                      .Register(*registry_);
  auto& data_refused = prometheus::BuildCounter()
                           .Name("eldr_data_plane_refused_total")
                           .Help(
                               "DecodeRouter calls refused by a credential check (plane data: the data-plane "
                               "token; reporter: a load report for a worker its caller may not report for), by "
                               "status code.")
                           .Register(*registry_);
  for (size_t p = 0; p < kNumPlanes; ++p) {
    auto& family = p == static_cast<size_t>(AuthPlane::kAdmin) ? refused : data_refused;
    const std::map<std::string, std::string> plane =
        p == static_cast<size_t>(AuthPlane::kAdmin)  ? std::map<std::string, std::string>{}
        : p == static_cast<size_t>(AuthPlane::kData) ? std::map<std::string, std::string>{{"plane", "data"}}
                                                     : std::map<std::string, std::string>{{"plane", "reporter"}};
    auto labels = [&](const char* code) {
      std::map<std::string, std::string> all = plane;
      all["code"] = code;
      return all;
    };
    auth_refused_[p][0] = &family.Add(labels("permission_denied"));
    auth_refused_[p][1] = &family.Add(labels("unauthenticated"));
  }
  auto& streams = prometheus::BuildCounter()
                      .Name("eldr_report_streams_refused_total")
                      .Help(
                          "ReportLoad streams refused at --max_report_streams (limit total) or "
                          "--max_report_streams_per_peer (limit per_peer).")
                      .Register(*registry_);
  streams_refused_total_ = &streams.Add({{"limit", "total"}});
  streams_refused_peer_ = &streams.Add({{"limit", "per_peer"}});
  streams_idle_ended_ = &prometheus::BuildCounter()
                             .Name("eldr_report_streams_idle_ended_total")
                             .Help("ReportLoad streams ended after --report_stream_idle_timeout without a message.")
                             .Register(*registry_)
                             .Add({});
  streams_open_ = &prometheus::BuildGauge()
                       .Name("eldr_report_streams_open")
                       .Help("ReportLoad streams open now.")
                       .Register(*registry_)
                       .Add({});
  route_streams_open_ = &prometheus::BuildGauge()
                             .Name("eldr_route_streams_open")
                             .Help("RouteStream streams open now.")
                             .Register(*registry_)
                             .Add({});
  auto& stream_messages = prometheus::BuildCounter()
                              .Name("eldr_route_stream_messages_total")
                              .Help(
                                  "RouteStream messages answered, by kind (route, complete, none: unparsable or "
                                  "neither set) and outcome (ok, or error: answered with an error).")
                              .Register(*registry_);
  auto& undelivered = prometheus::BuildCounter()
                          .Name("eldr_route_stream_undelivered_total")
                          .Help(
                              "RouteStream answers a stream that ended early (cancelled, connection lost) "
                              "could not deliver, by kind; their Route leases were released.")
                          .Register(*registry_);
  for (size_t k = 0; k < kNumStreamKinds; ++k) {
    const std::string kind = k == static_cast<size_t>(StreamMessageKind::kRoute)      ? "route"
                             : k == static_cast<size_t>(StreamMessageKind::kComplete) ? "complete"
                                                                                      : "none";
    if (k != static_cast<size_t>(StreamMessageKind::kNone)) {
      stream_messages_[k][1] = &stream_messages.Add({{"kind", kind}, {"outcome", "ok"}});
    }
    stream_messages_[k][0] = &stream_messages.Add({{"kind", kind}, {"outcome", "error"}});
    stream_undelivered_[k] = &undelivered.Add({{"kind", kind}});
  }
  auto& batches = prometheus::BuildCounter()
                      .Name("eldr_route_stream_batches_total")
                      .Help(
                          "RouteStream batch messages, by outcome: answered (each entry answered and counted in "
                          "eldr_route_stream_messages_total), or refused (more entries than --max_stream_batch: "
                          "one error, no entry handled).")
                      .Register(*registry_);
  stream_batches_answered_ = &batches.Add({{"outcome", "answered"}});
  stream_batches_refused_ = &batches.Add({{"outcome", "refused"}});
  stream_unanswered_ = &prometheus::BuildCounter()
                            .Name("eldr_route_stream_unanswered_total")
                            .Help(
                                "RouteStream messages with errors_only (a Complete or a batch of Completes) "
                                "that succeeded and so were not answered; their requests are counted in "
                                "eldr_route_stream_messages_total as ok.")
                            .Register(*registry_)
                            .Add({});
  stream_batch_size_ = &prometheus::BuildHistogram()
                            .Name("eldr_route_stream_batch_size")
                            .Help("Entries of each answered RouteStream batch message.")
                            .Register(*registry_)
                            .Add({}, RouteStreamBatchSizeBuckets());
  auto& tls = prometheus::BuildCounter()
                  .Name("eldr_tls_rotations_total")
                  .Help(
                      "Changed TLS certificate files seen: installed, or refused (invalid; the pair in "
                      "service stays).")
                  .Register(*registry_);
  tls_installed_ = &tls.Add({{"outcome", "installed"}});
  tls_refused_ = &tls.Add({{"outcome", "refused"}});
}

ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::AddCollectable(std::shared_ptr<prometheus::Collectable> collectable) {
  collectables_.push_back(std::move(collectable));
}

void ServerMetrics::AttachRouter(const Router* router) {
  AddCollectable(std::make_shared<RouterStateCollector>(router));
  AddCollectable(metrics::NewProcessCollector());
}

std::vector<std::weak_ptr<prometheus::Collectable>> ServerMetrics::AllCollectables() const {
  std::vector<std::weak_ptr<prometheus::Collectable>> all = {registry_};
  for (const auto& c : collectables_) all.push_back(c);
  return all;
}

void ServerMetrics::RecordRoute(const RouteResult& result, double seconds) {
  const size_t policy = IndexOf(kPolicyKinds, result.policy, 0);
  const bool fell_back = result.fallback != FallbackReason::kNone;
  route_requests_[policy][static_cast<size_t>(fell_back ? RouteOutcome::kFallback : RouteOutcome::kOk)]->Increment();
  route_duration_->Observe(seconds);
  if (fell_back) {
    prometheus::Counter* c = fallbacks_[IndexOf(kFallbackReasons, result.fallback, 0)];
    if (c != nullptr) c->Increment();
  }
  if (result.band_size > 0) {
    band_size_->Observe(result.band_size);
    similarity_->Observe(result.similarity);
  }
}

void ServerMetrics::RecordRouteFailure(PolicyKind policy, const absl::Status& status, double seconds) {
  RouteOutcome outcome = RouteOutcome::kError;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kFailedPrecondition:
      outcome = RouteOutcome::kInvalid;
      RecordRejected(RejectReasonOf(status));
      break;
    case absl::StatusCode::kUnavailable:
      outcome = RouteOutcome::kUnavailable;
      break;
    default:
      break;
  }
  route_requests_[IndexOf(kPolicyKinds, policy, 0)][static_cast<size_t>(outcome)]->Increment();
  route_duration_->Observe(seconds);
}

void ServerMetrics::RecordRejected(RejectReason reason) {
  const absl::Span<const RejectReason> all = AllRejectReasons();
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] == reason) {
      rejected_[i]->Increment();
      return;
    }
  }
}

void ServerMetrics::RecordComplete(bool released) { (released ? complete_ok_ : complete_not_found_)->Increment(); }

void ServerMetrics::RecordLoadReport(bool accepted) { (accepted ? reports_accepted_ : reports_rejected_)->Increment(); }

void ServerMetrics::RecordCentroidInstall(CentroidSource source, bool installed) {
  const absl::Span<const CentroidSource> all = AllCentroidSources();
  const size_t index = static_cast<size_t>(std::find(all.begin(), all.end(), source) - all.begin());
  if (index < installs_.size()) installs_[index][installed ? 1 : 0]->Increment();
}

void ServerMetrics::RecordAuthRefused(AuthPlane plane, bool missing) {
  auth_refused_[static_cast<size_t>(plane)][missing ? 1 : 0]->Increment();
}

void ServerMetrics::RecordReportStreamRefused(bool per_peer) {
  (per_peer ? streams_refused_peer_ : streams_refused_total_)->Increment();
}

void ServerMetrics::RecordReportStreamIdleEnded() { streams_idle_ended_->Increment(); }

void ServerMetrics::SetReportStreamsOpen(int64_t open) { streams_open_->Set(static_cast<double>(open)); }

void ServerMetrics::SetRouteStreamsOpen(int64_t open) { route_streams_open_->Set(static_cast<double>(open)); }

void ServerMetrics::RecordRouteStreamMessage(StreamMessageKind kind, bool ok) {
  prometheus::Counter* c = stream_messages_[static_cast<size_t>(kind)][ok ? 1 : 0];
  if (c != nullptr) c->Increment();
}

void ServerMetrics::RecordRouteStreamUndelivered(StreamMessageKind kind) {
  stream_undelivered_[static_cast<size_t>(kind)]->Increment();
}

void ServerMetrics::RecordRouteStreamBatch(int64_t entries) {
  stream_batches_answered_->Increment();
  stream_batch_size_->Observe(static_cast<double>(entries));
}

void ServerMetrics::RecordRouteStreamBatchRefused() { stream_batches_refused_->Increment(); }

void ServerMetrics::RecordRouteStreamUnanswered() { stream_unanswered_->Increment(); }

void ServerMetrics::RecordTlsRotation(bool installed) { (installed ? tls_installed_ : tls_refused_)->Increment(); }

std::string ServerMetrics::RenderText() const {
  std::vector<prometheus::MetricFamily> families;
  for (const auto& weak : AllCollectables()) {
    if (auto c = weak.lock()) {
      auto part = c->Collect();
      families.insert(families.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
    }
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace eldr::server
