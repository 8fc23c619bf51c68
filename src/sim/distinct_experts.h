// Counting the distinct experts a decode batch loads, per MoE layer.
//
// Every token of a batch chooses top_k experts at each layer; the step loads the union of those
// choices. One bitmap of `experts` bits per layer, OR-ed token by token, then popcounts: a batch of
// B tokens costs B * layers * top_k bit sets. Not thread-safe; one counter per worker.
#ifndef ELDR_SIM_DISTINCT_EXPERTS_H_
#define ELDR_SIM_DISTINCT_EXPERTS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace eldr::sim {

class DistinctExpertCounter {
 public:
  // experts <= 256 (ids are uint8). layers, top_k >= 1.
  DistinctExpertCounter(int layers, int experts, int top_k);

  int layers() const { return layers_; }
  int experts() const { return experts_; }
  int top_k() const { return top_k_; }

  // Forgets every token added so far.
  void Reset();
  // Adds one token's choices: layers * top_k expert ids, row-major [layer][choice].
  void AddToken(const uint8_t* token_topk);
  // Distinct experts at `layer` over the tokens added since Reset.
  int DistinctAtLayer(int layer) const;
  // Sum over layers of DistinctAtLayer.
  int64_t DistinctAllLayers() const;

 private:
  int layers_;
  int experts_;
  int top_k_;
  int words_per_layer_;
  std::vector<uint64_t> bits_;  // layers * words_per_layer
};

}  // namespace eldr::sim

#endif  // ELDR_SIM_DISTINCT_EXPERTS_H_
