// Dot-product kernels of the centroid index (private to eldr_core, also used by its tests and by
// eldr-microbench).
//
// One query (dim floats) against a set of rows given by pointers: contiguous centroid rows, a PCA
// matrix, or a gathered candidate subset all go through the same kernels. Rows are fp32 or IEEE
// half precision (binary16, stored as uint16_t); accumulation is always fp32.
//
// The instruction set is chosen at run time (CI and production machines differ): AVX-512
// (F + VL + BW for masked tails, with F16C/FMA), AVX2 + FMA + F16C, or a portable scalar version.
// Every level computes the same sums up to fp32 rounding order.
#ifndef ELDR_CORE_SCORER_KERNELS_H_
#define ELDR_CORE_SCORER_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace eldr::internal {

enum class SimdLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The best level this CPU supports (cached after the first call). The environment variable
// ELDR_SIMD=scalar|avx2|avx512 lowers it (never raises it above what the CPU supports), so a
// machine can reproduce what a smaller CI machine runs.
SimdLevel DetectSimdLevel();
// What the CPU supports, ignoring ELDR_SIMD.
SimdLevel CpuSimdLevel();
absl::string_view SimdLevelName(SimdLevel level);  // "scalar", "avx2", "avx512"

// out[r] = sum_i rows[r][i] * query[i] for r in [0, n). `rows` holds n pointers to rows of `dim`
// elements (any alignment; 64-byte aligned rows are faster). n >= 0, dim >= 0.
using DotRowsF32Fn = void (*)(const float* const* rows, int n, const float* query, int dim,
                              float* out);
using DotRowsF16Fn = void (*)(const uint16_t* const* rows, int n, const float* query, int dim,
                              float* out);

struct ScorerKernels {
  SimdLevel level = SimdLevel::kScalar;
  DotRowsF32Fn dot_rows_f32 = nullptr;
  DotRowsF16Fn dot_rows_f16 = nullptr;
};

// Kernels of `level`, which must not exceed CpuSimdLevel() (it is clamped to it).
const ScorerKernels& KernelsFor(SimdLevel level);
// KernelsFor(DetectSimdLevel()).
const ScorerKernels& BestKernels();

// Maximum number of fp32 additions on any path from a product to a row's final sum, over every
// kernel level: the n in the rounding-error bound gamma_n = n * 2^-24 of the accumulation.
int AccumulationDepth(int dim);

// IEEE binary16 conversions, round to nearest even; overflow becomes +-Inf, NaN stays NaN.
uint16_t FloatToHalf(float value);
float HalfToFloat(uint16_t half);
void FloatsToHalves(const float* in, size_t n, uint16_t* out);

}  // namespace eldr::internal

#endif  // ELDR_CORE_SCORER_KERNELS_H_
