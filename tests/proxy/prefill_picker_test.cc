#include "eldr/proxy/prefill_picker.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::proxy {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Instances(int n, int first_port = 8100) {
  std::vector<std::string> ids;
  for (int i = 0; i < n; ++i) ids.push_back(absl::StrCat("10.0.0.", i + 1, ":", first_port));
  return ids;
}

std::unique_ptr<PrefillPicker> MakePicker(std::vector<std::string> instances, PrefillPickerOptions options = {}) {
  absl::StatusOr<std::unique_ptr<PrefillPicker>> picker = PrefillPicker::Create(options, std::move(instances));
  EXPECT_TRUE(picker.ok()) << picker.status();
  return picker.ok() ? *std::move(picker) : nullptr;
}

// Random prompt-like keys, the same in every run.
std::vector<std::string> RandomKeys(int count, uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::uniform_int_distribution<int> length(16, 200);
  std::uniform_int_distribution<int> letter(32, 126);
  std::vector<std::string> keys;
  keys.reserve(count);
  for (int i = 0; i < count; ++i) {
    std::string key(length(generator), ' ');
    for (char& c : key) c = static_cast<char>(letter(generator));
    keys.push_back(std::move(key));
  }
  return keys;
}

// The instance each key maps to when nothing is in flight (each lease released at once).
std::vector<std::string> Mapping(PrefillPicker& picker, const std::vector<std::string>& keys) {
  std::vector<std::string> ids;
  ids.reserve(keys.size());
  for (const std::string& key : keys) {
    absl::StatusOr<PrefillLease> lease = picker.Pick(key);
    EXPECT_TRUE(lease.ok()) << lease.status();
    ids.push_back(lease.ok() ? lease->id() : "");
  }
  return ids;
}

int64_t InFlight(const PrefillPicker& picker, absl::string_view id) {
  for (const PrefillInstanceLoad& load : picker.Loads()) {
    if (load.id == id) return load.in_flight;
  }
  return -1;
}

int64_t TotalInFlight(const PrefillPicker& picker) {
  int64_t total = 0;
  for (const PrefillInstanceLoad& load : picker.Loads()) total += load.in_flight;
  return total;
}

// ---- Names and options ------------------------------------------------------------------------------

TEST(PrefillPolicyTest, NamesRoundTrip) {
  for (const PrefillPolicy policy :
       {PrefillPolicy::kPrefixHash, PrefillPolicy::kLeastLoaded, PrefillPolicy::kRoundRobin}) {
    absl::StatusOr<PrefillPolicy> parsed = ParsePrefillPolicy(PrefillPolicyName(policy));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, policy);
  }
  EXPECT_EQ(PrefillPolicyName(PrefillPolicy::kPrefixHash), "prefix_hash");
  EXPECT_EQ(PrefillPolicyName(PrefillPolicy::kLeastLoaded), "least_loaded");
  EXPECT_EQ(PrefillPolicyName(PrefillPolicy::kRoundRobin), "round_robin");
}

TEST(PrefillPolicyTest, UnknownNameListsTheValidOnes) {
  for (const char* name : {"", "prefix-hash", "PREFIX_HASH", "random"}) {
    absl::StatusOr<PrefillPolicy> parsed = ParsePrefillPolicy(name);
    ASSERT_FALSE(parsed.ok()) << name;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("prefix_hash, least_loaded or round_robin"));
  }
}

TEST(PrefillPickerOptionsTest, DefaultsAreValid) {
  const PrefillPickerOptions options;
  EXPECT_EQ(options.policy, PrefillPolicy::kPrefixHash);
  EXPECT_EQ(options.prefix_bytes, 1024u);
  EXPECT_EQ(options.virtual_nodes, 160);
  EXPECT_EQ(options.load_factor, 1.25);
  EXPECT_EQ(options.seed, 0u);
  EXPECT_TRUE(ValidatePrefillPickerOptions(options).ok());
}

TEST(PrefillPickerOptionsTest, RejectsEachOutOfRangeField) {
  struct Case {
    const char* name;
    void (*mutate)(PrefillPickerOptions&);
    const char* field;
  };
  const Case cases[] = {
      {"prefix_bytes 0", [](PrefillPickerOptions& o) { o.prefix_bytes = 0; }, "prefix_bytes"},
      {"prefix_bytes 2 MiB", [](PrefillPickerOptions& o) { o.prefix_bytes = 2 << 20; }, "prefix_bytes"},
      {"virtual_nodes 0", [](PrefillPickerOptions& o) { o.virtual_nodes = 0; }, "virtual_nodes"},
      {"virtual_nodes -3", [](PrefillPickerOptions& o) { o.virtual_nodes = -3; }, "virtual_nodes"},
      {"virtual_nodes 5000", [](PrefillPickerOptions& o) { o.virtual_nodes = 5000; }, "virtual_nodes"},
      {"load_factor 0.99", [](PrefillPickerOptions& o) { o.load_factor = 0.99; }, "load_factor"},
      {"load_factor NaN", [](PrefillPickerOptions& o) { o.load_factor = std::nan(""); }, "load_factor"},
      {"load_factor inf", [](PrefillPickerOptions& o) { o.load_factor = INFINITY; }, "load_factor"},
      {"load_factor 1001", [](PrefillPickerOptions& o) { o.load_factor = 1001; }, "load_factor"},
      {"policy 7", [](PrefillPickerOptions& o) { o.policy = static_cast<PrefillPolicy>(7); }, "policy"},
  };
  for (const Case& c : cases) {
    PrefillPickerOptions options;
    c.mutate(options);
    const absl::Status status = ValidatePrefillPickerOptions(options);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("PrefillPickerOptions.", c.field))) << c.name;
    EXPECT_FALSE(PrefillPicker::Create(options, Instances(2)).ok()) << c.name;
  }
}

TEST(PrefillPickerTest, RejectsBadInstanceLists) {
  struct Case {
    const char* name;
    std::vector<std::string> instances;
    const char* message;
  };
  const Case cases[] = {
      {"empty id", {"a:1", ""}, "empty"},
      {"duplicate", {"a:1", "b:1", "a:1"}, "\"a:1\" is given twice"},
      {"too long", {std::string(kMaxPrefillInstanceIdBytes + 1, 'x')}, "bytes long"},
      {"too many", std::vector<std::string>(), "at most 1024"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> instances = c.instances;
    if (instances.empty()) instances = Instances(static_cast<int>(kMaxPrefillInstances) + 1);
    absl::StatusOr<std::unique_ptr<PrefillPicker>> picker = PrefillPicker::Create({}, instances);
    ASSERT_FALSE(picker.ok()) << c.name;
    EXPECT_EQ(picker.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(picker.status().message(), HasSubstr(c.message)) << c.name;
  }
  // A rejected SetInstances changes nothing.
  std::unique_ptr<PrefillPicker> picker = MakePicker({"a:1", "b:1"});
  EXPECT_FALSE(picker->SetInstances({"c:1", "c:1"}).ok());
  EXPECT_EQ(picker->size(), 2u);
  EXPECT_EQ(picker->Loads()[0].id, "a:1");
}

// ---- prefix_hash: placement ----------------------------------------------------------------------

TEST(PrefillPickerTest, MappingIsStableAcrossPickersOrdersAndSeeds) {
  const std::vector<std::string> keys = RandomKeys(2000, 1);
  std::vector<std::string> ids = Instances(5);
  std::unique_ptr<PrefillPicker> first = MakePicker(ids);
  std::vector<std::string> reversed(ids.rbegin(), ids.rend());
  PrefillPickerOptions seeded;
  seeded.seed = 12345;
  std::unique_ptr<PrefillPicker> second = MakePicker(reversed, seeded);
  const std::vector<std::string> mapping = Mapping(*first, keys);
  EXPECT_EQ(Mapping(*second, keys), mapping);
  // And the same picker answers the same way again.
  EXPECT_EQ(Mapping(*first, keys), mapping);
}

TEST(PrefillPickerTest, GoldenPlacementNeverChanges) {
  // Pins the placement itself (hash, ring points "<id>#<v>", clockwise walk): proxy replicas of
  // different builds and versions must agree. Changing any of it moves every prefix cache.
  const std::map<std::string, std::string> golden = {
      {"Hello", "127.0.0.1:8100"},
      {"You are a helpful assistant.", "127.0.0.1:8102"},
      {"eldr-trace:7", "127.0.0.1:8102"},
      {"1,2,3", "127.0.0.1:8101"},
      {"a", "127.0.0.1:8100"},
      {"b", "127.0.0.1:8102"},
      {"c", "127.0.0.1:8101"},
      {"d", "127.0.0.1:8101"},
  };
  for (const std::vector<std::string>& order :
       {std::vector<std::string>{"127.0.0.1:8100", "127.0.0.1:8101", "127.0.0.1:8102"},
        std::vector<std::string>{"127.0.0.1:8102", "127.0.0.1:8100", "127.0.0.1:8101"}}) {
    std::unique_ptr<PrefillPicker> picker = MakePicker(order);
    for (const auto& [key, id] : golden) {
      absl::StatusOr<PrefillLease> lease = picker->Pick(key);
      ASSERT_TRUE(lease.ok());
      EXPECT_EQ(lease->id(), id) << key;
    }
  }
}

TEST(PrefillPickerTest, KeysSpreadEvenlyOverFourInstances) {
  const std::vector<std::string> ids = Instances(4);
  std::unique_ptr<PrefillPicker> picker = MakePicker(ids);
  const std::vector<std::string> keys = RandomKeys(10000, 2);
  std::map<std::string, int> counts;
  for (const std::string& id : Mapping(*picker, keys)) ++counts[id];
  ASSERT_EQ(counts.size(), 4u);
  for (const auto& [id, count] : counts) {
    const double share = count / 10000.0;
    EXPECT_GE(share, 0.20) << id;
    EXPECT_LE(share, 0.30) << id;
  }
  EXPECT_EQ(TotalInFlight(*picker), 0);
}

TEST(PrefillPickerTest, AddingAnInstanceMovesAboutAFifthOfTheKeysAllToIt) {
  std::vector<std::string> ids = Instances(4);
  std::unique_ptr<PrefillPicker> picker = MakePicker(ids);
  const std::vector<std::string> keys = RandomKeys(10000, 3);
  const std::vector<std::string> before = Mapping(*picker, keys);
  const std::string added = "10.0.0.99:8100";
  ids.push_back(added);
  ASSERT_TRUE(picker->SetInstances(ids).ok());
  const std::vector<std::string> after = Mapping(*picker, keys);
  int moved = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (before[i] == after[i]) continue;
    ++moved;
    EXPECT_EQ(after[i], added) << "a key moved between two old instances";
  }
  const double fraction = moved / 10000.0;
  EXPECT_GE(fraction, 0.14);
  EXPECT_LE(fraction, 0.26);

  // Removing it again restores the old mapping exactly.
  ids.pop_back();
  ASSERT_TRUE(picker->SetInstances(ids).ok());
  EXPECT_EQ(Mapping(*picker, keys), before);
}

TEST(PrefillPickerTest, RemovingAnInstanceMovesOnlyItsKeys) {
  std::vector<std::string> ids = Instances(5);
  std::unique_ptr<PrefillPicker> picker = MakePicker(ids);
  const std::vector<std::string> keys = RandomKeys(5000, 4);
  const std::vector<std::string> before = Mapping(*picker, keys);
  const std::string removed = ids[2];
  ids.erase(ids.begin() + 2);
  ASSERT_TRUE(picker->SetInstances(ids).ok());
  const std::vector<std::string> after = Mapping(*picker, keys);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (before[i] == removed) {
      EXPECT_NE(after[i], removed);
    } else {
      EXPECT_EQ(after[i], before[i]);
    }
  }
}

TEST(PrefillPickerTest, OnlyThePrefixCounts) {
  PrefillPickerOptions options;
  options.prefix_bytes = 16;
  std::unique_ptr<PrefillPicker> picker = MakePicker(Instances(8), options);
  const std::string system_prompt = "system\nYou are ";  // 15 bytes: the 16th byte differs below
  std::map<std::string, int> same_prefix;
  std::map<std::string, int> different_16th_byte;
  for (int i = 0; i < 200; ++i) {
    const std::string suffix = absl::StrCat(i, " and then a long user question ", i * 7919);
    absl::StatusOr<PrefillLease> a = picker->Pick(absl::StrCat(system_prompt, "X", suffix));
    ASSERT_TRUE(a.ok());
    ++same_prefix[a->id()];
    absl::StatusOr<PrefillLease> b =
        picker->Pick(absl::StrCat(system_prompt, std::string(1, static_cast<char>('a' + i % 26)), suffix));
    ASSERT_TRUE(b.ok());
    ++different_16th_byte[b->id()];
  }
  EXPECT_EQ(same_prefix.size(), 1u);  // one instance serves the shared 16-byte prefix
  EXPECT_GT(different_16th_byte.size(), 1u);
}

// ---- prefix_hash: bounded loads --------------------------------------------------------------------

TEST(PrefillPickerTest, BoundedLoadCapHoldsWhenEveryKeyIsEqual) {
  const int n = 4;
  PrefillPickerOptions options;
  std::unique_ptr<PrefillPicker> picker = MakePicker(Instances(n), options);
  std::vector<PrefillLease> held;
  std::string owner;
  for (int t = 1; t <= 400; ++t) {
    absl::StatusOr<PrefillLease> lease = picker->Pick("the same prompt for everyone");
    ASSERT_TRUE(lease.ok());
    if (t == 1) owner = lease->id();
    held.push_back(*std::move(lease));
    // Every instance stays within ceil(c * total / n) after each pick.
    const int64_t cap = static_cast<int64_t>(std::ceil(options.load_factor * t / n));
    for (const PrefillInstanceLoad& load : picker->Loads()) {
      ASSERT_LE(load.in_flight, cap) << "after " << t << " picks, " << load.id;
    }
  }
  // The owner is full and the overflow spread to every other instance.
  EXPECT_EQ(InFlight(*picker, owner), static_cast<int64_t>(std::ceil(options.load_factor * 400 / n)));
  for (const PrefillInstanceLoad& load : picker->Loads()) EXPECT_GT(load.in_flight, 0) << load.id;
  EXPECT_EQ(TotalInFlight(*picker), 400);
  held.clear();
  EXPECT_EQ(TotalInFlight(*picker), 0);
}

TEST(PrefillPickerTest, SkewedKeysStayWithinTheCap) {
  // 90% of requests share one prefix, the rest are random; all held.
  const int n = 5;
  PrefillPickerOptions options;
  options.load_factor = 1.5;
  std::unique_ptr<PrefillPicker> picker = MakePicker(Instances(n), options);
  const std::vector<std::string> random_keys = RandomKeys(100, 5);
  std::vector<PrefillLease> held;
  for (int t = 1; t <= 1000; ++t) {
    const std::string& key = t % 10 == 0 ? random_keys[t / 10 - 1] : std::string("hot system prompt");
    absl::StatusOr<PrefillLease> lease = picker->Pick(key);
    ASSERT_TRUE(lease.ok());
    held.push_back(*std::move(lease));
    const int64_t cap = static_cast<int64_t>(std::ceil(options.load_factor * t / n));
    for (const PrefillInstanceLoad& load : picker->Loads()) ASSERT_LE(load.in_flight, cap) << t;
  }
}

TEST(PrefillPickerTest, LoadFactorOneBalancesPerfectly) {
  PrefillPickerOptions options;
  options.load_factor = 1;
  std::unique_ptr<PrefillPicker> picker = MakePicker(Instances(3), options);
  std::vector<PrefillLease> held;
  for (int t = 0; t < 30; ++t) {
    absl::StatusOr<PrefillLease> lease = picker->Pick("k");
    ASSERT_TRUE(lease.ok());
    held.push_back(*std::move(lease));
  }
  for (const PrefillInstanceLoad& load : picker->Loads()) EXPECT_EQ(load.in_flight, 10) << load.id;
}

TEST(PrefillPickerTest, AReleasedLeaseLetsTheOwnerTakeItsKeyAgain) {
  std::unique_ptr<PrefillPicker> picker = MakePicker(Instances(4));
  absl::StatusOr<PrefillLease> first = picker->Pick("key");
  ASSERT_TRUE(first.ok());
  const std::string owner = first->id();
  // cap = ceil(1.25 * 2 / 4) = 1: the owner holds one, so the next request overflows.
  absl::StatusOr<PrefillLease> second = picker->Pick("key");
  ASSERT_TRUE(second.ok());
  EXPECT_NE(second->id(), owner);
  first->Release();
  second->Release();
  absl::StatusOr<PrefillLease> third = picker->Pick("key");
  ASSERT_TRUE(third.ok());
  EXPECT_EQ(third->id(), owner);
}

// ---- Exclusion and availability ----------------------------------------------------------------------

TEST(PrefillPickerTest, ExcludedInstancesAreSkipped) {
  for (const PrefillPolicy policy :
       {PrefillPolicy::kPrefixHash, PrefillPolicy::kLeastLoaded, PrefillPolicy::kRoundRobin}) {
    PrefillPickerOptions options;
    options.policy = policy;
    const std::vector<std::string> ids = Instances(3);
    std::unique_ptr<PrefillPicker> picker = MakePicker(ids, options);
    for (const std::string& key : RandomKeys(50, 6)) {
      absl::StatusOr<PrefillLease> lease = picker->Pick(key, {ids[0], ids[2], "not-an-instance:1"});
      ASSERT_TRUE(lease.ok()) << PrefillPolicyName(policy);
      EXPECT_EQ(lease->id(), ids[1]) << PrefillPolicyName(policy);
    }
  }
}

TEST(PrefillPickerTest, ExcludingTheOwnerGoesToTheRingSuccessor) {
  const std::vector<std::string> ids = Instances(4);
  std::unique_ptr<PrefillPicker> picker = MakePicker(ids);
  absl::StatusOr<PrefillLease> owner = picker->Pick("retried prompt");
  ASSERT_TRUE(owner.ok());
  const std::string owner_id = owner->id();
  owner->Release();
  absl::StatusOr<PrefillLease> retry = picker->Pick("retried prompt", {owner_id});
  ASSERT_TRUE(retry.ok());
  EXPECT_NE(retry->id(), owner_id);
  const std::string successor = retry->id();
  retry->Release();
  // Deterministic: the same retry goes to the same successor.
  absl::StatusOr<PrefillLease> again = picker->Pick("retried prompt", {owner_id});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->id(), successor);
}

TEST(PrefillPickerTest, UnavailableWhenEveryInstanceIsExcludedOrNoneExists) {
  const std::vector<std::string> ids = Instances(2);
  std::unique_ptr<PrefillPicker> picker = MakePicker(ids);
  absl::StatusOr<PrefillLease> lease = picker->Pick("k", ids);
  ASSERT_FALSE(lease.ok());
  EXPECT_EQ(lease.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(lease.status().message(), HasSubstr("every prefill instance (2) is excluded"));

  std::unique_ptr<PrefillPicker> empty = MakePicker({});
  absl::StatusOr<PrefillLease> none = empty->Pick("k");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(none.status().message(), HasSubstr("no prefill instance"));

  ASSERT_TRUE(empty->SetInstances({"late:1"}).ok());
  absl::StatusOr<PrefillLease> found = empty->Pick("k");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->id(), "late:1");
}

TEST(PrefillPickerTest, ExclusionsDoNotCountTowardsTheCap) {
  // Two instances, one excluded and busy: the other takes every request (its cap is over the
  // eligible instances only).
  const std::vector<std::string> ids = Instances(2);
  std::unique_ptr<PrefillPicker> picker = MakePicker(ids);
  std::vector<PrefillLease> held;
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<PrefillLease> lease = picker->Pick(absl::StrCat("k", i), {ids[0]});
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(lease->id(), ids[1]);
    held.push_back(*std::move(lease));
  }
}

// ---- Other policies --------------------------------------------------------------------------------

TEST(PrefillPickerTest, RoundRobinCyclesFromTheSeed) {
  PrefillPickerOptions options;
  options.policy = PrefillPolicy::kRoundRobin;
  options.seed = 5;  // 5 % 3 = 2: starts at the third instance
  const std::vector<std::string> ids = Instances(3);
  std::unique_ptr<PrefillPicker> picker = MakePicker(ids, options);
  std::vector<std::string> order;
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<PrefillLease> lease = picker->Pick("ignored");
    ASSERT_TRUE(lease.ok());
    order.push_back(lease->id());
  }
  EXPECT_EQ(order, (std::vector<std::string>{ids[2], ids[0], ids[1], ids[2], ids[0], ids[1]}));
  // An excluded instance is skipped and the cycle continues after the one picked.
  absl::StatusOr<PrefillLease> skipped = picker->Pick("ignored", {ids[2]});
  ASSERT_TRUE(skipped.ok());
  EXPECT_EQ(skipped->id(), ids[0]);
  absl::StatusOr<PrefillLease> next = picker->Pick("ignored");
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->id(), ids[1]);
}

TEST(PrefillPickerTest, LeastLoadedPicksTheFewestInFlightAndRotatesTies) {
  PrefillPickerOptions options;
  options.policy = PrefillPolicy::kLeastLoaded;
  const std::vector<std::string> ids = Instances(3);
  std::unique_ptr<PrefillPicker> picker = MakePicker(ids, options);
  std::vector<PrefillLease> held;
  // Nine held picks: each instance gets three (always the least loaded).
  for (int i = 0; i < 9; ++i) {
    absl::StatusOr<PrefillLease> lease = picker->Pick("same");
    ASSERT_TRUE(lease.ok());
    held.push_back(*std::move(lease));
    int64_t most = 0, least = 1 << 30;
    for (const PrefillInstanceLoad& load : picker->Loads()) {
      most = std::max(most, load.in_flight);
      least = std::min(least, load.in_flight);
    }
    EXPECT_LE(most - least, 1);
  }
  // Free one on ids[1]: it is now the only least loaded one.
  for (PrefillLease& lease : held) {
    if (lease.id() == ids[1]) {
      lease.Release();
      break;
    }
  }
  absl::StatusOr<PrefillLease> lease = picker->Pick("same");
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->id(), ids[1]);
  // Ties rotate: with nothing held, consecutive picks visit every instance.
  held.clear();
  lease->Release();
  std::map<std::string, int> seen;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<PrefillLease> free_pick = picker->Pick("same");
    ASSERT_TRUE(free_pick.ok());
    ++seen[free_pick->id()];
  }
  EXPECT_EQ(seen.size(), 3u);
}

// ---- Leases ----------------------------------------------------------------------------------------

TEST(PrefillLeaseTest, ReleaseMoveAndDestruction) {
  std::unique_ptr<PrefillPicker> picker = MakePicker({"a:1"});
  {
    absl::StatusOr<PrefillLease> picked = picker->Pick("k");
    ASSERT_TRUE(picked.ok());
    PrefillLease lease = *std::move(picked);
    EXPECT_TRUE(lease.valid());
    EXPECT_EQ(lease.id(), "a:1");
    EXPECT_EQ(InFlight(*picker, "a:1"), 1);

    PrefillLease moved(std::move(lease));
    EXPECT_FALSE(lease.valid());  // NOLINT(bugprone-use-after-move): documented moved-from state
    EXPECT_TRUE(lease.id().empty());
    EXPECT_TRUE(moved.valid());
    EXPECT_EQ(InFlight(*picker, "a:1"), 1);

    moved.Release();
    EXPECT_FALSE(moved.valid());
    EXPECT_EQ(moved.id(), "a:1");
    EXPECT_EQ(InFlight(*picker, "a:1"), 0);
    moved.Release();  // idempotent
    EXPECT_EQ(InFlight(*picker, "a:1"), 0);
  }
  {
    absl::StatusOr<PrefillLease> first = picker->Pick("k");
    absl::StatusOr<PrefillLease> second = picker->Pick("k");
    ASSERT_TRUE(first.ok() && second.ok());
    EXPECT_EQ(InFlight(*picker, "a:1"), 2);
    *first = *std::move(second);  // releases first's count, takes over second's
    EXPECT_EQ(InFlight(*picker, "a:1"), 1);
  }  // destruction releases the rest
  EXPECT_EQ(InFlight(*picker, "a:1"), 0);

  PrefillLease empty;
  EXPECT_FALSE(empty.valid());
  empty.Release();
}

TEST(PrefillLeaseTest, ALeaseMayOutliveItsPicker) {
  absl::StatusOr<PrefillLease> lease;
  {
    std::unique_ptr<PrefillPicker> picker = MakePicker({"a:1"});
    lease = picker->Pick("k");
    ASSERT_TRUE(lease.ok());
  }
  EXPECT_TRUE(lease->valid());
  lease->Release();  // no picker anymore: nothing to do, no crash
  EXPECT_FALSE(lease->valid());
}

TEST(PrefillPickerTest, SetInstancesKeepsTheCountsOfKeptInstances) {
  PrefillPickerOptions options;
  options.policy = PrefillPolicy::kRoundRobin;
  std::unique_ptr<PrefillPicker> picker = MakePicker({"a:1", "b:1"}, options);
  std::vector<PrefillLease> on_a, on_b;
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<PrefillLease> lease = picker->Pick("k");
    ASSERT_TRUE(lease.ok());
    (lease->id() == "a:1" ? on_a : on_b).push_back(*std::move(lease));
  }
  ASSERT_EQ(on_a.size(), 3u);
  ASSERT_EQ(on_b.size(), 3u);

  // b goes away, c arrives: a keeps its 3, c starts at 0, b is forgotten.
  ASSERT_TRUE(picker->SetInstances({"c:1", "a:1"}).ok());
  std::vector<PrefillInstanceLoad> loads = picker->Loads();
  ASSERT_EQ(loads.size(), 2u);
  EXPECT_EQ(loads[0].id, "c:1");
  EXPECT_EQ(loads[0].in_flight, 0);
  EXPECT_EQ(loads[1].id, "a:1");
  EXPECT_EQ(loads[1].in_flight, 3);

  // b comes back: it counts afresh, and the leases of its earlier membership release nothing.
  ASSERT_TRUE(picker->SetInstances({"c:1", "a:1", "b:1"}).ok());
  EXPECT_EQ(InFlight(*picker, "b:1"), 0);
  absl::StatusOr<PrefillLease> fresh_b = picker->Pick("k", {"c:1", "a:1"});
  ASSERT_TRUE(fresh_b.ok());
  EXPECT_EQ(fresh_b->id(), "b:1");
  EXPECT_EQ(InFlight(*picker, "b:1"), 1);
  on_b.clear();
  EXPECT_EQ(InFlight(*picker, "b:1"), 1);
  on_a.pop_back();
  EXPECT_EQ(InFlight(*picker, "a:1"), 2);
  on_a.clear();
  fresh_b->Release();
  EXPECT_EQ(TotalInFlight(*picker), 0);
}

TEST(PrefillPickerTest, ConcurrentPicksReleasesAndMembershipChanges) {
  std::unique_ptr<PrefillPicker> picker = MakePicker(Instances(4));
  const std::vector<std::string> keys = RandomKeys(256, 7);
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      std::vector<PrefillLease> held;
      for (int i = 0; i < 20000; ++i) {
        absl::StatusOr<PrefillLease> lease = picker->Pick(keys[(i * 7 + t) % keys.size()]);
        ASSERT_TRUE(lease.ok());
        held.push_back(*std::move(lease));
        if (held.size() > 8) held.erase(held.begin());
      }
    });
  }
  threads.emplace_back([&] {
    for (int i = 0; i < 2000; ++i) {
      std::vector<std::string> ids = Instances(4);
      if (i % 2 == 1) ids.push_back("10.0.0.50:8100");
      ASSERT_TRUE(picker->SetInstances(std::move(ids)).ok());
    }
  });
  for (std::thread& thread : threads) thread.join();
  // Every lease was released: whatever the membership changes, no count leaked or went negative.
  for (const PrefillInstanceLoad& load : picker->Loads()) EXPECT_EQ(load.in_flight, 0) << load.id;
}

}  // namespace
}  // namespace eldr::proxy
