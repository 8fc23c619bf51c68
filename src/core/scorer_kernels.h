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
#include <vector>

#include "absl/strings/string_view.h"

namespace eldr::internal {

enum class SimdLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The best level this CPU supports (cached after the first call). The environment variable
// ELDR_SIMD=scalar|avx2|avx512 (generic: scalar) lowers it (never raises it above what the CPU
// supports), so a machine can run and benchmark every path a smaller one would: the scorer's, the
// signature transform's and the refit window's kernels all follow it. Other values are ignored.
// The 8-bit dot products use VNNI where the CPU has it at the chosen level (AVX-512 VNNI; at the
// AVX2 level AVX-VNNI, as Intel's Xeon 6 E-core servers have without AVX-512): 255 query levels
// instead of 127. ELDR_VNNI=0 turns both off, so a VNNI machine also runs the path of one without
// (AMD Zen 2/3 at avx2, Skylake-SP at avx512).
SimdLevel DetectSimdLevel();
// What the CPU supports, ignoring ELDR_SIMD.
SimdLevel CpuSimdLevel();
absl::string_view SimdLevelName(SimdLevel level);  // "scalar", "avx2", "avx512"

// out[r] = sum_i rows[r][i] * query[i] for r in [0, n). `rows` holds n pointers to rows of `dim`
// elements (any alignment; 64-byte aligned rows are faster). n >= 0, dim >= 0.
using DotRowsF32Fn = void (*)(const float* const* rows, int n, const float* query, int dim, float* out);
using DotRowsF16Fn = void (*)(const uint16_t* const* rows, int n, const float* query, int dim, float* out);

// bfloat16 rows in the "paired" layout (PackBfloat16Row): ceil(dim / 32) blocks of 32 values,
// zero padded, in which 32-bit word j of a block holds value j in its low half and value j + 16
// in its high half. A bfloat16 in the high half of a word is already the float it stands for, and
// one in the low half is one shift away, so the scan needs no conversion instruction: that is why
// this format scans faster than binary16 (see docs/benchmarks.md).
using DotRowsBf16Fn = void (*)(const uint16_t* const* rows, int n, const float* query, int dim, float* out);

// Copies the columns of `in` (dim floats) whose bit is set in `masks` (bit i % 16 of masks[i / 16])
// to `out`, in order, and returns the sum of their squares. offsets[c] is the number of selected
// columns before chunk c (16 columns each): precomputed, so that the chunks' stores do not wait
// on each other. `out` must have room for the kept count plus 16 floats (the vector versions
// store whole registers). `kept` lists the same columns (the scalar version walks it).
using GatherColumnsFn = float (*)(const float* in, int dim, const uint16_t* masks, const int* offsets, const int* kept,
                                  int kept_count, float* out);

// out[j] = sum_c weights[c] * M[j][c] for j in [0, n): a small n x k matrix times a vector, the
// matrix stored transposed in panels of kPanelRows rows: panel p holds [k][kPanelRows] floats at
// panels + p * k * kPanelRows (64-byte aligned), entries of rows at or past n zero. Scores every
// centroid in the reduced space at once. Panels make the scan one sequential read: with the
// whole transpose ([k][n]) every axis was a jump of 4 KB at n = 1,024, which the hardware
// prefetcher does not follow. Writes out[0, n) only.
inline constexpr int kPanelRows = 64;
inline size_t PanelFloats(int n, int k) {
  return static_cast<size_t>((n + kPanelRows - 1) / kPanelRows) * kPanelRows * static_cast<size_t>(k);
}
// Element (row j, column c) of a panel layout.
inline size_t PanelIndex(int j, int c, int k) {
  return static_cast<size_t>(j / kPanelRows) * kPanelRows * static_cast<size_t>(k) +
         static_cast<size_t>(c) * kPanelRows + static_cast<size_t>(j % kPanelRows);
}
using AccumulatePanelsFn = void (*)(const float* panels, int k, int n, const float* weights, float* out);

// Expands a bitmap-sparse row: for i in [0, dim), out[i] = the next of `values` (in order) where
// bit i % 16 of words[i / 16] is set, else 0. `values` holds one float per set bit; it may lie in
// `out` itself at out + dim - (set bits), as every value is read before its slot is overwritten
// (the online refit window decodes its rows that way); elsewhere it must not overlap `out`. Bits
// at or beyond dim must be clear.
using ExpandBitmapFn = void (*)(const uint16_t* words, int dim, const float* values, float* out);

// The fused front of a route decision (SignatureTransform::ApplyKept): converts n int16
// little-endian counts at `src` (any alignment) to floats, times weights[i] (null: 1), ORs every
// count into *bits (a negative count sets its sign bit), and writes the values whose bit is set in
// `masks` (bit i % 16 of masks[i / 16]; bits at or beyond n clear) in order from out + offsets[c]
// for the values of chunk c (16 values each). Returns the sum of the squares of all n values and
// adds those of the written ones to *kept_sum; raises *kept_max to the largest written value.
// `out` needs 16 floats of room past the last written value (the vector versions store whole
// registers).
using ConvertGatherInt16Fn = float (*)(const char* src, const float* weights, int n, const uint16_t* masks,
                                       const int* offsets, float* out, float* kept_sum, float* kept_max, int32_t* bits);

// 8-bit scoring. Rows hold int8 values in [-127, 127] (one scale per row, kept by the index);
// the query is quantised per search to unsigned integers in [0, query_max] (QuantiseQueryFn).
// out[r] = sum_i query[i] * rows[r][i], exactly, in int32: `padded` is a multiple of 64, rows and
// query are zero past their length. padded * 255 * 127 must fit in int32 (padded <= 65,536).
using DotRowsU8S8Fn = void (*)(const int8_t* const* rows, int n, const uint8_t* query, int padded, int32_t* out);

// Quantises a non-negative query of dim floats, q[i] = in[i] * factor (each product rounded to
// float, as an in-place scaling would store it; factor 1: `in` itself), to out[i] = round(q[i] /
// scale) in [0, max_level], scale = max(q) / max_level (1 for an all-zero query), zero-padding
// out to `padded` (a multiple of 64, >= dim). Sets *scale, *residual_norm2 = sum (out[i] * scale -
// q[i])^2 and *quantised_norm2 = sum (out[i] * scale)^2, both accumulated in float lanes. When
// `scaled` is not null, also writes q into scaled[0, dim) (the later stages score it: one pass
// instead of scaling first; it must not overlap `in`). Returns false, writing nothing useful,
// when a value of q is negative or not finite (the caller scans in fp32). known_max >= 0: the
// caller guarantees every value of q lies in [0, known_max] (the fused transform knows it), so the
// checking pass is skipped and max(q) is taken as known_max.
using QuantiseQueryFn = bool (*)(const float* in, float factor, int dim, int padded, int max_level, float known_max,
                                 uint8_t* out, float* scaled, float* scale, float* residual_norm2,
                                 float* quantised_norm2);

// The largest magnitude bits (bits & 0x7fffffff) of n floats: their integer order is the order of
// |x|, with Inf and NaN above every finite value. 0 for n = 0.
using MaxMagnitudeBitsFn = uint32_t (*)(const float* in, size_t n);

// Encodes a row in binary16 both ways at once: halves[i] = FloatToHalf(in[i] * scale) for i in
// [0, dim); the bitmap of the non-zero halves ((h & 0x7fff) != 0) into words[0, ceil(dim / 16))
// (bit i % 16 of word i / 16, bits beyond dim clear); those halves in order into `values`, which
// needs room for dim + 16 (the vector version stores whole registers). Returns how many there are.
using EncodeHalvesFn = size_t (*)(const float* in, int dim, float scale, uint16_t* halves, uint16_t* words,
                                  uint16_t* values);

struct ScorerKernels {
  SimdLevel level = SimdLevel::kScalar;
  DotRowsF32Fn dot_rows_f32 = nullptr;
  DotRowsF16Fn dot_rows_f16 = nullptr;
  DotRowsBf16Fn dot_rows_bf16 = nullptr;
  GatherColumnsFn gather_columns = nullptr;
  AccumulatePanelsFn accumulate_panels = nullptr;
  ExpandBitmapFn expand_bitmap = nullptr;
  MaxMagnitudeBitsFn max_magnitude_bits = nullptr;
  EncodeHalvesFn encode_halves = nullptr;
  ConvertGatherInt16Fn convert_gather_int16 = nullptr;
  DotRowsU8S8Fn dot_rows_u8s8 = nullptr;
  QuantiseQueryFn quantise_query = nullptr;
  // The largest query level dot_rows_u8s8 takes: 255 where the product pairs are summed in 32 bits
  // (scalar, AVX-512 VNNI, AVX-VNNI), 127 where they are first summed in 16 bits (AVX2 and AVX-512
  // without VNNI: vpmaddubsw, 2 * 127 * 127 < 2^15, no saturation).
  int int8_query_max = 255;
  // The level and its VNNI use: "scalar", "avx2", "avx2+avx_vnni", "avx512", "avx512+vnni".
  const char* name = "scalar";
};

// Every 8-bit dot kernel this CPU can run, with its query_max and a name (tests and benchmarks:
// AVX2 and AVX-512 each have a VNNI and a non-VNNI version; KernelsFor picks VNNI where the CPU
// has it, unless ELDR_VNNI=0).
struct Int8DotKernel {
  const char* name;
  DotRowsU8S8Fn dot;
  int query_max;
};
std::vector<Int8DotKernel> AvailableInt8DotKernels();

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
// Exact (every binary16 value is a float; a NaN stays a NaN, F16C quiets a signalling one); F16C
// where the CPU has it. `in` and `out` must not overlap.
void HalvesToFloats(const uint16_t* in, size_t n, float* out);

// bfloat16 (the top 16 bits of a float), round to nearest even; NaN stays NaN.
uint16_t FloatToBfloat16(float value);
float Bfloat16ToFloat(uint16_t value);
// Elements a paired-layout bfloat16 row of `dim` values occupies: dim rounded up to 32.
inline int PairedBfloat16Elements(int dim) { return (dim + 31) / 32 * 32; }
// Writes `in` (dim floats) as one paired-layout row of PairedBfloat16Elements(dim) values.
void PackBfloat16Row(const float* in, int dim, uint16_t* out);
// Value i of a paired-layout row.
float PairedBfloat16At(const uint16_t* row, int i);

}  // namespace eldr::internal

#endif  // ELDR_CORE_SCORER_KERNELS_H_
