// Internal: the softmax of eldr_capture_record_gate_logits, shared by the CPU reference
// (capture_cpu.cc) and the CUDA kernels (capture_kernels.cu) so that both produce the same bits.
//
// Each token's probabilities are softmax(router_logits[t]) over all E experts, quantised to the
// fixed-point grid 2^-F. To make the quantised values identical on every device the computation uses
// no libm function: exp is a polynomial written with correctly rounded IEEE double operations
// (+, -, *, / and conversions), each one explicit. On the GPU they are the __d*_rn intrinsics, which
// the compiler never contracts into FMAs; on the host the files that include this header are compiled
// with -ffp-contract=off (src/capture/CMakeLists.txt). The order of the sum over experts is fixed
// (expert 0 first). Hence CPU and CUDA give the same quantised probability for every cell, and the
// fixed-point accumulators (integer adds) the same bits.
//
// Accuracy: DeterministicExp(x) is within 2^-50 relative of exp(x) for x in [-708, 0] (tested
// against std::exp); with the double sum over E terms and the division a probability is within
// d = (E + 10) * 2^-53 of the exact softmax p, so each quantised probability is round(p * 2^F), or
// one grid step away from it when p * 2^F lies within d * 2^F of a rounding boundary.
#ifndef ELDR_CUDA_GATE_SOFTMAX_H_
#define ELDR_CUDA_GATE_SOFTMAX_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ELDR_GATE_HD __host__ __device__
#else
#define ELDR_GATE_HD
#include <cmath>
#endif

namespace eldr::capture::internal {

// Element types of router logits (eldr_capture_logits_type).
inline constexpr int kLogitsFloat32 = 0;
inline constexpr int kLogitsBfloat16 = 1;
inline constexpr int kLogitsFloat16 = 2;

inline constexpr int LogitsTypeBytes(int type) { return type == kLogitsFloat32 ? 4 : 2; }

ELDR_GATE_HD inline double GateMul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
ELDR_GATE_HD inline double GateAdd(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
ELDR_GATE_HD inline double GateSub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
ELDR_GATE_HD inline double GateDiv(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
// Round to nearest integer, ties to even (the default rounding mode on the host).
ELDR_GATE_HD inline double GateRint(double x) {
#if defined(__CUDA_ARCH__)
  return rint(x);
#else
  return std::nearbyint(x);
#endif
}
ELDR_GATE_HD inline float GateBitsToFloat(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}
ELDR_GATE_HD inline double GatePow2(int k) {  // 2^k for k in [-1022, 1023]
  const uint64_t bits = static_cast<uint64_t>(k + 1023) << 52;
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
#endif
}

// One logit as float (exact for every type).
ELDR_GATE_HD inline float LoadLogit(const void* row, int type, int64_t e) {
  if (type == kLogitsFloat32) return static_cast<const float*>(row)[e];
  const uint32_t h = static_cast<const uint16_t*>(row)[e];
  if (type == kLogitsBfloat16) return GateBitsToFloat(h << 16);
  // IEEE binary16.
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return GateBitsToFloat(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * GateBitsToFloat(0x33800000u);  // 2^-24
    return sign != 0 ? -magnitude : magnitude;
  }
  return GateBitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

ELDR_GATE_HD inline bool LogitFinite(float x) { return x - x == 0.0f; }  // false for inf and NaN

// exp(x) for x <= 0; 0 below -708 (such a probability is far below any grid step).
ELDR_GATE_HD inline double DeterministicExp(double x) {
  if (!(x >= -708.0)) return 0.0;
  constexpr double kLog2e = 0x1.71547652b82fep+0;
  constexpr double kLn2Hi = 0x1.62e42fee00000p-1;  // 32 significant bits: k * kLn2Hi is exact
  constexpr double kLn2Lo = 0x1.a39ef35793c76p-33;
  const double k = GateRint(GateMul(x, kLog2e));
  // r = x - k ln2, |r| <= ~0.347.
  const double r = GateSub(GateSub(x, GateMul(k, kLn2Hi)), GateMul(k, kLn2Lo));
  // Taylor series to r^13 (truncation < 2^-56 relative), Horner.
  constexpr double kCoefficients[] = {
      0x1.6124613a86d09p-33, 0x1.1eed8eff8d898p-29, 0x1.ae64567f544e4p-26, 0x1.27e4fb7789f5cp-22, 0x1.71de3a556c734p-19,
      0x1.a01a01a01a01ap-16, 0x1.a01a01a01a01ap-13, 0x1.6c16c16c16c17p-10, 0x1.1111111111111p-7,  0x1.5555555555555p-5,
      0x1.5555555555555p-3,  0x1.0000000000000p-1,  0x1.0000000000000p+0,  0x1.0000000000000p+0};
  double p = kCoefficients[0];
  for (int i = 1; i < 14; ++i) p = GateAdd(GateMul(p, r), kCoefficients[i]);
  return GateMul(p, GatePow2(static_cast<int>(k)));
}

// The quantised softmax of one token's logits row (E values of `type`): calls add(e, q) with
// q = round(softmax(row)[e] * 2^fraction_bits) for every expert with q > 0. Returns false (and adds
// nothing) when a logit is not finite.
template <typename Add>
ELDR_GATE_HD inline bool QuantizedSoftmax(const void* row, int type, int experts, int fraction_bits, Add&& add) {
  float max = LoadLogit(row, type, 0);
  if (!LogitFinite(max)) return false;
  for (int e = 1; e < experts; ++e) {
    const float x = LoadLogit(row, type, e);
    if (!LogitFinite(x)) return false;
    if (x > max) max = x;
  }
  const double m = static_cast<double>(max);
  double sum = 0.0;
  for (int e = 0; e < experts; ++e) sum = GateAdd(sum, DeterministicExp(GateSub(LoadLogit(row, type, e), m)));
  const double scale = GatePow2(fraction_bits);
  for (int e = 0; e < experts; ++e) {
    // p <= 1 (the maximum's term is exactly 1 and every term is >= 0): q <= 2^fraction_bits.
    const double p = GateDiv(DeterministicExp(GateSub(LoadLogit(row, type, e), m)), sum);
    const uint32_t q = static_cast<uint32_t>(GateRint(GateMul(p, scale)));
    if (q != 0) add(e, q);
  }
  return true;
}

}  // namespace eldr::capture::internal

#endif  // ELDR_CUDA_GATE_SOFTMAX_H_
