#include "eldr/common/stable_hash.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace eldr {
namespace {

// FNV-1a 64 reference values (the FNV authors' test vectors).
TEST(StableHashTest, Fnv1a64MatchesReferenceVectors) {
  EXPECT_EQ(Fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(Fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(Fnv1a64("foobar"), 0x85944171f73967e8ull);
}

// Golden values computed by an independent implementation (Python): the hash must never change,
// since proxy replicas and restarts rely on it to place prefixes on the same prefill instance.
TEST(StableHashTest, StableHash64GoldenValues) {
  EXPECT_EQ(Mix64(0), 0u);
  EXPECT_EQ(Mix64(1), 0xb456bcfc34c2cb2cull);
  EXPECT_EQ(Mix64(0x123456789abcdef0ull), 0x18b8c062f6f42398ull);
  EXPECT_EQ(StableHash64(""), 0xefd01f60ba992926ull);
  EXPECT_EQ(StableHash64("a"), 0x82a2a958a9bece5bull);
  EXPECT_EQ(StableHash64("foobar"), 0x2c22194922d1672bull);
  EXPECT_EQ(StableHash64("127.0.0.1:8100#0"), 0xbdec5637f251f947ull);
  EXPECT_EQ(StableHash64("", 42), 0xd430cd2ca02da65eull);
  EXPECT_EQ(StableHash64("a", 42), 0x2ddfc22dc486fd44ull);
  EXPECT_EQ(StableHash64("foobar", 42), 0x9c4ca1de6183d4cfull);
}

TEST(StableHashTest, SeedZeroIsMixOfFnv) {
  for (const std::string& s : std::vector<std::string>{"", "x", "hello world", std::string(1000, 'q')}) {
    EXPECT_EQ(StableHash64(s), Mix64(Fnv1a64(s))) << s;
  }
}

TEST(StableHashTest, UnitIntervalIsInRangeAndUsesTheHighBits) {
  for (int i = 0; i < 1000; ++i) {
    const std::string key = "id-" + std::to_string(i);
    const double u = StableUnitInterval(key, 3);
    EXPECT_GE(u, 0.0);
    EXPECT_LT(u, 1.0);
    EXPECT_EQ(u, static_cast<double>(StableHash64(key, 3) >> 11) / 9007199254740992.0);
  }
}

}  // namespace
}  // namespace eldr
