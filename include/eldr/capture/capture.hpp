// ELDR capture library, C++ API (static library `eldr_capture_static`).
//
// The same operations as the C ABI in eldr/capture/capture.h, for engines written in C++: read that header
// for the model (per-KV-block counts, devices, streams, ordering, bad data). Nothing here depends on
// CUDA headers: streams are cudaStream_t values passed as void*.
//
// Thread safety: Capture is thread-safe (calls are serialised internally). FinishResult may be
// used from any thread. RouterClient is thread-safe.
#ifndef ELDR_CAPTURE_HPP_
#define ELDR_CAPTURE_HPP_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace eldr::capture {

enum class Device { kCpu = 0, kCuda = 1 };
enum class IndexType { kInt32 = 0, kInt64 = 1 };
// kInt16 saturates at 32767 (the router's int16_le wire format), kInt32 at 2^31 - 1. kFloat32 is the
// output of the gate-probability finishes (FinishGateProbs, FinishDirectGateProbs) only.
enum class OutputType { kInt16 = 0, kInt32 = 1, kFloat32 = 2 };
// Element type of router logits (RecordGateLogits): eldr_capture_logits_type.
enum class LogitsType { kFloat32 = 0, kBfloat16 = 1, kFloat16 = 2 };

// Defaults match eldr_capture_options_init; see eldr_capture_options for each field's contract.
struct Options {
  Device device = Device::kCpu;
  int cuda_device = 0;
  int num_layers = 0;           // L, required
  int num_experts = 0;          // E, required
  int max_top_k = 8;            // largest k passed to Record / RecordDirect
  int64_t num_blocks = 0;       // physical KV blocks; 0 disables the block mode
  int block_size = 0;           // tokens per KV block; required when num_blocks > 0
  int counter_bits = 0;         // 0: smallest of 8/16/32 holding block_size * max_top_k
  int max_finish_requests = 64;
  int max_blocks_per_request = 8192;  // host block tables only
  int result_slots = 4;
  int max_direct_requests = 0;  // 0: direct mode off
  bool validate_pointers = true;
  // Also keep gate-probability accumulators (per block and per direct slot) for RecordGateProbs /
  // RecordDirectGateProbs; see eldr_capture_options.record_gate_probs.
  bool record_gate_probs = false;
};

struct Info {
  Device device = Device::kCpu;
  int num_layers = 0;
  int num_experts = 0;
  int64_t num_blocks = 0;
  int block_size = 0;
  int counter_bits = 0;
  uint32_t counter_max = 0;
  uint64_t block_counts_bytes = 0;
  uint64_t device_bytes = 0;
  uint64_t host_bytes = 0;
  // Gate-probability accumulators (0 when options.record_gate_probs is off): fixed-point fraction
  // bits of the per-block accumulators (of the direct-mode ones, 24, without the block mode) and
  // the per-block accumulators' bytes.
  int gate_prob_fraction_bits = 0;
  uint64_t block_gate_prob_bytes = 0;
  int max_direct_requests = 0;
};

// Cumulative counters; see eldr_capture_stats for each field.
struct Stats {
  uint64_t recorded_choices = 0;
  uint64_t padding_tokens = 0;
  uint64_t bad_slots = 0;
  uint64_t bad_expert_ids = 0;
  uint64_t bad_request_indices = 0;
  uint64_t bad_block_ids = 0;
  uint64_t duplicate_slots = 0;
  uint64_t saturated_adds = 0;
  uint64_t saturated_outputs = 0;
  uint64_t block_resets = 0;
  uint64_t bad_gate_probs = 0;

  friend bool operator==(const Stats&, const Stats&) = default;
};

std::string StatsToString(const Stats& stats);

// Skips Record's own per-layer reset; see ELDR_CAPTURE_RECORD_SKIP_RESET.
inline constexpr uint32_t kRecordSkipReset = 1u << 0;

// 1 when the CUDA kernels were built and a usable GPU is present; otherwise the reason.
absl::Status CudaAvailable();

// The finished counts of one Finish / FinishDirect call. Holds one of the context's result slots
// until destroyed. The counts are valid once Query() returns true (or Wait() returned OK).
class FinishResult {
 public:
  virtual ~FinishResult() = default;
  // True when ready, false while pending, or the device error that stopped the copy. Never blocks.
  virtual absl::StatusOr<bool> Query() const = 0;
  // Blocks until ready.
  virtual absl::Status Wait() = 0;
  virtual int num_requests() const = 0;
  virtual OutputType output_type() const = 0;
  // L * E: the values of one request.
  virtual int64_t cells_per_request() const = 0;
  // [num_requests][L][E]; nullptr until ready or for the other output type.
  virtual const int16_t* counts_int16() const = 0;
  virtual const int32_t* counts_int32() const = 0;
  // [num_requests][L][E] gate-probability sums; nullptr until ready or for the count output types.
  virtual const float* gate_prob_sums() const = 0;
  // Counters as of this finish in stream order (valid once ready).
  virtual Stats stats() const = 0;
};

class Capture {
 public:
  // INVALID_ARGUMENT for bad options, UNAVAILABLE without a usable device, RESOURCE_EXHAUSTED when
  // the buffers cannot be allocated.
  static absl::StatusOr<std::unique_ptr<Capture>> Create(const Options& options);

  virtual ~Capture() = default;

  virtual const Info& info() const = 0;

  virtual absl::Status Record(int layer, const void* topk_ids, IndexType id_type, int top_k,
                              const void* slot_mapping, IndexType slot_type, int64_t num_tokens,
                              uint32_t flags, void* stream) = 0;
  virtual absl::Status ResetBatchBlocks(const void* slot_mapping, IndexType slot_type,
                                        int64_t num_tokens, void* stream) = 0;
  virtual absl::StatusOr<std::unique_ptr<FinishResult>> Finish(const int32_t* block_tables,
                                                               int64_t block_table_stride,
                                                               const int64_t* lengths,
                                                               int num_requests,
                                                               OutputType output_type,
                                                               void* stream) = 0;

  virtual absl::Status RecordDirect(int layer, const void* topk_ids, IndexType id_type, int top_k,
                                    const void* token_request, IndexType request_type,
                                    int64_t num_tokens, void* stream) = 0;
  virtual absl::StatusOr<std::unique_ptr<FinishResult>> FinishDirect(const int32_t* request_slots,
                                                                     int num_requests,
                                                                     OutputType output_type,
                                                                     void* stream) = 0;

  // Gate probabilities (options.record_gate_probs; FAILED_PRECONDITION otherwise): the same as Record
  // / RecordDirect, plus each choice's probability topk_weights[t][j] (float32, same memory as
  // topk_ids) added to the gate-probability accumulators of the same block or slot. See
  // eldr_capture_record_gate_probs for the fixed-point accumulation that makes every device agree.
  virtual absl::Status RecordGateProbs(int layer, const void* topk_ids, IndexType id_type, const float* topk_weights,
                                       int top_k, const void* slot_mapping, IndexType slot_type, int64_t num_tokens,
                                       uint32_t flags, void* stream) = 0;
  virtual absl::Status RecordDirectGateProbs(int layer, const void* topk_ids, IndexType id_type,
                                             const float* topk_weights, int top_k, const void* token_request,
                                             IndexType request_type, int64_t num_tokens, void* stream) = 0;
  // The reference's gate_prob_all capture (options.record_gate_probs): the counts as Record /
  // RecordDirect, plus softmax(router_logits[t]) over all E experts (router_logits [num_tokens]
  // [logits_stride] of logits_type, stride in elements, 0 meaning E; same memory as topk_ids) added
  // to the same gate-probability accumulators. A token with a non-finite logit adds no
  // probabilities and counts one bad_gate_probs. See eldr_capture_record_gate_logits.
  virtual absl::Status RecordGateLogits(int layer, const void* topk_ids, IndexType id_type, int top_k,
                                        const void* router_logits, LogitsType logits_type, int64_t logits_stride,
                                        const void* slot_mapping, IndexType slot_type, int64_t num_tokens,
                                        uint32_t flags, void* stream) = 0;
  virtual absl::Status RecordDirectGateLogits(int layer, const void* topk_ids, IndexType id_type, int top_k,
                                              const void* router_logits, LogitsType logits_type,
                                              int64_t logits_stride, const void* token_request,
                                              IndexType request_type, int64_t num_tokens, void* stream) = 0;
  // The gate-probability sums of requests, float32 [num_requests][L][E] (output type kFloat32):
  // same arguments and block rule as Finish / FinishDirect (FinishDirectGateProbs zeroes the slots'
  // gate accumulators, not their counts).
  virtual absl::StatusOr<std::unique_ptr<FinishResult>> FinishGateProbs(const int32_t* block_tables,
                                                                        int64_t block_table_stride,
                                                                        const int64_t* lengths, int num_requests,
                                                                        void* stream) = 0;
  virtual absl::StatusOr<std::unique_ptr<FinishResult>> FinishDirectGateProbs(const int32_t* request_slots,
                                                                              int num_requests, void* stream) = 0;

  virtual absl::Status Clear(void* stream) = 0;
  virtual absl::StatusOr<Stats> ReadStats(void* stream) = 0;
  virtual absl::Status ResetStats(void* stream) = 0;
  // Synchronous copies into host int32 arrays [count][L][E], for tests and debugging.
  virtual absl::Status ReadBlockCounts(int64_t first_block, int64_t num_blocks, int32_t* out,
                                       void* stream) = 0;
  virtual absl::Status ReadDirectCounts(int first_slot, int num_slots, int32_t* out,
                                        void* stream) = 0;
};

// ---- Client of eldr-router's DecodeRouter service ---------------------------------------------

struct RouterClientOptions {
  int timeout_ms = 2000;
  // Empty: plaintext. Otherwise PEM CA certificates for TLS, plus client chain and key for mTLS.
  std::string tls_root_certs_pem;
  std::string tls_client_cert_pem;
  std::string tls_client_key_pem;
  std::string tls_server_name;  // overrides the name checked against the router's certificate
};

struct RouteDecision {
  std::string worker_id;
  std::string address;
  uint64_t lease_id = 0;
  float similarity = 0;
  int band_size = 0;
  std::string policy;
  std::string fallback_reason;
  uint64_t centroid_generation = 0;
};

class RouterClient {
 public:
  // INVALID_ARGUMENT for an empty target or inconsistent TLS options. Connects lazily.
  static absl::StatusOr<std::unique_ptr<RouterClient>> Create(const std::string& target,
                                                              const RouterClientOptions& options);
  virtual ~RouterClient() = default;

  // Route with counts sent as int16_le bytes ([layers][experts], the finish output).
  virtual absl::StatusOr<RouteDecision> RouteInt16(const std::string& request_id,
                                                   int64_t prompt_tokens,
                                                   absl::Span<const int16_t> counts, int layers,
                                                   int experts) = 0;
  // Route with counts sent as packed int32 values.
  virtual absl::StatusOr<RouteDecision> RouteInt32(const std::string& request_id,
                                                   int64_t prompt_tokens,
                                                   absl::Span<const int32_t> counts, int layers,
                                                   int experts) = 0;
  // Route with gate-probability sums sent as float32_le bytes ([layers][experts], the
  // FinishGateProbs output); for a router calibrated with the gate_prob variant.
  virtual absl::StatusOr<RouteDecision> RouteGateProbSums(const std::string& request_id, int64_t prompt_tokens,
                                                          absl::Span<const float> sums, int layers,
                                                          int experts) = 0;
  // Route without a signature: the router balances load only.
  virtual absl::StatusOr<RouteDecision> RouteWithoutSignature(const std::string& request_id,
                                                              int64_t prompt_tokens) = 0;
  // Releases a lease; returns the worker whose load was released.
  virtual absl::StatusOr<std::string> Complete(uint64_t lease_id, int64_t output_tokens) = 0;
};

}  // namespace eldr::capture

#endif  // ELDR_CAPTURE_HPP_
