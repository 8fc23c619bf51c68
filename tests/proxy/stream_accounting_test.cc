#include "eldr/proxy/stream_accounting.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "eldr/http/sse.h"
#include "eldr/openai/errors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace eldr::proxy {
namespace {

using Json = nlohmann::json;

// The data of each event of a simple "data: ...\n\n" stream (one data line per event, as engines
// send them).
std::vector<std::string> EventData(absl::string_view stream) {
  std::vector<std::string> data;
  for (absl::string_view event : absl::StrSplit(stream, "\n\n", absl::SkipEmpty())) {
    EXPECT_TRUE(absl::ConsumePrefix(&event, "data: ")) << event;
    data.emplace_back(event);
  }
  return data;
}

// docs/engine-emulator.md's streamed completion with stream_options.include_usage.
constexpr absl::string_view kCompletionStream =
    "data: {\"id\":\"cmpl-r1\",\"object\":\"text_completion\",\"created\":1764000000,\"model\":\"m\","
    "\"choices\":[{\"index\":0,\"text\":\" t7_1\",\"logprobs\":null,\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"cmpl-r1\",\"object\":\"text_completion\",\"created\":1764000000,\"model\":\"m\","
    "\"choices\":[{\"index\":0,\"text\":\" t7_2\",\"logprobs\":null,\"finish_reason\":\"length\"}]}\n\n"
    "data: {\"id\":\"cmpl-r1\",\"object\":\"text_completion\",\"created\":1764000000,\"model\":\"m\","
    "\"choices\":[],\"usage\":{\"prompt_tokens\":37,\"completion_tokens\":2,\"total_tokens\":39}}\n\n"
    "data: [DONE]\n\n";

// The same for chat, without the usage chunk.
constexpr absl::string_view kChatStream =
    "data: {\"id\":\"chatcmpl-r2\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"m\","
    "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,"
    "\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-r2\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"m\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\" t7_1\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-r2\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"m\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\" t7_2\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n"
    "data: {\"id\":\"chatcmpl-r2\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"m\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\" t7_3\"},\"logprobs\":null,\"finish_reason\":\"stop\"}]}\n\n"
    "data: [DONE]\n\n";

TEST(DecodeStreamObserverTest, CompletionsStreamWithUsageChunk) {
  DecodeStreamObserver observer;
  const std::vector<std::string> events = EventData(kCompletionStream);
  ASSERT_EQ(events.size(), 4u);

  DecodeEventInfo first = observer.OnEventData(events[0]);
  EXPECT_TRUE(first.token);
  EXPECT_TRUE(first.first_token);
  EXPECT_FALSE(first.usage || first.done || first.error || first.malformed);
  EXPECT_TRUE(observer.first_token_seen());
  EXPECT_EQ(observer.finish_reason(), "");

  DecodeEventInfo second = observer.OnEventData(events[1]);
  EXPECT_TRUE(second.token);
  EXPECT_FALSE(second.first_token);
  EXPECT_EQ(observer.finish_reason(), "length");
  EXPECT_EQ(observer.output_tokens(), 2);  // counted so far

  DecodeEventInfo usage = observer.OnEventData(events[2]);  // vLLM's usage chunk: "choices": []
  EXPECT_FALSE(usage.token);
  EXPECT_TRUE(usage.usage);
  EXPECT_EQ(observer.usage_completion_tokens(), 2);
  EXPECT_EQ(observer.usage_prompt_tokens(), 37);
  EXPECT_EQ(observer.finish_reason(), "length");  // an empty choices array leaves it

  DecodeEventInfo done = observer.OnEventData(events[3]);
  EXPECT_TRUE(done.done);
  EXPECT_FALSE(done.token || done.malformed);

  EXPECT_EQ(observer.events(), 4);
  EXPECT_EQ(observer.token_events(), 2);
  EXPECT_EQ(observer.malformed_events(), 0);
  EXPECT_EQ(observer.output_tokens(), 2);
  EXPECT_TRUE(observer.done_seen());
  EXPECT_FALSE(observer.error_seen());
}

TEST(DecodeStreamObserverTest, ChatStreamCountsTokenEventsWithoutUsage) {
  DecodeStreamObserver observer;
  std::vector<DecodeEventInfo> infos;
  for (const std::string& data : EventData(kChatStream)) infos.push_back(observer.OnEventData(data));
  ASSERT_EQ(infos.size(), 5u);
  EXPECT_FALSE(infos[0].token);  // the role-only first chunk is no token
  EXPECT_FALSE(infos[0].first_token);
  EXPECT_TRUE(infos[1].first_token);
  EXPECT_FALSE(infos[2].first_token);
  EXPECT_TRUE(infos[4].done);
  EXPECT_EQ(observer.token_events(), 3);
  EXPECT_FALSE(observer.usage_completion_tokens().has_value());
  EXPECT_EQ(observer.output_tokens(), 3);
  EXPECT_EQ(observer.finish_reason(), "stop");
  EXPECT_TRUE(observer.done_seen());
}

TEST(DecodeStreamObserverTest, UsageWinsOverTheCountAndTheLastUsageCounts) {
  // vLLM's continuous usage stats: cumulative usage on every chunk, and tokens merged in a chunk.
  DecodeStreamObserver observer;
  observer.OnEventData(R"({"choices":[{"index":0,"text":"ab"}],"usage":{"prompt_tokens":5,"completion_tokens":2}})");
  EXPECT_EQ(observer.output_tokens(), 2);
  observer.OnEventData(R"({"choices":[{"index":0,"text":"cde"}],"usage":{"prompt_tokens":5,"completion_tokens":5}})");
  EXPECT_EQ(observer.token_events(), 2);
  EXPECT_EQ(observer.output_tokens(), 5);
  // A usage without a usable completion_tokens changes nothing.
  DecodeEventInfo info = observer.OnEventData(R"({"choices":[],"usage":{"completion_tokens":-1}})");
  EXPECT_FALSE(info.usage);
  EXPECT_EQ(observer.output_tokens(), 5);
}

TEST(DecodeStreamObserverTest, WhatCountsAsAToken) {
  struct Case {
    const char* data;
    bool token;
  };
  const Case cases[] = {
      {R"({"choices":[{"index":0,"text":"x"}]})", true},
      {R"({"choices":[{"index":0,"text":""}]})", false},
      {R"({"choices":[{"index":0,"text":null}]})", false},
      {R"({"choices":[{"index":0,"delta":{"content":"x"}}]})", true},
      {R"({"choices":[{"index":0,"delta":{"content":""}}]})", false},
      {R"({"choices":[{"index":0,"delta":{"role":"assistant"}}]})", false},
      {R"({"choices":[{"index":0,"delta":{"reasoning_content":"think"}}]})", true},
      {R"({"choices":[{"index":0,"delta":{"reasoning":"think"}}]})", true},
      {R"({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]})", true},
      {R"({"choices":[{"index":0,"delta":{"tool_calls":[]}}]})", false},
      {R"({"choices":[{"index":0,"delta":{}}, {"index":1,"delta":{"content":"y"}}]})", true},
      {R"({"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]})", false},
      {R"({"choices":[]})", false},
      {R"({"choices":"x"})", false},
      {R"({"choices":[5]})", false},
      {R"({})", false},
  };
  for (const Case& c : cases) {
    DecodeStreamObserver observer;
    const DecodeEventInfo info = observer.OnEventData(c.data);
    EXPECT_EQ(info.token, c.token) << c.data;
    EXPECT_EQ(info.first_token, c.token) << c.data;
    EXPECT_FALSE(info.malformed) << c.data;
    EXPECT_EQ(observer.token_events(), c.token ? 1 : 0) << c.data;
  }
}

TEST(DecodeStreamObserverTest, ErrorObjectsOfBothShapes) {
  struct Case {
    const char* data;
    const char* message;
  };
  const Case cases[] = {
      {R"({"error":{"message":"KV transfer failed","type":"ServiceUnavailableError","param":null,"code":503}})",
       "KV transfer failed"},
      {R"({"object":"error","message":"The model `x` does not exist.","type":"NotFoundError","param":null,"code":404})",
       "The model `x` does not exist."},
      {R"({"error":"overloaded"})", "overloaded"},
      {R"({"error":{"code":500}})", R"({"error":{"code":500}})"},
  };
  for (const Case& c : cases) {
    DecodeStreamObserver observer;
    observer.OnEventData(R"({"choices":[{"index":0,"text":"x"}]})");
    const DecodeEventInfo info = observer.OnEventData(c.data);
    EXPECT_TRUE(info.error) << c.data;
    EXPECT_FALSE(info.token) << c.data;
    EXPECT_TRUE(observer.error_seen()) << c.data;
    EXPECT_EQ(observer.error_message(), c.message) << c.data;
    // The first error's message stays.
    observer.OnEventData(R"({"error":{"message":"second"}})");
    EXPECT_EQ(observer.error_message(), c.message) << c.data;
  }
  DecodeStreamObserver observer;
  EXPECT_FALSE(observer.OnEventData(R"({"error":null,"choices":[{"index":0,"text":"x"}]})").error);
  EXPECT_FALSE(observer.error_seen());
}

TEST(DecodeStreamObserverTest, MalformedEventsAreCountedAndIgnored) {
  DecodeStreamObserver observer;
  for (const char* data : {"not json", "[1,2]", "42", "", "{\"choices\":[", "[DONE"}) {
    const DecodeEventInfo info = observer.OnEventData(data);
    EXPECT_TRUE(info.malformed) << data;
    EXPECT_FALSE(info.token || info.done || info.error) << data;
  }
  EXPECT_EQ(observer.malformed_events(), 6);
  EXPECT_EQ(observer.events(), 6);
  EXPECT_EQ(observer.output_tokens(), 0);
  EXPECT_FALSE(observer.first_token_seen());
  EXPECT_FALSE(observer.done_seen());
  EXPECT_TRUE(observer.OnEventData(" [DONE]\r\n").done);  // whitespace around [DONE] is tolerated
}

TEST(DecodeStreamObserverTest, TakesSseEvents) {
  DecodeStreamObserver observer;
  eldr::http::SseEvent event;
  event.data = R"({"choices":[{"index":0,"delta":{"content":"hi"}}]})";
  EXPECT_TRUE(observer.OnEvent(event).first_token);
  event.data = "[DONE]";
  EXPECT_TRUE(observer.OnEvent(event).done);
  EXPECT_EQ(observer.events(), 2);
}

// ---- Non-streamed answers ---------------------------------------------------------------------------

TEST(OutputTokensOfResponseTest, ReadsUsage) {
  struct Case {
    const char* body;
    int64_t tokens;
    bool from_usage;
  };
  const Case cases[] = {
      {R"({"object":"text_completion","choices":[{"index":0,"text":" t7_1 t7_2"}],
           "usage":{"prompt_tokens":37,"completion_tokens":2,"total_tokens":39}})",
       2, true},
      {R"({"object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"a"}}],
           "usage":{"prompt_tokens":1,"completion_tokens":0,"total_tokens":1}})",
       0, true},
      {R"({"choices":[{"index":0,"text":"a b c"}]})", 0, false},
      {R"({"usage":null})", 0, false},
      {R"({"usage":{"completion_tokens":-4}})", 0, false},
      {R"({"usage":{"completion_tokens":"4"}})", 0, false},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ResponseTokens> tokens = OutputTokensOfResponse(c.body);
    ASSERT_TRUE(tokens.ok()) << c.body;
    EXPECT_EQ(tokens->output_tokens, c.tokens) << c.body;
    EXPECT_EQ(tokens->from_usage, c.from_usage) << c.body;
  }
  absl::StatusOr<ResponseTokens> bad = OutputTokensOfResponse("<html>");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              ::testing::HasSubstr("the decode engine's answer is not valid JSON"));
  EXPECT_FALSE(OutputTokensOfResponse("[1]").ok());
}

// ---- The error event the proxy ends a broken stream with, read back -------------------------------

TEST(SseErrorEventTest, ErrorThenDone) {
  const std::string events =
      openai::SseErrorEvent("decode engine 10.0.0.3:8200 failed", "ServiceUnavailableError", 502);
  EXPECT_TRUE(absl::StartsWith(events, "data: {"));
  EXPECT_TRUE(absl::EndsWith(events, "}\n\ndata: [DONE]\n\n"));
  const std::vector<std::string> data = EventData(events);
  ASSERT_EQ(data.size(), 2u);
  EXPECT_EQ(Json::parse(data[0]), Json({{"error",
                                         {{"message", "decode engine 10.0.0.3:8200 failed"},
                                          {"type", "ServiceUnavailableError"},
                                          {"param", nullptr},
                                          {"code", 502}}}}));
  EXPECT_EQ(data[1], "[DONE]");
  // The proxy's own observer reads it as an error followed by the end.
  DecodeStreamObserver observer;
  EXPECT_TRUE(observer.OnEventData(data[0]).error);
  EXPECT_TRUE(observer.OnEventData(data[1]).done);
  EXPECT_EQ(observer.error_message(), "decode engine 10.0.0.3:8200 failed");
  // A message with line breaks stays on one data line.
  EXPECT_EQ(EventData(openai::SseErrorEvent("a\nb", "InternalServerError", 500)).size(), 2u);
}

}  // namespace
}  // namespace eldr::proxy
