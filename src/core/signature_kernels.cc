#include "core/signature_kernels.h"

#include "core/scorer_kernels.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace eldr::internal {
namespace {

// ---- Portable kernels --------------------------------------------------------------------------

double ConvertInt16Scalar(const char* src, const float* weights, float* dst, size_t n, int32_t* bits) {
  double sum = 0;
  int32_t acc_bits = 0;
  for (size_t i = 0; i < n; ++i) {
    int16_t c;
    std::memcpy(&c, src + 2 * i, sizeof(c));
    acc_bits |= c;
    const float v = static_cast<float>(c) * (weights != nullptr ? weights[i] : 1.f);
    dst[i] = v;
    sum += static_cast<double>(v) * v;
  }
  *bits |= acc_bits;
  return sum;
}

double ConvertInt32Scalar(const int32_t* src, const float* weights, float* dst, size_t n, int32_t* bits) {
  double sum = 0;
  int32_t acc_bits = 0;
  for (size_t i = 0; i < n; ++i) {
    acc_bits |= src[i];
    const float v = static_cast<float>(src[i]) * (weights != nullptr ? weights[i] : 1.f);
    dst[i] = v;
    sum += static_cast<double>(v) * v;
  }
  *bits |= acc_bits;
  return sum;
}

double ConvertFloatScalar(const float* src, float* dst, size_t n, int32_t* negatives) {
  double sum = 0;
  int32_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    const float v = src[i];
    count += v < 0.f ? 1 : 0;
    dst[i] = v;
    // float products, as the vector kernel: a NaN/Inf input yields a non-finite sum.
    sum += static_cast<double>(v * v);
  }
  *negatives += count;
  return sum;
}

void ScaleScalar(const float* in, size_t n, float factor, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = in[i] * factor;
}

int32_t OrInt16Scalar(const char* src, size_t n) {
  int32_t bits = 0;
  for (size_t i = 0; i < n; ++i) {
    int16_t c;
    std::memcpy(&c, src + 2 * i, sizeof(c));
    bits |= c;
  }
  return bits;
}

const SignatureKernels kScalar = {ConvertInt16Scalar, ConvertInt32Scalar, ConvertFloatScalar,
                                  ScaleScalar,        OrInt16Scalar,      "scalar"};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ELDR_HAVE_AVX2_KERNELS 1
#define ELDR_AVX2 __attribute__((target("avx2,fma")))

// Four independent 8-lane accumulators hide the FMA latency; 32 values per iteration.
ELDR_AVX2 inline double HorizontalSum(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  double total = 0;
  for (float lane : lanes) total += lane;
  return total;
}

ELDR_AVX2 int32_t HorizontalOr16(__m128i bits) {
  alignas(16) int16_t lanes[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), bits);
  int32_t out = 0;
  for (int16_t lane : lanes) out |= lane;
  return out;
}

ELDR_AVX2 int32_t HorizontalOr32(__m256i bits) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), bits);
  int32_t out = 0;
  for (int32_t lane : lanes) out |= lane;
  return out;
}

ELDR_AVX2 inline __m256 LoadInt16AsFloat(const char* src, __m128i* bits) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  *bits = _mm_or_si128(*bits, raw);
  return _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(raw));
}

ELDR_AVX2 double ConvertInt16Avx2(const char* src, const float* weights, float* dst, size_t n, int32_t* bits) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m128i or_bits = _mm_setzero_si128();
  size_t i = 0;
  if (weights != nullptr) {
    for (; i + 32 <= n; i += 32) {
      for (int k = 0; k < 4; ++k) {
        const size_t at = i + 8 * k;
        __m256 v = LoadInt16AsFloat(src + 2 * at, &or_bits);
        v = _mm256_mul_ps(v, _mm256_loadu_ps(weights + at));
        _mm256_storeu_ps(dst + at, v);
        acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
      }
    }
    for (; i + 8 <= n; i += 8) {
      __m256 v = LoadInt16AsFloat(src + 2 * i, &or_bits);
      v = _mm256_mul_ps(v, _mm256_loadu_ps(weights + i));
      _mm256_storeu_ps(dst + i, v);
      acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
    }
  } else {
    for (; i + 32 <= n; i += 32) {
      for (int k = 0; k < 4; ++k) {
        const size_t at = i + 8 * k;
        const __m256 v = LoadInt16AsFloat(src + 2 * at, &or_bits);
        _mm256_storeu_ps(dst + at, v);
        acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
      }
    }
    for (; i + 8 <= n; i += 8) {
      const __m256 v = LoadInt16AsFloat(src + 2 * i, &or_bits);
      _mm256_storeu_ps(dst + i, v);
      acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
    }
  }
  double sum = HorizontalSum(acc[0], acc[1], acc[2], acc[3]);
  int32_t tail_bits = 0;
  sum += ConvertInt16Scalar(src + 2 * i, weights != nullptr ? weights + i : nullptr, dst + i, n - i, &tail_bits);
  *bits |= HorizontalOr16(or_bits) | tail_bits;
  return sum;
}

ELDR_AVX2 double ConvertInt32Avx2(const int32_t* src, const float* weights, float* dst, size_t n, int32_t* bits) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256i or_bits = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      const size_t at = i + 8 * k;
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + at));
      or_bits = _mm256_or_si256(or_bits, raw);
      __m256 v = _mm256_cvtepi32_ps(raw);
      if (weights != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(weights + at));
      _mm256_storeu_ps(dst + at, v);
      acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
    }
  }
  double sum = HorizontalSum(acc[0], acc[1], acc[2], acc[3]);
  int32_t tail_bits = 0;
  sum += ConvertInt32Scalar(src + i, weights != nullptr ? weights + i : nullptr, dst + i, n - i, &tail_bits);
  *bits |= HorizontalOr32(or_bits) | tail_bits;
  return sum;
}

ELDR_AVX2 double ConvertFloatAvx2(const float* src, float* dst, size_t n, int32_t* negatives) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256 zero = _mm256_setzero_ps();
  int32_t count = 0;
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      const size_t at = i + 8 * k;
      const __m256 v = _mm256_loadu_ps(src + at);
      count += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_LT_OQ))));
      _mm256_storeu_ps(dst + at, v);
      acc[k] = _mm256_fmadd_ps(v, v, acc[k]);
    }
  }
  double sum = HorizontalSum(acc[0], acc[1], acc[2], acc[3]);
  sum += ConvertFloatScalar(src + i, dst + i, n - i, &count);
  *negatives += count;
  return sum;
}

ELDR_AVX2 void ScaleAvx2(const float* in, size_t n, float factor, float* out) {
  const __m256 f = _mm256_set1_ps(factor);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(in + i), f));
  for (; i < n; ++i) out[i] = in[i] * factor;
}

ELDR_AVX2 int32_t OrInt16Avx2(const char* src, size_t n) {
  __m256i bits = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    bits = _mm256_or_si256(bits, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i)));
  }
  // Fold the 16-bit lanes: OR the halves, then sign-extend each lane through HorizontalOr16.
  const __m128i folded = _mm_or_si128(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  return HorizontalOr16(folded) | OrInt16Scalar(src + 2 * i, n - i);
}

const SignatureKernels kAvx2 = {ConvertInt16Avx2, ConvertInt32Avx2, ConvertFloatAvx2, ScaleAvx2, OrInt16Avx2, "avx2"};

bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

}  // namespace

const SignatureKernels& ScalarSignatureKernels() { return kScalar; }

const SignatureKernels& Avx2SignatureKernelsIfSupported() {
#ifdef ELDR_HAVE_AVX2_KERNELS
  static const bool supported = CpuHasAvx2();
  if (supported) return kAvx2;
#endif
  return kScalar;
}

const SignatureKernels& BestSignatureKernels() {
  // One reading of ELDR_SIMD for every kernel family (DetectSimdLevel).
  static const SignatureKernels* const best = [] {
    if (DetectSimdLevel() == SimdLevel::kScalar) return &kScalar;
    return &Avx2SignatureKernelsIfSupported();
  }();
  return *best;
}

}  // namespace eldr::internal
