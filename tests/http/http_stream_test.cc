// Tests of streamed responses (ResponseStream, HttpRouter::HandleStreaming): routing, and a real
// HttpServer on 127.0.0.1 driven by raw POSIX sockets, which see the exact wire bytes (chunk
// framing, when the head and each piece arrive, when the connection closes), and by libcurl for
// many concurrent streams. The handlers hand their streams to the test thread, which drives them
// from outside the server's io threads, as a proxy's upstream callbacks do.
#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "eldr/http/http_server.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/raw_http_client.h"

namespace eldr::http {
namespace {

using ::eldr::testing::RawHttpClient;
using ::eldr::testing::RawHttpHead;
using ::eldr::testing::RawHttpResponse;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

const bool curl_initialised = [] {
  curl_global_init(CURL_GLOBAL_DEFAULT);
  return true;
}();

// Generous: only a broken server waits this long.
constexpr absl::Duration kWait = absl::Seconds(5);

// ---- Handing streams to the test -------------------------------------------------------------------

// What the streaming handlers received, in order; the test takes them out and drives them.
class StreamInbox {
 public:
  void Put(HttpRequest request, std::shared_ptr<ResponseStream> stream) {
    absl::MutexLock lock(&mu_);
    entries_.push_back({std::move(request), std::move(stream)});
  }

  // The next stream a handler received, waiting up to kWait; nullptr when none came.
  std::shared_ptr<ResponseStream> Take(HttpRequest* request = nullptr) {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(this, &StreamInbox::HasEntries), kWait)) return nullptr;
    Entry entry = std::move(entries_.front());
    entries_.erase(entries_.begin());
    if (request != nullptr) *request = std::move(entry.request);
    return std::move(entry.stream);
  }

 private:
  struct Entry {
    HttpRequest request;
    std::shared_ptr<ResponseStream> stream;
  };
  bool HasEntries() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !entries_.empty(); }

  absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// Events reported by callbacks (on the server's threads), awaited by the test.
class EventLog {
 public:
  void Add(std::string event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(event));
    threads_.push_back(std::this_thread::get_id());
  }

  // Waits (up to kWait) until at least `count` events arrived; returns them all.
  std::vector<std::string> WaitForCount(size_t count) {
    absl::MutexLock lock(&mu_);
    const auto enough = [this, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return events_.size() >= count; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), kWait);
    return events_;
  }

  std::vector<std::string> events() const {
    absl::MutexLock lock(&mu_);
    return events_;
  }

  std::vector<std::thread::id> threads() const {
    absl::MutexLock lock(&mu_);
    return threads_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread::id> threads_ ABSL_GUARDED_BY(mu_);
};

std::function<void(bool)> Record(EventLog& log, std::string name) {
  return [&log, name = std::move(name)](bool written) { log.Add(absl::StrCat(name, written ? ":true" : ":false")); };
}

// Waits (up to kWait) for `condition`.
bool Eventually(const std::function<bool()>& condition) {
  const absl::Time deadline = absl::Now() + kWait;
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return condition();
}

HttpResponse Text(int status, std::string body) {
  HttpResponse response;
  response.status = status;
  response.body = std::move(body);
  return response;
}

// /stream (GET, POST): hands the stream to `inbox`; /healthz (GET): "ok\n".
HttpRouter StreamRouter(StreamInbox& inbox) {
  HttpRouter router;
  router.HandleStreaming("/stream", {"GET", "POST"},
                         [&inbox](HttpRequest request, std::shared_ptr<ResponseStream> stream) {
                           inbox.Put(std::move(request), std::move(stream));
                         });
  router.Handle("/healthz", {"GET"}, [](const HttpRequest&) { return Text(200, "ok\n"); });
  return router;
}

HttpServerOptions TestOptions() {
  HttpServerOptions options;
  options.request_timeout = absl::Seconds(5);
  options.idle_timeout = absl::Seconds(10);
  options.write_timeout = absl::Seconds(5);
  return options;
}

std::unique_ptr<HttpServer> MustStart(HttpServerOptions options, HttpRouter router) {
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Create(std::move(options), std::move(router));
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  const absl::Status started = (*server)->Start();
  EXPECT_TRUE(started.ok()) << started;
  if (!started.ok()) return nullptr;
  return *std::move(server);
}

constexpr absl::string_view kGetStream = "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n";
constexpr absl::string_view kHeadStream = "HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n";
constexpr absl::string_view kGetHealthz = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";

// Asserts that `client`'s connection still serves an ordinary request.
void ExpectServesHealthz(RawHttpClient& client) {
  ASSERT_TRUE(client.Send(kGetHealthz));
  const std::optional<RawHttpResponse> response = client.ReadResponse();
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->body, "ok\n");
}

HttpRequest Request(std::string method, std::string path) {
  HttpRequest request;
  request.method = std::move(method);
  request.path = std::move(path);
  request.target = request.path;
  return request;
}

// A server on StreamRouter: its handlers hand their streams to inbox_.
class HttpStreamTest : public ::testing::Test {
 protected:
  // Starts server_ (it ASSERTs: call it in ASSERT_NO_FATAL_FAILURE).
  void StartServer(HttpServerOptions options = TestOptions()) {
    server_ = MustStart(std::move(options), StreamRouter(inbox_));
    ASSERT_NE(server_, nullptr);
  }

  // Sends `request` on `client` and takes the stream its handler received (and the request, into
  // `received`); nullptr when the send fails or no stream comes.
  std::shared_ptr<ResponseStream> Open(RawHttpClient& client, absl::string_view request = kGetStream,
                                       HttpRequest* received = nullptr) {
    if (!client.Send(request)) {
      ADD_FAILURE() << "cannot send " << request;
      return nullptr;
    }
    return inbox_.Take(received);
  }

  StreamInbox inbox_;
  std::unique_ptr<HttpServer> server_;
};

// ---- HttpRouter --------------------------------------------------------------------------------------

TEST(HttpRouterStreamingTest, FindsStreamingHandlersByPathAndMethod) {
  HttpRouter router;
  router.HandleStreaming("/events", {"GET"}, [](HttpRequest, std::shared_ptr<ResponseStream>) {});
  router.HandleStreaming("/v1/completions", {"POST"}, [](HttpRequest, std::shared_ptr<ResponseStream>) {});
  router.Handle("/metrics", {"GET"}, [](const HttpRequest&) { return Text(200, "m"); });

  EXPECT_NE(router.FindStreamingHandler(Request("GET", "/events")), nullptr);
  EXPECT_NE(router.FindStreamingHandler(Request("HEAD", "/events")), nullptr);  // HEAD on a GET route
  EXPECT_NE(router.FindStreamingHandler(Request("POST", "/v1/completions")), nullptr);
  EXPECT_EQ(router.FindStreamingHandler(Request("HEAD", "/v1/completions")), nullptr);
  EXPECT_EQ(router.FindStreamingHandler(Request("POST", "/events")), nullptr);
  EXPECT_EQ(router.FindStreamingHandler(Request("OPTIONS", "/events")), nullptr);
  EXPECT_EQ(router.FindStreamingHandler(Request("GET", "/metrics")), nullptr);
  EXPECT_EQ(router.FindStreamingHandler(Request("GET", "/nope")), nullptr);
  EXPECT_EQ(router.FindStreamingHandler(Request("OPTIONS", "*")), nullptr);

  // What the server does not stream, Dispatch answers as for any route.
  EXPECT_EQ(router.Dispatch(Request("GET", "/nope")).status, 404);
  const HttpResponse wrong_method = router.Dispatch(Request("PUT", "/events"));
  EXPECT_EQ(wrong_method.status, 405);
  EXPECT_THAT(wrong_method.headers,
              ElementsAre(std::make_pair(std::string("Allow"), std::string("GET, HEAD, OPTIONS"))));
  EXPECT_EQ(router.Dispatch(Request("OPTIONS", "/v1/completions")).status, 204);
  EXPECT_EQ(router.AllowHeader("/v1/completions"), "POST, OPTIONS");
  // Only the server streams: Dispatch answers a streaming route's own methods 500.
  EXPECT_EQ(router.Dispatch(Request("GET", "/events")).status, 500);
  EXPECT_EQ(router.Dispatch(Request("HEAD", "/events")).status, 500);
  EXPECT_EQ(router.Dispatch(Request("GET", "/metrics")).status, 200);
}

TEST(HttpRouterStreamingTest, RegisteringAPathAgainReplacesItsKind) {
  HttpRouter router;
  router.HandleStreaming("/x", {"GET"}, [](HttpRequest, std::shared_ptr<ResponseStream>) {});
  router.Handle("/x", {"GET"}, [](const HttpRequest&) { return Text(200, "plain"); });
  EXPECT_EQ(router.FindStreamingHandler(Request("GET", "/x")), nullptr);
  EXPECT_EQ(router.Dispatch(Request("GET", "/x")).body, "plain");
  router.HandleStreaming("/x", {"POST", "POST"}, [](HttpRequest, std::shared_ptr<ResponseStream>) {});
  EXPECT_NE(router.FindStreamingHandler(Request("POST", "/x")), nullptr);
  EXPECT_EQ(router.FindStreamingHandler(Request("GET", "/x")), nullptr);
  EXPECT_EQ(router.AllowHeader("/x"), "POST, OPTIONS");
}

// ---- The server: chunked streams ----------------------------------------------------------------------

TEST_F(HttpStreamTest, PiecesArriveOneByOneAsChunksAndTheConnectionIsKeptAlive) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  HttpRequest request;
  const std::shared_ptr<ResponseStream> stream = Open(client, kGetStream, &request);
  ASSERT_NE(stream, nullptr);
  EXPECT_EQ(request.method, "GET");
  EXPECT_EQ(request.path, "/stream");
  EXPECT_FALSE(request.peer.empty());
  EXPECT_FALSE(stream->done());

  // Nothing is sent before Begin.
  EXPECT_TRUE(client.StaysQuiet(absl::Milliseconds(50)));
  stream->Begin(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Request-Id", "r-1"}});
  const std::optional<RawHttpHead> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->version, "HTTP/1.1");
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->Header("transfer-encoding"), "chunked");
  EXPECT_EQ(head->Header("content-length"), std::nullopt);
  EXPECT_EQ(head->Header("content-type"), "text/event-stream");
  EXPECT_EQ(head->Header("cache-control"), "no-cache");
  EXPECT_EQ(head->Header("x-request-id"), "r-1");
  EXPECT_EQ(head->Header("server"), "eldr");
  EXPECT_TRUE(head->Header("date").has_value());
  EXPECT_EQ(head->Header("connection"), std::nullopt);  // HTTP/1.1 keep-alive is the default

  // Each piece is on the wire before the next is written: streamed, not buffered.
  EventLog log;
  for (int i = 0; i < 5; ++i) {
    const std::string event = absl::StrCat("data: {\"token\":", i, "}\n\n");
    stream->Write(event, Record(log, absl::StrCat("piece", i)));
    const std::optional<std::string> chunk = client.ReadChunk();
    ASSERT_TRUE(chunk.has_value()) << i;
    EXPECT_EQ(*chunk, event);
  }
  stream->Write("");  // an empty piece is no chunk (it would end the body)
  stream->Finish();
  EXPECT_TRUE(stream->done());
  const std::optional<std::string> last = client.ReadChunk();
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(*last, "");
  EXPECT_EQ(client.leftover(), "");
  EXPECT_THAT(log.WaitForCount(5),
              ElementsAre("piece0:true", "piece1:true", "piece2:true", "piece3:true", "piece4:true"));
  EXPECT_EQ(stream->queued_bytes(), 0u);

  // Calls after Finish are ignored; a late write reports false.
  stream->Write("late", Record(log, "late"));
  stream->Finish();
  stream->Abort();
  EXPECT_THAT(log.WaitForCount(6).back(), "late:false");

  // The same connection serves the next request.
  ExpectServesHealthz(client);
  EXPECT_TRUE(Eventually([&] {
    const HttpServerStats stats = server_->stats();
    return stats.requests == 2 && stats.responses_2xx == 2 && stats.open_connections == 1;
  }));
}

TEST_F(HttpStreamTest, WritesFromManyThreadsAllArriveEachInOrder) {
  HttpServerOptions options = TestOptions();
  options.threads = 2;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  RawHttpClient client(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/plain");
  constexpr int kWriters = 4;
  constexpr int kPieces = 200;
  std::atomic<int> written{0};
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < kPieces; ++i) {
        stream->Write(absl::StrCat(w, ":", i, ";"), [&written](bool ok) {
          if (ok) written.fetch_add(1);
        });
      }
    });
  }
  for (std::thread& writer : writers) writer.join();
  stream->Finish();
  ASSERT_TRUE(client.ReadHead().has_value());
  std::string body;
  for (;;) {
    const std::optional<std::string> chunk = client.ReadChunk();
    ASSERT_TRUE(chunk.has_value());
    if (chunk->empty()) break;
    body += *chunk;
  }
  std::vector<int> next(kWriters, 0);
  int pieces = 0;
  for (absl::string_view piece : absl::StrSplit(body, ';', absl::SkipEmpty())) {
    const std::vector<absl::string_view> parts = absl::StrSplit(piece, ':');
    ASSERT_EQ(parts.size(), 2u);
    int writer = 0, index = 0;
    ASSERT_TRUE(absl::SimpleAtoi(parts[0], &writer));
    ASSERT_TRUE(absl::SimpleAtoi(parts[1], &index));
    ASSERT_GE(writer, 0);
    ASSERT_LT(writer, kWriters);
    EXPECT_EQ(index, next[writer]) << "writer " << writer;  // one thread's calls keep their order
    next[writer] = index + 1;
    ++pieces;
  }
  EXPECT_EQ(pieces, kWriters * kPieces);
  EXPECT_TRUE(Eventually([&] { return written.load() == kWriters * kPieces; }));
  EXPECT_EQ(stream->queued_bytes(), 0u);
}

TEST_F(HttpStreamTest, RespondSendsAWholeResponseAndHeadGetsItsHead) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());

  HttpRequest request;
  std::shared_ptr<ResponseStream> stream =
      Open(client, "POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", &request);
  ASSERT_NE(stream, nullptr);
  EXPECT_EQ(request.body, "hello");
  HttpResponse answer = Text(201, "{\"ok\":true}");
  answer.content_type = "application/json";
  answer.headers.emplace_back("X-Answer", "42");
  stream->Respond(answer);
  EXPECT_TRUE(stream->done());
  std::optional<RawHttpResponse> response = client.ReadResponse();
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->status, 201);
  EXPECT_EQ(response->Header("content-length"), "11");
  EXPECT_EQ(response->Header("transfer-encoding"), std::nullopt);
  EXPECT_EQ(response->Header("content-type"), "application/json");
  EXPECT_EQ(response->Header("x-answer"), "42");
  EXPECT_EQ(response->body, "{\"ok\":true}");
  // Begin after Respond is ignored: nothing more arrives, and the connection goes on.
  stream->Begin(200, "text/plain");
  EXPECT_TRUE(client.StaysQuiet(absl::Milliseconds(50)));

  stream = Open(client, kHeadStream, &request);
  ASSERT_NE(stream, nullptr);
  EXPECT_EQ(request.method, "HEAD");
  stream->Respond(Text(200, "twelve bytes"));
  response = client.ReadResponse(/*head_request=*/true);
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->Header("content-length"), "12");
  ExpectServesHealthz(client);  // no body bytes were sent to HEAD
}

TEST_F(HttpStreamTest, HeadAnd204SendTheHeadOnlyAndDiscardTheWrites) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  EventLog log;

  std::shared_ptr<ResponseStream> stream = Open(client, kHeadStream);
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/event-stream");
  stream->Write("data: x\n\n", Record(log, "head-piece"));
  stream->Finish();
  std::optional<RawHttpHead> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->Header("transfer-encoding"), "chunked");  // what a GET would get
  EXPECT_EQ(log.WaitForCount(1), std::vector<std::string>{"head-piece:true"});
  EXPECT_EQ(stream->queued_bytes(), 0u);
  ExpectServesHealthz(client);  // no chunk, not even the last one, reached the wire

  stream = Open(client);
  ASSERT_NE(stream, nullptr);
  stream->Begin(204, "text/plain", {{"X-Empty", "yes"}});
  stream->Write("ignored", Record(log, "no-content-piece"));
  stream->Finish();
  head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 204);
  EXPECT_EQ(head->Header("transfer-encoding"), std::nullopt);
  EXPECT_EQ(head->Header("content-length"), std::nullopt);
  EXPECT_EQ(head->Header("content-type"), std::nullopt);
  EXPECT_EQ(head->Header("x-empty"), "yes");
  EXPECT_EQ(log.WaitForCount(2).back(), "no-content-piece:true");
  ExpectServesHealthz(client);
}

TEST_F(HttpStreamTest, Http10StreamsWithoutLengthAndCloses) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(client, "GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/plain");
  stream->Write("first ");
  const std::optional<RawHttpHead> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->version, "HTTP/1.0");
  EXPECT_EQ(head->Header("transfer-encoding"), std::nullopt);
  EXPECT_EQ(head->Header("content-length"), std::nullopt);
  EXPECT_EQ(head->Header("connection"), std::nullopt);  // no keep-alive: the body ends with the connection
  EXPECT_EQ(client.ReadBytes(6), "first ");
  stream->Write("second");
  stream->Finish();
  ASSERT_TRUE(client.WaitClosed());
  EXPECT_EQ(client.leftover(), "second");
}

TEST_F(HttpStreamTest, BeginFiltersFieldsAndFixesBadStatuses) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  stream->Begin(299, "text/plain\r\nX-Injected: 1",
                {{"Content-Length", "5"},
                 {"Transfer-Encoding", "gzip"},
                 {"Connection", "close"},
                 {"Bad Name", "x"},
                 {"X-Split", "a\r\nX-Injected: 2"},
                 {"X-Fine", "fine"}});
  stream->Finish();
  std::optional<RawHttpHead> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 299);
  EXPECT_EQ(head->Header("transfer-encoding"), "chunked");
  EXPECT_EQ(head->Header("content-length"), std::nullopt);
  EXPECT_EQ(head->Header("connection"), std::nullopt);
  EXPECT_EQ(head->Header("content-type"), std::nullopt);
  EXPECT_EQ(head->Header("x-injected"), std::nullopt);
  EXPECT_EQ(head->Header("x-split"), std::nullopt);
  EXPECT_EQ(head->Header("x-fine"), "fine");
  EXPECT_EQ(client.ReadChunk(), "");

  stream = Open(client);
  ASSERT_NE(stream, nullptr);
  stream->Begin(99, "text/plain");  // outside 200..599
  stream->Finish();
  head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 500);
  EXPECT_EQ(client.ReadChunk(), "");
  ExpectServesHealthz(client);
  EXPECT_TRUE(Eventually([&] { return server_->stats().responses_5xx == 1 && server_->stats().responses_2xx == 2; }));
}

TEST_F(HttpStreamTest, CallsOutOfOrderAreIgnored) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  EventLog log;
  stream->Write("too early", Record(log, "early"));  // before Begin
  stream->Finish();                                  // before Begin
  EXPECT_FALSE(stream->done());
  EXPECT_EQ(stream->queued_bytes(), 0u);
  stream->Begin(200, "text/plain");
  stream->Begin(404, "text/plain");  // a second Begin
  stream->Respond(Text(500, "no"));  // Respond after Begin
  stream->Write("body", Record(log, "body"));
  stream->Finish();
  const std::optional<RawHttpHead> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(client.ReadChunk(), "body");
  EXPECT_EQ(client.ReadChunk(), "");
  EXPECT_THAT(log.WaitForCount(2), ElementsAre("early:false", "body:true"));
  ExpectServesHealthz(client);
}

// ---- The client goes away ------------------------------------------------------------------------------

class ClientGoesAwayTest : public HttpStreamTest,
                           public ::testing::WithParamInterface<bool> {};  // true: reset, false: close

TEST_P(ClientGoesAwayTest, OnClosedRunsAndLaterCallsAreIgnored) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto client = std::make_unique<RawHttpClient>(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(*client);
  ASSERT_NE(stream, nullptr);
  EventLog log;
  stream->OnClosed([&log] { log.Add("closed"); });
  stream->Begin(200, "text/event-stream");
  stream->Write("data: 1\n\n", Record(log, "piece"));
  ASSERT_TRUE(client->ReadHead().has_value());
  ASSERT_EQ(client->ReadChunk(), "data: 1\n\n");
  EXPECT_EQ(log.WaitForCount(1), std::vector<std::string>{"piece:true"});

  // Nothing is being written: the server notices through its read.
  client->CloseNow(/*reset=*/GetParam());
  EXPECT_EQ(log.WaitForCount(2).back(), "closed");
  EXPECT_TRUE(stream->done());
  stream->Write("data: 2\n\n", Record(log, "after"));
  EXPECT_EQ(log.WaitForCount(3).back(), "after:false");
  EXPECT_EQ(stream->queued_bytes(), 0u);
  // OnClosed set after the end runs too (soon, on an io thread).
  stream->OnClosed([&log] { log.Add("closed-again"); });
  EXPECT_EQ(log.WaitForCount(4).back(), "closed-again");
  stream->Finish();
  EXPECT_TRUE(Eventually([&] { return server_->stats().open_connections == 0; }));
  EXPECT_EQ(log.events().size(), 4u);
  // No callback ran on the test thread, i.e. inside a call.
  for (const std::thread::id& thread : log.threads()) EXPECT_NE(thread, std::this_thread::get_id());
  RawHttpClient other(server_->port());
  ExpectServesHealthz(other);
}

INSTANTIATE_TEST_SUITE_P(CloseOrReset, ClientGoesAwayTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Reset" : "Close"; });

TEST_F(HttpStreamTest, ClientGoingAwayBeforeBeginIsNoticed) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto client = std::make_unique<RawHttpClient>(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(*client);
  ASSERT_NE(stream, nullptr);
  EventLog log;
  stream->OnClosed([&log] { log.Add("closed"); });
  client.reset();
  EXPECT_EQ(log.WaitForCount(1), std::vector<std::string>{"closed"});
  EXPECT_TRUE(stream->done());
  stream->Respond(Text(200, "too late"));  // ignored
  EXPECT_TRUE(Eventually([&] { return server_->stats().open_connections == 0; }));
}

TEST_F(HttpStreamTest, OpenStreamsCountsUntilTheLastPieceIsWrittenOrTheClientIsGone) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto client = std::make_unique<RawHttpClient>(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(*client);
  ASSERT_NE(stream, nullptr);
  EXPECT_EQ(server_->stats().open_streams, 1);
  stream->Begin(200, "text/plain");
  stream->Write("x");
  stream->Finish();  // ended by the handler: still open until the pieces are on the wire
  ASSERT_TRUE(client->ReadHead().has_value());
  ASSERT_EQ(client->ReadChunk(), "x");
  ASSERT_EQ(client->ReadChunk(), "");
  EXPECT_TRUE(Eventually([&] { return server_->stats().open_streams == 0; }));

  auto leaving = std::make_unique<RawHttpClient>(server_->port());
  const std::shared_ptr<ResponseStream> lost = Open(*leaving);
  ASSERT_NE(lost, nullptr);
  EXPECT_EQ(server_->stats().open_streams, 1);
  leaving.reset();
  EXPECT_TRUE(Eventually([&] { return server_->stats().open_streams == 0; }));
  EXPECT_TRUE(lost->done());
}

TEST_F(HttpStreamTest, FinishedStreamsDoNotRunOnClosed) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto client = std::make_unique<RawHttpClient>(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(*client);
  ASSERT_NE(stream, nullptr);
  EventLog log;
  stream->OnClosed([&log] { log.Add("closed"); });
  stream->Begin(200, "text/plain");
  stream->Write("x", Record(log, "x"));
  stream->Finish();
  ASSERT_TRUE(client->ReadHead().has_value());
  ASSERT_EQ(client->ReadChunk(), "x");
  ASSERT_EQ(client->ReadChunk(), "");
  client.reset();
  EXPECT_TRUE(Eventually([&] { return server_->stats().open_connections == 0; }));
  stream->OnClosed([&log] { log.Add("closed-late"); });
  // A callback that would run is posted at once; give it the chance, then check it did not come.
  RawHttpClient other(server_->port());
  ExpectServesHealthz(other);
  EXPECT_EQ(log.events(), std::vector<std::string>{"x:true"});
}

TEST_F(HttpStreamTest, AbortClosesWithoutTheLastChunk) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  EventLog log;
  stream->OnClosed([&log] { log.Add("closed"); });
  stream->Begin(200, "text/plain");
  stream->Write("partial", Record(log, "partial"));
  stream->Abort();
  EXPECT_TRUE(stream->done());
  ASSERT_TRUE(client.ReadHead().has_value());
  // The piece written before Abort may or may not have left; no last chunk ever comes.
  ASSERT_TRUE(client.WaitClosed());
  EXPECT_EQ(client.leftover().find("0\r\n\r\n"), std::string::npos);
  const std::vector<std::string> events = log.WaitForCount(2);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events.back(), "closed");
  if (client.leftover().empty()) {
    EXPECT_EQ(events.front(), "partial:false");
  } else {
    EXPECT_EQ(client.leftover(), "7\r\npartial\r\n");
    EXPECT_EQ(events.front(), "partial:true");
  }
}

TEST_F(HttpStreamTest, AClientThatDoesNotReadIsCutAfterTheWriteTimeout) {
  HttpServerOptions options = TestOptions();
  options.write_timeout = absl::Milliseconds(300);
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  RawHttpClient client(server_->port(), /*receive_buffer=*/4096);
  const std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  EventLog log;
  stream->OnClosed([&log] { log.Add("closed"); });
  stream->Begin(200, "application/octet-stream");
  // Far more than the socket buffers hold, in pieces; the client reads none of it.
  const std::string piece(256 * 1024, 'z');
  std::atomic<int> failed{0};
  for (int i = 0; i < 64; ++i) {
    stream->Write(piece, [&failed](bool ok) {
      if (!ok) failed.fetch_add(1);
    });
  }
  EXPECT_GT(stream->queued_bytes(), 0u);
  EXPECT_THAT(log.WaitForCount(1), ElementsAre("closed"));
  EXPECT_TRUE(Eventually([&] { return failed.load() > 0 && stream->queued_bytes() == 0; }));
  EXPECT_TRUE(Eventually([&] { return server_->stats().connections_timed_out == 1; }));
  EXPECT_TRUE(Eventually([&] { return server_->stats().open_connections == 0; }));
}

// ---- Pipelining -------------------------------------------------------------------------------------------

TEST_F(HttpStreamTest, APipelinedRequestIsServedAfterTheStream) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/plain");
  ASSERT_TRUE(client.ReadHead().has_value());
  // The next request arrives while the stream is open: it waits for the stream's end.
  ASSERT_TRUE(
      client.Send(absl::StrCat(kGetHealthz, "POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")));
  EXPECT_TRUE(client.StaysQuiet(absl::Milliseconds(100)));
  stream->Write("streamed");
  stream->Finish();
  EXPECT_EQ(client.ReadChunk(), "streamed");
  EXPECT_EQ(client.ReadChunk(), "");
  const std::optional<RawHttpResponse> healthz = client.ReadResponse();
  ASSERT_TRUE(healthz.has_value());
  EXPECT_EQ(healthz->body, "ok\n");
  HttpRequest request;
  const std::shared_ptr<ResponseStream> second = inbox_.Take(&request);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(request.body, "abc");
  second->Respond(Text(200, "second"));
  const std::optional<RawHttpResponse> answer = client.ReadResponse();
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->body, "second");
}

TEST_F(HttpStreamTest, ALargePipelinedRequestWithinTheLimitsIsKept) {
  HttpServerOptions options = TestOptions();
  options.max_body_bytes = 512 * 1024;
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  RawHttpClient client(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  const std::string body(400 * 1024, 'b');
  ASSERT_TRUE(
      client.Send(absl::StrCat("POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(), "\r\n\r\n", body)));
  stream->Respond(Text(200, "first"));
  std::optional<RawHttpResponse> answer = client.ReadResponse();
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->body, "first");
  HttpRequest request;
  const std::shared_ptr<ResponseStream> second = inbox_.Take(&request);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(request.body, body);
  second->Respond(Text(200, "second"));
  answer = client.ReadResponse();
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->body, "second");
}

TEST_F(HttpStreamTest, PipeliningBeyondTheKeptBytesIsFlowControlledNotCut) {
  HttpServerOptions options = TestOptions();
  options.max_header_bytes = 1024;
  options.max_body_bytes = 16 * 1024;  // the server keeps 1 KiB + 64 KiB while streaming
  ASSERT_NO_FATAL_FAILURE(StartServer(options));
  RawHttpClient client(server_->port());
  std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/plain");
  ASSERT_TRUE(client.ReadHead().has_value());
  // Ten requests of 15 KiB bodies: more than twice what the server keeps (the rest waits in the
  // sockets' buffers).
  constexpr int kPipelined = 10;
  const std::string body(15 * 1024, 'p');
  std::string requests;
  for (int i = 0; i < kPipelined; ++i) {
    absl::StrAppend(&requests, "POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(), "\r\n\r\n", body);
  }
  ASSERT_TRUE(client.Send(requests));
  stream->Write("still streaming");
  EXPECT_EQ(client.ReadChunk(), "still streaming");
  stream->Finish();
  EXPECT_EQ(client.ReadChunk(), "");
  for (int i = 0; i < kPipelined; ++i) {
    HttpRequest request;
    stream = inbox_.Take(&request);
    ASSERT_NE(stream, nullptr) << i;
    EXPECT_EQ(request.body, body) << i;
    stream->Respond(Text(200, absl::StrCat("answer ", i)));
    const std::optional<RawHttpResponse> answer = client.ReadResponse();
    ASSERT_TRUE(answer.has_value()) << i;
    EXPECT_EQ(answer->body, absl::StrCat("answer ", i));
  }
  ExpectServesHealthz(client);
}

TEST_F(HttpStreamTest, ConnectionCloseEndsTheConnectionAfterTheStream) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  const std::shared_ptr<ResponseStream> stream =
      Open(client, "GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/plain");
  stream->Write("only");
  stream->Finish();
  const std::optional<RawHttpHead> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->Header("connection"), "close");
  EXPECT_EQ(head->Header("transfer-encoding"), "chunked");
  EXPECT_EQ(client.ReadChunk(), "only");
  EXPECT_EQ(client.ReadChunk(), "");
  EXPECT_TRUE(client.WaitClosed());
  EXPECT_EQ(client.leftover(), "");
}

// ---- Handlers that fail or leave ---------------------------------------------------------------------------

TEST_F(HttpStreamTest, HandlerExceptionsAndAbandonedStreams) {
  std::atomic<int> mode{0};
  HttpRouter router;
  router.HandleStreaming("/s", {"GET"}, [&mode](HttpRequest, std::shared_ptr<ResponseStream> stream) {
    switch (mode.load()) {
      case 0:  // throws before beginning: 500
        throw std::runtime_error("secret-exception-text");
      case 1:  // throws after beginning: the connection closes
        stream->Begin(200, "text/plain");
        stream->Write("partial");
        throw std::runtime_error("secret-exception-text");
      case 2:  // drops the stream without a response: 500
        return;
      default:  // drops it after beginning: closed
        stream->Begin(200, "text/plain");
        return;
    }
  });
  router.Handle("/healthz", {"GET"}, [](const HttpRequest&) { return Text(200, "ok\n"); });
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), std::move(router));
  ASSERT_NE(server, nullptr);

  for (int m : {0, 2}) {
    mode = m;
    RawHttpClient client(server->port());
    ASSERT_TRUE(client.Send("GET /s HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::optional<RawHttpResponse> response = client.ReadResponse();
    ASSERT_TRUE(response.has_value()) << m;
    EXPECT_EQ(response->status, 500) << m;
    EXPECT_THAT(response->body, Not(HasSubstr("secret")));
    ExpectServesHealthz(client);  // the connection goes on
  }
  for (int m : {1, 3}) {
    mode = m;
    RawHttpClient client(server->port());
    ASSERT_TRUE(client.Send("GET /s HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::optional<RawHttpHead> head = client.ReadHead();
    ASSERT_TRUE(head.has_value()) << m;
    EXPECT_EQ(head->status, 200);
    ASSERT_TRUE(client.WaitClosed()) << m;
    EXPECT_EQ(client.leftover().find("0\r\n\r\n"), std::string::npos) << m;
  }
  RawHttpClient after(server->port());
  ExpectServesHealthz(after);
}

// ---- Many streams at once, read by libcurl --------------------------------------------------------------

size_t AppendToString(char* data, size_t size, size_t count, void* user) {
  static_cast<std::string*>(user)->append(data, size * count);
  return size * count;
}

TEST_F(HttpStreamTest, ConcurrentStreamsReadByCurlArriveWhole) {
  // Each handler answers from a thread of its own, with the SSE framing of OpenAI streams.
  std::vector<std::thread> producers;
  absl::Mutex producers_mu;
  HttpRouter router;
  router.HandleStreaming("/v1/completions", {"POST"}, [&](HttpRequest request, std::shared_ptr<ResponseStream> stream) {
    absl::MutexLock lock(&producers_mu);
    producers.emplace_back([request = std::move(request), stream = std::move(stream)] {
      stream->Begin(200, "text/event-stream");
      for (int i = 0; i < 50; ++i)
        stream->Write(absl::StrCat("data: {\"id\":\"", request.body, "\",\"i\":", i, "}\n\n"));
      stream->Write("data: [DONE]\n\n");
      stream->Finish();
    });
  });
  HttpServerOptions options = TestOptions();
  options.threads = 4;
  std::unique_ptr<HttpServer> server = MustStart(options, std::move(router));
  ASSERT_NE(server, nullptr);

  constexpr int kClients = 16;
  constexpr int kRequestsEach = 4;
  std::vector<std::thread> clients;
  std::atomic<int> good{0};
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      CURL* curl = curl_easy_init();
      for (int r = 0; r < kRequestsEach; ++r) {
        const std::string id = absl::StrCat(c, "-", r);
        std::string body;
        const std::string url = absl::StrCat("http://127.0.0.1:", server->port(), "/v1/completions");
        curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
        curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, 10000L);
        curl_easy_setopt(curl, CURLOPT_POSTFIELDS, id.c_str());
        curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, &AppendToString);
        curl_easy_setopt(curl, CURLOPT_WRITEDATA, &body);
        const CURLcode code = curl_easy_perform(curl);
        long status = 0;
        curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
        std::string expected;
        for (int i = 0; i < 50; ++i) absl::StrAppend(&expected, "data: {\"id\":\"", id, "\",\"i\":", i, "}\n\n");
        expected += "data: [DONE]\n\n";
        if (code == CURLE_OK && status == 200 && body == expected) good.fetch_add(1);
      }
      curl_easy_cleanup(curl);
    });
  }
  for (std::thread& client : clients) client.join();
  EXPECT_EQ(good.load(), kClients * kRequestsEach);
  server->Stop();
  absl::MutexLock lock(&producers_mu);
  for (std::thread& producer : producers) producer.join();
}

// ---- Stop -------------------------------------------------------------------------------------------------

TEST_F(HttpStreamTest, StopEndsOpenStreamsAndStreamsOutliveTheServer) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient begun_client(server_->port());
  RawHttpClient fresh_client(server_->port());
  const std::shared_ptr<ResponseStream> begun = Open(begun_client);
  ASSERT_NE(begun, nullptr);
  const std::shared_ptr<ResponseStream> fresh = Open(fresh_client);
  ASSERT_NE(fresh, nullptr);
  EventLog log;
  begun->OnClosed([&log] { log.Add("begun-closed"); });
  fresh->OnClosed([&log] { log.Add("fresh-closed"); });
  begun->Begin(200, "text/plain");
  begun->Write("x");
  ASSERT_TRUE(begun_client.ReadHead().has_value());
  ASSERT_EQ(begun_client.ReadChunk(), "x");

  server_->Stop();
  // Both ended before Stop returned, their callbacks run by then.
  std::vector<std::string> events = log.events();
  std::sort(events.begin(), events.end());
  EXPECT_THAT(events, ElementsAre("begun-closed", "fresh-closed"));
  EXPECT_TRUE(begun->done());
  EXPECT_TRUE(fresh->done());
  EXPECT_EQ(server_->stats().open_connections, 0);
  EXPECT_TRUE(begun_client.WaitClosed());
  EXPECT_TRUE(fresh_client.WaitClosed());

  // Calls after Stop, and after the server is gone, are ignored.
  server_.reset();
  std::atomic<bool> ran{false};
  begun->Write("y", [&ran](bool) { ran = true; });
  begun->Finish();
  fresh->Begin(200, "text/plain");
  fresh->Respond(Text(200, "z"));
  fresh->OnClosed([&ran] { ran = true; });
  begun->Abort();
  EXPECT_FALSE(ran.load());
}

TEST_F(HttpStreamTest, AStopFromAnOnClosedCallbackDuringStopDoesNotHang) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  RawHttpClient client(server_->port());
  const std::shared_ptr<ResponseStream> stream = Open(client);
  ASSERT_NE(stream, nullptr);
  HttpServer* raw = server_.get();
  std::atomic<bool> ran{false};
  stream->OnClosed([raw, &ran] {
    raw->Stop();
    ran = true;
  });
  server_->Stop();
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(server_->stats().open_connections, 0);
}

}  // namespace
}  // namespace eldr::http
