// The CUDA path against the CPU reference, bit for bit: the same engine scenarios (random and real
// traces, every counter width, both index types, per-layer and per-batch resets, host and device
// block tables, finishes split over many blocks) run on both devices, and the finished counts, the
// statistics, each finish's statistics snapshot and every block's counts must be identical.
// Without a usable GPU every test skips and says why.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "capture/capture_test_util.h"
#include "eldr/capture/capture.hpp"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#ifdef ELDR_CAPTURE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace eldr::capture {
namespace {

using ::testing::HasSubstr;
using testing::RandomRequests;
using testing::RunScenario;
using testing::ScenarioConfig;
using testing::ScenarioOutcome;

#define SKIP_WITHOUT_GPU()                                                        \
  do {                                                                            \
    const absl::Status gpu = testing::GpuUsable();                                \
    if (!gpu.ok()) GTEST_SKIP() << "no GPU for the CUDA path: " << gpu.message(); \
  } while (false)

std::unique_ptr<Capture> MustCreate(const Options& options) {
  absl::StatusOr<std::unique_ptr<Capture>> capture = Capture::Create(options);
  EXPECT_TRUE(capture.ok()) << capture.status();
  return capture.ok() ? *std::move(capture) : nullptr;
}

void ExpectIdentical(const ScenarioOutcome& cpu, const ScenarioOutcome& gpu) {
  ASSERT_EQ(cpu.finished.size(), gpu.finished.size());
  for (size_t r = 0; r < cpu.finished.size(); ++r) {
    ASSERT_EQ(gpu.finished[r], cpu.finished[r]) << "request " << r;
    ASSERT_EQ(cpu.finished[r], cpu.expected[r]) << "request " << r;
  }
  EXPECT_EQ(gpu.stats, cpu.stats) << "gpu: " << StatsToString(gpu.stats) << "\ncpu: " << StatsToString(cpu.stats);
  EXPECT_EQ(gpu.finish_stats, cpu.finish_stats);
  EXPECT_EQ(gpu.block_counts, cpu.block_counts);
  EXPECT_EQ(cpu.stats.recorded_choices, cpu.expected_recorded);
  EXPECT_EQ(cpu.stats.bad_expert_ids, cpu.expected_bad_ids);
  // Gate-probability sums (scenarios with gate_probs): the same float bits.
  ASSERT_EQ(gpu.finished_gate.size(), cpu.finished_gate.size());
  for (size_t r = 0; r < cpu.finished_gate.size(); ++r) {
    ASSERT_EQ(gpu.finished_gate[r], cpu.finished_gate[r]) << "gate sums of request " << r;
  }
  EXPECT_EQ(cpu.stats.bad_gate_probs, cpu.expected_bad_gate_probs);
}

void RunOnBoth(const ScenarioConfig& config, const std::vector<testing::RequestSpec>& requests) {
  auto cpu = MustCreate(testing::OptionsFor(config, Device::kCpu));
  auto gpu = MustCreate(testing::OptionsFor(config, Device::kCuda));
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  ASSERT_EQ(gpu->info().counter_bits, cpu->info().counter_bits);
  const ScenarioOutcome on_cpu = RunScenario(*cpu, Device::kCpu, config, requests);
  const ScenarioOutcome on_gpu = RunScenario(*gpu, Device::kCuda, config, requests);
  ExpectIdentical(on_cpu, on_gpu);
}

struct GpuCase {
  int block_size;
  int top_k;
  IndexType id_type;
  IndexType slot_type;
  bool batch_reset;
  OutputType output_type;
  int counter_bits;
};

void PrintTo(const GpuCase& c, std::ostream* os) {
  *os << "block_size " << c.block_size << " top_k " << c.top_k << " counter_bits " << c.counter_bits;
}

class CaptureGpuEngineTest : public ::testing::TestWithParam<GpuCase> {};

TEST_P(CaptureGpuEngineTest, MatchesTheCpuReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  const GpuCase& c = GetParam();
  ScenarioConfig config;
  config.layers = 6;
  config.experts = 40;
  config.top_k = c.top_k;
  config.block_size = c.block_size;
  const int max_tokens = std::max(70, 3 * c.block_size);
  config.num_blocks = 40 * max_tokens / c.block_size + 64;
  config.max_batch_tokens = 128;
  config.id_type = c.id_type;
  config.slot_type = c.slot_type;
  config.batch_reset = c.batch_reset;
  config.output_type = c.output_type;
  config.seed = static_cast<uint32_t>(c.block_size * 7 + c.top_k);
  std::vector<testing::RequestSpec> requests = RandomRequests(config, 40, max_tokens, 0.02, 0.35, config.seed + 3);
  auto cpu_options = testing::OptionsFor(config, Device::kCpu);
  auto gpu_options = testing::OptionsFor(config, Device::kCuda);
  cpu_options.counter_bits = gpu_options.counter_bits = c.counter_bits;
  auto cpu = MustCreate(cpu_options);
  auto gpu = MustCreate(gpu_options);
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  ExpectIdentical(RunScenario(*cpu, Device::kCpu, config, requests),
                  RunScenario(*gpu, Device::kCuda, config, requests));
}

TEST_P(CaptureGpuEngineTest, GateProbSumsMatchTheCpuReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  const GpuCase& c = GetParam();
  ScenarioConfig config;
  config.layers = 5;
  config.experts = 40;
  config.top_k = c.top_k;
  config.block_size = c.block_size;
  const int max_tokens = std::max(70, 3 * c.block_size);
  config.num_blocks = 40 * max_tokens / c.block_size + 64;
  config.max_batch_tokens = 128;
  config.id_type = c.id_type;
  config.slot_type = c.slot_type;
  config.batch_reset = c.batch_reset;
  config.output_type = c.output_type;
  config.gate_probs = true;
  config.seed = static_cast<uint32_t>(c.block_size * 11 + c.top_k);
  std::vector<testing::RequestSpec> requests = RandomRequests(config, 40, max_tokens, 0.02, 0.35, config.seed + 9);
  auto cpu = MustCreate(testing::OptionsFor(config, Device::kCpu));
  auto gpu = MustCreate(testing::OptionsFor(config, Device::kCuda));
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  ASSERT_EQ(gpu->info().gate_prob_fraction_bits, cpu->info().gate_prob_fraction_bits);
  const ScenarioOutcome on_cpu = RunScenario(*cpu, Device::kCpu, config, requests);
  const ScenarioOutcome on_gpu = RunScenario(*gpu, Device::kCuda, config, requests);
  ASSERT_FALSE(on_cpu.finished_gate.empty());
  EXPECT_GT(on_cpu.expected_bad_gate_probs, 0u);
  ExpectIdentical(on_cpu, on_gpu);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CaptureGpuEngineTest,
    ::testing::Values(GpuCase{16, 2, IndexType::kInt32, IndexType::kInt64, false, OutputType::kInt32, 0},
                      GpuCase{16, 8, IndexType::kInt64, IndexType::kInt64, false, OutputType::kInt16, 0},
                      GpuCase{16, 8, IndexType::kInt32, IndexType::kInt32, true, OutputType::kInt16, 16},
                      GpuCase{16, 8, IndexType::kInt64, IndexType::kInt32, false, OutputType::kInt32, 32},
                      GpuCase{1, 3, IndexType::kInt32, IndexType::kInt32, false, OutputType::kInt32, 0},
                      GpuCase{17, 4, IndexType::kInt64, IndexType::kInt32, true, OutputType::kInt16, 0},
                      GpuCase{64, 6, IndexType::kInt32, IndexType::kInt64, true, OutputType::kInt32, 0},
                      GpuCase{40, 8, IndexType::kInt64, IndexType::kInt64, false, OutputType::kInt32, 0}),
    [](const ::testing::TestParamInfo<GpuCase>& info) {
      const GpuCase& c = info.param;
      return "bs" + std::to_string(c.block_size) + "_k" + std::to_string(c.top_k) +
             (c.id_type == IndexType::kInt64 ? "_ids64" : "_ids32") +
             (c.slot_type == IndexType::kInt64 ? "_slots64" : "_slots32") +
             (c.batch_reset ? "_batchreset" : "_layerreset") +
             (c.output_type == OutputType::kInt16 ? "_out16" : "_out32") + "_bits" + std::to_string(c.counter_bits);
    });

TEST(CaptureGpuRealTraceTest, MatchesTheCpuReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  absl::StatusOr<testing::LoadedTraces> traces = testing::LoadBundledTraces(8);
  ASSERT_TRUE(traces.ok()) << traces.status();
  ScenarioConfig config;
  config.layers = traces->layers;
  config.experts = traces->experts;
  config.top_k = traces->top_k;
  config.block_size = 16;
  config.num_blocks = 256;
  config.max_batch_tokens = 512;
  config.output_type = OutputType::kInt16;
  config.max_finish_per_call = 4;
  RunOnBoth(config, testing::TraceRequests(config, traces->sequences, traces->tokens, 600));
}

// One request of 8192 tokens (512 blocks) and several short ones in one finish: the long one is
// split over thread blocks and summed through the 64-bit staging buffer.
TEST(CaptureGpuFinishTest, LongRequestsSplitAcrossThreadBlocksMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  ScenarioConfig config;
  config.layers = 8;
  config.experts = 64;
  config.top_k = 8;
  config.block_size = 16;
  config.num_blocks = 1200;
  config.max_batch_tokens = 8192;
  config.max_finish_per_call = 4;
  config.output_type = OutputType::kInt32;
  std::vector<testing::RequestSpec> requests = RandomRequests(config, 6, 400, 0.0, 0.0, 99);
  requests[2] = RandomRequests(config, 1, 1, 0.0, 0.0, 5)[0];
  requests[2].tokens = 8192;
  requests[2].routing.resize(int64_t{8192} * config.layers * config.top_k);
  for (size_t i = 0; i < requests[2].routing.size(); ++i) requests[2].routing[i] = (i * 7) % 64;
  RunOnBoth(config, requests);
}

TEST(CaptureGpuFinishTest, Int16SaturationMatchesTheCpu) {
  SKIP_WITHOUT_GPU();
  Options options;
  options.num_layers = 1;
  options.num_experts = 2;
  options.max_top_k = 1;
  options.block_size = 256;
  options.num_blocks = 160;
  options.max_finish_requests = 1;
  std::vector<int64_t> slots(40000);
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<int32_t> ids(40000, 1);
  std::vector<int32_t> table(160);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<int64_t> lengths = {40000};
  std::vector<int16_t> results[2];
  Stats stats[2];
  for (Device device : {Device::kCpu, Device::kCuda}) {
    options.device = device;
    auto capture = MustCreate(options);
    ASSERT_NE(capture, nullptr);
    testing::DeviceArrays arrays(device);
    ASSERT_TRUE(capture
                    ->Record(0, arrays.Upload(ids), IndexType::kInt32, 1, arrays.Upload(slots), IndexType::kInt64,
                             40000, 0, nullptr)
                    .ok());
    auto result = capture->Finish(arrays.Upload(table), 160, lengths.data(), 1, OutputType::kInt16, nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE((*result)->Wait().ok());
    const int d = static_cast<int>(device);
    results[d].assign((*result)->counts_int16(), (*result)->counts_int16() + 2);
    stats[d] = (*result)->stats();
  }
  EXPECT_EQ(results[1], results[0]);
  EXPECT_EQ(results[0], (std::vector<int16_t>{0, 32767}));
  EXPECT_EQ(stats[1], stats[0]);
  EXPECT_EQ(stats[0].saturated_outputs, 1u);
}

TEST(CaptureGpuDirectTest, MatchesTheCpuReference) {
  SKIP_WITHOUT_GPU();
  Options options;
  options.num_layers = 4;
  options.num_experts = 32;
  options.max_top_k = 8;
  options.max_direct_requests = 16;
  options.max_finish_requests = 16;
  std::mt19937 rng(3);
  std::vector<std::vector<int32_t>> ids(4, std::vector<int32_t>(3000 * 8));
  for (auto& layer : ids) {
    for (int32_t& id : layer) id = static_cast<int32_t>(rng() % 34) - 1;
  }
  std::vector<int32_t> requests(3000);
  for (int32_t& r : requests) r = static_cast<int32_t>(rng() % 20) - 2;
  const std::vector<int32_t> finishing = {3, 0, 15, 7};
  std::vector<int32_t> out[2], remaining[2];
  Stats stats[2];
  for (Device device : {Device::kCpu, Device::kCuda}) {
    options.device = device;
    auto capture = MustCreate(options);
    ASSERT_NE(capture, nullptr);
    testing::DeviceArrays arrays(device);
    const int32_t* device_requests = arrays.Upload(requests);
    for (int layer = 0; layer < 4; ++layer) {
      ASSERT_TRUE(capture
                      ->RecordDirect(layer, arrays.Upload(ids[layer]), IndexType::kInt32, 8, device_requests,
                                     IndexType::kInt32, 3000, nullptr)
                      .ok());
    }
    auto result = capture->FinishDirect(finishing.data(), 4, OutputType::kInt32, nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE((*result)->Wait().ok());
    const int d = static_cast<int>(device);
    out[d].assign((*result)->counts_int32(), (*result)->counts_int32() + 4 * 128);
    remaining[d].resize(16 * 128);
    ASSERT_TRUE(capture->ReadDirectCounts(0, 16, remaining[d].data(), nullptr).ok());
    stats[d] = (*result)->stats();
  }
  EXPECT_EQ(out[1], out[0]);
  EXPECT_EQ(remaining[1], remaining[0]);
  EXPECT_EQ(stats[1], stats[0]);
  EXPECT_GT(stats[0].bad_expert_ids, 0u);
  EXPECT_GT(stats[0].bad_request_indices, 0u);
  EXPECT_GT(stats[0].padding_tokens, 0u);
}

TEST(CaptureGpuFinishTest, LongRequestGateSumsSplitAcrossThreadBlocksMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  // One request of many blocks: the finish splits its blocks over thread blocks and adds them in a
  // 64-bit staging buffer, in whatever order they run; the sums must still equal the CPU's bits.
  ScenarioConfig config;
  config.layers = 3;
  config.experts = 64;
  config.top_k = 4;
  config.block_size = 16;
  config.num_blocks = 700;
  config.max_batch_tokens = 512;
  config.max_finish_per_call = 2;
  config.gate_probs = true;
  config.seed = 77;
  std::vector<testing::RequestSpec> requests = RandomRequests(config, 3, 16 * 200, 0.0, 0.0, 78);
  auto cpu = MustCreate(testing::OptionsFor(config, Device::kCpu));
  auto gpu = MustCreate(testing::OptionsFor(config, Device::kCuda));
  ASSERT_NE(cpu, nullptr);
  ASSERT_NE(gpu, nullptr);
  ExpectIdentical(RunScenario(*cpu, Device::kCpu, config, requests),
                  RunScenario(*gpu, Device::kCuda, config, requests));
}

TEST(CaptureGpuDirectTest, GateProbSumsMatchTheCpuReference) {
  SKIP_WITHOUT_GPU();
  Options options;
  options.num_layers = 3;
  options.num_experts = 32;
  options.max_top_k = 8;
  options.max_direct_requests = 16;
  options.max_finish_requests = 16;
  options.record_gate_probs = true;
  std::mt19937 rng(4);
  std::vector<std::vector<int32_t>> ids(3, std::vector<int32_t>(3000 * 8));
  std::vector<std::vector<float>> weights(3, std::vector<float>(3000 * 8));
  for (int layer = 0; layer < 3; ++layer) {
    for (size_t x = 0; x < ids[layer].size(); ++x) {
      ids[layer][x] = static_cast<int32_t>(rng() % 34) - 1;
      weights[layer][x] = testing::ScenarioGateProb(static_cast<int64_t>(x), layer, 0, ids[layer][x]);
    }
  }
  std::vector<int32_t> requests(3000);
  for (int32_t& r : requests) r = static_cast<int32_t>(rng() % 20) - 2;
  const std::vector<int32_t> finishing = {3, 0, 15, 7};
  std::vector<float> out[2];
  Stats stats[2];
  for (Device device : {Device::kCpu, Device::kCuda}) {
    options.device = device;
    auto capture = MustCreate(options);
    ASSERT_NE(capture, nullptr);
    testing::DeviceArrays arrays(device);
    const int32_t* device_requests = arrays.Upload(requests);
    for (int layer = 0; layer < 3; ++layer) {
      ASSERT_TRUE(capture
                      ->RecordDirectGateProbs(layer, arrays.Upload(ids[layer]), IndexType::kInt32,
                                              arrays.Upload(weights[layer]), 8, device_requests, IndexType::kInt32,
                                              3000, nullptr)
                      .ok());
    }
    auto result = capture->FinishDirectGateProbs(finishing.data(), 4, nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE((*result)->Wait().ok());
    const int d = static_cast<int>(device);
    out[d].assign((*result)->gate_prob_sums(), (*result)->gate_prob_sums() + 4 * 96);
    stats[d] = (*result)->stats();
  }
  EXPECT_EQ(out[1], out[0]);
  EXPECT_EQ(stats[1], stats[0]);
  EXPECT_GT(stats[0].bad_gate_probs, 0u);
  EXPECT_GT(*std::max_element(out[0].begin(), out[0].end()), 10.0f);
}

// Gate logits (softmax over all experts): the softmax of gate_softmax.h runs the same IEEE double
// operations on both devices, so the sums must be the same bits. Batches refill blocks (resets),
// repeat slots (duplicates), carry non-finite rows, padding and bad slots, in float32 and bfloat16.
TEST(CaptureGpuGateLogitsTest, BlockAndDirectSumsMatchTheCpuReferenceBitForBit) {
  SKIP_WITHOUT_GPU();
  Options options;
  options.num_layers = 2;
  options.num_experts = 128;
  options.max_top_k = 8;
  options.num_blocks = 64;
  options.block_size = 16;
  options.max_direct_requests = 8;
  options.max_finish_requests = 8;
  options.record_gate_probs = true;
  const int tokens = 2048, experts = 128, stride = 130;
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<int32_t> ids(tokens * 8);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % experts);
  std::vector<float> logits(static_cast<size_t>(tokens) * stride);
  for (float& x : logits) x = normal(rng);
  logits[5 * stride + 3] = std::numeric_limits<float>::quiet_NaN();
  logits[77 * stride + 100] = std::numeric_limits<float>::infinity();
  std::vector<uint16_t> bf16(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &logits[i], 4);
    bf16[i] = static_cast<uint16_t>(u >> 16);
  }
  // Slots: two passes over 1024 slots (the second refills every block from offset 0), some padding,
  // some out of range, some repeated.
  std::vector<int64_t> slots(tokens);
  for (int t = 0; t < tokens; ++t) slots[t] = t % 1024;
  slots[9] = -1;
  slots[10] = 5000;
  slots[1500] = slots[1499];
  std::vector<int32_t> requests(tokens);
  for (int32_t& r : requests) r = static_cast<int32_t>(rng() % 10) - 1;
  std::vector<int32_t> table(64);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<int32_t> finishing = {0, 3, 7};
  std::vector<float> block_sums[2], direct_sums[2];
  Stats stats[2];
  for (Device device : {Device::kCpu, Device::kCuda}) {
    options.device = device;
    auto capture = MustCreate(options);
    ASSERT_NE(capture, nullptr);
    testing::DeviceArrays arrays(device);
    const int32_t* device_ids = arrays.Upload(ids);
    for (int layer = 0; layer < 2; ++layer) {
      const void* data = layer == 0 ? static_cast<const void*>(arrays.Upload(logits)) : arrays.Upload(bf16);
      const LogitsType type = layer == 0 ? LogitsType::kFloat32 : LogitsType::kBfloat16;
      // Two batches of 1024 tokens, in stream order.
      for (int half = 0; half < 2; ++half) {
        const int64_t offset = int64_t{half} * 1024;
        const void* rows = static_cast<const uint8_t*>(data) + offset * stride * (layer == 0 ? 4 : 2);
        ASSERT_TRUE(capture
                        ->RecordGateLogits(
                            layer, device_ids + offset * 8, IndexType::kInt32, 8, rows, type, stride,
                            arrays.Upload(std::vector<int64_t>(slots.begin() + offset, slots.begin() + offset + 1024)),
                            IndexType::kInt64, 1024, 0, nullptr)
                        .ok());
      }
      ASSERT_TRUE(capture
                      ->RecordDirectGateLogits(layer, device_ids, IndexType::kInt32, 8, data, type, stride,
                                               arrays.Upload(requests), IndexType::kInt32, tokens, nullptr)
                      .ok());
    }
    const int64_t length = 1024;
    auto result = capture->FinishGateProbs(arrays.Upload(table), 64, &length, 1, nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE((*result)->Wait().ok());
    const int d = static_cast<int>(device);
    block_sums[d].assign((*result)->gate_prob_sums(), (*result)->gate_prob_sums() + 2 * experts);
    auto direct = capture->FinishDirectGateProbs(finishing.data(), 3, nullptr);
    ASSERT_TRUE(direct.ok()) << direct.status();
    ASSERT_TRUE((*direct)->Wait().ok());
    direct_sums[d].assign((*direct)->gate_prob_sums(), (*direct)->gate_prob_sums() + 3 * 2 * experts);
    stats[d] = (*direct)->stats();
  }
  EXPECT_EQ(block_sums[1], block_sums[0]);
  EXPECT_EQ(direct_sums[1], direct_sums[0]);
  EXPECT_EQ(stats[1], stats[0]);
  EXPECT_GT(stats[0].bad_gate_probs, 0u);
  EXPECT_GT(stats[0].duplicate_slots, 0u);
  // The second pass replaced the first: its 1023 tokens' distributions remain (one slot repeated).
  const double total = std::accumulate(block_sums[0].begin(), block_sums[0].begin() + experts, 0.0);
  EXPECT_NEAR(total, 1023.0, 0.05);
}

#ifdef ELDR_CAPTURE_HAVE_CUDA

TEST(CaptureGpuApiTest, RejectsPageableHostPointersBeforeLaunching) {
  SKIP_WITHOUT_GPU();
  Options options;
  options.device = Device::kCuda;
  options.num_layers = 2;
  options.num_experts = 4;
  options.max_top_k = 2;
  options.num_blocks = 4;
  options.block_size = 4;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  const std::vector<int32_t> host_ids = {0, 1};
  const std::vector<int64_t> host_slots = {0};
  testing::DeviceArrays arrays(Device::kCuda);
  const absl::Status ids_status = capture->Record(0, host_ids.data(), IndexType::kInt32, 2, arrays.Upload(host_slots),
                                                  IndexType::kInt64, 1, 0, nullptr);
  EXPECT_EQ(ids_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ids_status.message(), HasSubstr("record: topk_ids is pageable host memory"));
  const absl::Status slots_status = capture->Record(0, arrays.Upload(host_ids), IndexType::kInt32, 2, host_slots.data(),
                                                    IndexType::kInt64, 1, 0, nullptr);
  EXPECT_THAT(slots_status.message(), HasSubstr("record: slot_mapping is pageable host memory"));
  // The context is still healthy.
  EXPECT_TRUE(capture
                  ->Record(0, arrays.Upload(host_ids), IndexType::kInt32, 2, arrays.Upload(host_slots),
                           IndexType::kInt64, 1, 0, nullptr)
                  .ok());
  EXPECT_EQ(capture->ReadStats(nullptr)->recorded_choices, 2u);
}

TEST(CaptureGpuApiTest, WorksOnACallerStreamAndSignalsCompletion) {
  SKIP_WITHOUT_GPU();
  Options options;
  options.device = Device::kCuda;
  options.num_layers = 1;
  options.num_experts = 8;
  options.max_top_k = 1;
  options.num_blocks = 64;
  options.block_size = 16;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<int64_t> slots(1024);
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<int32_t> ids(1024);
  for (int t = 0; t < 1024; ++t) ids[t] = t % 8;
  testing::DeviceArrays arrays(Device::kCuda);
  ASSERT_TRUE(capture
                  ->Record(0, arrays.Upload(ids), IndexType::kInt32, 1, arrays.Upload(slots), IndexType::kInt64, 1024,
                           0, stream)
                  .ok());
  std::vector<int32_t> table(64);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<int64_t> lengths = {1024};
  auto result = capture->Finish(table.data(), 64, lengths.data(), 1, OutputType::kInt16, stream);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE((*result)->Wait().ok());
  absl::StatusOr<bool> ready = (*result)->Query();
  ASSERT_TRUE(ready.ok());
  EXPECT_TRUE(*ready);
  EXPECT_EQ(std::vector<int16_t>((*result)->counts_int16(), (*result)->counts_int16() + 8),
            std::vector<int16_t>(8, 128));
  cudaStreamDestroy(stream);
}

#endif  // ELDR_CAPTURE_HAVE_CUDA

}  // namespace
}  // namespace eldr::capture
