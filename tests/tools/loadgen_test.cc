// Tests of eldr-loadgen: the real binary (ELDR_BIN_DIR) against servers in this process on
// loopback: eldr::http::HttpServer answering non-streamed completions (counts, errors by kind, the
// trace requests named in the prompts, closed loop, warm-up), and a raw-socket server that streams
// server-sent events in chunks with small pauses (tokens, TTFT, TPOT, inter-token gaps, usage,
// chat deltas, stream errors). Assertions are on counts and orderings, never on absolute timings.
#include <algorithm>
#include <atomic>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "eldr/http/http_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sim/workload.h"
#include "testing/process.h"
#include "testing/raw_http_client.h"
#include "testing/raw_http_server.h"

namespace {

using ::eldr::http::HttpRequest;
using ::eldr::http::HttpResponse;
using ::eldr::http::HttpRouter;
using ::eldr::http::HttpServer;
using ::eldr::http::HttpServerOptions;
using ::eldr::testing::SendAll;
using ::nlohmann::json;
using ::testing::HasSubstr;

struct LoadgenRun {
  eldr::testing::ProcessResult process;
  json report;  // the --json object, when it parsed
};

// Runs eldr-loadgen with `args` plus --trace and --json; parses the report.
LoadgenRun RunLoadgen(std::vector<std::string> args) {
  args.push_back("--trace=" + eldr::testing::BundledTraceDir());
  args.push_back("--json");
  LoadgenRun run;
  run.process = eldr::testing::RunProcess(eldr::testing::BinaryPath("eldr-loadgen"), args, absl::Seconds(120));
  run.report = json::parse(run.process.stdout_text, nullptr, /*allow_exceptions=*/false);
  return run;
}

// The trace request named by "eldr-trace:<N>" in `text`, or -1.
int TraceMarker(absl::string_view text) {
  const size_t at = text.find("eldr-trace:");
  if (at == absl::string_view::npos) return -1;
  absl::string_view digits = text.substr(at + 11);
  size_t length = 0;
  while (length < digits.size() && absl::ascii_isdigit(digits[length])) ++length;
  int value = -1;
  return absl::SimpleAtoi(digits.substr(0, length), &value) ? value : -1;
}

// The trace requests eldr-loadgen must name, in order: the workload and arrivals of eldr-sim.
std::vector<int> ExpectedTraceRequests(int count) {
  eldr::sim::TraceWorkloadOptions options;
  options.dir = eldr::testing::BundledTraceDir();
  absl::StatusOr<eldr::sim::Workload> workload = eldr::sim::LoadTraceWorkload(options);
  EXPECT_TRUE(workload.ok()) << workload.status();
  std::vector<int> requests;
  if (!workload.ok()) return requests;
  for (const eldr::sim::Arrival& arrival : eldr::sim::MakeArrivals(*workload, 1.0, count, 1)) {
    requests.push_back(arrival.request);
  }
  return requests;
}

// ---- A non-streaming completions server ------------------------------------------------------------

// Answers POST /v1/completions (and chat) as a non-streaming engine: 5 tokens, usage included.
// Every `fail_every`-th request (1-based; 0: none) gets a 503.
class CompletionServer {
 public:
  explicit CompletionServer(int fail_every = 0) : fail_every_(fail_every) {
    HttpRouter router;
    const auto handler = [this](const HttpRequest& request) { return Answer(request); };
    router.Handle("/v1/completions", {"POST"}, handler);
    router.Handle("/v1/chat/completions", {"POST"}, handler);
    HttpServerOptions options;
    options.threads = 2;
    options.max_connections = 1000;
    absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Create(options, std::move(router));
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    EXPECT_TRUE(server_->Start().ok());
  }

  int port() const { return server_->port(); }
  std::string target() const { return absl::StrCat("127.0.0.1:", port()); }
  std::vector<json> bodies() {
    absl::MutexLock lock(&mu_);
    return bodies_;
  }

 private:
  HttpResponse Answer(const HttpRequest& request) {
    HttpResponse response;
    response.content_type = "application/json";
    const json body = json::parse(request.body, nullptr, false);
    int index;
    {
      absl::MutexLock lock(&mu_);
      bodies_.push_back(body);
      index = static_cast<int>(bodies_.size());
    }
    if (fail_every_ > 0 && index % fail_every_ == 0) {
      response.status = 503;
      response.body = R"({"object":"error","message":"overloaded","type":"ServiceUnavailableError","code":503})";
      return response;
    }
    const bool chat = request.path == "/v1/chat/completions";
    json choice = {{"index", 0}, {"finish_reason", "length"}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", " a b c d e"}};
    } else {
      choice["text"] = " a b c d e";
    }
    response.body = json{{"id", "cmpl-1"},
                         {"object", chat ? "chat.completion" : "text_completion"},
                         {"choices", json::array({choice})},
                         {"usage", {{"prompt_tokens", 10}, {"completion_tokens", 5}, {"total_tokens", 15}}}}
                        .dump();
    return response;
  }

  const int fail_every_;
  std::unique_ptr<HttpServer> server_;
  absl::Mutex mu_;
  std::vector<json> bodies_ ABSL_GUARDED_BY(mu_);
};

// ---- A raw-socket streaming server -------------------------------------------------------------------

std::string Chunk(absl::string_view data) { return absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n"); }

std::string Event(const json& payload) { return absl::StrCat("data: ", payload.dump(), "\n\n"); }

// How the streaming server answers.
enum class StreamStyle {
  kCompletions,  // choices[0].text, then usage, then [DONE]
  kChat,         // a role-only delta first, then delta.content
  kErrorEvent,   // two tokens, then an `error` object
  kNoDone,       // tokens, then the end of the body without [DONE]
  kBadJson,      // one token, then an event that is not JSON
};

// A TCP server on 127.0.0.1 that answers each request (keep-alive) with a chunked SSE stream of
// `tokens` token events, `pause` apart, one event per chunk.
class StreamServer {
 public:
  StreamServer(StreamStyle style, int tokens, absl::Duration pause)
      : style_(style), tokens_(tokens), pause_(pause), server_([this](int fd, int) { Serve(fd); }, /*backlog=*/256) {
    EXPECT_NE(server_.port(), 0) << server_.error();
  }

  std::string target() const { return absl::StrCat("127.0.0.1:", server_.port()); }
  int requests() const { return requests_.load(); }

 private:
  void Serve(int fd) {
    eldr::testing::RawRequestReader reader(fd);
    while (const std::optional<std::string> request = reader.Next()) {
      requests_.fetch_add(1);
      const bool chat = absl::StartsWith(*request, "POST /v1/chat/completions ");
      if (!SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")) {
        return;
      }
      const auto send_event = [&](const json& payload) { return SendAll(fd, Chunk(Event(payload))); };
      const auto token = [&](int k) {
        json choice = {{"index", 0}, {"finish_reason", nullptr}};
        if (chat) {
          choice["delta"] = {{"content", absl::StrCat(" t_", k)}};
        } else {
          choice["text"] = absl::StrCat(" t_", k);
        }
        return json{{"id", "cmpl-x"}, {"choices", json::array({choice})}};
      };
      if (chat &&
          !send_event(
              json{{"choices", json::array({{{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}}})}})) {
        return;
      }
      const int tokens = style_ == StreamStyle::kErrorEvent ? 2 : style_ == StreamStyle::kBadJson ? 1 : tokens_;
      for (int k = 1; k <= tokens; ++k) {
        absl::SleepFor(pause_);
        if (!send_event(token(k))) return;
      }
      if (style_ == StreamStyle::kErrorEvent) {
        send_event(json{{"error", {{"message", "engine failed"}, {"code", 500}}}});
      } else if (style_ == StreamStyle::kBadJson) {
        SendAll(fd, Chunk("data: {not json\n\n"));
      }
      if (style_ == StreamStyle::kCompletions || style_ == StreamStyle::kChat) {
        send_event(
            json{{"id", "cmpl-x"},
                 {"choices", json::array()},
                 {"usage", {{"prompt_tokens", 3}, {"completion_tokens", tokens_}, {"total_tokens", 3 + tokens_}}}});
      }
      if (style_ != StreamStyle::kNoDone) SendAll(fd, Chunk("data: [DONE]\n\n"));
      if (!SendAll(fd, "0\r\n\r\n")) return;
    }
  }

  const StreamStyle style_;
  const int tokens_;
  const absl::Duration pause_;
  std::atomic<int> requests_{0};
  eldr::testing::RawHttpServer server_;  // last: its threads run Serve until it is destroyed
};

// ---- Tests -------------------------------------------------------------------------------------------

TEST(LoadgenTest, NonStreamingOpenLoop) {
  CompletionServer server;
  eldr::testing::TempDir dir;
  const std::string lines_path = dir.File("requests.jsonl");
  const LoadgenRun run =
      RunLoadgen({"--target=" + server.target(), "--stream=false", "--rate=200", "--requests=20", "--model=test-model",
                  "--max_tokens=5", "--prompt_bytes=100", "--out_requests=" + lines_path});
  ASSERT_EQ(run.process.exit_code, 0) << run.process.stderr_text;
  ASSERT_TRUE(run.report.is_object()) << run.process.stdout_text;
  const json& report = run.report;
  EXPECT_EQ(report["mode"], "open");
  EXPECT_EQ(report["stream"], false);
  EXPECT_EQ(report["requests_sent"], 20);
  EXPECT_EQ(report["requests_measured"], 20);
  EXPECT_EQ(report["requests_ok"], 20);
  EXPECT_EQ(report["requests_error"], 0);
  EXPECT_TRUE(report["errors"].empty()) << report["errors"].dump();
  EXPECT_EQ(report["tokens"], 100);  // usage.completion_tokens of each answer
  EXPECT_EQ(report["ttft_ms"]["count"], 20);
  EXPECT_EQ(report["e2e_ms"]["count"], 20);
  EXPECT_EQ(report["tpot_ms"]["count"], 0);  // not measurable without a stream
  EXPECT_GT(report["e2e_ms"]["p50"].get<double>(), 0);
  EXPECT_GE(report["max_concurrent_streams"].get<int>(), 1);
  EXPECT_GE(report["client_cpu_s"].get<double>(), 0);
  EXPECT_GT(report["achieved_rate"].get<double>(), 0);
  // The human summary went to stderr.
  EXPECT_THAT(run.process.stderr_text, HasSubstr("20 requests to " + server.target()));

  // The requests as the server saw them: the body eldr-loadgen promises, naming the trace
  // requests of MakeArrivals (the order on the wire may interleave, so compare sorted).
  const std::vector<json> bodies = server.bodies();
  ASSERT_EQ(bodies.size(), 20u);
  std::vector<int> named;
  for (const json& body : bodies) {
    ASSERT_TRUE(body.is_object());
    EXPECT_EQ(body["model"], "test-model");
    EXPECT_EQ(body["max_tokens"], 5);
    EXPECT_EQ(body["stream"], false);
    EXPECT_FALSE(body.contains("stream_options"));
    const std::string prompt = body["prompt"].get<std::string>();
    EXPECT_EQ(prompt.size(), 100u);
    EXPECT_TRUE(absl::StartsWith(prompt, "eldr-trace:")) << prompt;
    named.push_back(TraceMarker(prompt));
  }
  std::vector<int> expected = ExpectedTraceRequests(20);
  std::sort(named.begin(), named.end());
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(named, expected);

  // One line per request, in sequence order, naming the same trace requests.
  std::ifstream lines(lines_path);
  std::string line;
  std::vector<int> ids;
  int sequence = 0;
  while (std::getline(lines, line)) {
    const json entry = json::parse(line, nullptr, false);
    ASSERT_TRUE(entry.is_object()) << line;
    EXPECT_EQ(entry["seq"], sequence++);
    EXPECT_EQ(entry["status"], 200);
    EXPECT_TRUE(entry["error"].is_null());
    EXPECT_EQ(entry["tokens"], 5);
    EXPECT_TRUE(entry["ttft_ms"].is_number());
    ids.push_back(entry["id"].get<int>());
  }
  EXPECT_EQ(ids, ExpectedTraceRequests(20));
}

TEST(LoadgenTest, HttpErrorsAreCountedByKind) {
  CompletionServer server(/*fail_every=*/4);
  const LoadgenRun run =
      RunLoadgen({"--target=" + server.target(), "--stream=false", "--concurrency=1", "--requests=12"});
  ASSERT_EQ(run.process.exit_code, 0) << run.process.stderr_text;
  const json& report = run.report;
  EXPECT_EQ(report["requests_sent"], 12);
  EXPECT_EQ(report["requests_ok"], 9);
  EXPECT_EQ(report["requests_error"], 3);
  EXPECT_EQ(report["errors"]["http_503"], 3);
  EXPECT_THAT(report["error_samples"]["http_503"].get<std::string>(), HasSubstr("overloaded"));
  EXPECT_EQ(report["max_concurrent_streams"], 1);
}

TEST(LoadgenTest, ClosedLoopKeepsConcurrency) {
  CompletionServer server;
  const LoadgenRun run = RunLoadgen(
      {"--target=" + server.target(), "--stream=false", "--concurrency=4", "--requests=40", "--endpoint=chat"});
  ASSERT_EQ(run.process.exit_code, 0) << run.process.stderr_text;
  const json& report = run.report;
  EXPECT_EQ(report["mode"], "closed");
  EXPECT_EQ(report["requests_ok"], 40);
  EXPECT_LE(report["max_concurrent_streams"].get<int>(), 4);
  EXPECT_GE(report["max_concurrent_streams"].get<int>(), 1);
  for (const json& body : server.bodies()) {
    ASSERT_TRUE(body.contains("messages"));
    EXPECT_EQ(body["messages"][0]["role"], "user");
    EXPECT_GE(TraceMarker(body["messages"][0]["content"].get<std::string>()), 0);
    EXPECT_FALSE(body.contains("model"));       // --model empty: not sent
    EXPECT_FALSE(body.contains("max_tokens"));  // --max_tokens 0: not sent
  }
}

TEST(LoadgenTest, WarmupRequestsAreLeftOut) {
  CompletionServer server;
  const LoadgenRun run =
      RunLoadgen({"--target=" + server.target(), "--stream=false", "--rate=100", "--requests=60", "--warmup_s=0.2"});
  ASSERT_EQ(run.process.exit_code, 0) << run.process.stderr_text;
  const json& report = run.report;
  const int warmup = report["warmup_requests"].get<int>();
  EXPECT_GT(warmup, 0);
  EXPECT_LT(warmup, 60);
  EXPECT_EQ(report["requests_measured"].get<int>() + warmup, 60);
  EXPECT_EQ(report["e2e_ms"]["count"].get<int>(), 60 - warmup);
}

TEST(LoadgenTest, StreamingCountsTokensAndTimings) {
  StreamServer server(StreamStyle::kCompletions, /*tokens=*/6, absl::Milliseconds(5));
  const LoadgenRun run = RunLoadgen({"--target=" + server.target(), "--concurrency=3", "--requests=12"});
  ASSERT_EQ(run.process.exit_code, 0) << run.process.stderr_text;
  const json& report = run.report;
  EXPECT_EQ(report["stream"], true);
  EXPECT_EQ(report["requests_ok"], 12) << report.dump();
  EXPECT_EQ(report["tokens"], 72);
  EXPECT_EQ(report["usage_reported"], 12);
  EXPECT_EQ(report["usage_mismatches"], 0);
  EXPECT_EQ(report["ttft_ms"]["count"], 12);
  EXPECT_EQ(report["tpot_ms"]["count"], 12);
  EXPECT_EQ(report["inter_token_ms"]["count"], 12 * 5);
  // The first token comes before the end, and tokens are spread out (a pause before each).
  EXPECT_LT(report["ttft_ms"]["p50"].get<double>(), report["e2e_ms"]["p50"].get<double>());
  EXPECT_GT(report["tpot_ms"]["p50"].get<double>(), 0);
  EXPECT_GT(report["inter_token_ms"]["p50"].get<double>(), 0);
  EXPECT_LE(report["inter_token_ms"]["p50"].get<double>(), report["inter_token_ms"]["max"].get<double>());
  EXPECT_EQ(server.requests(), 12);
}

TEST(LoadgenTest, StreamingChatDeltas) {
  StreamServer server(StreamStyle::kChat, /*tokens=*/4, absl::Milliseconds(2));
  const LoadgenRun run = RunLoadgen({"--target=" + server.target(), "--endpoint=chat", "--rate=50", "--requests=5"});
  ASSERT_EQ(run.process.exit_code, 0) << run.process.stderr_text;
  const json& report = run.report;
  EXPECT_EQ(report["requests_ok"], 5) << report.dump();
  // The role-only first delta carries no text and is not a token.
  EXPECT_EQ(report["tokens"], 20);
  EXPECT_EQ(report["usage_mismatches"], 0);
}

TEST(LoadgenTest, StreamErrorsByKind) {
  struct Case {
    StreamStyle style;
    const char* kind;
    const char* sample;
  };
  for (const Case& c : {Case{StreamStyle::kErrorEvent, "stream_error", "engine failed"},
                        Case{StreamStyle::kNoDone, "stream_error", "[DONE]"},
                        Case{StreamStyle::kBadJson, "bad_json", "not a JSON object"}}) {
    StreamServer server(c.style, /*tokens=*/3, absl::Milliseconds(1));
    const LoadgenRun run = RunLoadgen({"--target=" + server.target(), "--concurrency=2", "--requests=4"});
    ASSERT_EQ(run.process.exit_code, 0) << run.process.stderr_text;
    const json& report = run.report;
    EXPECT_EQ(report["requests_ok"], 0) << c.kind;
    EXPECT_EQ(report["errors"][c.kind], 4) << report.dump();
    EXPECT_THAT(report["error_samples"][c.kind].get<std::string>(), HasSubstr(c.sample));
  }
}

TEST(LoadgenTest, UnreachableTargetExitsOne) {
  absl::StatusOr<eldr::testing::ReservedLoopbackPort> dead = eldr::testing::ReservedLoopbackPort::Create();
  ASSERT_TRUE(dead.ok()) << dead.status();
  const int port = dead->port();
  const LoadgenRun run = RunLoadgen({absl::StrCat("--target=127.0.0.1:", port), "--rate=100", "--requests=3"});
  EXPECT_EQ(run.process.exit_code, 1) << run.process.stderr_text;
  ASSERT_TRUE(run.report.is_object());
  EXPECT_EQ(run.report["errors"]["connect"], 3);
}

TEST(LoadgenTest, BadFlagsExitTwo) {
  const std::vector<std::vector<std::string>> cases = {
      {"--rate=1", "--requests=1"},                                             // no --target
      {"--target=127.0.0.1:1", "--requests=1"},                                 // neither mode
      {"--target=127.0.0.1:1", "--rate=1", "--concurrency=2", "--requests=1"},  // both modes
      {"--target=127.0.0.1:1", "--rate=1"},                                     // no bound
      {"--target=127.0.0.1", "--rate=1", "--requests=1"},                       // no port
      {"--target=127.0.0.1:1", "--rate=1", "--requests=1", "--endpoint=embeddings"},
      {"--target=127.0.0.1:1", "--rate=abc", "--requests=1"},
      {"--target=127.0.0.1:1", "--rate=1", "--requests=1", "--no_such_flag=1"},
      {"--target=127.0.0.1:1", "--rate=1", "--requests=1", "--trace=/nonexistent/traces"},
  };
  for (const std::vector<std::string>& args : cases) {
    const eldr::testing::ProcessResult result =
        eldr::testing::RunProcess(eldr::testing::BinaryPath("eldr-loadgen"), args, absl::Seconds(60));
    EXPECT_EQ(result.exit_code, 2) << absl::StrJoin(args, " ") << "\n" << result.stderr_text;
    EXPECT_THAT(result.stderr_text, HasSubstr("eldr-loadgen:")) << absl::StrJoin(args, " ");
  }
}

}  // namespace
