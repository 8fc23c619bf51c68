// Tests of the centroid index: the SIMD kernels at every instruction-set level this CPU has, the
// binary16 conversions, decisions of the exact scorer against a double-precision reference,
// candidate recall of the FAISS reduced-space index, batched scoring, and input validation.
#include "eldr/core/centroid_index.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/centroid_index_internal.h"
#include "core/scorer_kernels.h"
#include "eldr/core/errors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

using internal::CpuSimdLevel;
using internal::FloatToHalf;
using internal::HalfToFloat;
using internal::KernelsFor;
using internal::SimdLevel;
using ::testing::HasSubstr;

// ---- Data ---------------------------------------------------------------------------------------

void Normalize(float* v, int dim) {
  double norm2 = 0;
  for (int i = 0; i < dim; ++i) norm2 += static_cast<double>(v[i]) * v[i];
  const double inv = norm2 > 0 ? 1.0 / std::sqrt(norm2) : 0.0;
  for (int i = 0; i < dim; ++i) v[i] = static_cast<float>(v[i] * inv);
}

// Unit rows with independent Gaussian entries (mixed signs).
std::vector<float> RandomRows(int rows, int dim, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> data(static_cast<size_t>(rows) * dim);
  for (float& v : data) v = normal(rng);
  for (int r = 0; r < rows; ++r) Normalize(data.data() + static_cast<size_t>(r) * dim, dim);
  return data;
}

// Signature-like clustered data: non-negative vectors. `domains` sparse-ish profiles; every
// centroid is its domain's profile plus its own perturbation; queries are a domain profile plus
// heavier per-request noise (a single request is noisier than a mean). Columns in `zero_columns`
// (a fraction of all) are zero everywhere, as experts with IDF weight 0 are.
struct Clustered {
  int dim = 0;
  int rows = 0;
  std::vector<float> centroids;
  std::vector<int> domain_of_row;
  std::vector<std::vector<float>> profiles;
};

Clustered MakeClustered(int rows, int dim, int domains, double zero_fraction, double row_spread, std::mt19937_64& rng) {
  Clustered c;
  c.dim = dim;
  c.rows = rows;
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  std::exponential_distribution<float> exponential(1.f);
  std::vector<char> zero(dim, 0);
  for (int i = 0; i < dim; ++i) zero[i] = uniform(rng) < zero_fraction;
  for (int d = 0; d < domains; ++d) {
    std::vector<float> profile(dim);
    for (int i = 0; i < dim; ++i) {
      // Each domain favours ~20% of the columns strongly.
      const float base = exponential(rng);
      profile[i] = zero[i] ? 0.f : (uniform(rng) < 0.2f ? 4.f * base : 0.5f * base);
    }
    Normalize(profile.data(), dim);
    c.profiles.push_back(std::move(profile));
  }
  c.centroids.resize(static_cast<size_t>(rows) * dim);
  for (int r = 0; r < rows; ++r) {
    const int d = r % domains;
    c.domain_of_row.push_back(d);
    float* row = c.centroids.data() + static_cast<size_t>(r) * dim;
    // Workers differ in how far they sit from their domain's profile.
    const float spread = static_cast<float>(row_spread) * (0.5f + uniform(rng));
    for (int i = 0; i < dim; ++i) {
      row[i] =
          zero[i] ? 0.f : std::max(0.f, c.profiles[d][i] + spread * (exponential(rng) - 1.f) / std::sqrt(float(dim)));
    }
    Normalize(row, dim);
  }
  return c;
}

// A request near worker `row`: its centroid plus per-request noise of relative size `noise`.
std::vector<float> QueryNear(const Clustered& c, int row, double noise, std::mt19937_64& rng) {
  std::exponential_distribution<float> exponential(1.f);
  std::vector<float> q(c.dim);
  const float* centroid = c.centroids.data() + static_cast<size_t>(row) * c.dim;
  for (int i = 0; i < c.dim; ++i) {
    q[i] = centroid[i] == 0.f && c.profiles[c.domain_of_row[row]][i] == 0.f
               ? 0.f
               : std::max(0.f,
                          centroid[i] + static_cast<float>(noise) * (exponential(rng) - 1.f) / std::sqrt(float(c.dim)));
  }
  Normalize(q.data(), c.dim);
  return q;
}

std::vector<double> ReferenceScores(const std::vector<float>& centroids, int rows, int dim, const float* q) {
  std::vector<double> scores(rows);
  for (int r = 0; r < rows; ++r) {
    double s = 0;
    for (int i = 0; i < dim; ++i) s += static_cast<double>(centroids[static_cast<size_t>(r) * dim + i]) * q[i];
    scores[r] = s;
  }
  return scores;
}

// Compares the band an index's Search output implies with the double-precision reference band.
// Rows within `tolerance` of the reference edge are not judged. Returns the number of rows
// decided differently; *best_mismatch is set when the best row differs while the reference's top
// two are more than `tolerance` apart.
int BandMismatches(const std::vector<ScoredRow>& got, const std::vector<double>& reference, double tau,
                   double tolerance, bool* best_mismatch) {
  const int rows = static_cast<int>(reference.size());
  const double ref_best = *std::max_element(reference.begin(), reference.end());
  const double ref_edge = ref_best - tau;
  float got_best = -1e30f;
  int got_best_row = -1;
  for (const ScoredRow& s : got) {
    if (s.score > got_best) {
      got_best = s.score;
      got_best_row = s.row;
    }
  }
  std::vector<char> in_band(rows, 0);
  for (const ScoredRow& s : got) in_band[s.row] = s.score >= got_best - static_cast<float>(tau);
  int mismatches = 0;
  for (int r = 0; r < rows; ++r) {
    if (std::fabs(reference[r] - ref_edge) <= tolerance) continue;
    const bool ref_in = reference[r] >= ref_edge;
    if (ref_in != static_cast<bool>(in_band[r])) ++mismatches;
  }
  std::vector<double> sorted = reference;
  std::sort(sorted.rbegin(), sorted.rend());
  const bool clear_winner = rows < 2 || sorted[0] - sorted[1] > tolerance;
  *best_mismatch = clear_winner && reference[got_best_row] != ref_best;
  return mismatches;
}

std::vector<SimdLevel> AvailableLevels() {
  std::vector<SimdLevel> levels = {SimdLevel::kScalar};
  if (static_cast<int>(CpuSimdLevel()) >= static_cast<int>(SimdLevel::kAvx2)) {
    levels.push_back(SimdLevel::kAvx2);
  }
  if (CpuSimdLevel() == SimdLevel::kAvx512) levels.push_back(SimdLevel::kAvx512);
  return levels;
}

// ---- binary16 conversions -----------------------------------------------------------------------

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

TEST(HalfConversionTest, RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), h) << "half 0x" << std::hex << h << " -> " << f;
  }
}

TEST(HalfConversionTest, KnownValues) {
  EXPECT_EQ(FloatToHalf(1.f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.f), 0x7c00);               // rounds to +Inf
  EXPECT_EQ(FloatToHalf(std::ldexp(1.f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.f, -26)), 0x0000);  // below half of it: rounds to 0
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.f, -24));
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  // Ties go to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  EXPECT_EQ(FloatToHalf(1.f + std::ldexp(1.f, -11)), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.f + 3 * std::ldexp(1.f, -11)), 0x3c02);
}

// The hardware conversion (F16C, round to nearest even) is the reference for random floats over
// the whole range, subnormals and overflow included.
__attribute__((target("f16c,avx"))) uint16_t HardwareHalf(float f) {
  return static_cast<uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
}

TEST(HalfConversionTest, MatchesHardwareOnRandomFloats) {
  if (CpuSimdLevel() == SimdLevel::kScalar) GTEST_SKIP() << "CPU without F16C";
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-30.f, 17.f);
  std::uniform_real_distribution<float> mantissa(1.f, 2.f);
  for (int i = 0; i < 200000; ++i) {
    float f = std::ldexp(mantissa(rng), static_cast<int>(exponent(rng)));
    if (i % 2) f = -f;
    ASSERT_EQ(FloatToHalf(f), HardwareHalf(f)) << f << " bits 0x" << std::hex << Bits(f);
  }
  std::vector<float> batch(1001);
  std::vector<uint16_t> halves(batch.size());
  for (float& f : batch) f = std::ldexp(mantissa(rng), static_cast<int>(exponent(rng)));
  internal::FloatsToHalves(batch.data(), batch.size(), halves.data());
  for (size_t i = 0; i < batch.size(); ++i) ASSERT_EQ(halves[i], FloatToHalf(batch[i]));
  // And back: every half converts in bulk as it does alone (a NaN stays a NaN; F16C quiets a
  // signalling one).
  std::vector<uint16_t> every(65536 + 5);
  for (size_t h = 0; h < every.size(); ++h) every[h] = static_cast<uint16_t>(h);
  std::vector<float> floats(every.size());
  internal::HalvesToFloats(every.data(), every.size(), floats.data());
  for (size_t h = 0; h < every.size(); ++h) {
    if (std::isnan(HalfToFloat(every[h]))) {
      ASSERT_TRUE(std::isnan(floats[h])) << h;
    } else {
      ASSERT_EQ(Bits(floats[h]), Bits(HalfToFloat(every[h]))) << h;
    }
  }
}

// ---- Kernels ------------------------------------------------------------------------------------

// Every level finds the largest magnitude and encodes rows in binary16 (dense and bitmap forms)
// exactly as the definitions in scorer_kernels.h say, for every tail length.
TEST(ScorerKernelsTest, HalfEncodingMatchesTheDefinitionAtEveryLevel) {
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal;
  for (SimdLevel level : AvailableLevels()) {
    const internal::ScorerKernels& kernels = KernelsFor(level);
    for (int dim : {0, 1, 15, 16, 17, 31, 100, 1664, 6144}) {
      for (double density : {0.0, 0.1, 0.6, 1.0}) {
        std::bernoulli_distribution keep(density);
        std::vector<float> row(dim, 0.f);
        for (float& v : row) {
          if (keep(rng)) v = normal(rng) * (keep(rng) ? 1.f : 1e-9f);  // some round to a zero half
        }
        uint32_t max_bits = 0;
        for (float v : row) max_bits = std::max(max_bits, Bits(std::abs(v)));
        ASSERT_EQ(kernels.max_magnitude_bits(row.data(), row.size()), max_bits) << SimdLevelName(level);
        const float scale = 4096.f;
        std::vector<uint16_t> halves(dim), words((dim + 15) / 16, 0xabcd), values(dim + 16);
        const size_t count = kernels.encode_halves(row.data(), dim, scale, halves.data(), words.data(), values.data());
        size_t expected_count = 0;
        for (int i = 0; i < dim; ++i) {
          const uint16_t h = FloatToHalf(row[i] * scale);
          ASSERT_EQ(halves[i], h) << SimdLevelName(level) << " dim " << dim << " entry " << i;
          const bool set = (h & 0x7fff) != 0;
          ASSERT_EQ(((words[i / 16] >> (i % 16)) & 1) != 0, set) << SimdLevelName(level) << " entry " << i;
          if (set) ASSERT_EQ(values[expected_count++], h) << SimdLevelName(level) << " entry " << i;
        }
        ASSERT_EQ(count, expected_count) << SimdLevelName(level) << " dim " << dim;
        if (dim % 16 != 0) ASSERT_EQ(words.back() >> (dim % 16), 0) << "bits beyond dim";
      }
    }
  }
  float nan = std::nanf("");
  EXPECT_GT(KernelsFor(CpuSimdLevel()).max_magnitude_bits(&nan, 1), 0x7f800000u);
}

// Every level expands a bitmap-sparse row like the definition, from a separate buffer and from the
// tail of the output itself (the refit window's in-place decode).
TEST(ScorerKernelsTest, ExpandBitmapMatchesTheDefinitionAtEveryLevel) {
  std::mt19937_64 rng(5);
  for (SimdLevel level : AvailableLevels()) {
    const internal::ExpandBitmapFn expand = KernelsFor(level).expand_bitmap;
    for (int dim : {1, 15, 16, 17, 100, 1664, 6144}) {
      for (double density : {0.0, 0.05, 0.5, 0.95, 1.0}) {
        std::bernoulli_distribution set(density);
        std::vector<uint16_t> words((dim + 15) / 16, 0);
        std::vector<float> expected(dim, 0.f), values;
        for (int i = 0; i < dim; ++i) {
          if (!set(rng)) continue;
          words[i / 16] = static_cast<uint16_t>(words[i / 16] | (1u << (i % 16)));
          expected[i] = static_cast<float>(i + 1);
          values.push_back(expected[i]);
        }
        std::vector<float> out(dim + 16, -1.f);  // the guard must stay untouched
        expand(words.data(), dim, values.data(), out.data());
        for (int i = 0; i < dim; ++i) ASSERT_EQ(out[i], expected[i]) << SimdLevelName(level) << " dim " << dim;
        for (int i = dim; i < dim + 16; ++i) ASSERT_EQ(out[i], -1.f) << SimdLevelName(level) << " guard";
        std::fill(out.begin(), out.end(), -1.f);
        std::copy(values.begin(), values.end(), out.begin() + (dim - static_cast<int>(values.size())));
        expand(words.data(), dim, out.data() + (dim - values.size()), out.data());
        for (int i = 0; i < dim; ++i) ASSERT_EQ(out[i], expected[i]) << SimdLevelName(level) << " in place, " << dim;
      }
    }
  }
}

TEST(ScorerKernelsTest, EveryLevelMatchesDoubleReference) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (SimdLevel level : AvailableLevels()) {
    const internal::ScorerKernels& kernels = KernelsFor(level);
    ASSERT_EQ(kernels.level, level);
    for (int dim : {0, 1, 7, 15, 16, 17, 31, 32, 33, 47, 100, 1664, 6144}) {
      for (int n : {0, 1, 2, 3, 4, 5, 6, 7, 9}) {
        // One spare element so that rows start unaligned (offset 1).
        std::vector<float> data(static_cast<size_t>(n) * dim + 1);
        for (float& v : data) v = normal(rng);
        std::vector<uint16_t> halves(data.size());
        for (size_t i = 0; i < data.size(); ++i) halves[i] = FloatToHalf(data[i]);
        std::vector<float> query(dim + 1);
        for (float& v : query) v = normal(rng);
        std::vector<const float*> f32_rows;
        std::vector<const uint16_t*> f16_rows;
        for (int r = 0; r < n; ++r) {
          f32_rows.push_back(data.data() + 1 + static_cast<size_t>(r) * dim);
          f16_rows.push_back(halves.data() + 1 + static_cast<size_t>(r) * dim);
        }
        // Paired-layout bfloat16 rows, one element off alignment as well.
        const int paired = internal::PairedBfloat16Elements(dim);
        std::vector<uint16_t> bf16(static_cast<size_t>(n) * paired + 1);
        std::vector<const uint16_t*> bf16_rows;
        for (int r = 0; r < n; ++r) {
          uint16_t* row = bf16.data() + 1 + static_cast<size_t>(r) * paired;
          internal::PackBfloat16Row(f32_rows[r], dim, row);
          bf16_rows.push_back(row);
        }
        std::vector<float> out32(n, -7.f), out16(n, -7.f), outbf(n, -7.f);
        kernels.dot_rows_f32(f32_rows.data(), n, query.data() + 1, dim, out32.data());
        kernels.dot_rows_f16(f16_rows.data(), n, query.data() + 1, dim, out16.data());
        kernels.dot_rows_bf16(bf16_rows.data(), n, query.data() + 1, dim, outbf.data());
        for (int r = 0; r < n; ++r) {
          double ref32 = 0, ref16 = 0, refbf = 0, magnitude = 0;
          for (int i = 0; i < dim; ++i) {
            ref32 += static_cast<double>(f32_rows[r][i]) * query[1 + i];
            ref16 += static_cast<double>(HalfToFloat(f16_rows[r][i])) * query[1 + i];
            const float bf = internal::Bfloat16ToFloat(internal::FloatToBfloat16(f32_rows[r][i]));
            ASSERT_EQ(internal::PairedBfloat16At(bf16_rows[r], i), bf);
            refbf += static_cast<double>(bf) * query[1 + i];
            magnitude += std::fabs(static_cast<double>(f32_rows[r][i]) * query[1 + i]);
          }
          EXPECT_NEAR(outbf[r], refbf,
                      internal::AccumulationDepth(dim) * std::ldexp(1.0, -24) * magnitude * 1.02 + 1e-30)
              << SimdLevelName(level) << " dim " << dim << " n " << n << " row " << r;
          // gamma_n * sum |products|, with the accumulation depth the kernels promise.
          const double tolerance = internal::AccumulationDepth(dim) * std::ldexp(1.0, -24) * magnitude * 1.01 + 1e-30;
          EXPECT_NEAR(out32[r], ref32, tolerance)
              << SimdLevelName(level) << " dim " << dim << " n " << n << " row " << r;
          EXPECT_NEAR(out16[r], ref16, tolerance)
              << SimdLevelName(level) << " dim " << dim << " n " << n << " row " << r;
        }
      }
    }
  }
}

TEST(ScorerKernelsTest, GatherColumnsKeepsTheMaskedColumnsInOrder) {
  std::mt19937_64 rng(12);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (SimdLevel level : AvailableLevels()) {
    for (int dim : {1, 8, 15, 16, 17, 100, 6144}) {
      for (double keep : {0.0, 0.3, 0.9, 1.0}) {
        std::vector<float> in(dim);
        for (float& v : in) v = uniform(rng);
        std::vector<uint16_t> masks((dim + 15) / 16, 0);
        std::vector<int> kept;
        for (int i = 0; i < dim; ++i) {
          if (uniform(rng) * 0.5f + 0.5f < keep) {
            kept.push_back(i);
            masks[i / 16] |= static_cast<uint16_t>(1u << (i % 16));
          }
        }
        std::vector<int> offsets(masks.size(), 0);
        for (size_t c = 1; c < masks.size(); ++c) {
          offsets[c] = offsets[c - 1] + __builtin_popcount(masks[c - 1]);
        }
        std::vector<float> out(kept.size() + 16, -9.f);
        const float sum = KernelsFor(level).gather_columns(in.data(), dim, masks.data(), offsets.data(), kept.data(),
                                                           static_cast<int>(kept.size()), out.data());
        double expected_sum = 0;
        for (size_t k = 0; k < kept.size(); ++k) {
          ASSERT_EQ(out[k], in[kept[k]]) << SimdLevelName(level) << " dim " << dim << " #" << k;
          expected_sum += static_cast<double>(in[kept[k]]) * in[kept[k]];
        }
        EXPECT_NEAR(sum, expected_sum, 1e-4 * (1 + expected_sum)) << SimdLevelName(level);
      }
    }
  }
}

TEST(ScorerKernelsTest, ConvertGatherInt16MatchesTheDefinitionAtEveryLevel) {
  std::mt19937_64 rng(33);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  for (SimdLevel level : AvailableLevels()) {
    for (int n : {1, 7, 8, 15, 16, 17, 31, 48, 50, 64, 100, 6144}) {
      for (double keep : {0.0, 0.3, 0.9, 1.0}) {
        for (bool weighted : {false, true}) {
          std::vector<int16_t> counts(n);
          for (int16_t& c : counts) c = static_cast<int16_t>(rng() % 300);
          if (n > 3) counts[n / 2] = -2;  // sets the sign bit of *bits
          std::string src(reinterpret_cast<const char*>(counts.data()), 2 * counts.size());
          src.insert(src.begin(), 'x');  // unaligned
          std::vector<float> weights(n);
          for (float& w : weights) w = 4 * uniform(rng);
          std::vector<uint16_t> masks((n + 15) / 16, 0);
          std::vector<int> kept;
          for (int i = 0; i < n; ++i) {
            if (uniform(rng) < keep) {
              kept.push_back(i);
              masks[i / 16] |= static_cast<uint16_t>(1u << (i % 16));
            }
          }
          std::vector<int> offsets(masks.size(), 0);
          for (size_t c = 1; c < masks.size(); ++c) offsets[c] = offsets[c - 1] + __builtin_popcount(masks[c - 1]);
          std::vector<float> out(kept.size() + 16, -9.f);
          float kept_sum = 0.5f;  // added to, not overwritten
          float kept_max = 0.f;   // raised, not overwritten
          int32_t bits = 0;
          const float full = KernelsFor(level).convert_gather_int16(src.data() + 1, weighted ? weights.data() : nullptr,
                                                                    n, masks.data(), offsets.data(), out.data(),
                                                                    &kept_sum, &kept_max, &bits);
          double expected_full = 0, expected_kept = 0.5;
          float expected_max = 0.f;
          for (int i = 0; i < n; ++i) {
            const double v = static_cast<double>(counts[i]) * (weighted ? weights[i] : 1.f);
            expected_full += v * v;
          }
          for (size_t k = 0; k < kept.size(); ++k) {
            const float want = static_cast<float>(counts[kept[k]]) * (weighted ? weights[kept[k]] : 1.f);
            ASSERT_EQ(out[k], want) << SimdLevelName(level) << " n " << n << " #" << k;
            expected_kept += static_cast<double>(want) * want;
            expected_max = std::max(expected_max, want);
          }
          EXPECT_NEAR(full, expected_full, 1e-5 * (1 + expected_full)) << SimdLevelName(level) << " n " << n;
          EXPECT_NEAR(kept_sum, expected_kept, 1e-5 * (1 + expected_kept)) << SimdLevelName(level) << " n " << n;
          EXPECT_EQ(bits<0, n> 3) << SimdLevelName(level) << " n " << n;
        }
      }
    }
  }
}

TEST(ScorerKernelsTest, Int8DotsAreExactAtEveryLevel) {
  std::mt19937_64 rng(41);
  for (const internal::Int8DotKernel& kernel : internal::AvailableInt8DotKernels()) {
    for (int padded : {64, 128, 192, 4544, 4544 / 64 * 64 + 64, 6144}) {
      for (int n : {1, 2, 3, 4, 5, 6, 7, 16, 17}) {
        std::vector<std::vector<int8_t>> rows(n, std::vector<int8_t>(padded));
        std::vector<const int8_t*> pointers;
        for (auto& row : rows) {
          for (int8_t& v : row) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
          pointers.push_back(row.data());
        }
        std::vector<uint8_t> query(padded);
        for (uint8_t& v : query) v = static_cast<uint8_t>(rng() % (kernel.query_max + 1));
        query[0] = static_cast<uint8_t>(kernel.query_max);  // the extremes: no saturation anywhere
        rows[0][0] = rows[0][1] = -127;
        query[1] = static_cast<uint8_t>(kernel.query_max);
        std::vector<int32_t> out(n, -1);
        kernel.dot(pointers.data(), n, query.data(), padded, out.data());
        for (int r = 0; r < n; ++r) {
          int64_t want = 0;
          for (int i = 0; i < padded; ++i) want += int64_t{query[i]} * rows[r][i];
          ASSERT_EQ(out[r], want) << kernel.name << " padded " << padded << " n " << n << " row " << r;
        }
      }
    }
  }
}

TEST(ScorerKernelsTest, QueryQuantisationMatchesTheDefinitionAtEveryLevel) {
  std::mt19937_64 rng(43);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  for (SimdLevel level : AvailableLevels()) {
    const internal::ScorerKernels& kernels = KernelsFor(level);
    for (int dim : {1, 7, 8, 9, 100, 4544}) {
      const int padded = (dim + 63) / 64 * 64;
      std::vector<float> q(dim);
      for (float& v : q) v = uniform(rng) * uniform(rng);
      std::vector<uint8_t> out(padded, 0xee);
      float scale = 0, residual2 = 0, quantised2 = 0;
      ASSERT_TRUE(kernels.quantise_query(q.data(), /*factor=*/1.f, dim, padded, kernels.int8_query_max,
                                         /*known_max=*/-1.f, out.data(), /*scaled=*/nullptr, &scale, &residual2,
                                         &quantised2));
      // A known maximum gives the same result without the checking pass.
      std::vector<uint8_t> hinted(padded, 0xee);
      float hinted_scale = 0, hinted_residual2 = 0, hinted_quantised2 = 0;
      ASSERT_TRUE(kernels.quantise_query(q.data(), 1.f, dim, padded, kernels.int8_query_max,
                                         *std::max_element(q.begin(), q.end()), hinted.data(), nullptr, &hinted_scale,
                                         &hinted_residual2, &hinted_quantised2));
      EXPECT_EQ(hinted, out);
      EXPECT_EQ(hinted_scale, scale);
      // Scaling on the way (the fused route decision's unnormalised values, with and without the
      // known maximum) is scaling first: the same levels, step, sums and scaled values.
      const float factor = 0.37f;
      std::vector<float> raw(dim), scaled_first(dim);
      for (int i = 0; i < dim; ++i) {
        raw[i] = q[i] / 0.37f;
        scaled_first[i] = raw[i] * factor;
      }
      for (bool known : {false, true}) {
        std::vector<uint8_t> first(padded, 0xee), fused(padded, 0xee);
        std::vector<float> written(dim, -1.f);
        float s1 = 0, r1 = 0, q1 = 0, s2 = 0, r2 = 0, q2 = 0;
        const float top_scaled = *std::max_element(scaled_first.begin(), scaled_first.end());
        ASSERT_TRUE(kernels.quantise_query(scaled_first.data(), 1.f, dim, padded, kernels.int8_query_max,
                                           known ? top_scaled : -1.f, first.data(), nullptr, &s1, &r1, &q1));
        ASSERT_TRUE(kernels.quantise_query(raw.data(), factor, dim, padded, kernels.int8_query_max,
                                           known ? top_scaled : -1.f, fused.data(), written.data(), &s2, &r2, &q2));
        EXPECT_EQ(fused, first) << SimdLevelName(level) << " dim " << dim;
        EXPECT_EQ(written, scaled_first) << SimdLevelName(level) << " dim " << dim;
        EXPECT_EQ(s2, s1);
        EXPECT_EQ(r2, r1);
        EXPECT_EQ(q2, q1);
      }
      const float top = *std::max_element(q.begin(), q.end());
      EXPECT_FLOAT_EQ(scale, top / kernels.int8_query_max);
      double want_residual = 0, want_quantised = 0;
      for (int i = 0; i < dim; ++i) {
        ASSERT_LE(out[i], kernels.int8_query_max);
        const double value = out[i] * static_cast<double>(scale);
        ASSERT_LE(std::fabs(value - q[i]), 0.5001 * scale) << SimdLevelName(level) << " dim " << dim << " #" << i;
        want_residual += (value - q[i]) * (value - q[i]);
        want_quantised += value * value;
      }
      for (int i = dim; i < padded; ++i) ASSERT_EQ(out[i], 0);
      EXPECT_NEAR(residual2, want_residual, 1e-3 * want_residual + 1e-12) << SimdLevelName(level);
      EXPECT_NEAR(quantised2, want_quantised, 1e-4 * want_quantised) << SimdLevelName(level);
      // A negative value or a NaN: refused (the index scans in fp32 instead).
      for (float bad : {-1e-3f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        std::vector<float> spoiled = q;
        spoiled[dim / 2] = bad;
        EXPECT_FALSE(kernels.quantise_query(spoiled.data(), 1.f, dim, padded, kernels.int8_query_max, -1.f, out.data(),
                                            nullptr, &scale, &residual2, &quantised2))
            << SimdLevelName(level) << " " << bad;
      }
    }
  }
}

TEST(SelectBestTest, PutsTheKHighestScoresFirstLikeASort) {
  std::mt19937_64 rng(5);
  std::vector<std::pair<float, int>> buffer;
  auto check = [&](std::vector<std::pair<float, int>> pairs, int k, const std::string& what) {
    const int n = static_cast<int>(pairs.size());
    std::vector<std::pair<float, int>> expected = pairs;
    std::sort(expected.begin(), expected.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<std::pair<float, int>> before = pairs;
    internal::SelectBest(pairs.data(), n, k, &buffer);
    // The same pairs, rearranged.
    std::vector<std::pair<float, int>> sorted_before = before, sorted_after = pairs;
    std::sort(sorted_before.begin(), sorted_before.end());
    std::sort(sorted_after.begin(), sorted_after.end());
    ASSERT_EQ(sorted_after, sorted_before) << what;
    // The front's scores are the k highest (as a multiset), and none behind beats one in front.
    std::vector<float> front_scores, expected_scores;
    for (int i = 0; i < k; ++i) front_scores.push_back(pairs[i].first);
    for (int i = 0; i < k; ++i) expected_scores.push_back(expected[i].first);
    std::sort(front_scores.begin(), front_scores.end());
    std::sort(expected_scores.begin(), expected_scores.end());
    ASSERT_EQ(front_scores, expected_scores) << what << " k " << k;
    if (k > 0 && k < n) {
      float lowest_front = pairs[0].first;
      for (int i = 0; i < k; ++i) lowest_front = std::min(lowest_front, pairs[i].first);
      for (int i = k; i < n; ++i) ASSERT_LE(pairs[i].first, lowest_front) << what << " k " << k << " at " << i;
    }
  };
  for (int n : {0, 1, 2, 16, 17, 33, 176, 1024}) {
    for (int trial = 0; trial < 4; ++trial) {
      std::vector<std::pair<float, int>> random(n), few_values(n), equal(n), ascending(n);
      std::uniform_real_distribution<float> uniform(-1.f, 1.f);
      for (int i = 0; i < n; ++i) {
        random[i] = {uniform(rng), i};
        few_values[i] = {static_cast<float>(rng() % 3), i};  // many ties
        equal[i] = {0.5f, i};
        ascending[i] = {static_cast<float>(i), i};
      }
      if (n > 0) random[rng() % n].first = -std::numeric_limits<float>::infinity();
      for (int k : {0, 1, n / 3, n / 2, n - 1, n}) {
        if (k < 0 || k > n) continue;
        check(random, k, "random n " + std::to_string(n));
        check(few_values, k, "few values n " + std::to_string(n));
        check(equal, k, "equal n " + std::to_string(n));
        check(ascending, k, "ascending n " + std::to_string(n));
      }
    }
  }
}

TEST(ScorerKernelsTest, AccumulatePanelsIsATransposedMatrixTimesVector) {
  using internal::PanelFloats;
  using internal::PanelIndex;
  std::mt19937_64 rng(21);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (SimdLevel level : AvailableLevels()) {
    for (int k : {1, 5, 32}) {
      for (int n : {1, 15, 16, 17, 63, 64, 65, 100, 257}) {
        std::vector<float> matrix(static_cast<size_t>(n) * k);  // row-major n x k
        for (float& v : matrix) v = normal(rng);
        // The kernels load panels with aligned loads: place them on a 64-byte boundary.
        std::vector<float> storage(PanelFloats(n, k) + 16, 0.f);
        float* panels = storage.data();
        while (reinterpret_cast<uintptr_t>(panels) % 64 != 0) ++panels;
        for (int j = 0; j < n; ++j) {
          for (int c = 0; c < k; ++c) panels[PanelIndex(j, c, k)] = matrix[static_cast<size_t>(j) * k + c];
        }
        std::vector<float> weights(k);
        for (float& w : weights) w = normal(rng);
        std::vector<float> out(n + 1, -5.f);
        KernelsFor(level).accumulate_panels(panels, k, n, weights.data(), out.data());
        for (int j = 0; j < n; ++j) {
          double expected = 0;
          for (int c = 0; c < k; ++c) expected += weights[c] * matrix[static_cast<size_t>(j) * k + c];
          ASSERT_NEAR(out[j], expected, 1e-4) << SimdLevelName(level) << " k " << k << " n " << n << " row " << j;
        }
        EXPECT_EQ(out[n], -5.f) << "wrote past n";
      }
    }
  }
}

TEST(ScorerKernelsTest, Bfloat16Conversions) {
  using internal::Bfloat16ToFloat;
  using internal::FloatToBfloat16;
  EXPECT_EQ(FloatToBfloat16(1.f), 0x3f80);
  EXPECT_EQ(Bfloat16ToFloat(0x3f80), 1.f);
  EXPECT_EQ(FloatToBfloat16(-2.f), 0xc000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to even (1); 1 + 3 * 2^-8 goes up.
  EXPECT_EQ(FloatToBfloat16(1.f + std::ldexp(1.f, -8)), 0x3f80);
  EXPECT_EQ(FloatToBfloat16(1.f + 3 * std::ldexp(1.f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(Bfloat16ToFloat(FloatToBfloat16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(Bfloat16ToFloat(FloatToBfloat16(std::numeric_limits<float>::max()))));
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uniform(-100.f, 100.f);
  for (int i = 0; i < 10000; ++i) {
    const float f = uniform(rng);
    EXPECT_LE(std::fabs(Bfloat16ToFloat(FloatToBfloat16(f)) - f), std::ldexp(std::fabs(f), -8));
  }
}

TEST(ScorerKernelsTest, LevelNamesAndDetection) {
  EXPECT_EQ(internal::SimdLevelName(SimdLevel::kScalar), "scalar");
  EXPECT_EQ(internal::SimdLevelName(SimdLevel::kAvx2), "avx2");
  EXPECT_EQ(internal::SimdLevelName(SimdLevel::kAvx512), "avx512");
  EXPECT_LE(static_cast<int>(internal::DetectSimdLevel()), static_cast<int>(CpuSimdLevel()));
  // Asking for more than the CPU has is clamped.
  EXPECT_LE(static_cast<int>(KernelsFor(SimdLevel::kAvx512).level), static_cast<int>(CpuSimdLevel()));
}

// ---- Exact scorer: decisions against the double-precision reference -----------------------------

// The three scan formats of the exact scorer, with the score tolerance each guarantees for unit
// vectors (the certified bound, rounded up).
struct ScanCase {
  const char* kind;
  bool half;
  HalfFormat format;
  double tolerance;
  CentroidIndexOptions Options() const {
    CentroidIndexOptions options;
    options.half_precision = half;
    options.half_format = format;
    return options;
  }
};
const ScanCase kScanCases[] = {
    {"exact_bf16", true, HalfFormat::kAuto, 3e-2},     {"exact_bf16", true, HalfFormat::kBfloat16, 4.5e-3},
    {"exact_fp16", true, HalfFormat::kBinary16, 6e-4}, {"exact_int8", true, HalfFormat::kInt8, 3e-2},
    {"exact", false, HalfFormat::kBfloat16, 1e-5},
};

// Columns that are non-zero in at least one centroid.
int KeptColumns(const Clustered& data) {
  int kept = 0;
  for (int i = 0; i < data.dim; ++i) {
    for (int r = 0; r < data.rows; ++r) {
      if (data.centroids[static_cast<size_t>(r) * data.dim + i] != 0.f) {
        ++kept;
        break;
      }
    }
  }
  return kept;
}

struct DecisionCase {
  const char* name;
  bool clustered;
  int rows;
  int dim;
};

TEST(ExactIndexTest, DecidesAsDoubleReferenceExceptNearTheEdge) {
  const DecisionCase cases[] = {
      {"random", false, 16, 1664},   {"random", false, 37, 300},   {"clustered", true, 16, 6144},
      {"clustered", true, 64, 1664}, {"clustered", true, 8, 6144},
  };
  std::mt19937_64 rng(2024);
  int judged_queries = 0;
  for (const DecisionCase& c : cases) {
    Clustered data;
    if (c.clustered) {
      data = MakeClustered(c.rows, c.dim, /*domains=*/4, /*zero_fraction=*/0.4, /*row_spread=*/3.0, rng);
    } else {
      data.dim = c.dim;
      data.rows = c.rows;
      data.centroids = RandomRows(c.rows, c.dim, rng);
    }
    for (double tau : {0.0, 0.05, 0.1, 0.3}) {
      for (const ScanCase& scan : kScanCases) {
        CentroidIndexOptions options = scan.Options();
        options.band_tau = tau;
        auto index = BuildCentroidIndexOfKind(CentroidIndexKind::kExact, data.centroids, c.rows, c.dim, options);
        ASSERT_TRUE(index.ok()) << index.status();
        const bool auto_fp32 = KeptColumns(data) < 2048 || internal::DetectSimdLevel() == SimdLevel::kScalar;
        if (scan.format != HalfFormat::kAuto) {
          EXPECT_EQ((*index)->kind(), scan.kind);
        } else if (auto_fp32) {
          EXPECT_EQ((*index)->kind(), "exact");
        } else {  // by pool size and instruction set (PicksTheImplementationByPoolSize)
          EXPECT_THAT(std::string((*index)->kind()), ::testing::AnyOf("exact_bf16", "exact_int8"));
        }
        std::vector<ScoredRow> got;
        for (int k = 0; k < 60; ++k) {
          std::vector<float> q =
              c.clustered ? QueryNear(data, static_cast<int>(rng() % data.rows), 0.5, rng) : RandomRows(1, c.dim, rng);
          ASSERT_TRUE((*index)->Search(q, &got).ok());
          ASSERT_EQ(got.size(), static_cast<size_t>(c.rows));
          std::vector<double> reference = ReferenceScores(data.centroids, c.rows, c.dim, q.data());
          bool best_mismatch = false;
          const int mismatches = BandMismatches(got, reference, tau, 1e-4, &best_mismatch);
          EXPECT_EQ(mismatches, 0) << c.name << " " << c.rows << "x" << c.dim << " tau " << tau << " " << scan.kind
                                   << " query " << k;
          EXPECT_FALSE(best_mismatch) << c.name << " tau " << tau << " query " << k;
          // Every score is within the 16-bit error bound of the reference.
          for (const ScoredRow& s : got) {
            EXPECT_NEAR(s.score, reference[s.row], scan.tolerance) << scan.kind;
          }
          ++judged_queries;
        }
      }
    }
  }
  EXPECT_EQ(judged_queries, 5 * 4 * static_cast<int>(std::size(kScanCases)) * 60);
}

// A row placed 1.5e-4 above the band edge whose 16-bit score falls below it: the rounding errors
// of 16 coordinates add up coherently. Refinement must put it back in the band, for both formats.
TEST(ExactIndexTest, RefinementRescuesRowsThat16BitScansMisplace) {
  const int dim = 64;
  const double tau = 0.1;
  std::vector<float> q(dim, 0.f);
  for (int i = 0; i < 16; ++i) q[i] = 0.25f;  // unit norm; a row's score is 4x its first value
  // Row: `value` on columns 0-14, `last` on column 15, the rest of the unit norm elsewhere.
  auto make_row = [&](float value, float last) {
    std::vector<float> row(dim, 0.f);
    for (int i = 0; i < 15; ++i) row[i] = value;
    row[15] = last;
    const float rest = std::sqrt((1.f - 15 * value * value - last * last) / (dim - 16));
    for (int i = 16; i < dim; ++i) row[i] = rest;
    return row;
  };
  for (HalfFormat format : {HalfFormat::kBfloat16, HalfFormat::kBinary16}) {
    auto round16 = [format](float v) {
      return format == HalfFormat::kBinary16 ? HalfToFloat(FloatToHalf(v))
                                             : internal::Bfloat16ToFloat(internal::FloatToBfloat16(v));
    };
    // A best row the format represents exactly (so its score is exact in the scan), and an edge
    // row whose score is 1.5e-4 above best - tau but whose 16 values all round down enough to put
    // its scanned score below it. The best row's last value moves the edge in fine steps until
    // the edge row's rounding works out.
    const float best_value = round16(0.225f);
    float best_last = 0, edge_value = 0;
    for (float last = round16(0.2f); last < 0.25f && edge_value == 0; last = std::nextafter(last, 1.f)) {
      if (round16(last) != last) continue;
      const double best_score = 0.25 * (15.0 * best_value + last);
      const float v = static_cast<float>((best_score - tau + 1.5e-4) / 4.0);
      if (4.0 * round16(v) < best_score - tau - 1e-5) {
        best_last = last;
        edge_value = v;
      }
    }
    ASSERT_NE(edge_value, 0.f) << "setup: no adversarial row found";
    std::vector<float> centroids;
    for (const std::vector<float>& row :
         {make_row(best_value, best_last), make_row(edge_value, edge_value), make_row(0.15f, 0.15f)}) {
      centroids.insert(centroids.end(), row.begin(), row.end());
    }
    const std::vector<double> reference = ReferenceScores(centroids, 3, dim, q.data());
    ASSERT_GT(reference[1] - (reference[0] - tau), 1e-4);
    ASSERT_LT(reference[1] - (reference[0] - tau), 2e-4);

    CentroidIndexOptions options;
    options.half_format = format;
    // Without refinement at this edge (index tuned for another tau), the scan misplaces row 1.
    options.band_tau = 0.3;
    auto unrefined = BuildCentroidIndexOfKind(CentroidIndexKind::kExact, centroids, 3, dim, options);
    ASSERT_TRUE(unrefined.ok());
    std::vector<ScoredRow> got;
    ASSERT_TRUE((*unrefined)->Search(q, &got).ok());
    ASSERT_LT(got[1].score, got[0].score - tau) << "setup: the scan must misplace row 1";

    options.band_tau = tau;
    auto index = BuildCentroidIndexOfKind(CentroidIndexKind::kExact, centroids, 3, dim, options);
    ASSERT_TRUE(index.ok());
    const int64_t refined_before = internal::RefinedRowsOnThisThread();
    ASSERT_TRUE((*index)->Search(q, &got).ok());
    EXPECT_EQ(internal::RefinedRowsOnThisThread() - refined_before, 2) << "best and edge rows";
    EXPECT_GE(got[1].score, got[0].score - tau);
    EXPECT_NEAR(got[1].score, reference[1], 1e-6);
    EXPECT_NEAR(got[0].score, reference[0], 1e-6);
    bool best_mismatch = false;
    EXPECT_EQ(BandMismatches(got, reference, tau, 1e-4, &best_mismatch), 0);
    EXPECT_FALSE(best_mismatch);
  }
}

// Rows placed just above and below the band edge (best - tau) of non-negative queries, closer than
// the 8-bit scan's error bound: each must end on its own side, as in double precision.
TEST(ExactIndexTest, Int8ScanDecidesRowsAtTheBandEdgeAsDouble) {
  std::mt19937_64 rng(77);
  std::uniform_real_distribution<double> uniform(0, 1);
  const int dim = 4544;
  const double tau = 0.1;
  const double offsets[] = {-5e-3, -1e-3, -2e-4, 2e-4, 1e-3, 5e-3};
  int judged = 0;
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<double> q(dim);
    double norm = 0;
    for (double& v : q) {
      v = uniform(rng) < 0.3 ? 0 : std::pow(uniform(rng), 2);
      norm += v * v;
    }
    for (double& v : q) v /= std::sqrt(norm);
    // u: a unit vector orthogonal to q.
    std::vector<double> u(dim);
    double dot = 0, unorm = 0;
    for (int i = 0; i < dim; ++i) {
      u[i] = uniform(rng) - 0.5;
      dot += u[i] * q[i];
    }
    for (int i = 0; i < dim; ++i) {
      u[i] -= dot * q[i];
      unorm += u[i] * u[i];
    }
    for (double& v : u) v /= std::sqrt(unorm);
    const int rows = 2 + static_cast<int>(std::size(offsets));
    std::vector<float> centroids(static_cast<size_t>(rows) * dim);
    for (int i = 0; i < dim; ++i) centroids[i] = static_cast<float>(q[i]);  // row 0: the best, score 1
    for (int r = 1; r < rows; ++r) {
      const double target = r == rows - 1 ? 0.5 : 1 - tau + offsets[r - 1];
      const double side = std::sqrt(1 - target * target);
      for (int i = 0; i < dim; ++i) {
        centroids[static_cast<size_t>(r) * dim + i] = static_cast<float>(target * q[i] + side * u[i]);
      }
    }
    CentroidIndexOptions options;
    options.half_format = HalfFormat::kInt8;
    options.band_tau = tau;
    auto index = BuildCentroidIndexOfKind(CentroidIndexKind::kExact, centroids, rows, dim, options);
    ASSERT_TRUE(index.ok()) << index.status();
    ASSERT_EQ((*index)->kind(), "exact_int8");
    std::vector<float> query(q.begin(), q.end());
    std::vector<ScoredRow> got;
    ASSERT_TRUE((*index)->Search(query, &got).ok());
    const std::vector<double> reference = ReferenceScores(centroids, rows, dim, query.data());
    float best = -1;
    for (const ScoredRow& s : got) best = std::max(best, s.score);
    const double best_reference = *std::max_element(reference.begin(), reference.end());
    for (const ScoredRow& s : got) {
      const bool in_band = s.score >= best - static_cast<float>(tau);
      const bool in_reference_band = reference[s.row] >= best_reference - tau;
      if (std::fabs(reference[s.row] - (best_reference - tau)) < 1e-4) continue;  // fp32 itself may differ
      EXPECT_EQ(in_band, in_reference_band)
          << "trial " << trial << " row " << s.row << " score " << s.score << " reference " << reference[s.row];
      ++judged;
    }
  }
  EXPECT_GE(judged, 20 * 7);
  // These queries need re-scoring: the rows sit inside the 8-bit bound of the edge.
  EXPECT_GT(internal::RefinedRowsOnThisThread(), 0);
}

TEST(ExactIndexTest, NothingIsRescoredWhenNoRowIsNearTheEdge) {
  // Scores 0.9, 0.5 and 0.2 with tau 0.1: far from the edge at 0.8, the scan decides alone.
  const int dim = 32;
  std::vector<float> centroids(3 * dim, 0.f);
  const float values[3] = {0.9f, 0.5f, 0.2f};
  for (int r = 0; r < 3; ++r) {
    centroids[r * dim] = values[r];
    centroids[r * dim + 1 + r] = std::sqrt(1 - values[r] * values[r]);
  }
  std::vector<float> q(dim, 0.f);
  q[0] = 1.f;
  CentroidIndexOptions options;
  options.half_format = HalfFormat::kBfloat16;
  auto index = BuildCentroidIndex(centroids, 3, dim, options);
  ASSERT_TRUE(index.ok());
  EXPECT_EQ((*index)->kind(), "exact_bf16");
  std::vector<ScoredRow> got;
  const int64_t refined_before = internal::RefinedRowsOnThisThread();
  ASSERT_TRUE((*index)->Search(q, &got).ok());
  EXPECT_EQ(internal::RefinedRowsOnThisThread(), refined_before);
  for (int r = 0; r < 3; ++r) EXPECT_NEAR(got[r].score, values[r], 4.5e-3);
}

TEST(ExactIndexTest, DropsAllZeroColumnsWithoutChangingScores) {
  std::mt19937_64 rng(5);
  Clustered data = MakeClustered(12, 512, 3, /*zero_fraction=*/0.6, 3.0, rng);
  CentroidIndexOptions options;
  options.half_precision = false;
  auto index = BuildCentroidIndexOfKind(CentroidIndexKind::kExact, data.centroids, 12, 512, options);
  ASSERT_TRUE(index.ok());
  // A query with mass on the dropped columns: they must not contribute.
  std::vector<float> q = RandomRows(1, 512, rng);
  std::vector<ScoredRow> got;
  ASSERT_TRUE((*index)->Search(q, &got).ok());
  const std::vector<double> reference = ReferenceScores(data.centroids, 12, 512, q.data());
  for (const ScoredRow& s : got) EXPECT_NEAR(s.score, reference[s.row], 1e-5);
  std::vector<float> batch(12);
  ASSERT_TRUE((*index)->ScoreBatch(q, 1, absl::MakeSpan(batch)).ok());
  for (int r = 0; r < 12; ++r) EXPECT_NEAR(batch[r], reference[r], 1e-5);
}

TEST(ExactIndexTest, ConcurrentSearchesAgree) {
  std::mt19937_64 rng(9);
  Clustered data = MakeClustered(16, 1664, 4, 0.3, 3.0, rng);
  CentroidIndexOptions options;
  options.half_format = HalfFormat::kBfloat16;  // the scan plus refinement path
  auto index = BuildCentroidIndex(data.centroids, 16, 1664, options);
  ASSERT_TRUE(index.ok());
  std::vector<std::vector<float>> queries;
  std::vector<std::vector<ScoredRow>> expected(32);
  for (int k = 0; k < 32; ++k) {
    queries.push_back(QueryNear(data, static_cast<int>(rng() % data.rows), 0.5, rng));
    ASSERT_TRUE((*index)->Search(queries[k], &expected[k]).ok());
  }
  std::vector<int> failures(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<ScoredRow> got;
      for (int round = 0; round < 50; ++round) {
        for (int k = 0; k < 32; ++k) {
          if (!(*index)->Search(queries[k], &got).ok()) ++failures[t];
          for (size_t i = 0; i < got.size(); ++i) {
            if (got[i].row != expected[k][i].row || got[i].score != expected[k][i].score) {
              ++failures[t];
            }
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_THAT(failures, ::testing::Each(0));
}

// ---- Large pools --------------------------------------------------------------------------------

struct RecallStats {
  int queries = 0;
  int best_found = 0;
  int band_matches = 0;
  double mean_band = 0;
};

RecallStats MeasureRecall(const CentroidIndex& index, const Clustered& data, double tau, int queries,
                          std::mt19937_64& rng) {
  RecallStats stats;
  std::vector<ScoredRow> got;
  for (int k = 0; k < queries; ++k) {
    std::vector<float> q = QueryNear(data, static_cast<int>(rng() % data.rows), 0.5, rng);
    EXPECT_TRUE(index.Search(q, &got).ok());
    const std::vector<double> reference = ReferenceScores(data.centroids, data.rows, data.dim, q.data());
    const int best = static_cast<int>(std::max_element(reference.begin(), reference.end()) - reference.begin());
    bool found = false;
    for (const ScoredRow& s : got) {
      found |= s.row == best;
      EXPECT_NEAR(s.score, reference[s.row], 4.5e-3) << "candidates are re-scored";
    }
    bool best_mismatch = false;
    const int mismatches = BandMismatches(got, reference, tau, 1e-4, &best_mismatch);
    const double edge = reference[best] - tau;
    stats.mean_band += std::count_if(reference.begin(), reference.end(), [edge](double s) { return s >= edge; });
    ++stats.queries;
    stats.best_found += found;
    stats.band_matches += mismatches == 0 && !best_mismatch;
  }
  stats.mean_band /= std::max(1, stats.queries);
  std::printf("%s: %d queries, best among candidates %d, band as exact %d, mean band %.1f rows\n",
              std::string(index.kind()).c_str(), stats.queries, stats.best_found, stats.band_matches, stats.mean_band);
  return stats;
}

// Hundreds of workers in a few domains, each worker its own sub-cluster. With 32 domains and
// spread 0.5 the band at tau 0.1 holds ~9 workers; with 8 domains and spread 0.4, ~60 (more than
// the first round of candidates, so the search has to widen).
Clustered LargePool(int rows, int dim, int domains, double spread, std::mt19937_64& rng) {
  return MakeClustered(rows, dim, domains, /*zero_fraction=*/0.4, spread, rng);
}

TEST(ReducedIndexTest, FlatCandidatesContainTheBestAndTheBand) {
  std::mt19937_64 rng(77);
  struct Pool {
    int domains;
    double spread;
    double min_mean_band;
  };
  for (const Pool& pool : {Pool{32, 0.5, 4.0}, Pool{8, 0.4, 40.0}}) {
    const Clustered data = LargePool(512, 1664, pool.domains, pool.spread, rng);
    auto index = BuildCentroidIndexOfKind(CentroidIndexKind::kFaissReduced, data.centroids, data.rows, data.dim,
                                          CentroidIndexOptions());
    ASSERT_TRUE(index.ok()) << index.status();
    EXPECT_EQ((*index)->kind(), "faiss_pca_flat");
    EXPECT_EQ((*index)->rows(), 512);
    EXPECT_EQ((*index)->dim(), 1664);
    const RecallStats stats = MeasureRecall(**index, data, 0.1, 200, rng);
    EXPECT_GE(stats.mean_band, pool.min_mean_band) << "the data must exercise wide bands";
    // Measured: 200/200 for both (docs/benchmarks.md); the margin allows other libm/RNG builds.
    EXPECT_GE(stats.best_found, 0.99 * stats.queries);
    EXPECT_GE(stats.band_matches, 0.97 * stats.queries) << "mean band " << stats.mean_band;
  }
}

// Every row inside the band (tau 2 covers all of [-1, 1]) makes the rounds widen past the rows the
// first selection set apart (about 1.5 x twice the first round), up to max_candidates: the later
// rounds must select from all the rows, and no row may be fetched twice or lost.
TEST(ReducedIndexTest, RoundsPastTheFirstSelectionFetchEveryRowOnce) {
  std::mt19937_64 rng(81);
  const Clustered data = LargePool(1024, 256, 8, 0.4, rng);
  CentroidIndexOptions options;
  options.band_tau = 2.0;
  options.candidates = 16;
  for (int max_candidates : {1024, 300}) {
    options.max_candidates = max_candidates;
    auto index =
        BuildCentroidIndexOfKind(CentroidIndexKind::kFaissReduced, data.centroids, data.rows, data.dim, options);
    ASSERT_TRUE(index.ok()) << index.status();
    for (int k = 0; k < 20; ++k) {
      const std::vector<float> q = QueryNear(data, static_cast<int>(rng() % data.rows), 0.5, rng);
      std::vector<ScoredRow> got;
      ASSERT_TRUE((*index)->Search(q, &got).ok());
      // 16, 32, ..., 512, then the cap.
      ASSERT_EQ(got.size(), static_cast<size_t>(max_candidates));
      std::vector<char> seen(data.rows, 0);
      const std::vector<double> reference = ReferenceScores(data.centroids, data.rows, data.dim, q.data());
      for (const ScoredRow& s : got) {
        ASSERT_GE(s.row, 0);
        ASSERT_LT(s.row, data.rows);
        EXPECT_EQ(seen[s.row], 0) << "row " << s.row << " fetched twice";
        seen[s.row] = 1;
        EXPECT_NEAR(s.score, reference[s.row], 4.5e-3);
      }
      if (max_candidates == data.rows) {
        const int best = static_cast<int>(std::max_element(reference.begin(), reference.end()) - reference.begin());
        EXPECT_EQ(seen[best], 1);
      }
    }
  }
}

// The 8-bit projection takes non-negative queries only (signatures are); a query with negative
// values is projected in fp32 instead and finds its best row and band as well.
TEST(ReducedIndexTest, QueriesWithNegativeValuesAreProjectedInFp32) {
  std::mt19937_64 rng(82);
  const Clustered data = LargePool(512, 1664, 32, 0.5, rng);
  auto index = BuildCentroidIndexOfKind(CentroidIndexKind::kFaissReduced, data.centroids, data.rows, data.dim,
                                        CentroidIndexOptions());
  ASSERT_TRUE(index.ok()) << index.status();
  int best_found = 0, band_matches = 0;
  constexpr int kQueries = 100;
  for (int k = 0; k < kQueries; ++k) {
    std::vector<float> q = QueryNear(data, static_cast<int>(rng() % data.rows), 0.5, rng);
    for (int i = 0; i < data.dim; i += 7) q[i] -= 0.01f;  // a few hundred small negative values
    Normalize(q.data(), data.dim);
    std::vector<ScoredRow> got;
    ASSERT_TRUE((*index)->Search(q, &got).ok());
    const std::vector<double> reference = ReferenceScores(data.centroids, data.rows, data.dim, q.data());
    const int best = static_cast<int>(std::max_element(reference.begin(), reference.end()) - reference.begin());
    best_found += std::any_of(got.begin(), got.end(), [best](const ScoredRow& s) { return s.row == best; });
    bool best_mismatch = false;
    band_matches += BandMismatches(got, reference, 0.1, 1e-4, &best_mismatch) == 0 && !best_mismatch;
  }
  EXPECT_GE(best_found, 0.99 * kQueries);
  EXPECT_GE(band_matches, 0.97 * kQueries);
}

TEST(ReducedIndexTest, HnswCandidatesContainTheBest) {
  std::mt19937_64 rng(78);
  const Clustered data = LargePool(512, 1664, 32, 0.5, rng);
  CentroidIndexOptions options;
  options.use_hnsw = true;
  auto index = BuildCentroidIndexOfKind(CentroidIndexKind::kFaissReduced, data.centroids, data.rows, data.dim, options);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ((*index)->kind(), "faiss_pca_hnsw");
  const RecallStats stats = MeasureRecall(**index, data, 0.1, 200, rng);
  // Measured: 200/200 best and band (docs/benchmarks.md); HNSW is approximate, hence the margin.
  EXPECT_GE(stats.best_found, 0.97 * stats.queries);
  EXPECT_GE(stats.band_matches, 0.95 * stats.queries) << "mean band " << stats.mean_band;
}

TEST(ReducedIndexTest, SmallPoolsAndFewRowsStillWork) {
  // Fewer rows than reduced_dims and candidates: every row is a candidate, so the result is exact,
  // whatever the scan format of the candidates.
  std::mt19937_64 rng(79);
  const Clustered data = MakeClustered(6, 256, 2, 0.0, 3.0, rng);
  for (const ScanCase& scan : kScanCases) {
    auto index = BuildCentroidIndexOfKind(CentroidIndexKind::kFaissReduced, data.centroids, 6, 256, scan.Options());
    ASSERT_TRUE(index.ok()) << index.status();
    for (int k = 0; k < 20; ++k) {
      std::vector<float> q = QueryNear(data, k % 6, 0.5, rng);
      std::vector<ScoredRow> got;
      ASSERT_TRUE((*index)->Search(q, &got).ok());
      ASSERT_EQ(got.size(), 6u);
      const std::vector<double> reference = ReferenceScores(data.centroids, 6, 256, q.data());
      for (const ScoredRow& s : got) EXPECT_NEAR(s.score, reference[s.row], scan.tolerance);
      bool best_mismatch = false;
      EXPECT_EQ(BandMismatches(got, reference, 0.1, 1e-4, &best_mismatch), 0) << scan.kind;
      EXPECT_FALSE(best_mismatch);
    }
  }
}

TEST(ReducedIndexTest, OneAndTwoRows) {
  std::mt19937_64 rng(80);
  for (int rows : {1, 2}) {
    const std::vector<float> centroids = RandomRows(rows, 40, rng);
    auto index =
        BuildCentroidIndexOfKind(CentroidIndexKind::kFaissReduced, centroids, rows, 40, CentroidIndexOptions());
    ASSERT_TRUE(index.ok()) << rows << " rows: " << index.status();
    const std::vector<float> q = RandomRows(1, 40, rng);
    std::vector<ScoredRow> got;
    ASSERT_TRUE((*index)->Search(q, &got).ok());
    ASSERT_EQ(got.size(), static_cast<size_t>(rows));
    const std::vector<double> reference = ReferenceScores(centroids, rows, 40, q.data());
    for (const ScoredRow& s : got) EXPECT_NEAR(s.score, reference[s.row], 4.5e-3);
  }
}

TEST(BuildCentroidIndexTest, PicksTheImplementationByPoolSize) {
  std::mt19937_64 rng(3);
  const std::vector<float> centroids = RandomRows(40, 128, rng);
  CentroidIndexOptions options;
  options.large_pool_min_rows = 40;
  auto large = BuildCentroidIndex(centroids, 40, 128, options);
  ASSERT_TRUE(large.ok());
  EXPECT_EQ((*large)->kind(), "faiss_pca_flat");
  options.large_pool_min_rows = 41;
  auto small = BuildCentroidIndex(centroids, 40, 128, options);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ((*small)->kind(), "exact") << "short rows scan in fp32 under kAuto";
  options.half_format = HalfFormat::kBfloat16;
  auto small_bf16 = BuildCentroidIndex(centroids, 40, 128, options);
  ASSERT_TRUE(small_bf16.ok());
  EXPECT_EQ((*small_bf16)->kind(), "exact_bf16");
  options.half_format = HalfFormat::kBinary16;
  auto small_fp16 = BuildCentroidIndex(centroids, 40, 128, options);
  ASSERT_TRUE(small_fp16.ok());
  EXPECT_EQ((*small_fp16)->kind(), "exact_fp16");
  options.half_precision = false;
  auto small32 = BuildCentroidIndex(centroids, 40, 128, options);
  ASSERT_TRUE(small32.ok());
  EXPECT_EQ((*small32)->kind(), "exact");

  // Long rows under kAuto: bfloat16 for small pools, the 8-bit first stage from 20 rows on (16 with AVX2); both
  // only with vector kernels (the portable ones scan fp32 fastest).
  const bool portable = internal::DetectSimdLevel() == SimdLevel::kScalar;
  const std::vector<float> long_rows = RandomRows(32, 4096, rng);
  auto long_auto =
      BuildCentroidIndex(absl::MakeConstSpan(long_rows).subspan(0, 8 * 4096), 8, 4096, CentroidIndexOptions());
  ASSERT_TRUE(long_auto.ok());
  EXPECT_EQ((*long_auto)->kind(), portable ? "exact" : "exact_bf16") << "long rows, 8 of them, under kAuto";
  auto long_32 = BuildCentroidIndex(long_rows, 32, 4096, CentroidIndexOptions());
  ASSERT_TRUE(long_32.ok());
  EXPECT_EQ((*long_32)->kind(), portable ? "exact" : "exact_int8") << "long rows, 32 of them, under kAuto";
  EXPECT_EQ(CentroidIndexOptions().large_pool_min_rows, 128);
}

// ---- Batches ------------------------------------------------------------------------------------

TEST(ScoreBatchTest, MatchesReferenceForBothImplementations) {
  std::mt19937_64 rng(13);
  const Clustered data = MakeClustered(150, 700, 5, 0.3, 6.0, rng);
  const int n = 23;
  std::vector<float> queries;
  for (int k = 0; k < n; ++k) {
    std::vector<float> q = QueryNear(data, k % data.rows, 0.5, rng);
    queries.insert(queries.end(), q.begin(), q.end());
  }
  for (CentroidIndexKind kind : {CentroidIndexKind::kExact, CentroidIndexKind::kFaissReduced}) {
    auto index = BuildCentroidIndexOfKind(kind, data.centroids, data.rows, data.dim, CentroidIndexOptions());
    ASSERT_TRUE(index.ok()) << index.status();
    std::vector<float> scores(static_cast<size_t>(n) * data.rows);
    ASSERT_TRUE((*index)->ScoreBatch(queries, n, absl::MakeSpan(scores)).ok());
    for (int k = 0; k < n; ++k) {
      const std::vector<double> reference =
          ReferenceScores(data.centroids, data.rows, data.dim, queries.data() + k * data.dim);
      for (int r = 0; r < data.rows; ++r) {
        ASSERT_NEAR(scores[static_cast<size_t>(k) * data.rows + r], reference[r], 2e-5)
            << (*index)->kind() << " query " << k << " row " << r;
      }
    }
    // Empty batch.
    EXPECT_TRUE((*index)->ScoreBatch({}, 0, {}).ok());
  }
}

TEST(ScoreAllPairsTest, ComputesRowMajorProducts) {
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};                    // 2 x 3
  const std::vector<float> b = {1, 0, 0, 0, 1, 1, 2, 2, 2, 0, 0, 0};  // 4 x 3
  std::vector<float> c(8, -1.f);
  ScoreAllPairs(a, 2, b, 4, 3, absl::MakeSpan(c));
  EXPECT_THAT(c, ::testing::ElementsAre(1, 5, 12, 0, 4, 11, 30, 0));
  std::vector<float> zero_dim(4, -1.f);
  ScoreAllPairs({}, 2, {}, 2, 0, absl::MakeSpan(zero_dim));
  EXPECT_THAT(zero_dim, ::testing::Each(0.f));
}

// ---- Validation ---------------------------------------------------------------------------------

TEST(CentroidIndexValidationTest, RejectsBadBuildInput) {
  const std::vector<float> four(4, 0.5f);
  auto wrong_size = BuildCentroidIndex(four, 2, 3, CentroidIndexOptions());
  EXPECT_EQ(wrong_size.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RejectReasonOf(wrong_size.status()), RejectReason::kGeometry);
  EXPECT_THAT(wrong_size.status().message(), HasSubstr("need 6 values, got 4"));

  EXPECT_EQ(RejectReasonOf(BuildCentroidIndex({}, 0, 4, CentroidIndexOptions()).status()), RejectReason::kGeometry);
  EXPECT_EQ(RejectReasonOf(BuildCentroidIndex({}, 1, 0, CentroidIndexOptions()).status()), RejectReason::kGeometry);
  EXPECT_EQ(BuildCentroidIndex({}, 1 << 20, 1 << 20, CentroidIndexOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);

  const std::vector<float> zeros(8, 0.f);
  auto all_zero = BuildCentroidIndex(zeros, 2, 4, CentroidIndexOptions());
  EXPECT_EQ(all_zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(all_zero.status().message(), HasSubstr("all zeros"));

  std::vector<float> nan = four;
  nan[3] = std::nanf("");
  auto non_finite = BuildCentroidIndex(nan, 2, 2, CentroidIndexOptions());
  EXPECT_EQ(RejectReasonOf(non_finite.status()), RejectReason::kNonFinite);
  EXPECT_THAT(non_finite.status().message(), HasSubstr("row 1, column 1"));

  for (auto mutate : std::vector<void (*)(CentroidIndexOptions&)>{
           [](CentroidIndexOptions& o) { o.large_pool_min_rows = 0; },
           [](CentroidIndexOptions& o) { o.reduced_dims = -1; },
           [](CentroidIndexOptions& o) { o.candidates = -1; },
           [](CentroidIndexOptions& o) { o.max_candidates = 0; },
           [](CentroidIndexOptions& o) { o.candidates = 300; },
           [](CentroidIndexOptions& o) { o.band_tau = -0.1; },
           [](CentroidIndexOptions& o) { o.band_tau = std::nan(""); },
           [](CentroidIndexOptions& o) { o.hnsw_neighbors = 1; },
       }) {
    CentroidIndexOptions options;
    mutate(options);
    auto built = BuildCentroidIndex(four, 2, 2, options);
    EXPECT_EQ(built.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(built.status().message(), HasSubstr("CentroidIndexOptions."));
  }
}

TEST(CentroidIndexValidationTest, RejectsBadQueries) {
  std::mt19937_64 rng(1);
  const std::vector<float> centroids = RandomRows(8, 32, rng);
  for (CentroidIndexKind kind : {CentroidIndexKind::kExact, CentroidIndexKind::kFaissReduced}) {
    auto index = BuildCentroidIndexOfKind(kind, centroids, 8, 32, CentroidIndexOptions());
    ASSERT_TRUE(index.ok());
    std::vector<ScoredRow> got;
    const std::vector<float> short_query(31, 0.1f);
    const absl::Status status = (*index)->Search(short_query, &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(RejectReasonOf(status), RejectReason::kGeometry);
    EXPECT_THAT(status.message(), HasSubstr("31 values"));

    // A non-finite query (the transform never produces one) is not rejected by the hot path but
    // must not crash or return rows out of range.
    std::vector<float> nan_query(32, 0.1f);
    nan_query[5] = std::nanf("");
    ASSERT_TRUE((*index)->Search(nan_query, &got).ok());
    for (const ScoredRow& s : got) {
      EXPECT_GE(s.row, 0);
      EXPECT_LT(s.row, 8);
    }

    std::vector<float> scores(8);
    EXPECT_EQ(RejectReasonOf((*index)->ScoreBatch(short_query, 1, absl::MakeSpan(scores))), RejectReason::kGeometry);
    const std::vector<float> one(32, 0.1f);
    std::vector<float> too_few(7);
    EXPECT_EQ(RejectReasonOf((*index)->ScoreBatch(one, 1, absl::MakeSpan(too_few))), RejectReason::kGeometry);
    EXPECT_EQ(RejectReasonOf((*index)->ScoreBatch(one, -1, absl::MakeSpan(scores))), RejectReason::kGeometry);
  }
}

}  // namespace
}  // namespace eldr
