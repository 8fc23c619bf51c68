#include "eldr/common/stable_hash.h"

namespace eldr {
namespace {

constexpr uint64_t kFnvOffsetBasis = 14695981039346656037ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

uint64_t Fnv1a64From(uint64_t state, absl::string_view bytes) {
  for (const char c : bytes) {
    state ^= static_cast<unsigned char>(c);
    state *= kFnvPrime;
  }
  return state;
}

}  // namespace

uint64_t Fnv1a64(absl::string_view bytes) { return Fnv1a64From(kFnvOffsetBasis, bytes); }

uint64_t Mix64(uint64_t value) {
  value ^= value >> 33;
  value *= 0xff51afd7ed558ccdull;
  value ^= value >> 33;
  value *= 0xc4ceb9fe1a85ec53ull;
  value ^= value >> 33;
  return value;
}

uint64_t StableHash64(absl::string_view bytes, uint64_t seed) {
  return Mix64(Fnv1a64From(kFnvOffsetBasis ^ Mix64(seed), bytes));
}

double StableUnitInterval(absl::string_view bytes, uint64_t seed) {
  return static_cast<double>(StableHash64(bytes, seed) >> 11) * 0x1.0p-53;
}

}  // namespace eldr
