// The CPU reference of the capture library against a straightforward bincount: hand-checked small
// cases for each rule (reset on offset 0, order independence, duplicates, partial blocks, bad data),
// then a paged engine on random and on the bundled real traces.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "capture/capture_test_util.h"
#include "eldr/capture/capture.hpp"
#include "gate_softmax.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::capture {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using testing::RandomRequests;
using testing::RunScenario;
using testing::ScenarioConfig;

std::unique_ptr<Capture> MustCreate(const Options& options) {
  absl::StatusOr<std::unique_ptr<Capture>> capture = Capture::Create(options);
  EXPECT_TRUE(capture.ok()) << capture.status();
  return capture.ok() ? *std::move(capture) : nullptr;
}

// 2 layers x 4 experts, blocks of 4 tokens, 8 blocks, top-2.
Options SmallOptions() {
  Options options;
  options.num_layers = 2;
  options.num_experts = 4;
  options.max_top_k = 2;
  options.num_blocks = 8;
  options.block_size = 4;
  options.max_finish_requests = 4;
  return options;
}

std::vector<int32_t> BlockCounts(Capture& capture, int64_t block) {
  std::vector<int32_t> out(capture.info().num_layers * capture.info().num_experts);
  EXPECT_TRUE(capture.ReadBlockCounts(block, 1, out.data(), nullptr).ok());
  return out;
}

TEST(CaptureOptionsTest, CounterWidthIsTheNarrowestHoldingBlockSizeTimesTopK) {
  struct Case {
    int block_size;
    int top_k;
    int bits;
  };
  for (const Case& c : {Case{16, 8, 8}, Case{31, 8, 8}, Case{32, 8, 16}, Case{15, 17, 8}, Case{16, 16, 16},
                        Case{64, 8, 16}, Case{8191, 8, 16}, Case{8192, 8, 32}, Case{1, 1, 8}}) {
    Options options;
    options.num_layers = 2;
    options.num_experts = 8;
    options.max_top_k = c.top_k;
    options.num_blocks = 4;
    options.block_size = c.block_size;
    auto capture = MustCreate(options);
    ASSERT_NE(capture, nullptr);
    EXPECT_EQ(capture->info().counter_bits, c.bits) << "block_size " << c.block_size << " top_k " << c.top_k;
    EXPECT_GE(uint64_t{capture->info().counter_max}, uint64_t(c.block_size) * c.top_k);
  }
}

TEST(CaptureOptionsTest, ForcedCounterWidthMustHoldTheBound) {
  Options options = SmallOptions();
  options.block_size = 64;
  options.max_top_k = 8;  // bound 512
  options.counter_bits = 8;
  absl::StatusOr<std::unique_ptr<Capture>> capture = Capture::Create(options);
  ASSERT_FALSE(capture.ok());
  EXPECT_EQ(capture.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(capture.status().message(), HasSubstr("cannot hold block_size * max_top_k = 512"));
  options.counter_bits = 32;
  auto wide = MustCreate(options);
  ASSERT_NE(wide, nullptr);
  EXPECT_EQ(wide->info().counter_bits, 32);
}

TEST(CaptureOptionsTest, RejectsBadOptionsWithTheReason) {
  struct Case {
    std::function<void(Options&)> change;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](Options& o) { o.num_layers = 0; }, "num_layers and num_experts must be > 0"},
      {[](Options& o) { o.num_experts = -3; }, "num_layers and num_experts must be > 0"},
      {[](Options& o) { o.max_top_k = 0; }, "max_top_k must be in [1, 1024]"},
      {[](Options& o) { o.block_size = 0; }, "block_size must be >= 1"},
      {[](Options& o) { o.num_blocks = -1; }, "num_blocks must be >= 0"},
      {[](Options& o) { o.num_blocks = 0; }, "neither the block mode nor the direct mode"},
      {[](Options& o) {
         o.num_blocks = int64_t{1} << 28;
         o.block_size = 16;
       },
       "must be below 2^31"},
      {[](Options& o) { o.counter_bits = 12; }, "counter_bits must be 0, 8, 16 or 32"},
      {[](Options& o) { o.max_finish_requests = 0; }, "max_finish_requests must be in"},
      {[](Options& o) { o.result_slots = 0; }, "result_slots must be in"},
      {[](Options& o) { o.max_direct_requests = -1; }, "max_direct_requests must be in"},
      {[](Options& o) { o.device = static_cast<Device>(7); }, "device must be cpu"},
  };
  for (const Case& c : cases) {
    Options options = SmallOptions();
    c.change(options);
    absl::StatusOr<std::unique_ptr<Capture>> capture = Capture::Create(options);
    ASSERT_FALSE(capture.ok()) << c.message;
    EXPECT_EQ(capture.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(capture.status().message(), HasSubstr(c.message));
  }
}

TEST(CaptureRecordTest, CountsEachChoiceIntoTheBlockOfItsSlot) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  // Tokens in slots 8, 9, 10 (block 2, offsets 0..2) and 13 (block 3, offset 1).
  const std::vector<int64_t> slots = {8, 9, 10, 13};
  const std::vector<int32_t> layer0 = {0, 1, 1, 2, 1, 3, 0, 0};
  const std::vector<int32_t> layer1 = {3, 3, 2, 2, 1, 0, 1, 1};
  ASSERT_TRUE(
      capture->Record(0, layer0.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 4, 0, nullptr).ok());
  ASSERT_TRUE(
      capture->Record(1, layer1.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 4, 0, nullptr).ok());
  // Block 2: layer 0 ids {0,1},{1,2},{1,3}; layer 1 ids {3,3},{2,2},{1,0}.
  EXPECT_THAT(BlockCounts(*capture, 2), ElementsAreArray({1, 3, 1, 1, 1, 1, 2, 2}));
  // Block 3: layer 0 {0,0}; layer 1 {1,1} (a duplicate within a token counts twice).
  EXPECT_THAT(BlockCounts(*capture, 3), ElementsAreArray({2, 0, 0, 0, 0, 2, 0, 0}));
  EXPECT_THAT(BlockCounts(*capture, 0), ElementsAreArray({0, 0, 0, 0, 0, 0, 0, 0}));
  absl::StatusOr<Stats> stats = capture->ReadStats(nullptr);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->recorded_choices, 16u);
  EXPECT_EQ(stats->block_resets, 2u);  // slot 8 at offset 0, once per layer call
}

TEST(CaptureRecordTest, ContinuingABlockAddsAndRestartingItResets) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> ids_a = {1, 2, 1, 2};
  const std::vector<int64_t> first_chunk = {20, 21};   // block 5 offsets 0, 1
  const std::vector<int64_t> second_chunk = {22, 23};  // offsets 2, 3: no reset
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(
        capture->Record(layer, ids_a.data(), IndexType::kInt32, 2, first_chunk.data(), IndexType::kInt64, 2, 0, nullptr)
            .ok());
  }
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(
        capture
            ->Record(layer, ids_a.data(), IndexType::kInt32, 2, second_chunk.data(), IndexType::kInt64, 2, 0, nullptr)
            .ok());
  }
  EXPECT_THAT(BlockCounts(*capture, 5), ElementsAreArray({0, 4, 4, 0, 0, 4, 4, 0}));
  // The block is reused for a new request: offset 0 is in the batch, the old counts vanish.
  const std::vector<int32_t> ids_b = {3, 3};
  const std::vector<int64_t> restart = {20};
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(
        capture->Record(layer, ids_b.data(), IndexType::kInt32, 2, restart.data(), IndexType::kInt64, 1, 0, nullptr)
            .ok());
  }
  EXPECT_THAT(BlockCounts(*capture, 5), ElementsAreArray({0, 0, 0, 2, 0, 0, 0, 2}));
}

TEST(CaptureRecordTest, ResetPrecedesTheBatchsAddsWhateverTheTokenOrder) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  // Fill block 1 with stale counts.
  const std::vector<int64_t> stale_slots = {4, 5, 6, 7};
  const std::vector<int32_t> stale_ids = {0, 0, 0, 0, 0, 0, 0, 0};
  ASSERT_TRUE(
      capture->Record(0, stale_ids.data(), IndexType::kInt32, 2, stale_slots.data(), IndexType::kInt64, 4, 0, nullptr)
          .ok());
  // A new fill of block 1 whose offset-0 token comes last in the batch.
  const std::vector<int64_t> slots = {6, 5, 4};
  const std::vector<int32_t> ids = {1, 2, 3, 3, 2, 1};
  ASSERT_TRUE(
      capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 3, 0, nullptr).ok());
  EXPECT_THAT(BlockCounts(*capture, 1), ElementsAreArray({0, 2, 2, 2, 0, 0, 0, 0}));
}

TEST(CaptureRecordTest, BatchResetThenSkipResetEqualsPerLayerReset) {
  ScenarioConfig config;
  config.layers = 3;
  config.experts = 8;
  config.top_k = 2;
  config.block_size = 4;
  config.num_blocks = 32;
  const auto requests = RandomRequests(config, 12, 23, 0.0, 0.3, 11);
  auto per_layer = MustCreate(testing::OptionsFor(config, Device::kCpu));
  config.batch_reset = true;
  auto batched = MustCreate(testing::OptionsFor(config, Device::kCpu));
  ASSERT_NE(per_layer, nullptr);
  ASSERT_NE(batched, nullptr);
  config.batch_reset = false;
  const auto a = RunScenario(*per_layer, Device::kCpu, config, requests);
  config.batch_reset = true;
  const auto b = RunScenario(*batched, Device::kCpu, config, requests);
  EXPECT_EQ(a.finished, b.finished);
  EXPECT_EQ(a.block_counts, b.block_counts);
  EXPECT_EQ(a.finished, a.expected);
}

TEST(CaptureRecordTest, ASlotCountsOncePerFillAndDuplicatesAreCounted) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  const std::vector<int64_t> slots = {9, 10};  // block 2, offsets 1 and 2: no reset
  const std::vector<int32_t> ids = {0, 1, 2, 3};
  for (int repeat = 0; repeat < 3; ++repeat) {
    ASSERT_TRUE(
        capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 2, 0, nullptr).ok());
  }
  EXPECT_THAT(BlockCounts(*capture, 2), ElementsAreArray({1, 1, 1, 1, 0, 0, 0, 0}));
  // The same slot twice in one batch counts once.
  const std::vector<int64_t> twice = {11, 11};
  const std::vector<int32_t> ids_twice = {3, 3, 3, 3};
  ASSERT_TRUE(
      capture->Record(0, ids_twice.data(), IndexType::kInt32, 2, twice.data(), IndexType::kInt64, 2, 0, nullptr).ok());
  EXPECT_THAT(BlockCounts(*capture, 2), ElementsAreArray({1, 1, 1, 3, 0, 0, 0, 0}));
  absl::StatusOr<Stats> stats = capture->ReadStats(nullptr);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->duplicate_slots, 5u);  // 2 tokens x 2 repeats, then one in-batch duplicate
  EXPECT_EQ(stats->recorded_choices, 6u);
  // Refilling the block from offset 0 clears the slot bitmap: the slots count again.
  const std::vector<int64_t> refill = {8, 9};
  ASSERT_TRUE(
      capture->Record(0, ids.data(), IndexType::kInt32, 2, refill.data(), IndexType::kInt64, 2, 0, nullptr).ok());
  EXPECT_THAT(BlockCounts(*capture, 2), ElementsAreArray({1, 1, 1, 1, 0, 0, 0, 0}));
}

TEST(CaptureRecordTest, CountersCannotOverflowAtTheirBound) {
  // 8-bit counters at their bound: block_size 31 * top_k 8 = 248 adds to one counter.
  Options options;
  options.num_layers = 1;
  options.num_experts = 4;
  options.max_top_k = 8;
  options.num_blocks = 2;
  options.block_size = 31;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  ASSERT_EQ(capture->info().counter_bits, 8);
  std::vector<int64_t> slots(31);
  std::iota(slots.begin(), slots.end(), 31);  // block 1 entirely
  const std::vector<int32_t> ids(31 * 8, 2);  // every choice expert 2
  for (int repeat = 0; repeat < 4; ++repeat) {
    ASSERT_TRUE(
        capture->Record(0, ids.data(), IndexType::kInt32, 8, slots.data(), IndexType::kInt64, 31, 0, nullptr).ok());
  }
  EXPECT_THAT(BlockCounts(*capture, 1), ElementsAreArray({0, 0, 248, 0}));
  EXPECT_THAT(BlockCounts(*capture, 0), ElementsAreArray({0, 0, 0, 0}));
}

TEST(CaptureRecordTest, BadDataIsCountedNeverWritten) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  // Slots: padding (-1, -7), past the cache (32, 1000), and one good token (slot 1).
  const std::vector<int64_t> slots = {-1, 32, 1, 1000, -7};
  const std::vector<int64_t> ids = {0, 1, 0, 1, 4, -1, (int64_t{1} << 33) + 2, 3, 2, 2};
  ASSERT_TRUE(
      capture->Record(1, ids.data(), IndexType::kInt64, 2, slots.data(), IndexType::kInt64, 5, 0, nullptr).ok());
  absl::StatusOr<Stats> stats = capture->ReadStats(nullptr);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->padding_tokens, 2u);
  EXPECT_EQ(stats->bad_slots, 2u);
  EXPECT_EQ(stats->bad_expert_ids, 2u);  // 4 and -1 of the good token
  EXPECT_EQ(stats->recorded_choices, 0u);
  for (int64_t b = 0; b < 8; ++b) {
    EXPECT_THAT(BlockCounts(*capture, b), ElementsAreArray({0, 0, 0, 0, 0, 0, 0, 0}));
  }
}

TEST(CaptureRecordTest, RejectsHostCheckableArgumentsWithTheReason) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> ids = {0, 1};
  const std::vector<int64_t> slots = {0};
  struct Case {
    absl::Status status;
    std::string message;
  };
  const std::vector<Case> cases = {
      {capture->Record(2, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 1, 0, nullptr),
       "layer 2 is outside [0, 2)"},
      {capture->Record(-1, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 1, 0, nullptr),
       "layer -1 is outside"},
      {capture->Record(0, ids.data(), IndexType::kInt32, 3, slots.data(), IndexType::kInt64, 1, 0, nullptr),
       "top_k 3 is outside [1, 2]"},
      {capture->Record(0, nullptr, IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 1, 0, nullptr),
       "topk_ids is null"},
      {capture->Record(0, ids.data(), IndexType::kInt32, 2, nullptr, IndexType::kInt64, 1, 0, nullptr),
       "slot_mapping is null"},
      {capture->Record(0, ids.data(), static_cast<IndexType>(5), 2, slots.data(), IndexType::kInt64, 1, 0, nullptr),
       "topk_ids type must be int32 (0) or int64 (1)"},
      {capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), static_cast<IndexType>(2), 1, 0, nullptr),
       "slot_mapping type must be"},
      {capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, -4, 0, nullptr),
       "num_tokens must be in"},
      {capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 1, 0x10, nullptr),
       "unknown flags 0x10"},
      {capture->RecordDirect(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 1, nullptr),
       "direct mode is off"},
  };
  for (const Case& c : cases) {
    EXPECT_FALSE(c.status.ok()) << c.message;
    EXPECT_THAT(c.status.message(), HasSubstr(c.message));
  }
  // Zero tokens is a valid empty batch, even with null arrays.
  EXPECT_TRUE(capture->Record(0, nullptr, IndexType::kInt32, 2, nullptr, IndexType::kInt64, 0, 0, nullptr).ok());
}

TEST(CaptureFinishTest, SumsExactlyTheBlocksUpToTheLength) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  // Block b gets b+1 tokens choosing expert (b % 4) in both layers (and both choices).
  for (int b = 0; b < 8; ++b) {
    std::vector<int64_t> slots;
    for (int o = 0; o <= std::min(b, 3); ++o) slots.push_back(b * 4 + o);
    const std::vector<int32_t> ids(slots.size() * 2, b % 4);
    for (int layer = 0; layer < 2; ++layer) {
      ASSERT_TRUE(capture
                      ->Record(layer, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, slots.size(),
                               0, nullptr)
                      .ok());
    }
  }
  // Request 0: blocks 5, 2 and 7, 9 tokens -> ceil(9/4) = 3 blocks; entry 3 (block 6) not read.
  // Request 1: 0 tokens. Request 2: 4 tokens -> block 1 only; then a bad entry never read.
  const std::vector<int32_t> tables = {5, 2, 7, 6, 3, 3, 3, 3, 1, -9, 4, 4};
  const std::vector<int64_t> lengths = {9, 0, 4};
  for (OutputType type : {OutputType::kInt16, OutputType::kInt32}) {
    auto result = capture->Finish(tables.data(), 4, lengths.data(), 3, type, nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE((*result)->Wait().ok());
    ASSERT_EQ((*result)->num_requests(), 3);
    ASSERT_EQ((*result)->cells_per_request(), 8);
    std::vector<int32_t> got(24);
    if (type == OutputType::kInt16) {
      ASSERT_EQ((*result)->counts_int32(), nullptr);
      std::copy_n((*result)->counts_int16(), 24, got.begin());
    } else {
      ASSERT_EQ((*result)->counts_int16(), nullptr);
      std::copy_n((*result)->counts_int32(), 24, got.begin());
    }
    // Block 5: 4 tokens x 2 choices of expert 1; block 2: 3 tokens of expert 2; block 7: 4 tokens
    // of expert 3.
    EXPECT_THAT(got, ElementsAreArray({0, 8, 6, 8, 0, 8, 6, 8,  //
                                       0, 0, 0, 0, 0, 0, 0, 0,  //
                                       0, 4, 0, 0, 0, 4, 0, 0}));
    EXPECT_EQ((*result)->stats().bad_block_ids, 0u);
  }
}

TEST(CaptureFinishTest, BadBlockIdsInATableAreCountedAndSkipped) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  const std::vector<int64_t> slots = {12};
  const std::vector<int32_t> ids = {1, 1};
  ASSERT_TRUE(
      capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 1, 0, nullptr).ok());
  const std::vector<int32_t> tables = {3, -1, 8, 3};
  const std::vector<int64_t> lengths = {16};
  auto result = capture->Finish(tables.data(), 4, lengths.data(), 1, OutputType::kInt32, nullptr);
  ASSERT_TRUE(result.ok());
  ASSERT_TRUE((*result)->Wait().ok());
  EXPECT_THAT(std::vector<int32_t>((*result)->counts_int32(), (*result)->counts_int32() + 8),
              ElementsAreArray({0, 4, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ((*result)->stats().bad_block_ids, 2u);
}

TEST(CaptureFinishTest, Int16OutputSaturatesAndCountsIt) {
  Options options;
  options.num_layers = 1;
  options.num_experts = 2;
  options.max_top_k = 1;
  options.block_size = 256;
  options.num_blocks = 160;
  options.max_finish_requests = 1;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  const int tokens = 40000;
  std::vector<int64_t> slots(tokens);
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<int32_t> ids(tokens, 1);
  ids[7] = 0;
  ASSERT_TRUE(
      capture->Record(0, ids.data(), IndexType::kInt32, 1, slots.data(), IndexType::kInt64, tokens, 0, nullptr).ok());
  std::vector<int32_t> table(160);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<int64_t> lengths = {tokens};
  auto narrow = capture->Finish(table.data(), 160, lengths.data(), 1, OutputType::kInt16, nullptr);
  ASSERT_TRUE(narrow.ok());
  EXPECT_EQ((*narrow)->counts_int16()[0], 1);
  EXPECT_EQ((*narrow)->counts_int16()[1], 32767);
  EXPECT_EQ((*narrow)->stats().saturated_outputs, 1u);
  narrow->reset();
  auto wide = capture->Finish(table.data(), 160, lengths.data(), 1, OutputType::kInt32, nullptr);
  ASSERT_TRUE(wide.ok());
  EXPECT_EQ((*wide)->counts_int32()[0], 1);
  EXPECT_EQ((*wide)->counts_int32()[1], tokens - 1);
}

TEST(CaptureFinishTest, RejectsHostCheckableArgumentsWithTheReason) {
  Options options = SmallOptions();
  options.max_blocks_per_request = 2;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> tables = {0, 1, 2, 3};
  const std::vector<int64_t> good = {5};
  const std::vector<int64_t> negative = {-1};
  const std::vector<int64_t> too_long = {17};
  const std::vector<int64_t> over_host_limit = {9};
  auto expect_error = [](auto result, const std::string& message) {
    ASSERT_FALSE(result.ok()) << message;
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(result.status().message(), HasSubstr(message));
  };
  expect_error(capture->Finish(tables.data(), 4, negative.data(), 1, OutputType::kInt16, nullptr),
               "lengths[0] = -1 is negative");
  expect_error(capture->Finish(tables.data(), 4, too_long.data(), 1, OutputType::kInt16, nullptr),
               "request 0 has 17 tokens = 5 blocks of 4, more than its block table holds");
  expect_error(capture->Finish(tables.data(), 4, good.data(), 0, OutputType::kInt16, nullptr),
               "num_requests must be in [1, 4]");
  expect_error(capture->Finish(tables.data(), 4, good.data(), 5, OutputType::kInt16, nullptr),
               "num_requests must be in [1, 4]");
  expect_error(capture->Finish(tables.data(), 4, good.data(), 1, static_cast<OutputType>(3), nullptr),
               "output_type must be int16 (0) or int32 (1)");
  expect_error(capture->Finish(nullptr, 4, good.data(), 1, OutputType::kInt16, nullptr), "block_tables is null");
  expect_error(capture->Finish(tables.data(), 4, nullptr, 1, OutputType::kInt16, nullptr), "lengths is null");
  expect_error(capture->Finish(tables.data(), 4, over_host_limit.data(), 1, OutputType::kInt16, nullptr),
               "more than options.max_blocks_per_request = 2");
}

TEST(CaptureFinishTest, ResultSlotsAreLimitedAndReusedAfterRelease) {
  Options options = SmallOptions();
  options.result_slots = 2;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> table = {0};
  const std::vector<int64_t> lengths = {1};
  auto first = capture->Finish(table.data(), 1, lengths.data(), 1, OutputType::kInt16, nullptr);
  auto second = capture->Finish(table.data(), 1, lengths.data(), 1, OutputType::kInt16, nullptr);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(second.ok());
  auto third = capture->Finish(table.data(), 1, lengths.data(), 1, OutputType::kInt16, nullptr);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("all 2 result slots are held"));
  first->reset();
  auto fourth = capture->Finish(table.data(), 1, lengths.data(), 1, OutputType::kInt16, nullptr);
  EXPECT_TRUE(fourth.ok()) << fourth.status();
}

TEST(CaptureFinishTest, ResultsOutliveTheirContextAndKeepTheirStatsSnapshot) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  const std::vector<int64_t> slots = {0, 1};
  const std::vector<int32_t> ids = {2, 3, 2, 9};
  ASSERT_TRUE(
      capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 2, 0, nullptr).ok());
  const std::vector<int32_t> table = {0};
  const std::vector<int64_t> lengths = {2};
  auto result = capture->Finish(table.data(), 1, lengths.data(), 1, OutputType::kInt16, nullptr);
  ASSERT_TRUE(result.ok());
  // Later work changes the context's stats, not the result's snapshot.
  ASSERT_TRUE(
      capture->Record(1, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 2, 0, nullptr).ok());
  capture.reset();
  ASSERT_TRUE((*result)->Wait().ok());
  EXPECT_EQ((*result)->stats().recorded_choices, 3u);
  EXPECT_EQ((*result)->stats().bad_expert_ids, 1u);
  EXPECT_THAT(std::vector<int16_t>((*result)->counts_int16(), (*result)->counts_int16() + 8),
              ElementsAreArray({0, 0, 2, 1, 0, 0, 0, 0}));
}

TEST(CaptureRecordTest, ClearAndResetStats) {
  auto capture = MustCreate(SmallOptions());
  ASSERT_NE(capture, nullptr);
  const std::vector<int64_t> slots = {5};
  const std::vector<int32_t> ids = {1, 2};
  ASSERT_TRUE(
      capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 1, 0, nullptr).ok());
  ASSERT_TRUE(capture->Clear(nullptr).ok());
  EXPECT_THAT(BlockCounts(*capture, 1), ElementsAreArray({0, 0, 0, 0, 0, 0, 0, 0}));
  // Clear also forgets the slot bitmap: recording the slot again is not a duplicate.
  ASSERT_TRUE(
      capture->Record(0, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 1, 0, nullptr).ok());
  EXPECT_THAT(BlockCounts(*capture, 1), ElementsAreArray({0, 1, 1, 0, 0, 0, 0, 0}));
  ASSERT_EQ(capture->ReadStats(nullptr)->recorded_choices, 4u);
  ASSERT_TRUE(capture->ResetStats(nullptr).ok());
  EXPECT_EQ(*capture->ReadStats(nullptr), Stats{});
}

// ---- The paged engine on random inputs ------------------------------------------------------

struct RandomCase {
  int block_size;
  int top_k;
  IndexType id_type;
  IndexType slot_type;
  bool batch_reset;
  OutputType output_type;
};

void PrintTo(const RandomCase& c, std::ostream* os) { *os << "block_size " << c.block_size << " top_k " << c.top_k; }

class CaptureRandomEngineTest : public ::testing::TestWithParam<RandomCase> {};

TEST_P(CaptureRandomEngineTest, EveryFinishedRequestEqualsItsBincount) {
  const RandomCase& c = GetParam();
  ScenarioConfig config;
  config.layers = 5;
  config.experts = 24;
  config.top_k = c.top_k;
  config.block_size = c.block_size;
  const int max_tokens = std::max(70, 3 * c.block_size);
  config.num_blocks = 40 * max_tokens / c.block_size + 64;
  config.max_batch_tokens = 64;
  config.id_type = c.id_type;
  config.slot_type = c.slot_type;
  config.batch_reset = c.batch_reset;
  config.output_type = c.output_type;
  config.seed = static_cast<uint32_t>(c.block_size * 131 + c.top_k);
  const auto requests = RandomRequests(config, 40, max_tokens, 0.02, 0.35, config.seed + 7);
  auto capture = MustCreate(testing::OptionsFor(config, Device::kCpu));
  ASSERT_NE(capture, nullptr);
  const auto outcome = RunScenario(*capture, Device::kCpu, config, requests);

  ASSERT_EQ(outcome.finished.size(), requests.size());
  for (size_t r = 0; r < requests.size(); ++r) {
    ASSERT_EQ(outcome.finished[r], outcome.expected[r]) << "request " << r;
  }
  // The scenario exercised what it is meant to.
  EXPECT_GT(outcome.reused_blocks, 10);
  EXPECT_GT(outcome.shared_prefix_blocks, 5);
  EXPECT_GT(outcome.batches, 10);
  EXPECT_GT(outcome.expected_bad_ids, 0u);
  // Every reported counter matches what the engine fed in.
  EXPECT_EQ(outcome.stats.recorded_choices, outcome.expected_recorded);
  EXPECT_EQ(outcome.stats.bad_expert_ids, outcome.expected_bad_ids);
  EXPECT_EQ(outcome.stats.bad_slots, outcome.expected_bad_slots);
  EXPECT_EQ(outcome.stats.padding_tokens, outcome.expected_padding);
  EXPECT_EQ(outcome.stats.block_resets, outcome.expected_block_resets);
  EXPECT_EQ(outcome.stats.duplicate_slots, 0u);
  EXPECT_EQ(outcome.stats.bad_block_ids, 0u);  // poisoned table padding is never read
  EXPECT_EQ(outcome.stats.saturated_outputs, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CaptureRandomEngineTest,
    ::testing::Values(RandomCase{16, 2, IndexType::kInt32, IndexType::kInt64, false, OutputType::kInt32},
                      RandomCase{16, 8, IndexType::kInt64, IndexType::kInt64, false, OutputType::kInt16},
                      RandomCase{1, 3, IndexType::kInt32, IndexType::kInt32, false, OutputType::kInt32},
                      RandomCase{17, 4, IndexType::kInt64, IndexType::kInt32, true, OutputType::kInt16},
                      RandomCase{64, 6, IndexType::kInt32, IndexType::kInt64, true, OutputType::kInt32},
                      RandomCase{40, 8, IndexType::kInt64, IndexType::kInt64, false, OutputType::kInt32}),
    [](const ::testing::TestParamInfo<RandomCase>& info) {
      const RandomCase& c = info.param;
      return "bs" + std::to_string(c.block_size) + "_k" + std::to_string(c.top_k) +
             (c.id_type == IndexType::kInt64 ? "_ids64" : "_ids32") +
             (c.slot_type == IndexType::kInt64 ? "_slots64" : "_slots32") +
             (c.batch_reset ? "_batchreset" : "_layerreset") +
             (c.output_type == OutputType::kInt16 ? "_out16" : "_out32");
    });

// Gate probabilities through the same engine: prefix sharing, reuse and resets apply to them as to
// the counts. Each sum is within the fixed-point bound of the exact (double) sum: every added
// probability is rounded once to a multiple of 2^-F (error <= 2^-(F+1)), then the total once to
// float32.
TEST_P(CaptureRandomEngineTest, GateProbSumsAreTheExactSumsWithinTheFixedPointBound) {
  const RandomCase& c = GetParam();
  ScenarioConfig config;
  config.layers = 4;
  config.experts = 24;
  config.top_k = c.top_k;
  config.block_size = c.block_size;
  const int max_tokens = std::max(70, 3 * c.block_size);
  config.num_blocks = 40 * max_tokens / c.block_size + 64;
  config.max_batch_tokens = 64;
  config.id_type = c.id_type;
  config.slot_type = c.slot_type;
  config.batch_reset = c.batch_reset;
  config.output_type = c.output_type;
  config.gate_probs = true;
  config.seed = static_cast<uint32_t>(c.block_size * 17 + c.top_k);
  const auto requests = RandomRequests(config, 30, max_tokens, 0.02, 0.35, config.seed + 5);
  auto capture = MustCreate(testing::OptionsFor(config, Device::kCpu));
  ASSERT_NE(capture, nullptr);
  const int fraction_bits = capture->info().gate_prob_fraction_bits;
  EXPECT_GE(fraction_bits, 8);
  EXPECT_LE(fraction_bits, 24);
  EXPECT_EQ(capture->info().block_gate_prob_bytes, static_cast<uint64_t>(config.num_blocks) * 4 * 24 * 4);
  const auto outcome = RunScenario(*capture, Device::kCpu, config, requests);
  ASSERT_EQ(outcome.finished_gate.size(), requests.size());
  double total = 0;
  for (size_t r = 0; r < requests.size(); ++r) {
    ASSERT_EQ(outcome.finished[r], outcome.expected[r]) << "request " << r;  // counts unchanged
    ASSERT_EQ(outcome.finished_gate[r].size(), outcome.expected_gate[r].size());
    for (size_t cell = 0; cell < outcome.expected_gate[r].size(); ++cell) {
      const double exact = outcome.expected_gate[r][cell];
      const double adds = outcome.expected[r][cell];  // at most this many probabilities were added
      const double bound = adds * std::ldexp(1.0, -fraction_bits - 1) + std::abs(exact) * std::ldexp(1.0, -23);
      ASSERT_NEAR(outcome.finished_gate[r][cell], exact, bound) << "request " << r << " cell " << cell;
      if (exact == 0) ASSERT_EQ(outcome.finished_gate[r][cell], 0.0f);
      total += exact;
    }
  }
  EXPECT_GT(total, 100.0);
  EXPECT_GT(outcome.expected_bad_gate_probs, 0u);
  EXPECT_EQ(outcome.stats.bad_gate_probs, outcome.expected_bad_gate_probs);
  EXPECT_EQ(outcome.stats.recorded_choices, outcome.expected_recorded);
  EXPECT_GT(outcome.reused_blocks, 5);
  EXPECT_GT(outcome.shared_prefix_blocks, 5);
}

TEST(CaptureGateProbTest, ExactProbabilitiesSumExactlyAndReuseResetsThem) {
  Options options;
  options.num_layers = 1;
  options.num_experts = 4;
  options.max_top_k = 2;
  options.num_blocks = 2;
  options.block_size = 4;
  options.record_gate_probs = true;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  EXPECT_EQ(capture->info().gate_prob_fraction_bits, 24);
  // Block 0, offsets 0..2: three tokens with dyadic probabilities (exact in fixed point).
  const std::vector<int32_t> ids = {0, 1, 0, 2, 3, 0};
  const std::vector<float> weights = {0.75f, 0.25f, 0.5f, 0.5f, 1.0f, 0.0f};
  const std::vector<int64_t> slots = {0, 1, 2};
  ASSERT_TRUE(capture
                  ->RecordGateProbs(0, ids.data(), IndexType::kInt32, weights.data(), 2, slots.data(),
                                    IndexType::kInt64, 3, 0, nullptr)
                  .ok());
  const int32_t table[] = {0};
  const int64_t length = 3;
  auto gate = capture->FinishGateProbs(table, 1, &length, 1, nullptr);
  ASSERT_TRUE(gate.ok()) << gate.status();
  EXPECT_THAT(std::vector<float>((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + 4),
              ElementsAreArray({1.25f, 0.25f, 0.5f, 1.0f}));
  EXPECT_EQ((*gate)->counts_int16(), nullptr);
  gate->reset();
  // The block is refilled from offset 0 by a plain record (counts only): its gate sums restart too.
  const std::vector<int32_t> ids2 = {1, 2};
  const std::vector<int64_t> slot0 = {0};
  ASSERT_TRUE(
      capture->Record(0, ids2.data(), IndexType::kInt32, 2, slot0.data(), IndexType::kInt64, 1, 0, nullptr).ok());
  const std::vector<float> w2 = {0.125f, 0.875f};
  const std::vector<int64_t> slot1 = {1};
  ASSERT_TRUE(capture
                  ->RecordGateProbs(0, ids2.data(), IndexType::kInt32, w2.data(), 2, slot1.data(), IndexType::kInt64, 1,
                                    0, nullptr)
                  .ok());
  const int64_t two = 2;
  gate = capture->FinishGateProbs(table, 1, &two, 1, nullptr);
  ASSERT_TRUE(gate.ok()) << gate.status();
  EXPECT_THAT(std::vector<float>((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + 4),
              ElementsAreArray({0.0f, 0.125f, 0.875f, 0.0f}));
  auto counts = capture->Finish(table, 1, &two, 1, OutputType::kInt32, nullptr);
  ASSERT_TRUE(counts.ok());
  EXPECT_THAT(std::vector<int32_t>((*counts)->counts_int32(), (*counts)->counts_int32() + 4),
              ElementsAreArray({0, 2, 2, 0}));
}

TEST(CaptureGateProbTest, BadProbabilitiesAreSkippedAndCountedButTheirChoicesCount) {
  Options options;
  options.num_layers = 1;
  options.num_experts = 3;
  options.max_top_k = 1;
  options.num_blocks = 1;
  options.block_size = 8;
  options.record_gate_probs = true;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> ids = {0, 0, 0, 1, 2};
  const std::vector<float> weights = {std::numeric_limits<float>::quiet_NaN(), -0.5f, 2.0f, 0.5f,
                                      std::numeric_limits<float>::infinity()};
  const std::vector<int64_t> slots = {0, 1, 2, 3, 4};
  ASSERT_TRUE(capture
                  ->RecordGateProbs(0, ids.data(), IndexType::kInt32, weights.data(), 1, slots.data(),
                                    IndexType::kInt64, 5, 0, nullptr)
                  .ok());
  const int32_t table[] = {0};
  const int64_t length = 5;
  auto gate = capture->FinishGateProbs(table, 1, &length, 1, nullptr);
  ASSERT_TRUE(gate.ok());
  EXPECT_THAT(std::vector<float>((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + 3),
              ElementsAreArray({0.0f, 0.5f, 0.0f}));
  EXPECT_EQ((*gate)->stats().bad_gate_probs, 4u);
  EXPECT_EQ((*gate)->stats().recorded_choices, 5u);
}

TEST(CaptureGateProbTest, RequiresTheOptionAndRejectsBadArguments) {
  Options options;
  options.num_layers = 2;
  options.num_experts = 4;
  options.num_blocks = 4;
  options.block_size = 16;
  options.max_direct_requests = 2;
  auto plain = MustCreate(options);
  ASSERT_NE(plain, nullptr);
  const int32_t ids[] = {0};
  const float weights[] = {0.5f};
  const int64_t slots[] = {0};
  absl::Status s =
      plain->RecordGateProbs(0, ids, IndexType::kInt32, weights, 1, slots, IndexType::kInt64, 1, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("record_gate_probs"));
  const int64_t length = 1;
  const int32_t table[] = {0};
  EXPECT_EQ(plain->FinishGateProbs(table, 1, &length, 1, nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      plain->RecordDirectGateProbs(0, ids, IndexType::kInt32, weights, 1, ids, IndexType::kInt32, 1, nullptr).code(),
      absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(plain->info().gate_prob_fraction_bits, 0);
  EXPECT_EQ(plain->info().block_gate_prob_bytes, 0u);

  options.record_gate_probs = true;
  auto gated = MustCreate(options);
  ASSERT_NE(gated, nullptr);
  s = gated->RecordGateProbs(0, ids, IndexType::kInt32, nullptr, 1, slots, IndexType::kInt64, 1, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("topk_weights is null"));
  EXPECT_EQ(
      gated->RecordGateProbs(2, ids, IndexType::kInt32, weights, 1, slots, IndexType::kInt64, 1, 0, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  const int64_t too_long = 17;
  EXPECT_EQ(gated->FinishGateProbs(table, 1, &too_long, 1, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  const int32_t twice[] = {1, 1};
  EXPECT_EQ(gated->FinishDirectGateProbs(twice, 2, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  // A block size whose bound leaves too few fraction bits is refused.
  options.block_size = 1 << 20;
  options.max_top_k = 64;
  options.num_blocks = 1;
  auto refused = Capture::Create(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("fraction bits"));
}

TEST(CaptureGateProbTest, DirectModeSumsPerSlotAndItsFinishZeroesOnlyTheGateSums) {
  Options options;
  options.num_layers = 2;
  options.num_experts = 3;
  options.max_top_k = 2;
  options.max_direct_requests = 3;
  options.record_gate_probs = true;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  // Tokens of slots 2, 0, padding, 2.
  const std::vector<int32_t> requests = {2, 0, -1, 2};
  const std::vector<int32_t> ids = {0, 1, 2, 2, 0, 0, 1, 0};
  const std::vector<float> weights = {0.5f, 0.5f, 0.75f, 0.25f, 1.0f, 1.0f, 0.125f, 0.875f};
  for (int layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(capture
                    ->RecordDirectGateProbs(layer, ids.data(), IndexType::kInt32, weights.data(), 2, requests.data(),
                                            IndexType::kInt32, 4, nullptr)
                    .ok());
  }
  const int32_t slots[] = {2, 0};
  auto gate = capture->FinishDirectGateProbs(slots, 2, nullptr);
  ASSERT_TRUE(gate.ok()) << gate.status();
  // Slot 2, each layer: expert 0 gets 0.5 + 0.875, expert 1 gets 0.5 + 0.125. Slot 0: expert 2 gets 1.
  const std::vector<float> want = {1.375f, 0.625f, 0.0f, 1.375f, 0.625f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f, 0.0f, 1.0f};
  EXPECT_THAT(std::vector<float>((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + 12), ElementsAreArray(want));
  gate->reset();
  // The counts are still there; a second gate finish reads zeros.
  auto counts = capture->FinishDirect(slots, 1, OutputType::kInt32, nullptr);
  ASSERT_TRUE(counts.ok());
  EXPECT_THAT(std::vector<int32_t>((*counts)->counts_int32(), (*counts)->counts_int32() + 6),
              ElementsAreArray({2, 2, 0, 2, 2, 0}));
  counts->reset();
  gate = capture->FinishDirectGateProbs(slots, 1, nullptr);
  ASSERT_TRUE(gate.ok());
  EXPECT_THAT(std::vector<float>((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + 6),
              ElementsAreArray({0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}));
}

// ---- Gate logits: softmax over all experts (the reference's gate_prob_all) -------------------------

// round(softmax(row)[e] * 2^bits) computed independently with std::exp in double.
std::vector<double> ReferenceQuantizedSoftmax(const std::vector<float>& row, int bits) {
  const double max = *std::max_element(row.begin(), row.end());
  double sum = 0;
  for (float x : row) sum += std::exp(static_cast<double>(x) - max);
  std::vector<double> q;
  for (float x : row) q.push_back(std::nearbyint(std::exp(static_cast<double>(x) - max) / sum * std::ldexp(1.0, bits)));
  return q;
}

Options GateLogitOptions() {
  Options options;
  options.num_layers = 2;
  options.num_experts = 4;
  options.max_top_k = 2;
  options.num_blocks = 4;
  options.block_size = 4;
  options.max_direct_requests = 2;
  options.record_gate_probs = true;
  return options;
}

std::vector<float> GateSums(Capture& capture, const std::vector<int32_t>& table, int64_t length) {
  auto gate = capture.FinishGateProbs(table.data(), static_cast<int64_t>(table.size()), &length, 1, nullptr);
  EXPECT_TRUE(gate.ok()) << gate.status();
  if (!gate.ok()) return {};
  const int64_t cells = (*gate)->cells_per_request();
  return std::vector<float>((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + cells);
}

TEST(CaptureGateLogitsTest, DeterministicExpIsWithin2ToTheMinus50OfStdExp) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> wide(-708.0, 0.0);
  std::uniform_real_distribution<double> narrow(-20.0, 0.0);
  for (int i = 0; i < 200000; ++i) {
    const double x = i % 2 == 0 ? wide(rng) : narrow(rng);
    const double want = std::exp(x);
    EXPECT_LE(std::abs(internal::DeterministicExp(x) - want), std::ldexp(want, -50)) << x;
  }
  EXPECT_EQ(internal::DeterministicExp(0.0), 1.0);
  EXPECT_EQ(internal::DeterministicExp(-709.0), 0.0);
  EXPECT_EQ(internal::DeterministicExp(-std::numeric_limits<double>::infinity()), 0.0);
}

TEST(CaptureGateLogitsTest, AddsTheSoftmaxOverAllExpertsNotOnlyTheTopK) {
  auto capture = MustCreate(GateLogitOptions());
  ASSERT_NE(capture, nullptr);
  const int bits = capture->info().gate_prob_fraction_bits;
  ASSERT_EQ(bits, 24);
  // Three tokens in block 1 (slots 4..6); top-2 ids say nothing about the probabilities.
  const std::vector<int32_t> ids = {0, 1, 2, 3, 1, 2};
  const std::vector<float> logits = {0.0f,   0.0f, 0.0f, 0.0f,    // uniform: exactly 1/4 each
                                     1000.f, 0.0f, 0.0f, 0.0f,    // stable: no overflow, {1, 0, 0, 0}
                                     0.5f,   -1.f, 2.0f, 0.25f};  // a general row
  const std::vector<int64_t> slots = {4, 5, 6};
  ASSERT_TRUE(capture
                  ->RecordGateLogits(1, ids.data(), IndexType::kInt32, 2, logits.data(), LogitsType::kFloat32, 0,
                                     slots.data(), IndexType::kInt64, 3, 0, nullptr)
                  .ok());
  const std::vector<float> sums = GateSums(*capture, {1}, 3);
  ASSERT_EQ(sums.size(), 8u);
  // Layer 0 untouched.
  for (int e = 0; e < 4; ++e) EXPECT_EQ(sums[e], 0.0f);
  const std::vector<double> general = ReferenceQuantizedSoftmax({0.5f, -1.f, 2.0f, 0.25f}, bits);
  const std::vector<double> want = {0.25 + 1.0, 0.25, 0.25, 0.25};
  for (int e = 0; e < 4; ++e) {
    const double expected = want[e] + std::ldexp(general[e], -bits);
    EXPECT_NEAR(sums[4 + e], expected, std::ldexp(1.0, -bits) + expected * 1e-7) << e;
  }
  // Every expert of the general row got its probability, including the one no token chose (0).
  EXPECT_GT(sums[4] - 1.25f, 0.0f);
  // Counts as eldr_capture_record.
  EXPECT_THAT(BlockCounts(*capture, 1), ElementsAreArray({0, 0, 0, 0, 1, 2, 2, 1}));
}

TEST(CaptureGateLogitsTest, RandomRowsMatchAStdExpSoftmaxWithinOneGridStepPerToken) {
  Options options = GateLogitOptions();
  options.num_layers = 1;
  options.num_experts = 64;
  options.max_top_k = 8;
  options.block_size = 16;
  options.num_blocks = 8;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  const int bits = capture->info().gate_prob_fraction_bits;
  const int tokens = 100, experts = 64;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(tokens * experts);
  for (float& x : logits) x = normal(rng);
  std::vector<int32_t> ids(tokens * 8);
  for (int i = 0; i < tokens * 8; ++i) ids[i] = i % experts;
  std::vector<int64_t> slots(tokens);
  std::iota(slots.begin(), slots.end(), 0);
  ASSERT_TRUE(capture
                  ->RecordGateLogits(0, ids.data(), IndexType::kInt32, 8, logits.data(), LogitsType::kFloat32, 0,
                                     slots.data(), IndexType::kInt64, tokens, 0, nullptr)
                  .ok());
  std::vector<double> want(experts, 0.0);
  int64_t exact = 0;
  for (int t = 0; t < tokens; ++t) {
    const std::vector<double> q =
        ReferenceQuantizedSoftmax(std::vector<float>(&logits[t * experts], &logits[(t + 1) * experts]), bits);
    for (int e = 0; e < experts; ++e) want[e] += q[e];
  }
  const std::vector<float> sums = GateSums(*capture, {0, 1, 2, 3, 4, 5, 6}, tokens);
  double total = 0;
  for (int e = 0; e < experts; ++e) {
    const double expected = std::ldexp(want[e], -bits);
    // At most one grid step per token (a probability on a rounding boundary), plus float32 rounding.
    EXPECT_NEAR(sums[e], expected, tokens * std::ldexp(1.0, -bits) + expected * 1.2e-7) << e;
    exact += sums[e] == static_cast<float>(expected);
    total += sums[e];
  }
  EXPECT_GE(exact, experts - 2);
  // Each token's distribution sums to 1 (within half a grid step per expert).
  EXPECT_NEAR(total, tokens, tokens * experts * std::ldexp(1.0, -bits - 1) + 1e-4);
}

TEST(CaptureGateLogitsTest, ReuseFromOffsetZeroResetsTheLogitSums) {
  auto capture = MustCreate(GateLogitOptions());
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> ids = {0, 1, 0, 1};
  const std::vector<float> first = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const std::vector<int64_t> slots = {8, 9};
  ASSERT_TRUE(capture
                  ->RecordGateLogits(0, ids.data(), IndexType::kInt32, 2, first.data(), LogitsType::kFloat32, 0,
                                     slots.data(), IndexType::kInt64, 2, 0, nullptr)
                  .ok());
  EXPECT_THAT(std::vector<float>(GateSums(*capture, {2}, 2)),
              ElementsAreArray({0.5f, 0.5f, 0.5f, 0.5f, 0.f, 0.f, 0.f, 0.f}));
  // Block 2 refilled from offset 0 with one token: only its distribution remains.
  const std::vector<float> second = {100.f, 0.f, 0.f, 0.f};
  ASSERT_TRUE(capture
                  ->RecordGateLogits(0, ids.data(), IndexType::kInt32, 2, second.data(), LogitsType::kFloat32, 0,
                                     slots.data(), IndexType::kInt64, 1, 0, nullptr)
                  .ok());
  EXPECT_THAT(std::vector<float>(GateSums(*capture, {2}, 1)),
              ElementsAreArray({1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}));
  // A duplicate slot adds neither counts nor probabilities.
  ASSERT_TRUE(capture
                  ->RecordGateLogits(0, ids.data(), IndexType::kInt32, 2, first.data(), LogitsType::kFloat32, 0,
                                     &slots[0], IndexType::kInt64, 1, kRecordSkipReset, nullptr)
                  .ok());
  EXPECT_THAT(std::vector<float>(GateSums(*capture, {2}, 1)),
              ElementsAreArray({1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}));
  absl::StatusOr<Stats> stats = capture->ReadStats(nullptr);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->duplicate_slots, 1u);
}

TEST(CaptureGateLogitsTest, NonFiniteLogitsSkipTheTokenAndAreCountedButItsChoicesCount) {
  auto capture = MustCreate(GateLogitOptions());
  ASSERT_NE(capture, nullptr);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<int32_t> ids = {0, 1, 2, 3, 0, 1, 2, 3};
  const std::vector<float> logits = {nan,  0.f,  0.f,  0.f,  0.f, inf, 0.f, 0.f,
                                     -inf, -inf, -inf, -inf, 0.f, 0.f, 0.f, 0.f};
  const std::vector<int64_t> slots = {0, 1, 2, 3};
  ASSERT_TRUE(capture
                  ->RecordGateLogits(0, ids.data(), IndexType::kInt32, 2, logits.data(), LogitsType::kFloat32, 0,
                                     slots.data(), IndexType::kInt64, 4, 0, nullptr)
                  .ok());
  auto gate = capture->FinishGateProbs(std::vector<int32_t>{0}.data(), 1, std::vector<int64_t>{4}.data(), 1, nullptr);
  ASSERT_TRUE(gate.ok());
  EXPECT_THAT(std::vector<float>((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + 4),
              ElementsAreArray({0.25f, 0.25f, 0.25f, 0.25f}));
  EXPECT_EQ((*gate)->stats().bad_gate_probs, 3u);
  EXPECT_EQ((*gate)->stats().recorded_choices, 8u);
  EXPECT_THAT(BlockCounts(*capture, 0), ElementsAreArray({2, 2, 2, 2, 0, 0, 0, 0}));
}

TEST(CaptureGateLogitsTest, StridedBfloat16AndFloat16RowsEqualTheirFloat32Values) {
  const std::vector<int32_t> ids = {0, 1, 2, 3};
  const std::vector<int64_t> slots = {0, 1};
  // Values exact in all three types; row stride 6 (two padding values per row, never read).
  const std::vector<float> f32 = {1.5f, -2.f, 0.25f, 3.f, 99.f, 99.f, -0.5f, 0.f, 4.f, -8.f, 99.f, 99.f};
  auto bits16 = [](float x, bool bf16) -> uint16_t {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if (bf16) return static_cast<uint16_t>(u >> 16);
    if (x == 99.f) return 0x7c00;  // padding: +inf, which would poison the row if read
    // binary16 of a normal float exact in 11 bits.
    const uint32_t sign = (u >> 16) & 0x8000u;
    if ((u & 0x7fffffffu) == 0) return static_cast<uint16_t>(sign);
    const int exponent = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
    return static_cast<uint16_t>(sign | (exponent << 10) | ((u >> 13) & 0x3ff));
  };
  std::vector<float> reference;
  for (LogitsType type : {LogitsType::kFloat32, LogitsType::kBfloat16, LogitsType::kFloat16}) {
    auto capture = MustCreate(GateLogitOptions());
    ASSERT_NE(capture, nullptr);
    std::vector<uint16_t> half;
    for (float x : f32) half.push_back(bits16(x, type == LogitsType::kBfloat16));
    const void* data = type == LogitsType::kFloat32 ? static_cast<const void*>(f32.data()) : half.data();
    ASSERT_TRUE(capture
                    ->RecordGateLogits(0, ids.data(), IndexType::kInt32, 2, data, type, 6, slots.data(),
                                       IndexType::kInt64, 2, 0, nullptr)
                    .ok());
    const std::vector<float> sums = GateSums(*capture, {0}, 2);
    if (reference.empty()) {
      reference = sums;
      const std::vector<double> a = ReferenceQuantizedSoftmax({1.5f, -2.f, 0.25f, 3.f}, 24);
      const std::vector<double> b = ReferenceQuantizedSoftmax({-0.5f, 0.f, 4.f, -8.f}, 24);
      for (int e = 0; e < 4; ++e) EXPECT_NEAR(sums[e], std::ldexp(a[e] + b[e], -24), 2 * std::ldexp(1.0, -24));
    } else {
      EXPECT_EQ(sums, reference) << static_cast<int>(type);
    }
    absl::StatusOr<Stats> stats = capture->ReadStats(nullptr);
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->bad_gate_probs, 0u);
  }
}

TEST(CaptureGateLogitsTest, DirectModeAddsTheSoftmaxToTheTokensSlot) {
  auto capture = MustCreate(GateLogitOptions());
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> requests = {1, -1, 1, 0};
  const std::vector<int32_t> ids = {0, 1, 0, 1, 2, 3, 3, 2};
  const std::vector<float> logits = {0.f, 0.f, 0.f, 0.f, 5.f, 5.f, 5.f, 5.f, 0.f, 0.f, 0.f, 0.f, 1e4f, 0.f, 0.f, 0.f};
  ASSERT_TRUE(capture
                  ->RecordDirectGateLogits(1, ids.data(), IndexType::kInt32, 2, logits.data(), LogitsType::kFloat32, 0,
                                           requests.data(), IndexType::kInt32, 4, nullptr)
                  .ok());
  const int32_t slots[] = {1, 0};
  auto gate = capture->FinishDirectGateProbs(slots, 2, nullptr);
  ASSERT_TRUE(gate.ok()) << gate.status();
  EXPECT_THAT(std::vector<float>((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + 16),
              ElementsAreArray({0.f, 0.f, 0.f, 0.f, 0.5f, 0.5f, 0.5f, 0.5f,  //
                                0.f, 0.f, 0.f, 0.f, 1.f, 0.f, 0.f, 0.f}));
  auto counts = capture->FinishDirect(slots, 2, OutputType::kInt32, nullptr);
  ASSERT_TRUE(counts.ok());
  EXPECT_THAT(std::vector<int32_t>((*counts)->counts_int32(), (*counts)->counts_int32() + 16),
              ElementsAreArray({0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1}));
}

TEST(CaptureGateLogitsTest, RequiresTheOptionAndRejectsBadArguments) {
  Options options = GateLogitOptions();
  options.record_gate_probs = false;
  auto plain = MustCreate(options);
  ASSERT_NE(plain, nullptr);
  const int32_t ids[] = {0};
  const float logits[] = {0.f, 0.f, 0.f, 0.f};
  const int64_t slots[] = {0};
  absl::Status s = plain->RecordGateLogits(0, ids, IndexType::kInt32, 1, logits, LogitsType::kFloat32, 0, slots,
                                           IndexType::kInt64, 1, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("record_gate_logits"));
  auto gated = MustCreate(GateLogitOptions());
  ASSERT_NE(gated, nullptr);
  s = gated->RecordGateLogits(0, ids, IndexType::kInt32, 1, nullptr, LogitsType::kFloat32, 0, slots, IndexType::kInt64,
                              1, 0, nullptr);
  EXPECT_THAT(s.message(), HasSubstr("router_logits is null"));
  s = gated->RecordGateLogits(0, ids, IndexType::kInt32, 1, logits, LogitsType::kFloat32, 3, slots, IndexType::kInt64,
                              1, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("logits_stride 3"));
  s = gated->RecordGateLogits(0, ids, IndexType::kInt32, 1, logits, static_cast<LogitsType>(7), 0, slots,
                              IndexType::kInt64, 1, 0, nullptr);
  EXPECT_THAT(s.message(), HasSubstr("logits_type"));
  s = gated->RecordDirectGateLogits(0, ids, IndexType::kInt32, 1, logits, LogitsType::kFloat32, 0, ids,
                                    IndexType::kInt32, 1, nullptr);
  EXPECT_TRUE(s.ok()) << s;
  // No tokens: nothing to read, OK even with null arrays.
  EXPECT_TRUE(gated
                  ->RecordGateLogits(0, nullptr, IndexType::kInt32, 1, nullptr, LogitsType::kFloat32, 0, nullptr,
                                     IndexType::kInt64, 0, 0, nullptr)
                  .ok());
}

// The largest block bound still leaves room for block_size tokens of probability 1 in one cell.
TEST(CaptureGateLogitsTest, AFullBlockOfCertainTokensFitsTheAccumulator) {
  Options options;
  options.num_layers = 1;
  options.num_experts = 2;
  options.max_top_k = 1;
  options.num_blocks = 1;
  options.block_size = 1 << 15;  // 16 integer bits: F = 16
  options.record_gate_probs = true;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  EXPECT_EQ(capture->info().gate_prob_fraction_bits, 16);
  const int n = options.block_size;
  std::vector<float> logits;
  for (int t = 0; t < n; ++t) logits.insert(logits.end(), {50.f, -50.f});
  std::vector<int32_t> ids(n, 0);
  std::vector<int64_t> slots(n);
  std::iota(slots.begin(), slots.end(), 0);
  ASSERT_TRUE(capture
                  ->RecordGateLogits(0, ids.data(), IndexType::kInt32, 1, logits.data(), LogitsType::kFloat32, 0,
                                     slots.data(), IndexType::kInt64, n, 0, nullptr)
                  .ok());
  const std::vector<float> sums = GateSums(*capture, {0}, n);
  EXPECT_EQ(sums[0], static_cast<float>(n));  // e^-100 rounds to 0 on the 2^-16 grid
  EXPECT_EQ(sums[1], 0.0f);
}

// ---- The paged engine on the bundled real traces ---------------------------------------------

TEST(CaptureRealTraceTest, EveryFinishedRequestEqualsItsBincount) {
  absl::StatusOr<testing::LoadedTraces> traces = testing::LoadBundledTraces(6);
  ASSERT_TRUE(traces.ok()) << traces.status();
  ASSERT_EQ(traces->layers, 26);
  ASSERT_EQ(traces->top_k, 6);
  ScenarioConfig config;
  config.layers = traces->layers;
  config.experts = traces->experts;
  config.top_k = traces->top_k;
  config.block_size = 16;
  config.num_blocks = 160;
  config.max_batch_tokens = 256;
  config.output_type = OutputType::kInt16;
  config.max_finish_per_call = 4;
  const auto requests = testing::TraceRequests(config, traces->sequences, traces->tokens, /*max_tokens=*/300);
  ASSERT_EQ(requests.size(), 24u);
  auto capture = MustCreate(testing::OptionsFor(config, Device::kCpu));
  ASSERT_NE(capture, nullptr);
  const auto outcome = RunScenario(*capture, Device::kCpu, config, requests);
  for (size_t r = 0; r < requests.size(); ++r) {
    ASSERT_EQ(outcome.finished[r], outcome.expected[r]) << "request " << r;
    // Rows sum to prompt_tokens * top_k: nothing lost, nothing double counted.
    const int64_t total = std::accumulate(outcome.finished[r].begin(), outcome.finished[r].end(), int64_t{0});
    EXPECT_EQ(total, int64_t{requests[r].tokens} * config.layers * config.top_k);
  }
  EXPECT_GT(outcome.shared_prefix_blocks, 0);
  EXPECT_GT(outcome.reused_blocks, 0);
  EXPECT_EQ(outcome.stats.recorded_choices, outcome.expected_recorded);
  EXPECT_EQ(outcome.stats.bad_expert_ids, 0u);
}

// ---- Direct mode ---------------------------------------------------------------------------

TEST(CaptureDirectTest, AccumulatesByRequestSlotAndFinishZeroesTheSlots) {
  Options options;
  options.num_layers = 3;
  options.num_experts = 10;
  options.max_top_k = 4;
  options.max_direct_requests = 6;
  options.max_finish_requests = 6;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  std::mt19937 rng(5);
  const int cells = 30;
  std::vector<std::vector<int32_t>> expected(6, std::vector<int32_t>(cells, 0));
  uint64_t bad_ids = 0, bad_requests = 0, padding = 0;
  for (int batch = 0; batch < 5; ++batch) {
    const int n = 50;
    std::vector<int64_t> requests(n);
    for (int64_t& r : requests) {
      const int pick = static_cast<int>(rng() % 10);
      r = pick < 6 ? pick : pick < 8 ? -1 : 6 + pick;  // slots 0..5, padding, out of range
    }
    for (int layer = 0; layer < 3; ++layer) {
      std::vector<int32_t> ids(n * 4);
      for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 11);  // 10 is out of range
      ASSERT_TRUE(
          capture->RecordDirect(layer, ids.data(), IndexType::kInt32, 4, requests.data(), IndexType::kInt64, n, nullptr)
              .ok());
      for (int t = 0; t < n; ++t) {
        if (requests[t] < 0) {
          ++padding;
          continue;
        }
        if (requests[t] >= 6) {
          ++bad_requests;
          continue;
        }
        for (int j = 0; j < 4; ++j) {
          const int32_t id = ids[t * 4 + j];
          if (id >= 10) {
            ++bad_ids;
          } else {
            ++expected[requests[t]][layer * 10 + id];
          }
        }
      }
    }
  }
  std::vector<int32_t> read(6 * cells);
  ASSERT_TRUE(capture->ReadDirectCounts(0, 6, read.data(), nullptr).ok());
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(std::vector<int32_t>(read.begin() + r * cells, read.begin() + (r + 1) * cells), expected[r]);
  }
  const std::vector<int32_t> finishing = {4, 1};
  auto result = capture->FinishDirect(finishing.data(), 2, OutputType::kInt16, nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE((*result)->Wait().ok());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(std::vector<int32_t>((*result)->counts_int16() + i * cells, (*result)->counts_int16() + (i + 1) * cells),
              expected[finishing[i]]);
  }
  const Stats stats = (*result)->stats();
  EXPECT_EQ(stats.bad_expert_ids, bad_ids);
  EXPECT_EQ(stats.bad_request_indices, bad_requests);
  EXPECT_EQ(stats.padding_tokens, padding);
  ASSERT_TRUE(capture->ReadDirectCounts(0, 6, read.data(), nullptr).ok());
  for (int r = 0; r < 6; ++r) {
    const bool finished = r == 4 || r == 1;
    EXPECT_EQ(std::vector<int32_t>(read.begin() + r * cells, read.begin() + (r + 1) * cells),
              finished ? std::vector<int32_t>(cells, 0) : expected[r])
        << "slot " << r;
  }
}

TEST(CaptureDirectTest, RejectsBadRequestSlots) {
  Options options;
  options.num_layers = 1;
  options.num_experts = 4;
  options.max_direct_requests = 3;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> repeated = {1, 2, 1};
  auto dup = capture->FinishDirect(repeated.data(), 3, OutputType::kInt32, nullptr);
  ASSERT_FALSE(dup.ok());
  EXPECT_THAT(dup.status().message(), HasSubstr("request slot 1 appears twice"));
  const std::vector<int32_t> outside = {0, 3};
  auto out = capture->FinishDirect(outside.data(), 2, OutputType::kInt32, nullptr);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(), HasSubstr("request_slots[1] = 3 is outside [0, 3)"));
  // The block mode is off in this context.
  const std::vector<int64_t> lengths = {1};
  auto blocks = capture->Finish(repeated.data(), 1, lengths.data(), 1, OutputType::kInt32, nullptr);
  ASSERT_FALSE(blocks.ok());
  EXPECT_EQ(blocks.status().code(), absl::StatusCode::kFailedPrecondition);
}

// ---- Threads -------------------------------------------------------------------------------

TEST(CaptureThreadTest, ConcurrentRecordsAndFinishesKeepEveryCount) {
  Options options;
  options.num_layers = 4;
  options.num_experts = 8;
  options.max_top_k = 2;
  options.num_blocks = 64;
  options.block_size = 8;
  options.result_slots = 8;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  // Thread i owns blocks [16 i, 16 i + 16) and records all layers of 128 tokens, then finishes.
  std::vector<std::thread> threads;
  std::vector<std::vector<int32_t>> results(4);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      std::vector<int64_t> slots(128);
      std::iota(slots.begin(), slots.end(), int64_t{i} * 128);
      std::vector<int32_t> ids(256);
      for (int t = 0; t < 256; ++t) ids[t] = (t + i) % 8;
      for (int layer = 0; layer < 4; ++layer) {
        EXPECT_TRUE(
            capture->Record(layer, ids.data(), IndexType::kInt32, 2, slots.data(), IndexType::kInt64, 128, 0, nullptr)
                .ok());
      }
      std::vector<int32_t> table(16);
      std::iota(table.begin(), table.end(), 16 * i);
      const std::vector<int64_t> lengths = {128};
      auto result = capture->Finish(table.data(), 16, lengths.data(), 1, OutputType::kInt32, nullptr);
      EXPECT_TRUE(result.ok());
      if (result.ok()) {
        results[i].assign((*result)->counts_int32(), (*result)->counts_int32() + 32);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 4; ++i) {
    // 256 choices per layer spread evenly over 8 experts.
    EXPECT_EQ(results[i], std::vector<int32_t>(32, 32)) << "thread " << i;
  }
}

}  // namespace
}  // namespace eldr::capture
