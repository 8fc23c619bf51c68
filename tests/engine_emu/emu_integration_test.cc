// The real eldr-engine-emu binary, twice: a prefill and a decode emulator on loopback, driven
// over real HTTP (libcurl) through vLLM's two-phase kv_transfer_params protocol: the prefill
// answer's counts, streamed and whole decode answers, a KV pulled twice, a dead prefill engine,
// the common endpoints, a client that goes away mid-stream, startup errors and SIGTERM.
#include <curl/curl.h>
#include <signal.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine_emu/catalog.h"
#include "engine_emu/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "testing/process.h"

namespace eldr::engine_emu {
namespace {

using eldr::testing::BinaryPath;
using eldr::testing::BundledTraceDir;
using eldr::testing::ChildProcess;
using eldr::testing::TempDir;
using eldr::testing::WaitForPort;
using nlohmann::json;
using ::testing::HasSubstr;
using testing::SseData;

constexpr char kModel[] = "deepseek-v2-lite-esft";

const bool curl_initialised = [] {
  curl_global_init(CURL_GLOBAL_DEFAULT);
  return true;
}();

struct HttpAnswer {
  int status = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names lowercased
  std::string body;
  CURLcode code = CURLE_OK;

  std::string Header(const std::string& name) const {
    for (const auto& [n, v] : headers) {
      if (n == name) return v;
    }
    return "";
  }
};

// One request with libcurl. `stop_after_bytes` > 0: the client closes the connection once that
// many body bytes arrived (a client going away mid-stream).
HttpAnswer Call(int port, const std::string& method, const std::string& path, const std::string& body = "",
                const std::vector<std::string>& headers = {}, size_t stop_after_bytes = 0) {
  HttpAnswer answer;
  CURL* curl = curl_easy_init();
  const std::string url = absl::StrCat("http://127.0.0.1:", port, path);
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, 60000L);
  if (method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  }
  struct curl_slist* list = curl_slist_append(nullptr, "Content-Type: application/json");
  for (const std::string& h : headers) list = curl_slist_append(list, h.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, list);
  struct Sink {
    HttpAnswer* answer;
    size_t stop_after;
  } sink{&answer, stop_after_bytes};
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &sink);
  curl_easy_setopt(
      curl, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t n, void* user) -> size_t {
        Sink* s = static_cast<Sink*>(user);
        s->answer->body.append(data, size * n);
        if (s->stop_after > 0 && s->answer->body.size() >= s->stop_after) return 0;  // abort the transfer
        return size * n;
      });
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &answer);
  curl_easy_setopt(
      curl, CURLOPT_HEADERFUNCTION, +[](char* data, size_t size, size_t n, void* user) -> size_t {
        HttpAnswer* a = static_cast<HttpAnswer*>(user);
        const absl::string_view line(data, size * n);
        const size_t colon = line.find(':');
        if (colon != absl::string_view::npos) {
          a->headers.emplace_back(absl::AsciiStrToLower(line.substr(0, colon)),
                                  std::string(absl::StripAsciiWhitespace(line.substr(colon + 1))));
        }
        return size * n;
      });
  answer.code = curl_easy_perform(curl);
  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  answer.status = static_cast<int>(status);
  curl_slist_free_all(list);
  curl_easy_cleanup(curl);
  return answer;
}

// An emulator started by the test; its port from --port_file.
struct Emulator {
  std::unique_ptr<ChildProcess> process;
  int port = 0;
};

absl::StatusOr<Emulator> StartEmulator(const TempDir& dir, const std::string& name, std::vector<std::string> args) {
  const std::string port_file = dir.File(name + ".port.json");
  std::vector<std::string> argv = {BinaryPath("eldr-engine-emu"), "--port_file=" + port_file,
                                   "--trace=" + BundledTraceDir()};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(argv, dir.File(name + ".log"));
  if (!child.ok()) return child.status();
  Emulator emulator;
  emulator.process = *std::move(child);
  absl::StatusOr<int> port = WaitForPort(port_file, "port", *emulator.process, absl::Seconds(30));
  if (!port.ok()) return absl::Status(port.status().code(), absl::StrCat(name, ": ", port.status().message()));
  emulator.port = *port;
  return emulator;
}

// A completions (or, with api "chat", chat) request body for trace request `trace`.
json RequestBody(int trace, const std::string& api, int max_tokens, bool stream) {
  json body;
  body["model"] = kModel;
  if (api == "chat") {
    body["messages"] = json::array({{{"role", "user"}, {"content", absl::StrCat("hello eldr-trace:", trace)}}});
  } else {
    body["prompt"] = absl::StrCat("hello eldr-trace:", trace);
  }
  body["max_tokens"] = max_tokens;
  body["stream"] = stream;
  return body;
}

std::string PrefillBody(int trace, const std::string& api = "completions") {
  json body = RequestBody(trace, api, /*max_tokens=*/1, /*stream=*/false);
  body["kv_transfer_params"] = {{"do_remote_decode", true},    {"do_remote_prefill", false},
                                {"remote_engine_id", nullptr}, {"remote_block_ids", nullptr},
                                {"remote_host", nullptr},      {"remote_port", nullptr}};
  return body.dump();
}

class EngineEmuIntegrationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    absl::StatusOr<Emulator> prefill = StartEmulator(
        *dir_, "prefill", {"--role=prefill", "--time_scale=0.01", "--engine_id=pf-it", "--kv_hold_timeout=60s"});
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = new Emulator(*std::move(prefill));
    absl::StatusOr<Emulator> decode =
        StartEmulator(*dir_, "decode", {"--role=decode", "--time_scale=0.01", "--max_batch=16", "--threads=2"});
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_ = new Emulator(*std::move(decode));
  }
  static void TearDownTestSuite() {
    delete decode_;
    delete prefill_;
    delete dir_;
    decode_ = prefill_ = nullptr;
    dir_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(prefill_, nullptr);
    ASSERT_NE(decode_, nullptr);
  }

  // Runs phase 1 on the prefill emulator; returns its answer's kv_transfer_params.
  json Prefill(int trace, const std::string& request_id, const std::string& api = "completions") {
    const HttpAnswer answer = Call(prefill_->port, "POST", api == "chat" ? "/v1/chat/completions" : "/v1/completions",
                                   PrefillBody(trace, api), {"X-Request-Id: " + request_id});
    EXPECT_EQ(answer.status, 200) << answer.body;
    EXPECT_EQ(answer.Header("x-request-id"), request_id);
    const json body = json::parse(answer.body, nullptr, false);
    EXPECT_TRUE(body.is_object()) << answer.body;
    return body.is_object() ? body["kv_transfer_params"] : json();
  }

  static std::string DecodeBody(int trace, const json& kv, bool stream, int max_tokens,
                                const std::string& api = "completions") {
    json body = RequestBody(trace, api, max_tokens, stream);
    if (stream) body["stream_options"] = {{"include_usage", true}};
    if (!kv.is_null()) body["kv_transfer_params"] = kv;
    return body.dump();
  }

  static std::string Metrics(const Emulator& e) {
    absl::StatusOr<std::string> page = eldr::testing::HttpGet(e.port, "/metrics");
    return page.ok() ? *page : "";
  }

  static TempDir* dir_;
  static Emulator* prefill_;
  static Emulator* decode_;
};

TempDir* EngineEmuIntegrationTest::dir_ = nullptr;
Emulator* EngineEmuIntegrationTest::prefill_ = nullptr;
Emulator* EngineEmuIntegrationTest::decode_ = nullptr;

TEST_F(EngineEmuIntegrationTest, TwoPhaseStreamed) {
  const auto catalog = testing::BundledCatalog();
  const int trace = 7;
  const json kv = Prefill(trace, "it-stream");
  ASSERT_TRUE(kv.is_object());
  EXPECT_EQ(kv["do_remote_prefill"], true);
  EXPECT_EQ(kv["remote_engine_id"], "pf-it");
  EXPECT_EQ(kv["remote_request_id"], "it-stream");
  EXPECT_EQ(kv["remote_host"], "127.0.0.1");
  EXPECT_EQ(kv["remote_port"], prefill_->port);
  EXPECT_EQ(kv["eldr_expert_counts"]["layers"], 26);
  EXPECT_EQ(kv["eldr_expert_counts"]["experts"], 64);
  EXPECT_EQ(testing::DecodeCountsBase64(kv["eldr_expert_counts"]["data"].get<std::string>()),
            catalog->request(trace).prompt_counts);

  const HttpAnswer answer =
      Call(decode_->port, "POST", "/v1/completions", DecodeBody(trace, kv, true, 5), {"X-Request-Id: it-stream-d"});
  ASSERT_EQ(answer.status, 200) << answer.body;
  EXPECT_THAT(answer.Header("content-type"), HasSubstr("text/event-stream"));
  EXPECT_EQ(answer.Header("x-request-id"), "it-stream-d");
  const std::vector<std::string> events = SseData(answer.body);
  ASSERT_EQ(events.size(), 7u) << answer.body;  // 5 tokens, usage, [DONE]
  for (int k = 1; k <= 5; ++k) {
    const json chunk = json::parse(events[k - 1]);
    EXPECT_EQ(chunk["id"], "cmpl-it-stream-d");
    EXPECT_EQ(chunk["object"], "text_completion");
    EXPECT_EQ(chunk["model"], kModel);
    EXPECT_EQ(chunk["choices"][0]["text"], absl::StrCat(" t", trace, "_", k));
    if (k < 5) {
      EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
    } else {
      EXPECT_EQ(chunk["choices"][0]["finish_reason"], "length");
    }
  }
  const json usage = json::parse(events[5]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], catalog->request(trace).prompt_tokens);
  EXPECT_EQ(usage["usage"]["completion_tokens"], 5);
  EXPECT_EQ(events[6], "[DONE]");
}

TEST_F(EngineEmuIntegrationTest, TwoPhaseWholeChatAnswer) {
  const json kv = Prefill(3, "it-chat", "chat");
  ASSERT_TRUE(kv.is_object());
  const HttpAnswer answer = Call(decode_->port, "POST", "/v1/chat/completions", DecodeBody(3, kv, false, 3, "chat"));
  ASSERT_EQ(answer.status, 200) << answer.body;
  const json body = json::parse(answer.body);
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["choices"][0]["message"]["content"], " t3_1 t3_2 t3_3");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], 3);
}

TEST_F(EngineEmuIntegrationTest, KvPulledTwiceFailsTheSecondRequest) {
  const json kv = Prefill(5, "it-twice");
  ASSERT_TRUE(kv.is_object());
  const HttpAnswer first = Call(decode_->port, "POST", "/v1/completions", DecodeBody(5, kv, false, 2));
  ASSERT_EQ(first.status, 200) << first.body;
  const HttpAnswer second = Call(decode_->port, "POST", "/v1/completions", DecodeBody(5, kv, true, 2));
  EXPECT_EQ(second.status, 503) << second.body;
  const json error = json::parse(second.body);
  EXPECT_EQ(error["object"], "error");
  EXPECT_EQ(error["type"], "ServiceUnavailableError");
  EXPECT_THAT(error["message"].get<std::string>(),
              HasSubstr(absl::StrCat("KV transfer from 127.0.0.1:", prefill_->port, " failed: HTTP 404")));
}

TEST_F(EngineEmuIntegrationTest, KvPullEndpoint) {
  const json kv = Prefill(2, "it-pull");
  ASSERT_TRUE(kv.is_object());
  json pull = {{"remote_engine_id", kv["remote_engine_id"]},
               {"remote_request_id", kv["remote_request_id"]},
               {"remote_block_ids", kv["remote_block_ids"]}};
  json wrong = pull;
  wrong["remote_engine_id"] = "someone-else";
  EXPECT_EQ(Call(prefill_->port, "POST", "/eldr_emu/kv_pull", wrong.dump()).status, 409);
  const HttpAnswer ok = Call(prefill_->port, "POST", "/eldr_emu/kv_pull", pull.dump());
  ASSERT_EQ(ok.status, 200) << ok.body;
  EXPECT_EQ(json::parse(ok.body)["blocks"], kv["remote_block_ids"].size());
  EXPECT_EQ(Call(prefill_->port, "POST", "/eldr_emu/kv_pull", pull.dump()).status, 404);
  EXPECT_EQ(Call(prefill_->port, "POST", "/eldr_emu/kv_pull", "{").status, 400);
  // The decode role has no kv_pull.
  EXPECT_EQ(Call(decode_->port, "POST", "/eldr_emu/kv_pull", pull.dump()).status, 404);
}

TEST_F(EngineEmuIntegrationTest, DeadPrefillEngineIs503) {
  // Port 1 on loopback: nothing listens there.
  const json kv = {{"do_remote_prefill", true}, {"do_remote_decode", false},  {"remote_engine_id", "x"},
                   {"remote_request_id", "y"},  {"remote_block_ids", {1, 2}}, {"remote_host", "127.0.0.1"},
                   {"remote_port", 1}};
  const HttpAnswer answer = Call(decode_->port, "POST", "/v1/completions", DecodeBody(1, kv, true, 2));
  EXPECT_EQ(answer.status, 503) << answer.body;
  EXPECT_THAT(json::parse(answer.body)["message"].get<std::string>(), HasSubstr("KV transfer from 127.0.0.1:1 failed"));
}

TEST_F(EngineEmuIntegrationTest, WholeRequestOnTheDecodeEngine) {
  const HttpAnswer answer = Call(decode_->port, "POST", "/v1/completions", DecodeBody(9, json(), true, 4));
  ASSERT_EQ(answer.status, 200) << answer.body;
  const std::vector<std::string> events = SseData(answer.body);
  ASSERT_EQ(events.size(), 6u);
  EXPECT_EQ(json::parse(events[3])["choices"][0]["text"], " t9_4");
}

TEST_F(EngineEmuIntegrationTest, CommonEndpoints) {
  for (const Emulator* e : {prefill_, decode_}) {
    const HttpAnswer models = Call(e->port, "GET", "/v1/models");
    ASSERT_EQ(models.status, 200);
    const json list = json::parse(models.body);
    EXPECT_EQ(list["object"], "list");
    ASSERT_EQ(list["data"].size(), 1u);
    EXPECT_EQ(list["data"][0]["id"], kModel);
    EXPECT_EQ(list["data"][0]["object"], "model");
    EXPECT_EQ(list["data"][0]["owned_by"], "eldr-engine-emu");
    EXPECT_EQ(list["data"][0]["root"], kModel);
    EXPECT_EQ(list["data"][0]["max_model_len"], 32768);
    EXPECT_TRUE(list["data"][0]["created"].is_number_integer());

    const HttpAnswer health = Call(e->port, "GET", "/health");
    EXPECT_EQ(health.status, 200);
    EXPECT_EQ(health.body, "");

    const std::string page = Metrics(*e);
    for (const char* series : {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}) {
      EXPECT_TRUE(eldr::testing::SampleValue(page, absl::StrCat(series, "{model_name=\"", kModel, "\"}")).has_value())
          << series << "\n"
          << page;
    }
  }
}

TEST_F(EngineEmuIntegrationTest, BadRequestsGetVllmErrors) {
  HttpAnswer answer = Call(decode_->port, "POST", "/v1/completions", "{not json");
  EXPECT_EQ(answer.status, 400);
  EXPECT_EQ(json::parse(answer.body)["type"], "BadRequestError");
  answer = Call(decode_->port, "POST", "/v1/completions", R"({"model":"other","prompt":"x"})");
  EXPECT_EQ(answer.status, 404);
  EXPECT_EQ(json::parse(answer.body)["message"], "The model `other` does not exist.");
  answer = Call(prefill_->port, "POST", "/v1/completions", R"({"prompt":"x"})");
  EXPECT_EQ(answer.status, 400);
  EXPECT_THAT(json::parse(answer.body)["message"].get<std::string>(), HasSubstr("disaggregated prefill only"));
  answer = Call(decode_->port, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":0})");
  EXPECT_EQ(answer.status, 400);
  EXPECT_EQ(Call(decode_->port, "GET", "/v1/completions").status, 405);
}

TEST_F(EngineEmuIntegrationTest, ClientGoneMidStreamCountsAborted) {
  const auto aborted = [&] {
    return eldr::testing::SampleValue(Metrics(*decode_), "eldr_emu_requests_aborted_total{role=\"decode\"}")
        .value_or(-1);
  };
  const double before = aborted();
  // 20000 tokens of ~0.15 ms steps would take seconds: the client leaves after its first bytes.
  const HttpAnswer answer =
      Call(decode_->port, "POST", "/v1/completions", DecodeBody(4, json(), true, 20000), {}, /*stop_after=*/1);
  EXPECT_EQ(answer.code, CURLE_WRITE_ERROR);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (aborted() < before + 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(aborted(), before + 1);
  // The engine is idle again: nothing left running.
  const absl::Time idle_deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < idle_deadline &&
         eldr::testing::SampleValue(Metrics(*decode_),
                                    absl::StrCat("vllm:num_requests_running{model_name=\"", kModel, "\"}")) != 0) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(eldr::testing::SampleValue(Metrics(*decode_),
                                       absl::StrCat("vllm:num_requests_running{model_name=\"", kModel, "\"}")),
            0);
}

TEST_F(EngineEmuIntegrationTest, ConcurrentStreamsShareTheBatch) {
  constexpr int kStreams = 24;
  std::vector<HttpAnswer> answers(kStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back(
        [&, i] { answers[i] = Call(decode_->port, "POST", "/v1/completions", DecodeBody(i, json(), true, 30)); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_EQ(answers[i].status, 200) << answers[i].body;
    const std::vector<std::string> events = SseData(answers[i].body);
    ASSERT_EQ(events.size(), 32u);
    const int index = i % testing::BundledCatalog()->size();
    for (int k = 1; k <= 30; ++k) {
      EXPECT_EQ(json::parse(events[k - 1])["choices"][0]["text"], absl::StrCat(" t", index, "_", k));
    }
  }
}

TEST(EngineEmuProcessTest, SigtermExitsZero) {
  TempDir dir;
  absl::StatusOr<Emulator> e = StartEmulator(dir, "decode", {"--role=decode"});
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(Call(e->port, "GET", "/health").status, 200);
  e->process->Signal(SIGTERM);
  absl::StatusOr<int> code = e->process->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << e->process->Log();
  EXPECT_EQ(*code, 0) << e->process->Log();
}

TEST(EngineEmuProcessTest, SigintDuringAStreamExitsZero) {
  TempDir dir;
  absl::StatusOr<Emulator> e = StartEmulator(dir, "decode", {"--role=decode", "--time_scale=0.01"});
  ASSERT_TRUE(e.ok()) << e.status();
  std::thread client([&] {
    Call(e->port, "POST", "/v1/completions", R"({"prompt":"eldr-trace:1","max_tokens":30000,"stream":true})");
  });
  absl::SleepFor(absl::Milliseconds(200));
  e->process->Signal(SIGINT);
  absl::StatusOr<int> code = e->process->Wait(absl::Seconds(20));
  client.join();
  ASSERT_TRUE(code.ok()) << e->process->Log();
  EXPECT_EQ(*code, 0) << e->process->Log();
}

TEST(EngineEmuProcessTest, StartupErrorsExit2WithOneLine) {
  const std::vector<std::vector<std::string>> bad = {
      {},
      {"--role=bogus"},
      {"--role=decode", "--time_scale=abc"},
      {"--role=decode", "--time_scale=0"},
      {"--role=decode", "--max_batch=0"},
      {"--role=decode", "--no_such_flag=1"},
      {"--role=prefill", "--signature_key=sig"},
      {"--role=decode", "--trace=/nonexistent/traces"},
      {"--role=decode", "--listen=256.0.0.1:1"},
      {"--role=decode", "--t_fixed_us=-1"},
      {"--role=prefill", "--kv_hold_timeout=0s"},
      {"--role=decode", "positional"},
  };
  for (const std::vector<std::string>& args : bad) {
    std::vector<std::string> with_trace = args;
    if (std::none_of(args.begin(), args.end(), [](const std::string& a) { return absl::StartsWith(a, "--trace"); })) {
      with_trace.push_back("--trace=" + BundledTraceDir());
    }
    const eldr::testing::ProcessResult result = eldr::testing::RunProcess(BinaryPath("eldr-engine-emu"), with_trace);
    EXPECT_EQ(result.exit_code, 2) << absl::StrJoin(args, " ") << "\n" << result.stderr_text;
    EXPECT_TRUE(absl::StartsWith(result.stderr_text, "eldr-engine-emu: ")) << result.stderr_text;
    EXPECT_EQ(std::count(result.stderr_text.begin(), result.stderr_text.end(), '\n'), 1) << result.stderr_text;
  }
  const eldr::testing::ProcessResult help = eldr::testing::RunProcess(BinaryPath("eldr-engine-emu"), {"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_THAT(help.stdout_text, HasSubstr("--max_batch"));
}

}  // namespace
}  // namespace eldr::engine_emu
