#include "eldr/proxy/ab_split.h"

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "eldr/proxy/request_id.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::proxy {
namespace {

using ::testing::HasSubstr;

AbSplitter MakeSplitter(double fraction, uint64_t seed = 0, std::string policy = "jsq") {
  AbSplitOptions options;
  options.baseline_fraction = fraction;
  options.baseline_policy = std::move(policy);
  options.seed = seed;
  absl::StatusOr<AbSplitter> splitter = AbSplitter::Create(options);
  EXPECT_TRUE(splitter.ok()) << splitter.status();
  return *std::move(splitter);
}

TEST(AbSplitOptionsTest, DefaultsAndValidation) {
  const AbSplitOptions defaults;
  EXPECT_EQ(defaults.baseline_fraction, 0);
  EXPECT_EQ(defaults.baseline_policy, "jsq");
  EXPECT_TRUE(ValidateAbSplitOptions(defaults).ok());
  for (const char* policy : {"rr", "random", "jsq", "p2c"}) {
    AbSplitOptions options;
    options.baseline_policy = policy;
    EXPECT_TRUE(ValidateAbSplitOptions(options).ok()) << policy;
  }

  struct Case {
    double fraction;
    const char* policy;
    const char* message;
  };
  const Case cases[] = {
      {-0.1, "jsq", "AbSplitOptions.baseline_fraction must be in [0, 1], got -0.1"},
      {1.5, "jsq", "AbSplitOptions.baseline_fraction must be in [0, 1], got 1.5"},
      {std::nan(""), "jsq", "AbSplitOptions.baseline_fraction must be in [0, 1]"},
      {INFINITY, "jsq", "AbSplitOptions.baseline_fraction must be in [0, 1]"},
      {0.5, "eldr",
       "AbSplitOptions.baseline_policy must be one of rr, random, jsq, p2c (eldr-router's load-only "
       "policies), got \"eldr\""},
      {0.5, "", "AbSplitOptions.baseline_policy must be one of rr, random, jsq, p2c"},
      {0.5, "JSQ", "got \"JSQ\""},
  };
  for (const Case& c : cases) {
    AbSplitOptions options;
    options.baseline_fraction = c.fraction;
    options.baseline_policy = c.policy;
    const absl::Status status = ValidateAbSplitOptions(options);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
    EXPECT_FALSE(AbSplitter::Create(options).ok()) << c.message;
  }
}

TEST(AbSplitterTest, FractionOfTenThousandIdsIsWithinTwoPercent) {
  for (const double fraction : {0.1, 0.25, 0.5, 0.9}) {
    for (const uint64_t seed : {0ull, 1ull, 99ull}) {
      const AbSplitter splitter = MakeSplitter(fraction, seed);
      int baseline = 0;
      for (int i = 0; i < 10000; ++i) baseline += splitter.UseBaseline(absl::StrCat("cmpl-", i)) ? 1 : 0;
      EXPECT_NEAR(baseline / 10000.0, fraction, 0.02) << fraction << " seed " << seed;
    }
  }
  // Random ids, as NewRequestId makes them.
  const AbSplitter splitter = MakeSplitter(0.3);
  int baseline = 0;
  for (int i = 0; i < 10000; ++i) baseline += splitter.UseBaseline(NewRequestId()) ? 1 : 0;
  EXPECT_NEAR(baseline / 10000.0, 0.3, 0.02);
}

TEST(AbSplitterTest, DeterministicPerIdAcrossSplittersAndThreads) {
  const AbSplitter a = MakeSplitter(0.5, 7);
  const AbSplitter b = MakeSplitter(0.5, 7);
  std::vector<std::string> ids;
  for (int i = 0; i < 2000; ++i) ids.push_back(absl::StrCat("req-", i * 31));
  std::vector<bool> expected;
  for (const std::string& id : ids) expected.push_back(a.UseBaseline(id));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(a.UseBaseline(ids[i]), expected[i]);  // a retry stays in its arm
    EXPECT_EQ(b.UseBaseline(ids[i]), expected[i]);  // so does the same id on another replica
  }
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (size_t i = 0; i < ids.size(); ++i) mismatches[t] += a.UseBaseline(ids[i]) != expected[i] ? 1 : 0;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0);
}

TEST(AbSplitterTest, ArmsAreNestedAsTheFractionGrows) {
  // With one seed, an id in the baseline at fraction f is in it at every larger fraction: raising
  // the fraction only moves ids from ELDR to the baseline.
  const AbSplitter small = MakeSplitter(0.2, 3);
  const AbSplitter large = MakeSplitter(0.6, 3);
  for (int i = 0; i < 5000; ++i) {
    const std::string id = absl::StrCat("id", i);
    if (small.UseBaseline(id)) {
      EXPECT_TRUE(large.UseBaseline(id)) << id;
    }
  }
}

TEST(AbSplitterTest, SeedsReshuffleTheArms) {
  const AbSplitter a = MakeSplitter(0.5, 1);
  const AbSplitter b = MakeSplitter(0.5, 2);
  int differ = 0;
  for (int i = 0; i < 4000; ++i) differ += a.UseBaseline(absl::StrCat(i)) != b.UseBaseline(absl::StrCat(i)) ? 1 : 0;
  EXPECT_NEAR(differ / 4000.0, 0.5, 0.05);  // independent halves disagree half the time
}

TEST(AbSplitterTest, ZeroAndOneAndLabels) {
  const AbSplitter none = MakeSplitter(0);
  const AbSplitter all = MakeSplitter(1, 0, "p2c");
  for (int i = 0; i < 1000; ++i) {
    EXPECT_FALSE(none.UseBaseline(absl::StrCat(i)));
    EXPECT_TRUE(all.UseBaseline(absl::StrCat(i)));
  }
  EXPECT_FALSE(none.UseBaseline(""));
  EXPECT_TRUE(all.UseBaseline(""));
  EXPECT_EQ(all.ArmLabel(true), "p2c");
  EXPECT_EQ(all.ArmLabel(false), "eldr");
  EXPECT_EQ(all.baseline_policy(), "p2c");
  EXPECT_EQ(all.baseline_fraction(), 1);
}

}  // namespace
}  // namespace eldr::proxy
