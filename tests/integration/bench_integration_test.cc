// eldr-bench against a real eldr-router: the load generator's JSON contract and both signature
// sources (random geometry, bundled real traces).
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "router_harness.h"

namespace eldr::testing {
namespace {

nlohmann::json RunBench(const std::vector<std::string>& args) {
  ProcessResult result = RunProcess(BinaryPath("eldr-bench"), args, absl::Seconds(60));
  EXPECT_EQ(result.exit_code, 0) << result.stderr_text;
  nlohmann::json j = nlohmann::json::parse(result.stdout_text, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << result.stdout_text;
  return j;
}

TEST(BenchIntegration, RandomSignaturesWithCompleteReportsTheContractFields) {
  TempDir dir;
  const std::string artifact = dir.File("a.json");
  const std::string workers = dir.File("w.json");
  ProcessResult fixtures =
      RunProcess(BinaryPath("eldr-bench"),
                 {"--write_artifact=" + artifact, "--write_workers=" + workers, "--geometry=12x32", "--workers=6"});
  ASSERT_EQ(fixtures.exit_code, 0) << fixtures.stderr_text;
  auto router = RouterProcess::Start(dir, {"--workers=" + workers, "--centroids=" + artifact});
  ASSERT_TRUE(router.ok()) << router.status();

  nlohmann::json out = RunBench({"--target=" + (*router)->target(), "--duration_s=1", "--warmup_s=0.2",
                                 "--concurrency=4", "--geometry=12x32", "--complete", "--json"});
  ASSERT_TRUE(out.is_object());
  for (const char* key : {"requests", "errors", "qps", "p50_us", "p90_us", "p99_us"}) {
    EXPECT_TRUE(out.contains(key)) << key;
  }
  EXPECT_GT(out["requests"].get<int64_t>(), 50);
  EXPECT_EQ(out["errors"].get<int64_t>(), 0);
  EXPECT_GT(out["qps"].get<double>(), 0);
  EXPECT_LE(out["p50_us"].get<double>(), out["p90_us"].get<double>());
  EXPECT_LE(out["p90_us"].get<double>(), out["p99_us"].get<double>());
  // Complete was sent for (almost) every route; the last routes may end with the window.
  EXPECT_GE(out["completes"].get<int64_t>(), out["requests"].get<int64_t>() - 8);

  // The daemon agrees: every completed lease was released, none is left behind.
  auto metrics = ScrapeMetrics((*router)->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->Value("eldr_live_leases"), 0);
  EXPECT_GE(metrics->Value("eldr_route_requests_total", {{"policy", "eldr"}, {"outcome", "ok"}}).value_or(0),
            out["requests"].get<double>());
}

TEST(BenchIntegration, BundledTracesDriveLocalityRoutes) {
  const char* data = std::getenv("ELDR_DATA_DIR");
  ASSERT_NE(data, nullptr);
  TempDir dir;
  const std::string artifact = dir.File("a.json");
  WriteTextFile(artifact, ArtifactJson({0, 1, 2, 3}, {"w0", "w1", "w2", "w3"}));
  auto router = RouterProcess::Start(dir, {"--workers=" + WorkerFlag(4), "--centroids=" + artifact});
  ASSERT_TRUE(router.ok()) << router.status();
  nlohmann::json out = RunBench({"--target=" + (*router)->target(), "--duration_s=1", "--warmup_s=0.2",
                                 "--concurrency=2", "--trace=" + std::string(data) + "/esft-routing", "--json"});
  EXPECT_EQ(out["geometry"], "26x64");
  EXPECT_EQ(out["signatures"].get<int>(), 213);  // 127 + 33 + 13 + 40 sequences
  EXPECT_GT(out["requests"].get<int64_t>(), 20);
  EXPECT_EQ(out["errors"].get<int64_t>(), 0);
  auto metrics = ScrapeMetrics((*router)->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  // Real signatures are scored against the centroids (no fallback).
  EXPECT_GE(metrics->Value("eldr_band_size_count").value_or(0), out["requests"].get<double>());
}

TEST(BenchIntegration, StreamModePipelinesRouteAndCompleteOverRouteStreams) {
  TempDir dir;
  auto router = RouterProcess::Start(dir, StandardArgs(dir));
  ASSERT_TRUE(router.ok()) << router.status();
  nlohmann::json out =
      RunBench({"--target=" + (*router)->target(), "--api=stream", "--channels=2", "--streams=3", "--concurrency=9",
                "--duration_s=1", "--warmup_s=0.2", "--geometry=26x64", "--complete", "--json"});
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["api"], "stream");
  EXPECT_EQ(out["streams"].get<int>(), 3);
  EXPECT_GT(out["requests"].get<int64_t>(), 50);
  EXPECT_EQ(out["errors"].get<int64_t>(), 0) << out.dump();
  EXPECT_LE(out["p50_us"].get<double>(), out["p99_us"].get<double>());
  EXPECT_GT(out["complete_p50_us"].get<double>(), 0);
  // At most one message per slot is unanswered when the window closes.
  EXPECT_GE(out["completes"].get<int64_t>(), out["requests"].get<int64_t>() - 9);

  // Every message went over RouteStream, and the half-close at the end left no lease behind.
  auto metrics = ScrapeMetrics((*router)->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->Value("eldr_live_leases"), 0);
  const double streamed =
      metrics->Value("eldr_route_stream_messages_total", {{"kind", "route"}, {"outcome", "ok"}}).value_or(0);
  EXPECT_GE(streamed, out["requests"].get<double>());
  EXPECT_EQ(metrics->Value("eldr_route_duration_seconds_count"), streamed) << "every route was streamed";
  EXPECT_EQ(metrics->Value("eldr_complete_requests_total", {{"outcome", "released"}}), streamed);
  // eldr-bench exits once it has its streams' statuses; the router releases the calls right after.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (metrics.ok() && metrics->Value("eldr_route_streams_open") != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    metrics = ScrapeMetrics((*router)->metrics_port());
  }
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->Value("eldr_route_streams_open"), 0);
}

TEST(BenchIntegration, StreamBatchSendsEachGroupsRoutesAndCompletesAsOneMessage) {
  TempDir dir;
  auto router = RouterProcess::Start(dir, StandardArgs(dir));
  ASSERT_TRUE(router.ok()) << router.status();
  // 10 slots on 2 streams, 5 each, in groups of 4: one group of 4 and one of 1 per stream.
  nlohmann::json out =
      RunBench({"--target=" + (*router)->target(), "--api=stream", "--streams=2", "--concurrency=10",
                "--stream_batch=4", "--duration_s=1", "--warmup_s=0.2", "--geometry=26x64", "--complete", "--json"});
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["stream_batch"].get<int>(), 4);
  EXPECT_GT(out["requests"].get<int64_t>(), 50);
  EXPECT_EQ(out["errors"].get<int64_t>(), 0) << out.dump();
  EXPECT_GE(out["completes"].get<int64_t>(), out["requests"].get<int64_t>() - 10);

  auto metrics = ScrapeMetrics((*router)->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->Value("eldr_live_leases"), 0);
  const double routes =
      metrics->Value("eldr_route_stream_messages_total", {{"kind", "route"}, {"outcome", "ok"}}).value_or(0);
  const double completes =
      metrics->Value("eldr_route_stream_messages_total", {{"kind", "complete"}, {"outcome", "ok"}}).value_or(0);
  EXPECT_GE(routes, out["requests"].get<double>());
  EXPECT_EQ(completes, routes);
  // Every message was a batch (of 4 or of 1): a route batch and a complete batch per round of a
  // group, so the batches hold every route and every complete.
  const double batches = metrics->Value("eldr_route_stream_batches_total", {{"outcome", "answered"}}).value_or(0);
  EXPECT_EQ(metrics->Value("eldr_route_stream_batch_size_sum"), routes + completes);
  EXPECT_EQ(metrics->Value("eldr_route_stream_batch_size_count"), batches);
  EXPECT_EQ(metrics->Value("eldr_route_stream_batch_size_bucket", {{"le", "4"}}), batches) << "a batch of more than 4";
  EXPECT_GT(batches - metrics->Value("eldr_route_stream_batch_size_bucket", {{"le", "2"}}).value_or(0), 0)
      << "no batch of 4";
  EXPECT_LT(batches, routes) << "fewer messages than routes";
}

// --stream_errors_only: Completes go unanswered when they succeed, singly and in batches; every
// lease is still released, and a Complete the router refuses is counted as an error.
TEST(BenchIntegration, StreamErrorsOnlyCompletesGoUnansweredAndStillRelease) {
  TempDir dir;
  auto router = RouterProcess::Start(dir, StandardArgs(dir));
  ASSERT_TRUE(router.ok()) << router.status();
  double unanswered_before = 0;
  for (const char* batch : {"1", "4"}) {
    nlohmann::json out = RunBench({"--target=" + (*router)->target(), "--api=stream", "--streams=2", "--concurrency=8",
                                   std::string("--stream_batch=") + batch, "--stream_errors_only", "--duration_s=1",
                                   "--warmup_s=0.2", "--geometry=26x64", "--complete", "--json"});
    ASSERT_TRUE(out.is_object());
    EXPECT_TRUE(out["stream_errors_only"].get<bool>());
    EXPECT_GT(out["requests"].get<int64_t>(), 50) << batch;
    EXPECT_EQ(out["errors"].get<int64_t>(), 0) << out.dump();
    EXPECT_GE(out["completes"].get<int64_t>(), out["requests"].get<int64_t>() - 8) << batch;

    auto metrics = ScrapeMetrics((*router)->metrics_port());
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    EXPECT_EQ(metrics->Value("eldr_live_leases"), 0) << batch;
    const double unanswered = metrics->Value("eldr_route_stream_unanswered_total").value_or(0);
    EXPECT_GE(unanswered - unanswered_before, out["completes"].get<double>() / (batch[0] == '1' ? 1 : 4)) << batch;
    unanswered_before = unanswered;
  }
  EXPECT_EQ(ScrapeMetrics((*router)->metrics_port())
                ->Value("eldr_route_stream_messages_total", {{"kind", "complete"}, {"outcome", "error"}})
                .value_or(0),
            0);
  // Leases that expire before their Complete: the router answers those Completes NOT_FOUND.
  TempDir expiring_dir;
  std::vector<std::string> args = StandardArgs(expiring_dir);
  args.insert(args.end(), {"--lease_ttl=1us", "--lease_expiry_interval=1ms"});
  auto expiring = RouterProcess::Start(expiring_dir, args);
  ASSERT_TRUE(expiring.ok()) << expiring.status();
  nlohmann::json out =
      RunBench({"--target=" + (*expiring)->target(), "--api=stream", "--concurrency=4", "--stream_errors_only",
                "--duration_s=1", "--warmup_s=0.2", "--geometry=26x64", "--complete", "--json"});
  ASSERT_TRUE(out.is_object());
  EXPECT_GT(out["errors"].get<int64_t>(), 0) << out.dump();
  EXPECT_GT(out["error_codes"].value("5", int64_t{0}), 0) << out.dump();
  // Checked: only for streams with Complete.
  for (const std::vector<std::string>& flags : std::vector<std::vector<std::string>>{
           {"--api=stream", "--stream_errors_only"}, {"--api=cq", "--complete", "--stream_errors_only"}}) {
    std::vector<std::string> args = {"--target=127.0.0.1:1"};
    args.insert(args.end(), flags.begin(), flags.end());
    ProcessResult result = RunProcess(BinaryPath("eldr-bench"), args, absl::Seconds(60));
    EXPECT_EQ(result.exit_code, 2) << flags[0];
    EXPECT_THAT(result.stderr_text, ::testing::HasSubstr("--stream_errors_only")) << flags[0];
  }
}

TEST(BenchIntegration, StreamBatchIsCheckedAndOnlyForStreams) {
  for (const std::vector<std::string>& flags : std::vector<std::vector<std::string>>{
           {"--api=stream", "--stream_batch=0"}, {"--api=stream", "--stream_batch=5000"}, {"--stream_batch=4"}}) {
    std::vector<std::string> args = {"--target=127.0.0.1:1"};
    args.insert(args.end(), flags.begin(), flags.end());
    ProcessResult result = RunProcess(BinaryPath("eldr-bench"), args, absl::Seconds(60));
    EXPECT_EQ(result.exit_code, 2) << flags.back();
    EXPECT_THAT(result.stderr_text, ::testing::HasSubstr("--stream_batch")) << flags.back();
  }
}

TEST(BenchIntegration, StreamModeFollowsTheRate) {
  TempDir dir;
  auto router = RouterProcess::Start(dir, StandardArgs(dir));
  ASSERT_TRUE(router.ok()) << router.status();
  nlohmann::json out = RunBench({"--target=" + (*router)->target(), "--api=stream", "--concurrency=8", "--rate=400",
                                 "--duration_s=1.5", "--warmup_s=0.2", "--geometry=26x64", "--complete", "--json"});
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["errors"].get<int64_t>(), 0) << out.dump();
  EXPECT_EQ(out["target_rate"].get<double>(), 400);
  EXPECT_NEAR(out["qps"].get<double>(), 400, 40) << out.dump();
}

TEST(BenchIntegration, StreamModeRejectsMoreStreamsThanSlots) {
  ProcessResult result =
      RunProcess(BinaryPath("eldr-bench"), {"--target=127.0.0.1:1", "--api=stream", "--streams=4", "--concurrency=2"},
                 absl::Seconds(60));
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_THAT(result.stderr_text, ::testing::HasSubstr("--streams"));
}

TEST(BenchIntegration, UnreachableTargetFailsClearly) {
  ProcessResult result =
      RunProcess(BinaryPath("eldr-bench"),
                 {"--target=127.0.0.1:1", "--duration_s=1", "--connect_timeout_s=0.5", "--json"}, absl::Seconds(60));
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_THAT(result.stderr_text, ::testing::HasSubstr("cannot connect"));
}

}  // namespace
}  // namespace eldr::testing
