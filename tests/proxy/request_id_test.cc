#include "eldr/proxy/request_id.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::proxy {
namespace {

using ::testing::HasSubstr;

TEST(RequestIdTest, NewIdsAreHexAndDistinct) {
  absl::flat_hash_set<std::string> seen;
  for (int i = 0; i < 10000; ++i) {
    const std::string id = NewRequestId();
    ASSERT_EQ(id.size(), 32u);
    for (const char c : id) ASSERT_TRUE((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) << id;
    EXPECT_TRUE(ValidateRequestId(id).ok());
    EXPECT_TRUE(seen.insert(id).second) << "repeated id " << id;
  }
}

TEST(RequestIdTest, ConcurrentGenerationGivesDistinctIds) {
  std::vector<std::vector<std::string>> ids(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&ids, t] {
      for (int i = 0; i < 5000; ++i) ids[t].push_back(NewRequestId());
    });
  }
  for (std::thread& thread : threads) thread.join();
  absl::flat_hash_set<std::string> seen;
  for (const auto& list : ids) {
    for (const std::string& id : list) EXPECT_TRUE(seen.insert(id).second);
  }
  EXPECT_EQ(seen.size(), 20000u);
}

TEST(RequestIdTest, ValidateRequestId) {
  EXPECT_TRUE(ValidateRequestId("a").ok());
  EXPECT_TRUE(ValidateRequestId("cmpl-0a1b2c_~!").ok());
  EXPECT_TRUE(ValidateRequestId(std::string(kMaxRequestIdBytes, 'x')).ok());
  struct Case {
    std::string id;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"", "the request id is empty"},
      {std::string(kMaxRequestIdBytes + 1, 'x'), "the request id is 257 bytes long; at most 256 are accepted"},
      {"has space", "byte 0x20 at position 3"},
      {"tab\there", "byte 0x09 at position 3"},
      {"crlf\r\n", "byte 0x0d at position 4"},
      {"caf\xc3\xa9", "byte 0xc3 at position 3; only visible ASCII (0x21-0x7e) is accepted"},
      {std::string("nul\0", 4), "byte 0x00 at position 3"},
      {"del\x7f", "byte 0x7f at position 3"},
  };
  for (const Case& c : cases) {
    const absl::Status status = ValidateRequestId(c.id);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
  }
}

}  // namespace
}  // namespace eldr::proxy
