// The capture kernels. Semantics are those of include/eldr/capture/capture.h and of the CPU reference
// (capture_cpu.cc); the GPU tests compare both bit for bit.
//
// Design notes.
// - Record is one thread per token: the token's slot is claimed in the per-(block, layer) slot
//   bitmap with one atomicOr (a slot counts at most once per fill, so a counter never exceeds
//   block_size * top_k), then each of its k choices is one fire-and-forget atomic add.
// - 8- and 16-bit counters are incremented with a 32-bit atomicAdd of (1 << shift) on the aligned
//   word that holds them. This is exact because a counter cannot overflow (above), so no carry ever
//   reaches a neighbour; block strides are multiples of 16 bytes, so a word never spans two blocks.
// - A reset must precede the adds of its batch. Kernels of one stream run in order, so the reset of a
//   record call is its own (small) kernel launched before the add kernel.
// - Statistics are reduced per thread block (warp reduce, then shared memory) and added to the global
//   counters with at most one atomic per counter per thread block.
// - Finish reads each block's counters with 16-byte loads and, when a request has many blocks, splits
//   its blocks over several thread blocks that add into a 64-bit staging buffer.

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "capture_kernels.h"
#include "capture_stats.h"
#include "gate_softmax.h"

namespace eldr::capture::kernels {
namespace {

using internal::kNumStats;
using internal::kStatBadBlockIds;
using internal::kStatBadExpertIds;
using internal::kStatBadGateProbs;
using internal::kStatBadRequests;
using internal::kStatBadSlots;
using internal::kStatBlockResets;
using internal::kStatDuplicateSlots;
using internal::kStatPadding;
using internal::kStatRecorded;
using internal::kStatSaturatedAdds;
using internal::kStatSaturatedOutputs;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Expert ids a record thread loads ahead of its slot claim (top-k of common MoE models is <= 8).
constexpr int kPrefetchedIds = 8;
// Direct-mode counters saturate here; the headroom above it (2^31) exceeds the adds one launch can
// make (num_tokens * top_k < 2^31), so concurrent over-adds that are undone never wrap the counter.
constexpr unsigned kDirectCounterMax = 0x7fffffffu;

// Adds this thread's statistics into the global counters. Every thread of the block must call it.
__device__ void FlushStats(const unsigned (&values)[kNumStats], unsigned long long* stats) {
  __shared__ unsigned partial[kWarps][kNumStats];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int i = 0; i < kNumStats; ++i) {
    const unsigned sum = __reduce_add_sync(kFullMask, values[i]);
    if (lane == 0) partial[warp][i] = sum;
  }
  __syncthreads();
  if (threadIdx.x < kNumStats) {
    unsigned long long total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += partial[w][threadIdx.x];
    if (total != 0) atomicAdd(&stats[threadIdx.x], total);
  }
}

template <typename Counter>
__device__ __forceinline__ void IncrementCounter(uint8_t* cell) {
  if constexpr (sizeof(Counter) == 4) {
    atomicAdd(reinterpret_cast<unsigned*>(cell), 1u);
  } else {
    const uintptr_t address = reinterpret_cast<uintptr_t>(cell);
    unsigned* word = reinterpret_cast<unsigned*>(address & ~uintptr_t{3});
    atomicAdd(word, 1u << ((address & 3) * 8));
  }
}

// round(p * 2^fraction_bits), ties to even, for p in [0, 1] (the CPU reference's QuantizeGateProb).
__device__ __forceinline__ unsigned QuantizeGateProb(float p, int fraction_bits) {
  return __float2uint_rn(p * __int_as_float((127 + fraction_bits) << 23));
}

// A fixed-point sum as float32 (the CPU reference's GateSumToFloat): round to nearest, then scale
// exactly by 2^-fraction_bits.
__device__ __forceinline__ float GateSumToFloat(unsigned long long sum, int fraction_bits) {
  return __ull2float_rn(sum) * __int_as_float((127 - fraction_bits) << 23);
}

__device__ __forceinline__ bool GateProbInRange(float p) { return p >= 0.0f && p <= 1.0f; }

template <typename Index>
__device__ __forceinline__ long long LoadIndex(const Index* array, long long i) {
  return static_cast<long long>(array[i]);
}

template <typename Counter, typename Slot>
__global__ void __launch_bounds__(kThreads)
    ResetLayerRowsKernel(BlockLayout layout, int layer, const Slot* slots, int num_tokens, unsigned long long* stats) {
  const int t = blockIdx.x * kThreads + threadIdx.x;
  int block = -1;
  if (t < num_tokens) {
    const long long slot = LoadIndex(slots, t);
    if (slot >= 0 && slot < layout.num_slots && slot % layout.block_size == 0) {
      block = static_cast<int>(slot / layout.block_size);
    }
  }
  unsigned values[kNumStats] = {};
  values[kStatBlockResets] = block >= 0;
  // The warp zeroes the rows of its resetting tokens together, one row at a time, coalesced.
  const int lane = threadIdx.x & 31;
  unsigned pending = __ballot_sync(kFullMask, block >= 0);
  while (pending != 0) {
    const int source = __ffs(pending) - 1;
    pending &= pending - 1;
    const int b = __shfl_sync(kFullMask, block, source);
    Counter* row = reinterpret_cast<Counter*>(static_cast<uint8_t*>(layout.counts) + b * layout.block_stride_bytes) +
                   static_cast<long long>(layer) * layout.experts;
    for (int c = lane; c < layout.experts; c += 32) row[c] = 0;
    uint32_t* bits = layout.bitmap + (static_cast<long long>(b) * layout.layers + layer) * layout.bitmap_words_per_row;
    for (int w = lane; w < layout.bitmap_words_per_row; w += 32) bits[w] = 0;
    if (layout.gate != nullptr) {
      uint32_t* gate = layout.gate + (static_cast<long long>(b) * layout.layers + layer) * layout.experts;
      for (int c = lane; c < layout.experts; c += 32) gate[c] = 0;
    }
  }
  FlushStats(values, stats);
}

template <typename Slot>
__global__ void __launch_bounds__(kThreads)
    ResetBlocksKernel(BlockLayout layout, const Slot* slots, int num_tokens, unsigned long long* stats) {
  const int t = blockIdx.x * kThreads + threadIdx.x;
  int block = -1;
  if (t < num_tokens) {
    const long long slot = LoadIndex(slots, t);
    if (slot >= 0 && slot < layout.num_slots && slot % layout.block_size == 0) {
      block = static_cast<int>(slot / layout.block_size);
    }
  }
  unsigned values[kNumStats] = {};
  values[kStatBlockResets] = block >= 0;
  const int lane = threadIdx.x & 31;
  unsigned pending = __ballot_sync(kFullMask, block >= 0);
  const long long chunks = layout.block_stride_bytes / 16;
  const long long bitmap_words = static_cast<long long>(layout.layers) * layout.bitmap_words_per_row;
  while (pending != 0) {
    const int source = __ffs(pending) - 1;
    pending &= pending - 1;
    const int b = __shfl_sync(kFullMask, block, source);
    uint4* region = reinterpret_cast<uint4*>(static_cast<uint8_t*>(layout.counts) + b * layout.block_stride_bytes);
    for (long long c = lane; c < chunks; c += 32) region[c] = make_uint4(0, 0, 0, 0);
    uint32_t* bits = layout.bitmap + b * bitmap_words;
    for (long long w = lane; w < bitmap_words; w += 32) bits[w] = 0;
    if (layout.gate != nullptr) {
      const long long cells = static_cast<long long>(layout.layers) * layout.experts;
      uint32_t* gate = layout.gate + b * cells;
      for (long long c = lane; c < cells; c += 32) gate[c] = 0;
    }
  }
  FlushStats(values, stats);
}

template <typename Counter, typename Id, typename Slot>
__global__ void __launch_bounds__(kThreads)
    RecordBlocksKernel(BlockLayout layout, int layer, const Id* ids, int top_k, const Slot* slots, int num_tokens,
                       const float* weights, Logits logits, unsigned long long* stats) {
  const int t = blockIdx.x * kThreads + threadIdx.x;
  unsigned values[kNumStats] = {};
  if (t < num_tokens) {
    const long long slot = LoadIndex(slots, t);
    if (slot < 0) {
      values[kStatPadding] = 1;
    } else if (slot >= layout.num_slots) {
      values[kStatBadSlots] = 1;
    } else {
      const int s = static_cast<int>(slot);
      const int b = s / layout.block_size;
      const int offset = s - b * layout.block_size;
      uint32_t* word = layout.bitmap +
                       (static_cast<long long>(b) * layout.layers + layer) * layout.bitmap_words_per_row +
                       (offset >> 5);
      const uint32_t bit = 1u << (offset & 31);
      // The first ids are loaded before the atomicOr so that their latency overlaps its round trip.
      const long long first = static_cast<long long>(t) * top_k;
      long long prefetched[kPrefetchedIds];
#pragma unroll
      for (int j = 0; j < kPrefetchedIds; ++j) {
        prefetched[j] = j < top_k ? LoadIndex(ids, first + j) : 0;
      }
      if (atomicOr(word, bit) & bit) {
        values[kStatDuplicateSlots] = 1;
      } else {
        uint8_t* row = static_cast<uint8_t*>(layout.counts) + b * layout.block_stride_bytes +
                       static_cast<long long>(layer) * layout.experts * sizeof(Counter);
        uint32_t* gate_row = weights != nullptr
                                 ? layout.gate + (static_cast<long long>(b) * layout.layers + layer) * layout.experts
                                 : nullptr;
        auto add = [&](long long expert, int j) {
          if (expert < 0 || expert >= layout.experts) {
            ++values[kStatBadExpertIds];
          } else {
            IncrementCounter<Counter>(row + expert * sizeof(Counter));
            ++values[kStatRecorded];
            if (gate_row != nullptr) {
              // Integer adds commute: the sum is the same whatever order the threads run in.
              const float p = weights[first + j];
              if (GateProbInRange(p)) {
                atomicAdd(gate_row + expert, QuantizeGateProb(p, layout.gate_fraction_bits));
              } else {
                ++values[kStatBadGateProbs];
              }
            }
          }
        };
        // Fully unrolled so that the prefetched ids stay in registers.
#pragma unroll
        for (int j = 0; j < kPrefetchedIds; ++j) {
          if (j < top_k) add(prefetched[j], j);
        }
        for (int j = kPrefetchedIds; j < top_k; ++j) add(LoadIndex(ids, first + j), j);
        if (logits.data != nullptr) {
          // The token's softmax over all experts (gate_softmax.h: the CPU reference's operations).
          uint32_t* cells = layout.gate + (static_cast<long long>(b) * layout.layers + layer) * layout.experts;
          const void* row = static_cast<const uint8_t*>(logits.data) +
                            static_cast<long long>(t) * logits.stride * internal::LogitsTypeBytes(logits.type);
          if (!internal::QuantizedSoftmax(row, logits.type, layout.experts, layout.gate_fraction_bits,
                                          [&](int e, uint32_t q) { atomicAdd(cells + e, q); })) {
            ++values[kStatBadGateProbs];
          }
        }
      }
    }
  }
  FlushStats(values, stats);
}

template <typename Id, typename Request>
__global__ void __launch_bounds__(kThreads)
    RecordDirectKernel(uint32_t* acc, unsigned long long* gate_acc, int layers, int experts, int max_requests,
                       int layer, const Id* ids, int top_k, const Request* requests, int num_tokens,
                       const float* weights, Logits logits, unsigned long long* stats) {
  const int t = blockIdx.x * kThreads + threadIdx.x;
  unsigned values[kNumStats] = {};
  if (t < num_tokens) {
    const long long request = LoadIndex(requests, t);
    if (request < 0) {
      values[kStatPadding] = 1;
    } else if (request >= max_requests) {
      values[kStatBadRequests] = 1;
    } else {
      const long long row_cell = (request * layers + layer) * static_cast<long long>(experts);
      uint32_t* row = acc + row_cell;
      const long long first = static_cast<long long>(t) * top_k;
      if (logits.data != nullptr) {
        const void* logit_row = static_cast<const uint8_t*>(logits.data) +
                                static_cast<long long>(t) * logits.stride * internal::LogitsTypeBytes(logits.type);
        if (!internal::QuantizedSoftmax(
                logit_row, logits.type, experts, internal::kDirectGateFractionBits,
                [&](int e, uint32_t q) { atomicAdd(gate_acc + row_cell + e, static_cast<unsigned long long>(q)); })) {
          ++values[kStatBadGateProbs];
        }
      }
      for (int j = 0; j < top_k; ++j) {
        const long long expert = LoadIndex(ids, first + j);
        if (expert < 0 || expert >= experts) {
          ++values[kStatBadExpertIds];
          continue;
        }
        if (weights != nullptr) {
          const float p = weights[first + j];
          if (GateProbInRange(p)) {
            atomicAdd(gate_acc + row_cell + expert,
                      static_cast<unsigned long long>(QuantizeGateProb(p, internal::kDirectGateFractionBits)));
          } else {
            ++values[kStatBadGateProbs];
          }
        }
        // Saturating add: an add that finds the counter at (or transiently above) the maximum
        // undoes itself, so the counter ends at min(start + adds, max) whatever the interleaving.
        const unsigned old = atomicAdd(row + expert, 1u);
        if (old >= kDirectCounterMax) {
          atomicSub(row + expert, 1u);
          ++values[kStatSaturatedAdds];
        } else {
          ++values[kStatRecorded];
        }
      }
    }
  }
  FlushStats(values, stats);
}

template <typename Out>
__device__ __forceinline__ Out Saturate(unsigned long long value, unsigned& clipped) {
  constexpr unsigned long long kMax = std::is_same_v<Out, int16_t> ? 32767ull : 2147483647ull;
  if (value > kMax) {
    ++clipped;
    return static_cast<Out>(kMax);
  }
  return static_cast<Out>(value);
}

template <typename Counter, typename Out>
__global__ void __launch_bounds__(kThreads)
    SumBlocksKernel(const uint8_t* counts, long long block_stride_bytes, long long cells, int chunks,
                    long long num_blocks, const int32_t* tables, long long table_stride,
                    const int32_t* num_blocks_per_request, int blocks_per_split, Out* out, unsigned long long* staging,
                    unsigned long long* stats) {
  constexpr int kCellsPerChunk = 16 / sizeof(Counter);
  using Acc = std::conditional_t<sizeof(Counter) == 4, unsigned long long, unsigned>;
  const int chunk = blockIdx.x * kThreads + threadIdx.x;
  const int request = blockIdx.y;
  const int request_blocks = num_blocks_per_request[request];
  const int begin = blockIdx.z * blocks_per_split;
  const int end = min(request_blocks, begin + blocks_per_split);
  const bool has_chunk = chunk < chunks;
  // One thread per (request, split) counts bad table entries, so each is counted once.
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
  const int32_t* table = tables + request * table_stride;

  unsigned values[kNumStats] = {};
  Acc acc[kCellsPerChunk] = {};
#pragma unroll 4
  for (int j = begin; j < end; ++j) {
    const int32_t block = table[j];
    if (block < 0 || block >= num_blocks) {
      if (reporter) ++values[kStatBadBlockIds];
      continue;
    }
    if (has_chunk) {
      const uint4 packed =
          *reinterpret_cast<const uint4*>(counts + static_cast<long long>(block) * block_stride_bytes + chunk * 16ll);
      const Counter* c = reinterpret_cast<const Counter*>(&packed);
#pragma unroll
      for (int i = 0; i < kCellsPerChunk; ++i) acc[i] += c[i];
    }
  }
  if (has_chunk) {
    const long long first_cell = static_cast<long long>(chunk) * kCellsPerChunk;
    const long long row = static_cast<long long>(request) * cells;
#pragma unroll
    for (int i = 0; i < kCellsPerChunk; ++i) {
      const long long cell = first_cell + i;
      if (cell >= cells) break;
      if (staging != nullptr) {
        if (acc[i] != 0) atomicAdd(&staging[row + cell], static_cast<unsigned long long>(acc[i]));
      } else {
        out[row + cell] = Saturate<Out>(acc[i], values[kStatSaturatedOutputs]);
      }
    }
  }
  FlushStats(values, stats);
}

template <typename Out>
__global__ void __launch_bounds__(kThreads)
    ConvertStagingKernel(const unsigned long long* staging, long long total, Out* out, unsigned long long* stats) {
  unsigned values[kNumStats] = {};
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    out[i] = Saturate<Out>(staging[i], values[kStatSaturatedOutputs]);
  }
  FlushStats(values, stats);
}

template <typename Out>
__global__ void __launch_bounds__(kThreads) FinishDirectKernel(uint32_t* acc, long long cells, const int32_t* slots,
                                                               int num_requests, Out* out, unsigned long long* stats) {
  unsigned values[kNumStats] = {};
  const long long total = cells * num_requests;
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    const long long request = i / cells;
    const long long cell = i - request * cells;
    uint32_t* counter = acc + slots[request] * cells + cell;
    const uint32_t value = *counter;
    *counter = 0;
    out[i] = Saturate<Out>(value, values[kStatSaturatedOutputs]);
  }
  FlushStats(values, stats);
}

// One thread per (cell, request, split of the request's blocks): an integer sum of the blocks' gate
// accumulators, converted to float32 directly or, with several splits, added to `staging` first.
__global__ void __launch_bounds__(kThreads)
    SumGateBlocksKernel(const uint32_t* gate, long long cells, long long num_blocks, const int32_t* tables,
                        long long table_stride, const int32_t* num_blocks_per_request, int blocks_per_split,
                        int fraction_bits, float* out, unsigned long long* staging, unsigned long long* stats) {
  const long long cell = static_cast<long long>(blockIdx.x) * kThreads + threadIdx.x;
  const int request = blockIdx.y;
  const int request_blocks = num_blocks_per_request[request];
  const int begin = blockIdx.z * blocks_per_split;
  const int end = min(request_blocks, begin + blocks_per_split);
  const bool reporter = blockIdx.x == 0 && threadIdx.x == 0;
  const int32_t* table = tables + request * table_stride;
  unsigned values[kNumStats] = {};
  unsigned long long acc = 0;
  for (int j = begin; j < end; ++j) {
    const int32_t block = table[j];
    if (block < 0 || block >= num_blocks) {
      if (reporter) ++values[kStatBadBlockIds];
      continue;
    }
    if (cell < cells) acc += gate[static_cast<long long>(block) * cells + cell];
  }
  if (cell < cells) {
    const long long index = static_cast<long long>(request) * cells + cell;
    if (staging != nullptr) {
      if (acc != 0) atomicAdd(&staging[index], acc);
    } else {
      out[index] = GateSumToFloat(acc, fraction_bits);
    }
  }
  FlushStats(values, stats);
}

__global__ void __launch_bounds__(kThreads)
    ConvertGateStagingKernel(const unsigned long long* staging, long long total, int fraction_bits, float* out) {
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    out[i] = GateSumToFloat(staging[i], fraction_bits);
  }
}

__global__ void __launch_bounds__(kThreads) FinishDirectGateKernel(unsigned long long* gate_acc, long long cells,
                                                                   const int32_t* slots, int num_requests, float* out) {
  const long long total = cells * num_requests;
  for (long long i = blockIdx.x * static_cast<long long>(kThreads) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * kThreads) {
    const long long request = i / cells;
    const long long cell = i - request * cells;
    unsigned long long* value = gate_acc + slots[request] * cells + cell;
    out[i] = GateSumToFloat(*value, internal::kDirectGateFractionBits);
    *value = 0;
  }
}

int Blocks(long long work) { return static_cast<int>((work + kThreads - 1) / kThreads); }

int GridStrideBlocks(long long work) {
  const long long blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

int LastLaunchError() { return static_cast<int>(cudaGetLastError()); }

template <typename Counter>
int LaunchResetLayerRowsTyped(const BlockLayout& layout, int layer, const void* slots, bool slots_int64, int num_tokens,
                              unsigned long long* stats, cudaStream_t stream) {
  if (slots_int64) {
    ResetLayerRowsKernel<Counter, int64_t><<<Blocks(num_tokens), kThreads, 0, stream>>>(
        layout, layer, static_cast<const int64_t*>(slots), num_tokens, stats);
  } else {
    ResetLayerRowsKernel<Counter, int32_t><<<Blocks(num_tokens), kThreads, 0, stream>>>(
        layout, layer, static_cast<const int32_t*>(slots), num_tokens, stats);
  }
  return LastLaunchError();
}

template <typename Counter, typename Id>
int LaunchRecordBlocksTyped(const BlockLayout& layout, int layer, const void* ids, int top_k, const void* slots,
                            bool slots_int64, int num_tokens, const float* weights, const Logits& logits,
                            unsigned long long* stats, cudaStream_t stream) {
  if (slots_int64) {
    RecordBlocksKernel<Counter, Id, int64_t><<<Blocks(num_tokens), kThreads, 0, stream>>>(
        layout, layer, static_cast<const Id*>(ids), top_k, static_cast<const int64_t*>(slots), num_tokens, weights,
        logits, stats);
  } else {
    RecordBlocksKernel<Counter, Id, int32_t><<<Blocks(num_tokens), kThreads, 0, stream>>>(
        layout, layer, static_cast<const Id*>(ids), top_k, static_cast<const int32_t*>(slots), num_tokens, weights,
        logits, stats);
  }
  return LastLaunchError();
}

template <typename Counter>
int LaunchRecordBlocksCounter(const BlockLayout& layout, int layer, const void* ids, bool ids_int64, int top_k,
                              const void* slots, bool slots_int64, int num_tokens, const float* weights,
                              const Logits& logits, unsigned long long* stats, cudaStream_t stream) {
  return ids_int64 ? LaunchRecordBlocksTyped<Counter, int64_t>(layout, layer, ids, top_k, slots, slots_int64,
                                                               num_tokens, weights, logits, stats, stream)
                   : LaunchRecordBlocksTyped<Counter, int32_t>(layout, layer, ids, top_k, slots, slots_int64,
                                                               num_tokens, weights, logits, stats, stream);
}

template <typename Id>
int LaunchRecordDirectTyped(uint32_t* acc, unsigned long long* gate_acc, int layers, int experts, int max_requests,
                            int layer, const void* ids, int top_k, const void* requests, bool requests_int64,
                            int num_tokens, const float* weights, const Logits& logits, unsigned long long* stats,
                            cudaStream_t stream) {
  if (requests_int64) {
    RecordDirectKernel<Id, int64_t><<<Blocks(num_tokens), kThreads, 0, stream>>>(
        acc, gate_acc, layers, experts, max_requests, layer, static_cast<const Id*>(ids), top_k,
        static_cast<const int64_t*>(requests), num_tokens, weights, logits, stats);
  } else {
    RecordDirectKernel<Id, int32_t><<<Blocks(num_tokens), kThreads, 0, stream>>>(
        acc, gate_acc, layers, experts, max_requests, layer, static_cast<const Id*>(ids), top_k,
        static_cast<const int32_t*>(requests), num_tokens, weights, logits, stats);
  }
  return LastLaunchError();
}

// The split of a request's blocks over thread blocks (see LaunchSumBlocksTyped).
struct BlockSplit {
  long long splits = 1;
  int blocks_per_split = 1;
};

BlockSplit SplitBlocks(int grid_x, int num_requests, int max_num_blocks, int sm_count) {
  BlockSplit split;
  if (max_num_blocks <= 0) return split;
  const long long base = static_cast<long long>(grid_x) * num_requests;
  const long long wanted = (4ll * sm_count + base - 1) / base;
  const long long most = (max_num_blocks + 7) / 8;
  const long long least = (max_num_blocks + 4095) / 4096;
  long long splits = wanted < most ? wanted : most;
  if (splits < least) splits = least;
  if (splits < 1) splits = 1;
  split.blocks_per_split = static_cast<int>((max_num_blocks + splits - 1) / splits);
  split.splits = (max_num_blocks + split.blocks_per_split - 1) / split.blocks_per_split;
  return split;
}

template <typename Counter, typename Out>
int LaunchSumBlocksTyped(const BlockLayout& layout, const int32_t* tables, int64_t stride, const int32_t* num_blocks,
                         int num_requests, int max_num_blocks, Out* out, unsigned long long* staging, int sm_count,
                         unsigned long long* stats, cudaStream_t stream) {
  const long long cells = static_cast<long long>(layout.layers) * layout.experts;
  const int chunks = static_cast<int>((cells * layout.counter_bytes + 15) / 16);
  const int grid_x = Blocks(chunks);
  // Split a request's blocks over several thread blocks when the (request, chunk) grid alone would
  // leave the GPU idle, or when one thread would sum too many blocks (4096 bounds the 32-bit
  // accumulator of 16-bit counters: 4096 * 65535 < 2^32).
  long long splits = 1;
  if (max_num_blocks > 0) {
    const long long base = static_cast<long long>(grid_x) * num_requests;
    const long long wanted = (4ll * sm_count + base - 1) / base;
    const long long most = (max_num_blocks + 7) / 8;
    const long long least = (max_num_blocks + 4095) / 4096;
    splits = wanted < most ? wanted : most;
    if (splits < least) splits = least;
    if (splits < 1) splits = 1;
  }
  const int blocks_per_split = max_num_blocks > 0 ? static_cast<int>((max_num_blocks + splits - 1) / splits) : 1;
  if (max_num_blocks > 0) splits = (max_num_blocks + blocks_per_split - 1) / blocks_per_split;
  const dim3 grid(grid_x, num_requests, static_cast<unsigned>(splits));
  const auto* counts = static_cast<const uint8_t*>(layout.counts);
  if (splits == 1) {
    SumBlocksKernel<Counter, Out><<<grid, kThreads, 0, stream>>>(counts, layout.block_stride_bytes, cells, chunks,
                                                                 layout.num_blocks, tables, stride, num_blocks,
                                                                 blocks_per_split, out, nullptr, stats);
    return LastLaunchError();
  }
  const long long total = cells * num_requests;
  cudaError_t status = cudaMemsetAsync(staging, 0, total * sizeof(unsigned long long), stream);
  if (status != cudaSuccess) return static_cast<int>(status);
  SumBlocksKernel<Counter, Out><<<grid, kThreads, 0, stream>>>(counts, layout.block_stride_bytes, cells, chunks,
                                                               layout.num_blocks, tables, stride, num_blocks,
                                                               blocks_per_split, out, staging, stats);
  status = cudaGetLastError();
  if (status != cudaSuccess) return static_cast<int>(status);
  ConvertStagingKernel<Out><<<GridStrideBlocks(total), kThreads, 0, stream>>>(staging, total, out, stats);
  return LastLaunchError();
}

template <typename Counter>
int LaunchSumBlocksCounter(const BlockLayout& layout, const int32_t* tables, int64_t stride, const int32_t* num_blocks,
                           int num_requests, int max_num_blocks, bool out_int16, void* out, unsigned long long* staging,
                           int sm_count, unsigned long long* stats, cudaStream_t stream) {
  if (out_int16) {
    return LaunchSumBlocksTyped<Counter, int16_t>(layout, tables, stride, num_blocks, num_requests, max_num_blocks,
                                                  static_cast<int16_t*>(out), staging, sm_count, stats, stream);
  }
  return LaunchSumBlocksTyped<Counter, int32_t>(layout, tables, stride, num_blocks, num_requests, max_num_blocks,
                                                static_cast<int32_t*>(out), staging, sm_count, stats, stream);
}

}  // namespace

int LaunchResetLayerRows(const BlockLayout& layout, int layer, const void* slots, bool slots_int64, int num_tokens,
                         unsigned long long* stats, void* stream) {
  switch (layout.counter_bytes) {
    case 1:
      return LaunchResetLayerRowsTyped<uint8_t>(layout, layer, slots, slots_int64, num_tokens, stats, AsStream(stream));
    case 2:
      return LaunchResetLayerRowsTyped<uint16_t>(layout, layer, slots, slots_int64, num_tokens, stats,
                                                 AsStream(stream));
    default:
      return LaunchResetLayerRowsTyped<uint32_t>(layout, layer, slots, slots_int64, num_tokens, stats,
                                                 AsStream(stream));
  }
}

int LaunchResetBlocks(const BlockLayout& layout, const void* slots, bool slots_int64, int num_tokens,
                      unsigned long long* stats, void* stream) {
  if (slots_int64) {
    ResetBlocksKernel<int64_t><<<Blocks(num_tokens), kThreads, 0, AsStream(stream)>>>(
        layout, static_cast<const int64_t*>(slots), num_tokens, stats);
  } else {
    ResetBlocksKernel<int32_t><<<Blocks(num_tokens), kThreads, 0, AsStream(stream)>>>(
        layout, static_cast<const int32_t*>(slots), num_tokens, stats);
  }
  return LastLaunchError();
}

int LaunchRecordBlocks(const BlockLayout& layout, int layer, const void* ids, bool ids_int64, int top_k,
                       const void* slots, bool slots_int64, int num_tokens, const float* weights, const Logits& logits,
                       unsigned long long* stats, void* stream) {
  switch (layout.counter_bytes) {
    case 1:
      return LaunchRecordBlocksCounter<uint8_t>(layout, layer, ids, ids_int64, top_k, slots, slots_int64, num_tokens,
                                                weights, logits, stats, AsStream(stream));
    case 2:
      return LaunchRecordBlocksCounter<uint16_t>(layout, layer, ids, ids_int64, top_k, slots, slots_int64, num_tokens,
                                                 weights, logits, stats, AsStream(stream));
    default:
      return LaunchRecordBlocksCounter<uint32_t>(layout, layer, ids, ids_int64, top_k, slots, slots_int64, num_tokens,
                                                 weights, logits, stats, AsStream(stream));
  }
}

int LaunchRecordDirect(uint32_t* acc, unsigned long long* gate_acc, int layers, int experts, int max_requests,
                       int layer, const void* ids, bool ids_int64, int top_k, const void* requests, bool requests_int64,
                       int num_tokens, const float* weights, const Logits& logits, unsigned long long* stats,
                       void* stream) {
  return ids_int64 ? LaunchRecordDirectTyped<int64_t>(acc, gate_acc, layers, experts, max_requests, layer, ids, top_k,
                                                      requests, requests_int64, num_tokens, weights, logits, stats,
                                                      AsStream(stream))
                   : LaunchRecordDirectTyped<int32_t>(acc, gate_acc, layers, experts, max_requests, layer, ids, top_k,
                                                      requests, requests_int64, num_tokens, weights, logits, stats,
                                                      AsStream(stream));
}

int LaunchSumGateBlocks(const BlockLayout& layout, const int32_t* tables, int64_t stride, const int32_t* num_blocks,
                        int num_requests, int max_num_blocks, float* out, unsigned long long* staging, int sm_count,
                        unsigned long long* stats, void* stream) {
  const cudaStream_t s = AsStream(stream);
  const long long cells = static_cast<long long>(layout.layers) * layout.experts;
  const int grid_x = Blocks(cells);
  const BlockSplit split = SplitBlocks(grid_x, num_requests, max_num_blocks, sm_count);
  const dim3 grid(grid_x, num_requests, static_cast<unsigned>(split.splits));
  if (split.splits == 1) {
    SumGateBlocksKernel<<<grid, kThreads, 0, s>>>(layout.gate, cells, layout.num_blocks, tables, stride, num_blocks,
                                                  split.blocks_per_split, layout.gate_fraction_bits, out, nullptr,
                                                  stats);
    return LastLaunchError();
  }
  const long long total = cells * num_requests;
  cudaError_t status = cudaMemsetAsync(staging, 0, total * sizeof(unsigned long long), s);
  if (status != cudaSuccess) return static_cast<int>(status);
  SumGateBlocksKernel<<<grid, kThreads, 0, s>>>(layout.gate, cells, layout.num_blocks, tables, stride, num_blocks,
                                                split.blocks_per_split, layout.gate_fraction_bits, out, staging, stats);
  status = cudaGetLastError();
  if (status != cudaSuccess) return static_cast<int>(status);
  ConvertGateStagingKernel<<<GridStrideBlocks(total), kThreads, 0, s>>>(staging, total, layout.gate_fraction_bits, out);
  return LastLaunchError();
}

int LaunchFinishDirectGate(unsigned long long* gate_acc, int64_t cells, const int32_t* slots, int num_requests,
                           float* out, unsigned long long* /*stats*/, void* stream) {
  FinishDirectGateKernel<<<GridStrideBlocks(cells * num_requests), kThreads, 0, AsStream(stream)>>>(
      gate_acc, cells, slots, num_requests, out);
  return LastLaunchError();
}

int LaunchSumBlocks(const BlockLayout& layout, const int32_t* tables, int64_t stride, const int32_t* num_blocks,
                    int num_requests, int max_num_blocks, bool out_int16, void* out, unsigned long long* staging,
                    int sm_count, unsigned long long* stats, void* stream) {
  switch (layout.counter_bytes) {
    case 1:
      return LaunchSumBlocksCounter<uint8_t>(layout, tables, stride, num_blocks, num_requests, max_num_blocks,
                                             out_int16, out, staging, sm_count, stats, AsStream(stream));
    case 2:
      return LaunchSumBlocksCounter<uint16_t>(layout, tables, stride, num_blocks, num_requests, max_num_blocks,
                                              out_int16, out, staging, sm_count, stats, AsStream(stream));
    default:
      return LaunchSumBlocksCounter<uint32_t>(layout, tables, stride, num_blocks, num_requests, max_num_blocks,
                                              out_int16, out, staging, sm_count, stats, AsStream(stream));
  }
}

int LaunchFinishDirect(uint32_t* acc, int64_t cells, const int32_t* slots, int num_requests, bool out_int16, void* out,
                       unsigned long long* stats, void* stream) {
  const int grid = GridStrideBlocks(cells * num_requests);
  if (out_int16) {
    FinishDirectKernel<int16_t>
        <<<grid, kThreads, 0, AsStream(stream)>>>(acc, cells, slots, num_requests, static_cast<int16_t*>(out), stats);
  } else {
    FinishDirectKernel<int32_t>
        <<<grid, kThreads, 0, AsStream(stream)>>>(acc, cells, slots, num_requests, static_cast<int32_t*>(out), stats);
  }
  return LastLaunchError();
}

}  // namespace eldr::capture::kernels
