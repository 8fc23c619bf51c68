#include "calib/synthetic_data.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "calib/calib_internal.h"

namespace eldr {
namespace {

// xorshift64*: fast, and plenty for noise.
struct NoiseSource {
  uint64_t state;
  uint64_t Next() {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return state * 0x2545F4914F6CDD1DULL;
  }
};

void FillCounts(const std::vector<int32_t>& profile, NoiseSource& noise, int32_t* out, size_t cells) {
  uint64_t bits = 0;
  int left = 0;
  for (size_t c = 0; c < cells; ++c) {
    if (left == 0) {
      bits = noise.Next();
      left = 32;
    }
    out[c] = profile[c] + static_cast<int32_t>(bits & 3);
    bits >>= 2;
    --left;
  }
}

}  // namespace

CalibrationData MakeSyntheticCalibrationData(const SyntheticDataOptions& options) {
  CalibrationData data;
  data.layers = options.layers;
  data.experts = options.experts;
  data.n = options.requests;
  const size_t cells = static_cast<size_t>(options.layers) * options.experts;
  std::mt19937_64 rng(options.seed);

  // Domain profiles: per layer, a seeded choice of hot experts with base counts 4..7.
  std::vector<std::vector<int32_t>> profiles(options.domains, std::vector<int32_t>(cells, 0));
  std::vector<int> experts(options.experts);
  const int hot = std::min(options.hot_experts, options.experts);
  for (auto& profile : profiles) {
    for (int l = 0; l < options.layers; ++l) {
      std::iota(experts.begin(), experts.end(), 0);
      for (int h = 0; h < hot; ++h) {
        const int j = h + std::min(static_cast<int>(UniformUnit(rng) * (options.experts - h)), options.experts - h - 1);
        std::swap(experts[h], experts[j]);
        profile[static_cast<size_t>(l) * options.experts + experts[h]] = 4 + static_cast<int32_t>(rng() % 4);
      }
    }
  }
  for (int d = 0; d < options.domains; ++d) data.label_names.push_back("domain" + std::to_string(d));

  data.labels.resize(data.n);
  data.prefill_counts.resize(cells * data.n);
  if (options.decode_counts) data.decode_counts.resize(cells * data.n);
  NoiseSource noise{options.seed * 0x9E3779B97F4A7C15ULL + 1};
  for (int r = 0; r < data.n; ++r) {
    const int domain = std::min(static_cast<int>(UniformUnit(rng) * options.domains), options.domains - 1);
    data.labels[r] = domain;
    FillCounts(profiles[domain], noise, data.prefill_counts.data() + r * cells, cells);
    if (options.decode_counts) {
      FillCounts(profiles[domain], noise, data.decode_counts.data() + r * cells, cells);
    }
  }
  return data;
}

}  // namespace eldr
