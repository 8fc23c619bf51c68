// KubeClient against a loopback server that writes its answers byte by byte (plain HTTP): line
// splitting across and within reads, silence, stop, HTTP errors, drops, token rotation, limits.
// TLS is exercised by the integration test against the stand-in API server.
#include "eldr/discovery/kube_client.h"

#include <sys/socket.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "eldr/common/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/process.h"
#include "testing/raw_http_server.h"

namespace eldr::discovery {
namespace {

using eldr::testing::RawHttpServer;
using eldr::testing::RawRequestReader;
using eldr::testing::SendAll;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr char kChunkedHead[] =
    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";

std::string Chunk(absl::string_view data) { return absl::StrCat(absl::Hex(data.size()), "\r\n", data, "\r\n"); }

std::string Answer(int status, absl::string_view body, absl::string_view reason = "X") {
  return absl::StrCat("HTTP/1.1 ", status, " ", reason,
                      "\r\nContent-Type: application/json\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

// A server whose every connection runs `reply(fd, request)`; the requests are kept.
class Server {
 public:
  explicit Server(std::function<void(int fd, const std::string& request)> reply)
      : reply_(std::move(reply)), server_([this](int fd, int) {
          RawRequestReader reader(fd);
          std::optional<std::string> request = reader.Next();
          if (!request.has_value()) return;
          {
            absl::MutexLock lock(&mu_);
            requests_.push_back(*request);
          }
          reply_(fd, *request);
        }) {}

  std::unique_ptr<KubeClient> Client(KubeApiConfig config = {}, KubeClientOptions options = {}) {
    config.server = absl::StrCat("http://127.0.0.1:", server_.port());
    auto client = KubeClient::Create(config, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return std::move(*client);
  }

  int port() const { return server_.port(); }

  std::vector<std::string> requests() {
    absl::MutexLock lock(&mu_);
    return requests_;
  }

 private:
  std::function<void(int, const std::string&)> reply_;
  absl::Mutex mu_;
  std::vector<std::string> requests_;
  RawHttpServer server_;
};

struct Lines {
  std::vector<std::string> lines;
  int batches = 0;
  int opens = 0;
  std::function<bool(absl::string_view)> on_line = [this](absl::string_view line) {
    lines.emplace_back(line);
    return true;
  };
  WatchHooks Hooks() {
    WatchHooks hooks;
    hooks.on_open = [this] { ++opens; };
    hooks.on_batch_end = [this] { ++batches; };
    return hooks;
  }
};

WatchLimits Limits(absl::Duration silence = absl::Seconds(5)) {
  WatchLimits limits;
  limits.connect_timeout = absl::Seconds(2);
  limits.silence_timeout = silence;
  limits.max_line_bytes = 1024;
  return limits;
}

TEST(KubeClientTest, GetSendsTokenAndReturnsAnyStatus) {
  Server server([](int fd, const std::string& request) {
    if (absl::StrContains(request, "/missing")) {
      SendAll(fd, Answer(404, R"({"kind":"Status","message":"pods \"x\" not found","code":404})"));
    } else {
      SendAll(fd, Answer(200, R"({"kind":"PodList"})"));
    }
  });
  KubeApiConfig config;
  config.token = "secret-token";
  auto client = server.Client(config);
  auto ok = client->Get("/api/v1/pods?limit=1", absl::Seconds(5));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->http_status, 200);
  EXPECT_EQ(ok->body, R"({"kind":"PodList"})");
  auto missing = client->Get("/missing", absl::Seconds(5));
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_EQ(missing->http_status, 404);
  EXPECT_THAT(KubeHttpStatus(missing->http_status, missing->body).message(), HasSubstr("pods \"x\" not found"));
  const auto requests = server.requests();
  ASSERT_EQ(requests.size(), 2u);
  EXPECT_THAT(requests[0], HasSubstr("GET /api/v1/pods?limit=1 HTTP/1.1"));
  EXPECT_THAT(requests[0], HasSubstr("Authorization: Bearer secret-token"));
  EXPECT_THAT(requests[0], HasSubstr("Accept: application/json"));
  EXPECT_THAT(requests[0], HasSubstr("User-Agent: eldr-discovery"));
  EXPECT_FALSE(client->Get("no-slash", absl::Seconds(1)).ok());
}

TEST(KubeClientTest, TokenFileIsReadAtEveryRequestAndAfterA401) {
  eldr::testing::TempDir dir;
  const std::string token_file = dir.File("token");
  ASSERT_TRUE(WriteFileAtomically(token_file, "token-1\n").ok());
  std::atomic<int> rotate_on_next{0};
  std::atomic<int> generation{2};
  Server server([&](int fd, const std::string& request) {
    // The "server" accepts only what the file holds now; for the retry tests it rotates the file
    // just before checking (the token the client sent is then stale).
    if (rotate_on_next.exchange(0) != 0) {
      (void)WriteFileAtomically(token_file, absl::StrCat("token-", ++generation, "\n"));
    }
    auto current = ReadFile(token_file);
    const std::string expected =
        current.ok() ? absl::StrCat("Authorization: Bearer ", absl::StripAsciiWhitespace(*current), "\r\n")
                     : std::string("Authorization: Bearer ");
    if (absl::StrContains(request, expected)) {
      SendAll(fd, Answer(200, "{}"));
    } else {
      SendAll(fd, Answer(401, R"({"kind":"Status","message":"Unauthorized","code":401})"));
    }
  });
  KubeApiConfig config;
  config.token_file = token_file;
  auto client = server.Client(config);
  EXPECT_EQ(client->Get("/a", absl::Seconds(5))->http_status, 200);
  ASSERT_TRUE(WriteFileAtomically(token_file, "token-2").ok());  // same length, new content
  EXPECT_EQ(client->Get("/b", absl::Seconds(5))->http_status, 200);
  rotate_on_next = 1;
  EXPECT_EQ(client->Get("/c", absl::Seconds(5))->http_status, 200);  // 401, re-read, retried
  auto requests = server.requests();
  ASSERT_EQ(requests.size(), 4u);
  EXPECT_THAT(requests[1], HasSubstr("Bearer token-2"));
  EXPECT_THAT(requests[2], HasSubstr("Bearer token-2"));
  EXPECT_THAT(requests[3], HasSubstr("Bearer token-3"));

  // The same for a watch.
  rotate_on_next = 1;
  Lines lines;
  std::atomic<bool> stop{false};
  absl::Status watched = client->Watch("/w", Limits(), lines.on_line, stop, lines.Hooks());
  EXPECT_TRUE(watched.ok()) << watched;

  EXPECT_THAT(server.requests().back(), HasSubstr("Bearer token-4"));

  // A file that disappears: the last token read is used. A wrong token stays a 401.
  ASSERT_EQ(std::remove(token_file.c_str()), 0);
  auto after_remove = client->Get("/d", absl::Seconds(5));
  ASSERT_TRUE(after_remove.ok());
  EXPECT_THAT(server.requests().back(), HasSubstr("Bearer token-4"));
  ASSERT_TRUE(WriteFileAtomically(token_file, "token-5").ok());
  Server strict([](int fd, const std::string&) { SendAll(fd, Answer(401, "{}")); });
  KubeApiConfig strict_config;
  strict_config.token_file = token_file;
  auto strict_client = strict.Client(strict_config);
  EXPECT_EQ(strict_client->Get("/e", absl::Seconds(5))->http_status, 401);
  EXPECT_EQ(strict.requests().size(), 1u);  // same token after re-reading: no retry
  absl::Status unauthenticated = strict_client->Watch("/w", Limits(), lines.on_line, stop);
  EXPECT_EQ(unauthenticated.code(), absl::StatusCode::kUnauthenticated);

  // A token file that never existed, and no inline token.
  KubeApiConfig missing;
  missing.token_file = dir.File("nope");
  EXPECT_EQ(server.Client(missing)->Get("/f", absl::Seconds(1)).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(KubeClientTest, GetLimitsAndFailures) {
  Server big([](int fd, const std::string&) { SendAll(fd, Answer(200, std::string(4096, 'x'))); });
  KubeClientOptions options;
  options.max_body_bytes = 1000;
  EXPECT_EQ(big.Client({}, options)->Get("/", absl::Seconds(5)).status().code(), absl::StatusCode::kResourceExhausted);

  Server silent([](int fd, const std::string&) { eldr::testing::WaitForPeerClose(fd, absl::Seconds(10)); });
  absl::Time start = absl::Now();
  auto timed_out = silent.Client()->Get("/", absl::Milliseconds(300));
  EXPECT_EQ(timed_out.status().code(), absl::StatusCode::kDeadlineExceeded) << timed_out.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));

  std::atomic<bool> stop{false};
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(200));
    stop = true;
  });
  start = absl::Now();
  auto cancelled = silent.Client()->Get("/", absl::Seconds(30), &stop);
  const absl::Duration took = absl::Now() - start;
  stopper.join();
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(took, absl::Milliseconds(200 + 150));

  KubeApiConfig refused;
  absl::StatusOr<eldr::testing::ReservedLoopbackPort> dead = eldr::testing::ReservedLoopbackPort::Create();
  ASSERT_TRUE(dead.ok()) << dead.status();
  refused.server = absl::StrCat("http://", dead->address());
  auto client = *KubeClient::Create(refused);
  auto unreachable = client->Get("/", absl::Seconds(2));
  EXPECT_EQ(unreachable.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(unreachable.status().message(), HasSubstr("refused or unreachable"));
}

TEST(KubeClientTest, WatchSplitsLinesAcrossAndWithinReads) {
  const std::string first = R"({"type":"ADDED","object":{"metadata":{"name":"a"}}})";
  const std::string second = R"({"type":"MODIFIED","object":{"metadata":{"name":"b"}}})";
  const std::string third = R"({"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"9"}}})";
  Server server([&](int fd, const std::string&) {
    SendAll(fd, kChunkedHead);
    // The first event byte by byte in 1-byte chunks...
    for (char c : first) {
      SendAll(fd, Chunk(std::string(1, c)));
      absl::SleepFor(absl::Microseconds(200));
    }
    SendAll(fd, Chunk("\n"));
    absl::SleepFor(absl::Milliseconds(20));
    // ... then two events (one with CRLF) and blank lines in one chunk, and a split across two.
    SendAll(fd, Chunk(absl::StrCat(second, "\r\n\n", third, "\n", first.substr(0, 10))));
    absl::SleepFor(absl::Milliseconds(20));
    SendAll(fd, Chunk(absl::StrCat(first.substr(10), "\n")));
    absl::SleepFor(absl::Milliseconds(20));
    // A last event without its newline, then a clean end.
    SendAll(fd, Chunk(third));
    SendAll(fd, "0\r\n\r\n");
  });
  auto client = server.Client();
  Lines lines;
  std::atomic<bool> stop{false};
  absl::Status status = client->Watch("/api/v1/pods?watch=1", Limits(), lines.on_line, stop, lines.Hooks());
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_THAT(lines.lines, ElementsAre(first, second, third, first, third));
  EXPECT_EQ(lines.opens, 1);
  EXPECT_GE(lines.batches, 3);
  EXPECT_LT(lines.batches, 5);  // second and third arrived together: one batch
}

TEST(KubeClientTest, WatchEndsWhenTheCallbackSaysSo) {
  Server server([](int fd, const std::string&) {
    SendAll(fd, kChunkedHead);
    SendAll(fd, Chunk("{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n"));
    eldr::testing::WaitForPeerClose(fd, absl::Seconds(10));
  });
  std::vector<std::string> seen;
  std::atomic<bool> stop{false};
  absl::Status status = server.Client()->Watch(
      "/w", Limits(),
      [&](absl::string_view line) {
        seen.emplace_back(line);
        return seen.size() < 2;
      },
      stop);
  EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(seen.size(), 2u);
}

TEST(KubeClientTest, WatchSilenceAndStop) {
  Server server([](int fd, const std::string&) {
    SendAll(fd, kChunkedHead);
    SendAll(fd, Chunk("{\"n\":1}\n"));
    eldr::testing::WaitForPeerClose(fd, absl::Seconds(10));
  });
  auto client = server.Client();
  Lines lines;
  std::atomic<bool> stop{false};
  absl::Time start = absl::Now();
  absl::Status silent = client->Watch("/w", Limits(absl::Milliseconds(400)), lines.on_line, stop);
  absl::Duration took = absl::Now() - start;
  EXPECT_EQ(silent.code(), absl::StatusCode::kDeadlineExceeded) << silent;
  EXPECT_THAT(silent.message(), HasSubstr("silent"));
  EXPECT_GE(took, absl::Milliseconds(400));
  EXPECT_LT(took, absl::Milliseconds(400 + 300));
  EXPECT_EQ(lines.lines.size(), 1u);

  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(300));
    stop = true;
  });
  start = absl::Now();
  absl::Status cancelled = client->Watch("/w", Limits(absl::Seconds(30)), lines.on_line, stop);
  took = absl::Now() - start;
  stopper.join();
  EXPECT_EQ(cancelled.code(), absl::StatusCode::kCancelled) << cancelled;
  EXPECT_LT(took, absl::Milliseconds(300 + 100));
}

TEST(KubeClientTest, WatchHttpErrors) {
  struct Case {
    int status;
    absl::StatusCode code;
  };
  for (const Case& c :
       {Case{401, absl::StatusCode::kUnauthenticated}, Case{403, absl::StatusCode::kPermissionDenied},
        Case{404, absl::StatusCode::kNotFound}, Case{410, kGoneCode}, Case{429, absl::StatusCode::kUnavailable},
        Case{500, absl::StatusCode::kUnavailable}, Case{503, absl::StatusCode::kUnavailable}}) {
    Server server([&](int fd, const std::string&) {
      SendAll(fd, Answer(c.status, absl::StrCat(R"({"kind":"Status","status":"Failure","message":"injected )", c.status,
                                                R"(","code":)", c.status, "}")));
    });
    Lines lines;
    std::atomic<bool> stop{false};
    absl::Status status = server.Client()->Watch("/w", Limits(), lines.on_line, stop, lines.Hooks());
    EXPECT_EQ(status.code(), c.code) << c.status << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("HTTP ", c.status, ": injected ", c.status)));
    EXPECT_EQ(HttpStatusOf(status), c.status);
    EXPECT_TRUE(lines.lines.empty());
    EXPECT_EQ(lines.opens, 0);
  }
}

TEST(KubeClientTest, WatchDroppedMidStreamIsUnavailable) {
  Server server([](int fd, const std::string&) {
    SendAll(fd, kChunkedHead);
    SendAll(fd, Chunk("{\"n\":1}\n{\"n\":"));
    absl::SleepFor(absl::Milliseconds(50));
    shutdown(fd, SHUT_RDWR);  // no terminating chunk
  });
  Lines lines;
  std::atomic<bool> stop{false};
  absl::Status status = server.Client()->Watch("/w", Limits(), lines.on_line, stop);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(status.message(), HasSubstr("lost"));
  EXPECT_THAT(lines.lines, ElementsAre("{\"n\":1}"));  // the partial line is never delivered
}

TEST(KubeClientTest, WatchLineLimit) {
  Server server([](int fd, const std::string&) {
    SendAll(fd, kChunkedHead);
    SendAll(fd, Chunk("{\"ok\":1}\n"));
    for (int i = 0; i < 4; ++i) SendAll(fd, Chunk(std::string(500, 'x')));
    eldr::testing::WaitForPeerClose(fd, absl::Seconds(5));
  });
  Lines lines;
  std::atomic<bool> stop{false};
  absl::Status status = server.Client()->Watch("/w", Limits(), lines.on_line, stop);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_EQ(lines.lines.size(), 1u);
}

TEST(KubeClientTest, ConnectionFailures) {
  KubeApiConfig refused;
  absl::StatusOr<eldr::testing::ReservedLoopbackPort> dead = eldr::testing::ReservedLoopbackPort::Create();
  ASSERT_TRUE(dead.ok()) << dead.status();
  refused.server = absl::StrCat("https://", dead->address());
  auto client = *KubeClient::Create(refused);
  Lines lines;
  std::atomic<bool> stop{false};
  absl::Status status = client->Watch("/w", Limits(), lines.on_line, stop);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(), HasSubstr("refused"));

  // TLS to a server that speaks plain HTTP (at once, without waiting for a request).
  RawHttpServer plain([](int fd, int) {
    SendAll(fd, Answer(400, "not TLS"));
    eldr::testing::WaitForPeerClose(fd, absl::Seconds(5));
  });
  KubeApiConfig tls;
  tls.server = absl::StrCat("https://127.0.0.1:", plain.port());
  auto tls_client = *KubeClient::Create(tls);
  absl::Status handshake = tls_client->Watch("/w", Limits(), lines.on_line, stop);
  EXPECT_EQ(handshake.code(), absl::StatusCode::kUnavailable) << handshake;
  EXPECT_THAT(handshake.message(), HasSubstr("TLS"));

  KubeApiConfig unresolvable;
  unresolvable.server = "https://no-such-host.invalid:443";
  absl::Status dns = (*KubeClient::Create(unresolvable))->Watch("/w", Limits(), lines.on_line, stop);
  EXPECT_EQ(dns.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(dns.message(), HasSubstr("resolve"));

  KubeApiConfig bad;
  bad.server = "ftp://x";
  EXPECT_EQ(KubeClient::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace eldr::discovery
