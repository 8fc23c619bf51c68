// RouteStream messages for the integration tests of DecodeRouter.RouteStream (single messages and
// batches): builders of the two request kinds, one exchange on an open stream, and bounded waits.
#ifndef ELDR_TESTS_INTEGRATION_ROUTE_STREAM_MESSAGES_H_
#define ELDR_TESTS_INTEGRATION_ROUTE_STREAM_MESSAGES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "eldr/v1/router.grpc.pb.h"
#include "gtest/gtest.h"
#include "router_harness.h"

namespace eldr::testing {

using RouteStreamCall = grpc::ClientReaderWriter<eldr::v1::RouteStreamRequest, eldr::v1::RouteStreamResponse>;

// A RouteStream message of id `id` carrying `route`.
inline eldr::v1::RouteStreamRequest RouteMessage(uint64_t id, const eldr::v1::RouteRequest& route) {
  eldr::v1::RouteStreamRequest message;
  message.set_id(id);
  *message.mutable_route() = route;
  return message;
}

// A RouteStream message of id `id` completing `lease`.
inline eldr::v1::RouteStreamRequest CompleteMessage(uint64_t id, uint64_t lease, int64_t output_tokens = 0) {
  eldr::v1::RouteStreamRequest message;
  message.set_id(id);
  message.mutable_complete()->set_lease_id(lease);
  message.mutable_complete()->set_output_tokens(output_tokens);
  return message;
}

// A RouteStream call open on a router, with the stub and the context (Ctx's 10 s deadline) it
// needs, declared in the order they must outlive each other. Taken apart where it is opened:
// `auto [stub, ctx, stream] = OpenRouteStream(*router);`.
struct OpenedRouteStream {
  std::unique_ptr<eldr::v1::DecodeRouter::Stub> stub;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<RouteStreamCall> stream;
};

inline OpenedRouteStream OpenRouteStream(const RouterProcess& router) {
  OpenedRouteStream opened{router.RouterStub(), Ctx(), nullptr};
  opened.stream = opened.stub->RouteStream(opened.ctx.get());
  return opened;
}

// One message written and its one answer read (the stream must still be open); the answer must
// carry the message's id.
inline eldr::v1::RouteStreamResponse Exchange(RouteStreamCall* stream, const eldr::v1::RouteStreamRequest& message) {
  eldr::v1::RouteStreamResponse answer;
  EXPECT_TRUE(stream->Write(message)) << "the stream closed";
  EXPECT_TRUE(stream->Read(&answer)) << "the stream closed";
  EXPECT_EQ(answer.id(), message.id());
  return answer;
}

// Polls until `done` holds (bounded; a test failure otherwise).
template <typename Predicate>
void WaitUntil(Predicate done, const std::string& what, absl::Duration timeout = absl::Seconds(10)) {
  if (!PollUntil(std::move(done), timeout, absl::Milliseconds(10))) ADD_FAILURE() << "timed out waiting for " << what;
}

}  // namespace eldr::testing

#endif  // ELDR_TESTS_INTEGRATION_ROUTE_STREAM_MESSAGES_H_
