// Tests of HttpClient (include/eldr/http/http_client.h) against real servers on loopback: the
// project's HttpServer for ordinary exchanges, and raw-socket servers written here for what a
// well-behaved server never does (slow chunked bodies, closing before the head or mid-body,
// stalling, oversized heads and bodies, closing pooled connections). Streaming is checked by
// handshakes (the server sends the next piece only once the client has seen the previous one),
// never by sleeping; deadlines are short (a few hundred milliseconds), and only their lower bounds
// (a timer never fires early) and generous upper bounds are asserted.
#include "eldr/http/http_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "eldr/http/http_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/process.h"
#include "testing/raw_http_client.h"
#include "testing/raw_http_server.h"

namespace eldr::http {
namespace {

using ::eldr::testing::RawHttpServer;
using ::eldr::testing::RawRequestReader;
using ::eldr::testing::SendAll;
using ::eldr::testing::WaitForPeerClose;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr absl::Duration kWait = absl::Seconds(10);  // the most any test waits for anything

// ---- Raw sockets -------------------------------------------------------------------------------------

// eldr_testing's RawHttpServer, failing the test when it cannot listen.
class RawServer : public RawHttpServer {
 public:
  explicit RawServer(Handler handler, int backlog = 512, bool accept_connections = true)
      : RawHttpServer(std::move(handler), backlog, accept_connections) {
    if (port() == 0) ADD_FAILURE() << error();
  }
};

// A RawServer handler that answers the first request of each connection with `response`, then
// waits for the client to close the connection (or, without `wait_for_close`, closes it at once).
RawServer::Handler AnswerFirstRequest(std::string response, bool wait_for_close = true) {
  return [response = std::move(response), wait_for_close](int fd, int) {
    RawRequestReader reader(fd);
    if (reader.Next()) SendAll(fd, response);
    if (wait_for_close) WaitForPeerClose(fd, kWait);
  };
}

// A RawServer handler that answers every request of a connection with `response` (keep-alive).
RawServer::Handler AnswerEveryRequest(std::string response) {
  return [response = std::move(response)](int fd, int) {
    RawRequestReader reader(fd);
    while (reader.Next()) SendAll(fd, response);
  };
}

std::string Chunk(absl::string_view data) { return absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n"); }

// ---- Recording a call ----------------------------------------------------------------------------------

// What the callbacks of one call saw, in order, with checks that they never overlapped and all ran
// on one thread.
struct Recording {
  absl::Mutex mu;
  std::optional<ClientResponseHead> head ABSL_GUARDED_BY(mu);
  std::vector<std::string> pieces ABSL_GUARDED_BY(mu);
  std::string body ABSL_GUARDED_BY(mu);
  std::optional<ClientResult> result ABSL_GUARDED_BY(mu);
  std::vector<std::string> events ABSL_GUARDED_BY(mu);  // "head", "body", "done"
  std::vector<std::string> violations ABSL_GUARDED_BY(mu);
  std::optional<std::thread::id> thread ABSL_GUARDED_BY(mu);
  std::atomic<bool> inside{false};

  void Enter(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (inside.exchange(true)) violations.push_back(absl::StrCat("overlapping callback: ", what));
    if (thread && *thread != std::this_thread::get_id()) violations.push_back("callbacks on different threads");
    thread = std::this_thread::get_id();
    if (result) violations.push_back(absl::StrCat(what, " after on_done"));
    events.push_back(what);
  }
  void Leave() { inside.store(false); }

  bool WaitForBodyBytes(size_t bytes, absl::Duration timeout = kWait) {
    absl::MutexLock lock(&mu);
    target_bytes = bytes;
    mu.AwaitWithTimeout(absl::Condition(&Recording::HasBodyBytesOrEnded, this), timeout);
    return body.size() >= bytes;
  }
  ClientResult WaitDone(absl::Duration timeout = kWait) {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(absl::Condition(&Recording::Ended, this), timeout);
    if (!result) {
      ClientResult missing;
      missing.status = absl::UnknownError("the call did not end in time");
      return missing;
    }
    return *result;
  }
  static bool HasBodyBytesOrEnded(Recording* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) {
    return r->body.size() >= r->target_bytes || r->result.has_value();
  }
  static bool Ended(Recording* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) { return r->result.has_value(); }
  std::string Body() {
    absl::MutexLock lock(&mu);
    return body;
  }
  std::vector<std::string> Pieces() {
    absl::MutexLock lock(&mu);
    return pieces;
  }
  std::optional<ClientResponseHead> Head() {
    absl::MutexLock lock(&mu);
    return head;
  }
  std::vector<std::string> Violations() {
    absl::MutexLock lock(&mu);
    return violations;
  }

  size_t target_bytes ABSL_GUARDED_BY(mu) = 0;
  // Runs in on_body after the piece is recorded (e.g. to cancel from inside a callback).
  std::function<void()> after_piece;
};

ClientCallbacks Record(const std::shared_ptr<Recording>& recording) {
  ClientCallbacks callbacks;
  callbacks.on_head = [recording](const ClientResponseHead& head) {
    absl::MutexLock lock(&recording->mu);
    recording->Enter("head");
    recording->head = head;
    recording->Leave();
  };
  callbacks.on_body = [recording](absl::string_view piece) {
    {
      absl::MutexLock lock(&recording->mu);
      recording->Enter("body");
      if (piece.empty()) recording->violations.push_back("empty piece");
      if (!recording->head) recording->violations.push_back("body before head");
      recording->pieces.emplace_back(piece);
      recording->body.append(piece.data(), piece.size());
    }
    if (recording->after_piece) recording->after_piece();
    recording->Leave();
  };
  callbacks.on_done = [recording](const ClientResult& result) {
    absl::MutexLock lock(&recording->mu);
    recording->Enter("done");
    recording->result = result;
    recording->Leave();
  };
  return callbacks;
}

ClientRequest Get(int port, std::string target = "/") {
  ClientRequest request;
  request.host = "127.0.0.1";
  request.port = port;
  request.target = std::move(target);
  return request;
}

std::unique_ptr<HttpClient> MakeClient(HttpClientOptions options = {}) {
  absl::StatusOr<std::unique_ptr<HttpClient>> client = HttpClient::Create(std::move(options));
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// Starts `request` and waits for its end.
std::shared_ptr<Recording> RunCall(HttpClient& client, ClientRequest request) {
  auto recording = std::make_shared<Recording>();
  client.Start(std::move(request), Record(recording));
  recording->WaitDone();
  return recording;
}

// ---- The project's HttpServer ---------------------------------------------------------------------

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer("127.0.0.1:0"); }

  void StartServer(const std::string& listen) {
    HttpRouter router;
    router.Handle("/hello", {"GET"}, [](const HttpRequest&) {
      HttpResponse response;
      response.body = "hello world";
      response.headers = {{"X-Test", "yes"}};
      return response;
    });
    router.Handle("/echo", {"POST", "PUT"}, [](const HttpRequest& request) {
      HttpResponse response;
      response.content_type = "application/octet-stream";
      response.body = absl::StrCat(request.method, " ", request.Header("x-token").value_or("-"), " ",
                                   request.Header("content-length").value_or("none"), " ", request.body);
      return response;
    });
    router.Handle("/big", {"GET"}, [](const HttpRequest&) {
      HttpResponse response;
      response.body.resize(3 << 20);
      for (size_t i = 0; i < response.body.size(); ++i) response.body[i] = static_cast<char>('a' + i % 26);
      return response;
    });
    HttpServerOptions options;
    options.listen = listen;
    options.threads = 2;
    options.max_connections = 4000;
    options.max_body_bytes = 1 << 20;
    absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Create(options, std::move(router));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_TRUE(server_->Start().ok());
  }

  std::unique_ptr<HttpServer> server_;
};

TEST(HttpClientOptionsTest, Validation) {
  EXPECT_TRUE(ValidateHttpClientOptions({}).ok());
  const auto invalid = [](auto mutate, absl::string_view field) {
    HttpClientOptions options;
    mutate(options);
    const absl::Status status = ValidateHttpClientOptions(options);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(status.message(), HasSubstr(field));
    EXPECT_EQ(HttpClient::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  };
  invalid([](HttpClientOptions& o) { o.threads = 0; }, "HttpClientOptions.threads");
  invalid([](HttpClientOptions& o) { o.threads = 257; }, "HttpClientOptions.threads");
  invalid([](HttpClientOptions& o) { o.max_idle_per_origin = -1; }, "HttpClientOptions.max_idle_per_origin");
  invalid([](HttpClientOptions& o) { o.max_idle_per_origin = 100001; }, "HttpClientOptions.max_idle_per_origin");
  invalid([](HttpClientOptions& o) { o.idle_connection_timeout = absl::ZeroDuration(); },
          "HttpClientOptions.idle_connection_timeout");
  invalid([](HttpClientOptions& o) { o.max_response_header_bytes = 63; },
          "HttpClientOptions.max_response_header_bytes");
  invalid([](HttpClientOptions& o) { o.max_response_header_bytes = (1 << 20) + 1; },
          "HttpClientOptions.max_response_header_bytes");
  invalid([](HttpClientOptions& o) { o.max_response_body_bytes = (uint64_t{64} << 30) + 1; },
          "HttpClientOptions.max_response_body_bytes");
}

TEST_F(ServerTest, GetDeliversHeadAndBody) {
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<Recording> call = RunCall(*client, Get(server_->port(), "/hello"));
  const ClientResult result = call->WaitDone();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_TRUE(result.head_received);
  EXPECT_FALSE(result.connection_reused);
  EXPECT_EQ(result.body_bytes, 11u);
  EXPECT_EQ(call->Body(), "hello world");
  const std::optional<ClientResponseHead> head = call->Head();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->version, 11);
  EXPECT_EQ(head->Header("x-TEST"), "yes");
  EXPECT_EQ(head->Header("content-length"), "11");
  EXPECT_EQ(head->Header("absent"), std::nullopt);
  EXPECT_THAT(call->Violations(), ::testing::IsEmpty());
  absl::MutexLock lock(&call->mu);
  EXPECT_EQ(call->events.front(), "head");
  EXPECT_EQ(call->events.back(), "done");
}

TEST_F(ServerTest, PostSendsBodyAndHeaders) {
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get(server_->port(), "/echo");
  request.method = "POST";
  request.body = "payload bytes";
  // The client's own fields are dropped from the caller's list.
  request.headers = {{"X-Token", "  abc  "}, {"Content-Length", "999"}, {"Host", "evil"}, {"Connection", "close"}};
  absl::StatusOr<FetchedResponse> response = FetchAndWait(*client, request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->head.status, 200);
  EXPECT_EQ(response->body, "POST abc 13 payload bytes");
  // An empty POST still announces its length.
  request.body.clear();
  response = FetchAndWait(*client, request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->body, "POST abc 0 ");
  // The connection was kept alive despite the caller's "Connection: close".
  EXPECT_EQ(server_->stats().connections_accepted, 1u);
}

TEST_F(ServerTest, NotFoundIsAnOrdinaryResponse) {
  std::unique_ptr<HttpClient> client = MakeClient();
  absl::StatusOr<FetchedResponse> response = FetchAndWait(*client, Get(server_->port(), "/nowhere"));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->head.status, 404);
}

TEST_F(ServerTest, KeepAliveReusesOneConnection) {
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<Recording> first = RunCall(*client, Get(server_->port(), "/hello"));
  ASSERT_TRUE(first->WaitDone().status.ok());
  EXPECT_FALSE(first->WaitDone().connection_reused);
  EXPECT_EQ(client->idle_connections(), 1);
  std::shared_ptr<Recording> second = RunCall(*client, Get(server_->port(), "/hello"));
  ASSERT_TRUE(second->WaitDone().status.ok());
  EXPECT_TRUE(second->WaitDone().connection_reused);
  EXPECT_EQ(second->Body(), "hello world");
  EXPECT_EQ(server_->stats().connections_accepted, 1u);
  EXPECT_EQ(client->active_calls(), 0);
}

TEST_F(ServerTest, NoReuseWhenPoolingIsDisabled) {
  HttpClientOptions options;
  options.max_idle_per_origin = 0;
  std::unique_ptr<HttpClient> client = MakeClient(options);
  for (int i = 0; i < 3; ++i) {
    std::shared_ptr<Recording> call = RunCall(*client, Get(server_->port(), "/hello"));
    ASSERT_TRUE(call->WaitDone().status.ok());
    EXPECT_FALSE(call->WaitDone().connection_reused);
  }
  EXPECT_EQ(client->idle_connections(), 0);
  EXPECT_EQ(server_->stats().connections_accepted, 3u);
}

TEST_F(ServerTest, LargeBodyArrivesInPiecesAndCompletely) {
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<Recording> call = RunCall(*client, Get(server_->port(), "/big"));
  const ClientResult result = call->WaitDone();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(result.body_bytes, 3u << 20);
  const std::string body = call->Body();
  ASSERT_EQ(body.size(), 3u << 20);
  bool intact = true;
  for (size_t i = 0; i < body.size() && intact; ++i) intact = body[i] == static_cast<char>('a' + i % 26);
  EXPECT_TRUE(intact);
  EXPECT_GT(call->Pieces().size(), 1u);
}

TEST_F(ServerTest, FetchLimit) {
  std::unique_ptr<HttpClient> client = MakeClient();
  absl::StatusOr<FetchedResponse> response = FetchAndWait(*client, Get(server_->port(), "/big"), 1000);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInternal) << response.status();
  EXPECT_THAT(response.status().message(), HasSubstr("1000"));
  response = FetchAndWait(*client, Get(server_->port(), "/hello"), 11);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->body, "hello world");
}

TEST_F(ServerTest, FetchAndWaitOnAnIoThreadFails) {
  std::unique_ptr<HttpClient> client = MakeClient();
  absl::Notification done;
  absl::Status inner;
  Fetch(*client, Get(server_->port(), "/hello"), 1 << 20, [&](absl::StatusOr<FetchedResponse>) {
    inner = FetchAndWait(*client, Get(server_->port(), "/hello")).status();
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(inner.code(), absl::StatusCode::kFailedPrecondition) << inner;
}

TEST_F(ServerTest, HostNamesResolve) {
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get(server_->port(), "/hello");
  request.host = "localhost";
  absl::StatusOr<FetchedResponse> response = FetchAndWait(*client, request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->body, "hello world");
  // A name that does not resolve (or, where DNS hangs, whose lookup outlives connect_timeout).
  request.host = "no-such-host.invalid";
  request.connect_timeout = absl::Seconds(3);
  response = FetchAndWait(*client, request);
  if (response.status().code() == absl::StatusCode::kDeadlineExceeded) {
    EXPECT_THAT(response.status().message(), HasSubstr("connect_timeout"));
  } else {
    EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable) << response.status();
    EXPECT_THAT(response.status().message(), HasSubstr("resolving no-such-host.invalid"));
  }
}

TEST(HttpClientIpv6Test, Ipv6Literal) {
  HttpRouter router;
  router.Handle("/v6", {"GET"}, [](const HttpRequest& request) {
    HttpResponse response;
    response.body = std::string(request.Header("host").value_or(""));
    return response;
  });
  HttpServerOptions options;
  options.listen = "[::1]:0";
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Create(options, std::move(router));
  ASSERT_TRUE(server.ok());
  if (!(*server)->Start().ok()) GTEST_SKIP() << "no IPv6 loopback here";
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get((*server)->port(), "/v6");
  request.host = "::1";
  absl::StatusOr<FetchedResponse> response = FetchAndWait(*client, request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->body, absl::StrCat("[::1]:", (*server)->port()));
}

TEST_F(ServerTest, ThousandConcurrentCallsOnOneThread) {
  // Each call holds two descriptors in this process (client and server side).
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  if (limit.rlim_cur < 4096 && limit.rlim_max >= 4096) {
    limit.rlim_cur = 4096;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
  ::getrlimit(RLIMIT_NOFILE, &limit);
  if (limit.rlim_cur < 2200) GTEST_SKIP() << "RLIMIT_NOFILE too low: " << limit.rlim_cur;

  HttpClientOptions options;
  options.threads = 1;
  options.max_idle_per_origin = 2000;
  std::unique_ptr<HttpClient> client = MakeClient(options);
  constexpr int kCalls = 1000;
  struct Tally {
    absl::Mutex mu;
    int ok ABSL_GUARDED_BY(mu) = 0;
    int failed ABSL_GUARDED_BY(mu) = 0;
    std::string first_failure ABSL_GUARDED_BY(mu);
    static bool AllEnded(Tally* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu) { return t->ok + t->failed == kCalls; }
  } tally;
  for (int i = 0; i < kCalls; ++i) {
    ClientCallbacks callbacks;
    auto body = std::make_shared<std::string>();
    callbacks.on_body = [body](absl::string_view piece) { body->append(piece.data(), piece.size()); };
    callbacks.on_done = [&tally, body](const ClientResult& result) {
      absl::MutexLock lock(&tally.mu);
      if (result.status.ok() && *body == "hello world") {
        ++tally.ok;
      } else if (tally.failed++ == 0) {
        tally.first_failure = result.status.ToString();
      }
    };
    client->Start(Get(server_->port(), "/hello"), std::move(callbacks));
  }
  absl::MutexLock lock(&tally.mu);
  ASSERT_TRUE(tally.mu.AwaitWithTimeout(absl::Condition(&Tally::AllEnded, &tally), absl::Seconds(60)));
  EXPECT_EQ(tally.ok, kCalls) << tally.first_failure;
  EXPECT_EQ(client->active_calls(), 0);
  EXPECT_GT(client->idle_connections(), 0);
}

TEST_F(ServerTest, DestroyingTheClientCancelsCallsInFlight) {
  RawServer silent([](int fd, int) {
    RawRequestReader reader(fd);
    reader.Next();
    WaitForPeerClose(fd, kWait);
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  auto recording = std::make_shared<Recording>();
  client->Start(Get(silent.port()), Record(recording));
  // Wait until the request is being served (the call is past connect).
  while (silent.accepted() == 0) absl::SleepFor(absl::Milliseconds(5));
  client.reset();
  absl::MutexLock lock(&recording->mu);
  ASSERT_TRUE(recording->result.has_value());  // on_done ran before the destructor returned
  EXPECT_EQ(recording->result->status.code(), absl::StatusCode::kCancelled) << recording->result->status;
}

// ---- Invalid requests ----------------------------------------------------------------------------------

TEST(HttpClientTest, InvalidRequestsEndInvalidArgument) {
  std::unique_ptr<HttpClient> client = MakeClient();
  const auto expect_invalid = [&](ClientRequest request, absl::string_view what) {
    std::shared_ptr<Recording> call = RunCall(*client, std::move(request));
    const ClientResult result = call->WaitDone();
    EXPECT_EQ(result.status.code(), absl::StatusCode::kInvalidArgument) << what << ": " << result.status;
    EXPECT_THAT(result.status.message(), HasSubstr(what));
    EXPECT_FALSE(result.head_received);
  };
  ClientRequest request = Get(80);
  request.headers = {{"X-Bad", "a\r\nInjected: yes"}};
  expect_invalid(request, "X-Bad");
  request = Get(80);
  request.headers = {{"X-Nul", std::string("a\0b", 3)}};
  expect_invalid(request, "X-Nul");
  request = Get(80);
  request.headers = {{"Bad Name", "v"}};
  expect_invalid(request, "field name");
  request = Get(80);
  request.method = "GE T";
  expect_invalid(request, "method");
  request = Get(0);
  expect_invalid(request, "port");
  request = Get(65536);
  expect_invalid(request, "port");
  request = Get(80, "http://example.com/");
  expect_invalid(request, "target");
  request = Get(80, "/a#b");
  expect_invalid(request, "target");
  request = Get(80);
  request.host = "";
  expect_invalid(request, "host");
  request.host = "[::1]";
  expect_invalid(request, "host");
  request.host = "a b";
  expect_invalid(request, "host");
  request = Get(80);
  request.first_byte_timeout = absl::ZeroDuration();
  expect_invalid(request, "first_byte_timeout");
  request = Get(80);
  request.connect_timeout = -absl::Seconds(1);
  expect_invalid(request, "connect_timeout");
}

// ---- Raw servers ----------------------------------------------------------------------------------------

TEST(HttpClientTest, ChunkedPiecesArriveBeforeTheEnd) {
  std::shared_ptr<Recording> recording = std::make_shared<Recording>();
  const std::vector<std::string> pieces = {"data: one\n\n", "data: two\n\n", "data: three\n\n"};
  std::atomic<bool> server_ok{true};
  RawServer server([&](int fd, int) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n");
    size_t sent = 0;
    for (const std::string& piece : pieces) {
      SendAll(fd, Chunk(piece));
      sent += piece.size();
      // The next piece goes only once the client has delivered this one: streaming, not buffering.
      if (!recording->WaitForBodyBytes(sent)) server_ok = false;
    }
    SendAll(fd, "0\r\n\r\n");
    WaitForPeerClose(fd, kWait);
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  client->Start(Get(server.port()), Record(recording));
  const ClientResult result = recording->WaitDone();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_TRUE(server_ok);
  EXPECT_THAT(recording->Pieces(), ElementsAre(pieces[0], pieces[1], pieces[2]));
  EXPECT_EQ(result.body_bytes, pieces[0].size() + pieces[1].size() + pieces[2].size());
  EXPECT_THAT(recording->Violations(), ::testing::IsEmpty());
  // A chunked keep-alive response leaves its connection in the pool.
  EXPECT_EQ(client->idle_connections(), 1);
}

TEST(HttpClientTest, ContentLengthBodyInPieces) {
  std::shared_ptr<Recording> recording = std::make_shared<Recording>();
  std::atomic<bool> server_ok{true};
  RawServer server([&](int fd, int) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234");
    if (!recording->WaitForBodyBytes(5)) server_ok = false;
    SendAll(fd, "56789");
    WaitForPeerClose(fd, kWait);
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  client->Start(Get(server.port()), Record(recording));
  const ClientResult result = recording->WaitDone();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_TRUE(server_ok);
  EXPECT_THAT(recording->Pieces(), ElementsAre("01234", "56789"));
}

TEST(HttpClientTest, BodyUntilCloseIsComplete) {
  std::shared_ptr<Recording> recording = std::make_shared<Recording>();
  RawServer server([&](int fd, int) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nfirst ");
    recording->WaitForBodyBytes(6);
    SendAll(fd, "second");
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  client->Start(Get(server.port()), Record(recording));
  const ClientResult result = recording->WaitDone();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(recording->Body(), "first second");
  EXPECT_EQ(client->idle_connections(), 0);
}

TEST(HttpClientTest, Http10ResponseIsNotReused) {
  RawServer server(AnswerEveryRequest("HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"));
  std::unique_ptr<HttpClient> client = MakeClient();
  for (int i = 0; i < 2; ++i) {
    std::shared_ptr<Recording> call = RunCall(*client, Get(server.port()));
    ASSERT_TRUE(call->WaitDone().status.ok()) << call->WaitDone().status;
    EXPECT_EQ(call->Head()->version, 10);
    EXPECT_FALSE(call->WaitDone().connection_reused);
  }
  EXPECT_EQ(server.accepted(), 2);
}

TEST(HttpClientTest, InterimResponsesAreSkipped) {
  RawServer server([](int fd, int) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd,
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
            "HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone");
    WaitForPeerClose(fd, kWait);
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<Recording> call = RunCall(*client, Get(server.port()));
  ASSERT_TRUE(call->WaitDone().status.ok()) << call->WaitDone().status;
  EXPECT_EQ(call->Head()->status, 201);
  EXPECT_EQ(call->Body(), "done");
  absl::MutexLock lock(&call->mu);
  EXPECT_EQ(std::count(call->events.begin(), call->events.end(), "head"), 1);
}

TEST(HttpClientTest, HeadResponseHasNoBodyAndIsReused) {
  RawServer server(AnswerEveryRequest("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"));
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get(server.port());
  request.method = "HEAD";
  std::shared_ptr<Recording> first = RunCall(*client, request);
  ASSERT_TRUE(first->WaitDone().status.ok()) << first->WaitDone().status;
  EXPECT_EQ(first->WaitDone().body_bytes, 0u);
  std::shared_ptr<Recording> second = RunCall(*client, request);
  ASSERT_TRUE(second->WaitDone().status.ok()) << second->WaitDone().status;
  EXPECT_TRUE(second->WaitDone().connection_reused);
  EXPECT_EQ(server.accepted(), 1);
}

TEST(HttpClientTest, CloseBeforeHeadIsUnavailable) {
  RawServer server([](int fd, int) {
    RawRequestReader reader(fd);
    reader.Next();
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<Recording> call = RunCall(*client, Get(server.port()));
  const ClientResult result = call->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kUnavailable) << result.status;
  EXPECT_FALSE(result.head_received);
  EXPECT_FALSE(call->Head().has_value());
  // A fresh connection is never retried.
  EXPECT_EQ(server.accepted(), 1);
}

TEST(HttpClientTest, CloseMidBodyIsInternal) {
  for (const std::string& response :
       {std::string("HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten.."),
        std::string("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").append(Chunk("only ten.."))}) {
    RawServer server(AnswerFirstRequest(response, /*wait_for_close=*/false));
    std::unique_ptr<HttpClient> client = MakeClient();
    std::shared_ptr<Recording> call = RunCall(*client, Get(server.port()));
    const ClientResult result = call->WaitDone();
    EXPECT_EQ(result.status.code(), absl::StatusCode::kInternal) << result.status;
    EXPECT_THAT(result.status.message(), HasSubstr("middle of the response body"));
    EXPECT_TRUE(result.head_received);
    EXPECT_EQ(call->Body(), "only ten..");
  }
}

TEST(HttpClientTest, MalformedResponseIsInternal) {
  RawServer server(AnswerFirstRequest("SMTP ready\r\n\r\n"));
  std::unique_ptr<HttpClient> client = MakeClient();
  const ClientResult result = RunCall(*client, Get(server.port()))->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kInternal) << result.status;
  EXPECT_THAT(result.status.message(), HasSubstr("malformed response"));
  EXPECT_FALSE(result.head_received);
}

TEST(HttpClientTest, FirstByteTimeout) {
  RawServer server([](int fd, int) {
    RawRequestReader reader(fd);
    reader.Next();
    WaitForPeerClose(fd, kWait);
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get(server.port());
  request.first_byte_timeout = absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  const ClientResult result = RunCall(*client, request)->WaitDone();
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(result.status.code(), absl::StatusCode::kDeadlineExceeded) << result.status;
  EXPECT_THAT(result.status.message(), HasSubstr("first_byte_timeout"));
  EXPECT_FALSE(result.head_received);
  EXPECT_GE(elapsed, absl::Milliseconds(200));
  EXPECT_LT(elapsed, absl::Seconds(5));
}

TEST(HttpClientTest, IdleTimeoutMidBody) {
  RawServer server(AnswerFirstRequest("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + Chunk("first")));
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get(server.port());
  request.idle_timeout = absl::Milliseconds(200);
  std::shared_ptr<Recording> call = RunCall(*client, request);
  const ClientResult result = call->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kDeadlineExceeded) << result.status;
  EXPECT_THAT(result.status.message(), HasSubstr("idle_timeout"));
  EXPECT_TRUE(result.head_received);
  EXPECT_EQ(call->Body(), "first");
}

TEST(HttpClientTest, IdleTimeoutIsBetweenPiecesNotTotal) {
  // Pieces every 50 ms for 600 ms: a 300 ms idle timeout never passes although the body takes longer.
  RawServer server([](int fd, int) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 12; ++i) {
      if (!SendAll(fd, Chunk("x"))) return;
      absl::SleepFor(absl::Milliseconds(50));
    }
    SendAll(fd, "0\r\n\r\n");
    WaitForPeerClose(fd, kWait);
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get(server.port());
  request.idle_timeout = absl::Milliseconds(300);
  std::shared_ptr<Recording> call = RunCall(*client, request);
  const ClientResult result = call->WaitDone();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(call->Body(), std::string(12, 'x'));
}

TEST(HttpClientTest, TotalTimeout) {
  RawServer server([](int fd, int) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
    for (int i = 0; i < 200; ++i) {
      if (!SendAll(fd, Chunk("x"))) return;
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get(server.port());
  request.total_timeout = absl::Milliseconds(300);
  request.idle_timeout = absl::Seconds(5);
  const absl::Time start = absl::Now();
  const ClientResult result = RunCall(*client, request)->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kDeadlineExceeded) << result.status;
  EXPECT_THAT(result.status.message(), HasSubstr("total_timeout"));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
}

TEST(HttpClientTest, ConnectTimeout) {
  // A listener whose accept queue is full and never drained: the kernel drops further SYNs, so a
  // connect hangs.
  RawServer server([](int, int) {}, /*backlog=*/0, /*accept_connections=*/false);
  std::vector<int> fillers;
  for (int i = 0; i < 8; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    address.sin_port = htons(static_cast<uint16_t>(server.port()));
    ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    fillers.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(100));  // let the handshakes that fit complete
  std::unique_ptr<HttpClient> client = MakeClient();
  ClientRequest request = Get(server.port());
  request.connect_timeout = absl::Milliseconds(300);
  const ClientResult result = RunCall(*client, request)->WaitDone();
  for (int fd : fillers) ::close(fd);
  EXPECT_EQ(result.status.code(), absl::StatusCode::kDeadlineExceeded) << result.status;
  EXPECT_THAT(result.status.message(), HasSubstr("connect_timeout"));
}

TEST(HttpClientTest, RefusedPortIsUnavailable) {
  absl::StatusOr<eldr::testing::ReservedLoopbackPort> dead = eldr::testing::ReservedLoopbackPort::Create();
  ASSERT_TRUE(dead.ok()) << dead.status();
  const int port = dead->port();
  std::unique_ptr<HttpClient> client = MakeClient();
  const ClientResult result = RunCall(*client, Get(port))->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kUnavailable) << result.status;
  EXPECT_THAT(result.status.message(), HasSubstr("connecting to 127.0.0.1:"));
  EXPECT_FALSE(result.head_received);
}

TEST(HttpClientTest, OversizedHeadIsInternal) {
  RawServer server(AnswerFirstRequest(
      absl::StrCat("HTTP/1.1 200 OK\r\nX-Big: ", std::string(4000, 'h'), "\r\nContent-Length: 0\r\n\r\n")));
  HttpClientOptions options;
  options.max_response_header_bytes = 1024;
  std::unique_ptr<HttpClient> client = MakeClient(options);
  const ClientResult result = RunCall(*client, Get(server.port()))->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kInternal) << result.status;
  EXPECT_THAT(result.status.message(), HasSubstr("max_response_header_bytes"));
  EXPECT_FALSE(result.head_received);
}

TEST(HttpClientTest, FieldTooLongForBeastIsInternal) {
  // Within a 1 MiB head limit, but one field longer than Beast can store (64 KiB).
  RawServer server(AnswerFirstRequest(
      absl::StrCat("HTTP/1.1 200 OK\r\nX-Huge: ", std::string(70000, 'h'), "\r\nContent-Length: 0\r\n\r\n")));
  HttpClientOptions options;
  options.max_response_header_bytes = 1 << 20;
  std::unique_ptr<HttpClient> client = MakeClient(options);
  const ClientResult result = RunCall(*client, Get(server.port()))->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kInternal) << result.status;
  // The client still works.
  RawServer fine(AnswerFirstRequest("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"));
  EXPECT_TRUE(RunCall(*client, Get(fine.port()))->WaitDone().status.ok());
}

TEST(HttpClientTest, OversizedBodyIsInternal) {
  for (const std::string& response :
       {std::string("HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n") + std::string(1000, 'b'),
        std::string("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n") + Chunk(std::string(60, 'b')) +
            Chunk(std::string(60, 'b')) + "0\r\n\r\n",
        std::string("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n") + std::string(1000, 'b')}) {
    RawServer server(AnswerFirstRequest(response));
    HttpClientOptions options;
    options.max_response_body_bytes = 100;
    std::unique_ptr<HttpClient> client = MakeClient(options);
    std::shared_ptr<Recording> call = RunCall(*client, Get(server.port()));
    const ClientResult result = call->WaitDone();
    EXPECT_EQ(result.status.code(), absl::StatusCode::kInternal) << result.status;
    EXPECT_THAT(result.status.message(), HasSubstr("max_response_body_bytes"));
    EXPECT_LE(call->Body().size(), 100u);
  }
}

TEST(HttpClientTest, CancelMidBodyClosesTheConnection) {
  std::shared_ptr<Recording> recording = std::make_shared<Recording>();
  absl::Notification server_saw_close;
  RawServer server([&](int fd, int) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + Chunk("first"));
    if (WaitForPeerClose(fd, kWait)) server_saw_close.Notify();
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<ClientCall> call = client->Start(Get(server.port()), Record(recording));
  ASSERT_TRUE(recording->WaitForBodyBytes(5));
  call->Cancel();
  call->Cancel();  // idempotent
  const ClientResult result = recording->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kCancelled) << result.status;
  EXPECT_TRUE(result.head_received);
  EXPECT_TRUE(server_saw_close.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(client->idle_connections(), 0);
  call->Cancel();  // after the end: nothing happens
  EXPECT_THAT(recording->Violations(), ::testing::IsEmpty());
}

TEST(HttpClientTest, CancelFromInsideACallbackStopsThePieces) {
  std::shared_ptr<Recording> recording = std::make_shared<Recording>();
  RawServer server([](int fd, int) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    // Several chunks in one write: all of them reach the client in one read.
    SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n" + std::string(10, 'a'));
    absl::SleepFor(absl::Milliseconds(50));
    SendAll(fd, std::string(10, 'b'));
    WaitForPeerClose(fd, kWait);
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<ClientCall> call;
  absl::Mutex call_mu;
  recording->after_piece = [&] {
    absl::MutexLock lock(&call_mu);
    if (call) call->Cancel();
  };
  {
    absl::MutexLock lock(&call_mu);
    call = client->Start(Get(server.port()), Record(recording));
  }
  const ClientResult result = recording->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kCancelled) << result.status;
  EXPECT_EQ(recording->Pieces().size(), 1u);
  absl::MutexLock lock(&call_mu);
  call.reset();
}

TEST(HttpClientTest, CancelBeforeConnectEnds) {
  std::unique_ptr<HttpClient> client = MakeClient();
  RawServer server([](int fd, int) { WaitForPeerClose(fd, kWait); });
  for (int i = 0; i < 20; ++i) {
    auto recording = std::make_shared<Recording>();
    std::shared_ptr<ClientCall> call = client->Start(Get(server.port()), Record(recording));
    call->Cancel();
    EXPECT_EQ(recording->WaitDone().status.code(), absl::StatusCode::kCancelled);
  }
  EXPECT_EQ(client->active_calls(), 0);
}

TEST(HttpClientTest, KeepAliveReuseOnRawServer) {
  RawServer server([](int fd, int) {
    RawRequestReader reader(fd);
    int served = 0;
    while (reader.Next()) SendAll(fd, absl::StrCat("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n", ++served));
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<Recording> first = RunCall(*client, Get(server.port()));
  std::shared_ptr<Recording> second = RunCall(*client, Get(server.port()));
  ASSERT_TRUE(second->WaitDone().status.ok()) << second->WaitDone().status;
  EXPECT_FALSE(first->WaitDone().connection_reused);
  EXPECT_TRUE(second->WaitDone().connection_reused);
  EXPECT_EQ(first->Body(), "1");
  EXPECT_EQ(second->Body(), "2");
  EXPECT_EQ(server.accepted(), 1);
}

TEST(HttpClientTest, PooledConnectionClosedWhileIdleIsNotUsed) {
  absl::Notification first_closed;
  RawServer server([&](int fd, int index) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
    if (index == 0) {
      // Closes the kept-alive connection while the client holds it idle.
      ::shutdown(fd, SHUT_RDWR);
      first_closed.Notify();
      return;
    }
    reader.Next(absl::Seconds(1));
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  ASSERT_TRUE(RunCall(*client, Get(server.port()))->WaitDone().status.ok());
  ASSERT_TRUE(first_closed.WaitForNotificationWithTimeout(kWait));
  const ClientResult result = RunCall(*client, Get(server.port()))->WaitDone();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(server.accepted(), 2);
}

TEST(HttpClientTest, StaleConnectionIsRetriedTransparently) {
  // The first connection answers one request, then reads the second one and closes without a byte
  // of answer (as a server whose keep-alive timer fired just then): the client retries once on a
  // new connection.
  RawServer server([](int fd, int index) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, absl::StrCat("HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n", index));
    if (index == 0) {
      reader.Next();
      return;
    }
    reader.Next(absl::Seconds(1));
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  std::shared_ptr<Recording> first = RunCall(*client, Get(server.port()));
  ASSERT_TRUE(first->WaitDone().status.ok());
  std::shared_ptr<Recording> second = RunCall(*client, Get(server.port()));
  const ClientResult result = second->WaitDone();
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(second->Body(), "1");  // served by the second connection
  EXPECT_FALSE(result.connection_reused);
  EXPECT_EQ(server.accepted(), 2);
  absl::MutexLock lock(&second->mu);
  EXPECT_THAT(second->events, ElementsAre("head", "body", "done"));  // the failed attempt showed nothing
}

TEST(HttpClientTest, NoRetryOnceResponseBytesArrived) {
  // A reused connection that fails after part of the head arrived is not retried (the server saw
  // the request).
  RawServer server([](int fd, int index) {
    RawRequestReader reader(fd);
    if (!reader.Next()) return;
    SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx");
    if (index == 0 && reader.Next()) SendAll(fd, "HTTP/1.1 200 O");
  });
  std::unique_ptr<HttpClient> client = MakeClient();
  ASSERT_TRUE(RunCall(*client, Get(server.port()))->WaitDone().status.ok());
  const ClientResult result = RunCall(*client, Get(server.port()))->WaitDone();
  EXPECT_EQ(result.status.code(), absl::StatusCode::kUnavailable) << result.status;
  EXPECT_TRUE(result.connection_reused);
  EXPECT_EQ(server.accepted(), 1);
}

TEST(HttpClientTest, IdleConnectionTimeoutClosesPooledConnections) {
  absl::Notification closed;
  RawServer server([&](int fd, int) {
    RawRequestReader reader(fd);
    if (reader.Next()) SendAll(fd, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
    if (WaitForPeerClose(fd, kWait)) closed.Notify();
  });
  HttpClientOptions options;
  options.idle_connection_timeout = absl::Milliseconds(100);
  std::unique_ptr<HttpClient> client = MakeClient(options);
  ASSERT_TRUE(RunCall(*client, Get(server.port()))->WaitDone().status.ok());
  EXPECT_TRUE(closed.WaitForNotificationWithTimeout(kWait));
  const absl::Time deadline = absl::Now() + kWait;
  while (client->idle_connections() != 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(client->idle_connections(), 0);
}

TEST(HttpClientTest, IdleLimitPerOrigin) {
  RawServer server(AnswerEveryRequest("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"));
  HttpClientOptions options;
  options.max_idle_per_origin = 2;
  options.threads = 2;
  std::unique_ptr<HttpClient> client = MakeClient(options);
  // Five calls at once need five connections; only two stay pooled afterwards.
  std::vector<std::shared_ptr<Recording>> calls;
  for (int i = 0; i < 5; ++i) {
    calls.push_back(std::make_shared<Recording>());
    client->Start(Get(server.port()), Record(calls.back()));
  }
  for (auto& call : calls) ASSERT_TRUE(call->WaitDone().status.ok());
  EXPECT_LE(client->idle_connections(), 2);
  EXPECT_GE(client->idle_connections(), 1);
  // Later calls find the pooled connections on whichever thread holds them.
  const int accepted = server.accepted();
  for (int i = 0; i < 4; ++i) {
    const ClientResult result = RunCall(*client, Get(server.port()))->WaitDone();
    ASSERT_TRUE(result.status.ok());
    EXPECT_TRUE(result.connection_reused);
  }
  EXPECT_EQ(server.accepted(), accepted);
}

}  // namespace
}  // namespace eldr::http
