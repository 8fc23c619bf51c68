// Test support for the capture library: a small paged-KV prefill engine that drives a Capture
// context the way vLLM does (block allocation from a LIFO free list, chunked prefill, several
// requests per batch, prefix sharing through reused blocks, eviction and reuse, padding), and the
// straightforward bincount every finished request must equal. The engine is deterministic for a
// seed, so the same scenario can run on the CPU and the CUDA device and be compared bit for bit.
#ifndef ELDR_TESTS_CAPTURE_CAPTURE_TEST_UTIL_H_
#define ELDR_TESTS_CAPTURE_CAPTURE_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "eldr/capture/capture.hpp"

namespace eldr::capture::testing {

// Arrays in memory the given device's kernels can read: host memory for the CPU, device memory
// (cudaMalloc) for CUDA. Frees everything it uploaded on destruction.
class DeviceArrays {
 public:
  explicit DeviceArrays(Device device) : device_(device) {}
  ~DeviceArrays();
  DeviceArrays(const DeviceArrays&) = delete;
  DeviceArrays& operator=(const DeviceArrays&) = delete;

  // Returns a pointer to a copy of `bytes` bytes at `data`, valid until this object dies.
  const void* Upload(const void* data, size_t bytes);
  template <typename T>
  const T* Upload(const std::vector<T>& values) {
    return static_cast<const T*>(Upload(values.data(), values.size() * sizeof(T)));
  }
  Device device() const { return device_; }

 private:
  Device device_;
  std::vector<std::vector<uint8_t>> host_;
  std::vector<void*> device_pointers_;
};

// Whether the CUDA tests can run; the reason when not.
absl::Status GpuUsable();

// One request: its prompt's routing [tokens][L][k] (ids may be out of range on purpose) and,
// optionally, a prefix of `shared_blocks` full blocks taken from request `shared_from`'s blocks
// (its routing there is a copy of the source's, as a causal model would compute it).
struct RequestSpec {
  std::vector<int64_t> routing;
  int tokens = 0;
  int shared_from = -1;
  int shared_blocks = 0;
};

struct ScenarioConfig {
  int layers = 4;
  int experts = 16;
  int top_k = 2;
  int block_size = 16;
  int64_t num_blocks = 64;
  int max_batch_tokens = 96;
  IndexType id_type = IndexType::kInt32;
  IndexType slot_type = IndexType::kInt64;
  // Reset with one reset_batch_blocks per batch and records with kRecordSkipReset.
  bool batch_reset = false;
  // Padding tokens (slot -1) and tokens with a slot past the cache, added to each batch.
  int padding_per_batch = 2;
  int bad_slots_per_batch = 1;
  // After a request finished, decode-like writes into the rest of its last block (they must vanish
  // when the block is reused).
  bool decode_garbage = true;
  // Alternate host and device block tables on finish (CUDA only; host tables on the CPU anyway).
  bool alternate_table_memory = true;
  int max_finish_per_call = 3;
  OutputType output_type = OutputType::kInt32;
  uint32_t seed = 1;
  // Append a deliberately out-of-range entry after each finishing table's used entries (must never
  // be read) and fill the rest of each row with block ids of other requests.
  bool poison_table_padding = true;
  // Record with RecordGateProbs (weights from ScenarioGateProb) and finish gate sums too; the
  // context must be created with record_gate_probs (OptionsFor sets it).
  bool gate_probs = false;
};

// The gate probability the scenario gives choice j of a token at prompt `position` (-1 for tokens
// outside prompts) on `layer` that chose `expert`: a pure function of them, so shared prefixes carry
// identical probabilities. Mostly in [0, 1] (some exactly 0 or 1); about 3% out of range (NaN,
// negative, above 1), which the library must skip and count.
float ScenarioGateProb(int64_t position, int layer, int j, int64_t expert);

// The exact sums (in double) of a request's in-range probabilities of in-range ids, [L][E].
std::vector<double> ExpectedGateSums(const ScenarioConfig& config, const RequestSpec& request);

// Random prompts: `count` requests of 1..max_tokens tokens, ids uniform in [0, E) with duplicates
// allowed within a token, a fraction `bad_id_rate` of ids out of range, and a fraction
// `share_rate` of requests sharing 1..n full blocks of an earlier request.
std::vector<RequestSpec> RandomRequests(const ScenarioConfig& config, int count, int max_tokens, double bad_id_rate,
                                        double share_rate, uint32_t seed);

// Requests built from real routing traces: each sequence's first `max_tokens` tokens as a prompt
// (uint8 [tokens][L][k] rows), and every third request sharing its first blocks with the one
// before it followed by its own tokens.
std::vector<RequestSpec> TraceRequests(const ScenarioConfig& config, const std::vector<std::vector<uint8_t>>& sequences,
                                       const std::vector<int>& sequence_tokens, int max_tokens);

// The bincount: expected[L][E] of a request's prompt, counting in-range ids only.
std::vector<int32_t> Bincount(const ScenarioConfig& config, const RequestSpec& request);

struct ScenarioOutcome {
  std::vector<std::vector<int32_t>> finished;  // per request index, [L][E] as int32
  std::vector<std::vector<int32_t>> expected;  // Bincount of each request
  Stats stats;                                 // after the run
  std::vector<Stats> finish_stats;             // snapshot of each finish result
  std::vector<int32_t> block_counts;           // every block's counts at the end [blocks][L][E]
  // With config.gate_probs: each request's finished gate sums [L][E] and their exact values.
  std::vector<std::vector<float>> finished_gate;
  std::vector<std::vector<double>> expected_gate;
  uint64_t expected_bad_gate_probs = 0;
  // What the engine knows it fed the library.
  uint64_t expected_padding = 0;
  uint64_t expected_bad_slots = 0;
  uint64_t expected_bad_ids = 0;
  uint64_t expected_recorded = 0;
  uint64_t expected_block_resets = 0;
  int batches = 0;
  int finish_calls = 0;
  int reused_blocks = 0;  // allocations of a block that had been freed before
  int shared_prefix_blocks = 0;
};

// Runs the engine on `capture` (created on `device` with matching geometry). Fails the current
// test through EXPECT/ASSERT on any library error.
ScenarioOutcome RunScenario(Capture& capture, Device device, const ScenarioConfig& config,
                            const std::vector<RequestSpec>& requests);

// Options matching `config`.
Options OptionsFor(const ScenarioConfig& config, Device device);

// Loads the bundled real traces (ELDR_DATA_DIR/esft-routing): per sequence its uint8 rows.
struct LoadedTraces {
  int layers = 0;
  int experts = 0;
  int top_k = 0;
  std::vector<std::vector<uint8_t>> sequences;
  std::vector<int> tokens;
};
absl::StatusOr<LoadedTraces> LoadBundledTraces(int max_sequences_per_domain);

}  // namespace eldr::capture::testing

#endif  // ELDR_TESTS_CAPTURE_CAPTURE_TEST_UTIL_H_
