// The refit window's compact storage (src/refit/signature_chunk.h): the half-precision round trip
// within its stated bound, the choice of the smaller encoding, chunk capacity, and reading ranges
// of chunks as one point set.
#include "refit/signature_chunk.h"

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace eldr::refit_internal {
namespace {

std::vector<float> Normalised(std::vector<float> row) {
  double sum = 0;
  for (float v : row) sum += static_cast<double>(v) * v;
  for (float& v : row) v = static_cast<float>(v / std::sqrt(sum));
  return row;
}

// A unit row of `dim` Gaussian entries, each kept with probability `density` (others zero).
std::vector<float> RandomRow(int dim, double density, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::bernoulli_distribution keep(density);
  std::vector<float> row(dim, 0.f);
  for (float& v : row) {
    if (keep(rng)) v = normal(rng);
  }
  row[static_cast<size_t>(seed % dim)] = 1.f;  // never all zero
  return Normalised(std::move(row));
}

std::vector<float> Decoded(absl::Span<const float> row) {
  EncodeScratch scratch;
  std::vector<float> out(row.size(), -1.f);
  DecodeSignature(EncodeSignature(row, &scratch), static_cast<int>(row.size()), out.data());
  return out;
}

// |y - x| <= max(2^-11 |x|, 2^-39 max|x|) entry by entry, zeros exact; returns the largest
// relative error among entries of at least max|x| * 2^-28 (binary16's normal range after the scale).
double CheckBound(absl::Span<const float> x, absl::Span<const float> y) {
  double max_abs = 0;
  for (float v : x) max_abs = std::max(max_abs, std::abs(static_cast<double>(v)));
  double worst_relative = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double error = std::abs(static_cast<double>(y[i]) - x[i]);
    if (x[i] == 0) {
      EXPECT_EQ(y[i], 0.f) << i;
      continue;
    }
    EXPECT_LE(error, std::max(std::ldexp(std::abs(static_cast<double>(x[i])), -11), std::ldexp(max_abs, -39)))
        << "entry " << i << " = " << x[i] << " decoded as " << y[i];
    if (std::abs(x[i]) >= std::ldexp(max_abs, -28)) worst_relative = std::max(worst_relative, error / std::abs(x[i]));
  }
  return worst_relative;
}

TEST(SignatureEncodingTest, RoundTripIsWithinTheHalfPrecisionBound) {
  // Dense and sparse unit rows of the default 48 x 128 geometry.
  for (const double density : {1.0, 0.3, 0.05}) {
    const std::vector<float> x = RandomRow(6144, density, 7);
    const double worst = CheckBound(x, Decoded(x));
    // The bound is the real one, not a loose one: rounding reaches close to it.
    EXPECT_GT(worst, std::ldexp(1.0, -12)) << density;
  }
  // Entries spread over 60 binades, far below binary16's normal range without the row scale.
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> binades(0, 60);
  std::vector<float> wide(2000);
  for (size_t i = 0; i < wide.size(); ++i) {
    wide[i] =
        static_cast<float>((i % 2 ? -1 : 1) * std::ldexp(1.0 + binades(rng) / 60, -static_cast<int>(binades(rng))));
  }
  wide[5] = 0;
  CheckBound(wide, Decoded(wide));
  // Not only unit rows: a large and a tiny scale (the row scale is exact either way).
  for (const float scale : {3.0e20f, 2.0e-25f}) {
    std::vector<float> scaled = RandomRow(512, 0.5, 11);
    for (float& v : scaled) v *= scale;
    CheckBound(scaled, Decoded(scaled));
  }
  // Values representable in binary16 under the scale come back exactly.
  const std::vector<float> exact = {0.5f, -0.25f, 0.375f, 0.f, std::ldexp(1.f, -30), 0.5f - std::ldexp(1.f, -12)};
  EXPECT_EQ(Decoded(exact), exact);
}

TEST(SignatureEncodingTest, ChoosesTheSmallerEncoding) {
  const int dim = 1664;  // 26 x 64: 104 bitmap words
  ASSERT_EQ(BitmapWords(dim), 104u);
  for (const int non_zero : {1, 50, 800, 1559, 1560, 1664}) {
    std::vector<float> row(dim, 0.f);
    for (int i = 0; i < non_zero; ++i) row[static_cast<size_t>(i) * dim / non_zero] = 1.f + i % 5;
    row = Normalised(std::move(row));
    EncodeScratch scratch;
    const EncodedSignature encoded = EncodeSignature(row, &scratch);
    const size_t bitmap = 104 + static_cast<size_t>(non_zero);
    EXPECT_EQ(encoded.encoding, bitmap < static_cast<size_t>(dim) ? RowEncoding::kBitmap : RowEncoding::kDense)
        << non_zero;
    EXPECT_EQ(encoded.elements.size(), std::min<size_t>(bitmap, dim)) << non_zero;
    // Either way the same values come back.
    std::vector<float> out(dim);
    DecodeSignature(encoded, dim, out.data());
    CheckBound(row, out);
  }
}

TEST(SignatureChunkTest, HoldsRowsUpToItsCapacity) {
  const int dim = 64;
  EncodeScratch scratch;
  const std::vector<float> dense = RandomRow(dim, 1.0, 1);
  const std::vector<float> sparse = RandomRow(dim, 0.1, 2);
  const size_t sparse_elements = EncodeSignature(sparse, &scratch).elements.size();
  ASSERT_LT(sparse_elements, static_cast<size_t>(dim));

  SignatureChunk chunk(dim, 3 * dim, 100);
  EXPECT_EQ(chunk.footprint_bytes(), SignatureChunk::FootprintBytes(3 * dim, 100));
  const absl::Time t0 = absl::FromUnixSeconds(100);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(chunk.Append(EncodeSignature(dense, &scratch), t0 + absl::Seconds(r)));
  EXPECT_FALSE(chunk.Append(EncodeSignature(sparse, &scratch), t0));  // no element left
  EXPECT_EQ(chunk.size(), 3);
  EXPECT_EQ(chunk.used_elements(), static_cast<size_t>(3 * dim));
  EXPECT_EQ(chunk.time(2), t0 + absl::Seconds(2));
  std::vector<float> out(dim);
  chunk.Decode(1, out.data());
  EXPECT_EQ(out, Decoded(dense));

  chunk.Clear();
  EXPECT_EQ(chunk.size(), 0);
  int rows = 0;
  while (chunk.Append(EncodeSignature(sparse, &scratch), t0)) ++rows;
  EXPECT_EQ(rows, static_cast<int>(3 * dim / sparse_elements));  // sparse rows take less room
  EXPECT_EQ(chunk.encoding(0), RowEncoding::kBitmap);
  EXPECT_EQ(chunk.row_elements(0), sparse_elements);
  chunk.Decode(rows - 1, out.data());
  EXPECT_EQ(out, Decoded(sparse));

  SignatureChunk few_rows(dim, 100 * dim, 2);
  EXPECT_TRUE(few_rows.Append(EncodeSignature(dense, &scratch), t0));
  EXPECT_TRUE(few_rows.Append(EncodeSignature(dense, &scratch), t0));
  EXPECT_FALSE(few_rows.Append(EncodeSignature(dense, &scratch), t0));  // no row left
}

TEST(SignatureRowsTest, ReadsRangesOfChunksInOrder) {
  const int dim = 48;
  EncodeScratch scratch;
  std::vector<std::vector<float>> rows;
  std::vector<std::shared_ptr<SignatureChunk>> chunks;
  for (int c = 0; c < 3; ++c) {
    chunks.push_back(std::make_shared<SignatureChunk>(dim, 10 * dim, 10));
    for (int r = 0; r < 10; ++r) {
      rows.push_back(RandomRow(dim, r % 2 ? 0.2 : 1.0, 100 * c + r));
      ASSERT_TRUE(chunks[c]->Append(EncodeSignature(rows.back(), &scratch), absl::FromUnixSeconds(10 * c + r)));
    }
  }
  // Rows 3..9 of the first chunk, all of the second, 0..4 of the third: window rows 3..24.
  SignatureRows window(4);
  window.set_dim(dim);
  window.Add(chunks[0], 3, 7);
  window.Add(chunks[1], 0, 10);
  window.Add(chunks[2], 0, 5);
  window.Add(chunks[2], 5, 0);  // empty ranges are ignored
  ASSERT_EQ(window.rows(), 22);
  EXPECT_EQ(window.block_rows(), 4);
  EXPECT_EQ(window.time(0), absl::FromUnixSeconds(3));
  EXPECT_EQ(window.time(21), absl::FromUnixSeconds(24));
  std::vector<float> scratch_rows;
  const absl::Span<const float> read = window.Read(5, 6, &scratch_rows);  // crosses into chunk 1
  ASSERT_EQ(read.size(), static_cast<size_t>(6 * dim));
  for (int i = 0; i < 6; ++i) {
    const std::vector<float> expected = Decoded(rows[static_cast<size_t>(3 + 5 + i)]);
    EXPECT_EQ(std::vector<float>(read.begin() + i * dim, read.begin() + (i + 1) * dim), expected) << i;
  }
  window.DropOldest(9);  // the first range and two rows of the second go
  ASSERT_EQ(window.rows(), 13);
  EXPECT_EQ(window.time(0), absl::FromUnixSeconds(12));
  const absl::Span<const float> first = window.Read(0, 1, &scratch_rows);
  EXPECT_EQ(std::vector<float>(first.begin(), first.end()), Decoded(rows[12]));
  window.DropOldest(100);
  EXPECT_EQ(window.rows(), 0);
}

}  // namespace
}  // namespace eldr::refit_internal
