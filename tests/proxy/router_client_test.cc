// eldr-proxy's RouterClient against an in-process DecodeRouter (a real gRPC server on loopback):
// the RouteStream transport's message matching, error mapping, concurrency, broken streams and
// shutdown, beside the unary transport. The whole proxy against real routers:
// proxy_integration_test.cc.
#include "proxy/router_client.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "eldr/v1/router.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace eldr::proxy {
namespace {

using ::testing::HasSubstr;

// gRPC's shared callback completion queue (Debian's gRPC 1.51 runs callback calls on its
// "alternative" queue and its own threads) stays up for the whole binary, as in eldr-proxy, where
// one RouterClient lives as long as the process. Otherwise the queue is torn down with the last
// channel and built again with the next one, and that cycle double-frees inside libgrpc
// (grpc_cq_internal_unref, seen under ASan after a few tests of either transport).
class KeepCallbackQueueAlive : public ::testing::Environment {
 public:
  void SetUp() override {
    static auto* channel =
        new std::shared_ptr<grpc::Channel>(grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials()));
    static auto* stub = eldr::v1::DecodeRouter::NewStub(*channel).release();
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    eldr::v1::CompleteRequest request;
    eldr::v1::CompleteResponse response;
    absl::Notification done;
    stub->async()->Complete(&context, &request, &response, [&](grpc::Status) { done.Notify(); });
    done.WaitForNotification();
  }
};
const ::testing::Environment* const kKeepCallbackQueueAlive =
    ::testing::AddGlobalTestEnvironment(new KeepCallbackQueueAlive);

// Route request ids the fake treats apart.
constexpr char kReject[] = "reject";  // INVALID_ARGUMENT, as a bad signature
constexpr char kSilent[] = "silent";  // never answered (RouteStream only)

// Answers Route and Complete (unary and as RouteStream messages) the same way: a lease per route,
// NOT_FOUND for an unknown lease. With break_after > 0, each RouteStream ends UNAVAILABLE after
// reading that many messages, answering only the first half of them.
class FakeRouter final : public eldr::v1::DecodeRouter::Service {
 public:
  explicit FakeRouter(int break_after = 0) : break_after_(break_after) {}

  grpc::Status Route(grpc::ServerContext*, const eldr::v1::RouteRequest* request,
                     eldr::v1::RouteResponse* response) override {
    return DoRoute(*request, response);
  }
  grpc::Status Complete(grpc::ServerContext*, const eldr::v1::CompleteRequest* request,
                        eldr::v1::CompleteResponse* response) override {
    return DoComplete(*request, response);
  }
  grpc::Status RouteStream(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<eldr::v1::RouteStreamResponse, eldr::v1::RouteStreamRequest>* stream) override {
    {
      absl::MutexLock lock(&mu_);
      ++streams_;
    }
    eldr::v1::RouteStreamRequest message;
    int read = 0;
    while (stream->Read(&message)) {
      ++read;
      if (break_after_ > 0 && read > break_after_ / 2) {
        if (read >= break_after_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the fake breaks its stream");
        continue;
      }
      eldr::v1::RouteStreamResponse answer;
      answer.set_id(message.id());
      grpc::Status status;
      if (message.has_route()) {
        if (message.route().request_id() == kSilent) continue;
        status = DoRoute(message.route(), answer.mutable_route());
      } else {
        status = DoComplete(message.complete(), answer.mutable_complete());
      }
      if (!status.ok()) {
        answer.mutable_error()->set_code(status.error_code());
        answer.mutable_error()->set_message(status.error_message());
      } else if (message.errors_only()) {
        continue;  // as eldr-router: an errors_only message that succeeded is not answered
      }
      stream->Write(answer);
    }
    return grpc::Status::OK;
  }

  int streams() const {
    absl::MutexLock lock(&mu_);
    return streams_;
  }
  int64_t live_leases() const {
    absl::MutexLock lock(&mu_);
    return live_leases_;
  }

 private:
  grpc::Status DoRoute(const eldr::v1::RouteRequest& request, eldr::v1::RouteResponse* response) {
    if (request.request_id() == kReject) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "counts: 3 layers, the artifact has 26");
    }
    absl::MutexLock lock(&mu_);
    ++live_leases_;
    response->set_worker_id("d0");
    response->set_address("127.0.0.1:8200");
    response->set_lease_id(next_lease_++);
    response->set_policy("jsq");
    return grpc::Status::OK;
  }
  grpc::Status DoComplete(const eldr::v1::CompleteRequest& request, eldr::v1::CompleteResponse* response) {
    absl::MutexLock lock(&mu_);
    if (request.lease_id() == 0 || request.lease_id() >= next_lease_) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("lease ", request.lease_id(), " is unknown"));
    }
    --live_leases_;
    response->set_worker_id("d0");
    return grpc::Status::OK;
  }

  const int break_after_;
  mutable absl::Mutex mu_;
  uint64_t next_lease_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t live_leases_ ABSL_GUARDED_BY(mu_) = 0;
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
};

class Server {
 public:
  explicit Server(FakeRouter* service) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
  }
  ~Server() { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200)); }
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

std::unique_ptr<RouterClient> NewClient(const std::string& target, RouterApi api, int streams = 1,
                                        absl::Duration route_timeout = absl::Seconds(5),
                                        bool complete_errors_only = false,
                                        absl::Duration complete_timeout = absl::Seconds(2)) {
  RouterClientOptions options;
  options.target = target;
  options.api = api;
  options.streams = streams;
  options.route_timeout = route_timeout;
  options.complete_errors_only = complete_errors_only;
  options.complete_timeout = complete_timeout;
  absl::StatusOr<std::unique_ptr<RouterClient>> client = RouterClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return *std::move(client);
}

absl::StatusOr<eldr::v1::RouteResponse> RouteAndWait(RouterClient& client, const std::string& request_id) {
  eldr::v1::RouteRequest request;
  request.set_request_id(request_id);
  absl::Mutex mu;
  std::optional<absl::StatusOr<eldr::v1::RouteResponse>> result;
  client.Route(request, [&](absl::StatusOr<eldr::v1::RouteResponse> routed) {
    absl::MutexLock lock(&mu);
    result = std::move(routed);
  });
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](std::optional<absl::StatusOr<eldr::v1::RouteResponse>>* r) { return r->has_value(); }, &result));
  return *result;
}

absl::Status CompleteAndWait(RouterClient& client, uint64_t lease) {
  absl::Mutex mu;
  std::optional<absl::Status> result;
  client.Complete(lease, 4, [&](absl::Status status) {
    absl::MutexLock lock(&mu);
    result = std::move(status);
  });
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](std::optional<absl::Status>* r) { return r->has_value(); }, &result));
  return *result;
}

TEST(StatusOfStreamAnswer, ErrorsBecomeTheUnaryStatusAndMismatchesAreInternal) {
  using Request = eldr::v1::RouteStreamRequest;
  eldr::v1::RouteStreamResponse answer;
  answer.mutable_error()->set_code(static_cast<int>(absl::StatusCode::kNotFound));
  answer.mutable_error()->set_message("lease 7 is unknown");
  EXPECT_EQ(StatusOfStreamAnswer(answer, Request::kComplete), absl::NotFoundError("lease 7 is unknown"));
  answer.mutable_error()->set_code(0);  // an error that would read as success
  EXPECT_EQ(StatusOfStreamAnswer(answer, Request::kComplete).code(), absl::StatusCode::kUnknown);
  answer.mutable_error()->set_code(99);
  EXPECT_EQ(StatusOfStreamAnswer(answer, Request::kComplete).code(), absl::StatusCode::kUnknown);
  answer.mutable_route()->set_lease_id(3);
  EXPECT_TRUE(StatusOfStreamAnswer(answer, Request::kRoute).ok());
  EXPECT_EQ(StatusOfStreamAnswer(answer, Request::kComplete).code(), absl::StatusCode::kInternal);
  answer.clear_result();
  EXPECT_EQ(StatusOfStreamAnswer(answer, Request::kRoute).code(), absl::StatusCode::kInternal);
}

TEST(ParseRouterApi, StreamOrUnary) {
  EXPECT_EQ(ParseRouterApi("stream").value(), RouterApi::kStream);
  EXPECT_EQ(ParseRouterApi("unary").value(), RouterApi::kUnary);
  EXPECT_THAT(ParseRouterApi("grpc").status().message(), HasSubstr("stream or unary"));
}

// A caller sees the same results, errors included, on either transport.
TEST(RouterClient, StreamAndUnaryGiveTheSameResults) {
  FakeRouter fake;
  Server server(&fake);
  for (RouterApi api : {RouterApi::kStream, RouterApi::kUnary}) {
    SCOPED_TRACE(api == RouterApi::kStream ? "stream" : "unary");
    std::unique_ptr<RouterClient> client = NewClient(server.target(), api);
    absl::StatusOr<eldr::v1::RouteResponse> routed = RouteAndWait(*client, "r1");
    ASSERT_TRUE(routed.ok()) << routed.status();
    EXPECT_EQ(routed->worker_id(), "d0");
    EXPECT_NE(routed->lease_id(), 0u);
    EXPECT_TRUE(CompleteAndWait(*client, routed->lease_id()).ok());
    EXPECT_EQ(RouteAndWait(*client, kReject).status(),
              absl::InvalidArgumentError("counts: 3 layers, the artifact has 26"));
    EXPECT_EQ(CompleteAndWait(*client, 1 << 30), absl::NotFoundError(absl::StrCat("lease ", 1 << 30, " is unknown")));
  }
  EXPECT_EQ(fake.streams(), 1);
  EXPECT_EQ(fake.live_leases(), 0);
}

// Many messages from several threads over several streams: each callback runs once, with the
// answer to its own message.
TEST(RouterClient, ConcurrentMessagesAreEachAnsweredOnce) {
  FakeRouter fake;
  Server server(&fake);
  std::unique_ptr<RouterClient> client = NewClient(server.target(), RouterApi::kStream, /*streams=*/3);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 250;
  std::atomic<int> ok{0};
  std::atomic<int> callbacks{0};
  absl::BlockingCounter done(kThreads * kPerThread * 2);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        eldr::v1::RouteRequest request;
        client->Route(request, [&](absl::StatusOr<eldr::v1::RouteResponse> routed) {
          callbacks.fetch_add(1);
          if (routed.ok()) {
            ok.fetch_add(1);
            client->Complete(routed->lease_id(), 1, [&](absl::Status status) {
              callbacks.fetch_add(1);
              if (status.ok()) ok.fetch_add(1);
              done.DecrementCount();
            });
          } else {
            done.DecrementCount();
          }
          done.DecrementCount();
        });
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  done.Wait();
  EXPECT_EQ(ok.load(), kThreads * kPerThread * 2);
  EXPECT_EQ(callbacks.load(), kThreads * kPerThread * 2);
  EXPECT_EQ(fake.streams(), 3);
  EXPECT_EQ(fake.live_leases(), 0);
}

// Streams that break mid-way: every message still gets exactly one result (its answer;
// UNAVAILABLE when its stream ended first; DEADLINE_EXCEEDED when it sits unanswered on a stream
// that does not break), and the client re-opens streams.
TEST(RouterClient, MessagesOfABrokenStreamFailUnavailableOnce) {
  FakeRouter fake(/*break_after=*/20);
  Server server(&fake);
  // The messages a stream read past its answered half and before its break are never answered.
  std::unique_ptr<RouterClient> client =
      NewClient(server.target(), RouterApi::kStream, /*streams=*/2, /*route_timeout=*/absl::Seconds(1));
  constexpr int kMessages = 400;
  absl::Mutex mu;
  int results = 0;
  int ok = 0;
  int unavailable = 0;
  int deadline_exceeded = 0;
  for (int i = 0; i < kMessages; ++i) {
    eldr::v1::RouteRequest request;
    client->Route(request, [&](absl::StatusOr<eldr::v1::RouteResponse> routed) {
      absl::MutexLock lock(&mu);
      ++results;
      if (routed.ok()) ++ok;
      if (absl::IsUnavailable(routed.status())) ++unavailable;
      if (absl::IsDeadlineExceeded(routed.status())) ++deadline_exceeded;
    });
    if (i % 50 == 0) absl::SleepFor(absl::Milliseconds(60));  // past the re-open backoff now and then
  }
  {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(absl::Condition(
                            +[](int* r) { return *r >= kMessages; }, &results),
                        absl::Seconds(30));
    EXPECT_EQ(results, kMessages);
    EXPECT_EQ(ok + unavailable + deadline_exceeded, kMessages);
    EXPECT_GT(ok, 0);
    EXPECT_GT(unavailable, 0);
  }
  EXPECT_GT(fake.streams(), 2);
  client.reset();  // must not hang on the streams
  absl::MutexLock lock(&mu);
  EXPECT_EQ(results, kMessages);  // and nothing ran twice
}

// A message the router never answers fails at its deadline; the client still shuts down.
TEST(RouterClient, AnUnansweredMessageFailsAtItsDeadline) {
  FakeRouter fake;
  Server server(&fake);
  std::unique_ptr<RouterClient> client =
      NewClient(server.target(), RouterApi::kStream, 1, /*route_timeout=*/absl::Milliseconds(200));
  const absl::Time start = absl::Now();
  const absl::Status silent = RouteAndWait(*client, kSilent).status();
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(silent.code(), absl::StatusCode::kDeadlineExceeded) << silent;
  EXPECT_GE(took, absl::Milliseconds(190));
  EXPECT_LT(took, absl::Seconds(2));
  EXPECT_TRUE(RouteAndWait(*client, "after").ok());  // the stream goes on
  EXPECT_EQ(fake.streams(), 1);
}

// complete_errors_only: a Complete is known done when a later message of its stream is answered,
// fails with the router's error when it fails, and is taken as done at its deadline when no error
// came for it; every lease is released.
TEST(RouterClient, ErrorsOnlyCompletesAreConfirmedByLaterAnswersOrTheirDeadline) {
  FakeRouter fake;
  Server server(&fake);
  std::unique_ptr<RouterClient> client = NewClient(server.target(), RouterApi::kStream, 1, absl::Seconds(5),
                                                   /*complete_errors_only=*/true, absl::Milliseconds(300));
  absl::StatusOr<eldr::v1::RouteResponse> first = RouteAndWait(*client, "first");
  ASSERT_TRUE(first.ok()) << first.status();
  absl::Mutex mu;
  std::optional<absl::Status> completed;
  const absl::Time sent = absl::Now();
  client->Complete(first->lease_id(), 4, [&](absl::Status status) {
    absl::MutexLock lock(&mu);
    completed = status;
  });
  // The next Route's answer confirms the Complete before its own callback runs.
  absl::StatusOr<eldr::v1::RouteResponse> second = RouteAndWait(*client, "second");
  ASSERT_TRUE(second.ok()) << second.status();
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(completed.has_value()) << "not confirmed by the later answer";
    EXPECT_TRUE(completed->ok()) << *completed;
  }
  EXPECT_LT(absl::Now() - sent, absl::Milliseconds(300));
  EXPECT_EQ(fake.live_leases(), 1);

  // A failing one comes back with the router's error.
  EXPECT_EQ(CompleteAndWait(*client, 987654321).code(), absl::StatusCode::kNotFound);

  // The last one, with nothing after it: done OK at its deadline, not DEADLINE_EXCEEDED.
  const absl::Time last = absl::Now();
  EXPECT_TRUE(CompleteAndWait(*client, second->lease_id()).ok());
  EXPECT_GE(absl::Now() - last, absl::Milliseconds(250));
  EXPECT_EQ(fake.live_leases(), 0);
  EXPECT_EQ(fake.streams(), 1);
}

}  // namespace
}  // namespace eldr::proxy
