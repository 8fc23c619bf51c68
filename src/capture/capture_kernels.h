// Internal: launchers of the capture kernels (capture_kernels.cu). Plain C++ declarations so that the
// host side (capture_cuda.cc) compiles without nvcc. Each launcher enqueues on `stream` (a
// cudaStream_t as void*) and returns the cudaError_t of the launch as an int (0 = success). Arguments
// are trusted: capture.cc and capture_cuda.cc validated them.
#ifndef ELDR_CUDA_CAPTURE_KERNELS_H_
#define ELDR_CUDA_CAPTURE_KERNELS_H_

#include <cstdint>

namespace eldr::capture::kernels {

struct BlockLayout {
  void* counts = nullptr;          // num_blocks * block_stride_bytes, 256-byte aligned
  uint32_t* bitmap = nullptr;      // num_blocks * layers * bitmap_words_per_row words
  int64_t block_stride_bytes = 0;  // multiple of 16
  int counter_bytes = 0;           // 1, 2 or 4
  int layers = 0;
  int experts = 0;
  int64_t num_blocks = 0;
  int block_size = 0;
  int num_slots = 0;  // num_blocks * block_size
  int bitmap_words_per_row = 0;
  // Gate-probability accumulators [num_blocks][layers * experts] (fixed point), or null when the
  // context does not record gate probabilities; resets zero them with the counts.
  uint32_t* gate = nullptr;
  int gate_fraction_bits = 0;
};

// Router logits of eldr_capture_record_gate_logits ([num_tokens][stride] of gate_softmax.h's
// kLogits* type), or data = null.
struct Logits {
  const void* data = nullptr;
  int type = 0;
  long long stride = 0;
};

// Zeroes row (block, layer) of counts and bitmap for every token of the batch whose slot is at
// offset 0 of its block.
int LaunchResetLayerRows(const BlockLayout& layout, int layer, const void* slots, bool slots_int64, int num_tokens,
                         unsigned long long* stats, void* stream);

// The same for every layer of those blocks.
int LaunchResetBlocks(const BlockLayout& layout, const void* slots, bool slots_int64, int num_tokens,
                      unsigned long long* stats, void* stream);

// Adds the batch's choices of `layer` into the per-block counts (see eldr_capture_record), and with
// `weights` ([num_tokens][top_k] float32, or null) their gate probabilities into layout.gate, or with
// `logits` the softmax over all experts of each counted token's logits.
int LaunchRecordBlocks(const BlockLayout& layout, int layer, const void* ids, bool ids_int64, int top_k,
                       const void* slots, bool slots_int64, int num_tokens, const float* weights, const Logits& logits,
                       unsigned long long* stats, void* stream);

// Direct mode: adds into acc[request][layer][expert] (uint32, saturating at 2^31 - 1), and with
// `weights` (or null) the gate probabilities into gate_acc (uint64 fixed point, 24 fraction bits).
int LaunchRecordDirect(uint32_t* acc, unsigned long long* gate_acc, int layers, int experts, int max_requests,
                       int layer, const void* ids, bool ids_int64, int top_k, const void* requests, bool requests_int64,
                       int num_tokens, const float* weights, const Logits& logits, unsigned long long* stats,
                       void* stream);

// Sums each request's first num_blocks[r] table entries of layout.gate into out [R][L*E] float32;
// `staging` (R * L * E uint64) as in LaunchSumBlocks.
int LaunchSumGateBlocks(const BlockLayout& layout, const int32_t* tables, int64_t stride, const int32_t* num_blocks,
                        int num_requests, int max_num_blocks, float* out, unsigned long long* staging, int sm_count,
                        unsigned long long* stats, void* stream);

// Direct mode gate finish: out[r] = float(gate_acc[slots[r]]) * 2^-24, then gate_acc[slots[r]] = 0.
int LaunchFinishDirectGate(unsigned long long* gate_acc, int64_t cells, const int32_t* slots, int num_requests,
                           float* out, unsigned long long* stats, void* stream);

// Sums each request's first num_blocks[r] table entries into out [R][L*E] (int16 or int32,
// saturating). `staging` holds R * L * E uint64 and is used when a request's blocks are split over
// several thread blocks; `sm_count` sizes that split.
int LaunchSumBlocks(const BlockLayout& layout, const int32_t* tables, int64_t stride, const int32_t* num_blocks,
                    int num_requests, int max_num_blocks, bool out_int16, void* out, unsigned long long* staging,
                    int sm_count, unsigned long long* stats, void* stream);

// Direct mode finish: out[r] = saturate(acc[slots[r]]), then acc[slots[r]] = 0.
int LaunchFinishDirect(uint32_t* acc, int64_t cells, const int32_t* slots, int num_requests, bool out_int16, void* out,
                       unsigned long long* stats, void* stream);

}  // namespace eldr::capture::kernels

#endif  // ELDR_CUDA_CAPTURE_KERNELS_H_
