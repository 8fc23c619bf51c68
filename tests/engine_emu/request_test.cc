// Request parsing and validation, the trace lookup (marker and FNV-1a fallback), vLLM's error
// bodies, and the counts payload.
#include "engine_emu/request.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "engine_emu/catalog.h"
#include "engine_emu/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace eldr::engine_emu {
namespace {

using testing::BundledCatalog;
using ::testing::HasSubstr;

TEST(TraceMarkerTest, FindsTheFirstMarkerAnywhere) {
  EXPECT_EQ(ParseTraceMarker("eldr-trace:7", 100), 7);
  EXPECT_EQ(ParseTraceMarker("Summarise this. eldr-trace:42 please", 100), 42);
  EXPECT_EQ(ParseTraceMarker("eldr-trace:3 and eldr-trace:5", 100), 3);
  EXPECT_EQ(ParseTraceMarker("x eldr-trace:12abc", 100), 12);
}

TEST(TraceMarkerTest, TakesTheNumberModuloThePool) {
  EXPECT_EQ(ParseTraceMarker("eldr-trace:107", 100), 7);
  EXPECT_EQ(ParseTraceMarker("eldr-trace:0", 5), 0);
  // More digits than any integer type holds: reduced digit by digit.
  // 10^30 mod 7 = 1 (10^6 = 1 mod 7, so 10^30 = 1).
  EXPECT_EQ(ParseTraceMarker(absl::StrCat("eldr-trace:1", std::string(30, '0')), 7), 1);
}

TEST(TraceMarkerTest, SkipsOccurrencesWithoutDigits) {
  EXPECT_EQ(ParseTraceMarker("eldr-trace: 5", 100), std::nullopt);
  EXPECT_EQ(ParseTraceMarker("eldr-trace:x eldr-trace:9", 100), 9);
  EXPECT_EQ(ParseTraceMarker("eldr-trace:", 100), std::nullopt);
  EXPECT_EQ(ParseTraceMarker("ELDR-TRACE:5", 100), std::nullopt);  // case-sensitive
  EXPECT_EQ(ParseTraceMarker("no marker here", 100), std::nullopt);
}

TEST(TraceMarkerTest, FallsBackToFnvOfTheText) {
  EXPECT_EQ(TraceIndexForPrompt("hello world", 97), static_cast<int>(Fnv1a64("hello world") % 97));
  EXPECT_EQ(TraceIndexForPrompt("eldr-trace:5", 97), 5);
}

TEST(CountsPayloadTest, LittleEndianInt16ClippedAtZero) {
  const std::vector<int16_t> counts = {0, 1, 258, -3, 32767};
  const std::string base64 = EncodeCountsBase64(counts);
  const std::vector<int16_t> back = testing::DecodeCountsBase64(base64);
  EXPECT_EQ(back, (std::vector<int16_t>{0, 1, 258, 0, 32767}));
  // 258 = 0x0102: low byte first.
  EXPECT_EQ(EncodeCountsBase64(std::vector<int16_t>{258}), "AgE=");
}

TEST(TraceCatalogTest, BundledTracesLoad) {
  const auto catalog = BundledCatalog();
  ASSERT_GT(catalog->size(), 10);
  EXPECT_EQ(catalog->layers(), 26);
  EXPECT_EQ(catalog->experts(), 64);
  EXPECT_EQ(catalog->top_k(), 6);
  for (int i = 0; i < catalog->size(); ++i) {
    EXPECT_EQ(testing::DecodeCountsBase64(catalog->counts_base64(i)), catalog->request(i).prompt_counts) << i;
  }
  // Decode experts cycle beyond the trace's decode steps.
  const sim::SimRequest& r = catalog->request(0);
  EXPECT_EQ(catalog->DecodeExperts(0, 0), catalog->workload().DecodeToken(r, 0));
  EXPECT_EQ(catalog->DecodeExperts(0, r.decode_steps + 1), catalog->workload().DecodeToken(r, 1));
}

TEST(TraceCatalogTest, RejectsAnEmptyPool) {
  sim::Workload workload;
  workload.layers = 2;
  workload.experts = 4;
  workload.top_k = 1;
  EXPECT_EQ(TraceCatalog::Create(std::move(workload)).status().code(), absl::StatusCode::kInvalidArgument);
}

class ParseTest : public ::testing::Test {
 protected:
  absl::StatusOr<EngineRequest> Parse(ApiKind api, const std::string& body, EngineRole role = EngineRole::kDecode) {
    RequestParserOptions options;
    options.role = role;
    options.model = "m1";
    return ParseEngineRequest(options, *BundledCatalog(), api, body);
  }
  void ExpectInvalid(ApiKind api, const std::string& body, const std::string& message_part,
                     EngineRole role = EngineRole::kDecode) {
    absl::StatusOr<EngineRequest> r = Parse(api, body, role);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(HttpStatusForError(r.status()), 400);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(message_part)) << body;
  }
};

TEST_F(ParseTest, CompletionsFields) {
  absl::StatusOr<EngineRequest> r = Parse(
      ApiKind::kCompletions,
      R"({"model":"m1","prompt":"eldr-trace:3 hi","max_tokens":5,"stream":true,"stream_options":{"include_usage":true},"temperature":0.7})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->api, ApiKind::kCompletions);
  EXPECT_EQ(r->trace_index, 3);
  EXPECT_EQ(r->max_tokens, 5);
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_FALSE(r->remote_prefill.has_value());
}

TEST_F(ParseTest, DefaultsAndPromptArrays) {
  absl::StatusOr<EngineRequest> r = Parse(ApiKind::kCompletions, R"({"prompt":["eldr-trace:4","eldr-trace:9"]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->trace_index, 4);  // the first element
  EXPECT_EQ(r->max_tokens, std::nullopt);
  EXPECT_FALSE(r->stream);
  EXPECT_FALSE(r->include_usage);
  r = Parse(ApiKind::kCompletions, R"({"prompt":"no marker","max_tokens":null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->trace_index, TraceIndexForPrompt("no marker", BundledCatalog()->size()));
  EXPECT_EQ(r->max_tokens, std::nullopt);
}

TEST_F(ParseTest, ChatJoinsMessageContents) {
  absl::StatusOr<EngineRequest> r = Parse(ApiKind::kChat, R"({"messages":[
      {"role":"system","content":"be brief"},
      {"role":"user","content":"what?"},
      {"role":"assistant","content":null},
      {"role":"user","content":[{"type":"text","text":"more"},{"type":"image_url","image_url":{"url":"x"}}]}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->trace_index, TraceIndexForPrompt("be brief\nwhat?\nmore", BundledCatalog()->size()));
  r = Parse(ApiKind::kChat, R"({"messages":[{"role":"user","content":"eldr-trace:11"}]})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->trace_index, 11);
}

TEST_F(ParseTest, ChatPrefersMaxCompletionTokens) {
  absl::StatusOr<EngineRequest> r =
      Parse(ApiKind::kChat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":9,"max_completion_tokens":4})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->max_tokens, 4);
  r = Parse(ApiKind::kChat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":9})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->max_tokens, 9);
  // Completions ignore max_completion_tokens.
  r = Parse(ApiKind::kCompletions, R"({"prompt":"x","max_completion_tokens":4})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->max_tokens, std::nullopt);
}

TEST_F(ParseTest, BadBodies) {
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt": "x",)", "not valid JSON");
  ExpectInvalid(ApiKind::kCompletions, "", "not valid JSON");
  ExpectInvalid(ApiKind::kCompletions, R"(["prompt"])", "must be a JSON object");
  ExpectInvalid(ApiKind::kCompletions, R"("x")", "must be a JSON object");
  ExpectInvalid(ApiKind::kCompletions, R"({})", "no prompt");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":""})", "empty");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":[]})", "empty array");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":[1,2,3]})", "token ids");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":7})", "string or an array");
  ExpectInvalid(ApiKind::kChat, R"({"prompt":"x"})", "no messages");
  ExpectInvalid(ApiKind::kChat, R"({"messages":[]})", "empty");
  ExpectInvalid(ApiKind::kChat, R"({"messages":"hi"})", "must be an array");
  ExpectInvalid(ApiKind::kChat, R"({"messages":[{"role":"user","content":""}]})", "no prompt text");
  ExpectInvalid(ApiKind::kChat, R"({"messages":[{"role":"user","content":5}]})", "content");
  ExpectInvalid(ApiKind::kChat, R"({"messages":[7]})", "must be an object");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","model":5})", "'model' must be a string");
}

TEST_F(ParseTest, BadMaxTokens) {
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","max_tokens":0})", "at least 1");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","max_tokens":-5})", "at least 1");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","max_tokens":"5"})", "must be an integer");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","max_tokens":2.5})", "must be an integer");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","max_tokens":99999999999999999999})", "");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","max_tokens":40000})", "maximum context length is 32768");
  ExpectInvalid(ApiKind::kChat, R"({"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0})",
                "at least 1");
}

TEST_F(ParseTest, BadTypes) {
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","stream":"yes"})", "'stream' must be a boolean");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","stream":true,"stream_options":{"include_usage":1}})",
                "stream_options.include_usage");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","stream_options":[]})", "'stream_options'");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","kv_transfer_params":"p"})", "'kv_transfer_params'");
}

TEST_F(ParseTest, UnknownModelIs404WithVllmsMessage) {
  absl::StatusOr<EngineRequest> r = Parse(ApiKind::kCompletions, R"({"prompt":"x","model":"gpt-9"})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(HttpStatusForError(r.status()), 404);
  EXPECT_EQ(r.status().message(), "The model `gpt-9` does not exist.");
}

TEST_F(ParseTest, PrefillRoleNeedsDoRemoteDecode) {
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x"})",
                "this emulator's prefill role serves disaggregated prefill only "
                "(kv_transfer_params.do_remote_decode)",
                EngineRole::kPrefill);
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","kv_transfer_params":{"do_remote_decode":false}})",
                "disaggregated prefill only", EngineRole::kPrefill);
  absl::StatusOr<EngineRequest> r =
      Parse(ApiKind::kCompletions,
            R"({"prompt":"x","max_tokens":1,"stream":true,"kv_transfer_params":{"do_remote_decode":true}})",
            EngineRole::kPrefill);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->stream);  // a prefill is answered in one piece
}

TEST_F(ParseTest, DecodeRoleRemotePrefill) {
  absl::StatusOr<EngineRequest> r = Parse(ApiKind::kCompletions, R"({"prompt":"x","kv_transfer_params":{
      "do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e1","remote_request_id":"r1",
      "remote_block_ids":[4,5,6],"remote_host":"10.0.0.2","remote_port":8100,"tp_size":1}})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->remote_prefill.has_value());
  EXPECT_EQ(r->remote_prefill->engine_id, "e1");
  EXPECT_EQ(r->remote_prefill->request_id, "r1");
  EXPECT_EQ(r->remote_prefill->block_ids, (std::vector<int64_t>{4, 5, 6}));
  EXPECT_EQ(r->remote_prefill->host, "10.0.0.2");
  EXPECT_EQ(r->remote_prefill->port, 8100);
  // do_remote_prefill false: prefilled locally.
  r = Parse(ApiKind::kCompletions, R"({"prompt":"x","kv_transfer_params":{"do_remote_prefill":false}})");
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->remote_prefill.has_value());

  const std::string base = R"("do_remote_prefill":true,"remote_engine_id":"e1","remote_request_id":"r1")";
  ExpectInvalid(
      ApiKind::kCompletions,
      absl::StrCat(R"({"prompt":"x","kv_transfer_params":{)", base, R"(,"remote_block_ids":[1],"remote_port":80}})"),
      "kv_transfer_params.remote_host");
  ExpectInvalid(ApiKind::kCompletions,
                absl::StrCat(R"({"prompt":"x","kv_transfer_params":{)", base,
                             R"(,"remote_block_ids":[1],"remote_host":"h","remote_port":70000}})"),
                "remote_port");
  ExpectInvalid(ApiKind::kCompletions,
                absl::StrCat(R"({"prompt":"x","kv_transfer_params":{)", base,
                             R"(,"remote_block_ids":["a"],"remote_host":"h","remote_port":80}})"),
                "remote_block_ids");
  ExpectInvalid(ApiKind::kCompletions,
                R"({"prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_request_id":"r",
                    "remote_block_ids":[],"remote_host":"h","remote_port":80}})",
                "remote_engine_id");
  ExpectInvalid(ApiKind::kCompletions, R"({"prompt":"x","kv_transfer_params":{"do_remote_prefill":"yes"}})",
                "do_remote_prefill");
}

TEST(ErrorBodyTest, VllmShapeAndTypes) {
  const struct {
    absl::Status status;
    int code;
    const char* type;
  } cases[] = {
      {absl::InvalidArgumentError("bad"), 400, "BadRequestError"},
      {absl::NotFoundError("nf"), 404, "NotFoundError"},
      {absl::ResourceExhaustedError("full"), 429, "TooManyRequestsError"},
      {absl::UnavailableError("down"), 503, "ServiceUnavailableError"},
      {absl::InternalError("oops"), 500, "InternalServerError"},
  };
  for (const auto& c : cases) {
    const nlohmann::json body = nlohmann::json::parse(ErrorBody(c.status));
    EXPECT_EQ(body["object"], "error");
    EXPECT_EQ(body["message"], std::string(c.status.message()));
    EXPECT_EQ(body["type"], c.type);
    EXPECT_TRUE(body["param"].is_null());
    EXPECT_EQ(body["code"], c.code);
    EXPECT_EQ(HttpStatusForError(c.status), c.code);
  }
  EXPECT_EQ(ErrorBody(absl::InvalidArgumentError("m")),
            R"({"object":"error","message":"m","type":"BadRequestError","param":null,"code":400})");
  const http::HttpResponse response = ErrorResponse(absl::ResourceExhaustedError("full"), "rid-1");
  EXPECT_EQ(response.status, 429);
  EXPECT_EQ(response.content_type, "application/json");
  ASSERT_EQ(response.headers.size(), 1u);
  EXPECT_EQ(response.headers[0].first, "X-Request-Id");
  EXPECT_EQ(response.headers[0].second, "rid-1");
}

TEST(JsonEscapeTest, EscapesQuotesAndControls) {
  EXPECT_EQ(JsonEscape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  EXPECT_EQ(JsonEscape("plain"), "plain");
}

}  // namespace
}  // namespace eldr::engine_emu
