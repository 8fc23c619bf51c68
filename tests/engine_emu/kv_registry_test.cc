// The prefill engine's KV registry: block ids, pull once, 404 after a pull, 409 on a mismatch,
// freed after the hold timeout, and the metrics it keeps.
#include "engine_emu/kv_registry.h"

#include <set>

#include "engine_emu/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/process.h"

namespace eldr::engine_emu {
namespace {

using ::testing::HasSubstr;

class KvRegistryTest : public ::testing::Test {
 protected:
  KvRegistryTest() : metrics_(EngineRole::kPrefill, "m"), registry_(Options(), &metrics_) {}
  static KvRegistryOptions Options() {
    KvRegistryOptions options;
    options.engine_id = "engine-A";
    options.hold_timeout_us = 1000;
    options.capacity_tokens = 1600;
    return options;
  }
  std::optional<double> Sample(const std::string& series) {
    return eldr::testing::SampleValue(metrics_.Serialize(), series);
  }

  EmuMetrics metrics_;
  KvRegistry registry_;
};

TEST_F(KvRegistryTest, BlockIdsAreFreshAndCeilOfPromptOver16) {
  const std::vector<int64_t> a = registry_.Hold("r1", 33, 0);  // ceil(33/16) = 3
  const std::vector<int64_t> b = registry_.Hold("r2", 16, 0);  // 1
  const std::vector<int64_t> c = registry_.Hold("r3", 1, 0);   // 1
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(b.size(), 1u);
  EXPECT_EQ(c.size(), 1u);
  std::set<int64_t> all(a.begin(), a.end());
  all.insert(b.begin(), b.end());
  all.insert(c.begin(), c.end());
  EXPECT_EQ(all.size(), 5u);
  EXPECT_EQ(registry_.held_requests(), 3);
  EXPECT_EQ(registry_.held_blocks(), 5);
  EXPECT_EQ(Sample("eldr_emu_kv_held_requests"), 3);
  EXPECT_DOUBLE_EQ(*Sample("vllm:kv_cache_usage_perc{model_name=\"m\"}"), 5.0 * 16 / 1600);
}

TEST_F(KvRegistryTest, PullsOnceThenNotFound) {
  const std::vector<int64_t> blocks = registry_.Hold("r1", 40, 0);
  absl::StatusOr<int> pulled = registry_.Pull("engine-A", "r1", blocks, 10);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(*pulled, 3);
  EXPECT_EQ(registry_.held_requests(), 0);
  absl::StatusOr<int> again = registry_.Pull("engine-A", "r1", blocks, 11);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("no KV is held for request 'r1'"));
  EXPECT_EQ(Sample("eldr_emu_kv_freed_total{reason=\"pulled\"}"), 1);
  EXPECT_EQ(Sample("eldr_emu_kv_freed_total{reason=\"timeout\"}"), 0);
  EXPECT_EQ(registry_.Pull("engine-A", "never", blocks, 12).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(KvRegistryTest, MismatchIsConflictAndKeepsTheHold) {
  const std::vector<int64_t> blocks = registry_.Hold("r1", 20, 0);
  absl::StatusOr<int> wrong_engine = registry_.Pull("engine-B", "r1", blocks, 1);
  EXPECT_EQ(wrong_engine.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(wrong_engine.status().message()), HasSubstr("engine-B"));
  std::vector<int64_t> other = blocks;
  other.back() += 100;
  EXPECT_EQ(registry_.Pull("engine-A", "r1", other, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry_.Pull("engine-A", "r1", {}, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry_.held_requests(), 1);
  EXPECT_TRUE(registry_.Pull("engine-A", "r1", blocks, 2).ok());
}

TEST_F(KvRegistryTest, FreedAfterTheTimeout) {
  const std::vector<int64_t> first = registry_.Hold("r1", 16, 0);
  const std::vector<int64_t> second = registry_.Hold("r2", 16, 500);
  EXPECT_EQ(registry_.NextDeadline(), 1000);
  EXPECT_EQ(registry_.ExpireDue(999), 0);
  EXPECT_EQ(registry_.ExpireDue(1000), 1);  // r1's deadline
  EXPECT_EQ(registry_.held_requests(), 1);
  EXPECT_EQ(registry_.Pull("engine-A", "r1", first, 1001).status().code(), absl::StatusCode::kNotFound);
  // r2's deadline passed but nothing expired it yet: it is not pullable either.
  EXPECT_EQ(registry_.Pull("engine-A", "r2", second, 1600).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry_.held_requests(), 0);
  EXPECT_EQ(Sample("eldr_emu_kv_freed_total{reason=\"timeout\"}"), 2);
  EXPECT_EQ(registry_.ExpireDue(5000), 0);
}

TEST_F(KvRegistryTest, PulledHoldsAreNotExpired) {
  const std::vector<int64_t> blocks = registry_.Hold("r1", 16, 0);
  ASSERT_TRUE(registry_.Pull("engine-A", "r1", blocks, 1).ok());
  EXPECT_EQ(registry_.ExpireDue(2000), 0);
  EXPECT_EQ(Sample("eldr_emu_kv_freed_total{reason=\"timeout\"}"), 0);
}

TEST_F(KvRegistryTest, RepeatedRequestIdsArePulledByTheirBlocks) {
  const std::vector<int64_t> a = registry_.Hold("same", 16, 0);
  const std::vector<int64_t> b = registry_.Hold("same", 32, 0);
  absl::StatusOr<int> pulled_b = registry_.Pull("engine-A", "same", b, 1);
  ASSERT_TRUE(pulled_b.ok());
  EXPECT_EQ(*pulled_b, 2);
  EXPECT_EQ(registry_.Pull("engine-A", "same", b, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<int> pulled_a = registry_.Pull("engine-A", "same", a, 1);
  ASSERT_TRUE(pulled_a.ok());
  EXPECT_EQ(*pulled_a, 1);
  EXPECT_EQ(registry_.Pull("engine-A", "same", a, 1).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace eldr::engine_emu
