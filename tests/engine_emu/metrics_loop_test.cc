// The metrics page (the vLLM gauges eldr-router's scraper reads, the eldr_emu_* series) and the
// asio engine loop (posted work and timers run on its thread, in order, never early).
#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "engine_emu/engine_loop.h"
#include "engine_emu/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/process.h"

namespace eldr::engine_emu {
namespace {

using ::testing::HasSubstr;

TEST(EmuMetricsTest, VllmGaugesCarryTheModelName) {
  EmuMetrics metrics(EngineRole::kDecode, "deepseek-v2-lite-esft");
  metrics.SetRunning(5);
  metrics.SetWaiting(2);
  metrics.SetKvUsage(1.7);  // clamped
  const std::string page = metrics.Serialize();
  EXPECT_EQ(eldr::testing::SampleValue(page, "vllm:num_requests_running{model_name=\"deepseek-v2-lite-esft\"}"), 5);
  EXPECT_EQ(eldr::testing::SampleValue(page, "vllm:num_requests_waiting{model_name=\"deepseek-v2-lite-esft\"}"), 2);
  EXPECT_EQ(eldr::testing::SampleValue(page, "vllm:kv_cache_usage_perc{model_name=\"deepseek-v2-lite-esft\"}"), 1);
  EXPECT_THAT(page, HasSubstr("# TYPE vllm:num_requests_running gauge"));
}

TEST(EmuMetricsTest, Counters) {
  EmuMetrics metrics(EngineRole::kDecode, "m");
  metrics.CountRequest(RequestOutcome::kOk);
  metrics.CountRequest(RequestOutcome::kAborted);
  metrics.CountRequest(RequestOutcome::kAborted);
  metrics.CountStep(3, 40, 1500);
  metrics.CountStep(2, 30, 500);
  metrics.CountGeneratedTokens(5);
  const std::string page = metrics.Serialize();
  EXPECT_EQ(eldr::testing::SampleValue(page, "eldr_emu_requests_total{outcome=\"ok\",role=\"decode\"}"), 1);
  EXPECT_EQ(eldr::testing::SampleValue(page, "eldr_emu_requests_total{outcome=\"aborted\",role=\"decode\"}"), 2);
  EXPECT_EQ(eldr::testing::SampleValue(page, "eldr_emu_requests_aborted_total{role=\"decode\"}"), 2);
  EXPECT_EQ(eldr::testing::SampleValue(page, "eldr_emu_decode_steps_total"), 2);
  EXPECT_EQ(eldr::testing::SampleValue(page, "eldr_emu_decode_step_batch_total"), 5);
  EXPECT_EQ(eldr::testing::SampleValue(page, "eldr_emu_decode_step_distinct_experts_total"), 70);
  EXPECT_NEAR(*eldr::testing::SampleValue(page, "eldr_emu_decode_step_seconds_total"), 0.002, 1e-12);
  EXPECT_EQ(eldr::testing::SampleValue(page, "eldr_emu_generated_tokens_total"), 5);
}

TEST(EngineLoopTest, PostedWorkAndTimersRunInOrderNeverEarly) {
  EngineLoop loop;
  std::vector<int> order;  // touched only on the loop's thread
  std::vector<double> lateness;
  absl::Notification done;
  loop.Post([&] {
    const double now = loop.NowUs();
    // Scheduled out of order; each runs at its time or later.
    for (const auto& [delay, number] : std::vector<std::pair<double, int>>{{3000, 3}, {1000, 1}, {2000, 2}}) {
      const double at = now + delay;
      const int id = number;  // clang 14 cannot capture a structured binding
      loop.RunAt(at, [&, at, id] {
        order.push_back(id);
        lateness.push_back(loop.NowUs() - at);
        if (order.size() == 3) done.Notify();
      });
    }
  });
  loop.Start();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  loop.Stop();
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  for (double late : lateness) EXPECT_GE(late, 0);
}

TEST(EngineLoopTest, NothingRunsAfterStop) {
  EngineLoop loop;
  loop.Start();
  loop.Stop();
  std::atomic<bool> ran{false};
  loop.Post([&] { ran = true; });
  loop.Stop();  // idempotent
  EXPECT_FALSE(ran.load());
}

}  // namespace
}  // namespace eldr::engine_emu
