// The binary encodings and their checksum: known CRC-32C vectors, round trips, and corruption of
// every kind refused with a reason.
#include "eldr/cluster/codec.h"

#include <cmath>
#include <cstring>
#include <string>

#include "cluster/redis_server.h"
#include "eldr/cluster/crc32c.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::cluster {
namespace {

using ::testing::HasSubstr;

uint32_t BitwiseCrc32c(const std::string& bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : bytes) {
    crc ^= c;
    for (int i = 0; i < 8; ++i) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xFF, and an ascending sequence.
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(static_cast<char>(i));
  EXPECT_EQ(Crc32c(ascending), 0x46DD794Eu);
}

TEST(Crc32cTest, SlicedMatchesBitwiseAndExtends) {
  std::string data;
  uint32_t x = 1;
  for (int i = 0; i < 1000; ++i) {
    x = x * 1103515245u + 12345u;
    data.push_back(static_cast<char>(x >> 24));
  }
  for (size_t n : {0, 1, 7, 8, 9, 15, 16, 17, 63, 999, 1000}) {
    const std::string prefix = data.substr(0, n);
    EXPECT_EQ(Crc32c(prefix), BitwiseCrc32c(prefix)) << n;
    for (size_t split : {size_t{0}, n / 3, n}) {
      EXPECT_EQ(Crc32cExtend(Crc32c(prefix.substr(0, split)), prefix.substr(split)), Crc32c(prefix)) << n;
    }
  }
}

TEST(CentroidCodecTest, RoundTrip) {
  CentroidArtifact artifact = testing::TestArtifact(3, 1);
  absl::StatusOr<std::string> encoded = EncodeCentroidArtifact(artifact);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  EXPECT_EQ(encoded->substr(0, 4), "ELDC");
  absl::StatusOr<CentroidArtifact> decoded = DecodeCentroidArtifact(*encoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->k, artifact.k);
  EXPECT_EQ(decoded->centroids, artifact.centroids);
  EXPECT_EQ(decoded->workers, artifact.workers);
  EXPECT_EQ(decoded->model, artifact.model);
  EXPECT_EQ(decoded->seed, artifact.seed);
  EXPECT_TRUE(SameTransform(decoded->spec, artifact.spec));
}

TEST(CentroidCodecTest, RoundTripWithMaskIdfAndNoNames) {
  CentroidArtifact artifact;
  artifact.spec.layers = 6;
  artifact.spec.experts = 4;
  artifact.spec.variant = SignatureVariant::kCountIdf;
  artifact.spec.layer_mask = {1, 4};
  for (int i = 0; i < 8; ++i) artifact.spec.idf.push_back(0.25f + 0.125f * i);
  artifact.k = 2;
  artifact.centroids.assign(16, 0.0f);
  artifact.centroids[0] = 1.0f;
  artifact.centroids[8 + 5] = -1.0f;
  artifact.seed = 0xFFFFFFFFFFFFFFFFull;
  absl::StatusOr<std::string> encoded = EncodeCentroidArtifact(artifact);
  ASSERT_TRUE(encoded.ok()) << encoded.status();
  absl::StatusOr<CentroidArtifact> decoded = DecodeCentroidArtifact(*encoded);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->spec.layer_mask, artifact.spec.layer_mask);
  EXPECT_EQ(decoded->spec.idf, artifact.spec.idf);
  EXPECT_EQ(decoded->spec.variant, SignatureVariant::kCountIdf);
  EXPECT_TRUE(decoded->workers.empty());
  EXPECT_TRUE(decoded->model.empty());
  EXPECT_EQ(decoded->seed, artifact.seed);
  EXPECT_EQ(decoded->centroids, artifact.centroids);
}

TEST(CentroidCodecTest, RefusesInvalidArtifact) {
  CentroidArtifact artifact = testing::TestArtifact();
  artifact.centroids[0] = 5.0f;  // not a unit row
  EXPECT_EQ(EncodeCentroidArtifact(artifact).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CentroidCodecTest, CorruptionRefusedWithReason) {
  const std::string good = *EncodeCentroidArtifact(testing::TestArtifact());

  absl::Status empty = DecodeCentroidArtifact("").status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(empty.message(), HasSubstr("magic"));

  EXPECT_THAT(DecodeCentroidArtifact("{\"L\": 4}").status().message(), HasSubstr("magic"));

  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x10;
  absl::Status checksum = DecodeCentroidArtifact(flipped).status();
  EXPECT_EQ(checksum.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(checksum.message(), HasSubstr("checksum"));

  absl::Status truncated = DecodeCentroidArtifact(good.substr(0, good.size() - 9)).status();
  EXPECT_EQ(truncated.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(truncated.message(), HasSubstr("truncated"));

  absl::Status padded = DecodeCentroidArtifact(good + "xx").status();
  EXPECT_EQ(padded.code(), absl::StatusCode::kDataLoss);

  std::string newer = good;
  newer[4] = 2;
  absl::Status version = DecodeCentroidArtifact(newer).status();
  EXPECT_EQ(version.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(version.message(), HasSubstr("version 2"));

  // Every single-byte truncation is refused, never a crash.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_FALSE(DecodeCentroidArtifact(good.substr(0, n)).ok()) << n;
  }
}

TEST(CentroidCodecTest, ValidChecksumOverBadContentStillRefused) {
  // A forged blob whose checksum is right but whose rows are not unit vectors.
  std::string blob = *EncodeCentroidArtifact(testing::TestArtifact());
  // The first row value sits after the 24-byte fixed header, mask count, idf count, k and dim.
  const size_t first_row = 24 + 4 + 4 + 4 + 4;
  const float big = 3.0f;
  std::memcpy(&blob[first_row], &big, 4);
  const uint32_t crc = Crc32c(absl::string_view(blob).substr(0, blob.size() - 4));
  for (int i = 0; i < 4; ++i) blob[blob.size() - 4 + i] = static_cast<char>(crc >> (8 * i));
  absl::Status status = DecodeCentroidArtifact(blob).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
}

TEST(WindowCodecTest, DenseAndSparseRoundTrip) {
  WindowSignature sparse;
  sparse.signature.assign(1000, 0.0f);
  sparse.signature[3] = 0.6f;
  sparse.signature[999] = 0.8f;
  sparse.decode_work = 123.5;
  absl::StatusOr<std::string> small = EncodeWindowSignature(sparse);
  ASSERT_TRUE(small.ok());
  EXPECT_LT(small->size(), 48u);  // two (u16 index, f16 value) pairs, not 2000 or 4000 bytes
  absl::StatusOr<WindowSignature> back = DecodeWindowSignature(*small);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->signature.size(), 1000u);
  for (int i = 0; i < 1000; ++i) {
    // Half precision: relative error at most 2^-11; zeros stay zeros.
    EXPECT_NEAR(back->signature[i], sparse.signature[i], std::fabs(sparse.signature[i]) * 0x1p-11f) << i;
    EXPECT_EQ(back->signature[i] == 0.0f, sparse.signature[i] == 0.0f) << i;
  }
  EXPECT_NE(back->signature[3], 0.6f);  // 0.6 is not a binary16 value: the half form was used
  EXPECT_EQ(back->decode_work, 123.5);

  WindowSignature dense;
  for (int i = 0; i < 16; ++i) dense.signature.push_back(i % 2 == 0 ? 0.25f : -0.375f);  // exact in binary16
  absl::StatusOr<std::string> full = EncodeWindowSignature(dense);
  ASSERT_TRUE(full.ok());
  EXPECT_EQ(full->size(), 28u + 16 * 2);  // header, decode work and checksum, then 2 bytes per value
  back = DecodeWindowSignature(*full);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->signature, dense.signature);
  EXPECT_EQ(back->decode_work, 0);

  // A 48 x 128 unit signature with every expert used fits in the dense half form.
  WindowSignature wide;
  wide.signature.assign(48 * 128, 1.0f / std::sqrt(48.0f * 128.0f));
  absl::StatusOr<std::string> wide_bytes = EncodeWindowSignature(wide);
  ASSERT_TRUE(wide_bytes.ok());
  EXPECT_LE(wide_bytes->size(), 48u * 128 * 2 + 32);
}

TEST(WindowCodecTest, ValuesBeyondHalfRangeKeepFullPrecision) {
  WindowSignature big;
  big.signature = {0.0f, 1e5f, 0.1f, 0.0f, -3.5e6f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  absl::StatusOr<std::string> bytes = EncodeWindowSignature(big);
  ASSERT_TRUE(bytes.ok());
  absl::StatusOr<WindowSignature> back = DecodeWindowSignature(*bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->signature, big.signature);  // exact: the f32 (sparse) form
  big.signature.assign(12, 2e5f);
  back = DecodeWindowSignature(*EncodeWindowSignature(big));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->signature, big.signature);  // exact: the dense f32 form
}

TEST(WindowCodecTest, CorruptionAndBadInput) {
  WindowSignature entry;
  entry.signature = {0.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const std::string good = *EncodeWindowSignature(entry);
  for (size_t n = 0; n < good.size(); ++n) EXPECT_FALSE(DecodeWindowSignature(good.substr(0, n)).ok()) << n;
  std::string flipped = good;
  flipped[10] ^= 1;
  EXPECT_EQ(DecodeWindowSignature(flipped).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(DecodeWindowSignature(*EncodeCentroidArtifact(testing::TestArtifact())).status().code(),
            absl::StatusCode::kDataLoss);

  EXPECT_FALSE(EncodeWindowSignature(WindowSignature{}).ok());
  WindowSignature bad;
  bad.signature = {1.0f, std::nanf("")};
  EXPECT_FALSE(EncodeWindowSignature(bad).ok());
}

}  // namespace
}  // namespace eldr::cluster
