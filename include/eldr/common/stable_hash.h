// A fixed 64-bit hash for placement decisions that must agree across processes (eldr-proxy's prefill
// ring and A/B split, the engine emulator's prompt-to-trace mapping).
//
// absl::Hash is salted per process, so it cannot place the same key on the same instance in two
// proxy replicas, or after a restart. StableHash64 is FNV-1a 64 over the bytes, finished with the
// MurmurHash3 64-bit finaliser so that nearby inputs ("a#1", "a#2") spread over the whole range:
// the same bytes and seed give the same value in every process, build and platform.
//
// Thread-safety: pure functions.
#ifndef ELDR_COMMON_STABLE_HASH_H_
#define ELDR_COMMON_STABLE_HASH_H_

#include <cstdint>

#include "absl/strings/string_view.h"

namespace eldr {

// FNV-1a 64 of `bytes` (offset basis 14695981039346656037, prime 1099511628211), unmixed: the
// value the engine emulator uses to map a prompt without a trace marker.
uint64_t Fnv1a64(absl::string_view bytes);

// The MurmurHash3 fmix64 finaliser: a bijection on 64-bit values with full avalanche.
uint64_t Mix64(uint64_t value);

// Mix64 of the FNV-1a 64 of `bytes` started from (offset basis xor Mix64(seed)). Mix64(0) is 0, so
// with seed 0 this is Mix64(Fnv1a64(bytes)). Different seeds give independent-looking hashes.
uint64_t StableHash64(absl::string_view bytes, uint64_t seed = 0);

// StableHash64 mapped to [0, 1) with 53 bits of resolution.
double StableUnitInterval(absl::string_view bytes, uint64_t seed = 0);

}  // namespace eldr

#endif  // ELDR_COMMON_STABLE_HASH_H_
