// The C ABI of libeldr_capture.so (include/eldr/capture/capture.h): thin wrappers over the C++ API that turn
// absl::Status into eldr_capture_status plus a thread-local message, and never let an exception
// cross the boundary.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "capture_backend.h"
#include "eldr/capture/capture.h"
#include "eldr/capture/capture.hpp"

struct eldr_capture_ctx {
  std::unique_ptr<eldr::capture::Capture> impl;
};

struct eldr_capture_result {
  std::unique_ptr<eldr::capture::FinishResult> impl;
};

struct eldr_capture_client {
  std::unique_ptr<eldr::capture::RouterClient> impl;
};

namespace {

using eldr::capture::Capture;
using eldr::capture::Device;
using eldr::capture::FinishResult;
using eldr::capture::IndexType;
using eldr::capture::OutputType;
using eldr::capture::Stats;

thread_local std::string last_error;

int ToCode(const absl::Status& status) {
  if (status.ok()) return ELDR_CAPTURE_OK;
  if (eldr::capture::internal::IsDeviceError(status)) return ELDR_CAPTURE_DEVICE_ERROR;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return ELDR_CAPTURE_INVALID_ARGUMENT;
    case absl::StatusCode::kResourceExhausted:
      return ELDR_CAPTURE_RESOURCE_EXHAUSTED;
    case absl::StatusCode::kUnavailable:
      return ELDR_CAPTURE_UNAVAILABLE;
    case absl::StatusCode::kNotFound:
      return ELDR_CAPTURE_NOT_FOUND;
    case absl::StatusCode::kFailedPrecondition:
      return ELDR_CAPTURE_FAILED_PRECONDITION;
    case absl::StatusCode::kDeadlineExceeded:
      return ELDR_CAPTURE_DEADLINE_EXCEEDED;
    default:
      return ELDR_CAPTURE_INTERNAL;
  }
}

int Report(const absl::Status& status) {
  if (!status.ok()) last_error = std::string(status.message());
  return ToCode(status);
}

int Fail(int code, std::string message) {
  last_error = std::move(message);
  return code;
}

// Runs `body` (returning an eldr_capture_status) with exceptions turned into ELDR_CAPTURE_INTERNAL.
template <typename Body>
int Guarded(const char* function, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Fail(ELDR_CAPTURE_RESOURCE_EXHAUSTED, absl::StrCat(function, ": out of host memory"));
  } catch (const std::exception& e) {
    return Fail(ELDR_CAPTURE_INTERNAL, absl::StrCat(function, ": ", e.what()));
  } catch (...) {
    return Fail(ELDR_CAPTURE_INTERNAL, absl::StrCat(function, ": unknown exception"));
  }
}

template <typename Struct>
bool StructTooSmall(const Struct* s) {
  return s->struct_size < sizeof(Struct);
}

// Whether a caller's struct (its struct_size) reaches past `field`: fields appended in later
// versions are read and written only then, so callers built against an older header keep working.
template <typename Struct, typename Field>
bool Covers(const Struct* s, const Field* field) {
  const size_t end =
      static_cast<size_t>(reinterpret_cast<const char*>(field) - reinterpret_cast<const char*>(s)) + sizeof(Field);
  return s->struct_size >= end;
}

// The sizes of the structs before gate probabilities were added (the oldest accepted).
constexpr size_t kOptionsSizeV1 = offsetof(eldr_capture_options, record_gate_probs);
constexpr size_t kInfoSizeV1 = offsetof(eldr_capture_info, gate_prob_fraction_bits);
constexpr size_t kStatsSizeV1 = offsetof(eldr_capture_stats, bad_gate_probs);

void FillStats(const Stats& from, eldr_capture_stats* to) {
  to->reserved = 0;
  to->recorded_choices = from.recorded_choices;
  to->padding_tokens = from.padding_tokens;
  to->bad_slots = from.bad_slots;
  to->bad_expert_ids = from.bad_expert_ids;
  to->bad_request_indices = from.bad_request_indices;
  to->bad_block_ids = from.bad_block_ids;
  to->duplicate_slots = from.duplicate_slots;
  to->saturated_adds = from.saturated_adds;
  to->saturated_outputs = from.saturated_outputs;
  to->block_resets = from.block_resets;
  if (Covers(to, &to->bad_gate_probs)) to->bad_gate_probs = from.bad_gate_probs;
}

int NullHandle(const char* function, const char* what) {
  return Fail(ELDR_CAPTURE_INVALID_ARGUMENT, absl::StrCat(function, ": ", what, " is null"));
}

// Copies `value` into a caller buffer; false when it does not fit (with its terminating NUL).
bool CopyString(const std::string& value, char* buffer, size_t capacity) {
  if (buffer == nullptr || value.size() + 1 > capacity) return false;
  std::memcpy(buffer, value.c_str(), value.size() + 1);
  return true;
}

void CopyTruncated(const std::string& value, char* buffer, size_t capacity) {
  const size_t n = std::min(value.size(), capacity - 1);
  std::memcpy(buffer, value.data(), n);
  buffer[n] = '\0';
}

}  // namespace

extern "C" {

const char* eldr_capture_status_name(int status) {
  switch (status) {
    case ELDR_CAPTURE_OK:
      return "OK";
    case ELDR_CAPTURE_NOT_READY:
      return "NOT_READY";
    case ELDR_CAPTURE_INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case ELDR_CAPTURE_RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case ELDR_CAPTURE_UNAVAILABLE:
      return "UNAVAILABLE";
    case ELDR_CAPTURE_DEVICE_ERROR:
      return "DEVICE_ERROR";
    case ELDR_CAPTURE_NOT_FOUND:
      return "NOT_FOUND";
    case ELDR_CAPTURE_FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case ELDR_CAPTURE_DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case ELDR_CAPTURE_BUFFER_TOO_SMALL:
      return "BUFFER_TOO_SMALL";
    case ELDR_CAPTURE_INTERNAL:
      return "INTERNAL";
    default:
      return "UNKNOWN";
  }
}

const char* eldr_capture_last_error(void) { return last_error.c_str(); }

const char* eldr_capture_version(void) { return "0.1.0"; }

int eldr_capture_cuda_available(void) {
  const absl::Status status = eldr::capture::CudaAvailable();
  if (!status.ok()) {
    last_error = std::string(status.message());
    return 0;
  }
  return 1;
}

void eldr_capture_options_init(eldr_capture_options* options) {
  if (options == nullptr) return;
  const eldr::capture::Options defaults;
  std::memset(options, 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->device = ELDR_CAPTURE_DEVICE_CPU;
  options->cuda_device = defaults.cuda_device;
  options->max_top_k = defaults.max_top_k;
  options->counter_bits = defaults.counter_bits;
  options->max_finish_requests = defaults.max_finish_requests;
  options->max_blocks_per_request = defaults.max_blocks_per_request;
  options->result_slots = defaults.result_slots;
  options->max_direct_requests = defaults.max_direct_requests;
  options->validate_pointers = defaults.validate_pointers ? 1 : 0;
}

int eldr_capture_create(const eldr_capture_options* options, eldr_capture_ctx** out) {
  return Guarded("eldr_capture_create", [&] {
    if (out == nullptr) return NullHandle("eldr_capture_create", "out");
    *out = nullptr;
    if (options == nullptr) return NullHandle("eldr_capture_create", "options");
    if (options->struct_size < kOptionsSizeV1) {
      return Fail(
          ELDR_CAPTURE_INVALID_ARGUMENT,
          absl::StrCat("eldr_capture_create: options->struct_size is ", options->struct_size, ", expected at least ",
                       kOptionsSizeV1, ": initialise options with eldr_capture_options_init"));
    }
    eldr::capture::Options o;
    o.device = static_cast<Device>(options->device);
    o.cuda_device = options->cuda_device;
    o.num_layers = options->num_layers;
    o.num_experts = options->num_experts;
    o.max_top_k = options->max_top_k;
    o.num_blocks = options->num_blocks;
    o.block_size = options->block_size;
    o.counter_bits = options->counter_bits;
    o.max_finish_requests = options->max_finish_requests;
    o.max_blocks_per_request = options->max_blocks_per_request;
    o.result_slots = options->result_slots;
    o.max_direct_requests = options->max_direct_requests;
    o.validate_pointers = options->validate_pointers != 0;
    o.record_gate_probs = Covers(options, &options->record_gate_probs) && options->record_gate_probs != 0;
    absl::StatusOr<std::unique_ptr<Capture>> capture = Capture::Create(o);
    if (!capture.ok()) return Report(capture.status());
    *out = new eldr_capture_ctx{*std::move(capture)};
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

void eldr_capture_destroy(eldr_capture_ctx* ctx) { delete ctx; }

int eldr_capture_get_info(const eldr_capture_ctx* ctx, eldr_capture_info* info) {
  if (ctx == nullptr) return NullHandle("eldr_capture_get_info", "ctx");
  if (info == nullptr) return NullHandle("eldr_capture_get_info", "info");
  if (info->struct_size < kInfoSizeV1) {
    return Fail(ELDR_CAPTURE_INVALID_ARGUMENT,
                "eldr_capture_get_info: set info->struct_size = sizeof(eldr_capture_info)");
  }
  const eldr::capture::Info& i = ctx->impl->info();
  info->device = static_cast<int32_t>(i.device);
  info->num_layers = i.num_layers;
  info->num_experts = i.num_experts;
  info->num_blocks = i.num_blocks;
  info->block_size = i.block_size;
  info->counter_bits = i.counter_bits;
  info->counter_max = i.counter_max;
  info->block_counts_bytes = i.block_counts_bytes;
  info->device_bytes = i.device_bytes;
  info->host_bytes = i.host_bytes;
  if (Covers(info, &info->block_gate_prob_bytes)) {
    info->gate_prob_fraction_bits = i.gate_prob_fraction_bits;
    info->reserved = 0;
    info->block_gate_prob_bytes = i.block_gate_prob_bytes;
  }
  return ELDR_CAPTURE_OK;
}

int eldr_capture_record(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids, int32_t id_type, int32_t top_k,
                        const void* slot_mapping, int32_t slot_type, int64_t num_tokens, uint32_t flags, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_record", "ctx");
  return Guarded("eldr_capture_record", [&] {
    return Report(ctx->impl->Record(layer, topk_ids, static_cast<IndexType>(id_type), top_k, slot_mapping,
                                    static_cast<IndexType>(slot_type), num_tokens, flags, stream));
  });
}

int eldr_capture_reset_batch_blocks(eldr_capture_ctx* ctx, const void* slot_mapping, int32_t slot_type,
                                    int64_t num_tokens, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_reset_batch_blocks", "ctx");
  return Guarded("eldr_capture_reset_batch_blocks", [&] {
    return Report(ctx->impl->ResetBatchBlocks(slot_mapping, static_cast<IndexType>(slot_type), num_tokens, stream));
  });
}

int eldr_capture_clear(eldr_capture_ctx* ctx, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_clear", "ctx");
  return Guarded("eldr_capture_clear", [&] { return Report(ctx->impl->Clear(stream)); });
}

int eldr_capture_finish(eldr_capture_ctx* ctx, const int32_t* block_tables, int64_t block_table_stride,
                        const int64_t* lengths, int32_t num_requests, int32_t output_type, void* stream,
                        eldr_capture_result** out) {
  if (out == nullptr) return NullHandle("eldr_capture_finish", "out");
  *out = nullptr;
  if (ctx == nullptr) return NullHandle("eldr_capture_finish", "ctx");
  return Guarded("eldr_capture_finish", [&] {
    absl::StatusOr<std::unique_ptr<FinishResult>> result = ctx->impl->Finish(
        block_tables, block_table_stride, lengths, num_requests, static_cast<OutputType>(output_type), stream);
    if (!result.ok()) return Report(result.status());
    *out = new eldr_capture_result{*std::move(result)};
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

int eldr_capture_record_gate_probs(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids, int32_t id_type,
                                   const float* topk_weights, int32_t top_k, const void* slot_mapping,
                                   int32_t slot_type, int64_t num_tokens, uint32_t flags, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_record_gate_probs", "ctx");
  return Guarded("eldr_capture_record_gate_probs", [&] {
    return Report(ctx->impl->RecordGateProbs(layer, topk_ids, static_cast<IndexType>(id_type), topk_weights, top_k,
                                             slot_mapping, static_cast<IndexType>(slot_type), num_tokens, flags,
                                             stream));
  });
}

int eldr_capture_record_gate_logits(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids, int32_t id_type,
                                    int32_t top_k, const void* router_logits, int32_t logits_type,
                                    int64_t logits_stride, const void* slot_mapping, int32_t slot_type,
                                    int64_t num_tokens, uint32_t flags, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_record_gate_logits", "ctx");
  return Guarded("eldr_capture_record_gate_logits", [&] {
    return Report(ctx->impl->RecordGateLogits(layer, topk_ids, static_cast<IndexType>(id_type), top_k, router_logits,
                                              static_cast<eldr::capture::LogitsType>(logits_type), logits_stride,
                                              slot_mapping, static_cast<IndexType>(slot_type), num_tokens, flags,
                                              stream));
  });
}

int eldr_capture_record_direct_gate_logits(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids, int32_t id_type,
                                           int32_t top_k, const void* router_logits, int32_t logits_type,
                                           int64_t logits_stride, const void* token_request, int32_t request_type,
                                           int64_t num_tokens, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_record_direct_gate_logits", "ctx");
  return Guarded("eldr_capture_record_direct_gate_logits", [&] {
    return Report(ctx->impl->RecordDirectGateLogits(layer, topk_ids, static_cast<IndexType>(id_type), top_k,
                                                    router_logits, static_cast<eldr::capture::LogitsType>(logits_type),
                                                    logits_stride, token_request, static_cast<IndexType>(request_type),
                                                    num_tokens, stream));
  });
}

int eldr_capture_finish_gate_probs(eldr_capture_ctx* ctx, const int32_t* block_tables, int64_t block_table_stride,
                                   const int64_t* lengths, int32_t num_requests, void* stream,
                                   eldr_capture_result** out) {
  if (out == nullptr) return NullHandle("eldr_capture_finish_gate_probs", "out");
  *out = nullptr;
  if (ctx == nullptr) return NullHandle("eldr_capture_finish_gate_probs", "ctx");
  return Guarded("eldr_capture_finish_gate_probs", [&] {
    absl::StatusOr<std::unique_ptr<FinishResult>> result =
        ctx->impl->FinishGateProbs(block_tables, block_table_stride, lengths, num_requests, stream);
    if (!result.ok()) return Report(result.status());
    *out = new eldr_capture_result{*std::move(result)};
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

int eldr_capture_record_direct_gate_probs(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids, int32_t id_type,
                                          const float* topk_weights, int32_t top_k, const void* token_request,
                                          int32_t request_type, int64_t num_tokens, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_record_direct_gate_probs", "ctx");
  return Guarded("eldr_capture_record_direct_gate_probs", [&] {
    return Report(ctx->impl->RecordDirectGateProbs(layer, topk_ids, static_cast<IndexType>(id_type), topk_weights,
                                                   top_k, token_request, static_cast<IndexType>(request_type),
                                                   num_tokens, stream));
  });
}

int eldr_capture_finish_direct_gate_probs(eldr_capture_ctx* ctx, const int32_t* request_slots, int32_t num_requests,
                                          void* stream, eldr_capture_result** out) {
  if (out == nullptr) return NullHandle("eldr_capture_finish_direct_gate_probs", "out");
  *out = nullptr;
  if (ctx == nullptr) return NullHandle("eldr_capture_finish_direct_gate_probs", "ctx");
  return Guarded("eldr_capture_finish_direct_gate_probs", [&] {
    absl::StatusOr<std::unique_ptr<FinishResult>> result =
        ctx->impl->FinishDirectGateProbs(request_slots, num_requests, stream);
    if (!result.ok()) return Report(result.status());
    *out = new eldr_capture_result{*std::move(result)};
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

int eldr_capture_read_block_counts(eldr_capture_ctx* ctx, int64_t first_block, int64_t num_blocks, int32_t* out,
                                   void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_read_block_counts", "ctx");
  return Guarded("eldr_capture_read_block_counts",
                 [&] { return Report(ctx->impl->ReadBlockCounts(first_block, num_blocks, out, stream)); });
}

int eldr_capture_record_direct(eldr_capture_ctx* ctx, int32_t layer, const void* topk_ids, int32_t id_type,
                               int32_t top_k, const void* token_request, int32_t request_type, int64_t num_tokens,
                               void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_record_direct", "ctx");
  return Guarded("eldr_capture_record_direct", [&] {
    return Report(ctx->impl->RecordDirect(layer, topk_ids, static_cast<IndexType>(id_type), top_k, token_request,
                                          static_cast<IndexType>(request_type), num_tokens, stream));
  });
}

int eldr_capture_finish_direct(eldr_capture_ctx* ctx, const int32_t* request_slots, int32_t num_requests,
                               int32_t output_type, void* stream, eldr_capture_result** out) {
  if (out == nullptr) return NullHandle("eldr_capture_finish_direct", "out");
  *out = nullptr;
  if (ctx == nullptr) return NullHandle("eldr_capture_finish_direct", "ctx");
  return Guarded("eldr_capture_finish_direct", [&] {
    absl::StatusOr<std::unique_ptr<FinishResult>> result =
        ctx->impl->FinishDirect(request_slots, num_requests, static_cast<OutputType>(output_type), stream);
    if (!result.ok()) return Report(result.status());
    *out = new eldr_capture_result{*std::move(result)};
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

int eldr_capture_read_direct_counts(eldr_capture_ctx* ctx, int32_t first_slot, int32_t num_slots, int32_t* out,
                                    void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_read_direct_counts", "ctx");
  return Guarded("eldr_capture_read_direct_counts",
                 [&] { return Report(ctx->impl->ReadDirectCounts(first_slot, num_slots, out, stream)); });
}

int eldr_capture_result_query(const eldr_capture_result* result) {
  if (result == nullptr) return NullHandle("eldr_capture_result_query", "result");
  return Guarded("eldr_capture_result_query", [&] {
    absl::StatusOr<bool> ready = result->impl->Query();
    if (!ready.ok()) return Report(ready.status());
    return static_cast<int>(*ready ? ELDR_CAPTURE_OK : ELDR_CAPTURE_NOT_READY);
  });
}

int eldr_capture_result_wait(eldr_capture_result* result) {
  if (result == nullptr) return NullHandle("eldr_capture_result_wait", "result");
  return Guarded("eldr_capture_result_wait", [&] { return Report(result->impl->Wait()); });
}

int32_t eldr_capture_result_num_requests(const eldr_capture_result* result) {
  return result == nullptr ? 0 : result->impl->num_requests();
}

int32_t eldr_capture_result_output_type(const eldr_capture_result* result) {
  return result == nullptr ? -1 : static_cast<int32_t>(result->impl->output_type());
}

const void* eldr_capture_result_counts(const eldr_capture_result* result) {
  if (result == nullptr) return nullptr;
  switch (result->impl->output_type()) {
    case OutputType::kInt16:
      return result->impl->counts_int16();
    case OutputType::kInt32:
      return result->impl->counts_int32();
    case OutputType::kFloat32:
      return result->impl->gate_prob_sums();
  }
  return nullptr;
}

const float* eldr_capture_result_gate_prob_sums(const eldr_capture_result* result) {
  return result == nullptr ? nullptr : result->impl->gate_prob_sums();
}

void eldr_capture_result_release(eldr_capture_result* result) { delete result; }

int eldr_capture_get_stats(eldr_capture_ctx* ctx, eldr_capture_stats* stats, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_get_stats", "ctx");
  if (stats == nullptr) return NullHandle("eldr_capture_get_stats", "stats");
  if (stats->struct_size < kStatsSizeV1) {
    return Fail(ELDR_CAPTURE_INVALID_ARGUMENT,
                "eldr_capture_get_stats: set stats->struct_size = sizeof(eldr_capture_stats)");
  }
  return Guarded("eldr_capture_get_stats", [&] {
    absl::StatusOr<Stats> s = ctx->impl->ReadStats(stream);
    if (!s.ok()) return Report(s.status());
    FillStats(*s, stats);
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

int eldr_capture_result_stats(const eldr_capture_result* result, eldr_capture_stats* stats) {
  if (result == nullptr) return NullHandle("eldr_capture_result_stats", "result");
  if (stats == nullptr) return NullHandle("eldr_capture_result_stats", "stats");
  if (stats->struct_size < kStatsSizeV1) {
    return Fail(ELDR_CAPTURE_INVALID_ARGUMENT,
                "eldr_capture_result_stats: set stats->struct_size = sizeof(eldr_capture_stats)");
  }
  return Guarded("eldr_capture_result_stats", [&] {
    absl::StatusOr<bool> ready = result->impl->Query();
    if (!ready.ok()) return Report(ready.status());
    if (!*ready) {
      return Fail(ELDR_CAPTURE_NOT_READY, "eldr_capture_result_stats: the result is not ready (wait for it first)");
    }
    FillStats(result->impl->stats(), stats);
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

int eldr_capture_reset_stats(eldr_capture_ctx* ctx, void* stream) {
  if (ctx == nullptr) return NullHandle("eldr_capture_reset_stats", "ctx");
  return Guarded("eldr_capture_reset_stats", [&] { return Report(ctx->impl->ResetStats(stream)); });
}

// ---- Router client ------------------------------------------------------------------------------

void eldr_capture_client_options_init(eldr_capture_client_options* options) {
  if (options == nullptr) return;
  const eldr::capture::RouterClientOptions defaults;
  std::memset(options, 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->timeout_ms = defaults.timeout_ms;
}

int eldr_capture_client_create(const char* target, const eldr_capture_client_options* options,
                               eldr_capture_client** out) {
  return Guarded("eldr_capture_client_create", [&] {
    if (out == nullptr) return NullHandle("eldr_capture_client_create", "out");
    *out = nullptr;
    if (target == nullptr) return NullHandle("eldr_capture_client_create", "target");
    eldr::capture::RouterClientOptions o;
    if (options != nullptr) {
      if (StructTooSmall(options)) {
        return Fail(ELDR_CAPTURE_INVALID_ARGUMENT,
                    "eldr_capture_client_create: initialise options with "
                    "eldr_capture_client_options_init");
      }
      o.timeout_ms = options->timeout_ms;
      if (options->tls_root_certs_pem != nullptr) o.tls_root_certs_pem = options->tls_root_certs_pem;
      if (options->tls_client_cert_pem != nullptr) {
        o.tls_client_cert_pem = options->tls_client_cert_pem;
      }
      if (options->tls_client_key_pem != nullptr) o.tls_client_key_pem = options->tls_client_key_pem;
      if (options->tls_server_name != nullptr) o.tls_server_name = options->tls_server_name;
    }
    absl::StatusOr<std::unique_ptr<eldr::capture::RouterClient>> client =
        eldr::capture::RouterClient::Create(target, o);
    if (!client.ok()) return Report(client.status());
    *out = new eldr_capture_client{*std::move(client)};
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

void eldr_capture_client_destroy(eldr_capture_client* client) { delete client; }

int eldr_capture_client_route(eldr_capture_client* client, const char* request_id, int64_t prompt_tokens,
                              const void* counts, int32_t counts_type, int32_t layers, int32_t experts, char* worker_id,
                              size_t worker_id_capacity, char* address, size_t address_capacity, uint64_t* lease_id,
                              eldr_capture_route_details* details) {
  static constexpr char kFunction[] = "eldr_capture_client_route";
  if (client == nullptr) return NullHandle(kFunction, "client");
  if (lease_id == nullptr) return NullHandle(kFunction, "lease_id");
  if (worker_id == nullptr || worker_id_capacity == 0) {
    return NullHandle(kFunction, "worker_id (or its capacity)");
  }
  if (address == nullptr || address_capacity == 0) {
    return NullHandle(kFunction, "address (or its capacity)");
  }
  if (details != nullptr && StructTooSmall(details)) {
    return Fail(ELDR_CAPTURE_INVALID_ARGUMENT,
                "eldr_capture_client_route: set details->struct_size = "
                "sizeof(eldr_capture_route_details)");
  }
  return Guarded(kFunction, [&] {
    const std::string id = request_id == nullptr ? std::string() : std::string(request_id);
    absl::StatusOr<eldr::capture::RouteDecision> decision;
    if (counts == nullptr) {
      decision = client->impl->RouteWithoutSignature(id, prompt_tokens);
    } else if (layers <= 0 || experts <= 0) {
      return Fail(ELDR_CAPTURE_INVALID_ARGUMENT,
                  absl::StrCat(kFunction, ": layers and experts must be > 0, got ", layers, " and ", experts));
    } else if (counts_type == ELDR_CAPTURE_OUTPUT_INT16) {
      decision = client->impl->RouteInt16(
          id, prompt_tokens, absl::MakeConstSpan(static_cast<const int16_t*>(counts), size_t(layers) * experts), layers,
          experts);
    } else if (counts_type == ELDR_CAPTURE_OUTPUT_INT32) {
      decision = client->impl->RouteInt32(
          id, prompt_tokens, absl::MakeConstSpan(static_cast<const int32_t*>(counts), size_t(layers) * experts), layers,
          experts);
    } else if (counts_type == ELDR_CAPTURE_OUTPUT_FLOAT32) {
      decision = client->impl->RouteGateProbSums(
          id, prompt_tokens, absl::MakeConstSpan(static_cast<const float*>(counts), size_t(layers) * experts), layers,
          experts);
    } else {
      return Fail(ELDR_CAPTURE_INVALID_ARGUMENT,
                  absl::StrCat(kFunction, ": counts_type must be int16 (0), int32 (1) or float32 gate sums (2), got ",
                               counts_type));
    }
    if (!decision.ok()) return Report(decision.status());
    *lease_id = decision->lease_id;
    if (details != nullptr) {
      details->band_size = decision->band_size;
      details->similarity = decision->similarity;
      details->reserved = 0;
      details->centroid_generation = decision->centroid_generation;
      CopyTruncated(decision->policy, details->policy, sizeof(details->policy));
      CopyTruncated(decision->fallback_reason, details->fallback_reason, sizeof(details->fallback_reason));
    }
    const bool worker_fits = CopyString(decision->worker_id, worker_id, worker_id_capacity);
    const bool address_fits = CopyString(decision->address, address, address_capacity);
    if (!worker_fits || !address_fits) {
      if (!worker_fits) worker_id[0] = '\0';
      if (!address_fits) address[0] = '\0';
      return Fail(
          ELDR_CAPTURE_BUFFER_TOO_SMALL,
          absl::StrCat(kFunction, ": the route was made (lease ", decision->lease_id, ") but worker_id needs ",
                       decision->worker_id.size() + 1, " bytes (have ", worker_id_capacity, ") and address needs ",
                       decision->address.size() + 1, " bytes (have ", address_capacity, ")"));
    }
    return static_cast<int>(ELDR_CAPTURE_OK);
  });
}

int eldr_capture_client_complete(eldr_capture_client* client, uint64_t lease_id, int64_t output_tokens) {
  if (client == nullptr) return NullHandle("eldr_capture_client_complete", "client");
  return Guarded("eldr_capture_client_complete", [&] {
    absl::StatusOr<std::string> worker = client->impl->Complete(lease_id, output_tokens);
    return Report(worker.status());
  });
}

}  // extern "C"
