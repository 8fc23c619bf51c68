// The C ABI of libeldr_capture.so, linked as a shared library the way an engine uses it: status
// codes and thread-local messages, struct_size checks, a record/finish round trip with result
// handles, statistics, and the router client against an in-process fake router.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "capture/fake_router.h"
#include "eldr/capture/capture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;

eldr_capture_options SmallOptions() {
  eldr_capture_options options;
  eldr_capture_options_init(&options);
  options.num_layers = 2;
  options.num_experts = 4;
  options.max_top_k = 2;
  options.num_blocks = 8;
  options.block_size = 4;
  options.result_slots = 1;
  options.max_direct_requests = 2;
  return options;
}

TEST(CaptureCApiTest, DefaultsAndNames) {
  eldr_capture_options options;
  std::memset(&options, 0xff, sizeof(options));
  eldr_capture_options_init(&options);
  EXPECT_EQ(options.struct_size, sizeof(options));
  EXPECT_EQ(options.device, ELDR_CAPTURE_DEVICE_CPU);
  EXPECT_EQ(options.max_top_k, 8);
  EXPECT_EQ(options.max_finish_requests, 64);
  EXPECT_EQ(options.result_slots, 4);
  EXPECT_EQ(options.validate_pointers, 1);
  EXPECT_EQ(options.num_layers, 0);
  EXPECT_STREQ(eldr_capture_status_name(ELDR_CAPTURE_INVALID_ARGUMENT), "INVALID_ARGUMENT");
  EXPECT_STREQ(eldr_capture_status_name(ELDR_CAPTURE_BUFFER_TOO_SMALL), "BUFFER_TOO_SMALL");
  EXPECT_STREQ(eldr_capture_status_name(99), "UNKNOWN");
  EXPECT_STREQ(eldr_capture_version(), "0.1.0");
}

TEST(CaptureCApiTest, ErrorsCarryACodeAndAThreadLocalMessage) {
  eldr_capture_ctx* ctx = reinterpret_cast<eldr_capture_ctx*>(0x1);
  eldr_capture_options options = SmallOptions();
  options.num_experts = 0;
  EXPECT_EQ(eldr_capture_create(&options, &ctx), ELDR_CAPTURE_INVALID_ARGUMENT);
  EXPECT_EQ(ctx, nullptr);
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("num_layers and num_experts must be > 0"));
  // Another thread has its own message.
  std::string other;
  std::thread([&] { other = eldr_capture_last_error(); }).join();
  EXPECT_EQ(other, "");
  // A struct from an older caller (too small) is refused with advice.
  options = SmallOptions();
  options.struct_size = 8;
  EXPECT_EQ(eldr_capture_create(&options, &ctx), ELDR_CAPTURE_INVALID_ARGUMENT);
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("eldr_capture_options_init"));
  EXPECT_EQ(eldr_capture_create(nullptr, &ctx), ELDR_CAPTURE_INVALID_ARGUMENT);
  EXPECT_EQ(eldr_capture_record(nullptr, 0, nullptr, 0, 1, nullptr, 0, 0, 0, nullptr), ELDR_CAPTURE_INVALID_ARGUMENT);
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("ctx is null"));
}

TEST(CaptureCApiTest, CudaAvailabilityIsReportedWithAReason) {
  const int available = eldr_capture_cuda_available();
  if (available == 1) {
    SUCCEED() << "a GPU is usable here";
    return;
  }
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("no usable GPU"));
  eldr_capture_options options = SmallOptions();
  options.device = ELDR_CAPTURE_DEVICE_CUDA;
  eldr_capture_ctx* ctx = nullptr;
  EXPECT_EQ(eldr_capture_create(&options, &ctx), ELDR_CAPTURE_UNAVAILABLE);
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("no usable GPU"));
}

TEST(CaptureCApiTest, RecordFinishRoundTrip) {
  eldr_capture_options options = SmallOptions();
  eldr_capture_ctx* ctx = nullptr;
  ASSERT_EQ(eldr_capture_create(&options, &ctx), ELDR_CAPTURE_OK) << eldr_capture_last_error();
  eldr_capture_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(eldr_capture_get_info(ctx, &info), ELDR_CAPTURE_OK);
  EXPECT_EQ(info.counter_bits, 8);
  EXPECT_EQ(info.counter_max, 255u);
  EXPECT_EQ(info.block_counts_bytes, 8u * 16u);

  // Request A: 6 tokens in blocks 3, 6. Token t chooses experts {t % 4, (t + 1) % 4} in layer 0
  // and {0, 0} in layer 1; one id is out of range.
  const std::vector<int64_t> slots = {12, 13, 14, 15, 24, 25};
  std::vector<int32_t> layer0, layer1;
  for (int t = 0; t < 6; ++t) {
    layer0.insert(layer0.end(), {t % 4, (t + 1) % 4});
    layer1.insert(layer1.end(), {0, 0});
  }
  layer1[11] = 77;
  ASSERT_EQ(eldr_capture_record(ctx, 0, layer0.data(), ELDR_CAPTURE_INT32, 2, slots.data(), ELDR_CAPTURE_INT64, 6, 0,
                                nullptr),
            ELDR_CAPTURE_OK);
  ASSERT_EQ(eldr_capture_record(ctx, 1, layer1.data(), ELDR_CAPTURE_INT32, 2, slots.data(), ELDR_CAPTURE_INT64, 6, 0,
                                nullptr),
            ELDR_CAPTURE_OK);
  std::vector<int32_t> block(8);
  ASSERT_EQ(eldr_capture_read_block_counts(ctx, 6, 1, block.data(), nullptr), ELDR_CAPTURE_OK);
  EXPECT_EQ(block, (std::vector<int32_t>{1, 2, 1, 0, 3, 0, 0, 0}));

  const std::vector<int32_t> table = {3, 6};
  const std::vector<int64_t> lengths = {6};
  eldr_capture_result* result = nullptr;
  ASSERT_EQ(eldr_capture_finish(ctx, table.data(), 2, lengths.data(), 1, ELDR_CAPTURE_OUTPUT_INT16, nullptr, &result),
            ELDR_CAPTURE_OK)
      << eldr_capture_last_error();
  ASSERT_EQ(eldr_capture_result_wait(result), ELDR_CAPTURE_OK);
  EXPECT_EQ(eldr_capture_result_query(result), ELDR_CAPTURE_OK);
  EXPECT_EQ(eldr_capture_result_num_requests(result), 1);
  EXPECT_EQ(eldr_capture_result_output_type(result), ELDR_CAPTURE_OUTPUT_INT16);
  const auto* counts = static_cast<const int16_t*>(eldr_capture_result_counts(result));
  ASSERT_NE(counts, nullptr);
  // Layer 0: ids {0,1},{1,2},{2,3},{3,0},{0,1},{1,2} -> 3, 4, 3, 2. Layer 1: eleven zeros.
  EXPECT_EQ(std::vector<int16_t>(counts, counts + 8), (std::vector<int16_t>{3, 4, 3, 2, 11, 0, 0, 0}));
  eldr_capture_stats stats;
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(eldr_capture_result_stats(result, &stats), ELDR_CAPTURE_OK);
  EXPECT_EQ(stats.recorded_choices, 23u);
  EXPECT_EQ(stats.bad_expert_ids, 1u);
  EXPECT_EQ(stats.block_resets, 4u);  // slots 12 and 24, in both layer calls

  // The only result slot is held: the next finish is refused until the result is released.
  eldr_capture_result* second = nullptr;
  EXPECT_EQ(eldr_capture_finish(ctx, table.data(), 2, lengths.data(), 1, ELDR_CAPTURE_OUTPUT_INT32, nullptr, &second),
            ELDR_CAPTURE_RESOURCE_EXHAUSTED);
  EXPECT_EQ(second, nullptr);
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("result slots are held"));
  eldr_capture_result_release(result);
  ASSERT_EQ(eldr_capture_finish(ctx, table.data(), 2, lengths.data(), 1, ELDR_CAPTURE_OUTPUT_INT32, nullptr, &second),
            ELDR_CAPTURE_OK);
  ASSERT_EQ(eldr_capture_result_wait(second), ELDR_CAPTURE_OK);
  EXPECT_EQ(static_cast<const int32_t*>(eldr_capture_result_counts(second))[1], 4);

  ASSERT_EQ(eldr_capture_get_stats(ctx, &stats, nullptr), ELDR_CAPTURE_OK);
  EXPECT_EQ(stats.recorded_choices, 23u);
  ASSERT_EQ(eldr_capture_reset_stats(ctx, nullptr), ELDR_CAPTURE_OK);
  ASSERT_EQ(eldr_capture_get_stats(ctx, &stats, nullptr), ELDR_CAPTURE_OK);
  EXPECT_EQ(stats.recorded_choices, 0u);
  // The result outlives the context.
  eldr_capture_destroy(ctx);
  EXPECT_EQ(static_cast<const int32_t*>(eldr_capture_result_counts(second))[0], 3);
  eldr_capture_result_release(second);
}

TEST(CaptureCApiTest, DirectModeThroughTheCAbi) {
  eldr_capture_options options = SmallOptions();
  eldr_capture_ctx* ctx = nullptr;
  ASSERT_EQ(eldr_capture_create(&options, &ctx), ELDR_CAPTURE_OK);
  const std::vector<int32_t> requests = {1, 0, 1, -1, 5};
  const std::vector<int64_t> ids = {3, 3, 0, 1, 3, 2, 0, 0, 1, 1};
  ASSERT_EQ(eldr_capture_record_direct(ctx, 1, ids.data(), ELDR_CAPTURE_INT64, 2, requests.data(), ELDR_CAPTURE_INT32,
                                       5, nullptr),
            ELDR_CAPTURE_OK);
  std::vector<int32_t> direct(16);
  ASSERT_EQ(eldr_capture_read_direct_counts(ctx, 0, 2, direct.data(), nullptr), ELDR_CAPTURE_OK);
  EXPECT_EQ(direct, (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 0, 0,  //
                                          0, 0, 0, 0, 0, 0, 1, 3}));
  const std::vector<int32_t> finishing = {1};
  eldr_capture_result* result = nullptr;
  ASSERT_EQ(eldr_capture_finish_direct(ctx, finishing.data(), 1, ELDR_CAPTURE_OUTPUT_INT32, nullptr, &result),
            ELDR_CAPTURE_OK);
  ASSERT_EQ(eldr_capture_result_wait(result), ELDR_CAPTURE_OK);
  const auto* counts = static_cast<const int32_t*>(eldr_capture_result_counts(result));
  EXPECT_EQ(std::vector<int32_t>(counts, counts + 8), (std::vector<int32_t>{0, 0, 0, 0, 0, 0, 1, 3}));
  eldr_capture_stats stats;
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(eldr_capture_result_stats(result, &stats), ELDR_CAPTURE_OK);
  EXPECT_EQ(stats.padding_tokens, 1u);
  EXPECT_EQ(stats.bad_request_indices, 1u);
  eldr_capture_result_release(result);
  eldr_capture_destroy(ctx);
}

TEST(CaptureCApiTest, GateProbSumsThroughTheCAbi) {
  eldr_capture_options options;
  eldr_capture_options_init(&options);
  EXPECT_EQ(options.record_gate_probs, 0);
  options.num_layers = 1;
  options.num_experts = 3;
  options.max_top_k = 2;
  options.num_blocks = 2;
  options.block_size = 4;
  options.max_direct_requests = 2;
  options.record_gate_probs = 1;
  eldr_capture_ctx* ctx = nullptr;
  ASSERT_EQ(eldr_capture_create(&options, &ctx), ELDR_CAPTURE_OK) << eldr_capture_last_error();
  eldr_capture_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(eldr_capture_get_info(ctx, &info), ELDR_CAPTURE_OK);
  EXPECT_EQ(info.gate_prob_fraction_bits, 24);
  EXPECT_EQ(info.block_gate_prob_bytes, 2u * 3 * 4);
  const int32_t ids[] = {0, 2, 1, 2};
  const float weights[] = {0.5f, 0.5f, 0.25f, 0.75f};
  const int64_t slots[] = {4, 5};  // block 1
  ASSERT_EQ(eldr_capture_record_gate_probs(ctx, 0, ids, ELDR_CAPTURE_INT32, weights, 2, slots, ELDR_CAPTURE_INT64, 2, 0,
                                           nullptr),
            ELDR_CAPTURE_OK)
      << eldr_capture_last_error();
  const int32_t table[] = {1};
  const int64_t length = 2;
  eldr_capture_result* result = nullptr;
  ASSERT_EQ(eldr_capture_finish_gate_probs(ctx, table, 1, &length, 1, nullptr, &result), ELDR_CAPTURE_OK);
  ASSERT_EQ(eldr_capture_result_wait(result), ELDR_CAPTURE_OK);
  EXPECT_EQ(eldr_capture_result_output_type(result), ELDR_CAPTURE_OUTPUT_FLOAT32);
  const float* sums = eldr_capture_result_gate_prob_sums(result);
  ASSERT_NE(sums, nullptr);
  EXPECT_EQ(std::vector<float>(sums, sums + 3), (std::vector<float>{0.5f, 0.25f, 1.25f}));
  EXPECT_EQ(eldr_capture_result_counts(result), static_cast<const void*>(sums));
  eldr_capture_result_release(result);

  // Direct mode, and a bad probability counted in the stats.
  const int32_t requests[] = {1, 1};
  const float direct_weights[] = {0.5f, -1.0f, 0.125f, 0.125f};
  ASSERT_EQ(eldr_capture_record_direct_gate_probs(ctx, 0, ids, ELDR_CAPTURE_INT32, direct_weights, 2, requests,
                                                  ELDR_CAPTURE_INT32, 2, nullptr),
            ELDR_CAPTURE_OK);
  const int32_t slot[] = {1};
  ASSERT_EQ(eldr_capture_finish_direct_gate_probs(ctx, slot, 1, nullptr, &result), ELDR_CAPTURE_OK);
  sums = eldr_capture_result_gate_prob_sums(result);
  ASSERT_NE(sums, nullptr);
  EXPECT_EQ(std::vector<float>(sums, sums + 3), (std::vector<float>{0.5f, 0.125f, 0.125f}));
  eldr_capture_stats stats;
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(eldr_capture_result_stats(result, &stats), ELDR_CAPTURE_OK);
  EXPECT_EQ(stats.bad_gate_probs, 1u);
  eldr_capture_result_release(result);
  // A count finish's result has no gate sums.
  ASSERT_EQ(eldr_capture_finish(ctx, table, 1, &length, 1, ELDR_CAPTURE_OUTPUT_INT32, nullptr, &result),
            ELDR_CAPTURE_OK);
  EXPECT_EQ(eldr_capture_result_gate_prob_sums(result), nullptr);
  eldr_capture_result_release(result);
  eldr_capture_destroy(ctx);
}

TEST(CaptureCApiTest, GateLogitsThroughTheCAbi) {
  eldr_capture_options options;
  eldr_capture_options_init(&options);
  options.num_layers = 1;
  options.num_experts = 4;
  options.max_top_k = 1;
  options.num_blocks = 2;
  options.block_size = 4;
  options.max_direct_requests = 2;
  options.record_gate_probs = 1;
  eldr_capture_ctx* ctx = nullptr;
  ASSERT_EQ(eldr_capture_create(&options, &ctx), ELDR_CAPTURE_OK) << eldr_capture_last_error();
  // Rows with exact softmaxes: {0, 0, -1000, -1000} -> {1/2, 1/2, 0, 0}; {0, 0, 0, 0} -> 1/4 each;
  // one NaN row (skipped, counted). float16 bits: 0 = 0x0000, -1000 = 0xe3d0, NaN = 0x7e00.
  const uint16_t logits[] = {0x0000, 0x0000, 0xe3d0, 0xe3d0, 0x0000, 0x0000,
                             0x0000, 0x0000, 0x0000, 0x7e00, 0x0000, 0x0000};
  const int32_t ids[] = {3, 3, 3};
  const int64_t slots[] = {4, 5, 6};  // block 1
  ASSERT_EQ(eldr_capture_record_gate_logits(ctx, 0, ids, ELDR_CAPTURE_INT32, 1, logits, ELDR_CAPTURE_LOGITS_FLOAT16, 0,
                                            slots, ELDR_CAPTURE_INT64, 3, 0, nullptr),
            ELDR_CAPTURE_OK)
      << eldr_capture_last_error();
  const int32_t table[] = {1};
  const int64_t length = 3;
  eldr_capture_result* result = nullptr;
  ASSERT_EQ(eldr_capture_finish_gate_probs(ctx, table, 1, &length, 1, nullptr, &result), ELDR_CAPTURE_OK);
  const float* sums = eldr_capture_result_gate_prob_sums(result);
  ASSERT_NE(sums, nullptr);
  EXPECT_EQ(std::vector<float>(sums, sums + 4), (std::vector<float>{0.75f, 0.75f, 0.25f, 0.25f}));
  eldr_capture_stats stats;
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(eldr_capture_result_stats(result, &stats), ELDR_CAPTURE_OK);
  EXPECT_EQ(stats.bad_gate_probs, 1u);
  EXPECT_EQ(stats.recorded_choices, 3u);
  eldr_capture_result_release(result);

  // Direct mode, float32 rows {0, 0, 0, 0} and {0, -1e4, -1e4, 0} with a stride of 5 (123: never read).
  const float rows[] = {0.f, 0.f, 0.f, 0.f, 123.f, 0.f, -1e4f, -1e4f, 0.f, 123.f};
  const int32_t requests[] = {1, 1};
  ASSERT_EQ(
      eldr_capture_record_direct_gate_logits(ctx, 0, ids, ELDR_CAPTURE_INT32, 1, rows, ELDR_CAPTURE_LOGITS_FLOAT32, 5,
                                             requests, ELDR_CAPTURE_INT32, 2, nullptr),
      ELDR_CAPTURE_OK)
      << eldr_capture_last_error();
  const int32_t slot[] = {1};
  ASSERT_EQ(eldr_capture_finish_direct_gate_probs(ctx, slot, 1, nullptr, &result), ELDR_CAPTURE_OK);
  sums = eldr_capture_result_gate_prob_sums(result);
  ASSERT_NE(sums, nullptr);
  EXPECT_EQ(std::vector<float>(sums, sums + 4), (std::vector<float>{0.75f, 0.25f, 0.25f, 0.75f}));
  eldr_capture_result_release(result);

  // Bad arguments are INVALID_ARGUMENT with the reason.
  EXPECT_EQ(eldr_capture_record_gate_logits(ctx, 0, ids, ELDR_CAPTURE_INT32, 1, logits, 9, 0, slots, ELDR_CAPTURE_INT64,
                                            1, 0, nullptr),
            ELDR_CAPTURE_INVALID_ARGUMENT);
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("logits_type"));
  EXPECT_EQ(eldr_capture_record_gate_logits(nullptr, 0, ids, ELDR_CAPTURE_INT32, 1, logits, 0, 0, slots,
                                            ELDR_CAPTURE_INT64, 1, 0, nullptr),
            ELDR_CAPTURE_INVALID_ARGUMENT);
  eldr_capture_destroy(ctx);
}

TEST(CaptureCApiTest, CallersOfTheOlderStructsStillWork) {
  // A caller compiled before record_gate_probs (and the stats' bad_gate_probs) existed passes the
  // older, smaller struct_size: accepted, the new fields neither read nor written.
  eldr_capture_options options;
  eldr_capture_options_init(&options);
  options.struct_size = static_cast<uint32_t>(offsetof(eldr_capture_options, record_gate_probs));
  options.record_gate_probs = 1;  // beyond the caller's struct: must be ignored
  options.num_layers = 1;
  options.num_experts = 2;
  options.num_blocks = 1;
  options.block_size = 4;
  eldr_capture_ctx* ctx = nullptr;
  ASSERT_EQ(eldr_capture_create(&options, &ctx), ELDR_CAPTURE_OK) << eldr_capture_last_error();
  const int32_t ids[] = {0};
  const float weights[] = {0.5f};
  const int64_t slots[] = {0};
  EXPECT_EQ(eldr_capture_record_gate_probs(ctx, 0, ids, ELDR_CAPTURE_INT32, weights, 1, slots, ELDR_CAPTURE_INT64, 1, 0,
                                           nullptr),
            ELDR_CAPTURE_FAILED_PRECONDITION);
  eldr_capture_stats stats;
  std::memset(&stats, 0xab, sizeof(stats));
  stats.struct_size = static_cast<uint32_t>(offsetof(eldr_capture_stats, bad_gate_probs));
  ASSERT_EQ(eldr_capture_get_stats(ctx, &stats, nullptr), ELDR_CAPTURE_OK);
  EXPECT_EQ(stats.bad_gate_probs, 0xababababababababull);  // untouched
  options.struct_size = 8;
  eldr_capture_ctx* refused = nullptr;
  EXPECT_EQ(eldr_capture_create(&options, &refused), ELDR_CAPTURE_INVALID_ARGUMENT);
  eldr_capture_destroy(ctx);
}

TEST(CaptureCApiTest, ClientRoutesAndCompletesThroughTheCAbi) {
  eldr::capture::testing::FakeRouter router;
  ASSERT_GT(router.port(), 0);
  eldr_capture_client* client = nullptr;
  ASSERT_EQ(eldr_capture_client_create(router.target().c_str(), nullptr, &client), ELDR_CAPTURE_OK)
      << eldr_capture_last_error();
  const std::vector<int16_t> counts = {0, 5, 1, 2, 0, 0, 9, 0};  // 2 x 4, argmax 6
  char worker[64];
  char address[64];
  uint64_t lease = 0;
  eldr_capture_route_details details;
  details.struct_size = sizeof(details);
  ASSERT_EQ(eldr_capture_client_route(client, "req-7", 99, counts.data(), ELDR_CAPTURE_OUTPUT_INT16, 2, 4, worker,
                                      sizeof(worker), address, sizeof(address), &lease, &details),
            ELDR_CAPTURE_OK)
      << eldr_capture_last_error();
  EXPECT_STREQ(worker, "decode-0");
  EXPECT_STREQ(address, "10.0.0.0:8000");
  EXPECT_EQ(lease, 1000u);
  EXPECT_STREQ(details.policy, "eldr");
  EXPECT_EQ(details.band_size, 2);
  EXPECT_EQ(router.service().last().counts, std::vector<int32_t>(counts.begin(), counts.end()));
  EXPECT_EQ(router.service().last().prompt_tokens, 99);
  ASSERT_EQ(eldr_capture_client_complete(client, lease, 12), ELDR_CAPTURE_OK);
  EXPECT_EQ(eldr_capture_client_complete(client, lease, 12), ELDR_CAPTURE_NOT_FOUND);
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("unknown lease 1000"));

  // Without counts the router balances load only.
  ASSERT_EQ(eldr_capture_client_route(client, nullptr, 5, nullptr, 0, 0, 0, worker, sizeof(worker), address,
                                      sizeof(address), &lease, &details),
            ELDR_CAPTURE_OK);
  EXPECT_STREQ(details.fallback_reason, "no_signature");

  // A worker id that does not fit: the route was made, the lease is returned with the error.
  char tiny[8];
  lease = 0;
  EXPECT_EQ(eldr_capture_client_route(client, "long-worker", 5, counts.data(), ELDR_CAPTURE_OUTPUT_INT16, 2, 4, tiny,
                                      sizeof(tiny), address, sizeof(address), &lease, nullptr),
            ELDR_CAPTURE_BUFFER_TOO_SMALL);
  EXPECT_EQ(lease, 1002u);
  EXPECT_STREQ(tiny, "");
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("worker_id needs 301 bytes (have 8)"));
  EXPECT_EQ(eldr_capture_client_complete(client, lease, 0), ELDR_CAPTURE_OK);

  EXPECT_EQ(eldr_capture_client_route(client, "reject", 5, counts.data(), ELDR_CAPTURE_OUTPUT_INT16, 2, 4, worker,
                                      sizeof(worker), address, sizeof(address), &lease, nullptr),
            ELDR_CAPTURE_INVALID_ARGUMENT);
  EXPECT_EQ(eldr_capture_client_route(client, "x", 5, counts.data(), 7, 2, 4, worker, sizeof(worker), address,
                                      sizeof(address), &lease, nullptr),
            ELDR_CAPTURE_INVALID_ARGUMENT);
  EXPECT_THAT(eldr_capture_last_error(), HasSubstr("counts_type must be int16 (0), int32 (1) or float32"));

  // Gate-probability sums go out as RouteRequest.gate_prob_sums, float32 little-endian.
  const std::vector<float> sums = {0.f, 0.25f, 3.5f, 0.f, 1.f, 0.f, 0.f, 0.125f};  // argmax 2
  ASSERT_EQ(eldr_capture_client_route(client, "gate", 7, sums.data(), ELDR_CAPTURE_OUTPUT_FLOAT32, 2, 4, worker,
                                      sizeof(worker), address, sizeof(address), &lease, nullptr),
            ELDR_CAPTURE_OK)
      << eldr_capture_last_error();
  EXPECT_STREQ(worker, "decode-2");
  EXPECT_EQ(router.service().last().encoding, "float32_le");
  EXPECT_EQ(router.service().last().gate_prob_sums, sums);
  EXPECT_EQ(router.service().last().layers, 2);
  EXPECT_EQ(eldr_capture_client_complete(client, lease, 0), ELDR_CAPTURE_OK);
  eldr_capture_client_destroy(client);

  // Unreachable router: UNAVAILABLE (or the deadline) within the timeout.
  int closed_port = 0;
  {
    eldr::capture::testing::FakeRouter gone;
    closed_port = gone.port();
  }
  eldr_capture_client_options client_options;
  eldr_capture_client_options_init(&client_options);
  client_options.timeout_ms = 200;
  const std::string target = "127.0.0.1:" + std::to_string(closed_port);
  ASSERT_EQ(eldr_capture_client_create(target.c_str(), &client_options, &client), ELDR_CAPTURE_OK);
  const int status = eldr_capture_client_route(client, "", 1, counts.data(), ELDR_CAPTURE_OUTPUT_INT16, 2, 4, worker,
                                               sizeof(worker), address, sizeof(address), &lease, nullptr);
  EXPECT_TRUE(status == ELDR_CAPTURE_UNAVAILABLE || status == ELDR_CAPTURE_DEADLINE_EXCEEDED)
      << eldr_capture_status_name(status) << ": " << eldr_capture_last_error();
  eldr_capture_client_destroy(client);
}

}  // namespace
