// libFuzzer entry point of one fuzz target: compiled once per target with ELDR_FUZZ_BODY naming
// its body in fuzz_targets.h.
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_targets.h"

#ifndef ELDR_FUZZ_BODY
#error "ELDR_FUZZ_BODY must name the target's body, e.g. eldr::fuzz::FuzzPromText"
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) { return ELDR_FUZZ_BODY(data, size); }
