// eldr-capture-bench: cost of the capture library's record and finish calls.
//
// Shapes follow the target: a prefill batch of 8192 tokens, top-8 routing, 48 MoE layers of
// 128 experts (Qwen3-30B-A3B), KV blocks of 16 tokens; finish for 64 requests of 1024 tokens.
//   Cpu*  the CPU reference, always.
//   Gpu*  the CUDA path, registered only when a GPU is usable (the reason is printed otherwise).
//         Record: GPU time per layer call from CUDA events around 48 back-to-back layer calls
//         (manual time). Finish: host wall time from the call until its counts are in host memory.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "eldr/capture/capture.hpp"

#ifdef ELDR_CAPTURE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace eldr::capture {
namespace {

constexpr int kLayers = 48;
constexpr int kExperts = 128;
constexpr int kTopK = 8;
constexpr int kBlockSize = 16;
constexpr int kFinishRequests = 64;
constexpr int kFinishTokens = 1024;

// A prefill batch: `requests` requests of tokens/requests tokens each, every request in fresh
// consecutive blocks (so each block's offset-0 slot is in the batch and gets reset).
struct Batch {
  std::vector<int32_t> ids;    // [tokens][k]
  std::vector<int64_t> slots;  // [tokens]
  std::vector<int32_t> token_request;
};

Batch MakeBatch(int tokens, int requests, uint32_t seed) {
  Batch batch;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> expert(0, kExperts - 1);
  batch.ids.resize(static_cast<size_t>(tokens) * kTopK);
  for (int32_t& id : batch.ids) id = expert(rng);
  batch.slots.resize(tokens);
  batch.token_request.resize(tokens);
  const int per_request = tokens / requests;
  for (int t = 0; t < tokens; ++t) {
    const int r = t / per_request;
    const int position = t % per_request;
    const int64_t first_block = int64_t{r} * ((per_request + kBlockSize - 1) / kBlockSize);
    batch.slots[t] = first_block * kBlockSize + position;
    batch.token_request[t] = r;
  }
  return batch;
}

Options BenchOptions(Device device, int64_t num_blocks) {
  Options options;
  options.device = device;
  options.num_layers = kLayers;
  options.num_experts = kExperts;
  options.max_top_k = kTopK;
  options.num_blocks = num_blocks;
  options.block_size = kBlockSize;
  options.max_finish_requests = kFinishRequests;
  options.max_direct_requests = 64;
  return options;
}

std::unique_ptr<Capture> MustCreate(const Options& options, benchmark::State& state) {
  absl::StatusOr<std::unique_ptr<Capture>> capture = Capture::Create(options);
  if (!capture.ok()) {
    state.SkipWithError(std::string(capture.status().message()).c_str());
    return nullptr;
  }
  return *std::move(capture);
}

// Block tables of kFinishRequests requests of kFinishTokens tokens in consecutive blocks.
std::vector<int32_t> FinishTables(int64_t* stride) {
  *stride = kFinishTokens / kBlockSize;
  std::vector<int32_t> tables(kFinishRequests * *stride);
  for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
  return tables;
}

void BM_CpuRecordLayer(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  const Batch batch = MakeBatch(tokens, 8, 1);
  auto capture = MustCreate(BenchOptions(Device::kCpu, tokens / kBlockSize + 8), state);
  if (capture == nullptr) return;
  int layer = 0;
  for (auto _ : state) {
    absl::Status status = capture->Record(layer, batch.ids.data(), IndexType::kInt32, kTopK, batch.slots.data(),
                                          IndexType::kInt64, tokens, 0, nullptr);
    if (!status.ok()) state.SkipWithError(std::string(status.message()).c_str());
    layer = (layer + 1) % kLayers;
  }
  state.SetItemsProcessed(state.iterations() * int64_t{tokens} * kTopK);
  state.counters["tokens"] = tokens;
}
BENCHMARK(BM_CpuRecordLayer)->Arg(1024)->Arg(8192)->Unit(benchmark::kMicrosecond);

void BM_CpuRecordDirectLayer(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  const Batch batch = MakeBatch(tokens, 8, 2);
  auto capture = MustCreate(BenchOptions(Device::kCpu, 0), state);
  if (capture == nullptr) return;
  int layer = 0;
  for (auto _ : state) {
    absl::Status status = capture->RecordDirect(layer, batch.ids.data(), IndexType::kInt32, kTopK,
                                                batch.token_request.data(), IndexType::kInt32, tokens, nullptr);
    if (!status.ok()) state.SkipWithError(std::string(status.message()).c_str());
    layer = (layer + 1) % kLayers;
  }
  state.SetItemsProcessed(state.iterations() * int64_t{tokens} * kTopK);
}
BENCHMARK(BM_CpuRecordDirectLayer)->Arg(8192)->Unit(benchmark::kMicrosecond);

void BM_CpuFinish(benchmark::State& state) {
  int64_t stride = 0;
  const std::vector<int32_t> tables = FinishTables(&stride);
  const std::vector<int64_t> lengths(kFinishRequests, kFinishTokens);
  Options options = BenchOptions(Device::kCpu, kFinishRequests * stride);
  auto capture = MustCreate(options, state);
  if (capture == nullptr) return;
  for (auto _ : state) {
    auto result = capture->Finish(tables.data(), stride, lengths.data(), kFinishRequests, OutputType::kInt16, nullptr);
    if (!result.ok()) {
      state.SkipWithError(std::string(result.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize((*result)->counts_int16());
  }
  state.SetItemsProcessed(state.iterations() * kFinishRequests);
  state.counters["blocks_per_request"] = static_cast<double>(stride);
}
BENCHMARK(BM_CpuFinish)->Unit(benchmark::kMicrosecond);

#ifdef ELDR_CAPTURE_HAVE_CUDA

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  void* p = nullptr;
  if (cudaMalloc(&p, host.size() * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T*>(p);
}

// GPU time per layer call: 48 record calls (one per layer, as an engine's forward makes them)
// between two CUDA events. Default: the library's defaults (per-layer reset kernel + add kernel,
// pointer check on). integration_path: what the vLLM integration does (one reset_batch_blocks per
// batch, included, then one add kernel per layer; pointers checked by the caller).
void BM_GpuRecordLayer(benchmark::State& state, bool integration_path) {
  const bool skip_reset = integration_path;
  const int tokens = static_cast<int>(state.range(0));
  const Batch batch = MakeBatch(tokens, 8, 3);
  Options options = BenchOptions(Device::kCuda, tokens / kBlockSize + 8);
  options.validate_pointers = !integration_path;
  auto capture = MustCreate(options, state);
  if (capture == nullptr) return;
  int32_t* ids = ToDevice(batch.ids);
  int64_t* slots = ToDevice(batch.slots);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const uint32_t flags = skip_reset ? kRecordSkipReset : 0;
  double enqueue_us = 0;
  for (auto _ : state) {
    cudaEventRecord(start, stream);
    const auto host_start = std::chrono::steady_clock::now();
    if (skip_reset) {
      absl::Status status = capture->ResetBatchBlocks(slots, IndexType::kInt64, tokens, stream);
      if (!status.ok()) state.SkipWithError(std::string(status.message()).c_str());
    }
    for (int layer = 0; layer < kLayers; ++layer) {
      absl::Status status =
          capture->Record(layer, ids, IndexType::kInt32, kTopK, slots, IndexType::kInt64, tokens, flags, stream);
      if (!status.ok()) state.SkipWithError(std::string(status.message()).c_str());
    }
    enqueue_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - host_start).count();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3 / kLayers);
  }
  state.SetItemsProcessed(state.iterations() * int64_t{tokens} * kTopK);
  state.counters["host_enqueue_us_per_layer"] =
      benchmark::Counter(enqueue_us / kLayers / static_cast<double>(state.iterations()));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  cudaFree(ids);
  cudaFree(slots);
}

// Host wall time of one finish call until its counts are in pinned host memory.
void BM_GpuFinish(benchmark::State& state) {
  int64_t stride = 0;
  const std::vector<int32_t> tables = FinishTables(&stride);
  const std::vector<int64_t> lengths(kFinishRequests, kFinishTokens);
  auto capture = MustCreate(BenchOptions(Device::kCuda, kFinishRequests * stride), state);
  if (capture == nullptr) return;
  int32_t* device_tables = ToDevice(tables);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    auto result = capture->Finish(device_tables, stride, lengths.data(), kFinishRequests, OutputType::kInt16, stream);
    if (!result.ok()) {
      state.SkipWithError(std::string(result.status().message()).c_str());
      break;
    }
    absl::Status waited = (*result)->Wait();
    if (!waited.ok()) state.SkipWithError(std::string(waited.message()).c_str());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  state.SetItemsProcessed(state.iterations() * kFinishRequests);
  state.counters["blocks_per_request"] = static_cast<double>(stride);
  cudaStreamDestroy(stream);
  cudaFree(device_tables);
}

void RegisterGpuBenchmarks() {
  const absl::Status available = CudaAvailable();
  if (!available.ok()) {
    std::printf("GPU benchmarks skipped: %s\n", std::string(available.message()).c_str());
    return;
  }
  benchmark::RegisterBenchmark("BM_GpuRecordLayer", BM_GpuRecordLayer, false)
      ->Arg(8192)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("BM_GpuRecordLayerIntegrationPath", BM_GpuRecordLayer, true)
      ->Arg(8192)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("BM_GpuFinish", BM_GpuFinish)->UseManualTime()->Unit(benchmark::kMicrosecond);
}

#else

void RegisterGpuBenchmarks() {
  std::printf("GPU benchmarks skipped: %s\n", std::string(CudaAvailable().message()).c_str());
}

#endif

}  // namespace
}  // namespace eldr::capture

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  eldr::capture::RegisterGpuBenchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
