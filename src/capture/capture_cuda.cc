// The CUDA backend, host side: device memory, pinned result slots, pointer checks and the launch
// sequence of each operation (kernels in capture_kernels.cu). Record calls only enqueue kernels on the
// caller's stream: no allocation, no host synchronisation, so they can be captured in CUDA graphs.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "capture_backend.h"
#include "capture_kernels.h"

namespace eldr::capture {
namespace internal {
namespace {

absl::Status FromCuda(cudaError_t error, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error), " (", static_cast<int>(error),
                                           "): ", cudaGetErrorString(error));
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorSystemDriverMismatch:
      return absl::UnavailableError(message);
    default:
      return DeviceError(message);
  }
}

#define ELDR_CUDA_RETURN_IF_ERROR(expr, what)    \
  do {                                           \
    const cudaError_t eldr_cuda_error_ = (expr); \
    if (eldr_cuda_error_ != cudaSuccess) {       \
      return FromCuda(eldr_cuda_error_, what);   \
    }                                            \
  } while (false)

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Makes `device` current for the scope and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int current = -1;
    if (previous_ >= 0 && cudaGetDevice(&current) == cudaSuccess && current != previous_) {
      cudaSetDevice(previous_);
    }
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct HostFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using DeviceMemory = std::unique_ptr<void, DeviceFree>;
using PinnedMemory = std::unique_ptr<void, HostFree>;

absl::StatusOr<DeviceMemory> AllocateDevice(size_t bytes, absl::string_view what) {
  void* p = nullptr;
  ELDR_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(bytes, 16)),
                            absl::StrCat("cudaMalloc of ", bytes, " bytes for ", what));
  DeviceMemory memory(p);
  ELDR_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, std::max<size_t>(bytes, 16)), absl::StrCat("cudaMemset of ", what));
  return memory;
}

absl::StatusOr<PinnedMemory> AllocatePinned(size_t bytes, absl::string_view what) {
  void* p = nullptr;
  ELDR_CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, std::max<size_t>(bytes, 16)),
                            absl::StrCat("cudaMallocHost of ", bytes, " bytes for ", what));
  std::memset(p, 0, std::max<size_t>(bytes, 16));
  return PinnedMemory(p);
}

enum class Access { kDevice, kHost };

class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Create(const Geometry& g, int device) {
    if (absl::Status available = CudaAvailable(); !available.ok()) return available;
    int count = 0;
    ELDR_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    if (device < 0 || device >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("capture options: cuda_device ", device, " is outside [0, ", count, ")"));
    }
    DeviceGuard guard(device);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "cudaSetDevice");
    int major = 0;
    ELDR_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                              "cudaDeviceGetAttribute");
    if (major < 8) {
      return absl::UnavailableError(absl::StrCat("capture: GPU ", device, " has compute capability ", major,
                                                 ".x; the kernels need 8.0 or newer (built for sm_80 and sm_90)"));
    }
    std::unique_ptr<CudaBackend> backend(new CudaBackend(g, device));
    if (absl::Status status = backend->Allocate(); !status.ok()) return status;
    return std::unique_ptr<Backend>(std::move(backend));
  }

  ~CudaBackend() override {
    DeviceGuard guard(device_);
    for (Slot& slot : slots_) {
      if (slot.event != nullptr) {
        cudaEventSynchronize(slot.event);
        cudaEventDestroy(slot.event);
      }
    }
    // Free while the context's device is current; cudaFree waits for the device to be idle.
    slots_.clear();
    counts_.reset();
    bitmap_.reset();
    direct_.reset();
    gate_.reset();
    direct_gate_.reset();
    stats_memory_.reset();
    stats_host_.reset();
  }

  absl::Status Record(const RecordCall& call) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "record: cudaSetDevice");
    if (g_.validate_pointers) {
      if (absl::Status s = RequireDeviceAccess(call.topk_ids, "record: topk_ids"); !s.ok()) return s;
      if (absl::Status s = RequireDeviceAccess(call.index, "record: slot_mapping"); !s.ok()) return s;
    }
    const bool slots64 = call.index_type == IndexType::kInt64;
    const int n = static_cast<int>(call.num_tokens);
    if (call.reset) {
      ELDR_CUDA_RETURN_IF_ERROR(static_cast<cudaError_t>(kernels::LaunchResetLayerRows(
                                    layout_, call.layer, call.index, slots64, n, stats_, call.stream)),
                                "record: reset kernel launch");
    }
    if (call.weights != nullptr && g_.validate_pointers) {
      if (absl::Status s = RequireDeviceAccess(call.weights, "record_gate_probs: topk_weights"); !s.ok()) return s;
    }
    if (call.logits != nullptr && g_.validate_pointers) {
      if (absl::Status s = RequireDeviceAccess(call.logits, "record_gate_logits: router_logits"); !s.ok()) return s;
    }
    const kernels::Logits logits{call.logits, call.logits_type, call.logits_stride};
    ELDR_CUDA_RETURN_IF_ERROR(static_cast<cudaError_t>(kernels::LaunchRecordBlocks(
                                  layout_, call.layer, call.topk_ids, call.id_type == IndexType::kInt64, call.top_k,
                                  call.index, slots64, n, call.weights, logits, stats_, call.stream)),
                              "record: kernel launch");
    return absl::OkStatus();
  }

  absl::Status ResetBatchBlocks(const void* slots, IndexType slot_type, int64_t num_tokens, void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "reset_batch_blocks: cudaSetDevice");
    if (g_.validate_pointers) {
      if (absl::Status s = RequireDeviceAccess(slots, "reset_batch_blocks: slot_mapping"); !s.ok()) {
        return s;
      }
    }
    ELDR_CUDA_RETURN_IF_ERROR(
        static_cast<cudaError_t>(kernels::LaunchResetBlocks(layout_, slots, slot_type == IndexType::kInt64,
                                                            static_cast<int>(num_tokens), stats_, stream)),
        "reset_batch_blocks: kernel launch");
    return absl::OkStatus();
  }

  absl::Status RecordDirect(const RecordCall& call) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "record_direct: cudaSetDevice");
    if (g_.validate_pointers) {
      if (absl::Status s = RequireDeviceAccess(call.topk_ids, "record_direct: topk_ids"); !s.ok()) {
        return s;
      }
      if (absl::Status s = RequireDeviceAccess(call.index, "record_direct: token_request"); !s.ok()) {
        return s;
      }
      if (call.weights != nullptr) {
        if (absl::Status s = RequireDeviceAccess(call.weights, "record_direct_gate_probs: topk_weights"); !s.ok()) {
          return s;
        }
      }
      if (call.logits != nullptr) {
        if (absl::Status s = RequireDeviceAccess(call.logits, "record_direct_gate_logits: router_logits"); !s.ok()) {
          return s;
        }
      }
    }
    const kernels::Logits logits{call.logits, call.logits_type, call.logits_stride};
    ELDR_CUDA_RETURN_IF_ERROR(
        static_cast<cudaError_t>(kernels::LaunchRecordDirect(
            static_cast<uint32_t*>(direct_.get()), static_cast<unsigned long long*>(direct_gate_.get()), g_.layers,
            g_.experts, g_.max_direct_requests, call.layer, call.topk_ids, call.id_type == IndexType::kInt64,
            call.top_k, call.index, call.index_type == IndexType::kInt64, static_cast<int>(call.num_tokens),
            call.weights, logits, stats_, call.stream)),
        "record_direct: kernel launch");
    return absl::OkStatus();
  }

  absl::Status FinishBlocks(int slot_index, const int32_t* block_tables, int64_t stride,
                            absl::Span<const int32_t> num_blocks_per_request, OutputType output_type,
                            void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "finish: cudaSetDevice");
    Slot& slot = slots_[slot_index];
    const int num_requests = static_cast<int>(num_blocks_per_request.size());
    const int max_blocks = *std::max_element(num_blocks_per_request.begin(), num_blocks_per_request.end());
    const int32_t* tables = block_tables;
    int64_t table_stride = stride;
    if (absl::Status s = StageTables(slot, num_blocks_per_request, &tables, &table_stride, AsStream(stream)); !s.ok()) {
      return s;
    }
    ELDR_CUDA_RETURN_IF_ERROR(static_cast<cudaError_t>(kernels::LaunchSumBlocks(
                                  layout_, tables, table_stride, slot.device_index(), num_requests, max_blocks,
                                  output_type == OutputType::kInt16, slot.device_out.get(),
                                  static_cast<unsigned long long*>(slot.staging.get()), sm_count_, stats_, stream)),
                              "finish: kernel launch");
    return CopyOut(slot, num_requests, output_type, AsStream(stream));
  }

  absl::Status FinishGateBlocks(int slot_index, const int32_t* block_tables, int64_t stride,
                                absl::Span<const int32_t> num_blocks_per_request, void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "finish_gate_probs: cudaSetDevice");
    Slot& slot = slots_[slot_index];
    const int num_requests = static_cast<int>(num_blocks_per_request.size());
    const int max_blocks = *std::max_element(num_blocks_per_request.begin(), num_blocks_per_request.end());
    const int32_t* tables = block_tables;
    int64_t table_stride = stride;
    if (absl::Status s = StageTables(slot, num_blocks_per_request, &tables, &table_stride, AsStream(stream)); !s.ok()) {
      return s;
    }
    ELDR_CUDA_RETURN_IF_ERROR(static_cast<cudaError_t>(kernels::LaunchSumGateBlocks(
                                  layout_, tables, table_stride, slot.device_index(), num_requests, max_blocks,
                                  static_cast<float*>(slot.device_out.get()),
                                  static_cast<unsigned long long*>(slot.staging.get()), sm_count_, stats_, stream)),
                              "finish_gate_probs: kernel launch");
    return CopyOut(slot, num_requests, OutputType::kFloat32, AsStream(stream));
  }

  absl::Status FinishGateDirect(int slot_index, absl::Span<const int32_t> request_slots, void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "finish_direct_gate_probs: cudaSetDevice");
    Slot& slot = slots_[slot_index];
    const int num_requests = static_cast<int>(request_slots.size());
    const cudaStream_t s = AsStream(stream);
    std::copy(request_slots.begin(), request_slots.end(), slot.pinned_index());
    ELDR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.device_index(), slot.pinned_index(), num_requests * sizeof(int32_t),
                                              cudaMemcpyHostToDevice, s),
                              "finish_direct_gate_probs: copy of request slots");
    ELDR_CUDA_RETURN_IF_ERROR(static_cast<cudaError_t>(kernels::LaunchFinishDirectGate(
                                  static_cast<unsigned long long*>(direct_gate_.get()), g_.cells, slot.device_index(),
                                  num_requests, static_cast<float*>(slot.device_out.get()), stats_, stream)),
                              "finish_direct_gate_probs: kernel launch");
    return CopyOut(slot, num_requests, OutputType::kFloat32, s);
  }

  absl::Status FinishDirect(int slot_index, absl::Span<const int32_t> request_slots, OutputType output_type,
                            void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "finish_direct: cudaSetDevice");
    Slot& slot = slots_[slot_index];
    const int num_requests = static_cast<int>(request_slots.size());
    const cudaStream_t s = AsStream(stream);
    std::copy(request_slots.begin(), request_slots.end(), slot.pinned_index());
    ELDR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.device_index(), slot.pinned_index(), num_requests * sizeof(int32_t),
                                              cudaMemcpyHostToDevice, s),
                              "finish_direct: copy of request slots");
    ELDR_CUDA_RETURN_IF_ERROR(static_cast<cudaError_t>(kernels::LaunchFinishDirect(
                                  static_cast<uint32_t*>(direct_.get()), g_.cells, slot.device_index(), num_requests,
                                  output_type == OutputType::kInt16, slot.device_out.get(), stats_, stream)),
                              "finish_direct: kernel launch");
    return CopyOut(slot, num_requests, output_type, s);
  }

  absl::StatusOr<bool> SlotReady(int slot) const override {
    const cudaError_t status = cudaEventQuery(slots_[slot].event);
    if (status == cudaSuccess) return true;
    if (status == cudaErrorNotReady) return false;
    return FromCuda(status, "result: cudaEventQuery");
  }

  absl::Status WaitSlot(int slot) override {
    ELDR_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slots_[slot].event), "result: cudaEventSynchronize");
    return absl::OkStatus();
  }

  const void* SlotCounts(int slot) const override { return slots_[slot].pinned_out.get(); }

  Stats SlotStats(int slot) const override {
    uint64_t values[kNumStats];
    std::memcpy(values, slots_[slot].pinned_stats(), sizeof(values));
    return StatsFromArray(values);
  }

  absl::Status Clear(void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "clear: cudaSetDevice");
    const cudaStream_t s = AsStream(stream);
    if (g_.block_mode()) {
      ELDR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(counts_.get(), 0, g_.block_counts_bytes(), s),
                                "clear: cudaMemsetAsync");
      ELDR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bitmap_.get(), 0, g_.bitmap_words() * sizeof(uint32_t), s),
                                "clear: cudaMemsetAsync");
    }
    if (g_.max_direct_requests > 0) {
      ELDR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(direct_.get(), 0, DirectBytes(), s), "clear: cudaMemsetAsync");
    }
    if (g_.block_gate_bytes() > 0) {
      ELDR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(gate_.get(), 0, g_.block_gate_bytes(), s), "clear: cudaMemsetAsync");
    }
    if (g_.direct_gate_bytes() > 0) {
      ELDR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(direct_gate_.get(), 0, g_.direct_gate_bytes(), s),
                                "clear: cudaMemsetAsync");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Stats> ReadStats(void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "stats: cudaSetDevice");
    const cudaStream_t s = AsStream(stream);
    ELDR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(stats_host_.get(), stats_, kStatsBytes, cudaMemcpyDeviceToHost, s),
                              "stats: cudaMemcpyAsync");
    ELDR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s), "stats: cudaStreamSynchronize");
    uint64_t values[kNumStats];
    std::memcpy(values, stats_host_.get(), sizeof(values));
    return StatsFromArray(values);
  }

  absl::Status ResetStats(void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "reset_stats: cudaSetDevice");
    ELDR_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(stats_, 0, kStatsBytes, AsStream(stream)),
                              "reset_stats: cudaMemsetAsync");
    return absl::OkStatus();
  }

  absl::Status ReadBlockCounts(int64_t first_block, int64_t num_blocks, int32_t* out, void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "read_block_counts: cudaSetDevice");
    const cudaStream_t s = AsStream(stream);
    std::vector<uint8_t> raw(static_cast<size_t>(num_blocks * g_.block_stride_bytes));
    ELDR_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(raw.data(), static_cast<const uint8_t*>(counts_.get()) + first_block * g_.block_stride_bytes,
                        raw.size(), cudaMemcpyDeviceToHost, s),
        "read_block_counts: cudaMemcpyAsync");
    ELDR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s), "read_block_counts: cudaStreamSynchronize");
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* counters = raw.data() + b * g_.block_stride_bytes;
      for (int64_t c = 0; c < g_.cells; ++c) {
        out[b * g_.cells + c] = static_cast<int32_t>(LoadCounter(counters, g_.counter_bytes, c));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ReadDirectCounts(int first_slot, int num_slots, int32_t* out, void* stream) override {
    DeviceGuard guard(device_);
    ELDR_CUDA_RETURN_IF_ERROR(guard.status(), "read_direct_counts: cudaSetDevice");
    const cudaStream_t s = AsStream(stream);
    ELDR_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out, static_cast<const uint32_t*>(direct_.get()) + first_slot * g_.cells,
                        int64_t{num_slots} * g_.cells * sizeof(uint32_t), cudaMemcpyDeviceToHost, s),
        "read_direct_counts: cudaMemcpyAsync");
    ELDR_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s), "read_direct_counts: cudaStreamSynchronize");
    return absl::OkStatus();
  }

  uint64_t device_bytes() const override { return device_bytes_; }
  uint64_t host_bytes() const override { return host_bytes_; }

 private:
  static constexpr size_t kStatsBytes = kNumStats * sizeof(uint64_t);

  // One result slot: device output and staging, index and table staging on both sides, the pinned
  // output the result reads, a stats snapshot and the completion event.
  struct Slot {
    DeviceMemory device_out;
    DeviceMemory staging;
    DeviceMemory device_scratch;  // [max_finish_requests] index, then the staged tables
    PinnedMemory pinned_out;
    PinnedMemory pinned_scratch;  // stats snapshot, [max_finish_requests] index, staged tables
    int max_requests = 0;
    cudaEvent_t event = nullptr;

    int32_t* device_index() { return static_cast<int32_t*>(device_scratch.get()); }
    int32_t* device_tables() { return device_index() + max_requests; }
    uint64_t* pinned_stats() const { return static_cast<uint64_t*>(pinned_scratch.get()); }
    int32_t* pinned_index() { return reinterpret_cast<int32_t*>(pinned_stats() + kNumStats); }
    int32_t* pinned_tables() { return pinned_index() + max_requests; }
  };

  CudaBackend(const Geometry& g, int device) : g_(g), device_(device) {}

  size_t DirectBytes() const { return static_cast<size_t>(g_.max_direct_requests) * g_.cells * sizeof(uint32_t); }

  absl::Status Allocate() {
    ELDR_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_),
                              "cudaDeviceGetAttribute");
    auto track = [this](absl::StatusOr<DeviceMemory> memory, size_t bytes, DeviceMemory& into) -> absl::Status {
      if (!memory.ok()) return memory.status();
      into = *std::move(memory);
      device_bytes_ += bytes;
      return absl::OkStatus();
    };
    auto track_pinned = [this](absl::StatusOr<PinnedMemory> memory, size_t bytes, PinnedMemory& into) -> absl::Status {
      if (!memory.ok()) return memory.status();
      into = *std::move(memory);
      host_bytes_ += bytes;
      return absl::OkStatus();
    };
    if (g_.block_mode()) {
      const size_t count_bytes = static_cast<size_t>(g_.block_counts_bytes());
      if (auto s = track(AllocateDevice(count_bytes, "per-block counts"), count_bytes, counts_); !s.ok()) {
        return s;
      }
      const size_t bitmap_bytes = static_cast<size_t>(g_.bitmap_words()) * sizeof(uint32_t);
      if (auto s = track(AllocateDevice(bitmap_bytes, "slot bitmap"), bitmap_bytes, bitmap_); !s.ok()) {
        return s;
      }
    }
    if (g_.max_direct_requests > 0) {
      if (auto s = track(AllocateDevice(DirectBytes(), "direct-mode counts"), DirectBytes(), direct_); !s.ok()) {
        return s;
      }
    }
    if (g_.block_gate_bytes() > 0) {
      const size_t bytes = static_cast<size_t>(g_.block_gate_bytes());
      if (auto s = track(AllocateDevice(bytes, "per-block gate probabilities"), bytes, gate_); !s.ok()) return s;
    }
    if (g_.direct_gate_bytes() > 0) {
      const size_t bytes = static_cast<size_t>(g_.direct_gate_bytes());
      if (auto s = track(AllocateDevice(bytes, "direct-mode gate probabilities"), bytes, direct_gate_); !s.ok()) {
        return s;
      }
    }
    if (auto s = track(AllocateDevice(kStatsBytes, "statistics"), kStatsBytes, stats_memory_); !s.ok()) {
      return s;
    }
    stats_ = static_cast<unsigned long long*>(stats_memory_.get());
    if (auto s = track_pinned(AllocatePinned(kStatsBytes, "statistics"), kStatsBytes, stats_host_); !s.ok()) {
      return s;
    }

    const size_t max_requests = static_cast<size_t>(g_.max_finish_requests);
    const size_t out_bytes = max_requests * g_.cells * sizeof(int32_t);
    const size_t staging_bytes = max_requests * g_.cells * sizeof(uint64_t);
    const size_t table_entries = g_.block_mode() ? max_requests * static_cast<size_t>(g_.max_blocks_per_request) : 0;
    const size_t scratch_bytes = (max_requests + table_entries) * sizeof(int32_t);
    slots_.resize(g_.result_slots);
    for (Slot& slot : slots_) {
      slot.max_requests = g_.max_finish_requests;
      if (auto s = track(AllocateDevice(out_bytes, "result counts"), out_bytes, slot.device_out); !s.ok()) {
        return s;
      }
      if (g_.block_mode()) {
        if (auto s = track(AllocateDevice(staging_bytes, "finish staging"), staging_bytes, slot.staging); !s.ok()) {
          return s;
        }
      }
      if (auto s = track(AllocateDevice(scratch_bytes, "finish scratch"), scratch_bytes, slot.device_scratch);
          !s.ok()) {
        return s;
      }
      if (auto s = track_pinned(AllocatePinned(out_bytes, "result counts"), out_bytes, slot.pinned_out); !s.ok()) {
        return s;
      }
      const size_t pinned_scratch_bytes = kStatsBytes + scratch_bytes;
      if (auto s = track_pinned(AllocatePinned(pinned_scratch_bytes, "finish scratch"), pinned_scratch_bytes,
                                slot.pinned_scratch);
          !s.ok()) {
        return s;
      }
      ELDR_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.event, cudaEventDisableTiming),
                                "cudaEventCreateWithFlags");
    }

    layout_.counts = counts_.get();
    layout_.bitmap = static_cast<uint32_t*>(bitmap_.get());
    layout_.block_stride_bytes = g_.block_stride_bytes;
    layout_.counter_bytes = g_.counter_bytes;
    layout_.layers = g_.layers;
    layout_.experts = g_.experts;
    layout_.num_blocks = g_.num_blocks;
    layout_.block_size = g_.block_size;
    layout_.num_slots = static_cast<int>(g_.num_slots);
    layout_.bitmap_words_per_row = g_.bitmap_words_per_row;
    layout_.gate = static_cast<uint32_t*>(gate_.get());
    layout_.gate_fraction_bits = g_.gate_fraction_bits;
    return absl::OkStatus();
  }

  // Where `p` lives, as far as kernels are concerned.
  absl::StatusOr<Access> Classify(const void* p, absl::string_view what) const {
    cudaPointerAttributes attributes{};
    const cudaError_t status = cudaPointerGetAttributes(&attributes, p);
    if (status != cudaSuccess) {
      cudaGetLastError();  // not a CUDA pointer: clear the sticky-free error state
      return Access::kHost;
    }
    switch (attributes.type) {
      case cudaMemoryTypeDevice:
        if (attributes.device != device_) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, " is memory of GPU ", attributes.device, ", the context is on GPU ", device_));
        }
        return Access::kDevice;
      case cudaMemoryTypeManaged:
        return Access::kDevice;
      default:
        return Access::kHost;
    }
  }

  // Kernels may read device, managed and pinned host memory, not pageable host memory.
  absl::Status RequireDeviceAccess(const void* p, absl::string_view what) const {
    cudaPointerAttributes attributes{};
    const cudaError_t status = cudaPointerGetAttributes(&attributes, p);
    if (status != cudaSuccess) cudaGetLastError();
    if (status != cudaSuccess || attributes.type == cudaMemoryTypeUnregistered) {
      return absl::InvalidArgumentError(
          absl::StrCat(what,
                       " is pageable host memory; the CUDA context needs device memory (or pinned host "
                       "memory)"));
    }
    if (attributes.type == cudaMemoryTypeDevice && attributes.device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " is memory of GPU ", attributes.device, ", the context is on GPU ", device_));
    }
    return absl::OkStatus();
  }

  // Copies each request's number of blocks to the device, and host block tables (staged in pinned
  // memory, rows max_blocks apart) when `*tables` is host memory: then `*tables` and `*stride` point
  // at the device copy.
  absl::Status StageTables(Slot& slot, absl::Span<const int32_t> num_blocks_per_request, const int32_t** tables,
                           int64_t* stride, cudaStream_t s) {
    const int num_requests = static_cast<int>(num_blocks_per_request.size());
    const int max_blocks = *std::max_element(num_blocks_per_request.begin(), num_blocks_per_request.end());
    std::copy(num_blocks_per_request.begin(), num_blocks_per_request.end(), slot.pinned_index());
    ELDR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.device_index(), slot.pinned_index(), num_requests * sizeof(int32_t),
                                              cudaMemcpyHostToDevice, s),
                              "finish: copy of block counts");
    if (max_blocks == 0) return absl::OkStatus();
    absl::StatusOr<Access> access = Classify(*tables, "finish: block_tables");
    if (!access.ok()) return access.status();
    if (*access != Access::kHost) return absl::OkStatus();
    // Pageable (or pinned) host tables: stage the used entries, rows max_blocks apart.
    if (max_blocks > g_.max_blocks_per_request) {
      const auto it = std::max_element(num_blocks_per_request.begin(), num_blocks_per_request.end());
      return absl::InvalidArgumentError(
          absl::StrCat("finish: request ", it - num_blocks_per_request.begin(), " has ", max_blocks,
                       " blocks, more than options.max_blocks_per_request = ", g_.max_blocks_per_request,
                       " allows for block tables in host memory"));
    }
    int32_t* staged = slot.pinned_tables();
    for (int r = 0; r < num_requests; ++r) {
      std::memcpy(staged + int64_t{r} * max_blocks, *tables + r * *stride, num_blocks_per_request[r] * sizeof(int32_t));
    }
    ELDR_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot.device_tables(), staged, int64_t{num_requests} * max_blocks * sizeof(int32_t),
                        cudaMemcpyHostToDevice, s),
        "finish: copy of host block tables");
    *tables = slot.device_tables();
    *stride = max_blocks;
    return absl::OkStatus();
  }

  absl::Status CopyOut(Slot& slot, int num_requests, OutputType output_type, cudaStream_t s) {
    const size_t element = output_type == OutputType::kInt16 ? sizeof(int16_t) : sizeof(int32_t);  // float32: 4
    ELDR_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot.pinned_out.get(), slot.device_out.get(),
                        static_cast<size_t>(num_requests) * g_.cells * element, cudaMemcpyDeviceToHost, s),
        "finish: copy of counts");
    ELDR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.pinned_stats(), stats_, kStatsBytes, cudaMemcpyDeviceToHost, s),
                              "finish: copy of statistics");
    ELDR_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.event, s), "finish: cudaEventRecord");
    return absl::OkStatus();
  }

  const Geometry g_;
  const int device_;
  int sm_count_ = 1;
  DeviceMemory counts_;
  DeviceMemory bitmap_;
  DeviceMemory direct_;
  DeviceMemory gate_;
  DeviceMemory direct_gate_;
  DeviceMemory stats_memory_;
  unsigned long long* stats_ = nullptr;
  PinnedMemory stats_host_;
  std::vector<Slot> slots_;
  kernels::BlockLayout layout_;
  uint64_t device_bytes_ = 0;
  uint64_t host_bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const Geometry& geometry, int cuda_device) {
  return CudaBackend::Create(geometry, cuda_device);
}

}  // namespace internal

absl::Status CudaAvailable() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("no usable GPU: cudaGetDeviceCount returned ", cudaGetErrorName(status),
                                               " (", static_cast<int>(status), "): ", cudaGetErrorString(status)));
  }
  if (count == 0) return absl::UnavailableError("no usable GPU: no CUDA device found");
  return absl::OkStatus();
}

}  // namespace eldr::capture
