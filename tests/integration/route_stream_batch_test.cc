// DecodeRouter.RouteStream batches (RouteStreamBatch) against the real daemon: a batch's entries
// answered in one message, in order, each with its id and exactly the answer (decision, error code
// and message, metrics) it would get as a message of its own or a unary RPC; a bad entry fails
// alone; the --max_stream_batch limit, nested and empty batches; single messages and the unary RPCs
// unchanged beside batches; the leases of a batch answer that a cancelled stream never delivered.
#include <atomic>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "eldr/v1/router.grpc.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "route_stream_messages.h"
#include "router_harness.h"

namespace eldr::testing {
namespace {

using ::eldr::v1::CompleteRequest;
using ::eldr::v1::RouteRequest;
using ::eldr::v1::RouteResponse;
using ::eldr::v1::RouteStreamRequest;
using ::eldr::v1::RouteStreamResponse;
using ::testing::HasSubstr;

using Stream = RouteStreamCall;

// One RouteStream message of id `id` carrying `entries` as a batch.
RouteStreamRequest Batch(uint64_t id, std::vector<RouteStreamRequest> entries) {
  RouteStreamRequest message;
  message.set_id(id);
  auto* batch = message.mutable_batch();  // set even when `entries` is empty
  for (RouteStreamRequest& entry : entries) *batch->add_requests() = std::move(entry);
  return message;
}

// A batch written and answered: the answer must be a batch of as many entries, each with the id of
// its request, in order.
RouteStreamResponse ExchangeBatch(Stream* stream, const RouteStreamRequest& message) {
  RouteStreamResponse answer = Exchange(stream, message);
  EXPECT_TRUE(answer.has_batch()) << (answer.has_error() ? answer.error().message() : "not a batch");
  EXPECT_EQ(answer.batch().responses_size(), message.batch().requests_size());
  for (int i = 0; i < std::min(answer.batch().responses_size(), message.batch().requests_size()); ++i) {
    EXPECT_EQ(answer.batch().responses(i).id(), message.batch().requests(i).id()) << "entry " << i;
  }
  return answer;
}

double StreamMessages(const RouterProcess& router, const std::string& kind, const std::string& outcome) {
  return Scraped(router, "eldr_route_stream_messages_total", {{"kind", kind}, {"outcome", outcome}});
}

// ---------------------------------------------------------------------------------------------

TEST(RouteStreamBatch, RoutesAndCompletesAreAnsweredInOneMessageInOrder) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();

  // The unary decision of a vector signature on an idle pool, for comparison.
  RouteRequest vector;
  for (int i = 0; i < kLayers * kExperts; ++i) vector.mutable_vector()->add_values(i % kExperts < 16 ? 1.f : 0.f);
  RouteResponse unary;
  {
    auto ctx = Ctx();
    ASSERT_TRUE(stub->Route(ctx.get(), vector, &unary).ok());
    CompleteRequest complete;
    complete.set_lease_id(unary.lease_id());
    eldr::v1::CompleteResponse released;
    auto complete_ctx = Ctx();
    ASSERT_TRUE(stub->Complete(complete_ctx.get(), complete, &released).ok());
  }

  auto ctx = Ctx();
  std::unique_ptr<Stream> stream = stub->RouteStream(ctx.get());
  // The vector first (the pool is idle for it, as for the unary call), then block i % 4: band of
  // one, w<i % 4> whatever the load.
  constexpr int kRoutes = 12;
  std::vector<RouteStreamRequest> entries = {RouteMessage(100, vector)};
  for (int i = 1; i < kRoutes; ++i) entries.push_back(RouteMessage(100 + i, BlockRequest(i % 4)));
  const RouteStreamResponse routed = ExchangeBatch(stream.get(), Batch(7, entries));
  ASSERT_EQ(routed.batch().responses_size(), kRoutes);
  std::vector<uint64_t> leases;
  for (int i = 0; i < kRoutes; ++i) {
    const RouteStreamResponse& r = routed.batch().responses(i);
    ASSERT_TRUE(r.has_route()) << "entry " << i << ": " << r.error().message();
    if (i == 0) {
      EXPECT_EQ(r.route().worker_id(), unary.worker_id());
      EXPECT_EQ(r.route().address(), unary.address());
      EXPECT_FLOAT_EQ(r.route().similarity(), unary.similarity());
      EXPECT_EQ(r.route().band_size(), unary.band_size());
      EXPECT_EQ(r.route().policy(), unary.policy());
      EXPECT_EQ(r.route().fallback_reason(), unary.fallback_reason());
      EXPECT_EQ(r.route().centroid_generation(), unary.centroid_generation());
    } else {
      EXPECT_EQ(r.route().worker_id(), absl::StrCat("w", i % 4)) << "entry " << i;
    }
    EXPECT_NE(r.route().lease_id(), 0u);
    for (uint64_t earlier : leases) EXPECT_NE(r.route().lease_id(), earlier) << "entry " << i;
    leases.push_back(r.route().lease_id());
  }
  EXPECT_EQ(State(*router).live_leases(), kRoutes);

  // A single message right after: the batch was answered by exactly one message.
  const RouteStreamResponse single = Exchange(stream.get(), RouteMessage(50, BlockRequest(3)));
  ASSERT_TRUE(single.has_route()) << single.error().message();
  EXPECT_EQ(single.route().worker_id(), "w3");

  // Completes in one batch; then a batch that mixes a Route and the Complete of an older lease.
  std::vector<RouteStreamRequest> completes;
  for (int i = 0; i < kRoutes; ++i) completes.push_back(CompleteMessage(200 + i, leases[i], 10));
  const RouteStreamResponse released = ExchangeBatch(stream.get(), Batch(8, completes));
  ASSERT_EQ(released.batch().responses_size(), kRoutes);
  for (int i = 0; i < kRoutes; ++i) {
    const RouteStreamResponse& r = released.batch().responses(i);
    ASSERT_TRUE(r.has_complete()) << "entry " << i << ": " << r.error().message();
    EXPECT_EQ(r.complete().worker_id(), routed.batch().responses(i).route().worker_id());
  }
  const RouteStreamResponse mixed = ExchangeBatch(
      stream.get(), Batch(9, {RouteMessage(300, BlockRequest(1)), CompleteMessage(301, single.route().lease_id())}));
  ASSERT_EQ(mixed.batch().responses_size(), 2);
  ASSERT_TRUE(mixed.batch().responses(0).has_route());
  EXPECT_EQ(mixed.batch().responses(0).route().worker_id(), "w1");
  ASSERT_TRUE(mixed.batch().responses(1).has_complete());
  EXPECT_EQ(mixed.batch().responses(1).complete().worker_id(), "w3");
  ASSERT_TRUE(
      Exchange(stream.get(), CompleteMessage(51, mixed.batch().responses(0).route().lease_id())).has_complete());

  // Pipelined batches, written before any answer is read: answers come in order.
  constexpr int kBatches = 40;
  constexpr int kPerBatch = 16;
  std::thread writer([&] {
    for (int b = 0; b < kBatches; ++b) {
      std::vector<RouteStreamRequest> batch;
      for (int i = 0; i < kPerBatch; ++i) batch.push_back(RouteMessage(10000 * (b + 1) + i, BlockRequest((b + i) % 4)));
      ASSERT_TRUE(stream->Write(Batch(1000 + b, std::move(batch))));
    }
    stream->WritesDone();
  });
  std::vector<uint64_t> pipelined;
  for (int b = 0; b < kBatches; ++b) {
    RouteStreamResponse answer;
    ASSERT_TRUE(stream->Read(&answer));
    ASSERT_EQ(answer.id(), 1000u + b) << "answers out of order";
    ASSERT_EQ(answer.batch().responses_size(), kPerBatch);
    for (int i = 0; i < kPerBatch; ++i) {
      const RouteStreamResponse& r = answer.batch().responses(i);
      ASSERT_EQ(r.id(), 10000u * (b + 1) + i);
      ASSERT_TRUE(r.has_route()) << r.error().message();
      EXPECT_EQ(r.route().worker_id(), absl::StrCat("w", (b + i) % 4));
      pipelined.push_back(r.route().lease_id());
    }
  }
  writer.join();
  RouteStreamResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(State(*router).live_leases(), kBatches * kPerBatch);

  // Every entry counted as a message of its own kind, every route as a route; the batches and
  // their sizes in their own series.
  const int routes = kRoutes + 1 + 1 + kBatches * kPerBatch;  // the batch, the single, the mix, the pipeline
  auto metrics = ScrapeMetrics(router->metrics_port());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(metrics->Value("eldr_route_stream_messages_total", {{"kind", "route"}, {"outcome", "ok"}}), routes);
  EXPECT_EQ(metrics->Value("eldr_route_stream_messages_total", {{"kind", "complete"}, {"outcome", "ok"}}), kRoutes + 2);
  EXPECT_EQ(metrics->Value("eldr_route_duration_seconds_count"), routes + 1);  // + the unary one
  EXPECT_EQ(metrics->Value("eldr_route_requests_total", {{"policy", "eldr"}, {"outcome", "ok"}}), routes + 1);
  EXPECT_EQ(metrics->Value("eldr_complete_requests_total", {{"outcome", "released"}}), kRoutes + 2 + 1);
  EXPECT_EQ(metrics->Value("eldr_route_stream_batches_total", {{"outcome", "answered"}}), 3 + kBatches);
  EXPECT_EQ(metrics->Value("eldr_route_stream_batches_total", {{"outcome", "refused"}}), 0);
  EXPECT_EQ(metrics->types.at("eldr_route_stream_batches_total"), "counter");
  EXPECT_EQ(metrics->types.at("eldr_route_stream_batch_size"), "histogram");
  EXPECT_EQ(metrics->Value("eldr_route_stream_batch_size_count"), 3 + kBatches);
  EXPECT_EQ(metrics->Value("eldr_route_stream_batch_size_sum"), 2 * kRoutes + 2 + kBatches * kPerBatch);
  EXPECT_EQ(metrics->Value("eldr_route_stream_batch_size_bucket", {{"le", "2"}}), 1);  // the mix
  EXPECT_EQ(metrics->Value("eldr_route_stream_batch_size_bucket", {{"le", "8"}}), 1);
  EXPECT_EQ(metrics->Value("eldr_route_stream_batch_size_bucket", {{"le", "16"}}), 3 + kBatches);
}

TEST(RouteStreamBatch, ABadEntryFailsAloneWithTheUnaryError) {
  TempDir dir;
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--max_message_bytes=12288");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();

  RouteRequest geometry;
  geometry.mutable_counts()->set_layers(3);
  geometry.mutable_counts()->set_experts(3);
  geometry.mutable_counts()->set_int16_le(std::string(18, '\0'));
  RouteRequest negative_prompt = BlockRequest(1);
  negative_prompt.set_prompt_tokens(-5);
  RouteRequest nan;
  for (int i = 0; i < kLayers * kExperts; ++i) {
    nan.mutable_vector()->add_values(i == 3 ? std::numeric_limits<float>::quiet_NaN() : 1.f);
  }
  RouteRequest oversized = BlockRequest(1);  // over --max_message_bytes on its own
  for (int i = 0; i < 60; ++i) oversized.add_exclude_workers(std::string(200, 'a' + i % 26));
  const std::vector<RouteRequest> bad_routes = {geometry, negative_prompt, nan, oversized};
  std::vector<grpc::Status> unary;
  for (const RouteRequest& request : bad_routes) {
    RouteResponse response;
    auto ctx = Ctx();
    unary.push_back(stub->Route(ctx.get(), request, &response));
    ASSERT_FALSE(unary.back().ok());
  }
  CompleteRequest unknown;
  unknown.set_lease_id(12345);
  eldr::v1::CompleteResponse ignored;
  auto unknown_ctx = Ctx();
  const grpc::Status unary_unknown = stub->Complete(unknown_ctx.get(), unknown, &ignored);
  ASSERT_EQ(unary_unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  CompleteRequest negative_tokens;
  negative_tokens.set_lease_id(1);
  negative_tokens.set_output_tokens(-3);
  auto negative_ctx = Ctx();
  const grpc::Status unary_negative = stub->Complete(negative_ctx.get(), negative_tokens, &ignored);
  ASSERT_EQ(unary_negative.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const double geometry_rejections = Scraped(*router, "eldr_rejected_total", {{"reason", "geometry"}});
  const double oversized_rejections = Scraped(*router, "eldr_rejected_total", {{"reason", "oversized"}});
  const double invalid_routes =
      Scraped(*router, "eldr_route_requests_total", {{"policy", "eldr"}, {"outcome", "invalid"}});
  const double not_found = Scraped(*router, "eldr_complete_requests_total", {{"outcome", "not_found"}});
  ASSERT_EQ(geometry_rejections, 1);
  ASSERT_EQ(oversized_rejections, 1);

  // Good and bad entries alternate; the whole message is far over --max_message_bytes (every
  // BlockRequest is 3.3 KB; within the transport's 4x), yet only the entry over it on its own is
  // refused as oversized.
  RouteStreamRequest neither;
  neither.set_id(77);
  std::vector<RouteStreamRequest> entries;
  uint64_t id = 1;
  for (const RouteRequest& bad : bad_routes) {
    entries.push_back(RouteMessage(id++, BlockRequest(2)));
    entries.push_back(RouteMessage(id++, bad));
  }
  entries.push_back(CompleteMessage(id++, 12345));
  entries.push_back(CompleteMessage(id++, 1, -3));
  entries.push_back(neither);
  entries.push_back(RouteMessage(id++, BlockRequest(0)));
  const RouteStreamRequest message = Batch(5, entries);
  ASSERT_GT(message.ByteSizeLong(), 12288u * 2);
  ASSERT_LT(message.ByteSizeLong(), 12288u * 4);
  auto ctx = Ctx();
  std::unique_ptr<Stream> stream = stub->RouteStream(ctx.get());
  const RouteStreamResponse answer = ExchangeBatch(stream.get(), message);
  ASSERT_EQ(answer.batch().responses_size(), static_cast<int>(entries.size()));
  std::vector<uint64_t> leases;
  for (size_t i = 0; i < bad_routes.size(); ++i) {
    const RouteStreamResponse& good = answer.batch().responses(2 * i);
    ASSERT_TRUE(good.has_route()) << "entry " << 2 * i << ": " << good.error().message();
    EXPECT_EQ(good.route().worker_id(), "w2");
    leases.push_back(good.route().lease_id());
    const RouteStreamResponse& bad = answer.batch().responses(2 * i + 1);
    ASSERT_TRUE(bad.has_error()) << "entry " << 2 * i + 1;
    EXPECT_EQ(bad.error().code(), static_cast<int>(unary[i].error_code())) << "entry " << 2 * i + 1;
    EXPECT_EQ(bad.error().message(), unary[i].error_message()) << "entry " << 2 * i + 1;
  }
  const int base = 2 * static_cast<int>(bad_routes.size());
  const RouteStreamResponse& unknown_lease = answer.batch().responses(base);
  ASSERT_TRUE(unknown_lease.has_error());
  EXPECT_EQ(unknown_lease.error().code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_EQ(unknown_lease.error().message(), unary_unknown.error_message());
  const RouteStreamResponse& negative = answer.batch().responses(base + 1);
  ASSERT_TRUE(negative.has_error());
  EXPECT_EQ(negative.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(negative.error().message(), unary_negative.error_message());
  const RouteStreamResponse& empty = answer.batch().responses(base + 2);
  EXPECT_EQ(empty.id(), 77u);
  ASSERT_TRUE(empty.has_error());
  EXPECT_EQ(empty.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(empty.error().message(), HasSubstr("neither route nor complete"));
  const RouteStreamResponse& last = answer.batch().responses(base + 3);
  ASSERT_TRUE(last.has_route()) << last.error().message();
  EXPECT_EQ(last.route().worker_id(), "w0");
  leases.push_back(last.route().lease_id());
  EXPECT_EQ(State(*router).live_leases(), static_cast<int64_t>(leases.size()));

  // The stream goes on; the good entries' leases are released by a batch.
  std::vector<RouteStreamRequest> completes;
  for (size_t i = 0; i < leases.size(); ++i) completes.push_back(CompleteMessage(500 + i, leases[i]));
  const RouteStreamResponse released = ExchangeBatch(stream.get(), Batch(6, completes));
  for (const RouteStreamResponse& r : released.batch().responses()) EXPECT_TRUE(r.has_complete());
  stream->WritesDone();
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(State(*router).live_leases(), 0);

  // The same counters as the unary path moved once more per bad entry.
  EXPECT_EQ(Scraped(*router, "eldr_rejected_total", {{"reason", "geometry"}}), 2 * geometry_rejections);
  EXPECT_EQ(Scraped(*router, "eldr_rejected_total", {{"reason", "oversized"}}), 2 * oversized_rejections);
  EXPECT_EQ(Scraped(*router, "eldr_route_requests_total", {{"policy", "eldr"}, {"outcome", "invalid"}}),
            2 * invalid_routes);
  EXPECT_EQ(Scraped(*router, "eldr_complete_requests_total", {{"outcome", "not_found"}}), 2 * not_found);
  EXPECT_EQ(StreamMessages(*router, "route", "error"), bad_routes.size());
  EXPECT_EQ(StreamMessages(*router, "route", "ok"), leases.size());
  EXPECT_EQ(StreamMessages(*router, "complete", "error"), 2);
  EXPECT_EQ(StreamMessages(*router, "complete", "ok"), leases.size());
  EXPECT_EQ(StreamMessages(*router, "none", "error"), 1);
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batches_total", {{"outcome", "answered"}}), 2);
}

TEST(RouteStreamBatch, ABatchOverTheLimitIsRefusedWholeAndNothingIsHandled) {
  TempDir dir;
  std::vector<std::string> args = StandardArgs(dir);
  args.push_back("--max_stream_batch=4");
  auto router = MustStart(dir, args);
  ASSERT_NE(router, nullptr);
  auto [stub, ctx, stream] = OpenRouteStream(*router);

  std::vector<RouteStreamRequest> five;
  for (int i = 0; i < 5; ++i) five.push_back(RouteMessage(10 + i, BlockRequest(i % 4)));
  const RouteStreamResponse refused = Exchange(stream.get(), Batch(3, five));
  ASSERT_TRUE(refused.has_error()) << "a batch over --max_stream_batch was answered";
  EXPECT_FALSE(refused.has_batch());
  EXPECT_EQ(refused.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(refused.error().message(),
            "RouteStreamBatch holds 5 requests; the router accepts at most 4 in one batch (--max_stream_batch); "
            "none was handled");
  EXPECT_EQ(State(*router).live_leases(), 0) << "an entry of a refused batch was routed";
  EXPECT_EQ(StreamMessages(*router, "route", "ok"), 0);
  EXPECT_EQ(Scraped(*router, "eldr_route_duration_seconds_count"), 0);
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batches_total", {{"outcome", "refused"}}), 1);
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batches_total", {{"outcome", "answered"}}), 0);
  EXPECT_EQ(Scraped(*router, "eldr_rejected_total", {{"reason", "oversized"}}), 1);

  // At the limit, answered in full; the stream went on.
  five.pop_back();
  const RouteStreamResponse answered = ExchangeBatch(stream.get(), Batch(4, five));
  std::vector<RouteStreamRequest> completes;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(answered.batch().responses(i).has_route()) << answered.batch().responses(i).error().message();
    completes.push_back(CompleteMessage(20 + i, answered.batch().responses(i).route().lease_id()));
  }
  const RouteStreamResponse released = ExchangeBatch(stream.get(), Batch(5, completes));
  for (const RouteStreamResponse& r : released.batch().responses()) EXPECT_TRUE(r.has_complete());
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(State(*router).live_leases(), 0);
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batches_total", {{"outcome", "answered"}}), 2);
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batch_size_bucket", {{"le", "4"}}), 2);
}

TEST(RouteStreamBatch, ANestedBatchIsAnErrorForItsEntryOnly) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto [stub, ctx, stream] = OpenRouteStream(*router);

  const RouteStreamResponse answer = ExchangeBatch(
      stream.get(), Batch(1, {RouteMessage(10, BlockRequest(0)), Batch(11, {RouteMessage(12, BlockRequest(1))}),
                              RouteMessage(13, BlockRequest(2))}));
  ASSERT_EQ(answer.batch().responses_size(), 3);
  ASSERT_TRUE(answer.batch().responses(0).has_route());
  EXPECT_EQ(answer.batch().responses(0).route().worker_id(), "w0");
  const RouteStreamResponse& nested = answer.batch().responses(1);
  EXPECT_EQ(nested.id(), 11u);
  ASSERT_TRUE(nested.has_error());
  EXPECT_EQ(nested.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(nested.error().message(), HasSubstr("batches do not nest"));
  ASSERT_TRUE(answer.batch().responses(2).has_route());
  EXPECT_EQ(answer.batch().responses(2).route().worker_id(), "w2");
  // The nested batch's route was not handled.
  EXPECT_EQ(State(*router).live_leases(), 2);
  EXPECT_EQ(StreamMessages(*router, "route", "ok"), 2);
  EXPECT_EQ(StreamMessages(*router, "none", "error"), 1);
  EXPECT_EQ(Scraped(*router, "eldr_rejected_total", {{"reason", "malformed"}}), 1);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(RouteStreamBatch, AnEmptyBatchIsAnsweredWithAnEmptyBatch) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto [stub, ctx, stream] = OpenRouteStream(*router);

  const RouteStreamResponse answer = Exchange(stream.get(), Batch(42, {}));
  EXPECT_TRUE(answer.has_batch()) << "an empty batch is answered with an empty batch, not an error";
  EXPECT_EQ(answer.batch().responses_size(), 0);
  // The stream goes on.
  const RouteStreamResponse routed = Exchange(stream.get(), RouteMessage(43, BlockRequest(1)));
  ASSERT_TRUE(routed.has_route());
  ASSERT_TRUE(Exchange(stream.get(), CompleteMessage(44, routed.route().lease_id())).has_complete());
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batches_total", {{"outcome", "answered"}}), 1);
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batch_size_bucket", {{"le", "0"}}), 1);
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batch_size_sum"), 0);
  EXPECT_EQ(StreamMessages(*router, "none", "error"), 0);
}

TEST(RouteStreamBatch, UnaryRpcsAndSingleMessagesWorkBesideBatches) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto [stub, ctx, stream] = OpenRouteStream(*router);
  for (int round = 0; round < 3; ++round) {
    // Unary.
    EXPECT_EQ(RouteAndComplete(*router, round), absl::StrCat("w", round));
    // A single message each way.
    const RouteStreamResponse single = Exchange(stream.get(), RouteMessage(1, BlockRequest(round)));
    ASSERT_TRUE(single.has_route()) << single.error().message();
    EXPECT_EQ(single.route().worker_id(), absl::StrCat("w", round));
    const RouteStreamResponse released = Exchange(stream.get(), CompleteMessage(2, single.route().lease_id()));
    ASSERT_TRUE(released.has_complete()) << released.error().message();
    EXPECT_FALSE(released.has_batch());
    // A batch on the same stream.
    const RouteStreamResponse batch =
        ExchangeBatch(stream.get(), Batch(3, {RouteMessage(4, BlockRequest(3)), RouteMessage(5, BlockRequest(round))}));
    ASSERT_EQ(batch.batch().responses_size(), 2);
    const RouteStreamResponse done =
        ExchangeBatch(stream.get(), Batch(6, {CompleteMessage(7, batch.batch().responses(0).route().lease_id()),
                                              CompleteMessage(8, batch.batch().responses(1).route().lease_id())}));
    EXPECT_TRUE(done.batch().responses(0).has_complete());
    EXPECT_TRUE(done.batch().responses(1).has_complete());
  }
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(State(*router).live_leases(), 0);
  // Single messages are not batches.
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_batches_total", {{"outcome", "answered"}}), 6);
  EXPECT_EQ(StreamMessages(*router, "route", "ok"), 9);
  EXPECT_EQ(Scraped(*router, "eldr_route_duration_seconds_count"), 12);
}

TEST(RouteStreamBatch, CancelReleasesEveryLeaseOfAnUndeliveredBatch) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();
  auto ctx = Ctx(absl::Seconds(30));
  std::unique_ptr<Stream> stream = stub->RouteStream(ctx.get());
  // The client writes batches of 10 routes and never reads: the router answers until the client's
  // window is full and kRouteStreamMaxPending (64) answers wait, then stops reading. 10 does not
  // divide the 63 - 65 answers then dropped, so releasing one lease per answer would show.
  constexpr int kPerBatch = 10;
  std::thread writer([&] {
    for (int b = 0; b < 20000; ++b) {
      std::vector<RouteStreamRequest> batch;
      for (int i = 0; i < kPerBatch; ++i) batch.push_back(RouteMessage(i + 1, BlockRequest(i % 4)));
      if (!stream->Write(Batch(b + 1, std::move(batch)))) return;
    }
  });
  double last = -1;
  WaitUntil(
      [&] {
        const double now = StreamMessages(*router, "route", "ok");
        const bool stalled = now > 0 && now == last;
        last = now;
        absl::SleepFor(absl::Milliseconds(200));
        return stalled;
      },
      "the stream to stall");
  ctx->TryCancel();
  writer.join();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  WaitUntil([&] { return Scraped(*router, "eldr_route_streams_open") == 0; }, "the stream to close");

  // Every entry of an answer the router never handed to gRPC had its lease released: whole
  // batches, so a multiple of the batch size, several of them.
  const double routed = StreamMessages(*router, "route", "ok");
  const double undelivered = Scraped(*router, "eldr_route_stream_undelivered_total", {{"kind", "route"}});
  EXPECT_GE(undelivered, 2 * kPerBatch);
  EXPECT_LE(undelivered, 65 * kPerBatch);  // the pending answers, and one being answered
  EXPECT_EQ(static_cast<int64_t>(undelivered) % kPerBatch, 0);
  EXPECT_EQ(State(*router).live_leases(), routed - undelivered);
}

// errors_only: a Complete (or a batch of Completes) that succeeds gets no answer, one that fails is
// answered in its place with the unary error; a Route (or a batch holding one) with the flag is
// refused whole, nothing in it handled.
TEST(RouteStreamErrorsOnly, CompletesAreAnsweredOnlyWhenTheyFail) {
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto [stub, ctx, stream] = OpenRouteStream(*router);
  auto errors_only = [](RouteStreamRequest message) {
    message.set_errors_only(true);
    return message;
  };

  const RouteStreamResponse first = Exchange(stream.get(), RouteMessage(1, BlockRequest(0)));
  ASSERT_TRUE(first.has_route()) << first.error().message();
  // Released without an answer: the next answer read is the next Route's.
  ASSERT_TRUE(stream->Write(errors_only(CompleteMessage(100, first.route().lease_id()))));
  const RouteStreamResponse second = Exchange(stream.get(), RouteMessage(2, BlockRequest(1)));
  ASSERT_TRUE(second.has_route()) << second.error().message();
  EXPECT_EQ(second.route().worker_id(), "w1");
  EXPECT_EQ(State(*router).live_leases(), 1) << "the errors_only Complete did not release its lease";

  // A failing one is answered, with the unary error.
  const RouteStreamResponse unknown = Exchange(stream.get(), errors_only(CompleteMessage(101, 987654321)));
  ASSERT_TRUE(unknown.has_error());
  EXPECT_EQ(unknown.error().code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));

  // A Route cannot go unanswered: refused, not routed.
  const double routes_before = Scraped(*router, "eldr_route_duration_seconds_count");
  const RouteStreamResponse route_refused = Exchange(stream.get(), errors_only(RouteMessage(102, BlockRequest(2))));
  ASSERT_TRUE(route_refused.has_error());
  EXPECT_EQ(route_refused.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(route_refused.error().message(), HasSubstr("errors_only is for a Complete or a batch of Completes"));
  std::vector<RouteStreamRequest> mixed;
  mixed.push_back(CompleteMessage(31, second.route().lease_id()));
  mixed.push_back(RouteMessage(32, BlockRequest(3)));
  const RouteStreamResponse mixed_refused = Exchange(stream.get(), errors_only(Batch(103, mixed)));
  ASSERT_TRUE(mixed_refused.has_error());
  EXPECT_EQ(mixed_refused.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(State(*router).live_leases(), 1) << "an entry of a refused errors_only batch was handled";
  EXPECT_EQ(Scraped(*router, "eldr_route_duration_seconds_count"), routes_before);

  // Batches of Completes: no answer when all succeed, the whole batch answered when one fails.
  std::vector<RouteStreamRequest> routes;
  for (int block = 0; block < 3; ++block) routes.push_back(RouteMessage(40 + block, BlockRequest(block)));
  const RouteStreamResponse routed = ExchangeBatch(stream.get(), Batch(104, routes));
  std::vector<uint64_t> leases;
  for (const RouteStreamResponse& r : routed.batch().responses()) {
    ASSERT_TRUE(r.has_route()) << r.error().message();
    leases.push_back(r.route().lease_id());
  }
  std::vector<RouteStreamRequest> good;
  good.push_back(CompleteMessage(51, second.route().lease_id()));
  good.push_back(CompleteMessage(52, leases[0]));
  ASSERT_TRUE(stream->Write(errors_only(Batch(105, good))));
  std::vector<RouteStreamRequest> one_bad;
  one_bad.push_back(CompleteMessage(61, leases[1]));
  one_bad.push_back(CompleteMessage(62, leases[1]));  // released by the entry before it
  one_bad.push_back(CompleteMessage(63, leases[2]));
  const RouteStreamResponse partly = ExchangeBatch(stream.get(), errors_only(Batch(106, one_bad)));
  ASSERT_EQ(partly.batch().responses_size(), 3);
  EXPECT_TRUE(partly.batch().responses(0).has_complete());
  EXPECT_EQ(partly.batch().responses(1).error().code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_TRUE(partly.batch().responses(2).has_complete());

  stream->WritesDone();
  RouteStreamResponse extra;
  EXPECT_FALSE(stream->Read(&extra)) << "an answer came for message " << extra.id();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(State(*router).live_leases(), 0);
  EXPECT_EQ(Scraped(*router, "eldr_route_stream_unanswered_total"), 2);
  EXPECT_EQ(StreamMessages(*router, "complete", "ok"), 5);
  EXPECT_EQ(StreamMessages(*router, "complete", "error"), 2);
  EXPECT_EQ(StreamMessages(*router, "none", "error"), 2);
  EXPECT_EQ(Scraped(*router, "eldr_rejected_total", {{"reason", "malformed"}}), 2);
}

}  // namespace
}  // namespace eldr::testing
