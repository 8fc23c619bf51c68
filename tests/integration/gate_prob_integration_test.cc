// The gate_prob signature end to end against the real daemon: eldr-router loads a centroid artifact
// of the reference's variant `gate_prob_all`; the capture library (CPU reference path) records each
// prompt token's top-k expert ids and gate probabilities per KV block and finishes a request into
// float32 gate-probability sums; its router client sends them as RouteRequest.gate_prob_sums, and the
// worker whose centroid matches is chosen. Requests whose expert *counts* are identical but whose
// probabilities favour different experts go to different workers, so the probabilities (not the
// counts) decide. Bad sums (partial floats, wrong size, NaN, negative) and integer counts against a
// gate_prob router come back INVALID_ARGUMENT with their reason, on Route and on RouteStream, and
// are counted in eldr_rejected_total and eldr_route_requests_total{outcome="invalid"}.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "eldr/capture/capture.hpp"
#include "eldr/core/centroid_artifact.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "router_harness.h"

namespace eldr::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kGateLayers = 4;
constexpr int kGateExperts = 16;
constexpr int kBlockExperts = 4;  // worker i's centroid is uniform over experts [4i, 4i + 4)
constexpr int kWorkers = 3;
constexpr int kTopK = 2;
constexpr int kKvBlockSize = 4;

std::string GateArtifactJson() {
  CentroidArtifact artifact;
  artifact.spec.layers = kGateLayers;
  artifact.spec.experts = kGateExperts;
  artifact.spec.variant = SignatureVariant::kGateProb;
  artifact.k = kWorkers;
  const int dim = kGateLayers * kGateExperts;
  artifact.centroids.assign(static_cast<size_t>(kWorkers) * dim, 0.f);
  const float v = 1.0f / std::sqrt(static_cast<float>(kGateLayers * kBlockExperts));
  for (int r = 0; r < kWorkers; ++r) {
    for (int l = 0; l < kGateLayers; ++l) {
      for (int j = 0; j < kBlockExperts; ++j) {
        artifact.centroids[static_cast<size_t>(r) * dim + l * kGateExperts + r * kBlockExperts + j] = v;
      }
    }
  }
  for (int r = 0; r < kWorkers; ++r) artifact.workers.push_back(absl::StrCat("g", r));
  artifact.model = "test-gate-4x16";
  artifact.seed = 3;
  return SerializeCentroidArtifact(artifact);
}

std::string GateWorkerFlag() {
  std::vector<std::string> items;
  for (int i = 0; i < kWorkers; ++i) items.push_back(absl::StrCat("g", i, "=10.0.1.", i, ":8000"));
  return absl::StrJoin(items, ",");
}

// One prompt through the capture library's CPU path: `tokens` tokens whose top-2 choices are an
// expert of block `strong` with probability 0.875 and one of block `weak` with 0.125, in every
// layer, written into KV blocks `first_block`... Returns the finished gate sums [L][E]; `counts`
// gets the finished counts.
std::vector<float> CaptureGateSums(capture::Capture& capture, int strong, int weak, int tokens, int first_block,
                                   std::vector<int32_t>* counts) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * kTopK);
  std::vector<float> weights(ids.size());
  std::vector<int64_t> slots(tokens);
  for (int t = 0; t < tokens; ++t) {
    ids[t * kTopK] = strong * kBlockExperts + t % kBlockExperts;
    ids[t * kTopK + 1] = weak * kBlockExperts + (t + 1) % kBlockExperts;
    weights[t * kTopK] = 0.875f;
    weights[t * kTopK + 1] = 0.125f;
    slots[t] = int64_t{first_block} * kKvBlockSize + t;
  }
  for (int layer = 0; layer < kGateLayers; ++layer) {
    const absl::Status status =
        capture.RecordGateProbs(layer, ids.data(), capture::IndexType::kInt32, weights.data(), kTopK, slots.data(),
                                capture::IndexType::kInt64, tokens, 0, nullptr);
    EXPECT_TRUE(status.ok()) << status;
  }
  std::vector<int32_t> table;
  for (int b = 0; b * kKvBlockSize < tokens; ++b) table.push_back(first_block + b);
  const int64_t length = tokens;
  auto gate = capture.FinishGateProbs(table.data(), static_cast<int64_t>(table.size()), &length, 1, nullptr);
  EXPECT_TRUE(gate.ok()) << gate.status();
  if (!gate.ok()) return {};
  auto finished = capture.Finish(table.data(), static_cast<int64_t>(table.size()), &length, 1,
                                 capture::OutputType::kInt32, nullptr);
  EXPECT_TRUE(finished.ok()) << finished.status();
  if (finished.ok())
    counts->assign((*finished)->counts_int32(), (*finished)->counts_int32() + kGateLayers * kGateExperts);
  const float* sums = (*gate)->gate_prob_sums();
  return std::vector<float>(sums, sums + kGateLayers * kGateExperts);
}

std::string Float32Le(const std::vector<float>& values) {
  std::string bytes;
  for (float value : values) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<char>((bits >> (8 * b)) & 0xff));
  }
  return bytes;
}

eldr::v1::RouteRequest GateRequest(int layers, int experts, std::string bytes) {
  eldr::v1::RouteRequest request;
  request.set_request_id("bad-gate");
  request.set_prompt_tokens(8);
  request.mutable_gate_prob_sums()->set_layers(layers);
  request.mutable_gate_prob_sums()->set_experts(experts);
  request.mutable_gate_prob_sums()->set_float32_le(std::move(bytes));
  return request;
}

class GateProbRouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string artifact = dir_.File("gate.json");
    const std::string json = GateArtifactJson();
    ASSERT_THAT(json, HasSubstr("\"gate_prob_all\""));  // the reference's name, as the reference writes it
    WriteTextFile(artifact, json);
    router_ = MustStart(dir_, {"--workers=" + GateWorkerFlag(), "--centroids=" + artifact});
    ASSERT_NE(router_, nullptr);
    capture::Options options;
    options.num_layers = kGateLayers;
    options.num_experts = kGateExperts;
    options.max_top_k = kTopK;
    options.num_blocks = 32;
    options.block_size = kKvBlockSize;
    options.record_gate_probs = true;
    auto created = capture::Capture::Create(options);
    ASSERT_TRUE(created.ok()) << created.status();
    capture_ = *std::move(created);
    auto client = capture::RouterClient::Create(router_->target(), capture::RouterClientOptions{});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  TempDir dir_;
  std::unique_ptr<RouterProcess> router_;
  std::unique_ptr<capture::Capture> capture_;
  std::unique_ptr<capture::RouterClient> client_;
};

TEST_F(GateProbRouterTest, CapturedGateSumsRouteToTheWorkerWhoseCentroidMatches) {
  // Request b favours block b and gives block (b + 1) % 3 a little; its neighbour request has the same
  // experts (identical counts) with the probabilities the other way round.
  int first_block = 0;
  for (int strong = 0; strong < kWorkers; ++strong) {
    const int weak = (strong + 1) % kWorkers;
    std::vector<int32_t> counts;
    const std::vector<float> sums = CaptureGateSums(*capture_, strong, weak, 8, first_block, &counts);
    first_block += 2;
    ASSERT_EQ(sums.size(), static_cast<size_t>(kGateLayers * kGateExperts));
    // Every layer: the four experts of the strong block got 2 x 0.875, the weak block's 2 x 0.125.
    EXPECT_EQ(sums[strong * kBlockExperts], 1.75f);
    EXPECT_EQ(sums[weak * kBlockExperts], 0.25f);
    auto decision = client_->RouteGateProbSums(absl::StrCat("gate-", strong), 8, sums, kGateLayers, kGateExperts);
    ASSERT_TRUE(decision.ok()) << decision.status();
    EXPECT_EQ(decision->worker_id, absl::StrCat("g", strong));
    EXPECT_EQ(decision->address, absl::StrCat("10.0.1.", strong, ":8000"));
    EXPECT_EQ(decision->policy, "eldr");
    EXPECT_EQ(decision->fallback_reason, "");
    EXPECT_EQ(decision->band_size, 1);
    EXPECT_GT(decision->similarity, 0.95f);
    ASSERT_TRUE(client_->Complete(decision->lease_id, 4).ok());

    // The mirrored request: same experts chosen, probabilities swapped: the other worker.
    std::vector<int32_t> mirrored_counts;
    const std::vector<float> mirrored = CaptureGateSums(*capture_, weak, strong, 8, first_block, &mirrored_counts);
    first_block += 2;
    auto other = client_->RouteGateProbSums("mirrored", 8, mirrored, kGateLayers, kGateExperts);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(other->worker_id, absl::StrCat("g", weak));
    ASSERT_TRUE(client_->Complete(other->lease_id, 4).ok());
    // Both requests chose the same experts the same number of times per layer.
    std::vector<int32_t> sorted_a = counts, sorted_b = mirrored_counts;
    std::sort(sorted_a.begin(), sorted_a.end());
    std::sort(sorted_b.begin(), sorted_b.end());
    EXPECT_EQ(sorted_a, sorted_b);
  }
  // 0 x 0: the calibrated geometry.
  std::vector<int32_t> counts;
  const std::vector<float> sums = CaptureGateSums(*capture_, 2, 0, 5, 20, &counts);
  auto stub = router_->RouterStub();
  eldr::v1::RouteResponse response;
  eldr::v1::RouteRequest bare = GateRequest(0, 0, Float32Le(sums));
  ASSERT_TRUE(stub->Route(Ctx().get(), bare, &response).ok());
  EXPECT_EQ(response.worker_id(), "g2");
  EXPECT_GE(Scraped(*router_, "eldr_route_requests_total", {{"policy", "eldr"}, {"outcome", "ok"}}), 7);
}

TEST_F(GateProbRouterTest, BadSumsAreInvalidArgumentWithTheReasonAndCounted) {
  auto stub = router_->RouterStub();
  const int cells = kGateLayers * kGateExperts;
  std::vector<float> good(cells, 0.f);
  good[3] = 2.f;
  struct Case {
    std::string name;
    eldr::v1::RouteRequest request;
    std::string reason;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({"partial float", GateRequest(kGateLayers, kGateExperts, Float32Le(good).substr(1)), "geometry",
                   "not a whole number of float32 values"});
  std::vector<float> short_sums(good.begin(), good.end() - 1);
  cases.push_back({"wrong size", GateRequest(kGateLayers, kGateExperts, Float32Le(short_sums)), "geometry", ""});
  cases.push_back(
      {"wrong geometry", GateRequest(kGateLayers, 8, Float32Le(std::vector<float>(32, 1.f))), "geometry", ""});
  std::vector<float> nan = good;
  nan[10] = std::numeric_limits<float>::quiet_NaN();
  cases.push_back({"NaN", GateRequest(kGateLayers, kGateExperts, Float32Le(nan)), "non_finite", ""});
  std::vector<float> infinite = good;
  infinite[11] = std::numeric_limits<float>::infinity();
  cases.push_back({"infinity", GateRequest(kGateLayers, kGateExperts, Float32Le(infinite)), "non_finite", ""});
  std::vector<float> negative = good;
  negative[12] = -0.5f;
  cases.push_back({"negative", GateRequest(kGateLayers, kGateExperts, Float32Le(negative)), "negative_count", ""});
  eldr::v1::RouteRequest counts;
  counts.mutable_counts()->set_layers(kGateLayers);
  counts.mutable_counts()->set_experts(kGateExperts);
  counts.mutable_counts()->set_int16_le(std::string(2 * cells, '\1'));
  cases.push_back({"integer counts", counts, "wrong_encoding", ""});

  std::map<std::string, double> before;
  for (const Case& c : cases) before[c.reason] = Scraped(*router_, "eldr_rejected_total", {{"reason", c.reason}});
  const double invalid_before = Scraped(*router_, "eldr_route_requests_total", {{"outcome", "invalid"}});
  std::map<std::string, int> expected_more;
  for (const Case& c : cases) {
    eldr::v1::RouteResponse response;
    const grpc::Status status = stub->Route(Ctx().get(), c.request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name << ": " << status.error_message();
    EXPECT_FALSE(status.error_message().empty()) << c.name;
    if (!c.message.empty()) EXPECT_THAT(status.error_message(), HasSubstr(c.message)) << c.name;
    ++expected_more[c.reason];
  }
  // RouteStream shares the conversion: the same refusal as a per-message error, and the stream goes on.
  grpc::ClientContext stream_context;
  stream_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub->RouteStream(&stream_context);
  eldr::v1::RouteStreamRequest bad;
  bad.set_id(41);
  *bad.mutable_route() = cases[3].request;  // NaN
  ASSERT_TRUE(stream->Write(bad));
  eldr::v1::RouteStreamResponse answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.id(), 41u);
  ASSERT_TRUE(answer.has_error());
  EXPECT_EQ(answer.error().code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  ++expected_more["non_finite"];
  eldr::v1::RouteStreamRequest fine;
  fine.set_id(42);
  *fine.mutable_route() = GateRequest(kGateLayers, kGateExperts, Float32Le(good));
  ASSERT_TRUE(stream->Write(fine));
  ASSERT_TRUE(stream->Read(&answer));
  ASSERT_TRUE(answer.has_route()) << answer.error().message();
  EXPECT_EQ(answer.route().worker_id(), "g0");  // expert 3 is in worker 0's block
  stream->WritesDone();
  while (stream->Read(&answer)) {
  }
  EXPECT_TRUE(stream->Finish().ok());

  // The capture library's client surfaces the router's refusal as INVALID_ARGUMENT too.
  auto refused = client_->RouteGateProbSums("nan", 8, nan, kGateLayers, kGateExperts);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  ++expected_more["non_finite"];

  for (const auto& [reason, more] : expected_more) {
    EXPECT_EQ(Scraped(*router_, "eldr_rejected_total", {{"reason", reason}}), before[reason] + more) << reason;
  }
  EXPECT_EQ(Scraped(*router_, "eldr_route_requests_total", {{"outcome", "invalid"}}),
            invalid_before + static_cast<double>(cases.size()) + 2);
}

TEST(GateProbCountRouterTest, GateSumsToACountRouterAreWrongEncoding) {
  // The standard daemon is calibrated with the count variant (26 x 64): gate sums of the right
  // size are still refused, with the variant named, and counted; counts keep working.
  TempDir dir;
  auto router = MustStart(dir, StandardArgs(dir));
  ASSERT_NE(router, nullptr);
  auto stub = router->RouterStub();
  std::vector<float> sums(static_cast<size_t>(kLayers) * kExperts, 0.f);
  sums[5] = 1.5f;
  const double before = Scraped(*router, "eldr_rejected_total", {{"reason", "wrong_encoding"}});
  eldr::v1::RouteResponse response;
  const grpc::Status status = stub->Route(Ctx().get(), GateRequest(kLayers, kExperts, Float32Le(sums)), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("float gate-probability sums sent to a count transform"));
  EXPECT_EQ(Scraped(*router, "eldr_rejected_total", {{"reason", "wrong_encoding"}}), before + 1);
  EXPECT_EQ(RouteAndComplete(*router, 2), "w2");
}

}  // namespace
}  // namespace eldr::testing
