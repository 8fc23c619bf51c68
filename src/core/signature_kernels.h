// The inner loops of SignatureTransform (private to eldr_core; tests compare the levels).
//
// Each kernel converts one contiguous run of raw values, multiplies by the weights (when given),
// writes the result, and returns its squared L2 norm, while folding the values into a bad-input
// indicator. An AVX2 + FMA version is chosen at run time when the CPU has it (the x86-64 baseline
// has neither); ELDR_SIMD=scalar (or generic) forces the portable one (see DetectSimdLevel).
#ifndef ELDR_CORE_SIGNATURE_KERNELS_H_
#define ELDR_CORE_SIGNATURE_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace eldr::internal {

struct SignatureKernels {
  // int16 little-endian counts at `src` (any alignment). ORs every count into *bits, so a
  // negative count sets its sign bit.
  double (*convert_int16)(const char* src, const float* weights, float* dst, size_t n, int32_t* bits);
  // int32 counts; as above.
  double (*convert_int32)(const int32_t* src, const float* weights, float* dst, size_t n, int32_t* bits);
  // Floats (no weights); adds the number of negative values to *negatives. A NaN or Inf makes the
  // returned sum non-finite.
  double (*convert_float)(const float* src, float* dst, size_t n, int32_t* negatives);
  // out[i] = in[i] * factor for i in [0, n); `out` may be `in` (in place), else they must not
  // overlap.
  void (*scale)(const float* in, size_t n, float factor, float* out);
  // OR of n int16 counts (layers outside the mask are still checked for negatives).
  int32_t (*or_int16)(const char* src, size_t n);
  const char* name;  // "avx2" or "scalar"
};

const SignatureKernels& ScalarSignatureKernels();
// The AVX2 kernels when the CPU supports AVX2 and FMA, otherwise the scalar ones.
const SignatureKernels& Avx2SignatureKernelsIfSupported();
// What SignatureTransform uses: the AVX2 kernels when supported, unless DetectSimdLevel() is
// scalar (ELDR_SIMD=scalar or generic).
const SignatureKernels& BestSignatureKernels();

}  // namespace eldr::internal

#endif  // ELDR_CORE_SIGNATURE_KERNELS_H_
