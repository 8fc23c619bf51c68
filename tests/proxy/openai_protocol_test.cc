#include "eldr/proxy/openai_protocol.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace eldr::proxy {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

constexpr size_t kLimit = 1 << 20;

ClientRequest MustParse(Endpoint endpoint, const std::string& body) {
  absl::StatusOr<ClientRequest> request = ParseClientRequest(endpoint, body, kLimit);
  EXPECT_TRUE(request.ok()) << body << ": " << request.status();
  return request.ok() ? *std::move(request) : ClientRequest{};
}

// int16 little-endian bytes of `values`.
std::string Int16Le(const std::vector<int16_t>& values) {
  std::string bytes;
  for (const int16_t v : values) {
    const auto u = static_cast<uint16_t>(v);
    bytes.push_back(static_cast<char>(u & 0xff));
    bytes.push_back(static_cast<char>(u >> 8));
  }
  return bytes;
}

// ---- ParseClientRequest: rejections -------------------------------------------------------------------

struct RejectCase {
  Endpoint endpoint;
  std::string body;
  absl::StatusCode code;
  std::string message;  // a substring of the status message
};

TEST(ParseClientRequestTest, RejectsEveryBrokenRuleNamingTheField) {
  const Endpoint kC = Endpoint::kCompletions;
  const Endpoint kChat = Endpoint::kChatCompletions;
  const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  const std::vector<RejectCase> cases = {
      // The body itself.
      {kC, "not json", kInvalid, "the request body is not valid JSON: parse error at line 1, column 2"},
      {kC, "{\"prompt\": \"x\",}", kInvalid, "the request body is not valid JSON: parse error"},
      {kC, "", kInvalid, "the request body is not valid JSON"},
      {kC, "{\"prompt\": \"\xff\"}", kInvalid, "not valid JSON"},  // invalid UTF-8
      {kC, "[1]", kInvalid, "the request body must be a JSON object, got an array"},
      {kC, "\"text\"", kInvalid, "must be a JSON object, got a string"},
      {kC, std::string(200, '['), kInvalid,
       "the request body is too deeply nested: arrays and objects are nested more than 128 deep (at byte 128)"},
      {kC, "{\"prompt\": \"x\", \"a\": " + std::string(130, '[') + std::string(130, ']') + "}", kInvalid,
       "nested more than 128 deep"},
      // completions: prompt.
      {kC, "{}", kInvalid, "prompt is required"},
      {kC, "{\"prompt\": null}", kInvalid,
       "prompt must be a non-empty string, a non-empty array of token ids, or an "
       "array holding exactly one of those, got null"},
      {kC, "{\"prompt\": 5}", kInvalid,
       "prompt must be a non-empty string, a non-empty array of token ids, or an "
       "array holding exactly one of those, got 5"},
      {kC, "{\"prompt\": {\"text\": \"x\"}}", kInvalid, "got an object"},
      {kC, "{\"prompt\": \"\"}", kInvalid, "prompt must not be empty"},
      {kC, "{\"prompt\": []}", kInvalid, "prompt must not be empty"},
      {kC, "{\"prompt\": [\"a\", \"b\"]}", kInvalid,
       "prompt holds 2 prompts; the prefill/decode proxy serves one prompt per request"},
      {kC, "{\"prompt\": [[1, 2], [3]]}", kInvalid, "prompt holds 2 prompts"},
      {kC, "{\"prompt\": [\"\"]}", kInvalid, "prompt[0] must not be empty"},
      {kC, "{\"prompt\": [[]]}", kInvalid, "prompt[0] must not be empty"},
      {kC, "{\"prompt\": [1, -2]}", kInvalid, "prompt[1] must be a token id (an integer >= 0), got -2"},
      {kC, "{\"prompt\": [1, 2.5]}", kInvalid, "prompt[1] must be a token id (an integer >= 0), got a non-integer"},
      {kC, "{\"prompt\": [true]}", kInvalid, "prompt[0] must be a token id (an integer >= 0), got true"},
      {kC, "{\"prompt\": [{\"a\": 1}]}", kInvalid, "prompt[0] must be a token id (an integer >= 0), got an object"},
      {kC, "{\"prompt\": [1, \"a\"]}", kInvalid, "prompt[1] must be a token id (an integer >= 0), got a string"},
      {kC, "{\"prompt\": [[\"a\"]]}", kInvalid, "prompt[0][0] must be a token id"},
      {kC, "{\"prompt\": [[7, -1]]}", kInvalid, "prompt[0][1] must be a token id"},
      // chat: messages.
      {kChat, "{}", kInvalid, "messages is required"},
      {kChat, "{\"prompt\": \"x\"}", kInvalid, "messages is required"},
      {kChat, "{\"messages\": null}", kInvalid, "messages must be an array of message objects, got null"},
      {kChat, "{\"messages\": {\"role\": \"user\"}}", kInvalid,
       "messages must be an array of message objects, got an object"},
      {kChat, "{\"messages\": []}", kInvalid, "messages must not be empty"},
      {kChat, "{\"messages\": [5]}", kInvalid, "messages[0] must be an object, got 5"},
      {kChat, "{\"messages\": [{\"content\": \"x\"}]}", kInvalid, "messages[0].role is required"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": 1, \"content\": \"x\"}]}", kInvalid,
       "messages[1].role must be a string, got 1"},
      {kChat, "{\"messages\": [{\"role\": \"user\"}]}", kInvalid,
       "messages[0].content is required (only an assistant message may omit it)"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": null}]}", kInvalid, "messages[0].content is required"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", kInvalid,
       "messages[0].content must be a string or an array of content parts, got 5"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": [\"x\"]}]}", kInvalid,
       "messages[0].content[0] must be a content part object, got a string"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"text\": \"x\"}]}]}", kInvalid,
       "messages[0].content[0].type must be a string"},
      {kChat,
       "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": "
       "\"text\"}]}]}",
       kInvalid, "messages[0].content[1].text must be a string (a \"text\" part)"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": 3}]}]}", kInvalid,
       "messages[0].content[0].text must be a string"},
      // Common fields.
      {kC, "{\"prompt\": \"x\", \"model\": 5}", kInvalid, "model must be a string, got 5"},
      {kC, "{\"prompt\": \"x\", \"stream\": \"yes\"}", kInvalid, "stream must be a boolean, got a string"},
      {kC, "{\"prompt\": \"x\", \"stream\": 1}", kInvalid, "stream must be a boolean, got 1"},
      {kC, "{\"prompt\": \"x\", \"stream_options\": {\"include_usage\": true}}", kInvalid,
       "stream_options can only be set when stream is true"},
      {kC, "{\"prompt\": \"x\", \"stream\": false, \"stream_options\": {}}", kInvalid,
       "stream_options can only be set when stream is true"},
      {kC, "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": 5}", kInvalid,
       "stream_options must be an object, got 5"},
      {kC, "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": {\"include_usage\": 1}}", kInvalid,
       "stream_options.include_usage must be a boolean, got 1"},
      {kC, "{\"prompt\": \"x\", \"max_tokens\": 0}", kInvalid, "max_tokens must be an integer >= 1, got 0"},
      {kC, "{\"prompt\": \"x\", \"max_tokens\": -3}", kInvalid, "max_tokens must be an integer >= 1, got -3"},
      {kC, "{\"prompt\": \"x\", \"max_tokens\": 1.5}", kInvalid,
       "max_tokens must be an integer >= 1, got a non-integer"},
      {kC, "{\"prompt\": \"x\", \"max_tokens\": \"10\"}", kInvalid, "max_tokens must be an integer >= 1, got a string"},
      {kC, "{\"prompt\": \"x\", \"max_tokens\": 18446744073709551615}", kInvalid, "max_tokens is too large"},
      {kC, "{\"prompt\": \"x\", \"max_tokens\": 1e30}", kInvalid, "max_tokens is too large"},
      {kC, "{\"prompt\": \"x\", \"max_tokens\": true}", kInvalid, "max_tokens must be an integer >= 1, got true"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": 0}", kInvalid,
       "max_tokens must be an integer >= 1"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_completion_tokens\": 0}", kInvalid,
       "max_completion_tokens must be an integer >= 1, got 0"},
      {kC, "{\"prompt\": \"x\", \"n\": 2}", kInvalid,
       "n must be 1 (the prefill/decode proxy serves one choice per request), got 2"},
      {kC, "{\"prompt\": \"x\", \"n\": 0}", kInvalid, "n must be 1"},
      {kC, "{\"prompt\": \"x\", \"n\": 1.5}", kInvalid, "n must be 1"},
      {kC, "{\"prompt\": \"x\", \"n\": \"1\"}", kInvalid,
       "n must be 1 (the prefill/decode proxy serves one choice per "
       "request), got a string"},
      {kChat, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"n\": 4}", kInvalid, "n must be 1"},
      {kC, "{\"prompt\": \"x\", \"best_of\": 3}", kInvalid, "best_of must be 1"},
  };
  for (const RejectCase& c : cases) {
    absl::StatusOr<ClientRequest> request = ParseClientRequest(c.endpoint, c.body, kLimit);
    ASSERT_FALSE(request.ok()) << c.body;
    EXPECT_EQ(request.status().code(), c.code) << c.body << ": " << request.status();
    EXPECT_THAT(request.status().message(), HasSubstr(c.message)) << c.body;
  }
}

TEST(ParseClientRequestTest, BodySizeLimit) {
  const std::string body = "{\"prompt\": \"0123456789\"}";
  EXPECT_TRUE(ParseClientRequest(Endpoint::kCompletions, body, body.size()).ok());
  absl::StatusOr<ClientRequest> request = ParseClientRequest(Endpoint::kCompletions, body, body.size() - 1);
  ASSERT_FALSE(request.ok());
  EXPECT_EQ(request.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(request.status().message(),
            absl::StrCat("the request body is ", body.size(), " bytes; at most ", body.size() - 1, " are accepted"));
}

TEST(ParseClientRequestTest, BracketsInsideStringsDoNotCountAsNesting) {
  const std::string text = std::string(500, '[') + "\\\"{{{";
  ClientRequest request = MustParse(Endpoint::kCompletions, "{\"prompt\": \"" + text + "\"}");
  EXPECT_EQ(request.prompt_key, std::string(500, '[') + "\"{{{");
}

// ---- ParseClientRequest: accepted requests ------------------------------------------------------------

TEST(ParseClientRequestTest, CompletionsPromptShapesAndTheirKeys) {
  struct Case {
    std::string prompt;
    std::string key;
  };
  const std::vector<Case> cases = {
      {"\"Hello, world\"", "Hello, world"},
      {"[\"only one\"]", "only one"},
      {"[1, 22, 333]", "1,22,333"},
      {"[0]", "0"},
      {"[[4, 5]]", "4,5"},
      {"[7.0, 8]", "7,8"},             // an integral float is an integer (pydantic's lax mode)
      {"[18446744073709551615]", ""},  // too large for a token id: rejected below
  };
  for (const Case& c : cases) {
    absl::StatusOr<ClientRequest> request =
        ParseClientRequest(Endpoint::kCompletions, absl::StrCat("{\"prompt\": ", c.prompt, "}"), kLimit);
    if (c.key.empty()) {
      EXPECT_FALSE(request.ok()) << c.prompt;
      continue;
    }
    ASSERT_TRUE(request.ok()) << c.prompt << ": " << request.status();
    EXPECT_EQ(request->prompt_key, c.key) << c.prompt;
    EXPECT_EQ(request->endpoint, Endpoint::kCompletions);
    EXPECT_FALSE(request->stream);
    EXPECT_FALSE(request->include_usage);
    EXPECT_FALSE(request->max_tokens.has_value());
    EXPECT_EQ(request->model, "");
  }
}

TEST(ParseClientRequestTest, ReadsTheCommonFields) {
  ClientRequest request = MustParse(Endpoint::kCompletions,
                                    R"({"model": "deepseek-v2-lite-esft", "prompt": "p", "stream": true,
                    "stream_options": {"include_usage": true}, "max_tokens": 64, "n": 1, "best_of": 1,
                    "temperature": 0.5, "logit_bias": {"50256": -100}})");
  EXPECT_EQ(request.model, "deepseek-v2-lite-esft");
  EXPECT_TRUE(request.stream);
  EXPECT_TRUE(request.include_usage);
  EXPECT_EQ(request.max_tokens, 64);
  // Everything passes through untouched.
  EXPECT_EQ(request.body["temperature"], 0.5);
  EXPECT_EQ(request.body["logit_bias"], Json({{"50256", -100}}));
}

TEST(ParseClientRequestTest, IntegralFloatsAreIntegers) {
  ClientRequest request = MustParse(Endpoint::kCompletions, R"({"prompt": "p", "max_tokens": 64.0, "n": 1.0})");
  EXPECT_EQ(request.max_tokens, 64);
  EXPECT_EQ(request.body["max_tokens"], 64.0);  // forwarded as sent
}

TEST(ParseClientRequestTest, NullFieldsCountAsAbsent) {
  ClientRequest request = MustParse(
      Endpoint::kChatCompletions,
      R"({"messages": [{"role": "user", "content": "hi"}], "model": null, "stream": null, "stream_options": null,
          "max_tokens": null, "max_completion_tokens": null, "n": null})");
  EXPECT_EQ(request.model, "");
  EXPECT_FALSE(request.stream);
  EXPECT_FALSE(request.include_usage);
  EXPECT_FALSE(request.max_tokens.has_value());

  ClientRequest streamed = MustParse(Endpoint::kCompletions,
                                     R"({"prompt": "x", "stream": true, "stream_options": {"include_usage": null}})");
  EXPECT_TRUE(streamed.stream);
  EXPECT_FALSE(streamed.include_usage);
}

TEST(ParseClientRequestTest, ChatKeyAndContentParts) {
  ClientRequest request = MustParse(Endpoint::kChatCompletions, R"({"messages": [
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": [{"type": "text", "text": "Look "},
                                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                    {"type": "text", "text": "here"}]},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                                                            "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "42"},
      {"role": "assistant"}]})");
  EXPECT_EQ(request.prompt_key, "system\nYou are terse.\nuser\nLook here\nassistant\n\ntool\n42\nassistant\n\n");
  EXPECT_EQ(request.endpoint, Endpoint::kChatCompletions);
}

TEST(ParseClientRequestTest, ChatMaxCompletionTokensWinsOverMaxTokens) {
  EXPECT_EQ(
      MustParse(Endpoint::kChatCompletions,
                R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "max_completion_tokens": 20})")
          .max_tokens,
      20);
  EXPECT_EQ(
      MustParse(Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10})")
          .max_tokens,
      10);
  // Completions have no max_completion_tokens: it passes through unread.
  ClientRequest completions = MustParse(Endpoint::kCompletions, R"({"prompt": "x", "max_completion_tokens": 0})");
  EXPECT_FALSE(completions.max_tokens.has_value());
  EXPECT_EQ(completions.body["max_completion_tokens"], 0);
}

TEST(EndpointTest, Paths) {
  EXPECT_EQ(EndpointPath(Endpoint::kCompletions), "/v1/completions");
  EXPECT_EQ(EndpointPath(Endpoint::kChatCompletions), "/v1/chat/completions");
}

// ---- MakePrefillBody / MakeDecodeBody ---------------------------------------------------------------

const Json kPrefillKvParams = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                               {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                               {"remote_host", nullptr},      {"remote_port", nullptr}};

TEST(MakePrefillBodyTest, CompletionsAsVllmsProxyBuildsIt) {
  const std::string client = R"({"model": "m", "prompt": "hi", "max_tokens": 50, "stream": true,
      "stream_options": {"include_usage": true}, "min_tokens": 3, "temperature": 0.7, "seed": 9,
      "kv_transfer_params": {"do_remote_prefill": true, "client": "sent this"}})";
  const ClientRequest request = MustParse(Endpoint::kCompletions, client);
  const Json expected = {{"model", "m"},
                         {"prompt", "hi"},
                         {"max_tokens", 1},
                         {"stream", false},
                         {"temperature", 0.7},
                         {"seed", 9},
                         {"kv_transfer_params", kPrefillKvParams}};
  EXPECT_EQ(Json::parse(MakePrefillBody(request)), expected);
  // The request itself is unchanged.
  EXPECT_EQ(request.body, Json::parse(client));
}

TEST(MakePrefillBodyTest, ChatWithMaxCompletionTokens) {
  const ClientRequest request = MustParse(Endpoint::kChatCompletions, R"({"model": "m",
      "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 20, "min_completion_tokens": 2,
      "stream": true})");
  const Json expected = {{"model", "m"},
                         {"messages", Json::array({{{"role", "user"}, {"content", "hi"}}})},
                         {"max_completion_tokens", 1},
                         {"max_tokens", 1},
                         {"stream", false},
                         {"kv_transfer_params", kPrefillKvParams}};
  EXPECT_EQ(Json::parse(MakePrefillBody(request)), expected);
}

TEST(MakePrefillBodyTest, ChatWithoutMaxTokensGetsOnlyMaxTokens) {
  const ClientRequest request =
      MustParse(Endpoint::kChatCompletions, R"({"messages": [{"role": "user", "content": "hi"}]})");
  const Json expected = {{"messages", Json::array({{{"role", "user"}, {"content", "hi"}}})},
                         {"max_tokens", 1},
                         {"stream", false},
                         {"kv_transfer_params", kPrefillKvParams}};
  EXPECT_EQ(Json::parse(MakePrefillBody(request)), expected);
}

TEST(MakeDecodeBodyTest, TheClientsBodyWithThePrefillsParams) {
  const std::string client = R"({"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": true,
      "stream_options": {"include_usage": true}, "min_tokens": 3, "temperature": 0.7,
      "big": 12345678901234567, "unicode": "h\u00e9llo \u2603"})";
  const ClientRequest request = MustParse(Endpoint::kCompletions, client);
  const Json params = {{"do_remote_prefill", true},
                       {"do_remote_decode", false},
                       {"remote_engine_id", "engine-1"},
                       {"remote_request_id", "r-1"},
                       {"remote_block_ids", {4, 5, 6}},
                       {"remote_host", "10.0.0.1"},
                       {"remote_port", 8100},
                       {"tp_size", 1}};
  Json expected = Json::parse(client);
  expected["kv_transfer_params"] = params;
  const Json decode = Json::parse(MakeDecodeBody(request, params));
  EXPECT_EQ(decode, expected);
  EXPECT_EQ(decode["big"].get<int64_t>(), 12345678901234567);
  EXPECT_EQ(decode["unicode"], "h\xc3\xa9llo \xe2\x98\x83");
}

// ---- ParsePrefillResponse -----------------------------------------------------------------------------

// A prefill answer in the shape docs/engine-emulator.md shows, with `extra` merged into its
// kv_transfer_params.
std::string PrefillAnswer(const Json& extra,
                          const Json& usage = Json{
                              {"prompt_tokens", 37}, {"completion_tokens", 1}, {"total_tokens", 38}}) {
  Json params = {{"do_remote_prefill", true},     {"do_remote_decode", false},
                 {"remote_engine_id", "e1"},      {"remote_request_id", "req-1"},
                 {"remote_block_ids", {0, 1, 2}}, {"remote_host", "127.0.0.1"},
                 {"remote_port", 8100},           {"tp_size", 1}};
  for (const auto& [key, value] : extra.items()) params[key] = value;
  Json answer = {{"id", "cmpl-req-1"},
                 {"object", "text_completion"},
                 {"created", 1764000000},
                 {"model", "m"},
                 {"choices", Json::array({{{"index", 0},
                                           {"text", " t7_0"},
                                           {"logprobs", nullptr},
                                           {"finish_reason", "length"},
                                           {"stop_reason", nullptr}}})},
                 {"kv_transfer_params", params}};
  if (!usage.is_null()) answer["usage"] = usage;
  return answer.dump();
}

const Json kForwardedParams = {{"do_remote_prefill", true},     {"do_remote_decode", false},
                               {"remote_engine_id", "e1"},      {"remote_request_id", "req-1"},
                               {"remote_block_ids", {0, 1, 2}}, {"remote_host", "127.0.0.1"},
                               {"remote_port", 8100},           {"tp_size", 1}};

Json CountsEntry(int layers, int experts, const std::string& bytes) {
  return {{"layers", layers}, {"experts", experts}, {"encoding", "int16_le"}, {"data", absl::Base64Escape(bytes)}};
}

TEST(ParsePrefillResponseTest, ReadsEldrExpertCounts) {
  const std::string bytes = Int16Le({1, 0, 7, 32767, 2, 300});
  absl::StatusOr<PrefillResult> result =
      ParsePrefillResponse(PrefillAnswer({{"eldr_expert_counts", CountsEntry(2, 3, bytes)}}));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE(result->signature.has_value());
  EXPECT_EQ(result->signature->layers, 2);
  EXPECT_EQ(result->signature->experts, 3);
  EXPECT_EQ(result->signature->int16_le, bytes);
  EXPECT_EQ(result->signature->source, "eldr_expert_counts");
  EXPECT_EQ(result->signature_problem, "");
  EXPECT_EQ(result->kv_transfer_params, kForwardedParams);
  EXPECT_EQ(result->prompt_tokens, 37);
}

TEST(ParsePrefillResponseTest, ReadsEldrSigWithoutGeometry) {
  const std::string bytes = Int16Le({5, 6, 7, 8});
  absl::StatusOr<PrefillResult> result = ParsePrefillResponse(PrefillAnswer({{"eldr_sig", absl::Base64Escape(bytes)}}));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE(result->signature.has_value());
  EXPECT_EQ(result->signature->layers, 0);
  EXPECT_EQ(result->signature->experts, 0);
  EXPECT_EQ(result->signature->int16_le, bytes);
  EXPECT_EQ(result->signature->source, "eldr_sig");
  EXPECT_EQ(result->signature_problem, "");
  EXPECT_EQ(result->kv_transfer_params, kForwardedParams);
}

TEST(ParsePrefillResponseTest, BothKeysPreferTheCountsAndRemoveBoth) {
  const std::string counts = Int16Le({1, 2});
  absl::StatusOr<PrefillResult> result = ParsePrefillResponse(PrefillAnswer(
      {{"eldr_expert_counts", CountsEntry(1, 2, counts)}, {"eldr_sig", absl::Base64Escape(Int16Le({9, 9, 9}))}}));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE(result->signature.has_value());
  EXPECT_EQ(result->signature->source, "eldr_expert_counts");
  EXPECT_EQ(result->signature->int16_le, counts);
  EXPECT_EQ(result->kv_transfer_params, kForwardedParams);
}

std::string Float32Le(const std::vector<float>& values) {
  std::string out;
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    for (int b = 0; b < 4; ++b) out.push_back(static_cast<char>((bits >> (8 * b)) & 0xff));
  }
  return out;
}

Json GateEntry(int layers, int experts, const std::string& bytes) {
  return {{"layers", layers}, {"experts", experts}, {"encoding", "float32_le"}, {"data", absl::Base64Escape(bytes)}};
}

TEST(ParsePrefillResponseTest, ReadsGateProbSumsBesideTheCountsAndAlone) {
  const std::string counts = Int16Le({1, 2, 0});
  const std::string sums = Float32Le({0.5f, 1.25f, 0.f});
  absl::StatusOr<PrefillResult> result = ParsePrefillResponse(PrefillAnswer(
      {{"eldr_expert_counts", CountsEntry(1, 3, counts)}, {"eldr_gate_prob_sums", GateEntry(1, 3, sums)}}));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE(result->signature.has_value());
  EXPECT_EQ(result->signature->source, "eldr_expert_counts");
  EXPECT_EQ(result->signature->int16_le, counts);
  EXPECT_EQ(result->signature->float32_le, sums);
  EXPECT_EQ(result->signature_problem, "");
  EXPECT_EQ(result->kv_transfer_params, kForwardedParams);  // removed before the decode

  result = ParsePrefillResponse(PrefillAnswer({{"eldr_gate_prob_sums", GateEntry(1, 3, sums)}}));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE(result->signature.has_value());
  EXPECT_EQ(result->signature->source, "eldr_gate_prob_sums");
  EXPECT_EQ(result->signature->layers, 1);
  EXPECT_EQ(result->signature->experts, 3);
  EXPECT_EQ(result->signature->int16_le, "");
  EXPECT_EQ(result->signature->float32_le, sums);
}

TEST(ParsePrefillResponseTest, UnusableGateProbSumsAreDroppedWithTheReason) {
  const std::string counts = Int16Le({1, 2});
  const std::vector<std::pair<Json, std::string>> cases = {
      {GateEntry(1, 2, Float32Le({0.5f})), "holds 4 bytes"},
      {GateEntry(1, 2, Float32Le({0.5f, std::nanf("")})), "non-finite"},
      {GateEntry(1, 2, Float32Le({-1.f, 0.f})), "negative"},
      {Json{{"layers", 1}, {"experts", 2}, {"encoding", "int16_le"}, {"data", absl::Base64Escape(counts)}},
       "float32_le"},
      {GateEntry(2, 1, Float32Le({0.5f, 0.5f})), "but the counts are 1 x 2"},
  };
  for (const auto& [entry, reason] : cases) {
    absl::StatusOr<PrefillResult> result = ParsePrefillResponse(
        PrefillAnswer({{"eldr_expert_counts", CountsEntry(1, 2, counts)}, {"eldr_gate_prob_sums", entry}}));
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE(result->signature.has_value()) << reason;
    EXPECT_EQ(result->signature->int16_le, counts) << reason;  // the counts are still used
    EXPECT_EQ(result->signature->float32_le, "") << reason;
    EXPECT_THAT(result->signature_problem, HasSubstr(reason));
    EXPECT_EQ(result->kv_transfer_params, kForwardedParams);
  }
}

TEST(ParsePrefillResponseTest, NoSignatureIsNoProblem) {
  absl::StatusOr<PrefillResult> result = ParsePrefillResponse(PrefillAnswer(Json::object()));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FALSE(result->signature.has_value());
  EXPECT_EQ(result->signature_problem, "");
  EXPECT_EQ(result->kv_transfer_params, kForwardedParams);
}

struct BadSignatureCase {
  const char* name;
  Json extra;           // merged into kv_transfer_params
  std::string problem;  // a substring of signature_problem
};

TEST(ParsePrefillResponseTest, BadSignaturesAreDroppedWithAReasonAndTheRequestGoesOn) {
  const std::string twelve = Int16Le({1, 2, 3, 4, 5, 6});
  auto counts = [&](Json entry) { return Json{{"eldr_expert_counts", std::move(entry)}}; };
  auto with = [&](const char* key, Json value) {
    Json entry = CountsEntry(2, 3, twelve);
    entry[key] = std::move(value);
    return Json{{"eldr_expert_counts", std::move(entry)}};
  };
  auto without = [&](const char* key) {
    Json entry = CountsEntry(2, 3, twelve);
    entry.erase(key);
    return Json{{"eldr_expert_counts", std::move(entry)}};
  };
  const std::vector<BadSignatureCase> cases = {
      {"not an object", counts("AAAA"), "eldr_expert_counts must be an object, got a string"},
      {"null", counts(nullptr), "eldr_expert_counts must be an object, got null"},
      {"layers missing", without("layers"), "eldr_expert_counts.layers must be an integer in [1, 65536], got nothing"},
      {"layers 0", with("layers", 0), "eldr_expert_counts.layers must be an integer in [1, 65536], got 0"},
      {"layers -2", with("layers", -2), "eldr_expert_counts.layers must be an integer in [1, 65536], got -2"},
      {"layers 1.5", with("layers", 1.5),
       "eldr_expert_counts.layers must be an integer in [1, 65536], got a non-integer"},
      {"layers string", with("layers", "2"),
       "eldr_expert_counts.layers must be an integer in [1, 65536], got a string"},
      {"layers huge", with("layers", 70000), "eldr_expert_counts.layers must be an integer in [1, 65536], got 70000"},
      {"experts 0", with("experts", 0), "eldr_expert_counts.experts must be an integer in [1, 65536], got 0"},
      {"too many counts", counts(CountsEntry(65536, 65536, "")), "has 65536 x 65536 counts; at most 16777216"},
      {"encoding missing", without("encoding"), "eldr_expert_counts.encoding must be \"int16_le\", got nothing"},
      {"encoding int32", with("encoding", "int32_le"),
       "eldr_expert_counts.encoding must be \"int16_le\", got \"int32_le\""},
      {"encoding number", with("encoding", 16), "eldr_expert_counts.encoding must be \"int16_le\", got 16"},
      {"data missing", without("data"), "eldr_expert_counts.data must be a base64 string"},
      {"data not a string", with("data", Json::array({1, 2})), "eldr_expert_counts.data must be a base64 string"},
      {"data bad character", with("data", "AAAA!AAA"),
       "eldr_expert_counts.data: invalid base64: character 0x21 at position 4"},
      {"data with whitespace", with("data", "AAAA AAA"), "eldr_expert_counts.data: invalid base64: character 0x20"},
      {"data unpadded", with("data", "AAE"), "eldr_expert_counts.data: invalid base64: the length 3"},
      {"data short", with("data", absl::Base64Escape(twelve.substr(0, 10))),
       "eldr_expert_counts.data holds 10 bytes; 2 x 3 int16 counts need 12"},
      {"data long", with("data", absl::Base64Escape(twelve + "xx")),
       "eldr_expert_counts.data holds 14 bytes; 2 x 3 int16 counts need 12"},
      {"negative count", counts(CountsEntry(2, 3, Int16Le({1, 2, 3, 4, 5, -5}))),
       "eldr_expert_counts has a negative count (-5 at layer 1, expert 2)"},
      {"sig not a string", {{"eldr_sig", 5}}, "eldr_sig must be a base64 string, got 5"},
      {"sig bad base64", {{"eldr_sig", "QUJ="}}, "eldr_sig: invalid base64: non-zero padding bits"},
      {"sig odd length",
       {{"eldr_sig", absl::Base64Escape("abc")}},
       "eldr_sig holds 3 bytes; int16 counts need a non-zero, even number of bytes"},
      {"sig empty", {{"eldr_sig", ""}}, "eldr_sig holds 0 bytes"},
      {"sig negative",
       {{"eldr_sig", absl::Base64Escape(Int16Le({0, 1, -1}))}},
       "eldr_sig has a negative count (-1 at index 2)"},
  };
  for (const BadSignatureCase& c : cases) {
    absl::StatusOr<PrefillResult> result = ParsePrefillResponse(PrefillAnswer(c.extra));
    ASSERT_TRUE(result.ok()) << c.name << ": " << result.status();
    EXPECT_FALSE(result->signature.has_value()) << c.name;
    EXPECT_THAT(result->signature_problem, HasSubstr(c.problem)) << c.name;
    EXPECT_EQ(result->kv_transfer_params, kForwardedParams) << c.name;
    EXPECT_EQ(result->prompt_tokens, 37) << c.name;
  }
}

TEST(ParsePrefillResponseTest, BadCountsFallBackToAGoodEldrSig) {
  const std::string sig = Int16Le({3, 4});
  absl::StatusOr<PrefillResult> result = ParsePrefillResponse(
      PrefillAnswer({{"eldr_expert_counts", {{"layers", 1}, {"experts", 2}, {"encoding", "fp8"}, {"data", "AAAA"}}},
                     {"eldr_sig", absl::Base64Escape(sig)}}));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_TRUE(result->signature.has_value());
  EXPECT_EQ(result->signature->source, "eldr_sig");
  EXPECT_EQ(result->signature->int16_le, sig);
  EXPECT_THAT(result->signature_problem, HasSubstr("eldr_expert_counts.encoding"));
  EXPECT_EQ(result->kv_transfer_params, kForwardedParams);

  absl::StatusOr<PrefillResult> both_bad =
      ParsePrefillResponse(PrefillAnswer({{"eldr_expert_counts", "x"}, {"eldr_sig", "x"}}));
  ASSERT_TRUE(both_bad.ok());
  EXPECT_FALSE(both_bad->signature.has_value());
  EXPECT_EQ(both_bad->signature_problem,
            "eldr_expert_counts must be an object, got a string; eldr_sig: invalid base64: the length 1 is not a "
            "multiple of 4 (padding missing?)");
}

TEST(ParsePrefillResponseTest, PromptTokens) {
  struct Case {
    Json usage;
    int64_t prompt_tokens;
  };
  const std::vector<Case> cases = {
      {nullptr, 0},  // no usage
      {Json{{"prompt_tokens", 5}}, 5},
      {Json{{"prompt_tokens", 0}}, 0},
      {Json{{"prompt_tokens", -5}}, 0},
      {Json{{"prompt_tokens", "5"}}, 0},
      {Json{{"prompt_tokens", 5.5}}, 0},
      {Json{{"completion_tokens", 1}}, 0},
      {Json("usage"), 0},
  };
  for (const Case& c : cases) {
    absl::StatusOr<PrefillResult> result = ParsePrefillResponse(PrefillAnswer(Json::object(), c.usage));
    ASSERT_TRUE(result.ok()) << c.usage;
    EXPECT_EQ(result->prompt_tokens, c.prompt_tokens) << c.usage;
  }
}

TEST(ParsePrefillResponseTest, AnswersThatCannotBeForwarded) {
  const std::string no_params =
      "the prefill engine returned no kv_transfer_params: is it running with a KV connector (kv_role kv_producer or "
      "kv_both)?";
  struct Case {
    std::string body;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"({"id": "cmpl-1", "choices": []})", absl::StatusCode::kFailedPrecondition, no_params},
      {R"({"kv_transfer_params": null})", absl::StatusCode::kFailedPrecondition, no_params},
      {R"({"kv_transfer_params": [1]})", absl::StatusCode::kFailedPrecondition, no_params},
      {"<html>502</html>", absl::StatusCode::kInternal, "the prefill engine's answer is not valid JSON: parse error"},
      {"[]", absl::StatusCode::kInternal, "the prefill engine's answer must be a JSON object, got an array"},
      {"{\"a\": " + std::string(300, '[') + std::string(300, ']') + "}", absl::StatusCode::kInternal,
       "the prefill engine's answer is too deeply nested: arrays and objects are nested more than 128 deep"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<PrefillResult> result = ParsePrefillResponse(c.body);
    ASSERT_FALSE(result.ok()) << c.body;
    EXPECT_EQ(result.status().code(), c.code) << c.body;
    EXPECT_THAT(result.status().message(), HasSubstr(c.message)) << c.body;
  }
  // An empty kv_transfer_params object is forwarded as such.
  absl::StatusOr<PrefillResult> empty = ParsePrefillResponse(R"({"kv_transfer_params": {}})");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->kv_transfer_params, Json::object());
}

TEST(ParsePrefillResponseTest, ChatAnswerEndToEndIntoTheDecodeBody) {
  const ClientRequest request = MustParse(Endpoint::kChatCompletions, R"({"model": "m", "stream": true,
      "messages": [{"role": "user", "content": "eldr-trace:7"}], "max_completion_tokens": 8})");
  const Json answer = {
      {"id", "chatcmpl-r"},
      {"object", "chat.completion"},
      {"choices",
       Json::array(
           {{{"index", 0}, {"message", {{"role", "assistant"}, {"content", " t7_0"}}}, {"finish_reason", "length"}}})},
      {"usage", {{"prompt_tokens", 12}, {"completion_tokens", 1}, {"total_tokens", 13}}},
      {"kv_transfer_params",
       {{"do_remote_prefill", true},
        {"remote_engine_id", "e"},
        {"remote_block_ids", {1}},
        {"eldr_expert_counts", CountsEntry(1, 1, Int16Le({12}))}}}};
  absl::StatusOr<PrefillResult> result = ParsePrefillResponse(answer.dump());
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->prompt_tokens, 12);
  ASSERT_TRUE(result->signature.has_value());
  const Json decode = Json::parse(MakeDecodeBody(request, result->kv_transfer_params));
  Json expected = request.body;
  expected["kv_transfer_params"] = {{"do_remote_prefill", true}, {"remote_engine_id", "e"}, {"remote_block_ids", {1}}};
  EXPECT_EQ(decode, expected);
}

// ---- Base64DecodeStrict -------------------------------------------------------------------------------

TEST(Base64DecodeStrictTest, AcceptsCanonicalEncodings) {
  struct Case {
    std::string text;
    std::string bytes;
  };
  const std::vector<Case> cases = {
      {"", ""}, {"QQ==", "A"}, {"QUI=", "AB"}, {"QUJD", "ABC"}, {"/+8=", "\xff\xef"}, {"AAAA", std::string(3, '\0')},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> decoded = Base64DecodeStrict(c.text);
    ASSERT_TRUE(decoded.ok()) << c.text << ": " << decoded.status();
    EXPECT_EQ(*decoded, c.bytes) << c.text;
  }
  // Round trip of random bytes of every length up to 64 through absl::Base64Escape.
  std::mt19937 generator(11);
  for (int length = 0; length <= 64; ++length) {
    std::string bytes(length, '\0');
    for (char& b : bytes) b = static_cast<char>(generator());
    absl::StatusOr<std::string> decoded = Base64DecodeStrict(absl::Base64Escape(bytes));
    ASSERT_TRUE(decoded.ok()) << length;
    EXPECT_EQ(*decoded, bytes);
  }
}

TEST(Base64DecodeStrictTest, RejectsWhatAbslWouldTolerate) {
  struct Case {
    std::string text;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"QUI", "the length 3 is not a multiple of 4"},
      {"QUJDQ", "the length 5 is not a multiple of 4"},
      {"QU I", "character 0x20 at position 2 is not in the alphabet"},
      {"QUJDQUI\n", "character 0x0a at position 7"},
      {"QU-D", "character 0x2d at position 2"},  // the URL-safe alphabet is not accepted
      {"QU_D", "character 0x5f at position 2"},
      {"QUJ=", "non-zero padding bits in the character at position 2"},
      {"QR==", "non-zero padding bits in the character at position 1"},
      {"Q===", "'=' at position 1"},
      {"QQ=A", "'=' at position 2"},
      {"QQ==QQ==", "'=' at position 2"},
      {"====", "'=' at position 0"},
      {"QU\xc3\xa9", "character 0xc3 at position 2"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> decoded = Base64DecodeStrict(c.text);
    ASSERT_FALSE(decoded.ok()) << c.text;
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(decoded.status().message(), HasSubstr(c.message)) << c.text;
  }
}

TEST(ParseJsonTest, DepthLimitAndMessages) {
  EXPECT_TRUE(ParseJson("[[[]]]", 3).ok());
  absl::StatusOr<Json> deep = ParseJson("[[[[]]]]", 3);
  ASSERT_FALSE(deep.ok());
  EXPECT_EQ(deep.status().message(), "arrays and objects are nested more than 3 deep (at byte 3)");
  absl::StatusOr<Json> bad = ParseJson("{\"a\": tru}");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("parse error at line 1, column"));
  EXPECT_THAT(std::string(bad.status().message()), ::testing::Not(HasSubstr("json.exception")));
  absl::StatusOr<Json> overflow = ParseJson("[1e400]");
  EXPECT_FALSE(overflow.ok());
}

}  // namespace
}  // namespace eldr::proxy
