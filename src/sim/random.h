// Reproducible random numbers for the simulator.
//
// The standard distributions are implementation-defined (libstdc++ and libc++ differ), so the engine
// (xoshiro256**, seeded through SplitMix64) and the few distributions the simulator needs are
// written here: a run is identical for a given seed on every platform. Not thread-safe.
#ifndef ELDR_SIM_RANDOM_H_
#define ELDR_SIM_RANDOM_H_

#include <cmath>
#include <cstdint>
#include <utility>

namespace eldr::sim {

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (uint64_t& word : state_) {
      seed = Mix(seed);
      word = seed;
    }
  }
  // A generator for an independent purpose (stream), derived from a base seed by SplitMix64.
  static Rng ForStream(uint64_t seed, uint64_t stream) { return Rng(Mix(seed ^ Mix(stream + 1))); }

  uint64_t Next() {
    const uint64_t result = Rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = Rotl(state_[3], 45);
    return result;
  }
  // Uniform in [0, 1), 53 random bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n), n >= 1 (multiply-shift; bias below 2^-32 for the sizes used here).
  uint64_t Below(uint64_t n) { return static_cast<uint64_t>((static_cast<unsigned __int128>(Next()) * n) >> 64); }
  // Exponential with mean 1.
  double Exponential() { return -std::log1p(-Uniform()); }
  // Standard normal (Box-Muller, both values used).
  double Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = Uniform();
    while (u1 <= 0) u1 = Uniform();
    const double u2 = Uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    spare_ = radius * std::sin(2 * M_PI * u2);
    has_spare_ = true;
    return radius * std::cos(2 * M_PI * u2);
  }
  // Fisher-Yates shuffle.
  template <typename Vector>
  void Shuffle(Vector& values) {
    for (size_t i = values.size(); i > 1; --i) std::swap(values[i - 1], values[Below(i)]);
  }

  static uint64_t Mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

  uint64_t state_[4];
  bool has_spare_ = false;
  double spare_ = 0;
};

}  // namespace eldr::sim

#endif  // ELDR_SIM_RANDOM_H_
