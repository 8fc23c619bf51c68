// The prefill role on a manual clock: FIFO timing from the cost model, the answer bodies with
// kv_transfer_params and the counts, the signature keys, the queue limit, aborts, and the KV
// hold timeout.
#include "engine_emu/prefill_engine.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "engine_emu/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sim/cost_model.h"
#include "testing/process.h"

namespace eldr::engine_emu {
namespace {

using nlohmann::json;
using testing::BundledCatalog;
using testing::FakeStream;
using testing::ManualClock;

constexpr double kScale = 0.5;

class PrefillEngineTest : public ::testing::Test {
 protected:
  PrefillEngineTest() { Build(SignatureKey::kEldrExpertCounts, 1024); }

  void Build(SignatureKey key, int max_waiting, bool gate_prob_sums = false) {
    engine_.reset();
    registry_.reset();
    metrics_ = std::make_unique<EmuMetrics>(EngineRole::kPrefill, "m1");
    KvRegistryOptions kv;
    kv.engine_id = "pf-engine";
    kv.hold_timeout_us = 30e6;
    registry_ = std::make_unique<KvRegistry>(kv, metrics_.get());
    PrefillEngineOptions options;
    options.engine.catalog = BundledCatalog();
    options.engine.time_scale = kScale;
    options.engine.model = "m1";
    options.engine.max_waiting = max_waiting;
    options.advertise_host = "10.1.2.3";
    options.advertise_port = 8200;
    options.signature_key = key;
    options.gate_prob_sums = gate_prob_sums;
    engine_ = std::make_unique<PrefillEngine>(options, &clock_, metrics_.get(), registry_.get());
  }

  // Submits a prefill request for trace request `index`.
  std::shared_ptr<FakeStream> Submit(uint64_t handle, int index, ApiKind api = ApiKind::kCompletions) {
    EngineRequest request;
    request.api = api;
    request.id = absl::StrCat("req-", handle);
    request.created = 1764000000;
    request.trace_index = index;
    request.max_tokens = 1;
    auto stream = std::make_shared<FakeStream>(&clock_);
    engine_->Submit(handle, request, stream);
    return stream;
  }

  double PrefillDuration(int index) const {
    return sim::PrefillUs(sim::CostModelOptions(), BundledCatalog()->request(index).prompt_tokens) * kScale;
  }

  std::optional<double> Sample(const std::string& series) const {
    return eldr::testing::SampleValue(metrics_->Serialize(), series);
  }

  ManualClock clock_;
  std::unique_ptr<EmuMetrics> metrics_;
  std::unique_ptr<KvRegistry> registry_;
  std::unique_ptr<PrefillEngine> engine_;
};

TEST_F(PrefillEngineTest, RunsOneAtATimeInArrivalOrder) {
  auto a = Submit(1, 3);
  auto b = Submit(2, 8);
  auto c = Submit(3, 5);
  EXPECT_EQ(engine_->running(), 1);
  EXPECT_EQ(engine_->waiting(), 2);
  EXPECT_EQ(Sample("vllm:num_requests_running{model_name=\"m1\"}"), 1);
  EXPECT_EQ(Sample("vllm:num_requests_waiting{model_name=\"m1\"}"), 2);
  clock_.RunUntilIdle();
  ASSERT_TRUE(a->responded() && b->responded() && c->responded());
  EXPECT_DOUBLE_EQ(a->responded_at_us(), PrefillDuration(3));
  EXPECT_DOUBLE_EQ(b->responded_at_us(), PrefillDuration(3) + PrefillDuration(8));
  EXPECT_DOUBLE_EQ(c->responded_at_us(), PrefillDuration(3) + PrefillDuration(8) + PrefillDuration(5));
  EXPECT_EQ(engine_->running(), 0);
  EXPECT_EQ(engine_->waiting(), 0);
  EXPECT_EQ(Sample("eldr_emu_requests_total{outcome=\"ok\",role=\"prefill\"}"), 3);
  EXPECT_EQ(Sample("eldr_emu_prefills_total"), 3);
}

TEST_F(PrefillEngineTest, ARequestArrivingLaterStartsAtOnce) {
  auto a = Submit(1, 3);
  clock_.AdvanceTo(PrefillDuration(3) + 1000);
  ASSERT_TRUE(a->responded());
  auto b = Submit(2, 4);
  clock_.RunUntilIdle();
  EXPECT_DOUBLE_EQ(b->responded_at_us(), PrefillDuration(3) + 1000 + PrefillDuration(4));
}

TEST_F(PrefillEngineTest, CompletionsAnswerCarriesKvTransferParamsAndCounts) {
  const int index = 6;
  auto stream = Submit(42, index);
  clock_.AdvanceTo(PrefillDuration(index));
  ASSERT_TRUE(stream->responded());
  const http::HttpResponse& response = stream->response();
  EXPECT_EQ(response.status, 200);
  EXPECT_EQ(response.content_type, "application/json");
  ASSERT_EQ(response.headers.size(), 1u);
  EXPECT_EQ(response.headers[0], (std::pair<std::string, std::string>("X-Request-Id", "req-42")));

  const json body = json::parse(response.body);
  const sim::SimRequest& trace = BundledCatalog()->request(index);
  const int prompt = trace.prompt_tokens;
  EXPECT_EQ(body["id"], "cmpl-req-42");
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["created"], 1764000000);
  EXPECT_EQ(body["model"], "m1");
  ASSERT_EQ(body["choices"].size(), 1u);
  EXPECT_EQ(body["choices"][0]["index"], 0);
  EXPECT_EQ(body["choices"][0]["text"], absl::StrCat(" t", index, "_0"));
  EXPECT_TRUE(body["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(body["choices"][0]["stop_reason"].is_null());
  EXPECT_EQ(body["usage"]["prompt_tokens"], prompt);
  EXPECT_EQ(body["usage"]["completion_tokens"], 1);
  EXPECT_EQ(body["usage"]["total_tokens"], prompt + 1);

  const json& kv = body["kv_transfer_params"];
  EXPECT_EQ(kv["do_remote_prefill"], true);
  EXPECT_EQ(kv["do_remote_decode"], false);
  EXPECT_EQ(kv["remote_engine_id"], "pf-engine");
  EXPECT_EQ(kv["remote_request_id"], "req-42");
  EXPECT_EQ(kv["remote_host"], "10.1.2.3");
  EXPECT_EQ(kv["remote_port"], 8200);
  EXPECT_EQ(kv["tp_size"], 1);
  ASSERT_TRUE(kv["remote_block_ids"].is_array());
  EXPECT_EQ(kv["remote_block_ids"].size(), static_cast<size_t>((prompt + 15) / 16));
  EXPECT_FALSE(kv.contains("eldr_sig"));
  const json& counts = kv["eldr_expert_counts"];
  EXPECT_EQ(counts["layers"], 26);
  EXPECT_EQ(counts["experts"], 64);
  EXPECT_EQ(counts["encoding"], "int16_le");
  EXPECT_EQ(testing::DecodeCountsBase64(counts["data"].get<std::string>()), trace.prompt_counts);

  // The KV is held: pullable once with the answer's fields.
  EXPECT_EQ(registry_->held_requests(), 1);
  const std::vector<int64_t> blocks = kv["remote_block_ids"].get<std::vector<int64_t>>();
  EXPECT_TRUE(registry_->Pull("pf-engine", "req-42", blocks, clock_.NowUs()).ok());
}

TEST_F(PrefillEngineTest, ChatAnswer) {
  auto stream = Submit(7, 2, ApiKind::kChat);
  clock_.RunUntilIdle();
  const json body = json::parse(stream->response().body);
  EXPECT_EQ(body["id"], "chatcmpl-req-7");
  EXPECT_EQ(body["object"], "chat.completion");
  const json& choice = body["choices"][0];
  EXPECT_EQ(choice["index"], 0);
  EXPECT_EQ(choice["message"]["role"], "assistant");
  EXPECT_EQ(choice["message"]["content"], " t2_0");
  EXPECT_EQ(choice["finish_reason"], "length");
  EXPECT_FALSE(choice.contains("text"));
  EXPECT_TRUE(body["kv_transfer_params"]["eldr_expert_counts"].is_object());
}

TEST_F(PrefillEngineTest, GateProbSumsAreTheCountsOverTopK) {
  const std::vector<int16_t>& counts = BundledCatalog()->request(3).prompt_counts;
  Build(SignatureKey::kEldrExpertCounts, 1024, /*gate_prob_sums=*/false);
  auto plain = Submit(1, 3);
  clock_.RunUntilIdle();
  EXPECT_FALSE(json::parse(plain->response().body)["kv_transfer_params"].contains("eldr_gate_prob_sums"));

  Build(SignatureKey::kEldrExpertCounts, 1024, /*gate_prob_sums=*/true);
  auto gated = Submit(2, 3);
  clock_.RunUntilIdle();
  const json kv = json::parse(gated->response().body)["kv_transfer_params"];
  const json& sums = kv["eldr_gate_prob_sums"];
  EXPECT_EQ(sums["layers"], 26);
  EXPECT_EQ(sums["experts"], 64);
  EXPECT_EQ(sums["encoding"], "float32_le");
  std::string raw;
  ASSERT_TRUE(absl::Base64Unescape(sums["data"].get<std::string>(), &raw));
  ASSERT_EQ(raw.size(), counts.size() * 4);
  const int top_k = BundledCatalog()->top_k();
  ASSERT_EQ(top_k, 6);
  double total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    uint32_t bits = 0;
    for (int b = 3; b >= 0; --b) bits = (bits << 8) | static_cast<uint8_t>(raw[4 * i + b]);
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    ASSERT_EQ(value, static_cast<float>(counts[i]) / 6.0f) << i;
    total += value;
  }
  // Each prompt token gives 1 / top_k to each of its top_k choices in each layer.
  EXPECT_NEAR(total, 26.0 * BundledCatalog()->request(3).prompt_tokens, 1e-2);
  EXPECT_TRUE(kv["eldr_expert_counts"].is_object());
}

TEST_F(PrefillEngineTest, SignatureKeys) {
  const std::vector<int16_t>& counts = BundledCatalog()->request(1).prompt_counts;
  Build(SignatureKey::kEldrSig, 1024);
  json kv;
  auto sig = Submit(2, 1);
  clock_.RunUntilIdle();
  kv = json::parse(sig->response().body)["kv_transfer_params"];
  EXPECT_FALSE(kv.contains("eldr_expert_counts"));
  EXPECT_EQ(testing::DecodeCountsBase64(kv["eldr_sig"].get<std::string>()), counts);

  Build(SignatureKey::kBoth, 1024);
  auto both = Submit(3, 1);
  clock_.RunUntilIdle();
  kv = json::parse(both->response().body)["kv_transfer_params"];
  EXPECT_EQ(kv["eldr_sig"], kv["eldr_expert_counts"]["data"]);

  Build(SignatureKey::kNone, 1024);
  auto none = Submit(4, 1);
  clock_.RunUntilIdle();
  kv = json::parse(none->response().body)["kv_transfer_params"];
  EXPECT_FALSE(kv.contains("eldr_sig"));
  EXPECT_FALSE(kv.contains("eldr_expert_counts"));
  EXPECT_EQ(kv["do_remote_prefill"], true);
}

TEST_F(PrefillEngineTest, FullQueueIs429) {
  Build(SignatureKey::kEldrExpertCounts, 1);
  auto a = Submit(1, 0);  // running
  auto b = Submit(2, 0);  // the one waiting place
  auto c = Submit(3, 0);
  ASSERT_TRUE(c->responded());
  EXPECT_EQ(c->response().status, 429);
  const json error = json::parse(c->response().body);
  EXPECT_EQ(error["type"], "TooManyRequestsError");
  EXPECT_EQ(error["code"], 429);
  EXPECT_FALSE(a->responded());
  EXPECT_EQ(Sample("eldr_emu_requests_total{outcome=\"rejected\",role=\"prefill\"}"), 1);
  clock_.RunUntilIdle();
  EXPECT_EQ(a->response().status, 200);
  EXPECT_EQ(b->response().status, 200);
}

TEST_F(PrefillEngineTest, AbortedWhileQueuedLeavesAtOnce) {
  auto a = Submit(1, 3);
  auto b = Submit(2, 8);
  auto c = Submit(3, 5);
  b->Close();
  engine_->Abort(2);
  EXPECT_EQ(engine_->waiting(), 1);
  clock_.AdvanceTo(PrefillDuration(3) + PrefillDuration(5));  // before the KV hold timeout
  EXPECT_FALSE(b->responded());
  EXPECT_DOUBLE_EQ(c->responded_at_us(), PrefillDuration(3) + PrefillDuration(5));
  EXPECT_EQ(Sample("eldr_emu_requests_aborted_total{role=\"prefill\"}"), 1);
  EXPECT_EQ(registry_->held_requests(), 2);
}

TEST_F(PrefillEngineTest, AbortedWhileRunningHoldsNoKv) {
  auto a = Submit(1, 3);
  auto b = Submit(2, 4);
  clock_.AdvanceBy(10);
  a->Close();
  engine_->Abort(1);
  clock_.AdvanceTo(PrefillDuration(3) + PrefillDuration(4));  // before the KV hold timeout
  EXPECT_FALSE(a->responded());
  // The prefill ran to its end: the next one started after it.
  EXPECT_DOUBLE_EQ(b->responded_at_us(), PrefillDuration(3) + PrefillDuration(4));
  EXPECT_EQ(registry_->held_requests(), 1);
  EXPECT_EQ(Sample("eldr_emu_requests_total{outcome=\"aborted\",role=\"prefill\"}"), 1);
  // Unknown and finished handles are ignored.
  engine_->Abort(1);
  engine_->Abort(99);
  EXPECT_EQ(Sample("eldr_emu_requests_aborted_total{role=\"prefill\"}"), 1);
}

TEST_F(PrefillEngineTest, HeldKvIsFreedAfterTheTimeout) {
  auto a = Submit(1, 3);
  clock_.AdvanceTo(PrefillDuration(3));
  ASSERT_TRUE(a->responded());
  EXPECT_EQ(registry_->held_requests(), 1);
  clock_.AdvanceTo(PrefillDuration(3) + 30e6 - 1);
  EXPECT_EQ(registry_->held_requests(), 1);
  clock_.AdvanceTo(PrefillDuration(3) + 30e6);
  EXPECT_EQ(registry_->held_requests(), 0);
  EXPECT_EQ(Sample("eldr_emu_kv_freed_total{reason=\"timeout\"}"), 1);
  const std::vector<int64_t> blocks =
      json::parse(a->response().body)["kv_transfer_params"]["remote_block_ids"].get<std::vector<int64_t>>();
  EXPECT_EQ(registry_->Pull("pf-engine", "req-1", blocks, clock_.NowUs()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace eldr::engine_emu
