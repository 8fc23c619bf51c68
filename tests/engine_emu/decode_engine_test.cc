// The decode role on a manual clock: step durations from the cost model on the traces' experts
// (checked against an independent count), FIFO admission at max_batch, token texts and order,
// finish reasons, the exact streamed and whole bodies, aborts, KV pulls, and the queue limit.
#include "engine_emu/decode_engine.h"

#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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
using testing::FakeKvPuller;
using testing::FakeStream;
using testing::ManualClock;

struct SubmitSpec {
  int index = 0;
  std::optional<int> max_tokens;
  bool stream = true;
  ApiKind api = ApiKind::kCompletions;
  bool include_usage = false;
  std::optional<RemotePrefill> remote;
};

// One token as a client sees it.
struct SeenToken {
  double time_us;
  std::string text;
  std::optional<std::string> finish_reason;
};

class DecodeEngineTest : public ::testing::Test {
 protected:
  DecodeEngineTest() { Build(64, 1024, 0.25, /*instant_prefill=*/true); }

  void Build(int max_batch, int max_waiting, double scale, bool instant_prefill) {
    engine_.reset();
    steps_.clear();
    metrics_ = std::make_unique<EmuMetrics>(EngineRole::kDecode, "m1");
    cost_ = sim::CostModelOptions();
    if (instant_prefill) {
      cost_.prefill_fixed_us = 0;
      cost_.prefill_token_us = 0;
    }
    scale_ = scale;
    DecodeEngineOptions options;
    options.engine.catalog = BundledCatalog();
    options.engine.cost = cost_;
    options.engine.time_scale = scale;
    options.engine.model = "m1";
    options.engine.max_waiting = max_waiting;
    options.max_batch = max_batch;
    options.on_step = [this](const DecodeStep& step) { steps_.push_back(step); };
    ASSERT_TRUE(ValidateDecodeEngineOptions(options).ok());
    engine_ = std::make_unique<DecodeEngine>(options, &clock_, metrics_.get(), &puller_);
  }

  std::shared_ptr<FakeStream> Submit(uint64_t handle, const SubmitSpec& spec) {
    EngineRequest request;
    request.api = spec.api;
    request.id = absl::StrCat("req-", handle);
    request.created = 1764000000;
    request.trace_index = spec.index;
    request.max_tokens = spec.max_tokens;
    request.stream = spec.stream;
    request.include_usage = spec.include_usage;
    request.remote_prefill = spec.remote;
    auto stream = std::make_shared<FakeStream>(&clock_);
    engine_->Submit(handle, request, stream);
    return stream;
  }

  // The tokens of a streamed completions or chat answer, with the time of the write that carried
  // each (role and usage events and [DONE] are skipped).
  static std::vector<SeenToken> Tokens(const FakeStream& stream) {
    std::vector<SeenToken> tokens;
    for (const FakeStream::Piece& piece : stream.pieces()) {
      for (absl::string_view event : absl::StrSplit(piece.bytes, "\n\n", absl::SkipEmpty())) {
        if (!absl::ConsumePrefix(&event, "data: ") || event == "[DONE]") continue;
        const json chunk = json::parse(event);
        if (chunk["choices"].empty()) continue;  // usage
        const json& choice = chunk["choices"][0];
        std::string text;
        if (choice.contains("text")) {
          text = choice["text"];
        } else if (choice["delta"].contains("content") && !choice["delta"].contains("role")) {
          text = choice["delta"]["content"];
        } else {
          continue;  // the chat role event
        }
        std::optional<std::string> finish;
        if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"].get<std::string>();
        tokens.push_back(SeenToken{piece.time_us, text, finish});
      }
    }
    return tokens;
  }

  // Distinct experts summed over layers of the tokens (trace request, k) — the k-th generated
  // token uses decode step k - 1 of the trace, cyclically — counted with sets, independently of
  // the engine's bitmaps.
  static int64_t ExpectedDistinct(const std::vector<std::pair<int, int>>& tokens) {
    const sim::Workload& w = BundledCatalog()->workload();
    int64_t total = 0;
    for (int layer = 0; layer < w.layers; ++layer) {
      std::set<int> experts;
      for (const auto& [index, k] : tokens) {
        const sim::SimRequest& r = w.pool[index];
        const uint8_t* ids = w.DecodeToken(r, (k - 1) % r.decode_steps) + layer * w.top_k;
        experts.insert(ids, ids + w.top_k);
      }
      total += static_cast<int64_t>(experts.size());
    }
    return total;
  }

  std::optional<double> Sample(const std::string& series) const {
    return eldr::testing::SampleValue(metrics_->Serialize(), series);
  }

  ManualClock clock_;
  FakeKvPuller puller_;
  sim::CostModelOptions cost_;
  double scale_ = 1;
  std::unique_ptr<EmuMetrics> metrics_;
  std::unique_ptr<DecodeEngine> engine_;
  std::vector<DecodeStep> steps_;
};

TEST_F(DecodeEngineTest, StepDurationsFollowTheCostModelOnTheTracesExperts) {
  // Local prefills of different lengths: requests join the batch at different steps.
  Build(64, 1024, 0.25, /*instant_prefill=*/false);
  const int indices[] = {0, 5, 9, 14, 20, 33};
  const int max_tokens[] = {12, 7, 20, 3, 15, 9};
  std::vector<std::shared_ptr<FakeStream>> streams;
  for (int i = 0; i < 6; ++i) {
    streams.push_back(Submit(i + 1, {.index = indices[i] % BundledCatalog()->size(), .max_tokens = max_tokens[i]}));
  }
  clock_.RunUntilIdle();

  // Every token's (trace request, k) by the time it was sent.
  std::map<double, std::vector<std::pair<int, int>>> by_time;
  for (int i = 0; i < 6; ++i) {
    const int index = indices[i] % BundledCatalog()->size();
    const std::vector<SeenToken> tokens = Tokens(*streams[i]);
    ASSERT_EQ(static_cast<int>(tokens.size()), max_tokens[i]);
    for (int k = 1; k <= max_tokens[i]; ++k) {
      EXPECT_EQ(tokens[k - 1].text, absl::StrCat(" t", index, "_", k));
      by_time[tokens[k - 1].time_us].push_back({index, k});
    }
    EXPECT_TRUE(streams[i]->finished());
  }
  // Each step ends with the tokens of its batch, and lasts DecodeStepUs(batch, distinct) * scale.
  ASSERT_EQ(steps_.size(), by_time.size());
  auto sent = by_time.begin();
  for (size_t s = 0; s < steps_.size(); ++s, ++sent) {
    const DecodeStep& step = steps_[s];
    const std::vector<std::pair<int, int>>& batch = sent->second;
    EXPECT_EQ(step.batch, static_cast<int>(batch.size())) << "step " << s;
    EXPECT_EQ(step.distinct_experts, ExpectedDistinct(batch)) << "step " << s;
    EXPECT_DOUBLE_EQ(step.duration_us, (cost_.t_fixed_us + cost_.t_token_us * batch.size() +
                                        cost_.t_expert_us * static_cast<double>(ExpectedDistinct(batch))) *
                                           0.25)
        << "step " << s;
    EXPECT_NEAR(step.start_us + step.duration_us, sent->first, 1e-6) << "step " << s;
    if (s > 0) {
      // The engine never idles while requests are in the batch: steps are back to back.
      EXPECT_NEAR(step.start_us, steps_[s - 1].start_us + steps_[s - 1].duration_us, 1e-6) << "step " << s;
    }
  }
  EXPECT_EQ(Sample("eldr_emu_decode_steps_total"), static_cast<double>(steps_.size()));
  EXPECT_EQ(Sample("eldr_emu_generated_tokens_total"), 12 + 7 + 20 + 3 + 15 + 9);
  EXPECT_EQ(Sample("eldr_emu_requests_total{outcome=\"ok\",role=\"decode\"}"), 6);
  EXPECT_EQ(Sample("eldr_emu_prefills_total"), 6);
}

TEST_F(DecodeEngineTest, FirstStepWaitsForTheLocalPrefill) {
  Build(64, 1024, 0.5, /*instant_prefill=*/false);
  auto stream = Submit(1, {.index = 4, .max_tokens = 1});
  clock_.RunUntilIdle();
  const std::vector<SeenToken> tokens = Tokens(*stream);
  ASSERT_EQ(tokens.size(), 1u);
  const double prefill = sim::PrefillUs(cost_, BundledCatalog()->request(4).prompt_tokens) * 0.5;
  ASSERT_EQ(steps_.size(), 1u);
  EXPECT_DOUBLE_EQ(steps_[0].start_us, prefill);
  EXPECT_DOUBLE_EQ(tokens[0].time_us, prefill + steps_[0].duration_us);
}

TEST_F(DecodeEngineTest, AdmitsInArrivalOrderUpToMaxBatch) {
  Build(/*max_batch=*/2, 1024, 1.0, /*instant_prefill=*/true);
  auto r1 = Submit(1, {.index = 1, .max_tokens = 3});
  auto r2 = Submit(2, {.index = 2, .max_tokens = 1});
  auto r3 = Submit(3, {.index = 3, .max_tokens = 2});
  auto r4 = Submit(4, {.index = 4, .max_tokens = 2});
  EXPECT_EQ(engine_->waiting(), 4);  // all prefilling
  clock_.AdvanceTo(0);
  // r1 was ready first and started a step alone; the others wait for the boundary.
  ASSERT_EQ(steps_.size(), 1u);
  EXPECT_EQ(engine_->running(), 1);
  EXPECT_EQ(engine_->waiting(), 3);
  EXPECT_EQ(Sample("vllm:num_requests_running{model_name=\"m1\"}"), 1);
  EXPECT_EQ(Sample("vllm:num_requests_waiting{model_name=\"m1\"}"), 3);
  clock_.RunUntilIdle();
  // [r1] [r1 r2] [r1 r3] [r3 r4] [r4]
  std::vector<int> batches;
  for (const DecodeStep& s : steps_) batches.push_back(s.batch);
  EXPECT_EQ(batches, (std::vector<int>{1, 2, 2, 2, 1}));
  auto end = [&](int s) { return steps_[s].start_us + steps_[s].duration_us; };
  auto times = [&](const FakeStream& stream) {
    std::vector<double> t;
    for (const SeenToken& token : Tokens(stream)) t.push_back(token.time_us);
    return t;
  };
  EXPECT_EQ(times(*r1), (std::vector<double>{end(0), end(1), end(2)}));
  EXPECT_EQ(times(*r2), (std::vector<double>{end(1)}));
  EXPECT_EQ(times(*r3), (std::vector<double>{end(2), end(3)}));
  EXPECT_EQ(times(*r4), (std::vector<double>{end(3), end(4)}));
  EXPECT_EQ(steps_[1].distinct_experts, ExpectedDistinct({{1, 2}, {2, 1}}));
  EXPECT_EQ(steps_[3].distinct_experts, ExpectedDistinct({{3, 2}, {4, 1}}));
  EXPECT_EQ(engine_->running(), 0);
  EXPECT_EQ(engine_->waiting(), 0);
  EXPECT_FALSE(engine_->stepping());
}

TEST_F(DecodeEngineTest, StreamedCompletionBodiesExactly) {
  auto stream = Submit(1, {.index = 7, .max_tokens = 2, .include_usage = true});
  clock_.RunUntilIdle();
  EXPECT_TRUE(stream->begun());
  EXPECT_EQ(stream->begin_status(), 200);
  EXPECT_EQ(stream->begin_content_type(), "text/event-stream");
  EXPECT_THAT(stream->begin_headers(),
              ::testing::Contains(std::pair<std::string, std::string>("X-Request-Id", "req-1")));
  const int prompt = BundledCatalog()->request(7).prompt_tokens;
  const std::string head = R"(data: {"id":"cmpl-req-1","object":"text_completion","created":1764000000,"model":"m1",)";
  EXPECT_EQ(
      stream->body(),
      absl::StrCat(head, R"("choices":[{"index":0,"text":" t7_1","logprobs":null,"finish_reason":null}]})", "\n\n",
                   head, R"("choices":[{"index":0,"text":" t7_2","logprobs":null,"finish_reason":"length"}]})", "\n\n",
                   head, R"("choices":[],"usage":{"prompt_tokens":)", prompt,
                   R"(,"completion_tokens":2,"total_tokens":)", prompt + 2, "}}\n\n", "data: [DONE]\n\n"));
  EXPECT_TRUE(stream->finished());
  EXPECT_EQ(stream->calls_after_end(), 0);
  // Two writes: one per token, the last carrying usage and [DONE] too.
  EXPECT_EQ(stream->pieces().size(), 2u);
  for (const std::string& event : stream->Events()) {
    if (event != "[DONE]") {
      EXPECT_NO_THROW(json::parse(event)) << event;
    }
  }
}

TEST_F(DecodeEngineTest, UsageEventOnlyWhenAsked) {
  auto stream = Submit(1, {.index = 7, .max_tokens = 2});
  clock_.RunUntilIdle();
  const std::vector<std::string> events = stream->Events();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_THAT(stream->body(), ::testing::Not(::testing::HasSubstr("usage")));
}

TEST_F(DecodeEngineTest, StreamedChatBodies) {
  auto stream = Submit(1, {.index = 3, .max_tokens = 3, .api = ApiKind::kChat, .include_usage = true});
  clock_.RunUntilIdle();
  const std::vector<std::string> events = stream->Events();
  ASSERT_EQ(events.size(), 6u);  // role, 3 tokens, usage, [DONE]
  const json role = json::parse(events[0]);
  EXPECT_EQ(role["id"], "chatcmpl-req-1");
  EXPECT_EQ(role["object"], "chat.completion.chunk");
  EXPECT_EQ(role["created"], 1764000000);
  EXPECT_EQ(role["model"], "m1");
  EXPECT_EQ(role["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(role["choices"][0]["finish_reason"].is_null());
  for (int k = 1; k <= 3; ++k) {
    const json chunk = json::parse(events[k]);
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    EXPECT_EQ(chunk["choices"][0]["index"], 0);
    EXPECT_EQ(chunk["choices"][0]["delta"], json({{"content", absl::StrCat(" t3_", k)}}));
    if (k < 3) {
      EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
    } else {
      EXPECT_EQ(chunk["choices"][0]["finish_reason"], "length");
    }
  }
  const json usage = json::parse(events[4]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 3);
  EXPECT_EQ(events[5], "[DONE]");
}

TEST_F(DecodeEngineTest, WithoutMaxTokensRunsTheTracesDecodeStepsAndStops) {
  // The pool's shortest request keeps the test small.
  const auto catalog = BundledCatalog();
  int index = 0;
  for (int i = 0; i < catalog->size(); ++i) {
    if (catalog->request(i).decode_steps < catalog->request(index).decode_steps) index = i;
  }
  const sim::SimRequest& trace = catalog->request(index);
  auto stream = Submit(1, {.index = index, .stream = false});
  clock_.RunUntilIdle();
  ASSERT_TRUE(stream->responded());
  EXPECT_FALSE(stream->begun());
  EXPECT_EQ(stream->response().status, 200);
  const json body = json::parse(stream->response().body);
  std::string expected;
  for (int k = 1; k <= trace.decode_steps; ++k) absl::StrAppend(&expected, " t", index, "_", k);
  EXPECT_EQ(body["id"], "cmpl-req-1");
  EXPECT_EQ(body["object"], "text_completion");
  EXPECT_EQ(body["choices"][0]["text"], expected);
  EXPECT_EQ(body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(body["usage"]["prompt_tokens"], trace.prompt_tokens);
  EXPECT_EQ(body["usage"]["completion_tokens"], trace.decode_steps);
  EXPECT_EQ(body["usage"]["total_tokens"], trace.prompt_tokens + trace.decode_steps);
  EXPECT_EQ(static_cast<int>(steps_.size()), trace.decode_steps);
}

TEST_F(DecodeEngineTest, MoreTokensThanTheTraceCycleThroughItsExperts) {
  const auto catalog = BundledCatalog();
  int index = 0;
  for (int i = 0; i < catalog->size(); ++i) {
    if (catalog->request(i).decode_steps < catalog->request(index).decode_steps) index = i;
  }
  const int steps = catalog->request(index).decode_steps;
  auto stream = Submit(1, {.index = index, .max_tokens = steps + 2, .stream = false, .api = ApiKind::kChat});
  clock_.RunUntilIdle();
  ASSERT_EQ(static_cast<int>(steps_.size()), steps + 2);
  EXPECT_EQ(steps_[steps].distinct_experts, ExpectedDistinct({{index, 1}}));
  EXPECT_EQ(steps_[steps + 1].distinct_experts, ExpectedDistinct({{index, 2}}));
  const json body = json::parse(stream->response().body);
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(body["usage"]["completion_tokens"], steps + 2);
}

TEST_F(DecodeEngineTest, AbortedRequestLeavesAtTheNextStep) {
  auto r1 = Submit(1, {.index = 1, .max_tokens = 10});
  auto r2 = Submit(2, {.index = 2, .max_tokens = 10});
  clock_.AdvanceTo(0);                                           // step 0: [r1]
  clock_.AdvanceTo(steps_[0].start_us + steps_[0].duration_us);  // step 1: [r1 r2]
  ASSERT_EQ(steps_.size(), 2u);
  clock_.AdvanceTo(steps_[1].start_us + steps_[1].duration_us + 1);  // inside step 2
  ASSERT_EQ(steps_.size(), 3u);
  EXPECT_EQ(steps_[2].batch, 2);  // r1 is still in the step that runs
  r1->Close();
  engine_->Abort(1);
  clock_.RunUntilIdle();
  // r1 got the tokens of steps 0 and 1 only; from step 3 on the batch is r2 alone.
  EXPECT_EQ(Tokens(*r1).size(), 2u);
  EXPECT_EQ(r1->pieces().size(), 2u);
  EXPECT_FALSE(r1->finished());
  EXPECT_EQ(steps_[3].batch, 1);
  EXPECT_EQ(steps_[3].distinct_experts, ExpectedDistinct({{2, 3}}));
  EXPECT_EQ(Tokens(*r2).size(), 10u);
  EXPECT_EQ(Sample("eldr_emu_requests_aborted_total{role=\"decode\"}"), 1);
  EXPECT_EQ(Sample("eldr_emu_requests_total{outcome=\"aborted\",role=\"decode\"}"), 1);
  EXPECT_EQ(Sample("eldr_emu_requests_total{outcome=\"ok\",role=\"decode\"}"), 1);
}

TEST_F(DecodeEngineTest, AClosedStreamIsNoticedAtTheStepBoundary) {
  // The client went away but the Abort has not reached the engine (yet): done() tells.
  auto r1 = Submit(1, {.index = 1, .max_tokens = 10});
  clock_.AdvanceTo(0);
  clock_.AdvanceTo(steps_[0].start_us + 1);
  r1->Close();
  clock_.RunUntilIdle();
  EXPECT_EQ(Tokens(*r1).size(), 0u);
  EXPECT_EQ(steps_.size(), 1u);
  EXPECT_EQ(Sample("eldr_emu_requests_aborted_total{role=\"decode\"}"), 1);
  engine_->Abort(1);  // late: ignored
  EXPECT_EQ(Sample("eldr_emu_requests_aborted_total{role=\"decode\"}"), 1);
}

TEST_F(DecodeEngineTest, AbortedWhileWaitingLeavesAtOnce) {
  Build(/*max_batch=*/1, 1024, 1.0, /*instant_prefill=*/true);
  auto r1 = Submit(1, {.index = 1, .max_tokens = 3});
  auto r2 = Submit(2, {.index = 2, .max_tokens = 3});
  clock_.AdvanceTo(0);
  EXPECT_EQ(engine_->waiting(), 1);
  engine_->Abort(2);
  EXPECT_EQ(engine_->waiting(), 0);
  EXPECT_EQ(Sample("vllm:num_requests_waiting{model_name=\"m1\"}"), 0);
  EXPECT_EQ(Sample("eldr_emu_requests_aborted_total{role=\"decode\"}"), 1);
  clock_.RunUntilIdle();
  EXPECT_EQ(steps_.size(), 3u);
  EXPECT_EQ(Tokens(*r2).size(), 0u);
}

TEST_F(DecodeEngineTest, PullsKvThenWaitsKvTransferUs) {
  RemotePrefill remote{"pf-1", "rid-9", {3, 4}, "10.0.0.9", 8100};
  auto stream = Submit(1, {.index = 5, .max_tokens = 1, .remote = remote});
  ASSERT_EQ(puller_.pulls().size(), 1u);
  EXPECT_EQ(puller_.pulls()[0].engine_id, "pf-1");
  EXPECT_EQ(puller_.pulls()[0].request_id, "rid-9");
  EXPECT_EQ(puller_.pulls()[0].block_ids, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(puller_.pulls()[0].host, "10.0.0.9");
  EXPECT_EQ(puller_.pulls()[0].port, 8100);
  EXPECT_EQ(engine_->waiting(), 1);
  clock_.AdvanceTo(100);
  EXPECT_TRUE(steps_.empty());
  puller_.Complete(0, absl::OkStatus());
  clock_.RunUntilIdle();
  ASSERT_EQ(steps_.size(), 1u);
  EXPECT_DOUBLE_EQ(steps_[0].start_us, 100 + cost_.kv_transfer_us * scale_);
  ASSERT_EQ(Tokens(*stream).size(), 1u);
  EXPECT_EQ(Sample("eldr_emu_kv_transfers_total{outcome=\"ok\"}"), 1);
  EXPECT_EQ(Sample("eldr_emu_prefills_total"), 0);  // prefilled remotely
}

TEST_F(DecodeEngineTest, FailedPullIs503BeforeAnyByte) {
  RemotePrefill remote{"pf-1", "rid-9", {3}, "10.0.0.9", 8100};
  auto stream = Submit(1, {.index = 5, .remote = remote});
  puller_.Complete(0, absl::UnavailableError("connection refused"));
  ASSERT_TRUE(stream->responded());
  EXPECT_FALSE(stream->begun());
  EXPECT_EQ(stream->response().status, 503);
  const json body = json::parse(stream->response().body);
  EXPECT_EQ(body["message"], "KV transfer from 10.0.0.9:8100 failed: connection refused");
  EXPECT_EQ(body["type"], "ServiceUnavailableError");
  EXPECT_EQ(engine_->waiting(), 0);
  EXPECT_EQ(Sample("eldr_emu_requests_total{outcome=\"kv_failed\",role=\"decode\"}"), 1);
  EXPECT_EQ(Sample("eldr_emu_kv_transfers_total{outcome=\"failed\"}"), 1);
}

TEST_F(DecodeEngineTest, AbortedWhilePullingNeverAnswers) {
  RemotePrefill remote{"pf-1", "rid-9", {3}, "10.0.0.9", 8100};
  auto stream = Submit(1, {.index = 5, .remote = remote});
  stream->Close();
  engine_->Abort(1);
  EXPECT_EQ(engine_->waiting(), 0);
  puller_.Complete(0, absl::OkStatus());
  clock_.RunUntilIdle();
  EXPECT_TRUE(steps_.empty());
  EXPECT_FALSE(stream->responded());
  EXPECT_FALSE(stream->begun());
  EXPECT_EQ(Sample("eldr_emu_requests_aborted_total{role=\"decode\"}"), 1);
}

TEST_F(DecodeEngineTest, FullQueueIs429) {
  Build(1, /*max_waiting=*/2, 1.0, true);
  auto r1 = Submit(1, {.index = 1, .max_tokens = 2});
  auto r2 = Submit(2, {.index = 2, .max_tokens = 2});
  auto r3 = Submit(3, {.index = 3, .max_tokens = 2});
  ASSERT_TRUE(r3->responded());
  EXPECT_EQ(r3->response().status, 429);
  EXPECT_EQ(json::parse(r3->response().body)["type"], "TooManyRequestsError");
  EXPECT_EQ(Sample("eldr_emu_requests_total{outcome=\"rejected\",role=\"decode\"}"), 1);
  clock_.AdvanceTo(0);  // r1 runs, r2 waits: one place again
  auto r4 = Submit(4, {.index = 4, .max_tokens = 2});
  EXPECT_FALSE(r4->responded());
  clock_.RunUntilIdle();
  EXPECT_TRUE(r1->finished() && r2->finished() && r4->finished());
}

TEST_F(DecodeEngineTest, KvUsageFollowsTheBatch) {
  auto r1 = Submit(1, {.index = 1, .max_tokens = 3});
  clock_.AdvanceTo(0);
  const int prompt = BundledCatalog()->request(1).prompt_tokens;
  EXPECT_DOUBLE_EQ(*Sample("vllm:kv_cache_usage_perc{model_name=\"m1\"}"), prompt / 150000.0);
  clock_.RunUntilIdle();
  EXPECT_DOUBLE_EQ(*Sample("vllm:kv_cache_usage_perc{model_name=\"m1\"}"), 0);
}

TEST_F(DecodeEngineTest, LargeBatchesRunWhole) {
  // max_batch 4096 with 3000 concurrent streams: one step holds all of them.
  Build(4096, 8192, 0.01, true);
  std::vector<std::shared_ptr<FakeStream>> streams;
  for (int i = 0; i < 3000; ++i) {
    streams.push_back(Submit(i + 1, {.index = i % BundledCatalog()->size(), .max_tokens = 4}));
  }
  clock_.RunUntilIdle();
  // The first request ran alone in step 0 and ends with step 3; the others joined at step 1 and
  // end with step 4: [1] [3000] [3000] [3000] [2999].
  ASSERT_EQ(steps_.size(), 5u);
  EXPECT_EQ(steps_[0].batch, 1);
  EXPECT_EQ(steps_[1].batch, 3000);
  EXPECT_EQ(steps_[3].batch, 3000);
  EXPECT_EQ(steps_[4].batch, 2999);
  std::vector<std::pair<int, int>> tokens = {{0, 2}};
  for (int i = 1; i < 3000; ++i) tokens.push_back({i % BundledCatalog()->size(), 1});
  EXPECT_EQ(steps_[1].distinct_experts, ExpectedDistinct(tokens));
  for (const auto& s : streams) EXPECT_TRUE(s->finished());
}

TEST(DecodeEngineOptionsTest, Validation) {
  DecodeEngineOptions options;
  options.engine.catalog = BundledCatalog();
  EXPECT_TRUE(ValidateDecodeEngineOptions(options).ok());
  options.max_batch = 0;
  EXPECT_THAT(std::string(ValidateDecodeEngineOptions(options).message()), ::testing::HasSubstr("--max_batch"));
  options.max_batch = 1;
  options.engine.time_scale = 0;
  EXPECT_THAT(std::string(ValidateDecodeEngineOptions(options).message()), ::testing::HasSubstr("--time_scale"));
  options.engine.time_scale = 1;
  options.engine.max_waiting = 0;
  EXPECT_THAT(std::string(ValidateDecodeEngineOptions(options).message()), ::testing::HasSubstr("--max_waiting"));
  options.engine.max_waiting = 1;
  options.engine.cost.t_expert_us = -1;
  EXPECT_THAT(std::string(ValidateDecodeEngineOptions(options).message()), ::testing::HasSubstr("t_expert_us"));
}

}  // namespace
}  // namespace eldr::engine_emu
