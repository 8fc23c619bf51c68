// The whole stack as real processes on loopback: eldr-engine-emu prefill and decode engines,
// eldr-router with centroids calibrated on the bundled traces, eldr-proxy in front, and real HTTP
// clients (eldr::http::HttpClient) for what a user sends.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "discovery/fake_kube.h"
#include "eldr/http/http_client.h"
#include "eldr/http/sse.h"
#include "eldr/v1/router.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "testing/process.h"

namespace eldr::proxy {
namespace {

using ::eldr::testing::BinaryPath;
using ::eldr::testing::BundledTraceDir;
using ::eldr::testing::ChildProcess;
using ::eldr::testing::FakeKube;
using ::eldr::testing::FakeKubeOptions;
using ::eldr::testing::HttpExchange;
using ::eldr::testing::HttpGet;
using ::eldr::testing::HttpStatusOf;
using ::eldr::testing::PollUntil;
using ::eldr::testing::ReservedLoopbackPort;
using ::eldr::testing::RunProcess;
using ::eldr::testing::SampleValue;
using ::eldr::testing::TempDir;
using ::eldr::testing::WaitForPort;
using ::testing::HasSubstr;

// The router's count of Completes that released a lease.
constexpr char kReleased[] = "eldr_complete_requests_total{outcome=\"released\"}";

// Polls `read` (one figure of a scrape) every 20 ms until it gives `want`, for up to 10 s. For a
// figure recorded after the client already has its answer: the router frees a lease before it
// counts the Complete, and counts the RouteStream message after that
// (DecodeRouterService::CompleteMessage, AnswerStreamRequest, AnswerStreamMessage); the proxy sends
// the Complete after the answer. A failure says what it read last.
::testing::AssertionResult Reaches(const std::string& what, double want, const std::function<double()>& read) {
  double last = -1;
  if (PollUntil(
          [&] {
            last = read();
            return last == want;
          },
          absl::Seconds(10), absl::Milliseconds(20))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << what << " is " << last << ", not " << want << ", after 10 s";
}

// Centroids for two decode workers d0, d1, calibrated once on the bundled traces.
const std::string& CentroidsFile() {
  static const std::string* path = [] {
    static TempDir dir;
    auto* file = new std::string(dir.File("centroids.json"));
    eldr::testing::ProcessResult calibrated = RunProcess(
        BinaryPath("eldr-calibrate"),
        {"--trace=" + BundledTraceDir(), "--prefill_fraction=0.5", "--clusters=2", "--workers=d0,d1", "--out=" + *file},
        absl::Seconds(120));
    if (calibrated.exit_code != 0) {
      ADD_FAILURE() << "eldr-calibrate failed: " << calibrated.stderr_text;
    }
    return file;
  }();
  return *path;
}

// A gate_prob artifact (the reference's name gate_prob_all) for d0, d1: the `count` centroids of the
// bundled traces relabelled. The engine emulator's stand-in gate sums are count / top_k, which a
// unit-norm signature cannot tell from the counts, so these centroids fit them as they fit counts.
const std::string& GateCentroidsFile() {
  static const std::string* path = [] {
    static TempDir dir;
    auto* file = new std::string(dir.File("gate_centroids.json"));
    const std::string counts = dir.File("count_centroids.json");
    eldr::testing::ProcessResult calibrated =
        RunProcess(BinaryPath("eldr-calibrate"),
                   {"--trace=" + BundledTraceDir(), "--prefill_fraction=0.5", "--clusters=2", "--workers=d0,d1",
                    "--variant=count", "--out=" + counts},
                   absl::Seconds(120));
    if (calibrated.exit_code != 0) ADD_FAILURE() << "eldr-calibrate failed: " << calibrated.stderr_text;
    std::ifstream in(counts);
    nlohmann::json artifact = nlohmann::json::parse(in);
    artifact["variant"] = "gate_prob_all";
    if (artifact.contains("sig_dtype")) artifact["sig_dtype"] = "<f4";
    std::ofstream(*file) << artifact.dump();
    return file;
  }();
  return *path;
}

struct StackOptions {
  int prefill = 1;
  int decode = 2;
  std::string signature_key = "eldr_expert_counts";
  bool router = true;
  bool router_on_unix_socket = false;  // the router's data plane on a Unix socket in the stack's folder
  std::string router_policy = "eldr";
  // The dead addresses below are ReservedLoopbackPorts held as long as the stack: refused for the
  // whole test, and never a server of a test running beside this one.
  bool dead_prefill_first = false;  // a dead instance listed before the live one(s)
  bool dead_decode_worker = false;  // the router's pool holds a worker nobody listens on
  std::vector<std::string> proxy_args;
  std::vector<std::string> prefill_args;  // appended to every prefill engine's flags (later flags win)
  std::string centroids;                  // the router's artifact; empty: CentroidsFile()
  double time_scale = 0.02;
  // Non-empty: the proxy finds its prefill instances by --discovery=kubernetes through this
  // kubeconfig (pods labelled app=prefill, port "http") instead of a --prefill list.
  std::string prefill_kubeconfig;
};

// One full stack; every process is killed when it goes out of scope.
class Stack {
 public:
  explicit Stack(StackOptions options) : options_(std::move(options)) {}

  void Start() {
    for (int i = 0; i < options_.decode; ++i) decode_ports_.push_back(StartEngine("decode", i));
    for (int i = 0; i < options_.prefill; ++i) prefill_ports_.push_back(StartEngine("prefill", i));
    if (options_.router) {
      std::vector<std::string> workers;
      for (int i = 0; i < options_.decode; ++i)
        workers.push_back(absl::StrCat("d", i, "=127.0.0.1:", decode_ports_[i]));
      if (options_.dead_decode_worker) {
        absl::StatusOr<ReservedLoopbackPort> dead = ReservedLoopbackPort::Create();
        ASSERT_TRUE(dead.ok()) << dead.status();
        dead_ports_.push_back(*std::move(dead));
        workers.push_back("dead=" + dead_ports_.back().address());
      }
      router_args_ = {"--workers=" + absl::StrJoin(workers, ","),
                      "--centroids=" + (options_.centroids.empty() ? CentroidsFile() : options_.centroids),
                      "--policy=" + options_.router_policy, "--refit_interval=0", "--log_level=warning"};
      if (options_.router_on_unix_socket) router_args_.push_back("--listen=unix:" + dir_.File("router.sock"));
      absl::StatusOr<eldr::testing::RouterChild> router = eldr::testing::StartRouter(dir_, router_args_);
      ASSERT_TRUE(router.ok()) << router.status();
      router_ = std::move(router->process);
      router_ports_ = router->ports;
    }
    std::vector<std::string> prefill;
    if (options_.dead_prefill_first) {
      absl::StatusOr<ReservedLoopbackPort> dead = ReservedLoopbackPort::Create();
      ASSERT_TRUE(dead.ok()) << dead.status();
      dead_ports_.push_back(*std::move(dead));
      prefill.push_back(dead_ports_.back().address());
    }
    for (int port : prefill_ports_) prefill.push_back(absl::StrCat("127.0.0.1:", port));
    std::vector<std::string> decode;
    for (int port : decode_ports_) decode.push_back(absl::StrCat("127.0.0.1:", port));
    std::vector<std::string> args = {BinaryPath("eldr-proxy"),
                                     "--listen=127.0.0.1:0",
                                     "--port_file=" + dir_.File("proxy.json"),
                                     "--decode=" + absl::StrJoin(decode, ","),
                                     "--retry_backoff=1ms",
                                     "--shutdown_grace=5s"};
    if (options_.prefill_kubeconfig.empty()) {
      args.push_back("--prefill=" + absl::StrJoin(prefill, ","));
    } else {
      args.insert(args.end(), {"--discovery=kubernetes", "--kubeconfig=" + options_.prefill_kubeconfig,
                               "--prefill_selector=app=prefill", "--prefill_port=http", "--discovery_settle=100ms"});
    }
    if (options_.router) {
      args.push_back(options_.router_on_unix_socket ? "--router=unix:" + dir_.File("router.sock")
                                                    : absl::StrCat("--router=127.0.0.1:", router_ports_.grpc));
    }
    args.insert(args.end(), options_.proxy_args.begin(), options_.proxy_args.end());
    absl::StatusOr<std::unique_ptr<ChildProcess>> proxy = ChildProcess::Spawn(args, dir_.File("proxy.log"));
    ASSERT_TRUE(proxy.ok()) << proxy.status();
    proxy_ = *std::move(proxy);
    absl::StatusOr<int> port = WaitForPort(dir_.File("proxy.json"), "port", *proxy_);
    ASSERT_TRUE(port.ok()) << port.status();
    proxy_port_ = *port;
  }

  // SIGKILLs eldr-router and starts a new one on the same data-plane address (a router restart:
  // the proxy's channel and stream see the connection drop, then a new server there). Needs
  // router_on_unix_socket: the socket's path lies in the stack's own folder, so nothing can take
  // it between the kill and the restart, as a test running beside this one could take a freed TCP
  // port. (The new router replaces the dead one's socket file, as gRPC unlinks it before binding.)
  void RestartRouter() {
    ASSERT_TRUE(options_.router_on_unix_socket) << "RestartRouter restarts a router on a Unix socket only";
    router_->Signal(SIGKILL);
    ASSERT_TRUE(router_->Wait(absl::Seconds(10)).ok());
    absl::StatusOr<eldr::testing::RouterChild> router = eldr::testing::StartRouter(dir_, router_args_);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = std::move(router->process);
    router_ports_ = router->ports;
  }

  int proxy_port() const { return proxy_port_; }
  int decode_port(int i) const { return decode_ports_[i]; }
  int prefill_port(int i) const { return prefill_ports_[i]; }
  ChildProcess& proxy() { return *proxy_; }
  ChildProcess& router() { return *router_; }

  double RouterMetric(const std::string& series) const {
    absl::StatusOr<std::string> page = HttpGet(router_ports_.metrics, "/metrics");
    if (!page.ok()) return -1;
    return SampleValue(*page, series).value_or(0);
  }
  // The sum of every series of `family` on the router's page (e.g. all outcomes and policies of
  // eldr_route_requests_total: every Route it handled, unary or as a stream message).
  double RouterMetricSum(const std::string& family) const {
    absl::StatusOr<std::string> page = HttpGet(router_ports_.metrics, "/metrics");
    if (!page.ok()) return -1;
    double sum = 0;
    for (absl::string_view line : absl::StrSplit(*page, '\n')) {
      if (!absl::ConsumePrefix(&line, family) || line.empty() || (line[0] != '{' && line[0] != ' ')) continue;
      double value = 0;
      if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) sum += value;
    }
    return sum;
  }
  double ProxyMetric(const std::string& series) const {
    absl::StatusOr<std::string> page = HttpGet(proxy_port_, "/metrics");
    if (!page.ok()) return -1;
    return SampleValue(*page, series).value_or(0);
  }
  double EngineMetric(int port, const std::string& series) const {
    absl::StatusOr<std::string> page = HttpGet(port, "/metrics");
    if (!page.ok()) return -1;
    return SampleValue(*page, series).value_or(0);
  }
  // Waits (bounded) until the router holds no lease: every Complete arrived. Only that: the router
  // frees a lease before it counts the Complete, so a caller that asserts a Complete count next
  // waits with LeasesReleased (or RouterMetricReaches) instead.
  ::testing::AssertionResult LeasesBackToZero() const { return RouterMetricReaches("eldr_live_leases", 0); }
  // Waits (bounded) until the router has counted `released` Completes that released a lease, then
  // checks that it holds no lease any more. Polls on the count itself: the router frees a lease
  // before it counts the Complete (Router::Complete, then RecordComplete), so no live lease does
  // not mean counted.
  ::testing::AssertionResult LeasesReleased(double released) const {
    ::testing::AssertionResult counted = RouterMetricReaches(kReleased, released);
    if (!counted) return counted;
    const double live = RouterMetric("eldr_live_leases");
    if (live != 0)
      return ::testing::AssertionFailure() << live << " leases still live with " << released << " released";
    return ::testing::AssertionSuccess();
  }
  // Waits (bounded) until the router's `series` is `want` (see Reaches).
  ::testing::AssertionResult RouterMetricReaches(const std::string& series, double want) const {
    return Reaches("router's " + series, want, [&] { return RouterMetric(series); });
  }
  // Waits (bounded) until the proxy's `series` is `want` (see Reaches).
  ::testing::AssertionResult ProxyMetricReaches(const std::string& series, double want) const {
    return Reaches("proxy's " + series, want, [&] { return ProxyMetric(series); });
  }
  // SIGKILLs every decode engine (an engine crash in the middle of answers).
  void KillDecodeEngines() {
    for (auto& engine : engines_) {
      if (absl::StrContains(engine->log_path(), "/decode")) engine->Signal(SIGKILL);
    }
  }
  std::string Logs() const {
    std::string out = absl::StrCat("--- proxy ---\n", proxy_ != nullptr ? proxy_->Log() : "");
    for (const auto& engine : engines_) absl::StrAppend(&out, "--- ", engine->log_path(), " ---\n", engine->Log(4096));
    return out;
  }

 private:
  int StartEngine(const std::string& role, int index) {
    const std::string port_file = dir_.File(absl::StrCat(role, index, ".json"));
    std::vector<std::string> args = {BinaryPath("eldr-engine-emu"),
                                     "--role=" + role,
                                     "--listen=127.0.0.1:0",
                                     "--port_file=" + port_file,
                                     "--trace=" + BundledTraceDir(),
                                     absl::StrCat("--time_scale=", options_.time_scale),
                                     "--engine_id=" + role + std::to_string(index)};
    if (role == "prefill") {
      args.push_back("--signature_key=" + options_.signature_key);
      args.insert(args.end(), options_.prefill_args.begin(), options_.prefill_args.end());
    }
    absl::StatusOr<std::unique_ptr<ChildProcess>> engine =
        ChildProcess::Spawn(args, dir_.File(absl::StrCat(role, index, ".log")));
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return 0;
    absl::StatusOr<int> port = WaitForPort(port_file, "port", **engine, absl::Seconds(60));
    EXPECT_TRUE(port.ok()) << port.status();
    engines_.push_back(*std::move(engine));
    return port.ok() ? *port : 0;
  }

  StackOptions options_;
  // Held dead until the stack's processes are gone (members are destroyed in reverse order).
  std::vector<ReservedLoopbackPort> dead_ports_;
  TempDir dir_;
  std::vector<std::unique_ptr<ChildProcess>> engines_;
  std::vector<int> prefill_ports_;
  std::vector<int> decode_ports_;
  std::unique_ptr<ChildProcess> router_;
  std::vector<std::string> router_args_;
  eldr::testing::DaemonPorts router_ports_;
  std::unique_ptr<ChildProcess> proxy_;
  int proxy_port_ = 0;
};

std::unique_ptr<http::HttpClient> NewClient() {
  http::HttpClientOptions options;
  absl::StatusOr<std::unique_ptr<http::HttpClient>> client = http::HttpClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return *std::move(client);
}

// A JSON POST of `body` to 127.0.0.1:<port><path>.
http::ClientRequest JsonPost(int port, const std::string& path, std::string body) {
  http::ClientRequest request;
  request.method = "POST";
  request.host = "127.0.0.1";
  request.port = port;
  request.target = path;
  request.headers = {{"Content-Type", "application/json"}};
  request.body = std::move(body);
  return request;
}

absl::StatusOr<http::FetchedResponse> Post(http::HttpClient& client, int port, const std::string& path,
                                           const std::string& body) {
  http::ClientRequest request = JsonPost(port, path, body);
  request.total_timeout = absl::Seconds(60);
  return http::FetchAndWait(client, std::move(request));
}

// The data of every event of an SSE body.
std::vector<std::string> EventData(const std::string& body) {
  std::vector<std::string> data;
  http::SseParser parser;
  EXPECT_TRUE(parser.Feed(body, [&](const http::SseEvent& event) { data.push_back(event.data); }).ok());
  return data;
}

// The generated pieces of a streamed completions or chat answer, in order.
std::vector<std::string> StreamedTokens(const std::string& body, bool chat) {
  std::vector<std::string> tokens;
  for (const std::string& data : EventData(body)) {
    if (data == "[DONE]") continue;
    const nlohmann::json chunk = nlohmann::json::parse(data, nullptr, false);
    if (!chunk.is_object() || !chunk.contains("choices") || chunk["choices"].empty()) continue;
    const nlohmann::json& choice = chunk["choices"][0];
    const std::string text = chat ? choice["delta"].value("content", "") : choice.value("text", "");
    if (!text.empty()) tokens.push_back(text);
  }
  return tokens;
}

std::vector<std::string> ExpectedTokens(int trace, int count) {
  std::vector<std::string> tokens;
  for (int k = 1; k <= count; ++k) tokens.push_back(absl::StrCat(" t", trace, "_", k));
  return tokens;
}

std::string CompletionBody(int trace, int max_tokens, bool stream) {
  nlohmann::json body = {
      {"prompt", absl::StrCat("eldr-trace:", trace, " tell me more")}, {"max_tokens", max_tokens}, {"stream", stream}};
  if (stream) body["stream_options"] = {{"include_usage", true}};
  return body.dump();
}

// POSTs a streamed completion of trace request `trace` to the stack's proxy; expects a 200 whose
// stream carries the trace's first `max_tokens` tokens in order.
void ExpectStreamedTokens(http::HttpClient& client, const Stack& stack, int trace, int max_tokens) {
  absl::StatusOr<http::FetchedResponse> answer =
      Post(client, stack.proxy_port(), "/v1/completions", CompletionBody(trace, max_tokens, true));
  ASSERT_TRUE(answer.ok()) << answer.status();
  ASSERT_EQ(answer->head.status, 200) << answer->body << stack.Logs();
  EXPECT_EQ(StreamedTokens(answer->body, false), ExpectedTokens(trace, max_tokens));
}

// Streams traces 0..n-1 (3 tokens each) through the stack's proxy; every lease must come back,
// counted released (so the released count is final on return; a RouteStream message's own count
// comes after it: wait for that with RouterMetricReaches).
void StreamTracesAndReleaseTheLeases(Stack& stack, int n) {
  const double released = stack.RouterMetric(kReleased);
  auto client = NewClient();
  for (int trace = 0; trace < n; ++trace) {
    ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, trace, /*max_tokens=*/3));
  }
  EXPECT_TRUE(stack.LeasesReleased(released + n));
}

// Whether the proxy comes to count n OK router calls of `method` (it counts a call when its answer
// is back, which may be after the router's own count).
::testing::AssertionResult ProxyCountsOkCalls(const Stack& stack, const std::string& method, int n) {
  return stack.ProxyMetricReaches(absl::StrCat("eldr_proxy_router_calls_total{code=\"OK\",method=\"", method, "\"}"),
                                  n);
}

// A streamed completions request in flight: what arrived so far, and how it ended. The destructor
// cancels the call and waits for its end, so the callbacks never outlive the object.
class StreamingCall {
 public:
  // Starts a streamed POST /v1/completions of CompletionBody(trace, max_tokens, true) on `port`.
  StreamingCall(http::HttpClient& client, int port, int trace, int max_tokens) {
    http::ClientCallbacks callbacks;
    callbacks.on_body = [this](absl::string_view piece) {
      absl::MutexLock lock(&mu_);
      received_.append(piece.data(), piece.size());
    };
    callbacks.on_done = [this](const http::ClientResult& result) {
      absl::MutexLock lock(&mu_);
      result_ = result;
    };
    call_ =
        client.Start(JsonPost(port, "/v1/completions", CompletionBody(trace, max_tokens, true)), std::move(callbacks));
  }
  ~StreamingCall() {
    call_->Cancel();
    WaitDone(absl::Seconds(10));
  }
  StreamingCall(const StreamingCall&) = delete;
  StreamingCall& operator=(const StreamingCall&) = delete;

  // Whether `tokens` generated pieces arrived within `timeout` (false when the call ends first).
  bool WaitForTokens(size_t tokens, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto enough = [this, tokens]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return StreamedTokens(received_, false).size() >= tokens;
    };
    const auto enough_or_done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return enough() || result_.has_value(); };
    mu_.AwaitWithTimeout(absl::Condition(&enough_or_done), timeout);
    return enough();
  }
  // Whether the call ended within `timeout`.
  bool WaitDone(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return result_.has_value(); };
    return mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
  }
  void Cancel() { call_->Cancel(); }

  // The body so far.
  std::string received() const {
    absl::MutexLock lock(&mu_);
    return received_;
  }
  // How the call ended (nullopt while it runs).
  std::optional<http::ClientResult> result() const {
    absl::MutexLock lock(&mu_);
    return result_;
  }

 private:
  mutable absl::Mutex mu_;
  std::string received_ ABSL_GUARDED_BY(mu_);
  std::optional<http::ClientResult> result_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<http::ClientCall> call_;
};

// The dead addresses of these tests (dead_prefill_first, dead_decode_worker, an unreachable
// router): a reserved port refuses connections while it is held, and no other socket can bind it,
// not even one that asks for SO_REUSEADDR.
TEST(ReservedLoopbackPortTest, RefusesConnectionsAndCannotBeTakenWhileHeld) {
  absl::StatusOr<ReservedLoopbackPort> reserved = ReservedLoopbackPort::Create();
  ASSERT_TRUE(reserved.ok()) << reserved.status();
  ASSERT_GT(reserved->port(), 0);
  EXPECT_EQ(reserved->address(), absl::StrCat("127.0.0.1:", reserved->port()));
  for (int attempt = 0; attempt < 3; ++attempt) {
    absl::StatusOr<std::string> answer = HttpExchange(reserved->port(), "GET / HTTP/1.0\r\n\r\n");
    EXPECT_EQ(answer.status().code(), absl::StatusCode::kUnavailable) << answer.status();
    EXPECT_THAT(std::string(answer.status().message()), HasSubstr(std::strerror(ECONNREFUSED)));
  }
  for (const uint32_t host : {INADDR_LOOPBACK, INADDR_ANY}) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    const int on = 1;
    ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)), 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(host);
    address.sin_port = htons(static_cast<uint16_t>(reserved->port()));
    const int bound = bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    const int error = errno;
    close(fd);
    EXPECT_EQ(bound, -1) << "bound the reserved port " << reserved->port();
    EXPECT_EQ(error, EADDRINUSE) << std::strerror(error);
  }
  // Moved (as into a vector), it is still held.
  const int port = reserved->port();
  std::vector<ReservedLoopbackPort> held;
  held.push_back(*std::move(reserved));
  EXPECT_EQ(held.back().port(), port);
  absl::StatusOr<std::string> answer = HttpExchange(port, "");
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kUnavailable) << answer.status();
}

TEST(ProxyIntegration, CompletionsAndChatStreamedAndNotInOrderWithOneCompletePerRequest) {
  Stack stack({});
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  int requests = 0;
  for (int trace : {3, 17, 42}) {
    absl::StatusOr<http::FetchedResponse> streamed =
        Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(trace, 8, true));
    ++requests;
    ASSERT_TRUE(streamed.ok()) << streamed.status() << stack.Logs();
    ASSERT_EQ(streamed->head.status, 200) << streamed->body << stack.Logs();
    EXPECT_THAT(std::string(streamed->head.Header("Content-Type").value_or("")), HasSubstr("text/event-stream"));
    EXPECT_EQ(StreamedTokens(streamed->body, false), ExpectedTokens(trace, 8));
    const std::vector<std::string> events = EventData(streamed->body);
    ASSERT_FALSE(events.empty());
    EXPECT_EQ(events.back(), "[DONE]");
    EXPECT_THAT(streamed->body, HasSubstr("\"completion_tokens\":8"));

    absl::StatusOr<http::FetchedResponse> whole =
        Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(trace, 5, false));
    ++requests;
    ASSERT_TRUE(whole.ok()) << whole.status();
    ASSERT_EQ(whole->head.status, 200) << whole->body;
    const nlohmann::json answer = nlohmann::json::parse(whole->body);
    EXPECT_EQ(answer["choices"][0]["text"], absl::StrJoin(ExpectedTokens(trace, 5), ""));
    EXPECT_EQ(answer["usage"]["completion_tokens"], 5);
  }
  nlohmann::json chat = {
      {"messages", {{{"role", "user"}, {"content", "eldr-trace:9 hi"}}}}, {"max_tokens", 6}, {"stream", true}};
  absl::StatusOr<http::FetchedResponse> chat_streamed =
      Post(*client, stack.proxy_port(), "/v1/chat/completions", chat.dump());
  ++requests;
  ASSERT_TRUE(chat_streamed.ok()) << chat_streamed.status();
  ASSERT_EQ(chat_streamed->head.status, 200) << chat_streamed->body;
  EXPECT_EQ(StreamedTokens(chat_streamed->body, true), ExpectedTokens(9, 6));
  chat["stream"] = false;
  absl::StatusOr<http::FetchedResponse> chat_whole =
      Post(*client, stack.proxy_port(), "/v1/chat/completions", chat.dump());
  ++requests;
  ASSERT_TRUE(chat_whole.ok()) << chat_whole.status();
  ASSERT_EQ(chat_whole->head.status, 200) << chat_whole->body;
  EXPECT_EQ(nlohmann::json::parse(chat_whole->body)["choices"][0]["message"]["content"],
            absl::StrJoin(ExpectedTokens(9, 6), ""));

  // Every request was routed by eldr-router on its signature, and released exactly once.
  EXPECT_TRUE(stack.LeasesReleased(requests));
  EXPECT_EQ(stack.RouterMetric("eldr_complete_requests_total{outcome=\"not_found\"}"), 0);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_signatures_total{source=\"eldr_expert_counts\"}"), requests);
  EXPECT_GT(stack.ProxyMetric("eldr_proxy_e2e_seconds_count{decision=\"locality\",policy=\"eldr\"}"), 0);
  EXPECT_GT(stack.ProxyMetric("eldr_proxy_ttft_seconds_count{decision=\"locality\",policy=\"eldr\"}"), 0);

  stack.proxy().Signal(SIGTERM);
  EXPECT_EQ(stack.proxy().Wait(absl::Seconds(10)).value_or(-1), 0) << stack.Logs();
}

TEST(ProxyIntegration, AClientThatLeavesMidStreamAbortsTheEngineAndReleasesTheLease) {
  StackOptions options;
  options.time_scale = 0.2;  // ~3 ms steps: a 5000-token answer lasts long enough to leave it
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  StreamingCall call(*client, stack.proxy_port(), /*trace=*/5, /*max_tokens=*/5000);
  ASSERT_TRUE(call.WaitForTokens(3, absl::Seconds(30))) << stack.Logs();
  call.Cancel();
  ASSERT_TRUE(call.WaitDone(absl::Seconds(10)));
  // The proxy cancelled the engine's call (the emulator counts the abort) and completed the lease.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  const auto aborted = [&] {
    return stack.EngineMetric(stack.decode_port(0), "eldr_emu_requests_aborted_total{role=\"decode\"}") +
           stack.EngineMetric(stack.decode_port(1), "eldr_emu_requests_aborted_total{role=\"decode\"}");
  };
  while (absl::Now() < deadline && aborted() < 1) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(aborted(), 1) << stack.Logs();
  EXPECT_TRUE(stack.LeasesReleased(1));
  // Counted after the engine's call is cancelled and the Complete sent (ProxyCall::OnClientGone).
  EXPECT_TRUE(
      stack.ProxyMetricReaches("eldr_proxy_requests_total{endpoint=\"completions\",outcome=\"client_gone\"}", 1));
}

TEST(ProxyIntegration, ADeadPrefillInstanceIsRetriedOnAnother) {
  StackOptions options;
  options.dead_prefill_first = true;
  options.proxy_args = {"--prefill_policy=round_robin"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  for (int trace = 0; trace < 6; ++trace) {
    ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, trace, /*max_tokens=*/3));
  }
  EXPECT_GE(stack.ProxyMetric("eldr_proxy_prefill_retries_total"), 3);
  EXPECT_GE(stack.ProxyMetric("eldr_proxy_upstream_errors_total{kind=\"connect\",phase=\"prefill\"}"), 3);
  EXPECT_TRUE(stack.LeasesBackToZero());
}

TEST(ProxyIntegration, ADeadDecodeWorkerIsReroutedBeforeTheFirstByte) {
  StackOptions options;
  options.dead_decode_worker = true;
  options.router_policy = "rr";  // the dead worker gets its turns
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  for (int trace = 0; trace < 6; ++trace) {
    ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, trace, /*max_tokens=*/3));
  }
  // Counted before the re-route, so before the answer: final now.
  const double reroutes = stack.ProxyMetric("eldr_proxy_decode_reroutes_total");
  EXPECT_GE(reroutes, 2);
  // Each route that went to the dead worker was completed before the re-route: released == routes.
  EXPECT_TRUE(stack.LeasesReleased(6 + reroutes));
}

TEST(ProxyIntegration, TheReferenceSignatureKeyIsRoutedByLocality) {
  StackOptions options;
  options.signature_key = "eldr_sig";
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  for (int trace = 0; trace < 4; ++trace) {
    absl::StatusOr<http::FetchedResponse> answer =
        Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(trace, 2, false));
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->head.status, 200) << answer->body << stack.Logs();
  }
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_signatures_total{source=\"eldr_sig\"}"), 4);
  EXPECT_EQ(stack.RouterMetric("eldr_route_requests_total{outcome=\"ok\",policy=\"eldr\"}"), 4);
}

TEST(ProxyIntegration, GateProbSumsAreForwardedToAGateProbRouter) {
  // The prefill attaches counts and gate sums; --route_with_gate_prob_sums sends the gate sums to
  // a router calibrated with gate_prob, which routes every request by locality (a count signature
  // would be refused there with INVALID_ARGUMENT and the request balanced on load only).
  StackOptions options;
  options.prefill_args = {"--gate_prob_sums"};
  options.proxy_args = {"--route_with_gate_prob_sums"};
  options.centroids = GateCentroidsFile();
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  for (int trace = 0; trace < 6; ++trace) {
    absl::StatusOr<http::FetchedResponse> answer =
        Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(trace, 2, trace % 2 == 0));
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->head.status, 200) << answer->body << stack.Logs();
  }
  EXPECT_EQ(stack.RouterMetric("eldr_route_requests_total{outcome=\"ok\",policy=\"eldr\"}"), 6) << stack.Logs();
  EXPECT_EQ(stack.RouterMetric("eldr_rejected_total{reason=\"wrong_encoding\"}"), 0);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_signatures_total{source=\"eldr_expert_counts\"}"), 6);
  EXPECT_TRUE(stack.LeasesBackToZero());
}

TEST(ProxyIntegration, WithoutTheFlagTheCountsAreSentEvenWhenGateSumsCame) {
  StackOptions options;
  options.prefill_args = {"--gate_prob_sums"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  for (int trace = 0; trace < 3; ++trace) {
    absl::StatusOr<http::FetchedResponse> answer =
        Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(trace, 2, false));
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->head.status, 200) << answer->body << stack.Logs();
  }
  EXPECT_EQ(stack.RouterMetric("eldr_route_requests_total{outcome=\"ok\",policy=\"eldr\"}"), 3);
  EXPECT_EQ(stack.RouterMetric("eldr_route_requests_total{outcome=\"invalid\",policy=\"eldr\"}"), 0);
}

TEST(ProxyIntegration, MalformedBodiesGet400WithTheReason) {
  Stack stack({});
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "parse error"},
      {"[1, 2]", "object"},
      {"{\"max_tokens\": 3}", "prompt"},
      {"{\"prompt\": \"x\", \"n\": 2}", "n"},
      {"{\"prompt\": \"x\", \"max_tokens\": 0}", "max_tokens"},
  };
  for (const auto& [body, reason] : cases) {
    absl::StatusOr<http::FetchedResponse> answer = Post(*client, stack.proxy_port(), "/v1/completions", body);
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->head.status, 400) << body;
    EXPECT_THAT(answer->body, HasSubstr(reason)) << body;
    EXPECT_THAT(answer->body, HasSubstr("\"code\":400")) << body;
  }
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_requests_total{endpoint=\"completions\",outcome=\"client_error\"}"),
            static_cast<double>(cases.size()));
  // Nothing reached the router.
  EXPECT_EQ(stack.RouterMetric("eldr_route_requests_total{outcome=\"ok\",policy=\"eldr\"}"), 0);
  // Other endpoints.
  EXPECT_TRUE(HttpGet(stack.proxy_port(), "/health").ok());
  EXPECT_TRUE(HttpGet(stack.proxy_port(), "/readyz").ok());
  absl::StatusOr<std::string> models = HttpGet(stack.proxy_port(), "/v1/models");
  ASSERT_TRUE(models.ok()) << models.status();
  EXPECT_THAT(*models, HasSubstr("\"object\":\"list\""));
}

TEST(ProxyIntegration, TheAbSplitRoutesItsBaselineArmByTheBaselinePolicy) {
  StackOptions options;
  options.proxy_args = {"--ab_baseline_fraction=0.5", "--ab_baseline_policy=rr"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  for (int trace = 0; trace < 24; ++trace) {
    absl::StatusOr<http::FetchedResponse> answer =
        Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(trace, 2, true));
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->head.status, 200) << answer->body;
  }
  const std::string baseline_series = "eldr_proxy_e2e_seconds_count{decision=\"baseline\",policy=\"rr\"}";
  const std::string locality_series = "eldr_proxy_e2e_seconds_count{decision=\"locality\",policy=\"eldr\"}";
  // The proxy counts a request's latencies before its client has the answer (ProxyCall::
  // OnDecodeDone); waiting until all 24 are in keeps the split's reading right even if not.
  EXPECT_TRUE(Reaches("baseline + locality e2e counts", 24,
                      [&] { return stack.ProxyMetric(baseline_series) + stack.ProxyMetric(locality_series); }));
  const double baseline = stack.ProxyMetric(baseline_series);
  const double locality = stack.ProxyMetric(locality_series);
  EXPECT_GT(baseline, 0);
  EXPECT_GT(locality, 0);
  EXPECT_EQ(baseline + locality, 24);
  EXPECT_EQ(stack.RouterMetric("eldr_route_requests_total{outcome=\"ok\",policy=\"rr\"}"), baseline);
}

TEST(ProxyIntegration, WithoutTheRouterTheProxyRoutesByItsStaticList) {
  // Held dead for the whole test (declared before the stack: it outlives the proxy).
  absl::StatusOr<ReservedLoopbackPort> unreachable = ReservedLoopbackPort::Create();
  ASSERT_TRUE(unreachable.ok()) << unreachable.status();
  StackOptions options;
  options.router = false;
  options.proxy_args = {"--router=" + unreachable->address(), "--route_timeout=200ms"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  for (int trace = 0; trace < 4; ++trace) {
    ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, trace, /*max_tokens=*/2));
  }
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_static_routes_total"), 4);
}

// An engine that dies mid-answer: the client's stream ends with an error event and [DONE] (it
// never looks like a complete answer), and the lease is released.
TEST(ProxyIntegration, AnEngineThatDiesMidStreamEndsTheStreamWithAnErrorEvent) {
  StackOptions options;
  options.time_scale = 0.2;
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  StreamingCall call(*client, stack.proxy_port(), /*trace=*/11, /*max_tokens=*/5000);
  ASSERT_TRUE(call.WaitForTokens(3, absl::Seconds(30))) << stack.Logs();
  stack.KillDecodeEngines();
  ASSERT_TRUE(call.WaitDone(absl::Seconds(20))) << stack.Logs();
  const http::ClientResult result = *call.result();
  EXPECT_TRUE(result.status.ok()) << result.status;  // the proxy ended its stream properly
  const std::vector<std::string> events = EventData(call.received());
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_THAT(events[events.size() - 2], HasSubstr("\"error\""));
  EXPECT_THAT(events[events.size() - 2], HasSubstr("broke off"));
  EXPECT_TRUE(stack.LeasesBackToZero());
  EXPECT_GE(stack.ProxyMetric("eldr_proxy_upstream_errors_total{kind=\"mid_stream\",phase=\"decode\"}"), 1);
}

// A body over --max_request_bytes is 413; an engine's 429 reaches the client as it came.
TEST(ProxyIntegration, LimitsAnswer413AndAnEnginesOverloadPasses429Through) {
  StackOptions options;
  options.proxy_args = {"--max_request_bytes=4096"};
  // One prefill at a time, 1.5 s each, at most one waiting: concurrent requests overflow it.
  options.prefill_args = {"--max_waiting=1", "--time_scale=1", "--prefill_fixed_us=1500000"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  nlohmann::json big = {{"prompt", std::string(8000, 'x')}, {"max_tokens", 2}};
  absl::StatusOr<http::FetchedResponse> oversized = Post(*client, stack.proxy_port(), "/v1/completions", big.dump());
  ASSERT_TRUE(oversized.ok()) << oversized.status();
  EXPECT_EQ(oversized->head.status, 413);

  absl::Mutex mu;
  std::vector<int> statuses;
  std::vector<std::string> bodies;
  absl::BlockingCounter finished(4);
  for (int i = 0; i < 4; ++i) {
    http::Fetch(*client, JsonPost(stack.proxy_port(), "/v1/completions", CompletionBody(i, 2, false)), 1 << 20,
                [&](absl::StatusOr<http::FetchedResponse> answer) {
                  absl::MutexLock lock(&mu);
                  statuses.push_back(answer.ok() ? answer->head.status : -1);
                  bodies.push_back(answer.ok() ? answer->body : std::string(answer.status().message()));
                  finished.DecrementCount();
                });
  }
  finished.Wait();
  absl::MutexLock lock(&mu);
  int ok = 0;
  int overloaded = 0;
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (statuses[i] == 200) ++ok;
    if (statuses[i] == 429) {
      ++overloaded;
      EXPECT_THAT(bodies[i], HasSubstr("TooManyRequestsError"));
    }
  }
  EXPECT_GE(ok, 1) << absl::StrJoin(statuses, ",");
  EXPECT_GE(overloaded, 1) << absl::StrJoin(statuses, ",");
  EXPECT_EQ(ok + overloaded, 4) << absl::StrJoin(statuses, ",");
  EXPECT_TRUE(stack.LeasesBackToZero());
}

// SIGTERM: new requests are refused (or find the port closed), the answer in flight finishes, the
// proxy exits 0.
TEST(ProxyIntegration, SigtermLetsAnswersInFlightFinish) {
  StackOptions options;
  options.time_scale = 0.5;  // ~8 ms steps: 100 tokens take most of a second
  // The grace must outlast the answer even on a loaded machine (CI runs tests two at a time beside
  // other builds): a cut answer here would be the grace's doing, not a draining bug.
  options.proxy_args = {"--shutdown_grace=60s"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  StreamingCall call(*client, stack.proxy_port(), /*trace=*/21, /*max_tokens=*/100);
  ASSERT_TRUE(call.WaitForTokens(1, absl::Seconds(30)));
  stack.proxy().Signal(SIGTERM);
  // The proxy refuses new requests from the moment it drains (ProxyImpl::Shutdown sets draining_
  // first, and /readyz reports it): wait for that, not for a fixed time, before the late request.
  ASSERT_TRUE(PollUntil(
      [&] {
        absl::StatusOr<std::string> readyz = HttpExchange(stack.proxy_port(), "GET /readyz HTTP/1.0\r\n\r\n");
        return !readyz.ok() || (HttpStatusOf(*readyz) == 503 && absl::StrContains(*readyz, "draining"));
      },
      absl::Seconds(10), absl::Milliseconds(10)))
      << stack.Logs();
  absl::StatusOr<http::FetchedResponse> late =
      Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(1, 2, false));
  if (late.ok()) EXPECT_EQ(late->head.status, 503);
  ASSERT_TRUE(call.WaitDone(absl::Seconds(20)));
  const std::string received = call.received();
  const std::vector<std::string> tokens = StreamedTokens(received, false);
  EXPECT_EQ(tokens.size(), 100u) << "the answer's end: "
                                 << received.substr(received.size() - std::min<size_t>(received.size(), 800))
                                 << "\nresult: "
                                 << (call.result().has_value() ? call.result()->status.ToString() : "none");
  EXPECT_EQ(tokens, ExpectedTokens(21, 100));
  EXPECT_EQ(stack.proxy().Wait(absl::Seconds(10)).value_or(-1), 0) << stack.Logs();
  EXPECT_TRUE(stack.LeasesBackToZero());
}

// --discovery=kubernetes: the prefill instances are the ready pods labelled app=prefill that the
// stand-in API server lists, followed as they come and go.
TEST(ProxyIntegration, PrefillInstancesFollowTheDiscoveredPods) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<FakeKube>> kube = FakeKube::Start(dir, FakeKubeOptions{dir.File("tls")});
  ASSERT_TRUE(kube.ok()) << kube.status();
  const std::string kubeconfig = dir.File("kubeconfig");
  ASSERT_TRUE((*kube)->WriteKubeconfig(kubeconfig).ok());
  StackOptions options;
  options.prefill = 2;
  options.prefill_kubeconfig = kubeconfig;
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  auto pod = [&](int i) {
    return nlohmann::json{
        {"name", absl::StrCat("prefill-", i)},
        {"ip", "127.0.0.1"},
        {"ready", true},
        {"labels", {{"app", "prefill"}}},
        {"ports", nlohmann::json::array({{{"name", "http"}, {"containerPort", stack.prefill_port(i)}}})}};
  };
  auto ready = [&] {
    absl::StatusOr<std::string> page = HttpGet(stack.proxy_port(), "/readyz");
    return page.ok() && absl::StrContains(*page, "ready") && !absl::StrContains(*page, "no prefill");
  };
  auto prefills_served = [&](int i) { return stack.EngineMetric(stack.prefill_port(i), "eldr_emu_prefills_total"); };

  // No prefill pod yet: not ready, and a request is refused with the reason.
  EXPECT_FALSE(ready());
  absl::StatusOr<http::FetchedResponse> early =
      Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(3, 4, /*stream=*/false));
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_EQ(early->head.status, 503) << early->body;

  ASSERT_TRUE((*kube)->CreatePod(pod(0)).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (!ready() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(ready()) << stack.Logs();
  ExpectStreamedTokens(*client, stack, 3, 4);
  EXPECT_GE(prefills_served(0), 1);

  // A second instance joins, the first goes away: requests go on, on the second one.
  ASSERT_TRUE((*kube)->CreatePod(pod(1)).ok());
  ASSERT_TRUE((*kube)->TerminatePod("prefill-0").ok());
  ASSERT_TRUE((*kube)->DeletePod("prefill-0").ok());
  // Applied: prefill-1 upserted (after the 100 ms settle) and prefill-0 removed. Discovery counts a
  // change after the proxy's prefill list took it (PoolReconciler::Call).
  ASSERT_TRUE(stack.ProxyMetricReaches("eldr_discovery_pool_changes_total{action=\"upsert\",role=\"prefill\"}", 2))
      << stack.Logs();
  ASSERT_TRUE(stack.ProxyMetricReaches("eldr_discovery_pool_changes_total{action=\"remove\",role=\"prefill\"}", 1))
      << stack.Logs();
  const double first_before = prefills_served(0);
  for (int trace : {5, 6, 7, 8}) ExpectStreamedTokens(*client, stack, trace, 3);
  EXPECT_EQ(prefills_served(0), first_before) << "a deleted pod gets no prefill";
  EXPECT_GE(prefills_served(1), 4);
  EXPECT_EQ(stack.ProxyMetric("eldr_discovery_synced{role=\"prefill\"}"), 1);
  EXPECT_EQ(stack.ProxyMetric("eldr_discovery_workers{role=\"prefill\",state=\"ready\"}"), 1);
  EXPECT_TRUE(stack.LeasesBackToZero());
}

// ---- eldr-router's RouteStream (--router_api) -----------------------------------------------------

// By default Route and Complete are messages of the proxy's RouteStream calls (--router_streams
// of them), not unary RPCs; what the proxy counts per router call is the same as on the unary path.
TEST(ProxyIntegration, RouteAndCompleteGoAsMessagesOfTheRouteStreams) {
  StackOptions options;
  options.proxy_args = {"--router_streams=2"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  ASSERT_NO_FATAL_FAILURE(StreamTracesAndReleaseTheLeases(stack, 6));
  EXPECT_EQ(stack.RouterMetric("eldr_route_stream_messages_total{kind=\"route\",outcome=\"ok\"}"), 6);
  // Counted after the Complete's release (AnswerStreamRequest): waited for.
  EXPECT_TRUE(stack.RouterMetricReaches("eldr_route_stream_messages_total{kind=\"complete\",outcome=\"ok\"}", 6));
  // Every Route the router handled came on a stream: none was a unary RPC.
  EXPECT_EQ(stack.RouterMetricSum("eldr_route_requests_total"), 6);
  EXPECT_EQ(stack.RouterMetric("eldr_complete_requests_total{outcome=\"released\"}"), 6);
  EXPECT_EQ(stack.RouterMetric("eldr_route_streams_open"), 2);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_calls_total{code=\"OK\",method=\"route\"}"), 6);
  EXPECT_TRUE(ProxyCountsOkCalls(stack, "complete", 6));
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_stream_opens_total"), 2);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_streams_open"), 2);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_unary_fallbacks_total{reason=\"reconnecting\"}"), 0);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_static_routes_total"), 0);
}

// A proxy beside the router in one pod can reach it over a Unix socket: the same streams.
TEST(ProxyIntegration, TheRouterIsReachedOverAUnixSocket) {
  StackOptions options;
  options.router_on_unix_socket = true;
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  ASSERT_NO_FATAL_FAILURE(StreamTracesAndReleaseTheLeases(stack, 3));
  EXPECT_EQ(stack.RouterMetric("eldr_route_stream_messages_total{kind=\"route\",outcome=\"ok\"}"), 3);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_calls_total{code=\"OK\",method=\"route\"}"), 3);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_static_routes_total"), 0);
}

// --router_complete_errors_only: the router answers none of the Completes (all succeed), every
// lease is released, and the proxy still counts each Complete as OK (confirmed by a later answer
// on its stream, or at its deadline).
TEST(ProxyIntegration, ErrorsOnlyCompletesGoUnansweredAndAreCountedOk) {
  StackOptions options;
  options.proxy_args = {"--router_streams=1", "--router_complete_errors_only"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  ASSERT_NO_FATAL_FAILURE(StreamTracesAndReleaseTheLeases(stack, 4));
  // Both counted after the Complete's release (AnswerStreamRequest, then AnswerStreamMessage).
  EXPECT_TRUE(stack.RouterMetricReaches("eldr_route_stream_messages_total{kind=\"complete\",outcome=\"ok\"}", 4));
  EXPECT_TRUE(stack.RouterMetricReaches("eldr_route_stream_unanswered_total", 4));
  EXPECT_TRUE(ProxyCountsOkCalls(stack, "complete", 4));
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_calls_total{code=\"DEADLINE_EXCEEDED\",method=\"complete\"}"), 0);
}

TEST(ProxyIntegration, RouterApiUnaryCallsTheUnaryRpcs) {
  StackOptions options;
  options.proxy_args = {"--router_api=unary"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  for (int trace = 0; trace < 4; ++trace) {
    ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, trace, /*max_tokens=*/3));
  }
  EXPECT_TRUE(stack.LeasesReleased(4));
  EXPECT_EQ(stack.RouterMetricSum("eldr_route_requests_total"), 4);
  EXPECT_EQ(stack.RouterMetricSum("eldr_route_stream_messages_total"), 0);
  EXPECT_EQ(stack.RouterMetric("eldr_route_streams_open"), 0);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_calls_total{code=\"OK\",method=\"route\"}"), 4);
  EXPECT_TRUE(ProxyCountsOkCalls(stack, "complete", 4));  // counted when the answer is back, after the router's count
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_stream_opens_total"), 0);
}

// A request in flight whose answer comes after `Send` returned: the outcome of one proxy request.
class PendingPost {
 public:
  PendingPost(http::HttpClient& client, int port, const std::string& body) {
    http::Fetch(client, JsonPost(port, "/v1/completions", body), 1 << 20,
                [this](absl::StatusOr<http::FetchedResponse> answer) {
                  absl::MutexLock lock(&mu_);
                  answer_ = std::move(answer);
                });
  }
  ~PendingPost() { Wait(absl::Seconds(30)); }  // the callback references this
  PendingPost(const PendingPost&) = delete;
  PendingPost& operator=(const PendingPost&) = delete;

  // The answer once it came within `timeout`; nullopt before.
  std::optional<absl::StatusOr<http::FetchedResponse>> Wait(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(
        absl::Condition(
            +[](std::optional<absl::StatusOr<http::FetchedResponse>>* answer) { return answer->has_value(); },
            &answer_),
        timeout);
    return answer_;
  }

 private:
  absl::Mutex mu_;
  std::optional<absl::StatusOr<http::FetchedResponse>> answer_ ABSL_GUARDED_BY(mu_);
};

// The router dies with a Route message of the stream unanswered (SIGSTOP first, so the message
// is surely in flight), and a new router comes up on the same address (a Unix socket, which no
// other test can take meanwhile, unlike a freed TCP port): the message fails once,
// UNAVAILABLE, and the proxy routes that request from its static list as on any router error;
// the stream re-opens, and later requests are routed by the new router on it.
TEST(ProxyIntegration, ARouterKilledWithAMessageInFlightFailsItOnceAndTheStreamReopens) {
  StackOptions options;
  // One stream, so that the opens are counted simply; the break, not the deadline, must end the wait.
  options.proxy_args = {"--router_streams=1", "--route_timeout=20s"};
  options.router_on_unix_socket = true;  // restarted on the same address: see RestartRouter
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, 1, /*max_tokens=*/3));
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_stream_opens_total"), 1);

  stack.router().Signal(SIGSTOP);
  std::optional<absl::StatusOr<http::FetchedResponse>> answer;
  {
    PendingPost stuck(*client, stack.proxy_port(), CompletionBody(2, 3, false));
    // Its prefill is done (the proxy now waits for the Route answer), and nothing answers it.
    ASSERT_TRUE(eldr::testing::PollUntil(
        [&] { return stack.EngineMetric(stack.prefill_port(0), "eldr_emu_prefills_total") >= 2; }, absl::Seconds(10)))
        << stack.Logs();
    EXPECT_FALSE(stuck.Wait(absl::Milliseconds(300)).has_value()) << "answered while the router was stopped";
    ASSERT_NO_FATAL_FAILURE(stack.RestartRouter());
    answer = stuck.Wait(absl::Seconds(10));
    ASSERT_TRUE(answer.has_value()) << stack.Logs();
  }
  ASSERT_TRUE(answer->ok()) << answer->status();
  EXPECT_EQ((*answer)->head.status, 200) << (*answer)->body << stack.Logs();
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_calls_total{code=\"UNAVAILABLE\",method=\"route\"}"), 1);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_calls_total{code=\"DEADLINE_EXCEEDED\",method=\"route\"}"), 0);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_static_routes_total"), 1);

  // The new router gets a new stream (after the re-open's backoff; unary in between).
  ASSERT_TRUE(eldr::testing::PollUntil(
      [&] {
        absl::StatusOr<http::FetchedResponse> probe =
            Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(3, 2, false));
        return probe.ok() && probe->head.status == 200 &&
               stack.RouterMetric("eldr_route_stream_messages_total{kind=\"route\",outcome=\"ok\"}") >= 1;
      },
      absl::Seconds(15), absl::Milliseconds(100)))
      << stack.Logs();
  const double static_routes = stack.ProxyMetric("eldr_proxy_static_routes_total");
  const double stream_routes = stack.RouterMetric("eldr_route_stream_messages_total{kind=\"route\",outcome=\"ok\"}");
  for (int trace = 4; trace < 8; ++trace) {
    ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, trace, /*max_tokens=*/3));
  }
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_static_routes_total"), static_routes);
  EXPECT_EQ(stack.RouterMetric("eldr_route_stream_messages_total{kind=\"route\",outcome=\"ok\"}"), stream_routes + 4);
  // At least one re-open; more when an open raced the channel's reconnection and failed fast.
  EXPECT_GE(stack.ProxyMetric("eldr_proxy_router_stream_opens_total"), 2);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_streams_open"), 1);
  EXPECT_TRUE(stack.LeasesBackToZero());
}

// A Route message that the router does not answer by --route_timeout fails DEADLINE_EXCEEDED (the
// request is routed from the static list meanwhile); the router's late answer is dropped and its
// lease released; the stream goes on.
TEST(ProxyIntegration, AStreamMessageWithoutAnAnswerFailsAtItsDeadline) {
  StackOptions options;
  options.proxy_args = {"--router_streams=1", "--route_timeout=300ms"};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  auto client = NewClient();
  ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, 1, /*max_tokens=*/3));
  ASSERT_TRUE(stack.LeasesReleased(1));

  stack.router().Signal(SIGSTOP);
  const absl::Time sent = absl::Now();
  absl::StatusOr<http::FetchedResponse> answer =
      Post(*client, stack.proxy_port(), "/v1/completions", CompletionBody(2, 3, false));
  const absl::Duration took = absl::Now() - sent;
  stack.router().Signal(SIGCONT);
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->head.status, 200) << answer->body << stack.Logs();
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_calls_total{code=\"DEADLINE_EXCEEDED\",method=\"route\"}"), 1);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_static_routes_total"), 1);

  // The resumed router answers the message: the lease it took is released by the proxy.
  EXPECT_TRUE(stack.LeasesReleased(2)) << stack.Logs();
  ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, 3, /*max_tokens=*/3));
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_static_routes_total"), 1);
  EXPECT_EQ(stack.RouterMetric("eldr_route_stream_messages_total{kind=\"route\",outcome=\"ok\"}"), 3);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_stream_opens_total"), 1);
  EXPECT_TRUE(stack.LeasesBackToZero());
}

// A DecodeRouter from before RouteStream: a real gRPC server that implements Route and Complete
// only (gRPC answers RouteStream UNIMPLEMENTED), routing every request to one address.
class RouterWithoutRouteStream final : public eldr::v1::DecodeRouter::Service {
 public:
  void set_address(const std::string& address) {
    absl::MutexLock lock(&mu_);
    address_ = address;
  }
  int routes() const {
    absl::MutexLock lock(&mu_);
    return routes_;
  }
  int completes() const {
    absl::MutexLock lock(&mu_);
    return completes_;
  }

  grpc::Status Route(grpc::ServerContext*, const eldr::v1::RouteRequest*, eldr::v1::RouteResponse* response) override {
    absl::MutexLock lock(&mu_);
    ++routes_;
    const uint64_t lease = next_lease_++;
    leases_.insert(lease);
    response->set_worker_id("d0");
    response->set_address(address_);
    response->set_lease_id(lease);
    response->set_policy("jsq");
    return grpc::Status::OK;
  }
  grpc::Status Complete(grpc::ServerContext*, const eldr::v1::CompleteRequest* request,
                        eldr::v1::CompleteResponse* response) override {
    absl::MutexLock lock(&mu_);
    if (leases_.erase(request->lease_id()) == 0) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown lease");
    ++completes_;
    response->set_worker_id("d0");
    return grpc::Status::OK;
  }

 private:
  mutable absl::Mutex mu_;
  std::string address_ ABSL_GUARDED_BY(mu_);
  int routes_ ABSL_GUARDED_BY(mu_) = 0;
  int completes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_lease_ ABSL_GUARDED_BY(mu_) = 1;
  std::set<uint64_t> leases_ ABSL_GUARDED_BY(mu_);
};

TEST(ProxyIntegration, ARouterWithoutRouteStreamIsCalledUnary) {
  RouterWithoutRouteStream old_router;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&old_router);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  StackOptions options;
  options.router = false;
  options.decode = 1;
  options.proxy_args = {absl::StrCat("--router=127.0.0.1:", port)};
  Stack stack(options);
  ASSERT_NO_FATAL_FAILURE(stack.Start());
  old_router.set_address(absl::StrCat("127.0.0.1:", stack.decode_port(0)));
  auto client = NewClient();
  for (int trace = 0; trace < 4; ++trace) {
    ASSERT_NO_FATAL_FAILURE(ExpectStreamedTokens(*client, stack, trace, /*max_tokens=*/3));
  }
  EXPECT_EQ(old_router.routes(), 4);
  EXPECT_TRUE(eldr::testing::PollUntil([&] { return old_router.completes() == 4; }, absl::Seconds(10)));
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_calls_total{code=\"OK\",method=\"route\"}"), 4);
  // The proxy counts a Complete when its answer is back, a moment after the router counted it.
  EXPECT_TRUE(ProxyCountsOkCalls(stack, "complete", 4));
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_static_routes_total"), 0);
  // One stream was tried; its message went again unary, and so did every later one.
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_stream_opens_total"), 1);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_streams_open"), 0);
  EXPECT_EQ(stack.ProxyMetric("eldr_proxy_router_unary_fallbacks_total{reason=\"unimplemented\"}"), 8);
  stack.proxy().Signal(SIGTERM);
  EXPECT_EQ(stack.proxy().Wait(absl::Seconds(10)).value_or(-1), 0) << stack.Logs();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

}  // namespace
}  // namespace eldr::proxy
