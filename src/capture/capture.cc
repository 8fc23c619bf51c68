// The front end of eldr::capture::Capture: option resolution, argument validation (everything the
// host can check is rejected here, identically for both devices), result-slot bookkeeping, and
// dispatch to the CPU or CUDA backend.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "capture_backend.h"
#include "eldr/capture/capture.hpp"

namespace eldr::capture {
namespace internal {

Stats StatsFromArray(const uint64_t (&values)[kNumStats]) {
  Stats stats;
  stats.recorded_choices = values[kStatRecorded];
  stats.padding_tokens = values[kStatPadding];
  stats.bad_slots = values[kStatBadSlots];
  stats.bad_expert_ids = values[kStatBadExpertIds];
  stats.bad_request_indices = values[kStatBadRequests];
  stats.bad_block_ids = values[kStatBadBlockIds];
  stats.duplicate_slots = values[kStatDuplicateSlots];
  stats.saturated_adds = values[kStatSaturatedAdds];
  stats.saturated_outputs = values[kStatSaturatedOutputs];
  stats.block_resets = values[kStatBlockResets];
  stats.bad_gate_probs = values[kStatBadGateProbs];
  return stats;
}

namespace {
constexpr absl::string_view kDeviceErrorPayload = "type.eldr.dev/capture.DeviceError";
}  // namespace

absl::Status DeviceError(absl::string_view message) {
  absl::Status status = absl::InternalError(message);
  status.SetPayload(kDeviceErrorPayload, absl::Cord("1"));
  return status;
}

bool IsDeviceError(const absl::Status& status) { return status.GetPayload(kDeviceErrorPayload).has_value(); }

absl::StatusOr<Geometry> ResolveGeometry(const Options& options) {
  auto invalid = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("capture options: ", parts...));
  };
  if (options.device != Device::kCpu && options.device != Device::kCuda) {
    return invalid("device must be cpu (0) or cuda (1), got ", static_cast<int>(options.device));
  }
  if (options.num_layers <= 0 || options.num_experts <= 0) {
    return invalid("num_layers and num_experts must be > 0, got ", options.num_layers, " and ", options.num_experts);
  }
  constexpr int64_t kMaxCells = int64_t{1} << 24;
  const int64_t cells = int64_t{options.num_layers} * options.num_experts;
  if (cells > kMaxCells) {
    return invalid("num_layers * num_experts = ", cells, " exceeds ", kMaxCells);
  }
  if (options.max_top_k < 1 || options.max_top_k > 1024) {
    return invalid("max_top_k must be in [1, 1024], got ", options.max_top_k);
  }
  if (options.num_blocks < 0) return invalid("num_blocks must be >= 0, got ", options.num_blocks);
  if (options.num_blocks == 0 && options.max_direct_requests <= 0) {
    return invalid(
        "num_blocks = 0 and max_direct_requests = 0: neither the block mode nor the "
        "direct mode is enabled");
  }
  if (options.max_direct_requests < 0 || options.max_direct_requests > (1 << 20)) {
    return invalid("max_direct_requests must be in [0, 2^20], got ", options.max_direct_requests);
  }
  if (options.max_finish_requests < 1 || options.max_finish_requests > 65535) {
    return invalid("max_finish_requests must be in [1, 65535], got ", options.max_finish_requests);
  }
  if (options.result_slots < 1 || options.result_slots > 1024) {
    return invalid("result_slots must be in [1, 1024], got ", options.result_slots);
  }
  if (options.max_blocks_per_request < 1) {
    return invalid("max_blocks_per_request must be >= 1, got ", options.max_blocks_per_request);
  }

  Geometry g;
  g.layers = options.num_layers;
  g.experts = options.num_experts;
  g.cells = cells;
  g.max_top_k = options.max_top_k;
  g.num_blocks = options.num_blocks;
  g.max_direct_requests = options.max_direct_requests;
  g.max_finish_requests = options.max_finish_requests;
  g.max_blocks_per_request = options.max_blocks_per_request;
  g.result_slots = options.result_slots;
  g.validate_pointers = options.validate_pointers;

  if (g.num_blocks > 0) {
    if (options.block_size < 1) {
      return invalid("block_size must be >= 1 when num_blocks > 0, got ", options.block_size);
    }
    g.block_size = options.block_size;
    if (g.num_blocks > std::numeric_limits<int32_t>::max() / g.block_size) {
      return invalid("num_blocks * block_size = ", g.num_blocks, " * ", g.block_size,
                     " must be below 2^31 (slots are 32-bit)");
    }
    g.num_slots = g.num_blocks * g.block_size;
    // A slot counts once per fill (slot bitmap), so one block adds at most block_size * top_k to a
    // counter: choose the narrowest width that holds that bound.
    const int64_t bound = int64_t{g.block_size} * g.max_top_k;
    const int needed_bits = bound <= 0xff ? 8 : bound <= 0xffff ? 16 : 32;
    if (bound > std::numeric_limits<uint32_t>::max()) {
      return invalid("block_size * max_top_k = ", bound, " does not fit a 32-bit counter");
    }
    int bits = options.counter_bits;
    if (bits == 0) {
      bits = needed_bits;
    } else if (bits != 8 && bits != 16 && bits != 32) {
      return invalid("counter_bits must be 0, 8, 16 or 32, got ", bits);
    } else if (bits < needed_bits) {
      return invalid("counter_bits = ", bits, " cannot hold block_size * max_top_k = ", bound, " (needs ", needed_bits,
                     ")");
    }
    g.counter_bytes = bits / 8;
    g.counter_max = bits == 32 ? 0xffffffffu : (1u << bits) - 1;
    g.block_stride_bytes = (cells * g.counter_bytes + 15) / 16 * 16;
    g.bitmap_words_per_row = (g.block_size + 31) / 32;
    constexpr int64_t kMaxBlockBytes = int64_t{1} << 46;
    if (g.num_blocks > kMaxBlockBytes / g.block_stride_bytes) {
      return invalid("per-block counts would take more than 2^46 bytes");
    }
  } else if (options.counter_bits != 0 && options.counter_bits != 8 && options.counter_bits != 16 &&
             options.counter_bits != 32) {
    return invalid("counter_bits must be 0, 8, 16 or 32, got ", options.counter_bits);
  }
  g.gate_probs = options.record_gate_probs;
  if (g.gate_probs && g.block_mode()) {
    // One block adds at most block_size * max_top_k probabilities of at most 1 to a cell: keep the
    // 32-bit accumulator from overflowing with fraction bits = 32 - bits(block_size * max_top_k).
    const uint64_t bound = uint64_t{static_cast<uint32_t>(g.block_size)} * g.max_top_k;
    int bits = 0;
    while ((uint64_t{1} << bits) <= bound) ++bits;
    g.gate_fraction_bits = std::min(kMaxGateFractionBits, 32 - bits);
    if (g.gate_fraction_bits < 8) {
      return invalid("record_gate_probs: block_size * max_top_k = ", bound,
                     " leaves fewer than 8 fraction bits in a 32-bit gate-probability accumulator (at most 2^24)");
    }
    if (g.num_blocks > (int64_t{1} << 46) / (cells * 4)) {
      return invalid("per-block gate-probability accumulators would take more than 2^46 bytes");
    }
  }
  return g;
}

}  // namespace internal

namespace {

using internal::Backend;
using internal::Geometry;

std::string IndexTypeError(const char* what, IndexType type) {
  return absl::StrCat(what, " type must be int32 (0) or int64 (1), got ", static_cast<int>(type));
}

bool ValidIndexType(IndexType type) { return type == IndexType::kInt32 || type == IndexType::kInt64; }

bool ValidOutputType(OutputType type) { return type == OutputType::kInt16 || type == OutputType::kInt32; }

// State shared by a context and the results it produced: results keep the backend (and its memory)
// alive until they are released.
struct SharedState {
  SharedState(Geometry g, std::unique_ptr<Backend> b)
      : geometry(std::move(g)), backend(std::move(b)), held(geometry.result_slots, false) {}

  const Geometry geometry;
  absl::Mutex mu;
  // Calls that enqueue work or touch shared buffers hold `mu`. The per-slot methods (SlotReady,
  // WaitSlot, SlotCounts, SlotStats) of a slot held by a result are called without it: only that
  // result touches the slot.
  const std::unique_ptr<Backend> backend;
  std::vector<bool> held ABSL_GUARDED_BY(mu);
};

class FinishResultImpl final : public FinishResult {
 public:
  FinishResultImpl(std::shared_ptr<SharedState> shared, int slot, int num_requests, OutputType output_type)
      : shared_(std::move(shared)), slot_(slot), num_requests_(num_requests), output_type_(output_type) {}

  ~FinishResultImpl() override {
    absl::MutexLock lock(&shared_->mu);
    shared_->held[slot_] = false;
  }

  absl::StatusOr<bool> Query() const override {
    if (ready_) return true;
    absl::StatusOr<bool> ready = shared_->backend->SlotReady(slot_);
    if (ready.ok() && *ready) ready_ = true;
    return ready;
  }

  absl::Status Wait() override {
    if (ready_) return absl::OkStatus();
    absl::Status status = shared_->backend->WaitSlot(slot_);
    if (status.ok()) ready_ = true;
    return status;
  }

  int num_requests() const override { return num_requests_; }
  OutputType output_type() const override { return output_type_; }
  int64_t cells_per_request() const override { return shared_->geometry.cells; }

  const int16_t* counts_int16() const override {
    if (output_type_ != OutputType::kInt16 || !IsReady()) return nullptr;
    return static_cast<const int16_t*>(shared_->backend->SlotCounts(slot_));
  }
  const int32_t* counts_int32() const override {
    if (output_type_ != OutputType::kInt32 || !IsReady()) return nullptr;
    return static_cast<const int32_t*>(shared_->backend->SlotCounts(slot_));
  }
  const float* gate_prob_sums() const override {
    if (output_type_ != OutputType::kFloat32 || !IsReady()) return nullptr;
    return static_cast<const float*>(shared_->backend->SlotCounts(slot_));
  }
  Stats stats() const override { return IsReady() ? shared_->backend->SlotStats(slot_) : Stats{}; }

 private:
  bool IsReady() const {
    absl::StatusOr<bool> ready = Query();
    return ready.ok() && *ready;
  }

  const std::shared_ptr<SharedState> shared_;
  const int slot_;
  const int num_requests_;
  const OutputType output_type_;
  mutable std::atomic<bool> ready_{false};
};

class CaptureImpl final : public Capture {
 public:
  CaptureImpl(std::shared_ptr<SharedState> shared, Info info) : shared_(std::move(shared)), info_(info) {}

  const Info& info() const override { return info_; }

  absl::Status Record(int layer, const void* topk_ids, IndexType id_type, int top_k, const void* slot_mapping,
                      IndexType slot_type, int64_t num_tokens, uint32_t flags, void* stream) override {
    const Geometry& g = shared_->geometry;
    if (!g.block_mode()) {
      return absl::FailedPreconditionError("record: the block mode is off (num_blocks = 0)");
    }
    if ((flags & ~kRecordSkipReset) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat("record: unknown flags 0x%x", flags));
    }
    absl::Status status =
        CheckRecordArgs("record", layer, topk_ids, id_type, top_k, slot_mapping, slot_type, "slot_mapping", num_tokens);
    if (!status.ok() || num_tokens == 0) return status;
    internal::RecordCall call{
        layer, topk_ids, id_type, top_k, slot_mapping, slot_type, num_tokens, (flags & kRecordSkipReset) == 0, stream};
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->Record(call);
  }

  absl::Status ResetBatchBlocks(const void* slot_mapping, IndexType slot_type, int64_t num_tokens,
                                void* stream) override {
    const Geometry& g = shared_->geometry;
    if (!g.block_mode()) {
      return absl::FailedPreconditionError("reset_batch_blocks: the block mode is off (num_blocks = 0)");
    }
    if (!ValidIndexType(slot_type)) {
      return absl::InvalidArgumentError(IndexTypeError("reset_batch_blocks: slot_mapping", slot_type));
    }
    if (num_tokens < 0 || num_tokens > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("reset_batch_blocks: num_tokens must be in [0, 2^31), got ", num_tokens));
    }
    if (num_tokens == 0) return absl::OkStatus();
    if (slot_mapping == nullptr) {
      return absl::InvalidArgumentError("reset_batch_blocks: slot_mapping is null");
    }
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->ResetBatchBlocks(slot_mapping, slot_type, num_tokens, stream);
  }

  absl::StatusOr<std::unique_ptr<FinishResult>> Finish(const int32_t* block_tables, int64_t block_table_stride,
                                                       const int64_t* lengths, int num_requests, OutputType output_type,
                                                       void* stream) override {
    if (!shared_->geometry.block_mode()) {
      return absl::FailedPreconditionError("finish: the block mode is off (num_blocks = 0)");
    }
    if (absl::Status s = CheckFinishCommon("finish", num_requests, output_type); !s.ok()) return s;
    absl::StatusOr<std::vector<int32_t>> request_blocks =
        CheckBlockTables("finish", block_tables, block_table_stride, lengths, num_requests);
    if (!request_blocks.ok()) return request_blocks.status();
    absl::MutexLock lock(&shared_->mu);
    absl::StatusOr<int> slot = AcquireSlot();
    if (!slot.ok()) return slot.status();
    absl::Status status =
        shared_->backend->FinishBlocks(*slot, block_tables, block_table_stride, *request_blocks, output_type, stream);
    return MakeResult(*slot, status, num_requests, output_type);
  }

  absl::StatusOr<std::unique_ptr<FinishResult>> FinishGateProbs(const int32_t* block_tables, int64_t block_table_stride,
                                                                const int64_t* lengths, int num_requests,
                                                                void* stream) override {
    static constexpr char kOp[] = "finish_gate_probs";
    if (absl::Status s = CheckGateProbs(kOp); !s.ok()) return s;
    if (!shared_->geometry.block_mode()) {
      return absl::FailedPreconditionError(absl::StrCat(kOp, ": the block mode is off (num_blocks = 0)"));
    }
    if (absl::Status s = CheckFinishCommon(kOp, num_requests, OutputType::kInt32); !s.ok()) return s;
    absl::StatusOr<std::vector<int32_t>> request_blocks =
        CheckBlockTables(kOp, block_tables, block_table_stride, lengths, num_requests);
    if (!request_blocks.ok()) return request_blocks.status();
    absl::MutexLock lock(&shared_->mu);
    absl::StatusOr<int> slot = AcquireSlot();
    if (!slot.ok()) return slot.status();
    absl::Status status =
        shared_->backend->FinishGateBlocks(*slot, block_tables, block_table_stride, *request_blocks, stream);
    return MakeResult(*slot, status, num_requests, OutputType::kFloat32);
  }

  absl::Status RecordGateProbs(int layer, const void* topk_ids, IndexType id_type, const float* topk_weights, int top_k,
                               const void* slot_mapping, IndexType slot_type, int64_t num_tokens, uint32_t flags,
                               void* stream) override {
    static constexpr char kOp[] = "record_gate_probs";
    if (absl::Status s = CheckGateProbs(kOp); !s.ok()) return s;
    if (!shared_->geometry.block_mode()) {
      return absl::FailedPreconditionError(absl::StrCat(kOp, ": the block mode is off (num_blocks = 0)"));
    }
    if ((flags & ~kRecordSkipReset) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: unknown flags 0x%x", kOp, flags));
    }
    absl::Status status =
        CheckRecordArgs(kOp, layer, topk_ids, id_type, top_k, slot_mapping, slot_type, "slot_mapping", num_tokens);
    if (!status.ok() || num_tokens == 0) return status;
    if (topk_weights == nullptr) return absl::InvalidArgumentError(absl::StrCat(kOp, ": topk_weights is null"));
    internal::RecordCall call{layer,        topk_ids,    id_type,    top_k,
                              slot_mapping, slot_type,   num_tokens, (flags & kRecordSkipReset) == 0,
                              stream,       topk_weights};
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->Record(call);
  }

  absl::Status RecordDirectGateProbs(int layer, const void* topk_ids, IndexType id_type, const float* topk_weights,
                                     int top_k, const void* token_request, IndexType request_type, int64_t num_tokens,
                                     void* stream) override {
    static constexpr char kOp[] = "record_direct_gate_probs";
    if (absl::Status s = CheckGateProbs(kOp); !s.ok()) return s;
    if (shared_->geometry.max_direct_requests == 0) {
      return absl::FailedPreconditionError(absl::StrCat(kOp, ": the direct mode is off (max_direct_requests = 0)"));
    }
    absl::Status status =
        CheckRecordArgs(kOp, layer, topk_ids, id_type, top_k, token_request, request_type, "token_request", num_tokens);
    if (!status.ok() || num_tokens == 0) return status;
    if (topk_weights == nullptr) return absl::InvalidArgumentError(absl::StrCat(kOp, ": topk_weights is null"));
    internal::RecordCall call{layer,        topk_ids,   id_type, top_k,  token_request,
                              request_type, num_tokens, false,   stream, topk_weights};
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->RecordDirect(call);
  }

  absl::Status RecordGateLogits(int layer, const void* topk_ids, IndexType id_type, int top_k,
                                const void* router_logits, LogitsType logits_type, int64_t logits_stride,
                                const void* slot_mapping, IndexType slot_type, int64_t num_tokens, uint32_t flags,
                                void* stream) override {
    static constexpr char kOp[] = "record_gate_logits";
    if (absl::Status s = CheckGateProbs(kOp); !s.ok()) return s;
    if (!shared_->geometry.block_mode()) {
      return absl::FailedPreconditionError(absl::StrCat(kOp, ": the block mode is off (num_blocks = 0)"));
    }
    if ((flags & ~kRecordSkipReset) != 0) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: unknown flags 0x%x", kOp, flags));
    }
    absl::Status status =
        CheckRecordArgs(kOp, layer, topk_ids, id_type, top_k, slot_mapping, slot_type, "slot_mapping", num_tokens);
    if (status.ok()) status = CheckLogits(kOp, router_logits, logits_type, &logits_stride, num_tokens);
    if (!status.ok() || num_tokens == 0) return status;
    internal::RecordCall call{
        layer, topk_ids, id_type, top_k, slot_mapping, slot_type, num_tokens, (flags & kRecordSkipReset) == 0, stream};
    call.logits = router_logits;
    call.logits_type = static_cast<int>(logits_type);
    call.logits_stride = logits_stride;
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->Record(call);
  }

  absl::Status RecordDirectGateLogits(int layer, const void* topk_ids, IndexType id_type, int top_k,
                                      const void* router_logits, LogitsType logits_type, int64_t logits_stride,
                                      const void* token_request, IndexType request_type, int64_t num_tokens,
                                      void* stream) override {
    static constexpr char kOp[] = "record_direct_gate_logits";
    if (absl::Status s = CheckGateProbs(kOp); !s.ok()) return s;
    if (shared_->geometry.max_direct_requests == 0) {
      return absl::FailedPreconditionError(absl::StrCat(kOp, ": the direct mode is off (max_direct_requests = 0)"));
    }
    absl::Status status =
        CheckRecordArgs(kOp, layer, topk_ids, id_type, top_k, token_request, request_type, "token_request", num_tokens);
    if (status.ok()) status = CheckLogits(kOp, router_logits, logits_type, &logits_stride, num_tokens);
    if (!status.ok() || num_tokens == 0) return status;
    internal::RecordCall call{layer, topk_ids, id_type, top_k, token_request, request_type, num_tokens, false, stream};
    call.logits = router_logits;
    call.logits_type = static_cast<int>(logits_type);
    call.logits_stride = logits_stride;
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->RecordDirect(call);
  }

  absl::StatusOr<std::unique_ptr<FinishResult>> FinishDirectGateProbs(const int32_t* request_slots, int num_requests,
                                                                      void* stream) override {
    static constexpr char kOp[] = "finish_direct_gate_probs";
    if (absl::Status s = CheckGateProbs(kOp); !s.ok()) return s;
    absl::StatusOr<std::vector<int32_t>> slots = CheckDirectSlots(kOp, request_slots, num_requests, OutputType::kInt32);
    if (!slots.ok()) return slots.status();
    absl::MutexLock lock(&shared_->mu);
    absl::StatusOr<int> slot = AcquireSlot();
    if (!slot.ok()) return slot.status();
    absl::Status status = shared_->backend->FinishGateDirect(*slot, *slots, stream);
    return MakeResult(*slot, status, num_requests, OutputType::kFloat32);
  }

  absl::Status RecordDirect(int layer, const void* topk_ids, IndexType id_type, int top_k, const void* token_request,
                            IndexType request_type, int64_t num_tokens, void* stream) override {
    if (shared_->geometry.max_direct_requests == 0) {
      return absl::FailedPreconditionError("record_direct: the direct mode is off (max_direct_requests = 0)");
    }
    absl::Status status = CheckRecordArgs("record_direct", layer, topk_ids, id_type, top_k, token_request, request_type,
                                          "token_request", num_tokens);
    if (!status.ok() || num_tokens == 0) return status;
    internal::RecordCall call{layer, topk_ids, id_type, top_k, token_request, request_type, num_tokens, false, stream};
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->RecordDirect(call);
  }

  absl::StatusOr<std::unique_ptr<FinishResult>> FinishDirect(const int32_t* request_slots, int num_requests,
                                                             OutputType output_type, void* stream) override {
    absl::StatusOr<std::vector<int32_t>> slots =
        CheckDirectSlots("finish_direct", request_slots, num_requests, output_type);
    if (!slots.ok()) return slots.status();
    absl::MutexLock lock(&shared_->mu);
    absl::StatusOr<int> slot = AcquireSlot();
    if (!slot.ok()) return slot.status();
    absl::Status status = shared_->backend->FinishDirect(*slot, *slots, output_type, stream);
    return MakeResult(*slot, status, num_requests, output_type);
  }

  absl::Status Clear(void* stream) override {
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->Clear(stream);
  }

  absl::StatusOr<Stats> ReadStats(void* stream) override {
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->ReadStats(stream);
  }

  absl::Status ResetStats(void* stream) override {
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->ResetStats(stream);
  }

  absl::Status ReadBlockCounts(int64_t first_block, int64_t num_blocks, int32_t* out, void* stream) override {
    const Geometry& g = shared_->geometry;
    if (first_block < 0 || num_blocks < 0 || first_block > g.num_blocks - num_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("read_block_counts: blocks [", first_block, ", ",
                                                     first_block + num_blocks, ") are outside [0, ", g.num_blocks,
                                                     ")"));
    }
    if (num_blocks == 0) return absl::OkStatus();
    if (out == nullptr) return absl::InvalidArgumentError("read_block_counts: out is null");
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->ReadBlockCounts(first_block, num_blocks, out, stream);
  }

  absl::Status ReadDirectCounts(int first_slot, int num_slots, int32_t* out, void* stream) override {
    const Geometry& g = shared_->geometry;
    if (first_slot < 0 || num_slots < 0 || first_slot > g.max_direct_requests - num_slots) {
      return absl::InvalidArgumentError(absl::StrCat("read_direct_counts: slots [", first_slot, ", ",
                                                     first_slot + num_slots, ") are outside [0, ",
                                                     g.max_direct_requests, ")"));
    }
    if (num_slots == 0) return absl::OkStatus();
    if (out == nullptr) return absl::InvalidArgumentError("read_direct_counts: out is null");
    absl::MutexLock lock(&shared_->mu);
    return shared_->backend->ReadDirectCounts(first_slot, num_slots, out, stream);
  }

 private:
  absl::Status CheckRecordArgs(const char* op, int layer, const void* topk_ids, IndexType id_type, int top_k,
                               const void* index, IndexType index_type, const char* index_name,
                               int64_t num_tokens) const {
    const Geometry& g = shared_->geometry;
    if (layer < 0 || layer >= g.layers) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": layer ", layer, " is outside [0, ", g.layers, ")"));
    }
    if (top_k < 1 || top_k > g.max_top_k) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": top_k ", top_k, " is outside [1, ", g.max_top_k, "] (options.max_top_k)"));
    }
    if (!ValidIndexType(id_type)) {
      return absl::InvalidArgumentError(IndexTypeError(absl::StrCat(op, ": topk_ids").c_str(), id_type));
    }
    if (!ValidIndexType(index_type)) {
      return absl::InvalidArgumentError(IndexTypeError(absl::StrCat(op, ": ", index_name).c_str(), index_type));
    }
    if (num_tokens < 0 || num_tokens > std::numeric_limits<int32_t>::max() / top_k) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": num_tokens must be in [0, 2^31 / top_k), got ", num_tokens));
    }
    if (num_tokens > 0 && (topk_ids == nullptr || index == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": ", topk_ids == nullptr ? "topk_ids" : index_name, " is null"));
    }
    return absl::OkStatus();
  }

  absl::Status CheckFinishCommon(const char* op, int num_requests, OutputType output_type) const {
    const Geometry& g = shared_->geometry;
    if (num_requests < 1 || num_requests > g.max_finish_requests) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": num_requests must be in [1, ", g.max_finish_requests,
                                                     "] (options.max_finish_requests), got ", num_requests));
    }
    if (!ValidOutputType(output_type)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": output_type must be int16 (0) or int32 (1), got ", static_cast<int>(output_type)));
    }
    return absl::OkStatus();
  }

  // Router logits: a known type, a stride (0: E) of at least E elements, not null, and the whole
  // array addressable with 64-bit offsets below 2^62 bytes.
  absl::Status CheckLogits(const char* op, const void* logits, LogitsType type, int64_t* stride,
                           int64_t num_tokens) const {
    const Geometry& g = shared_->geometry;
    if (type != LogitsType::kFloat32 && type != LogitsType::kBfloat16 && type != LogitsType::kFloat16) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": logits_type must be float32 (0), bfloat16 (1) or float16 (2), got ", static_cast<int>(type)));
    }
    if (*stride == 0) *stride = g.experts;
    if (*stride < g.experts || *stride > (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": logits_stride ", *stride, " is outside [E = ", g.experts, ", 2^31] (0 means E)"));
    }
    if (num_tokens > 0 && logits == nullptr)
      return absl::InvalidArgumentError(absl::StrCat(op, ": router_logits is null"));
    return absl::OkStatus();
  }

  absl::Status CheckGateProbs(const char* op) const {
    if (!shared_->geometry.gate_probs) {
      return absl::FailedPreconditionError(
          absl::StrCat(op, ": gate probabilities are off (create the context with options.record_gate_probs)"));
    }
    return absl::OkStatus();
  }

  // Validates a finish's block tables and lengths; returns each request's number of blocks.
  absl::StatusOr<std::vector<int32_t>> CheckBlockTables(const char* op, const int32_t* block_tables,
                                                        int64_t block_table_stride, const int64_t* lengths,
                                                        int num_requests) const {
    const Geometry& g = shared_->geometry;
    if (lengths == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": lengths is null"));
    if (block_table_stride < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": block_table_stride must be >= 0, got ", block_table_stride));
    }
    std::vector<int32_t> request_blocks(num_requests);
    int64_t max_blocks = 0;
    for (int r = 0; r < num_requests; ++r) {
      if (lengths[r] < 0) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": lengths[", r, "] = ", lengths[r], " is negative"));
      }
      // Kernels index a request's blocks with 32-bit ints and split them over at most 2^15
      // thread blocks of 4096 blocks each.
      constexpr int64_t kMaxRequestTokens = int64_t{1} << 40;
      constexpr int64_t kMaxRequestBlocks = int64_t{1} << 27;
      if (lengths[r] > kMaxRequestTokens) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": lengths[", r, "] = ", lengths[r], " exceeds 2^40 tokens"));
      }
      const int64_t blocks = (lengths[r] + g.block_size - 1) / g.block_size;
      if (blocks > kMaxRequestBlocks) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": request ", r, " has ", blocks, " blocks, more than 2^27"));
      }
      if (blocks > block_table_stride) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": request ", r, " has ", lengths[r], " tokens = ", blocks, " blocks of ", g.block_size,
                         ", more than its block table holds (stride ", block_table_stride, ")"));
      }
      request_blocks[r] = static_cast<int32_t>(blocks);
      max_blocks = std::max(max_blocks, blocks);
    }
    if (max_blocks > 0 && block_tables == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": block_tables is null"));
    }
    return request_blocks;
  }

  // Validates a direct finish's request slots (distinct, in range); returns them.
  absl::StatusOr<std::vector<int32_t>> CheckDirectSlots(const char* op, const int32_t* request_slots, int num_requests,
                                                        OutputType output_type) const {
    const Geometry& g = shared_->geometry;
    if (g.max_direct_requests == 0) {
      return absl::FailedPreconditionError(absl::StrCat(op, ": the direct mode is off (max_direct_requests = 0)"));
    }
    if (absl::Status s = CheckFinishCommon(op, num_requests, output_type); !s.ok()) return s;
    if (request_slots == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": request_slots is null"));
    std::vector<int32_t> slots(request_slots, request_slots + num_requests);
    std::vector<int32_t> sorted = slots;
    std::sort(sorted.begin(), sorted.end());
    for (int r = 0; r < num_requests; ++r) {
      if (slots[r] < 0 || slots[r] >= g.max_direct_requests) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": request_slots[", r, "] = ", slots[r], " is outside [0, ", g.max_direct_requests, ")"));
      }
      if (r > 0 && sorted[r] == sorted[r - 1]) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": request slot ", sorted[r], " appears twice"));
      }
    }
    return slots;
  }

  // The result of a finish enqueued into `slot` (held), or the slot freed again on failure.
  absl::StatusOr<std::unique_ptr<FinishResult>> MakeResult(int slot, const absl::Status& status, int num_requests,
                                                           OutputType output_type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared_->mu) {
    if (!status.ok()) {
      shared_->held[slot] = false;
      return status;
    }
    return std::unique_ptr<FinishResult>(new FinishResultImpl(shared_, slot, num_requests, output_type));
  }

  // A slot no result holds. A slot released while its copy was still pending is reused once the
  // copy completed, waiting for it if no other slot is free.
  absl::StatusOr<int> AcquireSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared_->mu) {
    int pending = -1;
    for (int i = 0; i < shared_->geometry.result_slots; ++i) {
      if (shared_->held[i]) continue;
      absl::StatusOr<bool> ready = shared_->backend->SlotReady(i);
      if (!ready.ok()) return ready.status();
      if (*ready) {
        shared_->held[i] = true;
        return i;
      }
      if (pending < 0) pending = i;
    }
    if (pending < 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", shared_->geometry.result_slots,
                       " result slots are held by unreleased results (options.result_slots): release results "
                       "once their counts are read"));
    }
    if (absl::Status status = shared_->backend->WaitSlot(pending); !status.ok()) return status;
    shared_->held[pending] = true;
    return pending;
  }

  const std::shared_ptr<SharedState> shared_;
  const Info info_;
};

}  // namespace

std::string StatsToString(const Stats& s) {
  return absl::StrCat("recorded_choices=", s.recorded_choices, " padding_tokens=", s.padding_tokens,
                      " bad_slots=", s.bad_slots, " bad_expert_ids=", s.bad_expert_ids,
                      " bad_request_indices=", s.bad_request_indices, " bad_block_ids=", s.bad_block_ids,
                      " duplicate_slots=", s.duplicate_slots, " saturated_adds=", s.saturated_adds,
                      " saturated_outputs=", s.saturated_outputs, " block_resets=", s.block_resets);
}

absl::StatusOr<std::unique_ptr<Capture>> Capture::Create(const Options& options) {
  absl::StatusOr<Geometry> geometry = internal::ResolveGeometry(options);
  if (!geometry.ok()) return geometry.status();
  absl::StatusOr<std::unique_ptr<Backend>> backend = options.device == Device::kCpu
                                                         ? internal::MakeCpuBackend(*geometry)
                                                         : internal::MakeCudaBackend(*geometry, options.cuda_device);
  if (!backend.ok()) return backend.status();
  Info info;
  info.device = options.device;
  info.num_layers = geometry->layers;
  info.num_experts = geometry->experts;
  info.num_blocks = geometry->num_blocks;
  info.block_size = geometry->block_size;
  info.counter_bits = geometry->counter_bytes * 8;
  info.counter_max = geometry->counter_max;
  info.block_counts_bytes = static_cast<uint64_t>(geometry->block_counts_bytes());
  info.device_bytes = (*backend)->device_bytes();
  info.host_bytes = (*backend)->host_bytes();
  info.gate_prob_fraction_bits = !geometry->gate_probs    ? 0
                                 : geometry->block_mode() ? geometry->gate_fraction_bits
                                                          : internal::kDirectGateFractionBits;
  info.max_direct_requests = geometry->max_direct_requests;
  info.block_gate_prob_bytes = static_cast<uint64_t>(geometry->block_gate_bytes());
  auto shared = std::make_shared<SharedState>(*std::move(geometry), *std::move(backend));
  return std::unique_ptr<Capture>(new CaptureImpl(std::move(shared), info));
}

}  // namespace eldr::capture
