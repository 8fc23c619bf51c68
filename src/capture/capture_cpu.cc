// The CPU reference backend: every operation of include/eldr/capture/capture.h, written as plainly as the
// semantics allow, with the same memory layout as the CUDA backend (capture_backend.h) so that the
// GPU tests compare per-block counts, statistics and finished counts bit for bit. Everything runs
// on the calling thread before the call returns; `stream` arguments are ignored.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "capture_backend.h"
#include "gate_softmax.h"

namespace eldr::capture::internal {
namespace {

constexpr uint32_t kDirectCounterMax = 0x7fffffffu;

// round(p * 2^fraction_bits), ties to even, for p in [0, 1]: the product is exact (a power of two
// scaling), so this is the one rounding, as __float2uint_rn does on the GPU.
uint32_t QuantizeGateProb(float p, int fraction_bits) {
  return static_cast<uint32_t>(std::nearbyint(std::ldexp(p, fraction_bits)));
}

// A fixed-point sum as float32: one rounding to nearest (uint64 -> float, __ull2float_rn on the
// GPU), then an exact scaling by 2^-fraction_bits.
float GateSumToFloat(uint64_t sum, int fraction_bits) { return std::ldexp(static_cast<float>(sum), -fraction_bits); }

template <typename Index>
const Index* Typed(const void* p) {
  return static_cast<const Index*>(p);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const Geometry& g)
      : g_(g),
        counts_(static_cast<size_t>(g.block_counts_bytes()), 0),
        bitmap_(static_cast<size_t>(g.bitmap_words()), 0),
        direct_(static_cast<size_t>(g.max_direct_requests * g.cells), 0),
        gate_(static_cast<size_t>(g.block_gate_bytes() / 4), 0),
        direct_gate_(static_cast<size_t>(g.direct_gate_bytes() / 8), 0),
        slots_(g.result_slots) {
    for (Slot& slot : slots_) {
      slot.counts.assign(static_cast<size_t>(g.max_finish_requests * g.cells * sizeof(int32_t)), 0);
    }
  }

  absl::Status Record(const RecordCall& call) override {
    const bool ids64 = call.id_type == IndexType::kInt64;
    const bool slots64 = call.index_type == IndexType::kInt64;
    if (ids64) {
      return slots64 ? RecordTyped<int64_t, int64_t>(call) : RecordTyped<int64_t, int32_t>(call);
    }
    return slots64 ? RecordTyped<int32_t, int64_t>(call) : RecordTyped<int32_t, int32_t>(call);
  }

  absl::Status ResetBatchBlocks(const void* slots, IndexType slot_type, int64_t num_tokens, void* /*stream*/) override {
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = LoadIndex(slots, slot_type, t);
      if (slot < 0 || slot >= g_.num_slots || slot % g_.block_size != 0) continue;
      const int64_t block = slot / g_.block_size;
      std::memset(&counts_[block * g_.block_stride_bytes], 0, g_.block_stride_bytes);
      const int64_t words = int64_t{g_.layers} * g_.bitmap_words_per_row;
      std::fill_n(&bitmap_[block * words], words, 0u);
      if (!gate_.empty()) std::fill_n(&gate_[block * g_.cells], g_.cells, 0u);
      ++stats_[kStatBlockResets];
    }
    return absl::OkStatus();
  }

  absl::Status RecordDirect(const RecordCall& call) override {
    for (int64_t t = 0; t < call.num_tokens; ++t) {
      const int64_t request = LoadIndex(call.index, call.index_type, t);
      if (request < 0) {
        ++stats_[kStatPadding];
        continue;
      }
      if (request >= g_.max_direct_requests) {
        ++stats_[kStatBadRequests];
        continue;
      }
      const int64_t row_cell = (request * g_.layers + call.layer) * g_.experts;
      uint32_t* row = &direct_[row_cell];
      if (call.logits != nullptr) AddSoftmax(call, t, &direct_gate_[row_cell], kDirectGateFractionBits);
      for (int j = 0; j < call.top_k; ++j) {
        const int64_t expert = LoadIndex(call.topk_ids, call.id_type, t * call.top_k + j);
        if (expert >= 0 && expert < g_.experts && call.weights != nullptr) {
          const float p = call.weights[t * call.top_k + j];
          if (GateProbInRange(p)) {
            direct_gate_[row_cell + expert] += QuantizeGateProb(p, kDirectGateFractionBits);
          } else {
            ++stats_[kStatBadGateProbs];
          }
        }
        if (expert < 0 || expert >= g_.experts) {
          ++stats_[kStatBadExpertIds];
        } else if (row[expert] >= kDirectCounterMax) {
          ++stats_[kStatSaturatedAdds];
        } else {
          ++row[expert];
          ++stats_[kStatRecorded];
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status FinishBlocks(int slot, const int32_t* block_tables, int64_t stride,
                            absl::Span<const int32_t> num_blocks_per_request, OutputType output_type,
                            void* /*stream*/) override {
    if (absl::Status s = CheckHostTables(num_blocks_per_request); !s.ok()) return s;
    std::vector<uint64_t> sums(static_cast<size_t>(g_.cells));
    const int num_requests = static_cast<int>(num_blocks_per_request.size());
    for (int r = 0; r < num_requests; ++r) {
      std::fill(sums.begin(), sums.end(), 0);
      for (int j = 0; j < num_blocks_per_request[r]; ++j) {
        const int32_t block = block_tables[r * stride + j];
        if (block < 0 || block >= g_.num_blocks) {
          ++stats_[kStatBadBlockIds];
          continue;
        }
        AddBlock(&counts_[block * g_.block_stride_bytes], sums);
      }
      WriteOutput(slot, r, sums, output_type);
    }
    slots_[slot].stats = StatsFromArray(stats_);
    return absl::OkStatus();
  }

  absl::Status FinishDirect(int slot, absl::Span<const int32_t> request_slots, OutputType output_type,
                            void* /*stream*/) override {
    std::vector<uint64_t> values(static_cast<size_t>(g_.cells));
    for (size_t r = 0; r < request_slots.size(); ++r) {
      uint32_t* row = &direct_[request_slots[r] * g_.cells];
      std::copy(row, row + g_.cells, values.begin());
      std::fill(row, row + g_.cells, 0u);
      WriteOutput(slot, static_cast<int>(r), values, output_type);
    }
    slots_[slot].stats = StatsFromArray(stats_);
    return absl::OkStatus();
  }

  absl::Status FinishGateBlocks(int slot, const int32_t* block_tables, int64_t stride,
                                absl::Span<const int32_t> num_blocks_per_request, void* /*stream*/) override {
    if (absl::Status s = CheckHostTables(num_blocks_per_request); !s.ok()) return s;
    std::vector<uint64_t> sums(static_cast<size_t>(g_.cells));
    float* out = reinterpret_cast<float*>(slots_[slot].counts.data());
    for (size_t r = 0; r < num_blocks_per_request.size(); ++r) {
      std::fill(sums.begin(), sums.end(), 0);
      for (int j = 0; j < num_blocks_per_request[r]; ++j) {
        const int32_t block = block_tables[r * stride + j];
        if (block < 0 || block >= g_.num_blocks) {
          ++stats_[kStatBadBlockIds];
          continue;
        }
        const uint32_t* cells = &gate_[block * g_.cells];
        for (int64_t c = 0; c < g_.cells; ++c) sums[c] += cells[c];
      }
      for (int64_t c = 0; c < g_.cells; ++c) {
        out[r * g_.cells + c] = GateSumToFloat(sums[c], g_.gate_fraction_bits);
      }
    }
    slots_[slot].stats = StatsFromArray(stats_);
    return absl::OkStatus();
  }

  absl::Status FinishGateDirect(int slot, absl::Span<const int32_t> request_slots, void* /*stream*/) override {
    float* out = reinterpret_cast<float*>(slots_[slot].counts.data());
    for (size_t r = 0; r < request_slots.size(); ++r) {
      uint64_t* row = &direct_gate_[request_slots[r] * g_.cells];
      for (int64_t c = 0; c < g_.cells; ++c) {
        out[r * g_.cells + c] = GateSumToFloat(row[c], kDirectGateFractionBits);
        row[c] = 0;
      }
    }
    slots_[slot].stats = StatsFromArray(stats_);
    return absl::OkStatus();
  }

  absl::StatusOr<bool> SlotReady(int /*slot*/) const override { return true; }
  absl::Status WaitSlot(int /*slot*/) override { return absl::OkStatus(); }
  const void* SlotCounts(int slot) const override { return slots_[slot].counts.data(); }
  Stats SlotStats(int slot) const override { return slots_[slot].stats; }

  absl::Status Clear(void* /*stream*/) override {
    std::fill(counts_.begin(), counts_.end(), 0);
    std::fill(bitmap_.begin(), bitmap_.end(), 0u);
    std::fill(direct_.begin(), direct_.end(), 0u);
    std::fill(gate_.begin(), gate_.end(), 0u);
    std::fill(direct_gate_.begin(), direct_gate_.end(), uint64_t{0});
    return absl::OkStatus();
  }

  absl::StatusOr<Stats> ReadStats(void* /*stream*/) override { return StatsFromArray(stats_); }

  absl::Status ResetStats(void* /*stream*/) override {
    std::fill(std::begin(stats_), std::end(stats_), 0);
    return absl::OkStatus();
  }

  absl::Status ReadBlockCounts(int64_t first_block, int64_t num_blocks, int32_t* out, void* /*stream*/) override {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* counters = &counts_[(first_block + b) * g_.block_stride_bytes];
      for (int64_t c = 0; c < g_.cells; ++c) {
        out[b * g_.cells + c] = static_cast<int32_t>(LoadCounter(counters, g_.counter_bytes, c));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ReadDirectCounts(int first_slot, int num_slots, int32_t* out, void* /*stream*/) override {
    const uint32_t* begin = &direct_[first_slot * g_.cells];
    std::transform(begin, begin + num_slots * g_.cells, out, [](uint32_t v) { return static_cast<int32_t>(v); });
    return absl::OkStatus();
  }

  uint64_t device_bytes() const override { return 0; }
  uint64_t host_bytes() const override {
    uint64_t bytes = counts_.size() + bitmap_.size() * sizeof(uint32_t) + direct_.size() * sizeof(uint32_t) +
                     gate_.size() * sizeof(uint32_t) + direct_gate_.size() * sizeof(uint64_t);
    for (const Slot& slot : slots_) bytes += slot.counts.size();
    return bytes;
  }

 private:
  struct Slot {
    std::vector<uint8_t> counts;
    Stats stats;
  };

  // Host block tables are limited to max_blocks_per_request on both devices (the CUDA backend
  // stages them in pinned memory of that size), so both behave alike.
  absl::Status CheckHostTables(absl::Span<const int32_t> num_blocks_per_request) const {
    for (size_t r = 0; r < num_blocks_per_request.size(); ++r) {
      if (num_blocks_per_request[r] > g_.max_blocks_per_request) {
        return absl::InvalidArgumentError(
            absl::StrCat("finish: request ", r, " has ", num_blocks_per_request[r],
                         " blocks, more than options.max_blocks_per_request = ", g_.max_blocks_per_request,
                         " allows for block tables in host memory"));
      }
    }
    return absl::OkStatus();
  }

  // Adds token t's quantised softmax over all experts (gate_softmax.h) to `cells` [E]; a row with a
  // non-finite logit adds nothing and counts one bad_gate_probs.
  template <typename Cell>
  void AddSoftmax(const RecordCall& call, int64_t t, Cell* cells, int fraction_bits) {
    const void* row =
        static_cast<const uint8_t*>(call.logits) + t * call.logits_stride * LogitsTypeBytes(call.logits_type);
    if (!QuantizedSoftmax(row, call.logits_type, g_.experts, fraction_bits,
                          [&](int e, uint32_t q) { cells[e] += q; })) {
      ++stats_[kStatBadGateProbs];
    }
  }

  static int64_t LoadIndex(const void* array, IndexType type, int64_t i) {
    return type == IndexType::kInt64 ? Typed<int64_t>(array)[i] : Typed<int32_t>(array)[i];
  }

  void AddToCounter(uint8_t* counters, int64_t cell) {
    switch (g_.counter_bytes) {
      case 1:
        ++counters[cell];
        break;
      case 2: {
        uint16_t v;
        std::memcpy(&v, counters + cell * 2, 2);
        ++v;
        std::memcpy(counters + cell * 2, &v, 2);
        break;
      }
      default: {
        uint32_t v;
        std::memcpy(&v, counters + cell * 4, 4);
        ++v;
        std::memcpy(counters + cell * 4, &v, 4);
        break;
      }
    }
  }

  template <typename Id, typename SlotIndex>
  absl::Status RecordTyped(const RecordCall& call) {
    const Id* ids = Typed<Id>(call.topk_ids);
    const SlotIndex* slots = Typed<SlotIndex>(call.index);
    const int64_t row_offset = int64_t{call.layer} * g_.experts * g_.counter_bytes;
    const int words = g_.bitmap_words_per_row;
    auto bitmap_row = [&](int64_t block) { return &bitmap_[(block * g_.layers + call.layer) * words]; };
    // Resets first, so that every add of the batch lands after them whatever the token order.
    if (call.reset) {
      for (int64_t t = 0; t < call.num_tokens; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= g_.num_slots || slot % g_.block_size != 0) continue;
        const int64_t block = slot / g_.block_size;
        std::memset(&counts_[block * g_.block_stride_bytes + row_offset], 0,
                    static_cast<size_t>(g_.experts) * g_.counter_bytes);
        std::fill_n(bitmap_row(block), words, 0u);
        if (!gate_.empty()) std::fill_n(&gate_[block * g_.cells + int64_t{call.layer} * g_.experts], g_.experts, 0u);
        ++stats_[kStatBlockResets];
      }
    }
    for (int64_t t = 0; t < call.num_tokens; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) {
        ++stats_[kStatPadding];
        continue;
      }
      if (slot >= g_.num_slots) {
        ++stats_[kStatBadSlots];
        continue;
      }
      const int64_t block = slot / g_.block_size;
      const int64_t offset = slot % g_.block_size;
      uint32_t& word = bitmap_row(block)[offset / 32];
      const uint32_t bit = 1u << (offset % 32);
      if (word & bit) {
        ++stats_[kStatDuplicateSlots];
        continue;
      }
      word |= bit;
      uint8_t* row = &counts_[block * g_.block_stride_bytes + row_offset];
      uint32_t* gate_row =
          call.weights != nullptr ? &gate_[block * g_.cells + int64_t{call.layer} * g_.experts] : nullptr;
      if (call.logits != nullptr) {
        AddSoftmax(call, t, &gate_[block * g_.cells + int64_t{call.layer} * g_.experts], g_.gate_fraction_bits);
      }
      for (int j = 0; j < call.top_k; ++j) {
        const int64_t expert = ids[t * call.top_k + j];
        if (expert < 0 || expert >= g_.experts) {
          ++stats_[kStatBadExpertIds];
          continue;
        }
        AddToCounter(row, expert);
        ++stats_[kStatRecorded];
        if (gate_row != nullptr) {
          const float p = call.weights[t * call.top_k + j];
          if (GateProbInRange(p)) {
            gate_row[expert] += QuantizeGateProb(p, g_.gate_fraction_bits);
          } else {
            ++stats_[kStatBadGateProbs];
          }
        }
      }
    }
    return absl::OkStatus();
  }

  // sums[c] += counter c of the block (little-endian counters, as on the GPU).
  void AddBlock(const uint8_t* counters, std::vector<uint64_t>& sums) const {
    switch (g_.counter_bytes) {
      case 1:
        AddTyped<uint8_t>(counters, sums);
        break;
      case 2:
        AddTyped<uint16_t>(counters, sums);
        break;
      default:
        AddTyped<uint32_t>(counters, sums);
        break;
    }
  }

  template <typename Counter>
  void AddTyped(const uint8_t* counters, std::vector<uint64_t>& sums) const {
    uint64_t* out = sums.data();
    for (int64_t c = 0; c < g_.cells; ++c) {
      Counter value;
      std::memcpy(&value, counters + c * sizeof(Counter), sizeof(Counter));
      out[c] += value;
    }
  }

  void WriteOutput(int slot, int request, const std::vector<uint64_t>& values, OutputType output_type) {
    uint8_t* base = slots_[slot].counts.data();
    if (output_type == OutputType::kInt16) {
      int16_t* out = reinterpret_cast<int16_t*>(base) + request * g_.cells;
      for (int64_t c = 0; c < g_.cells; ++c) {
        if (values[c] > 32767) ++stats_[kStatSaturatedOutputs];
        out[c] = static_cast<int16_t>(std::min<uint64_t>(values[c], 32767));
      }
    } else {
      int32_t* out = reinterpret_cast<int32_t*>(base) + request * g_.cells;
      for (int64_t c = 0; c < g_.cells; ++c) {
        if (values[c] > 2147483647u) ++stats_[kStatSaturatedOutputs];
        out[c] = static_cast<int32_t>(std::min<uint64_t>(values[c], 2147483647u));
      }
    }
  }

  const Geometry g_;
  std::vector<uint8_t> counts_;
  std::vector<uint32_t> bitmap_;
  std::vector<uint32_t> direct_;
  std::vector<uint32_t> gate_;         // [num_blocks][L][E] fixed point (record_gate_probs)
  std::vector<uint64_t> direct_gate_;  // [max_direct_requests][L][E] fixed point
  std::vector<Slot> slots_;
  uint64_t stats_[kNumStats] = {};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(const Geometry& geometry) {
  try {
    return std::unique_ptr<Backend>(new CpuBackend(geometry));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("capture: cannot allocate the CPU context's counters (host memory)");
  }
}

}  // namespace eldr::capture::internal
