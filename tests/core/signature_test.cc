#include "eldr/core/signature.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/signature_kernels.h"
#include "eldr/core/errors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr {
namespace {

using ::testing::HasSubstr;

// int16 little-endian bytes, written byte by byte so the test does not depend on host order.
std::string Int16Bytes(const std::vector<int32_t>& values) {
  std::string bytes;
  for (int32_t v : values) {
    const uint16_t u = static_cast<uint16_t>(static_cast<int16_t>(v));
    bytes.push_back(static_cast<char>(u & 0xff));
    bytes.push_back(static_cast<char>(u >> 8));
  }
  return bytes;
}

std::vector<int32_t> RandomCounts(int layers, int experts, uint32_t seed, int max_count = 40) {
  std::mt19937 rng(seed);
  std::vector<int32_t> counts(static_cast<size_t>(layers) * experts);
  for (auto& c : counts) c = static_cast<int32_t>(rng() % (max_count + 1));
  return counts;
}

std::vector<float> RandomIdf(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(0.0f, 4.0f);
  std::vector<float> idf(n);
  for (auto& w : idf) w = dist(rng);
  return idf;
}

// The transform computed independently in double precision.
std::vector<double> Reference(const SignatureSpec& spec, const std::vector<double>& raw) {
  const std::vector<int> mask = spec.EffectiveMask();
  std::vector<double> out;
  for (size_t j = 0; j < mask.size(); ++j) {
    for (int e = 0; e < spec.experts; ++e) {
      double v = raw[static_cast<size_t>(mask[j]) * spec.experts + e];
      if (spec.variant == SignatureVariant::kCountIdf) v *= spec.idf[j * spec.experts + e];
      out.push_back(v);
    }
  }
  double norm = 0;
  for (double v : out) norm += v * v;
  norm = std::sqrt(norm);
  for (double& v : out) v /= norm;
  return out;
}

std::vector<double> AsDouble(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 2e-6) << "at " << i;
  }
}

SignatureTransform MakeTransform(SignatureSpec spec) {
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(std::move(spec));
  EXPECT_TRUE(transform.ok()) << transform.status();
  return *std::move(transform);
}

SignatureSpec CountIdfSpec(int layers, int experts, std::vector<int> mask, uint32_t seed = 7) {
  SignatureSpec spec;
  spec.layers = layers;
  spec.experts = experts;
  spec.variant = SignatureVariant::kCountIdf;
  spec.layer_mask = std::move(mask);
  spec.idf = RandomIdf(spec.dim(), seed);
  return spec;
}

void ExpectReject(const absl::Status& status, absl::StatusCode code, RejectReason reason, absl::string_view text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_EQ(RejectReasonOf(status), reason) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(std::string(text)));
}

// ---- Names and spec --------------------------------------------------------------------------

TEST(SignatureVariantTest, ParsesEveryNameIncludingReferenceAlias) {
  EXPECT_EQ(*ParseSignatureVariant("count"), SignatureVariant::kCount);
  EXPECT_EQ(*ParseSignatureVariant("count_idf"), SignatureVariant::kCountIdf);
  EXPECT_EQ(*ParseSignatureVariant("gate_prob"), SignatureVariant::kGateProb);
  EXPECT_EQ(*ParseSignatureVariant("gate_prob_all"), SignatureVariant::kGateProb);
  const absl::Status unknown = ParseSignatureVariant("tfidf").status();
  ExpectReject(unknown, absl::StatusCode::kInvalidArgument, RejectReason::kMalformed, "tfidf");
  EXPECT_EQ(SignatureVariantName(SignatureVariant::kGateProb), "gate_prob");
  EXPECT_EQ(SignatureVariantName(SignatureVariant::kCountIdf), "count_idf");
}

TEST(SignatureSpecTest, MaskDefinesDimension) {
  SignatureSpec spec;
  spec.layers = 26;
  spec.experts = 64;
  EXPECT_EQ(spec.masked_layers(), 26);
  EXPECT_EQ(spec.dim(), 26 * 64);
  EXPECT_EQ(spec.EffectiveMask().size(), 26u);
  EXPECT_EQ(spec.EffectiveMask()[25], 25);
  spec.layer_mask = {1, 4, 9};
  EXPECT_EQ(spec.dim(), 3 * 64);
  EXPECT_EQ(spec.EffectiveMask(), (std::vector<int>{1, 4, 9}));
}

TEST(SignatureSpecTest, ValidationNamesEachFailedCheck) {
  SignatureSpec spec = CountIdfSpec(4, 8, {0, 2});
  EXPECT_TRUE(ValidateSignatureSpec(spec).ok());

  SignatureSpec bad = spec;
  bad.layers = 0;
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry,
               "layers (L) must be >= 1");
  bad = spec;
  bad.experts = -2;
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry,
               "experts (e) must be >= 1");
  bad = spec;
  bad.layer_mask = {0, 4};
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry,
               "layer_mask[1] = 4 is outside [0, 4)");
  bad = spec;
  bad.layer_mask = {-1, 2};
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry, "outside");
  bad = spec;
  bad.layer_mask = {2, 1};
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kMalformed,
               "sorted and distinct");
  bad = spec;
  bad.layer_mask = {1, 1};
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kMalformed,
               "sorted and distinct");
  bad = spec;
  bad.idf.pop_back();
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry,
               "sig_idf has 15 weights, expected");
  bad = spec;
  bad.idf[3] = std::numeric_limits<float>::quiet_NaN();
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kNonFinite, "sig_idf[3]");
  bad = spec;
  bad.idf[5] = -0.5f;
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kMalformed, "sig_idf[5]");
  bad = spec;
  std::fill(bad.idf.begin(), bad.idf.end(), 0.f);
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kMalformed, "all zeros");
  bad = spec;
  bad.variant = SignatureVariant::kCount;
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kMalformed,
               "only valid for variant count_idf");
  bad = spec;
  bad.layers = 1 << 15;
  bad.experts = 1 << 10;
  bad.layer_mask.clear();
  bad.idf.clear();
  bad.variant = SignatureVariant::kCount;
  ExpectReject(ValidateSignatureSpec(bad), absl::StatusCode::kInvalidArgument, RejectReason::kOversized, "exceeds");
  EXPECT_FALSE(SignatureTransform::Create(bad).ok());
}

// ---- Correct transforms ------------------------------------------------------------------------

TEST(SignatureTransformTest, CountAllLayersMatchesReferenceForInt16AndInt32) {
  SignatureSpec spec;
  spec.layers = 48;
  spec.experts = 128;
  spec.variant = SignatureVariant::kCount;
  const SignatureTransform transform = MakeTransform(spec);
  const std::vector<int32_t> counts = RandomCounts(48, 128, 1);
  const std::string bytes = Int16Bytes(counts);
  std::vector<float> from16(transform.dim()), from32(transform.dim());
  ASSERT_TRUE(transform.Apply(CountsInt16Le{48, 128, bytes}, absl::MakeSpan(from16)).ok());
  ASSERT_TRUE(transform.Apply(CountsInt32{48, 128, counts}, absl::MakeSpan(from32)).ok());
  ExpectNear(from16, Reference(spec, AsDouble(counts)));
  EXPECT_EQ(from16, from32);
}

TEST(SignatureTransformTest, CountIdfWithMaskMatchesReference) {
  const SignatureSpec spec = CountIdfSpec(26, 64, {0, 3, 4, 11, 25});
  const SignatureTransform transform = MakeTransform(spec);
  const std::vector<int32_t> counts = RandomCounts(26, 64, 2);
  std::vector<float> out(transform.dim());
  ASSERT_TRUE(transform.Apply(CountsInt16Le{26, 64, Int16Bytes(counts)}, absl::MakeSpan(out)).ok());
  ExpectNear(out, Reference(spec, AsDouble(counts)));
  std::vector<float> out32(transform.dim());
  ASSERT_TRUE(transform.Apply(CountsInt32{26, 64, counts}, absl::MakeSpan(out32)).ok());
  ExpectNear(out32, Reference(spec, AsDouble(counts)));
}

TEST(SignatureTransformTest, CountIdfAllLayersMatchesReference) {
  const SignatureSpec spec = CountIdfSpec(48, 128, {});
  const SignatureTransform transform = MakeTransform(spec);
  const std::vector<int32_t> counts = RandomCounts(48, 128, 3, 3000);
  std::vector<float> out(transform.dim());
  ASSERT_TRUE(transform.Apply(CountsInt16Le{48, 128, Int16Bytes(counts)}, absl::MakeSpan(out)).ok());
  ExpectNear(out, Reference(spec, AsDouble(counts)));
}

TEST(SignatureTransformTest, OddGeometriesUseTheTailPaths) {
  // Row lengths that are not multiples of the vector width, and masked rows of 13 experts.
  for (int experts : {1, 7, 13, 33}) {
    const SignatureSpec spec = CountIdfSpec(5, experts, {1, 2, 4});
    const SignatureTransform transform = MakeTransform(spec);
    const std::vector<int32_t> counts = RandomCounts(5, experts, 10 + experts);
    std::vector<int32_t> nonzero = counts;
    nonzero[1 * experts] = 5;  // make sure the masked part is not all zero
    std::vector<float> out(transform.dim());
    ASSERT_TRUE(transform.Apply(CountsInt16Le{5, experts, Int16Bytes(nonzero)}, absl::MakeSpan(out)).ok());
    ExpectNear(out, Reference(spec, AsDouble(nonzero)));
  }
}

TEST(SignatureTransformTest, GateProbMatchesReference) {
  SignatureSpec spec;
  spec.layers = 6;
  spec.experts = 40;
  spec.variant = SignatureVariant::kGateProb;
  spec.layer_mask = {0, 5};
  const SignatureTransform transform = MakeTransform(spec);
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> dist(0.f, 3.f);
  std::vector<float> sums(6 * 40);
  for (auto& v : sums) v = dist(rng);
  std::vector<float> out(transform.dim());
  ASSERT_TRUE(transform.Apply(GateProbSums{6, 40, sums}, absl::MakeSpan(out)).ok());
  ExpectNear(out, Reference(spec, std::vector<double>(sums.begin(), sums.end())));
}

TEST(SignatureTransformTest, HugeFiniteGateSumsStillNormalise) {
  SignatureSpec spec;
  spec.layers = 2;
  spec.experts = 4;
  spec.variant = SignatureVariant::kGateProb;
  const SignatureTransform transform = MakeTransform(spec);
  const std::vector<float> sums = {3e30f, 0, 0, 4e30f, 0, 0, 0, 0};
  std::vector<float> out(transform.dim());
  ASSERT_TRUE(transform.Apply(GateProbSums{2, 4, sums}, absl::MakeSpan(out)).ok());
  EXPECT_NEAR(out[0], 0.6f, 1e-6);
  EXPECT_NEAR(out[3], 0.8f, 1e-6);
}

TEST(SignatureTransformTest, TransformedVectorIsRenormalised) {
  const SignatureSpec spec = CountIdfSpec(3, 4, {0, 2});
  const SignatureTransform transform = MakeTransform(spec);
  std::vector<float> vector(transform.dim(), 0.f);
  vector[0] = 3.f;
  vector[7] = -4.f;  // any sign is allowed for an already transformed vector
  std::vector<float> out(transform.dim());
  ASSERT_TRUE(transform.Apply(TransformedVector{vector}, absl::MakeSpan(out)).ok());
  EXPECT_FLOAT_EQ(out[0], 0.6f);
  EXPECT_FLOAT_EQ(out[7], -0.8f);
}

TEST(SignatureTransformTest, WeightedSkipsNormalisationAndAcceptsZero) {
  const SignatureSpec spec = CountIdfSpec(3, 4, {1});
  const SignatureTransform transform = MakeTransform(spec);
  std::vector<int32_t> counts(12, 0);
  counts[4 + 2] = 5;
  std::vector<float> out(transform.dim());
  ASSERT_TRUE(transform.Weighted(CountsInt32{3, 4, counts}, absl::MakeSpan(out)).ok());
  EXPECT_FLOAT_EQ(out[2], 5.f * spec.idf[2]);
  EXPECT_FLOAT_EQ(out[0], 0.f);
  const std::vector<int32_t> zeros(12, 0);
  EXPECT_TRUE(transform.Weighted(CountsInt32{3, 4, zeros}, absl::MakeSpan(out)).ok());
  const std::vector<int32_t> negative = {0, 0, 0, 0, -1, 0, 0, 0, 0, 0, 0, 0};
  ExpectReject(transform.Weighted(CountsInt32{3, 4, negative}, absl::MakeSpan(out)), absl::StatusCode::kInvalidArgument,
               RejectReason::kNegativeCount, "negative");
}

// ---- Every rejection ---------------------------------------------------------------------------

class SignatureRejectionTest : public ::testing::Test {
 protected:
  SignatureRejectionTest() : spec_(CountIdfSpec(4, 8, {1, 3})), transform_(MakeTransform(spec_)), out_(spec_.dim()) {
    counts_ = RandomCounts(4, 8, 5);
    counts_[1 * 8] = 2;
  }
  absl::Status Apply(const SignatureInput& input) { return transform_.Apply(input, absl::MakeSpan(out_)); }

  SignatureSpec spec_;
  SignatureTransform transform_;
  std::vector<float> out_;
  std::vector<int32_t> counts_;
};

TEST_F(SignatureRejectionTest, GeometryMismatchForEveryInputKind) {
  const std::string bytes = Int16Bytes(counts_);
  ExpectReject(Apply(CountsInt16Le{5, 8, bytes}), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry,
               "5x8 does not match the calibrated transform (4 layers x 8");
  ExpectReject(Apply(CountsInt16Le{4, 9, bytes}), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry, "4x9");
  ExpectReject(Apply(CountsInt16Le{-4, 8, bytes}), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry, "-4x8");
  ExpectReject(Apply(CountsInt32{4, 7, counts_}), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry, "4x7");
  std::vector<float> gate(32, 1.f);
  SignatureSpec gate_spec;
  gate_spec.layers = 4;
  gate_spec.experts = 8;
  gate_spec.variant = SignatureVariant::kGateProb;
  const SignatureTransform gate_transform = MakeTransform(gate_spec);
  std::vector<float> out(gate_transform.dim());
  ExpectReject(gate_transform.Apply(GateProbSums{3, 8, gate}, absl::MakeSpan(out)), absl::StatusCode::kInvalidArgument,
               RejectReason::kGeometry, "3x8");
  ExpectReject(gate_transform.Apply(GateProbSums{4, 8, absl::MakeConstSpan(gate).subspan(1)}, absl::MakeSpan(out)),
               absl::StatusCode::kInvalidArgument, RejectReason::kGeometry, "need 32 values, got 31");
  std::vector<float> vector(spec_.dim() + 1, 1.f);
  ExpectReject(Apply(TransformedVector{vector}), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry,
               "has 17 values");
}

TEST_F(SignatureRejectionTest, ByteLengthChecks) {
  std::string bytes = Int16Bytes(counts_);
  ExpectReject(Apply(CountsInt16Le{4, 8, absl::string_view(bytes).substr(0, 63)}), absl::StatusCode::kInvalidArgument,
               RejectReason::kWrongEncoding, "even byte length, got 63");
  ExpectReject(Apply(CountsInt16Le{4, 8, absl::string_view(bytes).substr(0, 62)}), absl::StatusCode::kInvalidArgument,
               RejectReason::kGeometry, "need 64 bytes, got 62");
  bytes += "xy";
  ExpectReject(Apply(CountsInt16Le{4, 8, bytes}), absl::StatusCode::kInvalidArgument, RejectReason::kGeometry,
               "got 66");
  ExpectReject(Apply(CountsInt32{4, 8, absl::MakeConstSpan(counts_).subspan(0, 31)}),
               absl::StatusCode::kInvalidArgument, RejectReason::kGeometry, "need 32 values, got 31");
}

TEST_F(SignatureRejectionTest, NegativeCountsInMaskedAndUnmaskedLayers) {
  for (int cell : {1 * 8 + 3, 0 * 8 + 5, 2 * 8 + 7, 3 * 8}) {
    std::vector<int32_t> bad = counts_;
    bad[cell] = -1;
    ExpectReject(Apply(CountsInt16Le{4, 8, Int16Bytes(bad)}), absl::StatusCode::kInvalidArgument,
                 RejectReason::kNegativeCount, "negative");
    ExpectReject(Apply(CountsInt32{4, 8, bad}), absl::StatusCode::kInvalidArgument, RejectReason::kNegativeCount,
                 "negative");
  }
  // int16 -32768 (0x8000) is negative too.
  std::vector<int32_t> bad = counts_;
  bad[9] = -32768;
  ExpectReject(Apply(CountsInt16Le{4, 8, Int16Bytes(bad)}), absl::StatusCode::kInvalidArgument,
               RejectReason::kNegativeCount, "negative");
}

TEST_F(SignatureRejectionTest, NonFiniteAndNegativeFloats) {
  SignatureSpec gate_spec;
  gate_spec.layers = 4;
  gate_spec.experts = 8;
  gate_spec.variant = SignatureVariant::kGateProb;
  gate_spec.layer_mask = {0, 1};
  const SignatureTransform gate = MakeTransform(gate_spec);
  std::vector<float> out(gate.dim());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (int cell : {3, 9, 20, 31}) {  // masked (0, 1) and unmasked (2, 3) layers
    for (float value : {nan, inf, -inf}) {
      std::vector<float> sums(32, 0.5f);
      sums[cell] = value;
      ExpectReject(gate.Apply(GateProbSums{4, 8, sums}, absl::MakeSpan(out)), absl::StatusCode::kInvalidArgument,
                   RejectReason::kNonFinite, absl::StrCat("layer ", cell / 8, " expert ", cell % 8));
    }
    std::vector<float> sums(32, 0.5f);
    sums[cell] = -0.25f;
    ExpectReject(gate.Apply(GateProbSums{4, 8, sums}, absl::MakeSpan(out)), absl::StatusCode::kInvalidArgument,
                 RejectReason::kNegativeCount, absl::StrCat("layer ", cell / 8, " expert ", cell % 8, " is negative"));
  }
  std::vector<float> vector(spec_.dim(), 0.1f);
  vector[4] = nan;
  ExpectReject(Apply(TransformedVector{vector}), absl::StatusCode::kInvalidArgument, RejectReason::kNonFinite,
               "value 4");
}

TEST_F(SignatureRejectionTest, WrongEncodingForVariant) {
  SignatureSpec gate_spec;
  gate_spec.layers = 4;
  gate_spec.experts = 8;
  gate_spec.variant = SignatureVariant::kGateProb;
  const SignatureTransform gate = MakeTransform(gate_spec);
  std::vector<float> out(gate.dim());
  ExpectReject(gate.Apply(CountsInt16Le{4, 8, Int16Bytes(counts_)}, absl::MakeSpan(out)),
               absl::StatusCode::kInvalidArgument, RejectReason::kWrongEncoding, "gate_prob");
  ExpectReject(gate.Apply(CountsInt32{4, 8, counts_}, absl::MakeSpan(out)), absl::StatusCode::kInvalidArgument,
               RejectReason::kWrongEncoding, "gate_prob");
  const std::vector<float> sums(32, 1.f);
  ExpectReject(Apply(GateProbSums{4, 8, sums}), absl::StatusCode::kInvalidArgument, RejectReason::kWrongEncoding,
               "count_idf transform, which needs integer counts");
}

TEST_F(SignatureRejectionTest, ZeroAfterMaskIsFailedPrecondition) {
  std::vector<int32_t> only_unmasked(32, 0);
  only_unmasked[0] = 9;      // layer 0: not in the mask {1, 3}
  only_unmasked[2 * 8] = 4;  // layer 2: not in the mask
  ExpectReject(Apply(CountsInt16Le{4, 8, Int16Bytes(only_unmasked)}), absl::StatusCode::kFailedPrecondition,
               RejectReason::kZeroSignature, "all zeros");
  ExpectReject(Apply(CountsInt32{4, 8, std::vector<int32_t>(32, 0)}), absl::StatusCode::kFailedPrecondition,
               RejectReason::kZeroSignature, "all zeros");
  // Counts only where the IDF weight is zero vanish too.
  SignatureSpec spec = CountIdfSpec(2, 4, {});
  spec.idf = {0, 1, 1, 1, 1, 1, 1, 1};
  const SignatureTransform transform = MakeTransform(spec);
  std::vector<float> out(transform.dim());
  ExpectReject(transform.Apply(CountsInt32{2, 4, std::vector<int32_t>{7, 0, 0, 0, 0, 0, 0, 0}}, absl::MakeSpan(out)),
               absl::StatusCode::kFailedPrecondition, RejectReason::kZeroSignature, "all zeros");
  ExpectReject(Apply(TransformedVector{std::vector<float>(spec_.dim(), 0.f)}), absl::StatusCode::kFailedPrecondition,
               RejectReason::kZeroSignature, "all zeros");
}

TEST_F(SignatureRejectionTest, OutputBufferMustHaveDim) {
  std::vector<float> small(spec_.dim() - 1);
  ExpectReject(transform_.Apply(CountsInt32{4, 8, counts_}, absl::MakeSpan(small)), absl::StatusCode::kInvalidArgument,
               RejectReason::kGeometry, "output buffer");
}

// ---- Kernels -----------------------------------------------------------------------------------

TEST(SignatureKernelsTest, VectorKernelsAgreeWithScalarOnes) {
  const internal::SignatureKernels& scalar = internal::ScalarSignatureKernels();
  const internal::SignatureKernels& fast = internal::Avx2SignatureKernelsIfSupported();
  std::mt19937 rng(11);
  for (size_t n : {0u, 1u, 7u, 8u, 31u, 32u, 33u, 100u, 6144u}) {
    std::vector<int32_t> values(n);
    for (auto& v : values) v = static_cast<int32_t>(rng() % 2000);
    const std::string bytes = Int16Bytes(values);
    const std::vector<float> weights = RandomIdf(static_cast<int>(n), 3);
    for (const float* w : {static_cast<const float*>(nullptr), weights.data()}) {
      std::vector<float> a(n), b(n);
      int32_t bits_a = 0, bits_b = 0;
      const double sum_a = scalar.convert_int16(bytes.data(), w, a.data(), n, &bits_a);
      const double sum_b = fast.convert_int16(bytes.data(), w, b.data(), n, &bits_b);
      EXPECT_EQ(a, b) << n;
      EXPECT_NEAR(sum_a, sum_b, 1e-5 * std::max(1.0, sum_a)) << n;
      EXPECT_EQ(bits_a, bits_b);
      const double sum32_a = scalar.convert_int32(values.data(), w, a.data(), n, &bits_a);
      const double sum32_b = fast.convert_int32(values.data(), w, b.data(), n, &bits_b);
      EXPECT_EQ(a, b) << n;
      EXPECT_NEAR(sum32_a, sum32_b, 1e-5 * std::max(1.0, sum32_a)) << n;
    }
    if (n > 0) {
      std::vector<int32_t> negative = values;
      negative[n - 1] = -3;
      const std::string negative_bytes = Int16Bytes(negative);
      int32_t bits = 0;
      std::vector<float> out(n);
      fast.convert_int16(negative_bytes.data(), nullptr, out.data(), n, &bits);
      EXPECT_LT(bits, 0) << n;
      EXPECT_LT(fast.or_int16(negative_bytes.data(), n), 0) << n;
      EXPECT_GE(fast.or_int16(bytes.data(), n), 0) << n;
    }
    std::vector<float> floats(n);
    for (auto& f : floats) f = static_cast<float>(static_cast<int>(rng() % 200) - 20) / 7.f;
    std::vector<float> a(n), b(n);
    int32_t neg_a = 0, neg_b = 0;
    const double fa = scalar.convert_float(floats.data(), a.data(), n, &neg_a);
    const double fb = fast.convert_float(floats.data(), b.data(), n, &neg_b);
    EXPECT_EQ(a, b);
    EXPECT_EQ(neg_a, neg_b);
    EXPECT_NEAR(fa, fb, 1e-5 * std::max(1.0, fa));
    // In place, and into another buffer (the centroid index scales a kept query that way).
    std::vector<float> c(n, -1.f);
    fast.scale(b.data(), n, 0.3f, c.data());
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(c[i], b[i] * 0.3f) << n;
    scalar.scale(a.data(), n, 0.5f, a.data());
    fast.scale(b.data(), n, 0.5f, b.data());
    EXPECT_EQ(a, b);
  }
}

// ---- IDF ---------------------------------------------------------------------------------------

TEST(ComputeIdfTest, DocumentFrequencyFormula) {
  // n = 3 requests, 1 layer x 3 experts: expert 0 used by all, expert 1 by one, expert 2 by none.
  const std::vector<int32_t> counts = {5, 0, 0,  //
                                       1, 2, 0,  //
                                       7, 0, 0};
  const std::vector<float> idf = ComputeIdf(counts, 3, 1, 3);
  ASSERT_EQ(idf.size(), 3u);
  EXPECT_FLOAT_EQ(idf[0], std::log(4.0 / 4.0));
  EXPECT_FLOAT_EQ(idf[1], std::log(4.0 / 2.0));
  EXPECT_FLOAT_EQ(idf[2], std::log(4.0 / 1.0));
}

TEST(ComputeIdfTest, InconsistentArgumentsGiveEmpty) {
  const std::vector<int32_t> counts(10, 1);
  EXPECT_TRUE(ComputeIdf(counts, 3, 1, 3).empty());
  EXPECT_TRUE(ComputeIdf(counts, -1, 1, 3).empty());
  EXPECT_TRUE(ComputeIdf(counts, 1, 0, 10).empty());
  EXPECT_EQ(ComputeIdf({}, 0, 2, 2), std::vector<float>(4, 0.f));  // log(1/1)
}

// ---- ApplyKept: the fused form for scorers that drop columns -----------------------------------

// A column selection over `dim` columns, owning its arrays.
struct OwnedSelection {
  std::vector<uint16_t> masks;
  std::vector<int> offsets;
  std::vector<int> kept;
  int dim = 0;
  ColumnSelection View() const { return ColumnSelection{dim, masks, offsets, static_cast<int>(kept.size())}; }
};

OwnedSelection RandomSelection(int dim, double keep, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(0, 1);
  OwnedSelection s;
  s.dim = dim;
  s.masks.assign((dim + 15) / 16, 0);
  for (int i = 0; i < dim; ++i) {
    if (uniform(rng) < keep) {
      s.kept.push_back(i);
      s.masks[i / 16] |= static_cast<uint16_t>(1u << (i % 16));
    }
  }
  s.offsets.assign(s.masks.size(), 0);
  for (size_t c = 1; c < s.masks.size(); ++c) s.offsets[c] = s.offsets[c - 1] + __builtin_popcount(s.masks[c - 1]);
  return s;
}

TEST(SignatureApplyKeptTest, WritesTheKeptColumnsOfApplyAndTheirNorm) {
  struct Case {
    int layers, experts;
    std::vector<int> mask;
    bool idf;
  };
  const Case cases[] = {{48, 128, {}, true}, {26, 64, {0, 1, 2, 5, 12, 15, 22}, true},
                        {26, 64, {}, false}, {5, 16, {1, 3}, true},
                        {3, 10, {}, true},   {7, 9, {}, false}};
  int checked = 0;
  for (const Case& c : cases) {
    SignatureSpec spec = CountIdfSpec(c.layers, c.experts, c.mask);
    if (!c.idf) {
      spec.variant = SignatureVariant::kCount;
      spec.idf.clear();
    }
    const SignatureTransform transform = MakeTransform(spec);
    for (double keep : {0.0, 0.5, 0.74, 1.0}) {
      const OwnedSelection selection = RandomSelection(transform.dim(), keep, 11 + checked);
      ASSERT_TRUE(transform.SupportsApplyKept(selection.View()));
      for (uint32_t seed : {1u, 2u, 3u}) {
        const std::string bytes = Int16Bytes(RandomCounts(c.layers, c.experts, seed + checked));
        const CountsInt16Le counts{c.layers, c.experts, bytes};
        std::vector<float> whole(transform.dim());
        ASSERT_TRUE(transform.Apply(counts, absl::MakeSpan(whole)).ok());
        std::vector<float> kept(selection.kept.size() + 16, -1.f);
        absl::StatusOr<SignatureTransform::KeptValues> applied =
            transform.ApplyKept(counts, selection.View(), absl::MakeSpan(kept));
        ASSERT_TRUE(applied.ok()) << applied.status();
        const float* norm = &applied->norm;
        float expected_max = 0;
        double expected_norm2 = 0;
        // The values come before normalisation: times the returned scale they are Apply's.
        for (size_t k = 0; k < selection.kept.size(); ++k) {
          const float want = whole[selection.kept[k]];
          const float scaled = kept[k] * applied->scale;
          ASSERT_NEAR(scaled, want, 1e-6f * std::fabs(want) + 1e-9f) << c.layers << "x" << c.experts << " #" << k;
          expected_norm2 += static_cast<double>(want) * want;
          expected_max = std::max(expected_max, scaled);
        }
        EXPECT_EQ(applied->max, expected_max);
        EXPECT_NEAR(*norm, std::sqrt(expected_norm2), 1e-5) << c.layers << "x" << c.experts << " keep " << keep;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 6 * 4 * 3);
}

TEST(SignatureApplyKeptTest, RejectsWhatApplyRejectsWithTheSameStatus) {
  const SignatureSpec spec = CountIdfSpec(4, 16, {0, 2});
  const SignatureTransform transform = MakeTransform(spec);
  const OwnedSelection selection = RandomSelection(transform.dim(), 0.6, 5);
  std::vector<float> whole(transform.dim());
  std::vector<float> kept(selection.kept.size() + 16);
  std::vector<int32_t> negative_masked = RandomCounts(4, 16, 3);
  negative_masked[2 * 16 + 5] = -1;
  std::vector<int32_t> negative_unmasked = RandomCounts(4, 16, 4);
  negative_unmasked[1 * 16 + 7] = -3;
  std::vector<int32_t> zero_on_mask = RandomCounts(4, 16, 5);
  for (int e = 0; e < 16; ++e) zero_on_mask[e] = zero_on_mask[2 * 16 + e] = 0;
  const std::string bytes[] = {Int16Bytes(negative_masked), Int16Bytes(negative_unmasked), Int16Bytes(zero_on_mask),
                               Int16Bytes(RandomCounts(4, 16, 6)).substr(3)};
  const CountsInt16Le inputs[] = {
      {4, 16, bytes[0]}, {4, 16, bytes[1]}, {4, 16, bytes[2]}, {4, 16, bytes[3]}, {5, 16, bytes[2]}};
  for (const CountsInt16Le& input : inputs) {
    const absl::Status applied = transform.Apply(input, absl::MakeSpan(whole));
    ASSERT_FALSE(applied.ok());
    const absl::StatusOr<SignatureTransform::KeptValues> fused =
        transform.ApplyKept(input, selection.View(), absl::MakeSpan(kept));
    ASSERT_FALSE(fused.ok());
    EXPECT_EQ(fused.status().code(), applied.code());
    EXPECT_EQ(fused.status().message(), applied.message());
    EXPECT_EQ(RejectReasonOf(fused.status()), RejectReasonOf(applied));
  }
  // A buffer without the 16 floats of room.
  std::vector<float> short_buffer(selection.kept.size());
  const std::string good = Int16Bytes(RandomCounts(4, 16, 8));
  EXPECT_EQ(
      transform.ApplyKept(CountsInt16Le{4, 16, good}, selection.View(), absl::MakeSpan(short_buffer)).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(SignatureApplyKeptTest, SupportsOnlyCountVariantsAndChunkAlignedLayers) {
  OwnedSelection selection = RandomSelection(2 * 10, 0.5, 1);
  // A partial mask of 10-expert layers: layer boundaries fall inside 16-column chunks.
  const SignatureTransform partial = MakeTransform(CountIdfSpec(4, 10, {1, 3}));
  EXPECT_FALSE(partial.SupportsApplyKept(selection.View()));
  std::vector<float> out(selection.kept.size() + 16);
  const std::string bytes = Int16Bytes(RandomCounts(4, 10, 2));
  EXPECT_EQ(partial.ApplyKept(CountsInt16Le{4, 10, bytes}, selection.View(), absl::MakeSpan(out)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Every layer of 10 experts: one contiguous run, fine.
  const SignatureTransform all = MakeTransform(CountIdfSpec(2, 10, {}));
  EXPECT_TRUE(all.SupportsApplyKept(selection.View()));
  // A selection of another dimension.
  EXPECT_FALSE(all.SupportsApplyKept(RandomSelection(21, 0.5, 1).View()));
  SignatureSpec gate;
  gate.layers = 2;
  gate.experts = 10;
  gate.variant = SignatureVariant::kGateProb;
  EXPECT_FALSE(MakeTransform(gate).SupportsApplyKept(selection.View()));
}

}  // namespace
}  // namespace eldr
