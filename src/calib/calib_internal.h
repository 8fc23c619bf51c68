// Helpers shared by the calibration sources (not part of the public API).
#ifndef ELDR_CALIB_CALIB_INTERNAL_H_
#define ELDR_CALIB_CALIB_INTERNAL_H_

#include <chrono>
#include <cstdint>
#include <random>

namespace eldr {

// A uniform double in [0, 1) from the top 53 bits of one draw. Spelled out (rather than
// std::uniform_real_distribution, whose algorithm is implementation-defined) so that a seed gives
// the same calibration with every standard library.
inline double UniformUnit(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// Seconds elapsed since `start` on the monotonic clock.
inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace eldr

#endif  // ELDR_CALIB_CALIB_INTERNAL_H_
