#include "server/metrics.h"

#include <limits>

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "eldr/core/errors.h"
#include "eldr/core/router.h"
#include "eldr/metrics/prometheus.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/config.h"

namespace eldr::server {

using metrics::AddSample;
using metrics::MetricFamily;
using metrics::MetricLabel;
using metrics::MetricLabels;
using metrics::SingleSample;
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::unique_ptr<Router> TwoWorkerRouter() {
  RouterOptions options;
  options.policy = PolicyKind::kJsq;
  auto router = Router::Create(options, {WorkerSpec{"w0", "h:1"}, WorkerSpec{"w1", "h:2"}});
  EXPECT_TRUE(router.ok()) << router.status();
  return *std::move(router);
}

TEST(ServerMetrics, RouteOutcomesFallbacksAndRejectionsAreCounted) {
  ServerMetrics metrics;
  RouteResult ok;
  ok.policy = PolicyKind::kEldr;
  ok.band_size = 2;
  ok.similarity = 0.5f;
  metrics.RecordRoute(ok, 12e-6);
  RouteResult fallback;
  fallback.policy = PolicyKind::kJsq;
  fallback.fallback = FallbackReason::kNoCentroids;
  metrics.RecordRoute(fallback, 3e-6);
  metrics.RecordRouteFailure(PolicyKind::kEldr, InvalidInput(RejectReason::kGeometry, "bad"), 1e-6);
  metrics.RecordRouteFailure(PolicyKind::kEldr, absl::UnavailableError("no worker"), 1e-6);
  metrics.RecordComplete(false);
  metrics.RecordAuthRefused(AuthPlane::kAdmin, true);
  metrics.RecordAuthRefused(AuthPlane::kData, false);
  metrics.RecordCentroidInstall(CentroidSource::kRefit, true);
  metrics.RecordCentroidInstall(CentroidSource::kAdmin, false);

  const std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("eldr_route_requests_total{outcome=\"ok\",policy=\"eldr\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_route_requests_total{outcome=\"fallback\",policy=\"jsq\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_route_requests_total{outcome=\"invalid\",policy=\"eldr\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_route_requests_total{outcome=\"unavailable\",policy=\"eldr\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_fallback_total{reason=\"no_centroids\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_rejected_total{reason=\"geometry\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_route_duration_seconds_count 4"));
  EXPECT_THAT(text, HasSubstr("eldr_route_duration_seconds_bucket{le=\"1.5e-05\"} 4"));
  EXPECT_THAT(text, HasSubstr("eldr_route_duration_seconds_bucket{le=\"1e-05\"} 3"));
  EXPECT_THAT(text, HasSubstr("eldr_band_size_count 1"));
  EXPECT_THAT(text, HasSubstr("eldr_route_similarity_sum 0.5"));
  EXPECT_THAT(text, HasSubstr("eldr_complete_requests_total{outcome=\"not_found\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_admin_refused_total{code=\"unauthenticated\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_data_plane_refused_total{code=\"permission_denied\",plane=\"data\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_centroid_reloads_total{outcome=\"ok\",source=\"refit\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_centroid_reloads_total{outcome=\"error\",source=\"admin\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_rejected_total{reason=\"out_of_range\"} 0"));
}

TEST(ServerMetrics, DurationBucketsSpanOneMicrosecondToTenMilliseconds) {
  const auto& buckets = RouteDurationBuckets();
  ASSERT_FALSE(buckets.empty());
  EXPECT_DOUBLE_EQ(buckets.front(), 1e-6);
  EXPECT_DOUBLE_EQ(buckets.back(), 1e-2);
  for (size_t i = 1; i < buckets.size(); ++i) EXPECT_LT(buckets[i - 1], buckets[i]);
}

TEST(ServerMetrics, StreamBatchSizesAreCountedInPowersOfTwoFromEmptyToTheLimit) {
  const auto& buckets = RouteStreamBatchSizeBuckets();
  ASSERT_EQ(buckets.size(), 14u);  // 0, 1, 2, 4, ..., 4096
  EXPECT_EQ(buckets.front(), 0);
  EXPECT_EQ(buckets.back(), static_cast<double>(kMaxStreamBatchLimit));
  for (size_t i = 2; i < buckets.size(); ++i) EXPECT_EQ(buckets[i], 2 * buckets[i - 1]);

  ServerMetrics metrics;
  metrics.RecordRouteStreamBatch(0);
  metrics.RecordRouteStreamBatch(3);
  metrics.RecordRouteStreamBatch(256);
  metrics.RecordRouteStreamBatchRefused();
  const std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("eldr_route_stream_batches_total{outcome=\"answered\"} 3"));
  EXPECT_THAT(text, HasSubstr("eldr_route_stream_batches_total{outcome=\"refused\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_route_stream_batch_size_bucket{le=\"0\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_route_stream_batch_size_bucket{le=\"2\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_route_stream_batch_size_bucket{le=\"4\"} 2"));
  EXPECT_THAT(text, HasSubstr("eldr_route_stream_batch_size_bucket{le=\"128\"} 2"));
  EXPECT_THAT(text, HasSubstr("eldr_route_stream_batch_size_bucket{le=\"256\"} 3"));
  EXPECT_THAT(text, HasSubstr("eldr_route_stream_batch_size_sum 259"));
}

TEST(ServerMetrics, WorkerStateIsReadFromTheRouterAtScrapeTime) {
  auto router = TwoWorkerRouter();
  ServerMetrics metrics;
  metrics.AttachRouter(router.get());
  auto routed = router->Route(nullptr, absl::Now());
  ASSERT_TRUE(routed.ok());
  LoadSnapshot snapshot;
  snapshot.running = 4;
  snapshot.waiting = 1;
  snapshot.taken_at = absl::Now();
  ASSERT_TRUE(router->ReportLoad("w1", snapshot, absl::Now()).ok());

  std::string text = metrics.RenderText();
  EXPECT_THAT(text, HasSubstr("eldr_worker_inflight{worker=\"" + routed->worker_id + "\"} 1"));
  EXPECT_THAT(text, HasSubstr("eldr_worker_reported_load{worker=\"w1\"} 5"));
  EXPECT_THAT(text, HasSubstr("eldr_worker_report_age_seconds{worker=\"w1\"}"));
  EXPECT_THAT(text, Not(HasSubstr("eldr_worker_report_age_seconds{worker=\"w0\"}")));
  EXPECT_THAT(text, HasSubstr("eldr_centroid_generation 0"));
  EXPECT_THAT(text, HasSubstr("eldr_live_leases 1"));
  EXPECT_THAT(text, HasSubstr("eldr_leases_expired_total 0"));
  EXPECT_THAT(text, HasSubstr("eldr_leases_evicted_total 0"));
  EXPECT_THAT(text, HasSubstr("process_resident_memory_bytes"));
  EXPECT_THAT(text, HasSubstr("process_open_fds"));

  // A removed worker simply disappears from the next scrape.
  ASSERT_TRUE(router->RemoveWorker("w1").ok());
  text = metrics.RenderText();
  EXPECT_THAT(text, Not(HasSubstr("worker=\"w1\"")));
}

// The prometheus helpers never export a non-finite value (a sample is dropped instead).
TEST(ServerMetrics, NonFiniteValuesNeverReachTheExposition) {
  prometheus::MetricFamily family = MetricFamily("x", "help", prometheus::MetricType::Gauge);
  AddSample(&family, std::numeric_limits<double>::infinity());
  AddSample(&family, std::numeric_limits<double>::quiet_NaN());
  AddSample(&family, 2.5);
  ASSERT_EQ(family.metric.size(), 1u);
  EXPECT_DOUBLE_EQ(family.metric[0].gauge.value, 2.5);
}

}  // namespace
}  // namespace eldr::server
