#include "core/scorer_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

namespace eldr::internal {
namespace {

// ---- Scalar -------------------------------------------------------------------------------------
// Eight interleaved partial sums per row: the same accumulation depth as the vector kernels'
// lanes, and independent dependency chains for the compiler.
template <typename Load>
float ScalarDot(Load load, const float* query, int dim) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= dim; i += 8) {
    for (int lane = 0; lane < 8; ++lane) partial[lane] += load(i + lane) * query[i + lane];
  }
  for (int lane = 0; i < dim; ++i, ++lane) partial[lane] += load(i) * query[i];
  return ((partial[0] + partial[4]) + (partial[2] + partial[6])) +
         ((partial[1] + partial[5]) + (partial[3] + partial[7]));
}

void DotRowsF32Scalar(const float* const* rows, int n, const float* query, int dim, float* out) {
  for (int r = 0; r < n; ++r) {
    const float* row = rows[r];
    out[r] = ScalarDot([row](int i) { return row[i]; }, query, dim);
  }
}

void DotRowsF16Scalar(const uint16_t* const* rows, int n, const float* query, int dim, float* out) {
  for (int r = 0; r < n; ++r) {
    const uint16_t* row = rows[r];
    out[r] = ScalarDot([row](int i) { return HalfToFloat(row[i]); }, query, dim);
  }
}

void DotRowsBf16Scalar(const uint16_t* const* rows, int n, const float* query, int dim, float* out) {
  for (int r = 0; r < n; ++r) {
    const uint16_t* row = rows[r];
    out[r] = ScalarDot([row](int i) { return PairedBfloat16At(row, i); }, query, dim);
  }
}

float GatherColumnsScalar(const float* in, int /*dim*/, const uint16_t* /*masks*/, const int* /*offsets*/,
                          const int* kept, int kept_count, float* out) {
  float sum = 0;
  for (int i = 0; i < kept_count; ++i) {
    const float v = in[kept[i]];
    out[i] = v;
    sum += v * v;
  }
  return sum;
}

float ConvertGatherInt16Scalar(const char* src, const float* weights, int n, const uint16_t* masks, const int* offsets,
                               float* out, float* kept_sum, float* kept_max, int32_t* bits) {
  double full = 0, kept = 0;
  float largest = *kept_max;
  int32_t acc = 0;
  for (int c = 0; 16 * c < n; ++c) {
    int pos = offsets[c];
    const int end = std::min(n, 16 * c + 16);
    for (int i = 16 * c; i < end; ++i) {
      int16_t count;
      std::memcpy(&count, src + 2 * i, sizeof(count));
      acc |= count;
      const float v = static_cast<float>(count) * (weights != nullptr ? weights[i] : 1.f);
      full += static_cast<double>(v) * v;
      if ((masks[c] >> (i & 15)) & 1) {
        out[pos++] = v;
        kept += static_cast<double>(v) * v;
        largest = std::max(largest, v);
      }
    }
  }
  *bits |= acc;
  *kept_sum += static_cast<float>(kept);
  *kept_max = largest;
  return static_cast<float>(full);
}

void DotRowsU8S8Scalar(const int8_t* const* rows, int n, const uint8_t* query, int padded, int32_t* out) {
  for (int r = 0; r < n; ++r) {
    const int8_t* row = rows[r];
    int32_t sum = 0;
    for (int i = 0; i < padded; ++i) sum += static_cast<int32_t>(query[i]) * row[i];
    out[r] = sum;
  }
}

bool QuantiseQueryScalar(const float* in, float factor, int dim, int padded, int max_level, float known_max,
                         uint8_t* out, float* scaled, float* scale, float* residual_norm2, float* quantised_norm2) {
  float largest = known_max;
  if (!(known_max >= 0.f)) {
    largest = 0;
    for (int i = 0; i < dim; ++i) {
      const float v = in[i] * factor;
      if (!(v >= 0.f) || !std::isfinite(v)) return false;
      largest = std::max(largest, v);
    }
  }
  const float step = largest > 0 ? largest / static_cast<float>(max_level) : 1.f;
  const float inverse = 1.f / step;
  float residual = 0, quantised = 0;
  for (int i = 0; i < dim; ++i) {
    const float v = in[i] * factor;
    if (scaled != nullptr) scaled[i] = v;
    const int level = std::min(max_level, static_cast<int>(std::nearbyint(v * inverse)));
    out[i] = static_cast<uint8_t>(level);
    const float value = static_cast<float>(level) * step;
    residual += (value - v) * (value - v);
    quantised += value * value;
  }
  std::memset(out + dim, 0, static_cast<size_t>(padded - dim));
  *scale = step;
  *residual_norm2 = residual;
  *quantised_norm2 = quantised;
  return true;
}

void AccumulatePanelsScalar(const float* panels, int k, int n, const float* weights, float* out) {
  for (int j0 = 0; j0 < n; j0 += kPanelRows) {
    const float* panel = panels + static_cast<size_t>(j0) * k;
    const int count = std::min(kPanelRows, n - j0);
    for (int j = 0; j < count; ++j) out[j0 + j] = 0.f;
    for (int c = 0; c < k; ++c) {
      const float w = weights[c];
      const float* column = panel + static_cast<size_t>(c) * kPanelRows;
      for (int j = 0; j < count; ++j) out[j0 + j] += w * column[j];
    }
  }
}

// Set bits in order; the zeros between them are written as the scan passes them, so a value
// converted into the tail of `out` is always read before its slot is reached.
void ExpandBitmapScalar(const uint16_t* words, int dim, const float* values, float* out) {
  int next = 0;  // entries below this are written
  for (int w = 0; w * 16 < dim; ++w) {
    for (uint32_t bits = words[w]; bits != 0; bits &= bits - 1) {
      const int index = w * 16 + __builtin_ctz(bits);
      const float value = *values++;
      for (; next < index; ++next) out[next] = 0.f;
      out[index] = value;
      next = index + 1;
    }
  }
  for (; next < dim; ++next) out[next] = 0.f;
}

uint32_t MaxMagnitudeBitsScalar(const float* in, size_t n) {
  uint32_t max_bits = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, in + i, sizeof(bits));
    max_bits = std::max(max_bits, bits & 0x7fffffffu);
  }
  return max_bits;
}

// The bitmap and the non-zero halves of halves[0, dim), without branches: every half is written,
// and the write position advances past the non-zero ones only.
size_t PackNonZeroHalves(const uint16_t* halves, int dim, uint16_t* words, uint16_t* values) {
  size_t count = 0;
  for (int w = 0; w * 16 < dim; ++w) {
    uint32_t bits = 0;
    const int end = std::min(dim, w * 16 + 16);
    for (int i = w * 16; i < end; ++i) {
      const uint32_t set = (halves[i] & 0x7fffu) != 0 ? 1u : 0u;
      values[count] = halves[i];
      count += set;
      bits |= set << (i - w * 16);
    }
    words[w] = static_cast<uint16_t>(bits);
  }
  return count;
}

size_t EncodeHalvesScalar(const float* in, int dim, float scale, uint16_t* halves, uint16_t* words, uint16_t* values) {
  for (int i = 0; i < dim; ++i) halves[i] = FloatToHalf(in[i] * scale);
  return PackNonZeroHalves(halves, dim, words, values);
}

// ---- AVX2 + FMA + F16C --------------------------------------------------------------------------
// Four rows at a time so each query chunk is loaded once for four rows; two accumulators per row
// hide the FMA latency. The rows stream from L2/L3, which is what bounds these kernels.
// Runs `blocks` (a kernel body that handles rows in groups of 4) on n rows: the last group is
// padded with copies of the last row, whose results are dropped, so no row falls back to the
// scalar loop (at 4.5k columns one scalar bfloat16 row costs as much as 16 vector ones).
template <typename Row, typename Out, typename Blocks>
void InGroupsOf4(const Blocks& blocks, const Row* const* rows, int n, Out* out) {
  const int whole = n & ~3;
  if (whole > 0) blocks(rows, whole, out);
  if (whole == n) return;
  const Row* tail[4];
  Out tail_out[4];
  for (int k = 0; k < 4; ++k) tail[k] = rows[std::min(whole + k, n - 1)];
  blocks(tail, 4, tail_out);
  for (int k = 0; whole + k < n; ++k) out[whole + k] = tail_out[k];
}

// Runs `block` on n rows in blocks of 4, then one of 2 and one of 1 for the rest: block(rows_per_block,
// rows, out) scores rows_per_block (a std::integral_constant: 4, 2 or 1) rows. For kernels whose
// per-row sums are chains of dependent FMAs or dot instructions: each block size unrolls its loop
// so that it keeps as many independent sums as a block of 4, where a tail padded to 4 rows (as
// InGroupsOf4 does) did up to four times the work at the same speed. The 8-bit stage leaves 1-3
// rows to score again in bfloat16 on most decisions, so that tail is the common case there.
template <typename Row, typename Out, typename Block>
void InBlocksOf4Then2Then1(const Block& block, const Row* const* rows, int n, Out* out) {
  int r = 0;
  for (; r + 4 <= n; r += 4) block(std::integral_constant<int, 4>{}, rows + r, out + r);
  if (n - r >= 2) {
    block(std::integral_constant<int, 2>{}, rows + r, out + r);
    r += 2;
  }
  if (r < n) block(std::integral_constant<int, 1>{}, rows + r, out + r);
}

#define ELDR_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

ELDR_TARGET_AVX2 inline float HorizontalSumAvx2(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

ELDR_TARGET_AVX2 inline __m256 LoadAvx2(const float* p) { return _mm256_loadu_ps(p); }
ELDR_TARGET_AVX2 inline __m256 LoadAvx2(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float LoadScalar(const float* p) { return *p; }
inline float LoadScalar(const uint16_t* p) { return HalfToFloat(*p); }

template <typename T>
ELDR_TARGET_AVX2 void DotRowsAvx2(const T* const* rows, int n, const float* query, int dim, float* out) {
  int r = 0;
  for (; r + 4 <= n; r += 4) {
    const T* r0 = rows[r];
    const T* r1 = rows[r + 1];
    const T* r2 = rows[r + 2];
    const T* r3 = rows[r + 3];
    __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps();
    __m256 a1 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    __m256 a2 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
      const __m256 q0 = _mm256_loadu_ps(query + i);
      const __m256 q1 = _mm256_loadu_ps(query + i + 8);
      a0 = _mm256_fmadd_ps(LoadAvx2(r0 + i), q0, a0);
      b0 = _mm256_fmadd_ps(LoadAvx2(r0 + i + 8), q1, b0);
      a1 = _mm256_fmadd_ps(LoadAvx2(r1 + i), q0, a1);
      b1 = _mm256_fmadd_ps(LoadAvx2(r1 + i + 8), q1, b1);
      a2 = _mm256_fmadd_ps(LoadAvx2(r2 + i), q0, a2);
      b2 = _mm256_fmadd_ps(LoadAvx2(r2 + i + 8), q1, b2);
      a3 = _mm256_fmadd_ps(LoadAvx2(r3 + i), q0, a3);
      b3 = _mm256_fmadd_ps(LoadAvx2(r3 + i + 8), q1, b3);
    }
    float t0 = 0, t1 = 0, t2 = 0, t3 = 0;
    for (; i < dim; ++i) {
      t0 += LoadScalar(r0 + i) * query[i];
      t1 += LoadScalar(r1 + i) * query[i];
      t2 += LoadScalar(r2 + i) * query[i];
      t3 += LoadScalar(r3 + i) * query[i];
    }
    out[r] = HorizontalSumAvx2(_mm256_add_ps(a0, b0)) + t0;
    out[r + 1] = HorizontalSumAvx2(_mm256_add_ps(a1, b1)) + t1;
    out[r + 2] = HorizontalSumAvx2(_mm256_add_ps(a2, b2)) + t2;
    out[r + 3] = HorizontalSumAvx2(_mm256_add_ps(a3, b3)) + t3;
  }
  for (; r < n; ++r) {
    const T* row = rows[r];
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
      a = _mm256_fmadd_ps(LoadAvx2(row + i), _mm256_loadu_ps(query + i), a);
      b = _mm256_fmadd_ps(LoadAvx2(row + i + 8), _mm256_loadu_ps(query + i + 8), b);
    }
    float t = 0;
    for (; i < dim; ++i) t += LoadScalar(row + i) * query[i];
    out[r] = HorizontalSumAvx2(_mm256_add_ps(a, b)) + t;
  }
}

ELDR_TARGET_AVX2 void DotRowsF32Avx2(const float* const* rows, int n, const float* query, int dim, float* out) {
  DotRowsAvx2<float>(rows, n, query, dim, out);
}
ELDR_TARGET_AVX2 void DotRowsF16Avx2(const uint16_t* const* rows, int n, const float* query, int dim, float* out) {
  DotRowsAvx2<uint16_t>(rows, n, query, dim, out);
}

// Paired bfloat16, 32 values per block: words 0-7 carry values 0-7 (low halves) and 16-23 (high
// halves), words 8-15 carry 8-15 and 24-31.
ELDR_TARGET_AVX2 inline __m256 LowBf16Avx2(__m256i words) { return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)); }
ELDR_TARGET_AVX2 inline __m256 HighBf16Avx2(__m256i words) {
  return _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Rows rows (1, 2 or 4) at once, `unroll` blocks of 32 values per step: rows * unroll * 2
// independent sums, 8 for every block size (each takes two dependent FMAs per block).
template <int Rows, int Unroll>
ELDR_TARGET_AVX2 void DotRowsBf16Avx2Block(const uint16_t* const* rows, const float* query, int dim, float* out) {
  const int full = dim & ~31;
  __m256 lo[Rows][Unroll], hi[Rows][Unroll];
  for (int k = 0; k < Rows; ++k) {
    for (int u = 0; u < Unroll; ++u) lo[k][u] = hi[k][u] = _mm256_setzero_ps();
  }
  int i = 0;
  for (; i + 32 * Unroll <= full; i += 32 * Unroll) {
    for (int u = 0; u < Unroll; ++u) {
      const int at = i + 32 * u;
      const __m256 q0 = _mm256_loadu_ps(query + at);
      const __m256 q1 = _mm256_loadu_ps(query + at + 8);
      const __m256 q2 = _mm256_loadu_ps(query + at + 16);
      const __m256 q3 = _mm256_loadu_ps(query + at + 24);
      for (int k = 0; k < Rows; ++k) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k] + at));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k] + at + 16));
        lo[k][u] = _mm256_fmadd_ps(LowBf16Avx2(w0), q0, lo[k][u]);
        hi[k][u] = _mm256_fmadd_ps(HighBf16Avx2(w0), q2, hi[k][u]);
        lo[k][u] = _mm256_fmadd_ps(LowBf16Avx2(w1), q1, lo[k][u]);
        hi[k][u] = _mm256_fmadd_ps(HighBf16Avx2(w1), q3, hi[k][u]);
      }
    }
  }
  for (; i < full; i += 32) {
    const __m256 q0 = _mm256_loadu_ps(query + i);
    const __m256 q1 = _mm256_loadu_ps(query + i + 8);
    const __m256 q2 = _mm256_loadu_ps(query + i + 16);
    const __m256 q3 = _mm256_loadu_ps(query + i + 24);
    for (int k = 0; k < Rows; ++k) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k] + i));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k] + i + 16));
      lo[k][0] = _mm256_fmadd_ps(LowBf16Avx2(w0), q0, lo[k][0]);
      hi[k][0] = _mm256_fmadd_ps(HighBf16Avx2(w0), q2, hi[k][0]);
      lo[k][0] = _mm256_fmadd_ps(LowBf16Avx2(w1), q1, lo[k][0]);
      hi[k][0] = _mm256_fmadd_ps(HighBf16Avx2(w1), q3, hi[k][0]);
    }
  }
  for (int k = 0; k < Rows; ++k) {
    __m256 sum = _mm256_add_ps(lo[k][0], hi[k][0]);
    for (int u = 1; u < Unroll; ++u) sum = _mm256_add_ps(sum, _mm256_add_ps(lo[k][u], hi[k][u]));
    float tail = 0;
    for (int j = full; j < dim; ++j) tail += PairedBfloat16At(rows[k], j) * query[j];
    out[k] = HorizontalSumAvx2(sum) + tail;
  }
}

ELDR_TARGET_AVX2 void DotRowsBf16Avx2(const uint16_t* const* rows, int n, const float* query, int dim, float* out) {
  InBlocksOf4Then2Then1(
      [&](auto block_rows, const uint16_t* const* block, float* block_out) {
        constexpr int kRows = decltype(block_rows)::value;
        DotRowsBf16Avx2Block<kRows, 4 / kRows>(block, query, dim, block_out);
      },
      rows, n, out);
}

// Lane permutations that move the selected lanes of an 8-lane register to the front.
struct CompressTable {
  alignas(32) int32_t perm[256][8];
  CompressTable() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if (m & (1 << lane)) perm[m][k++] = lane;
      }
      while (k < 8) perm[m][k++] = 0;
    }
  }
};

ELDR_TARGET_AVX2 float GatherColumnsAvx2(const float* in, int dim, const uint16_t* masks, const int* offsets,
                                         const int* /*kept*/, int /*kept_count*/, float* out) {
  static const CompressTable table;
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < dim; i += 8) {
    const int chunk = i >> 4;
    const int m = (masks[chunk] >> (i & 8)) & 0xff;
    if (m == 0) continue;
    const int pos = offsets[chunk] + ((i & 8) ? __builtin_popcount(static_cast<unsigned>(masks[chunk] & 0xff)) : 0);
    // Masked load: unselected lanes (and lanes past dim, never selected) read as 0.
    const __m256i selected = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(m), lane_bits), lane_bits);
    const __m256 v = _mm256_maskload_ps(in + i, selected);
    sum = _mm256_fmadd_ps(v, v, sum);
    const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(table.perm[m]));
    _mm256_storeu_ps(out + pos, _mm256_permutevar8x32_ps(v, perm));
  }
  return HorizontalSumAvx2(sum);
}

// Values i .. n - 1 (fewer than 16, the end of a run) of ConvertGatherInt16, one at a time.
void ConvertGatherInt16Tail(const char* src, const float* weights, int i, int n, const uint16_t* masks,
                            const int* offsets, float* out, float* full, float* kept, float* kept_max, int32_t* bits) {
  for (; i < n; ++i) {
    int16_t count;
    std::memcpy(&count, src + 2 * i, sizeof(count));
    *bits |= count;
    const float v = static_cast<float>(count) * (weights != nullptr ? weights[i] : 1.f);
    *full += v * v;
    const unsigned word = masks[i >> 4];
    if ((word >> (i & 15)) & 1) {
      out[offsets[i >> 4] + __builtin_popcount(word & ((1u << (i & 15)) - 1))] = v;
      *kept += v * v;
      *kept_max = std::max(*kept_max, v);
    }
  }
}

ELDR_TARGET_AVX2 float ConvertGatherInt16Avx2(const char* src, const float* weights, int n, const uint16_t* masks,
                                              const int* offsets, float* out, float* kept_sum, float* kept_max,
                                              int32_t* bits) {
  static const CompressTable table;
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  // One pair of sums per half chunk: consecutive steps do not wait on each other's FMA.
  __m256 full0 = _mm256_setzero_ps(), full1 = full0, kept0 = full0, kept1 = full0;
  __m256 largest = _mm256_set1_ps(*kept_max);
  __m128i or_bits = _mm_setzero_si128();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const int chunk = i >> 4;
    const unsigned word = masks[chunk];
    const __m128i raw0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    const __m128i raw1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i + 16));
    or_bits = _mm_or_si128(or_bits, _mm_or_si128(raw0, raw1));
    __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(raw0));
    __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(raw1));
    if (weights != nullptr) {
      v0 = _mm256_mul_ps(v0, _mm256_loadu_ps(weights + i));
      v1 = _mm256_mul_ps(v1, _mm256_loadu_ps(weights + i + 8));
    }
    full0 = _mm256_fmadd_ps(v0, v0, full0);
    full1 = _mm256_fmadd_ps(v1, v1, full1);
    const unsigned m0 = word & 0xff, m1 = word >> 8;
    const int pos0 = offsets[chunk];
    const int pos1 = pos0 + __builtin_popcount(m0);
    const __m256i sel0 =
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m0)), lane_bits), lane_bits);
    const __m256i sel1 =
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m1)), lane_bits), lane_bits);
    const __m256 k0 = _mm256_and_ps(v0, _mm256_castsi256_ps(sel0));
    const __m256 k1 = _mm256_and_ps(v1, _mm256_castsi256_ps(sel1));
    kept0 = _mm256_fmadd_ps(k0, k0, kept0);
    kept1 = _mm256_fmadd_ps(k1, k1, kept1);
    // Unselected lanes hold +0 in k0/k1; *kept_max starts at >= 0 in every use, and a negative
    // selected value cannot raise it either way.
    largest = _mm256_max_ps(largest, _mm256_max_ps(k0, k1));
    // In order: the second store overwrites the first one's spill-over lanes.
    _mm256_storeu_ps(out + pos0,
                     _mm256_permutevar8x32_ps(v0, _mm256_load_si256(reinterpret_cast<const __m256i*>(table.perm[m0]))));
    _mm256_storeu_ps(out + pos1,
                     _mm256_permutevar8x32_ps(v1, _mm256_load_si256(reinterpret_cast<const __m256i*>(table.perm[m1]))));
  }
  alignas(16) int16_t lanes[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), or_bits);
  int32_t acc = 0;
  for (int16_t lane : lanes) acc |= lane;
  float full = HorizontalSumAvx2(_mm256_add_ps(full0, full1));
  float kept = HorizontalSumAvx2(_mm256_add_ps(kept0, kept1));
  alignas(32) float top[8];
  _mm256_store_ps(top, largest);
  for (float lane : top) *kept_max = std::max(*kept_max, lane);
  ConvertGatherInt16Tail(src, weights, i, n, masks, offsets, out, &full, &kept, kept_max, &acc);
  *bits |= acc;
  *kept_sum += kept;
  return full;
}

ELDR_TARGET_AVX2 void DotRowsU8S8Avx2Groups(const int8_t* const* rows, int n, const uint8_t* query, int padded,
                                            int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  int r = 0;
  for (; r + 4 <= n; r += 4) {
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int i = 0; i < padded; i += 32) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(query + i));
      for (int k = 0; k < 4; ++k) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r + k] + i));
        // u8 x s8 pairs summed in int16 (no saturation for query levels <= 127), then in int32.
        acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(q, w), ones));
      }
    }
    for (int k = 0; k < 4; ++k) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[k]);
      int32_t sum = 0;
      for (int32_t lane : lanes) sum += lane;
      out[r + k] = sum;
    }
  }
  if (r < n) DotRowsU8S8Scalar(rows + r, n - r, query, padded, out + r);
}

ELDR_TARGET_AVX2 void DotRowsU8S8Avx2(const int8_t* const* rows, int n, const uint8_t* query, int padded,
                                      int32_t* out) {
  InGroupsOf4([&](const int8_t* const* group, int count,
                  int32_t* group_out) { DotRowsU8S8Avx2Groups(group, count, query, padded, group_out); },
              rows, n, out);
}

// AVX-VNNI (the VEX form of vpdpbusd: Intel's Xeon 6 E-core servers and Alder Lake on, AMD Zen 5),
// for CPUs that have it without AVX-512 (or run with ELDR_SIMD=avx2): one instruction per 32
// products summed straight into int32, so the query takes all 255 levels, as with AVX-512 VNNI.
#define ELDR_TARGET_AVX2_VNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// Rows rows (1, 2 or 4) at once, `unroll` blocks of 32 values per step: rows * unroll
// independent sums, 8 for every block size.
template <int Rows, int Unroll>
ELDR_TARGET_AVX2_VNNI void DotRowsU8S8Avx2VnniBlock(const int8_t* const* rows, const uint8_t* query, int padded,
                                                    int32_t* out) {
  __m256i acc[Rows][Unroll];
  for (int k = 0; k < Rows; ++k) {
    for (int u = 0; u < Unroll; ++u) acc[k][u] = _mm256_setzero_si256();
  }
  int i = 0;
  for (; i + 32 * Unroll <= padded; i += 32 * Unroll) {
    for (int u = 0; u < Unroll; ++u) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(query + i + 32 * u));
      for (int k = 0; k < Rows; ++k) {
        acc[k][u] = _mm256_dpbusd_avx_epi32(acc[k][u], q,
                                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k] + i + 32 * u)));
      }
    }
  }
  for (; i < padded; i += 32) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(query + i));
    for (int k = 0; k < Rows; ++k) {
      acc[k][0] =
          _mm256_dpbusd_avx_epi32(acc[k][0], q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k] + i)));
    }
  }
  for (int k = 0; k < Rows; ++k) {
    __m256i sum = acc[k][0];
    for (int u = 1; u < Unroll; ++u) sum = _mm256_add_epi32(sum, acc[k][u]);
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    const __m128i quarter = _mm_add_epi32(half, _mm_unpackhi_epi64(half, half));
    out[k] = _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 1)));
  }
}

ELDR_TARGET_AVX2_VNNI void DotRowsU8S8Avx2Vnni(const int8_t* const* rows, int n, const uint8_t* query, int padded,
                                               int32_t* out) {
  InBlocksOf4Then2Then1(
      [&](auto block_rows, const int8_t* const* block, int32_t* block_out) {
        constexpr int kRows = decltype(block_rows)::value;
        DotRowsU8S8Avx2VnniBlock<kRows, 8 / kRows>(block, query, padded, block_out);
      },
      rows, n, out);
}

ELDR_TARGET_AVX2 bool QuantiseQueryAvx2(const float* in, float factor, int dim, int padded, int max_level,
                                        float known_max, uint8_t* out, float* scaled, float* scale,
                                        float* residual_norm2, float* quantised_norm2) {
  const __m256 f = _mm256_set1_ps(factor);
  // Pass 1: the largest value; a negative value or a NaN fails the ordered >= 0 test, +Inf the
  // finiteness test of the maximum.
  __m256 largest = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
  int i = known_max >= 0.f ? dim : 0;  // a known maximum skips the pass
  for (; i + 8 <= dim; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(in + i), f);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, zero, _CMP_NGE_UQ));
    largest = _mm256_max_ps(largest, v);
  }
  if (_mm256_movemask_ps(bad) != 0) return false;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  float top = 0;
  for (float lane : lanes) top = std::max(top, lane);
  for (int j = i; j < dim; ++j) {
    const float v = in[j] * factor;
    if (!(v >= 0.f)) return false;
    top = std::max(top, v);
  }
  if (known_max >= 0.f) top = known_max;
  if (!std::isfinite(top)) return false;
  const float step = top > 0 ? top / static_cast<float>(max_level) : 1.f;
  const __m256 inverse = _mm256_set1_ps(1.f / step);
  const __m256 step_v = _mm256_set1_ps(step);
  const __m256i cap = _mm256_set1_epi32(max_level);
  __m256 residual = _mm256_setzero_ps(), quantised = _mm256_setzero_ps();
  // The levels of 8 values at `at`, their squares and residuals summed.
  const auto levels = [&](int at, __m256* residual_sum, __m256* quantised_sum) ELDR_TARGET_AVX2 {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(in + at), f);
    if (scaled != nullptr) _mm256_storeu_ps(scaled + at, v);
    // Round to nearest (the default MXCSR mode, as std::nearbyint in the scalar version).
    const __m256i level = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, inverse)), cap);
    const __m256 value = _mm256_mul_ps(_mm256_cvtepi32_ps(level), step_v);
    const __m256 d = _mm256_sub_ps(value, v);
    *residual_sum = _mm256_fmadd_ps(d, d, *residual_sum);
    *quantised_sum = _mm256_fmadd_ps(value, value, *quantised_sum);
    return level;
  };
  i = 0;
  // 32 values per step, packed to bytes together: two in-lane packs, then one permutation puts
  // the four groups' 64-bit pieces in order (the packs interleave the 128-bit lanes).
  __m256 residual1 = _mm256_setzero_ps(), quantised1 = _mm256_setzero_ps();
  for (; i + 32 <= dim; i += 32) {
    const __m256i l0 = levels(i, &residual, &quantised);
    const __m256i l1 = levels(i + 8, &residual1, &quantised1);
    const __m256i l2 = levels(i + 16, &residual, &quantised);
    const __m256i l3 = levels(i + 24, &residual1, &quantised1);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(l0, l1), _mm256_packus_epi32(l2, l3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  residual = _mm256_add_ps(residual, residual1);
  quantised = _mm256_add_ps(quantised, quantised1);
  for (; i + 8 <= dim; i += 8) {
    const __m256i level = levels(i, &residual, &quantised);
    const __m128i packed16 = _mm_packus_epi32(_mm256_castsi256_si128(level), _mm256_extracti128_si256(level, 1));
    const __m128i packed8 = _mm_packus_epi16(packed16, packed16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), packed8);
  }
  float residual_sum = HorizontalSumAvx2(residual), quantised_sum = HorizontalSumAvx2(quantised);
  for (; i < dim; ++i) {
    const float v = in[i] * factor;
    if (scaled != nullptr) scaled[i] = v;
    const int level = std::min(max_level, static_cast<int>(std::nearbyint(v * (1.f / step))));
    out[i] = static_cast<uint8_t>(level);
    const float value = static_cast<float>(level) * step;
    residual_sum += (value - v) * (value - v);
    quantised_sum += value * value;
  }
  std::memset(out + dim, 0, static_cast<size_t>(padded - dim));
  *scale = step;
  *residual_norm2 = residual_sum;
  *quantised_norm2 = quantised_sum;
  return true;
}

ELDR_TARGET_AVX2 void AccumulatePanelsAvx2(const float* panels, int k, int n, const float* weights, float* out) {
  // One panel (64 outputs, 8 registers) per pass over the k weights.
  for (int j0 = 0; j0 < n; j0 += kPanelRows) {
    const float* panel = panels + static_cast<size_t>(j0) * k;
    __m256 a[8];
    for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
    for (int c = 0; c < k; ++c) {
      const __m256 w = _mm256_broadcast_ss(weights + c);
      const float* column = panel + static_cast<size_t>(c) * kPanelRows;
      for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(w, _mm256_load_ps(column + 8 * t), a[t]);
    }
    if (n - j0 >= kPanelRows) {
      for (int t = 0; t < 8; ++t) _mm256_storeu_ps(out + j0 + 8 * t, a[t]);
    } else {
      alignas(32) float lanes[kPanelRows];
      for (int t = 0; t < 8; ++t) _mm256_store_ps(lanes + 8 * t, a[t]);
      for (int t = 0; j0 + t < n; ++t) out[j0 + t] = lanes[t];
    }
  }
}

// ---- AVX-512 ------------------------------------------------------------------------------------
// Same structure with 16 lanes; the tail (dim % 32) uses masked loads instead of a scalar loop.
#define ELDR_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma,f16c")))

ELDR_TARGET_AVX512 uint32_t MaxMagnitudeBitsAvx512(const float* in, size_t n) {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i a = _mm512_setzero_si512();
  size_t i = 0;
  // The zero-masked forms (all lanes on) keep GCC 12 from warning about its headers' undefined
  // pass-through operands.
  constexpr __mmask16 kAll = 0xffff;
  for (; i + 16 <= n; i += 16) {
    a = _mm512_maskz_max_epu32(kAll, a, _mm512_and_si512(_mm512_loadu_si512(in + i), magnitude));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    a = _mm512_maskz_max_epu32(kAll, a, _mm512_and_si512(_mm512_maskz_loadu_epi32(tail, in + i), magnitude));
  }
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, a);
  uint32_t max_bits = 0;
  for (const uint32_t lane : lanes) max_bits = std::max(max_bits, lane);
  return max_bits;
}

// 16 entries a step: convert, test the halves, and compress the non-zero ones (as 32-bit lanes,
// AVX-512F having no 16-bit compress) into `values` with one store of 16 halves.
ELDR_TARGET_AVX512 size_t EncodeHalvesAvx512(const float* in, int dim, float scale, uint16_t* halves, uint16_t* words,
                                             uint16_t* values) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m256i magnitude = _mm256_set1_epi16(0x7fff);
  size_t count = 0;
  for (int i = 0; i < dim; i += 16) {
    const __mmask16 lanes =
        dim - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (dim - i)) - 1);
    const __m256i h = _mm512_maskz_cvtps_ph(lanes, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, in + i), s),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(halves + i, lanes, h);
    const __mmask16 set = _mm256_mask_test_epi16_mask(lanes, h, magnitude);
    words[i / 16] = static_cast<uint16_t>(set);
    const __m512i packed = _mm512_maskz_compress_epi32(set, _mm512_maskz_cvtepu16_epi32(lanes, h));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + count), _mm512_maskz_cvtepi32_epi16(lanes, packed));
    count += static_cast<size_t>(__builtin_popcount(set));
  }
  return count;
}

// One expanding load per 16 entries (vexpandps takes exactly the set lanes' values, in order); the
// load of a block precedes its store, and the values still to come lie beyond the block.
ELDR_TARGET_AVX512 void ExpandBitmapAvx512(const uint16_t* words, int dim, const float* values, float* out) {
  int i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __mmask16 mask = words[i / 16];
    const __m512 v = _mm512_maskz_expandloadu_ps(mask, values);
    values += __builtin_popcount(mask);
    _mm512_storeu_ps(out + i, v);
  }
  if (i < dim) {
    const __m512 v = _mm512_maskz_expandloadu_ps(static_cast<__mmask16>(words[i / 16]), values);
    _mm512_mask_storeu_ps(out + i, static_cast<__mmask16>((1u << (dim - i)) - 1), v);
  }
}

// The zero-masked forms of the conversion and the extraction compile to the same instructions as
// the plain intrinsics, whose GCC 12 implementations read an "undefined" register and trip
// -Wmaybe-uninitialized.
constexpr __mmask16 kAllLanes = 0xffff;

ELDR_TARGET_AVX512 inline __m512 LoadAvx512(const float* p) { return _mm512_loadu_ps(p); }
ELDR_TARGET_AVX512 inline __m512 LoadAvx512(const uint16_t* p) {
  return _mm512_maskz_cvtph_ps(kAllLanes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
ELDR_TARGET_AVX512 inline __m512 MaskedLoadAvx512(__mmask16 mask, const float* p) {
  return _mm512_maskz_loadu_ps(mask, p);
}
ELDR_TARGET_AVX512 inline __m512 MaskedLoadAvx512(__mmask16 mask, const uint16_t* p) {
  return _mm512_maskz_cvtph_ps(kAllLanes, _mm256_maskz_loadu_epi16(mask, p));
}
ELDR_TARGET_AVX512 inline float HorizontalSumAvx512(__m512 v) {
  const __m512d bits = _mm512_castps_pd(v);
  const __m256 low = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(static_cast<__mmask8>(0xff), bits, 0));
  const __m256 high = _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(static_cast<__mmask8>(0xff), bits, 1));
  return HorizontalSumAvx2(_mm256_add_ps(low, high));
}

template <typename T>
ELDR_TARGET_AVX512 void DotRowsAvx512(const T* const* rows, int n, const float* query, int dim, float* out) {
  const int full = dim & ~31;
  const int rest = dim - full;  // 0..31 elements, in at most two masked 16-lane chunks
  const __mmask16 mask_lo = rest >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << rest) - 1);
  const __mmask16 mask_hi = rest > 16 ? static_cast<__mmask16>((1u << (rest - 16)) - 1) : static_cast<__mmask16>(0);
  int r = 0;
  for (; r + 4 <= n; r += 4) {
    const T* r0 = rows[r];
    const T* r1 = rows[r + 1];
    const T* r2 = rows[r + 2];
    const T* r3 = rows[r + 3];
    __m512 a0 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps();
    __m512 a1 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    __m512 a2 = _mm512_setzero_ps(), b2 = _mm512_setzero_ps();
    __m512 a3 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
    for (int i = 0; i < full; i += 32) {
      const __m512 q0 = _mm512_loadu_ps(query + i);
      const __m512 q1 = _mm512_loadu_ps(query + i + 16);
      a0 = _mm512_fmadd_ps(LoadAvx512(r0 + i), q0, a0);
      b0 = _mm512_fmadd_ps(LoadAvx512(r0 + i + 16), q1, b0);
      a1 = _mm512_fmadd_ps(LoadAvx512(r1 + i), q0, a1);
      b1 = _mm512_fmadd_ps(LoadAvx512(r1 + i + 16), q1, b1);
      a2 = _mm512_fmadd_ps(LoadAvx512(r2 + i), q0, a2);
      b2 = _mm512_fmadd_ps(LoadAvx512(r2 + i + 16), q1, b2);
      a3 = _mm512_fmadd_ps(LoadAvx512(r3 + i), q0, a3);
      b3 = _mm512_fmadd_ps(LoadAvx512(r3 + i + 16), q1, b3);
    }
    if (rest > 0) {
      const __m512 q0 = _mm512_maskz_loadu_ps(mask_lo, query + full);
      const __m512 q1 = _mm512_maskz_loadu_ps(mask_hi, query + full + 16);
      a0 = _mm512_fmadd_ps(MaskedLoadAvx512(mask_lo, r0 + full), q0, a0);
      b0 = _mm512_fmadd_ps(MaskedLoadAvx512(mask_hi, r0 + full + 16), q1, b0);
      a1 = _mm512_fmadd_ps(MaskedLoadAvx512(mask_lo, r1 + full), q0, a1);
      b1 = _mm512_fmadd_ps(MaskedLoadAvx512(mask_hi, r1 + full + 16), q1, b1);
      a2 = _mm512_fmadd_ps(MaskedLoadAvx512(mask_lo, r2 + full), q0, a2);
      b2 = _mm512_fmadd_ps(MaskedLoadAvx512(mask_hi, r2 + full + 16), q1, b2);
      a3 = _mm512_fmadd_ps(MaskedLoadAvx512(mask_lo, r3 + full), q0, a3);
      b3 = _mm512_fmadd_ps(MaskedLoadAvx512(mask_hi, r3 + full + 16), q1, b3);
    }
    out[r] = HorizontalSumAvx512(_mm512_add_ps(a0, b0));
    out[r + 1] = HorizontalSumAvx512(_mm512_add_ps(a1, b1));
    out[r + 2] = HorizontalSumAvx512(_mm512_add_ps(a2, b2));
    out[r + 3] = HorizontalSumAvx512(_mm512_add_ps(a3, b3));
  }
  for (; r < n; ++r) {
    const T* row = rows[r];
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    for (int i = 0; i < full; i += 32) {
      a = _mm512_fmadd_ps(LoadAvx512(row + i), _mm512_loadu_ps(query + i), a);
      b = _mm512_fmadd_ps(LoadAvx512(row + i + 16), _mm512_loadu_ps(query + i + 16), b);
    }
    if (rest > 0) {
      a = _mm512_fmadd_ps(MaskedLoadAvx512(mask_lo, row + full), _mm512_maskz_loadu_ps(mask_lo, query + full), a);
      b = _mm512_fmadd_ps(MaskedLoadAvx512(mask_hi, row + full + 16), _mm512_maskz_loadu_ps(mask_hi, query + full + 16),
                          b);
    }
    out[r] = HorizontalSumAvx512(_mm512_add_ps(a, b));
  }
}

ELDR_TARGET_AVX512 void DotRowsF32Avx512(const float* const* rows, int n, const float* query, int dim, float* out) {
  DotRowsAvx512<float>(rows, n, query, dim, out);
}
ELDR_TARGET_AVX512 void DotRowsF16Avx512(const uint16_t* const* rows, int n, const float* query, int dim, float* out) {
  DotRowsAvx512<uint16_t>(rows, n, query, dim, out);
}

// Rows rows (1, 2 or 4) at once, `unroll` blocks of 32 values per step: rows * unroll * 2
// independent sums, 8 for every block size.
template <int Rows, int Unroll>
ELDR_TARGET_AVX512 void DotRowsBf16Avx512Block(const uint16_t* const* rows, const float* query, int dim, float* out) {
  const int full = dim & ~31;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 lo[Rows][Unroll], hi[Rows][Unroll];
  for (int k = 0; k < Rows; ++k) {
    for (int u = 0; u < Unroll; ++u) lo[k][u] = hi[k][u] = _mm512_setzero_ps();
  }
  int i = 0;
  for (; i + 32 * Unroll <= full; i += 32 * Unroll) {
    for (int u = 0; u < Unroll; ++u) {
      const int at = i + 32 * u;
      const __m512 q0 = _mm512_loadu_ps(query + at);
      const __m512 q1 = _mm512_loadu_ps(query + at + 16);
      for (int k = 0; k < Rows; ++k) {
        const __m512i w = _mm512_loadu_si512(rows[k] + at);
        lo[k][u] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, w, 16)), q0, lo[k][u]);
        hi[k][u] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high_half)), q1, hi[k][u]);
      }
    }
  }
  // The blocks past the last whole step, then the masked end (the row's padding is zero; the
  // query is read only up to dim).
  for (; i < dim; i += 32) {
    const int left = dim - i;
    const __mmask16 mask_lo = left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 mask_hi = left >= 32  ? static_cast<__mmask16>(0xffff)
                              : left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1)
                                          : static_cast<__mmask16>(0);
    const __m512 q0 = _mm512_maskz_loadu_ps(mask_lo, query + i);
    const __m512 q1 = _mm512_maskz_loadu_ps(mask_hi, query + i + 16);
    for (int k = 0; k < Rows; ++k) {
      const __m512i w = _mm512_loadu_si512(rows[k] + i);
      lo[k][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, w, 16)), q0, lo[k][0]);
      hi[k][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high_half)), q1, hi[k][0]);
    }
  }
  for (int k = 0; k < Rows; ++k) {
    __m512 sum = _mm512_add_ps(lo[k][0], hi[k][0]);
    for (int u = 1; u < Unroll; ++u) sum = _mm512_add_ps(sum, _mm512_add_ps(lo[k][u], hi[k][u]));
    out[k] = HorizontalSumAvx512(sum);
  }
}

ELDR_TARGET_AVX512 void DotRowsBf16Avx512(const uint16_t* const* rows, int n, const float* query, int dim, float* out) {
  InBlocksOf4Then2Then1(
      [&](auto block_rows, const uint16_t* const* block, float* block_out) {
        constexpr int kRows = decltype(block_rows)::value;
        DotRowsBf16Avx512Block<kRows, 4 / kRows>(block, query, dim, block_out);
      },
      rows, n, out);
}

ELDR_TARGET_AVX512 float GatherColumnsAvx512(const float* in, int dim, const uint16_t* masks, const int* offsets,
                                             const int* /*kept*/, int /*kept_count*/, float* out) {
  // Chunks store in order, so a store's spill-over lanes (zeros past this chunk's count) are
  // overwritten by the next chunk's store; the last one's land in the 16 floats of slack.
  // Two chunks per step, two sums: one sum would make every chunk wait on the previous FMA.
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  const int chunks = (dim + 15) / 16;
  int c = 0;
  for (; c + 2 <= chunks; c += 2) {
    const __mmask16 m0 = masks[c], m1 = masks[c + 1];
    // Lanes past dim are never selected, so the masked loads stay inside `in`.
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, in + 16 * c);
    const __m512 v1 = _mm512_maskz_loadu_ps(m1, in + 16 * c + 16);
    sum0 = _mm512_fmadd_ps(v0, v0, sum0);
    sum1 = _mm512_fmadd_ps(v1, v1, sum1);
    _mm512_storeu_ps(out + offsets[c], _mm512_maskz_compress_ps(m0, v0));
    _mm512_storeu_ps(out + offsets[c + 1], _mm512_maskz_compress_ps(m1, v1));
  }
  if (c < chunks) {
    const __mmask16 m = masks[c];
    const __m512 v = _mm512_maskz_loadu_ps(m, in + 16 * c);
    sum0 = _mm512_fmadd_ps(v, v, sum0);
    _mm512_storeu_ps(out + offsets[c], _mm512_maskz_compress_ps(m, v));
  }
  return HorizontalSumAvx512(_mm512_add_ps(sum0, sum1));
}

// GCC 12 warns that the "undefined" source register inside _mm512_cvtepi16_epi32,
// _mm512_cvtepi32_ps and _mm512_reduce_max_ps may be used uninitialised (a false positive of its
// intrinsic headers).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// Chunk c of ConvertGatherInt16 as weighted floats: a whole chunk (16 values) with plain loads,
// the last one of a run (fewer values) masked. Templates keep the checks out of the loop.
template <bool kWeighted, bool kWhole>
ELDR_TARGET_AVX512 inline __m512 LoadInt16ChunkAvx512(const char* src, const float* weights, int n, int c,
                                                      __m256i* or_bits) {
  __m256i raw;
  __mmask16 valid = static_cast<__mmask16>(0xffff);
  if constexpr (kWhole) {
    raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * c));
  } else {
    valid = static_cast<__mmask16>((1u << (n - 16 * c)) - 1);
    raw = _mm256_maskz_loadu_epi16(valid, src + 32 * c);
  }
  *or_bits = _mm256_or_si256(*or_bits, raw);
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(raw));
  if constexpr (!kWeighted) return v;
  return _mm512_mul_ps(v, kWhole ? _mm512_loadu_ps(weights + 16 * c) : _mm512_maskz_loadu_ps(valid, weights + 16 * c));
}

template <bool kWeighted>
ELDR_TARGET_AVX512 float ConvertGatherInt16Avx512Run(const char* src, const float* weights, int n,
                                                     const uint16_t* masks, const int* offsets, float* out,
                                                     float* kept_sum, float* kept_max, int32_t* bits) {
  // Two chunks per step, two sums of each kind (as GatherColumnsAvx512); chunks store in order,
  // so each store's spill-over lanes are overwritten by the next one's.
  __m512 full0 = _mm512_setzero_ps(), full1 = full0, kept0 = full0, kept1 = full0;
  // Compressed-out lanes are +0: see ConvertGatherInt16Avx2.
  __m512 largest = _mm512_set1_ps(*kept_max);
  __m256i or_bits = _mm256_setzero_si256();
  const int whole = n / 16;
  int c = 0;
  for (; c + 2 <= whole; c += 2) {
    const __m512 v0 = LoadInt16ChunkAvx512<kWeighted, true>(src, weights, n, c, &or_bits);
    const __m512 v1 = LoadInt16ChunkAvx512<kWeighted, true>(src, weights, n, c + 1, &or_bits);
    full0 = _mm512_fmadd_ps(v0, v0, full0);
    full1 = _mm512_fmadd_ps(v1, v1, full1);
    const __m512 k0 = _mm512_maskz_compress_ps(masks[c], v0);
    const __m512 k1 = _mm512_maskz_compress_ps(masks[c + 1], v1);
    kept0 = _mm512_fmadd_ps(k0, k0, kept0);
    kept1 = _mm512_fmadd_ps(k1, k1, kept1);
    largest = _mm512_max_ps(largest, _mm512_max_ps(k0, k1));
    _mm512_storeu_ps(out + offsets[c], k0);
    _mm512_storeu_ps(out + offsets[c + 1], k1);
  }
  // At most one whole chunk and one partial one left.
  for (; c * 16 < n; ++c) {
    const __m512 v = c < whole ? LoadInt16ChunkAvx512<kWeighted, true>(src, weights, n, c, &or_bits)
                               : LoadInt16ChunkAvx512<kWeighted, false>(src, weights, n, c, &or_bits);
    full0 = _mm512_fmadd_ps(v, v, full0);
    const __m512 k = _mm512_maskz_compress_ps(masks[c], v);
    kept0 = _mm512_fmadd_ps(k, k, kept0);
    largest = _mm512_max_ps(largest, k);
    _mm512_storeu_ps(out + offsets[c], k);
  }
  alignas(32) int16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), or_bits);
  int32_t acc = 0;
  for (int16_t lane : lanes) acc |= lane;
  *bits |= acc;
  *kept_max = _mm512_reduce_max_ps(largest);
  *kept_sum += HorizontalSumAvx512(_mm512_add_ps(kept0, kept1));
  return HorizontalSumAvx512(_mm512_add_ps(full0, full1));
}

ELDR_TARGET_AVX512 float ConvertGatherInt16Avx512(const char* src, const float* weights, int n, const uint16_t* masks,
                                                  const int* offsets, float* out, float* kept_sum, float* kept_max,
                                                  int32_t* bits) {
  return weights != nullptr
             ? ConvertGatherInt16Avx512Run<true>(src, weights, n, masks, offsets, out, kept_sum, kept_max, bits)
             : ConvertGatherInt16Avx512Run<false>(src, weights, n, masks, offsets, out, kept_sum, kept_max, bits);
}
#pragma GCC diagnostic pop

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // as above: _mm512_reduce_add_epi32 and the
#pragma GCC diagnostic ignored "-Wuninitialized"        // conversions of QuantiseQueryAvx512
ELDR_TARGET_AVX512 void DotRowsU8S8Avx512Groups(const int8_t* const* rows, int n, const uint8_t* query, int padded,
                                                int32_t* out) {
  const __m512i ones = _mm512_set1_epi16(1);
  int r = 0;
  for (; r + 4 <= n; r += 4) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int i = 0; i < padded; i += 64) {
      const __m512i q = _mm512_loadu_si512(query + i);
      for (int k = 0; k < 4; ++k) {
        const __m512i w = _mm512_loadu_si512(rows[r + k] + i);
        acc[k] = _mm512_add_epi32(acc[k], _mm512_madd_epi16(_mm512_maddubs_epi16(q, w), ones));
      }
    }
    for (int k = 0; k < 4; ++k) out[r + k] = _mm512_reduce_add_epi32(acc[k]);
  }
  if (r < n) DotRowsU8S8Scalar(rows + r, n - r, query, padded, out + r);
}

ELDR_TARGET_AVX512 void DotRowsU8S8Avx512(const int8_t* const* rows, int n, const uint8_t* query, int padded,
                                          int32_t* out) {
  InGroupsOf4([&](const int8_t* const* group, int count,
                  int32_t* group_out) { DotRowsU8S8Avx512Groups(group, count, query, padded, group_out); },
              rows, n, out);
}

#define ELDR_TARGET_AVX512_VNNI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))

// Rows rows (1, 2 or 4) at once, `unroll` blocks of 64 values per step: rows * unroll
// independent sums, 8 for every block size (one sum per row left each row a chain of dependent
// vpdpbusd, bound by its latency).
template <int Rows, int Unroll>
ELDR_TARGET_AVX512_VNNI void DotRowsU8S8Avx512VnniBlock(const int8_t* const* rows, const uint8_t* query, int padded,
                                                        int32_t* out) {
  __m512i acc[Rows][Unroll];
  for (int k = 0; k < Rows; ++k) {
    for (int u = 0; u < Unroll; ++u) acc[k][u] = _mm512_setzero_si512();
  }
  int i = 0;
  for (; i + 64 * Unroll <= padded; i += 64 * Unroll) {
    for (int u = 0; u < Unroll; ++u) {
      const __m512i q = _mm512_loadu_si512(query + i + 64 * u);
      for (int k = 0; k < Rows; ++k) {
        acc[k][u] = _mm512_dpbusd_epi32(acc[k][u], q, _mm512_loadu_si512(rows[k] + i + 64 * u));
      }
    }
  }
  for (; i < padded; i += 64) {
    const __m512i q = _mm512_loadu_si512(query + i);
    for (int k = 0; k < Rows; ++k) acc[k][0] = _mm512_dpbusd_epi32(acc[k][0], q, _mm512_loadu_si512(rows[k] + i));
  }
  for (int k = 0; k < Rows; ++k) {
    __m512i sum = acc[k][0];
    for (int u = 1; u < Unroll; ++u) sum = _mm512_add_epi32(sum, acc[k][u]);
    out[k] = _mm512_reduce_add_epi32(sum);
  }
}

ELDR_TARGET_AVX512_VNNI void DotRowsU8S8Avx512Vnni(const int8_t* const* rows, int n, const uint8_t* query, int padded,
                                                   int32_t* out) {
  InBlocksOf4Then2Then1(
      [&](auto block_rows, const int8_t* const* block, int32_t* block_out) {
        constexpr int kRows = decltype(block_rows)::value;
        DotRowsU8S8Avx512VnniBlock<kRows, 8 / kRows>(block, query, padded, block_out);
      },
      rows, n, out);
}

ELDR_TARGET_AVX512 bool QuantiseQueryAvx512(const float* in, float factor, int dim, int padded, int max_level,
                                            float known_max, uint8_t* out, float* scaled, float* scale,
                                            float* residual_norm2, float* quantised_norm2) {
  const __m512 f = _mm512_set1_ps(factor);
  // Pass 1: the largest value; a negative value or a NaN fails the ordered >= 0 test.
  const __m512 zero = _mm512_setzero_ps();
  __m512 largest = zero;
  __mmask16 bad = 0;
  int i = known_max >= 0.f ? dim : 0;  // a known maximum skips the pass
  for (; i < dim; i += 16) {
    const __mmask16 valid =
        dim - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (dim - i)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, in + i), f);
    bad |= _mm512_mask_cmp_ps_mask(valid, v, zero, _CMP_NGE_UQ);
    largest = _mm512_max_ps(largest, v);
  }
  if (bad != 0) return false;
  const float top = known_max >= 0.f ? known_max : _mm512_reduce_max_ps(largest);
  if (!std::isfinite(top)) return false;
  const float step = top > 0 ? top / static_cast<float>(max_level) : 1.f;
  const __m512 inverse = _mm512_set1_ps(1.f / step);
  const __m512 step_v = _mm512_set1_ps(step);
  const __m512i cap = _mm512_set1_epi32(max_level);
  __m512 residual = zero, quantised = zero;
  // The levels of 16 scaled values (zero lanes past dim add nothing), their squares and residuals
  // summed.
  const auto levels = [&](__m512 v) ELDR_TARGET_AVX512 {
    // Round to nearest even (the default MXCSR mode, as std::nearbyint in the scalar version).
    const __m512i level = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inverse)), cap);
    const __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(level), step_v);
    const __m512 d = _mm512_sub_ps(value, v);
    residual = _mm512_fmadd_ps(d, d, residual);
    quantised = _mm512_fmadd_ps(value, value, quantised);
    return _mm512_cvtusepi32_epi8(level);
  };
  // Whole vectors with plain loads and stores, then the masked end.
  const int whole = dim & ~15;
  for (i = 0; i < whole; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(in + i), f);
    if (scaled != nullptr) _mm512_storeu_ps(scaled + i, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), levels(v));
  }
  if (i < dim) {
    const __mmask16 valid = static_cast<__mmask16>((1u << (dim - i)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, in + i), f);
    if (scaled != nullptr) _mm512_mask_storeu_ps(scaled + i, valid, v);
    _mm_mask_storeu_epi8(out + i, valid, levels(v));
  }
  std::memset(out + dim, 0, static_cast<size_t>(padded - dim));
  *scale = step;
  *residual_norm2 = HorizontalSumAvx512(residual);
  *quantised_norm2 = HorizontalSumAvx512(quantised);
  return true;
}
#pragma GCC diagnostic pop

ELDR_TARGET_AVX512 void AccumulatePanelsAvx512(const float* panels, int k, int n, const float* weights, float* out) {
  // One panel (64 outputs, 4 registers) per pass over the k weights.
  for (int j0 = 0; j0 < n; j0 += kPanelRows) {
    const float* panel = panels + static_cast<size_t>(j0) * k;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < k; ++c) {
      const __m512 w = _mm512_set1_ps(weights[c]);
      const float* column = panel + static_cast<size_t>(c) * kPanelRows;
      a0 = _mm512_fmadd_ps(w, _mm512_load_ps(column), a0);
      a1 = _mm512_fmadd_ps(w, _mm512_load_ps(column + 16), a1);
      a2 = _mm512_fmadd_ps(w, _mm512_load_ps(column + 32), a2);
      a3 = _mm512_fmadd_ps(w, _mm512_load_ps(column + 48), a3);
    }
    const int left = std::min(kPanelRows, n - j0);
    auto lanes = [left](int first) {
      const int count = std::clamp(left - first, 0, 16);
      return count == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1);
    };
    _mm512_mask_storeu_ps(out + j0, lanes(0), a0);
    _mm512_mask_storeu_ps(out + j0 + 16, lanes(16), a1);
    _mm512_mask_storeu_ps(out + j0 + 32, lanes(32), a2);
    _mm512_mask_storeu_ps(out + j0 + 48, lanes(48), a3);
  }
}

ELDR_TARGET_AVX2 void FloatsToHalvesF16c(const float* in, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

ELDR_TARGET_AVX2 uint32_t MaxMagnitudeBitsAvx2(const float* in, size_t n) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i a = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    a = _mm256_max_epu32(a, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)), magnitude));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
  uint32_t max_bits = MaxMagnitudeBitsScalar(in + i, n - i);
  for (const uint32_t lane : lanes) max_bits = std::max(max_bits, lane);
  return max_bits;
}

// Lookup tables for compressing and expanding 8 lanes by an 8-bit mask (AVX2 has neither
// instruction): for mask m, the pshufb byte order that moves the set 16-bit lanes to the front,
// and for each of 8 float lanes the rank of the value it takes (its index among the set lanes).
struct LaneTables {
  alignas(16) uint8_t compress16[256][16];
  alignas(32) int32_t expand32[256][8];
  LaneTables() {
    for (int m = 0; m < 256; ++m) {
      int next = 0;
      for (int lane = 0; lane < 8; ++lane) {
        expand32[m][lane] = next;
        if ((m >> lane) & 1) {
          compress16[m][2 * next] = static_cast<uint8_t>(2 * lane);
          compress16[m][2 * next + 1] = static_cast<uint8_t>(2 * lane + 1);
          ++next;
        }
      }
      for (int b = 2 * next; b < 16; ++b) compress16[m][b] = 0x80;  // zero the rest
    }
  }
};
const LaneTables& Tables() {
  static const LaneTables tables;
  return tables;
}

// F16C conversion, then 8 halves a step: test, and compress the non-zero ones with one shuffle.
ELDR_TARGET_AVX2 size_t EncodeHalvesAvx2(const float* in, int dim, float scale, uint16_t* halves, uint16_t* words,
                                         uint16_t* values) {
  const __m256 s = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(in + i), s), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(halves + i), h);
  }
  for (; i < dim; ++i) halves[i] = FloatToHalf(in[i] * scale);
  const LaneTables& tables = Tables();
  const __m128i magnitude = _mm_set1_epi16(0x7fff);
  size_t count = 0;
  i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + i));
    const __m128i zero = _mm_cmpeq_epi16(_mm_and_si128(h, magnitude), _mm_setzero_si128());
    const int set = ~_mm_movemask_epi8(_mm_packs_epi16(zero, zero)) & 0xff;
    const __m128i order = _mm_load_si128(reinterpret_cast<const __m128i*>(tables.compress16[set]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values + count), _mm_shuffle_epi8(h, order));
    count += static_cast<size_t>(__builtin_popcount(set));
    if (i % 16 == 0) {
      words[i / 16] = static_cast<uint16_t>(set);
    } else {
      words[i / 16] = static_cast<uint16_t>(words[i / 16] | (set << 8));
    }
  }
  if (i < dim) {  // the last dim % 8 entries: the scalar packing, merged into the last word
    uint16_t tail_word = 0;
    count += PackNonZeroHalves(halves + i, dim - i, &tail_word, values + count);
    const int shift = i % 16;
    words[i / 16] = static_cast<uint16_t>((shift == 0 ? 0 : words[i / 16]) | (tail_word << shift));
  }
  return count;
}

// 8 entries a step: a masked load of the values the set lanes take (never reading past them, so
// the in-place form stays in bounds), a permutation to their lanes, zeros elsewhere.
ELDR_TARGET_AVX2 void ExpandBitmapAvx2(const uint16_t* words, int dim, const float* values, float* out) {
  const LaneTables& tables = Tables();
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int i = 0;
  for (; i + 8 <= dim; i += 8) {
    const int set = (words[i / 16] >> (i % 16)) & 0xff;
    const int taken = __builtin_popcount(set);
    const __m256i first = _mm256_cmpgt_epi32(_mm256_set1_epi32(taken), lane_index);  // lanes < taken
    const __m256 v = _mm256_maskload_ps(values, first);
    const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(tables.expand32[set]));
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(set), lane_bits), lane_bits);
    _mm256_storeu_ps(out + i, _mm256_and_ps(_mm256_permutevar8x32_ps(v, order), _mm256_castsi256_ps(on)));
    values += taken;
  }
  if (i < dim) {  // the last dim % 8 entries
    const uint16_t tail_word = static_cast<uint16_t>((words[i / 16] >> (i % 16)) & ((1u << (dim - i)) - 1));
    ExpandBitmapScalar(&tail_word, dim - i, values, out + i);
  }
}

ELDR_TARGET_AVX2 void HalvesToFloatsF16c(const uint16_t* in, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

SimdLevel ComputeCpuSimdLevel() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    // F16C is implied by AVX-512F on every CPU that has it, but GCC cannot test "f16c" here.
    return SimdLevel::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx")) {
    // __builtin_cpu_supports has no "f16c" in GCC 12; read CPUID leaf 1, ECX bit 29.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
    if (ecx & (1u << 29)) return SimdLevel::kAvx2;
  }
  return SimdLevel::kScalar;
}

bool CpuHasVnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return vnni;
}

// AVX-VNNI: CPUID leaf 7, subleaf 1, EAX bit 4 (GCC 12's __builtin_cpu_supports has no name for
// it); its ymm state is the AVX2 level's, which CpuSimdLevel checked.
bool CpuHasAvxVnni() {
  static const bool avx_vnni = [] {
    if (static_cast<int>(CpuSimdLevel()) < static_cast<int>(SimdLevel::kAvx2)) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0), "c"(0));
    if (eax < 7) return false;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(1));
    return (eax & (1u << 4)) != 0;
  }();
  return avx_vnni;
}

// ELDR_VNNI=0: the 8-bit dot products without VNNI even where the CPU has it (see
// scorer_kernels.h). Other values, or none, allow it.
bool VnniAllowed() {
  static const bool allowed = [] {
    const char* env = std::getenv("ELDR_VNNI");
    return env == nullptr || std::string(env) != "0";
  }();
  return allowed;
}
bool UseVnni() { return CpuHasVnni() && VnniAllowed(); }
bool UseAvxVnni() { return CpuHasAvxVnni() && VnniAllowed(); }

SimdLevel ComputeDetectedSimdLevel() {
  SimdLevel level = CpuSimdLevel();
  if (const char* env = std::getenv("ELDR_SIMD"); env != nullptr) {
    const std::string requested(env);
    SimdLevel cap = level;
    if (requested == "scalar" || requested == "generic") cap = SimdLevel::kScalar;
    if (requested == "avx2") cap = SimdLevel::kAvx2;
    if (requested == "avx512") cap = SimdLevel::kAvx512;
    if (static_cast<int>(cap) < static_cast<int>(level)) level = cap;
  }
  return level;
}

float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
uint32_t FloatToBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

}  // namespace

SimdLevel CpuSimdLevel() {
  static const SimdLevel level = ComputeCpuSimdLevel();
  return level;
}

SimdLevel DetectSimdLevel() {
  static const SimdLevel level = ComputeDetectedSimdLevel();
  return level;
}

absl::string_view SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "scalar";
}

const ScorerKernels& KernelsFor(SimdLevel level) {
  static const ScorerKernels kScalar{SimdLevel::kScalar,
                                     DotRowsF32Scalar,
                                     DotRowsF16Scalar,
                                     DotRowsBf16Scalar,
                                     GatherColumnsScalar,
                                     AccumulatePanelsScalar,
                                     ExpandBitmapScalar,
                                     MaxMagnitudeBitsScalar,
                                     EncodeHalvesScalar,
                                     ConvertGatherInt16Scalar,
                                     DotRowsU8S8Scalar,
                                     QuantiseQueryScalar,
                                     255,
                                     "scalar"};
  static const ScorerKernels kAvx2{SimdLevel::kAvx2,
                                   DotRowsF32Avx2,
                                   DotRowsF16Avx2,
                                   DotRowsBf16Avx2,
                                   GatherColumnsAvx2,
                                   AccumulatePanelsAvx2,
                                   ExpandBitmapAvx2,
                                   MaxMagnitudeBitsAvx2,
                                   EncodeHalvesAvx2,
                                   ConvertGatherInt16Avx2,
                                   UseAvxVnni() ? DotRowsU8S8Avx2Vnni : DotRowsU8S8Avx2,
                                   QuantiseQueryAvx2,
                                   UseAvxVnni() ? 255 : 127,
                                   UseAvxVnni() ? "avx2+avx_vnni" : "avx2"};
  static const ScorerKernels kAvx512{SimdLevel::kAvx512,
                                     DotRowsF32Avx512,
                                     DotRowsF16Avx512,
                                     DotRowsBf16Avx512,
                                     GatherColumnsAvx512,
                                     AccumulatePanelsAvx512,
                                     ExpandBitmapAvx512,
                                     MaxMagnitudeBitsAvx512,
                                     EncodeHalvesAvx512,
                                     ConvertGatherInt16Avx512,
                                     UseVnni() ? DotRowsU8S8Avx512Vnni : DotRowsU8S8Avx512,
                                     QuantiseQueryAvx512,
                                     UseVnni() ? 255 : 127,
                                     UseVnni() ? "avx512+vnni" : "avx512"};
  if (static_cast<int>(level) > static_cast<int>(CpuSimdLevel())) level = CpuSimdLevel();
  switch (level) {
    case SimdLevel::kAvx512:
      return kAvx512;
    case SimdLevel::kAvx2:
      return kAvx2;
    case SimdLevel::kScalar:
      break;
  }
  return kScalar;
}

std::vector<Int8DotKernel> AvailableInt8DotKernels() {
  std::vector<Int8DotKernel> kernels = {{"scalar", DotRowsU8S8Scalar, 255}};
  if (static_cast<int>(CpuSimdLevel()) >= static_cast<int>(SimdLevel::kAvx2)) {
    kernels.push_back({"avx2", DotRowsU8S8Avx2, 127});
    if (CpuHasAvxVnni()) kernels.push_back({"avx2_vnni", DotRowsU8S8Avx2Vnni, 255});
  }
  if (CpuSimdLevel() == SimdLevel::kAvx512) {
    kernels.push_back({"avx512", DotRowsU8S8Avx512, 127});
    if (CpuHasVnni()) kernels.push_back({"avx512_vnni", DotRowsU8S8Avx512Vnni, 255});
  }
  return kernels;
}

const ScorerKernels& BestKernels() {
  static const ScorerKernels& kernels = KernelsFor(DetectSimdLevel());
  return kernels;
}

int AccumulationDepth(int dim) {
  // Scalar: 8 interleaved partial sums of ceil(dim / 8) terms, then a 3-level tree. The vector
  // kernels have shorter chains (at most ceil(dim / 16) products per accumulator) but may end with
  // a scalar run of up to 31 values (AVX2 bfloat16; 15 for AVX2 fp32 and binary16) and up to 7
  // reduction levels (accumulators, lanes, the run's sum), which for short rows is more than the
  // scalar tree: 40 covers both.
  return (dim + 7) / 8 + 40;
}

uint16_t FloatToHalf(float value) {
  uint32_t bits = FloatToBits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u) {  // Inf or NaN (NaN keeps a quiet payload bit)
    return static_cast<uint16_t>(sign | (bits > 0x7f800000u ? 0x7e00u : 0x7c00u));
  }
  if (bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (bits < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5f puts the half subnormal's unit (2^-24)
    // at the float's last mantissa bit, so the FPU does the round-to-nearest-even for us.
    const float shifted = BitsToFloat(bits) + 0.5f;
    return static_cast<uint16_t>(sign | (FloatToBits(shifted) - 0x3f000000u));
  }
  const uint32_t odd = (bits >> 13) & 1u;
  bits += 0xc8000000u + 0x0fffu + odd;  // rebias the exponent (127 -> 15), round to nearest even
  return static_cast<uint16_t>(sign | (bits >> 13));
}

float HalfToFloat(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
    return BitsToFloat(sign | FloatToBits(magnitude));
  }
  if (exponent == 31) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

void FloatsToHalves(const float* in, size_t n, uint16_t* out) {
  if (CpuSimdLevel() != SimdLevel::kScalar) {
    FloatsToHalvesF16c(in, n, out);
    return;
  }
  for (size_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}

void HalvesToFloats(const uint16_t* in, size_t n, float* out) {
  if (CpuSimdLevel() != SimdLevel::kScalar) {
    HalvesToFloatsF16c(in, n, out);
    return;
  }
  for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

uint16_t FloatToBfloat16(float value) {
  const uint32_t bits = FloatToBits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

float Bfloat16ToFloat(uint16_t value) { return BitsToFloat(static_cast<uint32_t>(value) << 16); }

void PackBfloat16Row(const float* in, int dim, uint16_t* out) {
  const int elements = PairedBfloat16Elements(dim);
  for (int block = 0; block < elements; block += 32) {
    for (int j = 0; j < 16; ++j) {
      const int low = block + j;
      const int high = block + j + 16;
      out[block + 2 * j] = low < dim ? FloatToBfloat16(in[low]) : 0;
      out[block + 2 * j + 1] = high < dim ? FloatToBfloat16(in[high]) : 0;
    }
  }
}

float PairedBfloat16At(const uint16_t* row, int i) {
  const int block = i & ~31;
  const int j = i & 31;
  return Bfloat16ToFloat(row[block + (j < 16 ? 2 * j : 2 * (j - 16) + 1)]);
}

}  // namespace eldr::internal
