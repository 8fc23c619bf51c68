#include "sim/distinct_experts.h"

#include <algorithm>
#include <bit>

namespace eldr::sim {

DistinctExpertCounter::DistinctExpertCounter(int layers, int experts, int top_k)
    : layers_(layers),
      experts_(experts),
      top_k_(top_k),
      words_per_layer_((experts + 63) / 64),
      bits_(static_cast<size_t>(layers) * words_per_layer_, 0) {}

void DistinctExpertCounter::Reset() { std::fill(bits_.begin(), bits_.end(), 0); }

void DistinctExpertCounter::AddToken(const uint8_t* token_topk) {
  uint64_t* layer_bits = bits_.data();
  for (int l = 0; l < layers_; ++l, layer_bits += words_per_layer_) {
    for (int c = 0; c < top_k_; ++c) {
      const unsigned expert = *token_topk++;
      layer_bits[expert >> 6] |= uint64_t{1} << (expert & 63);
    }
  }
}

int DistinctExpertCounter::DistinctAtLayer(int layer) const {
  const uint64_t* layer_bits = bits_.data() + static_cast<size_t>(layer) * words_per_layer_;
  int count = 0;
  for (int w = 0; w < words_per_layer_; ++w) count += std::popcount(layer_bits[w]);
  return count;
}

int64_t DistinctExpertCounter::DistinctAllLayers() const {
  int64_t count = 0;
  for (uint64_t word : bits_) count += std::popcount(word);
  return count;
}

}  // namespace eldr::sim
