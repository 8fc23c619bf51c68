// Internal: the device backends behind eldr::capture::Capture (CPU reference and CUDA). The front end
// (capture.cc) validates every host-checkable argument and owns the result-slot bookkeeping; a
// backend only executes, with the semantics documented in include/eldr/capture/capture.h. Both backends keep
// the same memory layout, so their per-block counts compare bit for bit.
#ifndef ELDR_CUDA_CAPTURE_BACKEND_H_
#define ELDR_CUDA_CAPTURE_BACKEND_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "capture_stats.h"
#include "eldr/capture/capture.hpp"

namespace eldr::capture::internal {

Stats StatsFromArray(const uint64_t (&values)[kNumStats]);

// Resolved geometry and layout, shared by both backends.
//
// Per-block counts: block b occupies block_stride_bytes at b * block_stride_bytes; within it cell
// (layer, expert) is counter number layer * E + expert, counter_bytes wide, little-endian. The
// stride is rounded up to 16 bytes so that every block starts 16-byte aligned and no 32-bit word
// straddles two blocks; the padding is always zero.
//
// Gate-probability accumulators (record_gate_probs): per block, L * E unsigned 32-bit fixed-point
// values with gate_fraction_bits fraction bits, block b's at b * cells; per direct slot, L * E
// unsigned 64-bit values with kDirectGateFractionBits fraction bits. Integer adds are associative,
// so every device and every thread order produces the same bits; the finish converts the integer
// sum of a request to float32 once (round to nearest, then an exact scaling by 2^-fraction_bits).
//
// Slot bitmap: one bit per (block, layer, offset) says the slot was counted for the layer since the
// block's last reset. Row (b, layer) is bitmap_words_per_row 32-bit words at
// (b * L + layer) * bitmap_words_per_row.
struct Geometry {
  int layers = 0;
  int experts = 0;
  int64_t cells = 0;  // L * E
  int max_top_k = 0;
  int64_t num_blocks = 0;
  int block_size = 0;
  int64_t num_slots = 0;  // num_blocks * block_size (< 2^31)
  int counter_bytes = 0;  // 1, 2 or 4
  uint32_t counter_max = 0;
  int64_t block_stride_bytes = 0;
  int bitmap_words_per_row = 0;
  int max_direct_requests = 0;
  int max_finish_requests = 0;
  int max_blocks_per_request = 0;
  int result_slots = 0;
  bool validate_pointers = true;
  bool gate_probs = false;
  int gate_fraction_bits = 0;  // block mode, when gate_probs

  bool block_mode() const { return num_blocks > 0; }
  int64_t block_gate_bytes() const { return gate_probs ? num_blocks * cells * 4 : 0; }
  int64_t direct_gate_bytes() const { return gate_probs ? int64_t{max_direct_requests} * cells * 8 : 0; }
  int64_t block_counts_bytes() const { return num_blocks * block_stride_bytes; }
  int64_t bitmap_words() const { return num_blocks * layers * bitmap_words_per_row; }
};

// Validates `options` and derives the layout. INVALID_ARGUMENT names the first bad field.
absl::StatusOr<Geometry> ResolveGeometry(const Options& options);

// Gate probabilities outside [0, 1] (and NaN) are skipped and counted in bad_gate_probs.
inline bool GateProbInRange(float p) { return p >= 0.0f && p <= 1.0f; }  // false for NaN

// One record call, validated by the front end (num_tokens > 0, pointers non-null, layer and top_k
// in range).
struct RecordCall {
  int layer = 0;
  const void* topk_ids = nullptr;
  IndexType id_type = IndexType::kInt32;
  int top_k = 0;
  const void* index = nullptr;  // slot mapping (block mode) or token -> request (direct mode)
  IndexType index_type = IndexType::kInt64;
  int64_t num_tokens = 0;
  bool reset = true;  // block mode: reset this layer's rows of blocks starting in the batch
  void* stream = nullptr;
  const float* weights = nullptr;  // [num_tokens][top_k] gate probabilities, or null (counts only)
  // Or router logits [num_tokens][logits_stride] of logits_type (gate_softmax.h kLogits*): softmax
  // over all E experts added to the gate accumulators (eldr_capture_record_gate_logits). At most one
  // of weights and logits is set.
  const void* logits = nullptr;
  int logits_type = 0;
  int64_t logits_stride = 0;  // elements, >= E
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual absl::Status Record(const RecordCall& call) = 0;
  virtual absl::Status ResetBatchBlocks(const void* slots, IndexType slot_type, int64_t num_tokens, void* stream) = 0;
  virtual absl::Status RecordDirect(const RecordCall& call) = 0;

  // Enqueues a finish into result slot `slot` (held by the caller). `num_blocks_per_request[r]` is
  // ceil(length / block_size) <= stride, already checked. `block_tables` may be device or host memory.
  virtual absl::Status FinishBlocks(int slot, const int32_t* block_tables, int64_t stride,
                                    absl::Span<const int32_t> num_blocks_per_request, OutputType output_type,
                                    void* stream) = 0;
  // `request_slots` are distinct and in range, already checked.
  virtual absl::Status FinishDirect(int slot, absl::Span<const int32_t> request_slots, OutputType output_type,
                                    void* stream) = 0;
  // Gate-probability finishes (geometry.gate_probs): float32 [R][L][E] into the slot, same arguments.
  virtual absl::Status FinishGateBlocks(int slot, const int32_t* block_tables, int64_t stride,
                                        absl::Span<const int32_t> num_blocks_per_request, void* stream) = 0;
  virtual absl::Status FinishGateDirect(int slot, absl::Span<const int32_t> request_slots, void* stream) = 0;

  // Whether the last finish enqueued into `slot` completed (true for a never used slot).
  virtual absl::StatusOr<bool> SlotReady(int slot) const = 0;
  virtual absl::Status WaitSlot(int slot) = 0;
  // Host memory of the slot's counts ([R][L][E] of the finish's output type) and stats snapshot.
  virtual const void* SlotCounts(int slot) const = 0;
  virtual Stats SlotStats(int slot) const = 0;

  virtual absl::Status Clear(void* stream) = 0;
  virtual absl::StatusOr<Stats> ReadStats(void* stream) = 0;
  virtual absl::Status ResetStats(void* stream) = 0;
  virtual absl::Status ReadBlockCounts(int64_t first_block, int64_t num_blocks, int32_t* out, void* stream) = 0;
  virtual absl::Status ReadDirectCounts(int first_slot, int num_slots, int32_t* out, void* stream) = 0;

  virtual uint64_t device_bytes() const = 0;
  virtual uint64_t host_bytes() const = 0;
};

// A CUDA runtime failure: code INTERNAL with a payload that the C ABI maps to
// ELDR_CAPTURE_DEVICE_ERROR.
absl::Status DeviceError(absl::string_view message);
bool IsDeviceError(const absl::Status& status);

absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const Geometry& geometry);
// UNAVAILABLE when built without CUDA or without a usable GPU.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const Geometry& geometry, int cuda_device);

// Reads counter `cell` of a block stored with `counter_bytes`-wide little-endian counters.
inline uint32_t LoadCounter(const uint8_t* block, int counter_bytes, int64_t cell) {
  const uint8_t* p = block + cell * counter_bytes;
  switch (counter_bytes) {
    case 1:
      return p[0];
    case 2:
      return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
    default:
      return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
             (static_cast<uint32_t>(p[3]) << 24);
  }
}

}  // namespace eldr::capture::internal

#endif  // ELDR_CUDA_CAPTURE_BACKEND_H_
