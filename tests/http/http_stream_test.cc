// Tests of streamed responses (ResponseStream, HttpRouter::HandleStreaming): routing, and a real
// HttpServer on 127.0.0.1 driven by raw POSIX sockets, which see the exact wire bytes (chunk
// framing, when the head and each piece arrive, when the connection closes), and by libcurl for
// many concurrent streams. The handlers hand their streams to the test thread, which drives them
// from outside the server's io threads, as a proxy's upstream callbacks do.
#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
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

namespace eldr::http {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

const bool curl_initialised = [] {
  curl_global_init(CURL_GLOBAL_DEFAULT);
  return true;
}();

// Generous: only a broken server waits this long.
constexpr absl::Duration kWait = absl::Seconds(5);

// ---- A raw client that reads chunked bodies ---------------------------------------------------------

struct Head {
  std::string version;  // "HTTP/1.1"
  int status = 0;
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased

  std::optional<std::string> Header(absl::string_view name) const {
    for (const auto& [header, value] : headers) {
      if (header == name) return value;
    }
    return std::nullopt;
  }
};

class RawClient {
 public:
  // Connects to 127.0.0.1:port; `receive_buffer` > 0 shrinks SO_RCVBUF first.
  explicit RawClient(int port, int receive_buffer = 0) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (receive_buffer > 0) ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &receive_buffer, sizeof(receive_buffer));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~RawClient() { CloseNow(); }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  bool connected() const { return connected_; }

  bool Send(absl::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t sent = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) return false;
      bytes.remove_prefix(static_cast<size_t>(sent));
    }
    return true;
  }

  // Closes the socket; `reset` makes the kernel send RST instead of FIN.
  void CloseNow(bool reset = false) {
    if (fd_ < 0) return;
    if (reset) {
      const linger hard{1, 0};
      ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
    }
    ::close(fd_);
    fd_ = -1;
  }

  // The response head, or nullopt when the connection closes or `timeout` passes first.
  std::optional<Head> ReadHead(absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    size_t end = std::string::npos;
    while ((end = pending_.find("\r\n\r\n")) == std::string::npos) {
      if (!Fill(deadline)) return std::nullopt;
    }
    Head head;
    const std::vector<absl::string_view> lines = absl::StrSplit(absl::string_view(pending_).substr(0, end), "\r\n");
    const std::vector<absl::string_view> status_line = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
    if (status_line.size() < 2 || !absl::SimpleAtoi(status_line[1], &head.status)) return std::nullopt;
    head.version = std::string(status_line[0]);
    for (size_t i = 1; i < lines.size(); ++i) {
      const size_t colon = lines[i].find(':');
      if (colon == absl::string_view::npos) return std::nullopt;
      head.headers.emplace_back(absl::AsciiStrToLower(lines[i].substr(0, colon)),
                                std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1))));
    }
    pending_.erase(0, end + 4);
    return head;
  }

  // One chunk of a chunked body: its payload ("" for the last chunk, whose empty trailer is
  // consumed too), or nullopt on close, timeout or bad framing.
  std::optional<std::string> ReadChunk(absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    size_t line_end = std::string::npos;
    while ((line_end = pending_.find("\r\n")) == std::string::npos) {
      if (!Fill(deadline)) return std::nullopt;
    }
    size_t size = 0;
    if (!absl::SimpleHexAtoi(absl::string_view(pending_).substr(0, line_end), &size)) return std::nullopt;
    const size_t needed = line_end + 2 + size + 2;
    while (pending_.size() < needed) {
      if (!Fill(deadline)) return std::nullopt;
    }
    if (pending_.compare(needed - 2, 2, "\r\n") != 0) return std::nullopt;
    std::string payload = pending_.substr(line_end + 2, size);
    pending_.erase(0, needed);
    return payload;
  }

  // `size` bytes (an unframed body), or nullopt.
  std::optional<std::string> ReadBytes(size_t size, absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    while (pending_.size() < size) {
      if (!Fill(deadline)) return std::nullopt;
    }
    std::string bytes = pending_.substr(0, size);
    pending_.erase(0, size);
    return bytes;
  }

  // True when the server closes the connection (EOF or reset) within `timeout`; what arrives
  // meanwhile is kept in leftover().
  bool WaitClosed(absl::Duration timeout = kWait) {
    const absl::Time deadline = absl::Now() + timeout;
    while (!closed_) {
      if (!Fill(deadline) && !closed_) return false;
    }
    return true;
  }

  // Whether nothing arrives (and the connection stays open) for `quiet`.
  bool StaysQuiet(absl::Duration quiet) {
    const size_t before = pending_.size();
    Fill(absl::Now() + quiet);
    return pending_.size() == before && !closed_;
  }

  const std::string& leftover() const { return pending_; }

 private:
  // Reads what is available before `deadline` into pending_; false on timeout or close.
  bool Fill(absl::Time deadline) {
    if (closed_ || fd_ < 0) return false;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    pollfd descriptor{fd_, POLLIN, 0};
    const int ready = ::poll(&descriptor, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (ready <= 0) return false;
    char chunk[16384];
    const ssize_t got = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (got <= 0) {
      closed_ = true;
      return false;
    }
    pending_.append(chunk, static_cast<size_t>(got));
    return true;
  }

  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
  std::string pending_;
};

// Reads a Content-Length framed response (no body for HEAD, 204, 304) off `client`.
struct WholeResponse {
  Head head;
  std::string body;
};

std::optional<WholeResponse> ReadWholeResponse(RawClient& client, bool head_request = false) {
  std::optional<Head> head = client.ReadHead();
  if (!head.has_value()) return std::nullopt;
  WholeResponse response{*std::move(head), ""};
  if (head_request || response.head.status == 204 || response.head.status == 304) return response;
  size_t length = 0;
  const std::optional<std::string> content_length = response.head.Header("content-length");
  if (!content_length.has_value() || !absl::SimpleAtoi(*content_length, &length)) return std::nullopt;
  std::optional<std::string> body = client.ReadBytes(length);
  if (!body.has_value()) return std::nullopt;
  response.body = *std::move(body);
  return response;
}

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
constexpr absl::string_view kGetHealthz = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";

// Asserts that `client`'s connection still serves an ordinary request.
void ExpectServesHealthz(RawClient& client) {
  ASSERT_TRUE(client.Send(kGetHealthz));
  const std::optional<WholeResponse> response = ReadWholeResponse(client);
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->head.status, 200);
  EXPECT_EQ(response->body, "ok\n");
}

HttpRequest Request(std::string method, std::string path) {
  HttpRequest request;
  request.method = std::move(method);
  request.path = std::move(path);
  request.target = request.path;
  return request;
}

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

TEST(HttpStreamTest, PiecesArriveOneByOneAsChunksAndTheConnectionIsKeptAlive) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  HttpRequest request;
  const std::shared_ptr<ResponseStream> stream = inbox.Take(&request);
  ASSERT_NE(stream, nullptr);
  EXPECT_EQ(request.method, "GET");
  EXPECT_EQ(request.path, "/stream");
  EXPECT_FALSE(request.peer.empty());
  EXPECT_FALSE(stream->done());

  // Nothing is sent before Begin.
  EXPECT_TRUE(client.StaysQuiet(absl::Milliseconds(50)));
  stream->Begin(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Request-Id", "r-1"}});
  const std::optional<Head> head = client.ReadHead();
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
    const HttpServerStats stats = server->stats();
    return stats.requests == 2 && stats.responses_2xx == 2 && stats.open_connections == 1;
  }));
}

TEST(HttpStreamTest, WritesFromManyThreadsAllArriveEachInOrder) {
  StreamInbox inbox;
  HttpServerOptions options = TestOptions();
  options.threads = 2;
  std::unique_ptr<HttpServer> server = MustStart(options, StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
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

TEST(HttpStreamTest, RespondSendsAWholeResponseAndHeadGetsItsHead) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());

  ASSERT_TRUE(client.Send("POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"));
  HttpRequest request;
  std::shared_ptr<ResponseStream> stream = inbox.Take(&request);
  ASSERT_NE(stream, nullptr);
  EXPECT_EQ(request.body, "hello");
  HttpResponse answer = Text(201, "{\"ok\":true}");
  answer.content_type = "application/json";
  answer.headers.emplace_back("X-Answer", "42");
  stream->Respond(answer);
  EXPECT_TRUE(stream->done());
  std::optional<WholeResponse> response = ReadWholeResponse(client);
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->head.status, 201);
  EXPECT_EQ(response->head.Header("content-length"), "11");
  EXPECT_EQ(response->head.Header("transfer-encoding"), std::nullopt);
  EXPECT_EQ(response->head.Header("content-type"), "application/json");
  EXPECT_EQ(response->head.Header("x-answer"), "42");
  EXPECT_EQ(response->body, "{\"ok\":true}");
  // Begin after Respond is ignored: nothing more arrives, and the connection goes on.
  stream->Begin(200, "text/plain");
  EXPECT_TRUE(client.StaysQuiet(absl::Milliseconds(50)));

  ASSERT_TRUE(client.Send("HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n"));
  stream = inbox.Take(&request);
  ASSERT_NE(stream, nullptr);
  EXPECT_EQ(request.method, "HEAD");
  stream->Respond(Text(200, "twelve bytes"));
  response = ReadWholeResponse(client, /*head_request=*/true);
  ASSERT_TRUE(response.has_value());
  EXPECT_EQ(response->head.status, 200);
  EXPECT_EQ(response->head.Header("content-length"), "12");
  ExpectServesHealthz(client);  // no body bytes were sent to HEAD
}

TEST(HttpStreamTest, HeadAnd204SendTheHeadOnlyAndDiscardTheWrites) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  EventLog log;

  ASSERT_TRUE(client.Send("HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n"));
  std::shared_ptr<ResponseStream> stream = inbox.Take();
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/event-stream");
  stream->Write("data: x\n\n", Record(log, "head-piece"));
  stream->Finish();
  std::optional<Head> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(head->Header("transfer-encoding"), "chunked");  // what a GET would get
  EXPECT_EQ(log.WaitForCount(1), std::vector<std::string>{"head-piece:true"});
  EXPECT_EQ(stream->queued_bytes(), 0u);
  ExpectServesHealthz(client);  // no chunk, not even the last one, reached the wire

  ASSERT_TRUE(client.Send(kGetStream));
  stream = inbox.Take();
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

TEST(HttpStreamTest, Http10StreamsWithoutLengthAndCloses) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send("GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/plain");
  stream->Write("first ");
  const std::optional<Head> head = client.ReadHead();
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

TEST(HttpStreamTest, BeginFiltersFieldsAndFixesBadStatuses) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  std::shared_ptr<ResponseStream> stream = inbox.Take();
  ASSERT_NE(stream, nullptr);
  stream->Begin(299, "text/plain\r\nX-Injected: 1",
                {{"Content-Length", "5"},
                 {"Transfer-Encoding", "gzip"},
                 {"Connection", "close"},
                 {"Bad Name", "x"},
                 {"X-Split", "a\r\nX-Injected: 2"},
                 {"X-Fine", "fine"}});
  stream->Finish();
  std::optional<Head> head = client.ReadHead();
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

  ASSERT_TRUE(client.Send(kGetStream));
  stream = inbox.Take();
  ASSERT_NE(stream, nullptr);
  stream->Begin(99, "text/plain");  // outside 200..599
  stream->Finish();
  head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 500);
  EXPECT_EQ(client.ReadChunk(), "");
  ExpectServesHealthz(client);
  EXPECT_TRUE(Eventually([&] { return server->stats().responses_5xx == 1 && server->stats().responses_2xx == 2; }));
}

TEST(HttpStreamTest, CallsOutOfOrderAreIgnored) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
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
  const std::optional<Head> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->status, 200);
  EXPECT_EQ(client.ReadChunk(), "body");
  EXPECT_EQ(client.ReadChunk(), "");
  EXPECT_THAT(log.WaitForCount(2), ElementsAre("early:false", "body:true"));
  ExpectServesHealthz(client);
}

// ---- The client goes away ------------------------------------------------------------------------------

class ClientGoesAwayTest : public ::testing::TestWithParam<bool> {};  // true: reset, false: close

TEST_P(ClientGoesAwayTest, OnClosedRunsAndLaterCallsAreIgnored) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  auto client = std::make_unique<RawClient>(server->port());
  ASSERT_TRUE(client->Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
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
  EXPECT_TRUE(Eventually([&] { return server->stats().open_connections == 0; }));
  EXPECT_EQ(log.events().size(), 4u);
  // No callback ran on the test thread, i.e. inside a call.
  for (const std::thread::id& thread : log.threads()) EXPECT_NE(thread, std::this_thread::get_id());
  RawClient other(server->port());
  ExpectServesHealthz(other);
}

INSTANTIATE_TEST_SUITE_P(CloseOrReset, ClientGoesAwayTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Reset" : "Close"; });

TEST(HttpStreamTest, ClientGoingAwayBeforeBeginIsNoticed) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  auto client = std::make_unique<RawClient>(server->port());
  ASSERT_TRUE(client->Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
  ASSERT_NE(stream, nullptr);
  EventLog log;
  stream->OnClosed([&log] { log.Add("closed"); });
  client.reset();
  EXPECT_EQ(log.WaitForCount(1), std::vector<std::string>{"closed"});
  EXPECT_TRUE(stream->done());
  stream->Respond(Text(200, "too late"));  // ignored
  EXPECT_TRUE(Eventually([&] { return server->stats().open_connections == 0; }));
}

TEST(HttpStreamTest, FinishedStreamsDoNotRunOnClosed) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  auto client = std::make_unique<RawClient>(server->port());
  ASSERT_TRUE(client->Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
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
  EXPECT_TRUE(Eventually([&] { return server->stats().open_connections == 0; }));
  stream->OnClosed([&log] { log.Add("closed-late"); });
  // A callback that would run is posted at once; give it the chance, then check it did not come.
  RawClient other(server->port());
  ExpectServesHealthz(other);
  EXPECT_EQ(log.events(), std::vector<std::string>{"x:true"});
}

TEST(HttpStreamTest, AbortClosesWithoutTheLastChunk) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
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

TEST(HttpStreamTest, AClientThatDoesNotReadIsCutAfterTheWriteTimeout) {
  StreamInbox inbox;
  HttpServerOptions options = TestOptions();
  options.write_timeout = absl::Milliseconds(300);
  std::unique_ptr<HttpServer> server = MustStart(options, StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port(), /*receive_buffer=*/4096);
  ASSERT_TRUE(client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
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
  EXPECT_TRUE(Eventually([&] { return server->stats().connections_timed_out == 1; }));
  EXPECT_TRUE(Eventually([&] { return server->stats().open_connections == 0; }));
}

// ---- Pipelining -------------------------------------------------------------------------------------------

TEST(HttpStreamTest, APipelinedRequestIsServedAfterTheStream) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
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
  const std::optional<WholeResponse> healthz = ReadWholeResponse(client);
  ASSERT_TRUE(healthz.has_value());
  EXPECT_EQ(healthz->body, "ok\n");
  HttpRequest request;
  const std::shared_ptr<ResponseStream> second = inbox.Take(&request);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(request.body, "abc");
  second->Respond(Text(200, "second"));
  const std::optional<WholeResponse> answer = ReadWholeResponse(client);
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->body, "second");
}

TEST(HttpStreamTest, ALargePipelinedRequestWithinTheLimitsIsKept) {
  StreamInbox inbox;
  HttpServerOptions options = TestOptions();
  options.max_body_bytes = 512 * 1024;
  std::unique_ptr<HttpServer> server = MustStart(options, StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
  ASSERT_NE(stream, nullptr);
  const std::string body(400 * 1024, 'b');
  ASSERT_TRUE(
      client.Send(absl::StrCat("POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: ", body.size(), "\r\n\r\n", body)));
  stream->Respond(Text(200, "first"));
  std::optional<WholeResponse> answer = ReadWholeResponse(client);
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->body, "first");
  HttpRequest request;
  const std::shared_ptr<ResponseStream> second = inbox.Take(&request);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(request.body, body);
  second->Respond(Text(200, "second"));
  answer = ReadWholeResponse(client);
  ASSERT_TRUE(answer.has_value());
  EXPECT_EQ(answer->body, "second");
}

TEST(HttpStreamTest, PipeliningBeyondTheKeptBytesIsFlowControlledNotCut) {
  StreamInbox inbox;
  HttpServerOptions options = TestOptions();
  options.max_header_bytes = 1024;
  options.max_body_bytes = 16 * 1024;  // the server keeps 1 KiB + 64 KiB while streaming
  std::unique_ptr<HttpServer> server = MustStart(options, StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  std::shared_ptr<ResponseStream> stream = inbox.Take();
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
    stream = inbox.Take(&request);
    ASSERT_NE(stream, nullptr) << i;
    EXPECT_EQ(request.body, body) << i;
    stream->Respond(Text(200, absl::StrCat("answer ", i)));
    const std::optional<WholeResponse> answer = ReadWholeResponse(client);
    ASSERT_TRUE(answer.has_value()) << i;
    EXPECT_EQ(answer->body, absl::StrCat("answer ", i));
  }
  ExpectServesHealthz(client);
}

TEST(HttpStreamTest, ConnectionCloseEndsTheConnectionAfterTheStream) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send("GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
  ASSERT_NE(stream, nullptr);
  stream->Begin(200, "text/plain");
  stream->Write("only");
  stream->Finish();
  const std::optional<Head> head = client.ReadHead();
  ASSERT_TRUE(head.has_value());
  EXPECT_EQ(head->Header("connection"), "close");
  EXPECT_EQ(head->Header("transfer-encoding"), "chunked");
  EXPECT_EQ(client.ReadChunk(), "only");
  EXPECT_EQ(client.ReadChunk(), "");
  EXPECT_TRUE(client.WaitClosed());
  EXPECT_EQ(client.leftover(), "");
}

// ---- Handlers that fail or leave ---------------------------------------------------------------------------

TEST(HttpStreamTest, HandlerExceptionsAndAbandonedStreams) {
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
    RawClient client(server->port());
    ASSERT_TRUE(client.Send("GET /s HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::optional<WholeResponse> response = ReadWholeResponse(client);
    ASSERT_TRUE(response.has_value()) << m;
    EXPECT_EQ(response->head.status, 500) << m;
    EXPECT_THAT(response->body, Not(HasSubstr("secret")));
    ExpectServesHealthz(client);  // the connection goes on
  }
  for (int m : {1, 3}) {
    mode = m;
    RawClient client(server->port());
    ASSERT_TRUE(client.Send("GET /s HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::optional<Head> head = client.ReadHead();
    ASSERT_TRUE(head.has_value()) << m;
    EXPECT_EQ(head->status, 200);
    ASSERT_TRUE(client.WaitClosed()) << m;
    EXPECT_EQ(client.leftover().find("0\r\n\r\n"), std::string::npos) << m;
  }
  RawClient after(server->port());
  ExpectServesHealthz(after);
}

// ---- Many streams at once, read by libcurl --------------------------------------------------------------

size_t AppendToString(char* data, size_t size, size_t count, void* user) {
  static_cast<std::string*>(user)->append(data, size * count);
  return size * count;
}

TEST(HttpStreamTest, ConcurrentStreamsReadByCurlArriveWhole) {
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

TEST(HttpStreamTest, StopEndsOpenStreamsAndStreamsOutliveTheServer) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient begun_client(server->port());
  RawClient fresh_client(server->port());
  ASSERT_TRUE(begun_client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> begun = inbox.Take();
  ASSERT_NE(begun, nullptr);
  ASSERT_TRUE(fresh_client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> fresh = inbox.Take();
  ASSERT_NE(fresh, nullptr);
  EventLog log;
  begun->OnClosed([&log] { log.Add("begun-closed"); });
  fresh->OnClosed([&log] { log.Add("fresh-closed"); });
  begun->Begin(200, "text/plain");
  begun->Write("x");
  ASSERT_TRUE(begun_client.ReadHead().has_value());
  ASSERT_EQ(begun_client.ReadChunk(), "x");

  server->Stop();
  // Both ended before Stop returned, their callbacks run by then.
  std::vector<std::string> events = log.events();
  std::sort(events.begin(), events.end());
  EXPECT_THAT(events, ElementsAre("begun-closed", "fresh-closed"));
  EXPECT_TRUE(begun->done());
  EXPECT_TRUE(fresh->done());
  EXPECT_EQ(server->stats().open_connections, 0);
  EXPECT_TRUE(begun_client.WaitClosed());
  EXPECT_TRUE(fresh_client.WaitClosed());

  // Calls after Stop, and after the server is gone, are ignored.
  server.reset();
  std::atomic<bool> ran{false};
  begun->Write("y", [&ran](bool) { ran = true; });
  begun->Finish();
  fresh->Begin(200, "text/plain");
  fresh->Respond(Text(200, "z"));
  fresh->OnClosed([&ran] { ran = true; });
  begun->Abort();
  EXPECT_FALSE(ran.load());
}

TEST(HttpStreamTest, AStopFromAnOnClosedCallbackDuringStopDoesNotHang) {
  StreamInbox inbox;
  std::unique_ptr<HttpServer> server = MustStart(TestOptions(), StreamRouter(inbox));
  ASSERT_NE(server, nullptr);
  RawClient client(server->port());
  ASSERT_TRUE(client.Send(kGetStream));
  const std::shared_ptr<ResponseStream> stream = inbox.Take();
  ASSERT_NE(stream, nullptr);
  HttpServer* raw = server.get();
  std::atomic<bool> ran{false};
  stream->OnClosed([raw, &ran] {
    raw->Stop();
    ran = true;
  });
  server->Stop();
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(server->stats().open_connections, 0);
}

}  // namespace
}  // namespace eldr::http
