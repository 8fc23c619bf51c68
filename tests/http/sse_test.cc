// Tests of SseParser and SseDataEvent (include/eldr/http/sse.h): every rule of the header, and that
// feeding a stream in pieces split at any byte boundary yields the same events as feeding it whole.
#include "eldr/http/sse.h"

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eldr::http {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// An event as a comparable value: event/data/id/retry.
struct Seen {
  std::string event;
  std::string data;
  std::string id;
  std::optional<int64_t> retry_ms;
  bool operator==(const Seen& other) const {
    return event == other.event && data == other.data && id == other.id && retry_ms == other.retry_ms;
  }
};

void PrintTo(const Seen& seen, std::ostream* out) {
  *out << "{event=\"" << seen.event << "\" data=\"" << seen.data << "\" id=\"" << seen.id << "\" retry=";
  if (seen.retry_ms) {
    *out << *seen.retry_ms;
  } else {
    *out << "none";
  }
  *out << "}";
}

Seen Data(std::string data) { return Seen{"", std::move(data), "", std::nullopt}; }

// Feeds `pieces` one after the other; every Feed must succeed.
std::vector<Seen> FeedPieces(SseParser& parser, const std::vector<absl::string_view>& pieces) {
  std::vector<Seen> seen;
  for (absl::string_view piece : pieces) {
    const absl::Status status = parser.Feed(piece, [&](const SseEvent& event) {
      seen.push_back(Seen{event.event, event.data, event.id, event.retry_ms});
    });
    EXPECT_TRUE(status.ok()) << status;
  }
  return seen;
}

std::vector<Seen> FeedWhole(absl::string_view stream) {
  SseParser parser;
  return FeedPieces(parser, {stream});
}

TEST(SseParserTest, OpenAiStream) {
  const std::string stream =
      "data: {\"choices\":[{\"text\":\" t7_1\"}]}\n\n"
      "data: {\"choices\":[{\"text\":\" t7_2\"}]}\n\n"
      "data: [DONE]\n\n";
  EXPECT_THAT(FeedWhole(stream), ElementsAre(Data("{\"choices\":[{\"text\":\" t7_1\"}]}"),
                                             Data("{\"choices\":[{\"text\":\" t7_2\"}]}"), Data("[DONE]")));
}

TEST(SseParserTest, LineEndingsLfCrlfAndCrAreEquivalent) {
  const std::vector<Seen> expected = {Seen{"update", "a\nb", "7", std::nullopt}, Data("c")};
  EXPECT_EQ(FeedWhole("event: update\ndata: a\ndata: b\nid: 7\n\ndata: c\n\n"), expected);
  EXPECT_EQ(FeedWhole("event: update\r\ndata: a\r\ndata: b\r\nid: 7\r\n\r\ndata: c\r\n\r\n"), expected);
  EXPECT_EQ(FeedWhole("event: update\rdata: a\rdata: b\rid: 7\r\rdata: c\r\r"), expected);
  EXPECT_EQ(FeedWhole("event: update\r\ndata: a\rdata: b\nid: 7\r\n\rdata: c\n\r\n"), expected);
}

TEST(SseParserTest, CrLfSplitAcrossPiecesIsOneLineEnd) {
  SseParser parser;
  // Were the LF after the CR taken as a second line end, the first event would be dispatched
  // early and "data: y" would form a separate event.
  EXPECT_THAT(FeedPieces(parser, {"data: x\r", "\ndata: y\r", "\n\r", "\n"}), ElementsAre(Data("x\ny")));
}

TEST(SseParserTest, EveryByteBoundaryGivesTheSameEvents) {
  const std::string stream =
      "\xEF\xBB\xBF: comment\r\n"
      "event: delta\r\ndata: {\"a\":1}\r\nid: 42\r\nretry: 1500\r\n\r\n"
      "data:no space\rdata:  two spaces\r\r"
      "data\n\n"
      "id: lonely\n\n"
      "data: last\n\n";
  const std::vector<Seen> expected = {Seen{"delta", "{\"a\":1}", "42", 1500}, Data("no space\n two spaces"), Data(""),
                                      Data("last")};
  ASSERT_EQ(FeedWhole(stream), expected);
  for (size_t first = 0; first <= stream.size(); ++first) {
    SseParser parser;
    EXPECT_EQ(FeedPieces(parser, {absl::string_view(stream).substr(0, first), absl::string_view(stream).substr(first)}),
              expected)
        << "split at " << first;
  }
  for (size_t first = 0; first <= stream.size(); ++first) {
    for (size_t second = first; second <= stream.size(); second += 7) {
      SseParser parser;
      const absl::string_view view(stream);
      EXPECT_EQ(FeedPieces(parser, {view.substr(0, first), view.substr(first, second - first), view.substr(second)}),
                expected)
          << "split at " << first << " and " << second;
    }
  }
  // One byte at a time.
  SseParser parser;
  std::vector<absl::string_view> bytes;
  for (size_t i = 0; i < stream.size(); ++i) bytes.push_back(absl::string_view(stream).substr(i, 1));
  EXPECT_EQ(FeedPieces(parser, bytes), expected);
}

TEST(SseParserTest, CommentsAreIgnored) {
  EXPECT_THAT(FeedWhole(": keep-alive\n\n:\ndata: x\n: between\ndata: y\n\n"), ElementsAre(Data("x\ny")));
}

TEST(SseParserTest, LeadingByteOrderMarkIsSkippedOnlyAtTheStart) {
  EXPECT_THAT(FeedWhole("\xEF\xBB\xBF"
                        "data: x\n\n"),
              ElementsAre(Data("x")));
  // A second BOM is part of the first field name, which then is not "data": nothing is dispatched.
  EXPECT_THAT(FeedWhole("\xEF\xBB\xBF\xEF\xBB\xBF"
                        "data: x\n\n"),
              IsEmpty());
  // A BOM later in the stream is just bytes of a value.
  EXPECT_THAT(FeedWhole("data: a\n\ndata: \xEF\xBB\xBF"
                        "b\n\n"),
              ElementsAre(Data("a"), Data("\xEF\xBB\xBF"
                                          "b")));
  // Bytes that start like a BOM but are not one stay part of the first line.
  EXPECT_THAT(FeedWhole("\xEF\xBB"
                        "data: x\n\n"),
              IsEmpty());
  SseParser parser;
  EXPECT_THAT(FeedPieces(parser, {"\xEF", "\xBB", "\xBF", "data: split\n\n"}), ElementsAre(Data("split")));
}

TEST(SseParserTest, MultiLineDataIsJoinedWithLf) {
  EXPECT_THAT(FeedWhole("data: one\ndata: two\ndata:\ndata: four\n\n"), ElementsAre(Data("one\ntwo\n\nfour")));
}

TEST(SseParserTest, EventsWithoutDataAreNotDispatched) {
  EXPECT_THAT(FeedWhole("event: ping\n\nid: 3\n\nretry: 10\n\n\n\n"), IsEmpty());
  // The fields of an undispatched event do not leak into the next one.
  EXPECT_THAT(FeedWhole("event: ping\nid: 9\n\ndata: x\n\n"), ElementsAre(Data("x")));
}

TEST(SseParserTest, FieldsAndValues) {
  // No colon: the whole line is the field name with an empty value; unknown fields are ignored;
  // only one space after the colon is stripped.
  EXPECT_THAT(FeedWhole("data\nfoo: bar\nDATA: upper case is another field\ndata:   x\n\n"),
              ElementsAre(Data("\n  x")));
  // The last event/id of an event wins; an id with NUL is ignored.
  EXPECT_THAT(FeedWhole("event: a\nevent: b\nid: 1\nid: 2\ndata: d\n\n"), ElementsAre(Seen{"b", "d", "2", {}}));
  EXPECT_THAT(FeedWhole(std::string("id: 5\nid: x\0y\ndata: d\n\n", 23)), ElementsAre(Seen{"", "d", "5", {}}));
  // retry: only all digits.
  EXPECT_THAT(FeedWhole("retry: 250\ndata: a\n\nretry: 25x\ndata: b\n\nretry:\ndata: c\n\nretry: -5\ndata: d\n\n"),
              ElementsAre(Seen{"", "a", "", 250}, Data("b"), Data("c"), Data("d")));
  // The id is this event's own.
  EXPECT_THAT(FeedWhole("id: 1\ndata: a\n\ndata: b\n\n"), ElementsAre(Seen{"", "a", "1", {}}, Data("b")));
}

TEST(SseParserTest, IncompleteEventStaysPending) {
  SseParser parser;
  EXPECT_EQ(parser.pending_bytes(), 0u);
  EXPECT_THAT(FeedPieces(parser, {"data: abc\n"}), IsEmpty());
  EXPECT_EQ(parser.pending_bytes(), 3u);  // the value "abc"
  EXPECT_THAT(FeedPieces(parser, {"data: de"}), IsEmpty());
  EXPECT_EQ(parser.pending_bytes(), 3u + 8u);  // "abc" and the incomplete line "data: de"
  EXPECT_THAT(FeedPieces(parser, {"\n\n"}), ElementsAre(Data("abc\nde")));
  EXPECT_EQ(parser.pending_bytes(), 0u);
}

TEST(SseParserTest, LineLimitFailsAndStaysFailed) {
  SseParser parser(16);
  // A line of exactly the limit is fine.
  EXPECT_THAT(FeedPieces(parser, {"data: 0123456789\n\n"}), ElementsAre(Data("0123456789")));
  int events = 0;
  const auto count = [&](const SseEvent&) { ++events; };
  // An unterminated line beyond the limit fails at once, before any terminator arrives.
  absl::Status status = parser.Feed("data: 0123456789A", count);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), HasSubstr("16 bytes"));
  status = parser.Feed("\n\ndata: ok\n\n", count);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_EQ(events, 0);
}

TEST(SseParserTest, LongLineAcrossPiecesFails) {
  SseParser parser(10);
  const auto ignore = [](const SseEvent&) {};
  EXPECT_TRUE(parser.Feed("data:", ignore).ok());
  EXPECT_TRUE(parser.Feed(" 1234", ignore).ok());
  EXPECT_EQ(parser.Feed("5\n", ignore).code(), absl::StatusCode::kResourceExhausted);
}

TEST(SseParserTest, EventLimitCountsAllItsFields) {
  SseParser parser(10);
  int events = 0;
  const auto count = [&](const SseEvent&) { ++events; };
  // Each line is short, but the data lines together (with their joining LFs) exceed the limit.
  EXPECT_TRUE(parser.Feed("data: 1234\ndata: 5\n", count).ok());  // 4 + 1 + 1 = 6
  EXPECT_TRUE(parser.Feed("event: abc\n", count).ok());           // 9
  const absl::Status status = parser.Feed("data: xy\n", count);   // 9 + 3 > 10
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(status.message(), HasSubstr("event"));
  EXPECT_EQ(parser.Feed("\n", count).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(events, 0);
  // A fresh parser accepts an event within the limit.
  SseParser fresh(10);
  EXPECT_TRUE(fresh.Feed("data: 1234\ndata: 5\n\n", count).ok());
  EXPECT_EQ(events, 1);
}

TEST(SseDataEventTest, Format) {
  EXPECT_EQ(SseDataEvent("{\"a\":1}"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(SseDataEvent(""), "data: \n\n");
  EXPECT_EQ(SseDataEvent("a\nb"), "data: a\ndata: b\n\n");
  EXPECT_EQ(SseDataEvent("a\r\nb\rc"), "data: a\ndata: b\ndata: c\n\n");
}

TEST(SseDataEventTest, RoundTrip) {
  for (const std::string& payload :
       {std::string("{\"id\":\"cmpl-1\",\"choices\":[{\"text\":\" t1_1\"}]}"), std::string("[DONE]"), std::string(""),
        std::string(" leading space"), std::string("multi\nline\n\npayload"), std::string("trailing LF\n"),
        std::string(": looks like a comment"), std::string(1000, 'x')}) {
    std::string stream;
    for (int i = 0; i < 3; ++i) stream += SseDataEvent(payload);
    EXPECT_THAT(FeedWhole(stream), ElementsAre(Data(payload), Data(payload), Data(payload))) << payload;
  }
}

}  // namespace
}  // namespace eldr::http
