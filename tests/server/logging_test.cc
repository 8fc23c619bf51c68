#include "server/logging.h"

#include <fcntl.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace eldr::server {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// Captures log lines through a pipe for the duration of a test.
class LogCapture {
 public:
  LogCapture() {
    EXPECT_EQ(pipe2(fds_, O_CLOEXEC | O_NONBLOCK), 0);
    SetLogFd(fds_[1]);
  }
  ~LogCapture() {
    SetLogFd(2);
    SetLogLevel(LogLevel::kInfo);
    SetLogFormat(LogFormat::kKeyValue);
    close(fds_[0]);
    close(fds_[1]);
  }
  std::vector<std::string> Lines() {
    std::string text;
    char buf[4096];
    ssize_t n;
    while ((n = read(fds_[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
    std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
    return lines;
  }

 private:
  int fds_[2] = {-1, -1};
};

TEST(Logging, KeyValueLineHasTimestampLevelEventAndFields) {
  LogCapture capture;
  ELDR_LOG(Info, "worker_added").With("worker", "w1").With("capacity", 2.5).With("leases", 3).With("ok", true);
  const auto lines = capture.Lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], StartsWith("ts="));
  EXPECT_THAT(lines[0], HasSubstr(" level=info event=worker_added worker=w1 capacity=2.5 leases=3 ok=true"));
}

TEST(Logging, ValuesThatNeedItAreQuotedAndEscaped) {
  EXPECT_EQ(FormatLogValueForTest(LogFormat::kKeyValue, "plain"), "plain");
  EXPECT_EQ(FormatLogValueForTest(LogFormat::kKeyValue, ""), "\"\"");
  EXPECT_EQ(FormatLogValueForTest(LogFormat::kKeyValue, "two words"), "\"two words\"");
  EXPECT_EQ(FormatLogValueForTest(LogFormat::kKeyValue, "a=b"), "\"a=b\"");
  EXPECT_EQ(FormatLogValueForTest(LogFormat::kKeyValue, "say \"hi\"\n"), "\"say \\\"hi\\\"\\n\"");
  EXPECT_EQ(FormatLogValueForTest(LogFormat::kJson, "tab\there"), "\"tab\\there\"");
  EXPECT_EQ(FormatLogValueForTest(LogFormat::kJson, std::string("\x01", 1)), "\"\\u0001\"");
}

TEST(Logging, JsonLinesParse) {
  LogCapture capture;
  SetLogFormat(LogFormat::kJson);
  ELDR_LOG(Warning, "centroids_rejected")
      .With("source", "/tmp/a \"b\".json")
      .With("code", absl::InvalidArgumentError("row 3 is not unit"))
      .With("generation", uint64_t{18446744073709551615u});
  const auto lines = capture.Lines();
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json j = nlohmann::json::parse(lines[0]);
  EXPECT_EQ(j["level"], "warning");
  EXPECT_EQ(j["event"], "centroids_rejected");
  EXPECT_EQ(j["source"], "/tmp/a \"b\".json");
  EXPECT_EQ(j["code"], "INVALID_ARGUMENT");
  EXPECT_EQ(j["error"], "row 3 is not unit");
  EXPECT_EQ(j["generation"].get<uint64_t>(), 18446744073709551615u);
}

TEST(Logging, DisabledLevelsWriteNothing) {
  LogCapture capture;
  SetLogLevel(LogLevel::kWarning);
  ELDR_LOG(Info, "quiet");
  ELDR_LOG(Debug, "quieter");
  ELDR_LOG(Error, "loud");
  const auto lines = capture.Lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("level=error event=loud"));
}

TEST(Logging, ParsesLevelsAndFormats) {
  EXPECT_EQ(*ParseLogLevel("DEBUG"), LogLevel::kDebug);
  EXPECT_EQ(*ParseLogLevel("warn"), LogLevel::kWarning);
  EXPECT_FALSE(ParseLogLevel("loud").ok());
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_EQ(*ParseLogFormat("kv"), LogFormat::kKeyValue);
  EXPECT_FALSE(ParseLogFormat("xml").ok());
}

}  // namespace
}  // namespace eldr::server
