// The C++ calibration recorder (eldr/capture/calibration_recorder.hpp) on the CPU reference: the
// bundled real traces replayed as an engine runs them (up to three requests per forward pass,
// prompts in chunks, then one token per decode step, padding rows), gate probabilities 1 / top_k
// per choice (the traces record none). Each record must equal a bincount of its prompt and of its
// first N decode positions, the gate sums count / top_k, and the file it writes must read back
// through eldr_calib's ReadCaptureFiles (the reader eldr-calibrate uses) unchanged.
#include "eldr/capture/calibration_recorder.hpp"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "capture/capture_test_util.h"
#include "eldr/calib/calibration.h"
#include "eldr/capture/capture.hpp"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/process.h"

namespace eldr::capture {
namespace {

using ::testing::HasSubstr;

constexpr int kDecodeTokens = 20;

std::vector<int32_t> Bincount(const std::vector<uint8_t>& rows, int layers, int experts, int top_k, int64_t begin,
                              int64_t end) {
  std::vector<int32_t> counts(static_cast<size_t>(layers) * experts, 0);
  for (int64_t t = begin; t < end; ++t) {
    for (int l = 0; l < layers; ++l) {
      for (int j = 0; j < top_k; ++j) ++counts[l * experts + rows[(t * layers + l) * top_k + j]];
    }
  }
  return counts;
}

std::unique_ptr<Capture> MustCreate(const Options& options) {
  absl::StatusOr<std::unique_ptr<Capture>> capture = Capture::Create(options);
  EXPECT_TRUE(capture.ok()) << capture.status();
  return capture.ok() ? *std::move(capture) : nullptr;
}

TEST(CalibrationRecorderTest, ReplayedTracesGivePromptDecodeAndGateSumsAndAFileEldrCalibrateReads) {
  absl::StatusOr<testing::LoadedTraces> traces = testing::LoadBundledTraces(4);
  ASSERT_TRUE(traces.ok()) << traces.status();
  const int L = traces->layers, E = traces->experts, K = traces->top_k;
  Options options;
  options.num_layers = L;
  options.num_experts = E;
  options.max_top_k = K;
  options.max_direct_requests = 6;
  options.max_finish_requests = 2;
  options.record_gate_probs = true;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  absl::StatusOr<std::unique_ptr<CalibrationRecorder>> created =
      CalibrationRecorder::Create(capture.get(), kDecodeTokens);
  ASSERT_TRUE(created.ok()) << created.status();
  CalibrationRecorder& recorder = **created;

  struct Running {
    std::string key;
    int sequence = 0;
    int64_t prompt = 0;
    int64_t position = 0;
  };
  std::deque<int> waiting;
  for (int s = 0; s < static_cast<int>(traces->sequences.size()); ++s) waiting.push_back(s);
  std::vector<Running> running;
  int passes = 0;
  while (!waiting.empty() || !running.empty()) {
    while (!waiting.empty() && running.size() < 3) {
      const int s = waiting.front();
      waiting.pop_front();
      Running r{absl::StrCat("seq", s), s, traces->tokens[s] / 2, 0};
      ASSERT_TRUE(recorder.BeginRequest(r.key, r.prompt, s % 4).ok());
      running.push_back(r);
    }
    std::vector<std::pair<std::string, int64_t>> entries;
    std::vector<std::pair<int, int64_t>> rows_of_pass;  // (sequence, token) of each row; -1: padding
    for (Running& r : running) {
      const int64_t take = r.position < r.prompt ? std::min<int64_t>(48, r.prompt - r.position) : 1;
      entries.emplace_back(r.key, take);
      for (int64_t t = r.position; t < r.position + take; ++t) rows_of_pass.emplace_back(r.sequence, t);
      r.position += take;
    }
    entries.emplace_back("padding", 2);
    rows_of_pass.emplace_back(-1, 0);
    rows_of_pass.emplace_back(-1, 0);
    absl::StatusOr<absl::Span<const int32_t>> slots = recorder.SetBatch(entries);
    ASSERT_TRUE(slots.ok()) << slots.status();
    ASSERT_EQ(slots->size(), rows_of_pass.size());
    const int64_t n = static_cast<int64_t>(rows_of_pass.size());
    for (int l = 0; l < L; ++l) {
      std::vector<int32_t> ids(n * K, 0);
      std::vector<float> weights(n * K, 1.0f / static_cast<float>(K));
      for (int64_t i = 0; i < n; ++i) {
        const auto [s, t] = rows_of_pass[i];
        for (int j = 0; j < K; ++j) {
          ids[i * K + j] = s < 0 ? j : traces->sequences[s][(t * L + l) * K + j];
        }
      }
      ASSERT_TRUE(capture
                      ->RecordDirectGateProbs(l, ids.data(), IndexType::kInt32, weights.data(), K, slots->data(),
                                              IndexType::kInt32, n, nullptr)
                      .ok());
    }
    ++passes;
    for (auto it = running.begin(); it != running.end();) {
      if (it->position >= traces->tokens[it->sequence]) {
        ASSERT_TRUE(recorder.FinishRequest(it->key).ok());
        it = running.erase(it);
      } else {
        ++it;
      }
    }
  }
  EXPECT_GT(passes, 50);
  EXPECT_EQ(recorder.in_flight(), 0);
  ASSERT_EQ(recorder.records().size(), traces->sequences.size());
  bool truncated = false;
  for (const CalibrationRecord& record : recorder.records()) {
    const int s = std::stoi(record.key.substr(3));
    const int64_t prompt = traces->tokens[s] / 2;
    const int64_t decoded = std::min<int64_t>(traces->tokens[s] - prompt, kDecodeTokens);
    truncated = truncated || traces->tokens[s] - prompt > kDecodeTokens;
    EXPECT_EQ(record.prompt_tokens, prompt);
    EXPECT_EQ(record.decode_tokens, decoded);
    ASSERT_EQ(record.prefill_counts, Bincount(traces->sequences[s], L, E, K, 0, prompt)) << record.key;
    ASSERT_EQ(record.decode_counts, Bincount(traces->sequences[s], L, E, K, prompt, prompt + decoded)) << record.key;
    for (size_t c = 0; c < record.gate_prob_sums.size(); ++c) {
      ASSERT_NEAR(record.gate_prob_sums[c], record.prefill_counts[c] / static_cast<double>(K), 1e-4) << record.key;
    }
    EXPECT_EQ(record.label, s % 4);
  }
  EXPECT_TRUE(truncated);  // some requests generate more than N: only their first N count

  eldr::testing::TempDir dir;
  const std::string path = dir.File("calibration.cap");
  ASSERT_TRUE(recorder.WriteCaptureFile(path).ok());
  absl::StatusOr<CalibrationData> read = ReadCaptureFiles({path}, 0, 0);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->n, static_cast<int>(recorder.records().size()));
  EXPECT_EQ(read->layers, L);
  EXPECT_EQ(read->experts, E);
  const size_t cells = static_cast<size_t>(L) * E;
  for (int r = 0; r < read->n; ++r) {
    const CalibrationRecord& record = recorder.records()[r];
    EXPECT_TRUE(std::equal(record.prefill_counts.begin(), record.prefill_counts.end(),
                           read->prefill_counts.begin() + r * cells));
    EXPECT_TRUE(
        std::equal(record.decode_counts.begin(), record.decode_counts.end(), read->decode_counts.begin() + r * cells));
    EXPECT_TRUE(std::equal(record.gate_prob_sums.begin(), record.gate_prob_sums.end(),
                           read->gate_prob_sums.begin() + r * cells));
    EXPECT_EQ(read->labels[r], record.label);
  }
}

// The reference's gate_prob_all: the engine records with RecordDirectGateLogits and the recorder's
// token -> slot array; the record's gate sums are the softmax over all experts of its prompt
// tokens' logits only (decode positions go to its decode slot, padding nowhere).
TEST(CalibrationRecorderTest, GateLogitsGiveThePromptsSoftmaxSumsOverAllExperts) {
  Options options;
  options.num_layers = 1;
  options.num_experts = 4;
  options.max_top_k = 1;
  options.max_direct_requests = 2;
  options.record_gate_probs = true;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  auto recorder = CalibrationRecorder::Create(capture.get(), 2);
  ASSERT_TRUE(recorder.ok()) << recorder.status();
  ASSERT_TRUE((*recorder)->BeginRequest("a", 3).ok());
  // One pass: 3 prompt positions, 2 decode positions, then 1 beyond N (padding).
  const std::pair<std::string, int64_t> pass[] = {{"a", 6}};
  absl::StatusOr<absl::Span<const int32_t>> slots = (*recorder)->SetBatch(pass);
  ASSERT_TRUE(slots.ok());
  const int32_t ids[] = {0, 1, 2, 3, 3, 3};
  // Prompt rows: uniform, {1/2, 1/2, 0, 0}, {0, 0, 0, 1}; decode and padding rows elsewhere.
  const float logits[] = {0.f, 0.f, 0.f,   0.f,   0.f, 0.f, -1e4f, -1e4f, -1e4f, -1e4f, -1e4f, 0.f,
                          9.f, 0.f, -1e4f, -1e4f, 9.f, 0.f, -1e4f, -1e4f, 9.f,   9.f,   9.f,   9.f};
  ASSERT_TRUE(capture
                  ->RecordDirectGateLogits(0, ids, IndexType::kInt32, 1, logits, LogitsType::kFloat32, 0, slots->data(),
                                           IndexType::kInt32, 6, nullptr)
                  .ok());
  absl::StatusOr<CalibrationRecord> record = (*recorder)->FinishRequest("a");
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_THAT(record->gate_prob_sums, ::testing::ElementsAre(0.75f, 0.75f, 0.25f, 1.25f));
  EXPECT_THAT(record->prefill_counts, ::testing::ElementsAre(1, 1, 1, 0));
  EXPECT_THAT(record->decode_counts, ::testing::ElementsAre(0, 0, 0, 2));
}

TEST(CalibrationRecorderTest, RefusesContextsItCannotUseAndRequestsItCannotTake) {
  Options options;
  options.num_layers = 2;
  options.num_experts = 4;
  options.max_direct_requests = 2;
  auto no_gate = MustCreate(options);
  ASSERT_NE(no_gate, nullptr);
  EXPECT_THAT(CalibrationRecorder::Create(no_gate.get()).status().message(), HasSubstr("record_gate_probs"));
  options.record_gate_probs = true;
  options.max_direct_requests = 1;
  auto one_slot = MustCreate(options);
  ASSERT_NE(one_slot, nullptr);
  EXPECT_THAT(CalibrationRecorder::Create(one_slot.get()).status().message(), HasSubstr("max_direct_requests >= 2"));
  options.max_direct_requests = 2;
  auto capture = MustCreate(options);
  ASSERT_NE(capture, nullptr);
  EXPECT_EQ(CalibrationRecorder::Create(capture.get(), 0).status().code(), absl::StatusCode::kInvalidArgument);
  auto recorder = CalibrationRecorder::Create(capture.get(), 4);
  ASSERT_TRUE(recorder.ok());
  EXPECT_EQ((*recorder)->SerializeCaptureFile().status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*recorder)->BeginRequest("a", 3).ok());
  EXPECT_EQ((*recorder)->BeginRequest("a", 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*recorder)->BeginRequest("b", 3).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*recorder)->FinishRequest("b").status().code(), absl::StatusCode::kNotFound);
  // Positions: 3 prompt, then 4 decode, then padding.
  const std::pair<std::string, int64_t> pass[] = {{"a", 9}};
  absl::StatusOr<absl::Span<const int32_t>> slots = (*recorder)->SetBatch(pass);
  ASSERT_TRUE(slots.ok());
  EXPECT_THAT(std::vector<int32_t>(slots->begin(), slots->end()), ::testing::ElementsAre(0, 0, 0, 1, 1, 1, 1, -1, -1));
  absl::StatusOr<CalibrationRecord> record = (*recorder)->FinishRequest("a");
  ASSERT_TRUE(record.ok());
  EXPECT_EQ(record->decode_tokens, 4);
  EXPECT_TRUE((*recorder)->BeginRequest("b", 3).ok());  // its slots are free again
}

}  // namespace
}  // namespace eldr::capture
