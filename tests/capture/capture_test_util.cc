#include "capture/capture_test_util.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "eldr/trace/trace.h"
#include "gtest/gtest.h"

#ifdef ELDR_CAPTURE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace eldr::capture::testing {

DeviceArrays::~DeviceArrays() {
#ifdef ELDR_CAPTURE_HAVE_CUDA
  for (void* p : device_pointers_) cudaFree(p);
#endif
}

const void* DeviceArrays::Upload(const void* data, size_t bytes) {
  if (device_ == Device::kCpu) {
    host_.emplace_back(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + bytes);
    if (host_.back().empty()) host_.back().resize(8);
    return host_.back().data();
  }
#ifdef ELDR_CAPTURE_HAVE_CUDA
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 8)), cudaSuccess);
  if (bytes > 0) EXPECT_EQ(cudaMemcpy(p, data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  device_pointers_.push_back(p);
  return p;
#else
  ADD_FAILURE() << "CUDA upload in a build without CUDA";
  return nullptr;
#endif
}

absl::Status GpuUsable() { return CudaAvailable(); }

Options OptionsFor(const ScenarioConfig& config, Device device) {
  Options options;
  options.device = device;
  options.num_layers = config.layers;
  options.num_experts = config.experts;
  options.max_top_k = config.top_k;
  options.num_blocks = config.num_blocks;
  options.block_size = config.block_size;
  options.max_finish_requests = config.max_finish_per_call;
  options.result_slots = 2;
  options.record_gate_probs = config.gate_probs;
  return options;
}

namespace {

// An id that must be skipped, representable in the configured id type. For int64 some of them
// would become valid ids if truncated to 32 bits.
int64_t BadId(const ScenarioConfig& config, std::mt19937& rng) {
  const int64_t e = config.experts;
  if (config.id_type == IndexType::kInt64) {
    const int64_t choices[] = {-1, e, e + 1000, (int64_t{1} << 40) + 3, -(int64_t{1} << 35), (int64_t{1} << 32) + 1};
    return choices[rng() % std::size(choices)];
  }
  const int64_t choices[] = {-1, e, e + 1000, std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  return choices[rng() % std::size(choices)];
}

int64_t RandomId(const ScenarioConfig& config, std::mt19937& rng) {
  return static_cast<int64_t>(rng() % static_cast<uint32_t>(config.experts));
}

int64_t BlocksFor(int64_t tokens, int block_size) { return (tokens + block_size - 1) / block_size; }

}  // namespace

std::vector<RequestSpec> RandomRequests(const ScenarioConfig& config, int count, int max_tokens, double bad_id_rate,
                                        double share_rate, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> unit(0, 1);
  std::vector<RequestSpec> requests(count);
  const int64_t row = int64_t{config.layers} * config.top_k;
  for (int i = 0; i < count; ++i) {
    RequestSpec& r = requests[i];
    r.tokens = 1 + static_cast<int>(rng() % max_tokens);
    // Share with an earlier request that has at least one full block.
    if (i > 0 && unit(rng) < share_rate) {
      const int source = static_cast<int>(rng() % i);
      const int full_blocks = requests[source].tokens / config.block_size;
      if (full_blocks > 0) {
        r.shared_from = source;
        r.shared_blocks = 1 + static_cast<int>(rng() % full_blocks);
        r.tokens = std::max(r.tokens, r.shared_blocks * config.block_size + 1);
      }
    }
    r.routing.resize(r.tokens * row);
    int first_own = 0;
    if (r.shared_from >= 0) {
      first_own = r.shared_blocks * config.block_size;
      std::copy_n(requests[r.shared_from].routing.begin(), first_own * row, r.routing.begin());
    }
    for (int64_t x = first_own * row; x < r.tokens * row; ++x) {
      r.routing[x] = unit(rng) < bad_id_rate ? BadId(config, rng) : RandomId(config, rng);
    }
  }
  return requests;
}

std::vector<RequestSpec> TraceRequests(const ScenarioConfig& config, const std::vector<std::vector<uint8_t>>& sequences,
                                       const std::vector<int>& sequence_tokens, int max_tokens) {
  const int64_t row = int64_t{config.layers} * config.top_k;
  std::vector<RequestSpec> requests;
  for (size_t s = 0; s < sequences.size(); ++s) {
    RequestSpec r;
    const int own = std::min(sequence_tokens[s], max_tokens);
    if (s % 3 == 2 && !requests.empty()) {
      const RequestSpec& source = requests.back();
      const int full_blocks = source.tokens / config.block_size;
      if (full_blocks > 0) {
        r.shared_from = static_cast<int>(requests.size()) - 1;
        r.shared_blocks = std::min(full_blocks, 1 + static_cast<int>(s % 4));
      }
    }
    const int prefix = r.shared_blocks * config.block_size;
    r.tokens = prefix + own;
    r.routing.resize(r.tokens * row);
    if (prefix > 0) {
      std::copy_n(requests[r.shared_from].routing.begin(), prefix * row, r.routing.begin());
    }
    for (int64_t x = 0; x < own * row; ++x) r.routing[prefix * row + x] = sequences[s][x];
    requests.push_back(std::move(r));
  }
  return requests;
}

std::vector<int32_t> Bincount(const ScenarioConfig& config, const RequestSpec& request) {
  std::vector<int32_t> counts(int64_t{config.layers} * config.experts, 0);
  for (int t = 0; t < request.tokens; ++t) {
    for (int l = 0; l < config.layers; ++l) {
      for (int j = 0; j < config.top_k; ++j) {
        const int64_t id = request.routing[(int64_t{t} * config.layers + l) * config.top_k + j];
        if (id >= 0 && id < config.experts) ++counts[int64_t{l} * config.experts + id];
      }
    }
  }
  return counts;
}

float ScenarioGateProb(int64_t position, int layer, int j, int64_t expert) {
  uint64_t h = static_cast<uint64_t>(position + 7) * 0x9E3779B97F4A7C15ull;
  h ^= (static_cast<uint64_t>(layer) + 1) * 0xC2B2AE3D27D4EB4Full;
  h ^= (static_cast<uint64_t>(j) + 3) * 0x165667B19E3779F9ull;
  h ^= static_cast<uint64_t>(expert + 11) * 0xD6E8FEB86659FD93ull;
  h ^= h >> 31;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  switch (h % 101) {
    case 0:
      return std::numeric_limits<float>::quiet_NaN();
    case 1:
      return -0.25f;
    case 2:
      return 1.5f;
    case 3:
    case 4:
      return 1.0f;
    case 5:
      return 0.0f;
    default:
      // Any float in [0, 1), not only round values: 24 random bits.
      return static_cast<float>((h >> 40) & 0xffffff) / 16777216.0f;
  }
}

std::vector<double> ExpectedGateSums(const ScenarioConfig& config, const RequestSpec& request) {
  std::vector<double> sums(int64_t{config.layers} * config.experts, 0.0);
  for (int t = 0; t < request.tokens; ++t) {
    for (int l = 0; l < config.layers; ++l) {
      for (int j = 0; j < config.top_k; ++j) {
        const int64_t id = request.routing[(int64_t{t} * config.layers + l) * config.top_k + j];
        if (id < 0 || id >= config.experts) continue;
        const float p = ScenarioGateProb(t, l, j, id);
        if (p >= 0.0f && p <= 1.0f) sums[int64_t{l} * config.experts + id] += p;
      }
    }
  }
  return sums;
}

namespace {

struct BatchToken {
  int request = -1;  // -1: not a prompt token
  int position = 0;
  int64_t slot = 0;
  std::vector<int64_t> ids;  // [L][k] for non-prompt tokens
};

struct ActiveRequest {
  int index = 0;
  int position = 0;  // next prompt position to compute
  std::vector<int32_t> blocks;
  bool finished = false;
  bool garbage_written = false;
};

template <typename T>
std::vector<T> Narrow(const std::vector<int64_t>& values) {
  std::vector<T> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = static_cast<T>(values[i]);
  return out;
}

const void* UploadIndex(DeviceArrays& arrays, const std::vector<int64_t>& values, IndexType type) {
  if (type == IndexType::kInt64) return arrays.Upload(values);
  return arrays.Upload(Narrow<int32_t>(values));
}

}  // namespace

ScenarioOutcome RunScenario(Capture& capture, Device device, const ScenarioConfig& config,
                            const std::vector<RequestSpec>& requests) {
  ScenarioOutcome out;
  const int num_requests = static_cast<int>(requests.size());
  out.finished.resize(num_requests);
  for (const RequestSpec& r : requests) out.expected.push_back(Bincount(config, r));
  if (config.gate_probs) {
    out.finished_gate.resize(num_requests);
    for (const RequestSpec& r : requests) out.expected_gate.push_back(ExpectedGateSums(config, r));
  }
  std::mt19937 rng(config.seed);
  const int64_t num_slots = config.num_blocks * config.block_size;
  const int64_t cells = int64_t{config.layers} * config.experts;

  std::vector<int32_t> free_blocks;
  for (int64_t b = config.num_blocks - 1; b >= 0; --b) free_blocks.push_back(static_cast<int32_t>(b));
  std::vector<int> refcount(config.num_blocks, 0);
  std::vector<bool> ever_freed(config.num_blocks, false);
  std::vector<ActiveRequest> all(num_requests);
  std::vector<bool> admitted(num_requests, false);
  std::vector<int> active;            // prefilling
  std::vector<int> awaiting_release;  // finished; garbage and release next step
  int next_request = 0;
  int64_t reserved_blocks = 0;  // still to be allocated by admitted requests
  int finished_count = 0;

  auto allocate = [&]() -> int32_t {
    EXPECT_FALSE(free_blocks.empty()) << "scenario ran out of blocks";
    const int32_t b = free_blocks.back();
    free_blocks.pop_back();
    if (ever_freed[b]) ++out.reused_blocks;
    refcount[b] = 1;
    --reserved_blocks;
    return b;
  };
  auto release = [&](int32_t b) {
    if (--refcount[b] == 0) {
      ever_freed[b] = true;
      free_blocks.push_back(b);
    }
  };
  // Sources of a shared prefix keep their blocks until every later sharer was admitted.
  auto still_needed_as_source = [&](int index) {
    for (int i = next_request; i < num_requests; ++i) {
      if (requests[i].shared_from == index) return true;
    }
    return false;
  };

  int guard = 0;
  while (finished_count < num_requests || !awaiting_release.empty()) {
    if (++guard > 100000) {
      ADD_FAILURE() << "scenario does not terminate";
      break;
    }
    // Admission in order; a sharer waits until its source finished.
    while (next_request < num_requests && active.size() < 4) {
      const RequestSpec& spec = requests[next_request];
      if (spec.shared_from >= 0 && !all[spec.shared_from].finished) break;
      const int64_t needed = BlocksFor(spec.tokens, config.block_size) - spec.shared_blocks;
      if (static_cast<int64_t>(free_blocks.size()) < reserved_blocks + needed) break;
      ActiveRequest& a = all[next_request];
      a.index = next_request;
      if (spec.shared_from >= 0) {
        const ActiveRequest& source = all[spec.shared_from];
        for (int j = 0; j < spec.shared_blocks; ++j) {
          a.blocks.push_back(source.blocks[j]);
          ++refcount[source.blocks[j]];
        }
        a.position = spec.shared_blocks * config.block_size;
        out.shared_prefix_blocks += spec.shared_blocks;
      }
      reserved_blocks += needed;
      admitted[next_request] = true;
      active.push_back(next_request++);
    }

    // Build the batch.
    std::vector<BatchToken> batch;
    int budget = config.max_batch_tokens;
    for (int index : active) {
      ActiveRequest& a = all[index];
      const int remaining = requests[index].tokens - a.position;
      if (budget <= 0 || remaining <= 0) continue;
      const int chunk = std::min(remaining, 1 + static_cast<int>(rng() % budget));
      for (int p = a.position; p < a.position + chunk; ++p) {
        if (p % config.block_size == 0) a.blocks.push_back(allocate());
        BatchToken token;
        token.request = index;
        token.position = p;
        token.slot = int64_t{a.blocks[p / config.block_size]} * config.block_size + p % config.block_size;
        batch.push_back(std::move(token));
      }
      budget -= chunk;
    }
    auto random_ids = [&]() {
      std::vector<int64_t> ids(int64_t{config.layers} * config.top_k);
      for (int64_t& id : ids) id = RandomId(config, rng);
      return ids;
    };
    // Decode-like writes into the unused part of finished requests' last blocks.
    std::vector<BatchToken> garbage;
    for (int index : awaiting_release) {
      ActiveRequest& a = all[index];
      const int tokens = requests[index].tokens;
      if (!config.decode_garbage || a.garbage_written || tokens % config.block_size == 0) continue;
      a.garbage_written = true;
      const int end = std::min<int>(config.block_size, tokens % config.block_size + 3);
      for (int offset = tokens % config.block_size; offset < end; ++offset) {
        BatchToken token;
        token.slot = int64_t{a.blocks.back()} * config.block_size + offset;
        token.ids = random_ids();
        garbage.push_back(std::move(token));
      }
    }
    const bool has_prompt_tokens = !batch.empty();
    for (BatchToken& token : garbage) batch.push_back(std::move(token));
    if (!batch.empty()) {
      for (int i = 0; i < config.padding_per_batch; ++i) {
        BatchToken token;
        token.slot = i % 2 == 0 ? -1 : -5;
        token.ids = random_ids();
        batch.push_back(std::move(token));
      }
      for (int i = 0; i < config.bad_slots_per_batch; ++i) {
        BatchToken token;
        token.slot = num_slots + static_cast<int64_t>(rng() % 100);
        token.ids = random_ids();
        batch.push_back(std::move(token));
      }
      std::shuffle(batch.begin(), batch.end(), rng);

      const int n = static_cast<int>(batch.size());
      std::vector<int64_t> slots(n);
      for (int t = 0; t < n; ++t) slots[t] = batch[t].slot;
      auto id_of = [&](const BatchToken& token, int layer, int j) -> int64_t {
        if (token.request < 0) return token.ids[int64_t{layer} * config.top_k + j];
        return requests[token.request].routing[(int64_t{token.position} * config.layers + layer) * config.top_k + j];
      };
      // What the library must report for this batch.
      uint64_t offset_zero = 0;
      for (const BatchToken& token : batch) {
        if (token.slot < 0) {
          out.expected_padding += config.layers;
          continue;
        }
        if (token.slot >= num_slots) {
          out.expected_bad_slots += config.layers;
          continue;
        }
        if (token.slot % config.block_size == 0) ++offset_zero;
        for (int l = 0; l < config.layers; ++l) {
          for (int j = 0; j < config.top_k; ++j) {
            const int64_t id = id_of(token, l, j);
            if (id >= 0 && id < config.experts) {
              ++out.expected_recorded;
              const float p = ScenarioGateProb(token.request < 0 ? -1 : token.position, l, j, id);
              if (config.gate_probs && !(p >= 0.0f && p <= 1.0f)) ++out.expected_bad_gate_probs;
            } else {
              ++out.expected_bad_ids;
            }
          }
        }
      }
      out.expected_block_resets += config.batch_reset ? offset_zero : offset_zero * config.layers;

      DeviceArrays arrays(device);
      const void* device_slots = UploadIndex(arrays, slots, config.slot_type);
      if (config.batch_reset) {
        EXPECT_TRUE(capture.ResetBatchBlocks(device_slots, config.slot_type, n, nullptr).ok());
      }
      for (int l = 0; l < config.layers; ++l) {
        std::vector<int64_t> ids(int64_t{n} * config.top_k);
        for (int t = 0; t < n; ++t) {
          for (int j = 0; j < config.top_k; ++j) ids[int64_t{t} * config.top_k + j] = id_of(batch[t], l, j);
        }
        const void* device_ids = UploadIndex(arrays, ids, config.id_type);
        const uint32_t flags = config.batch_reset ? kRecordSkipReset : 0;
        absl::Status status;
        if (config.gate_probs) {
          std::vector<float> weights(ids.size());
          for (int t = 0; t < n; ++t) {
            for (int j = 0; j < config.top_k; ++j) {
              const int64_t x = int64_t{t} * config.top_k + j;
              weights[x] = ScenarioGateProb(batch[t].request < 0 ? -1 : batch[t].position, l, j, ids[x]);
            }
          }
          status = capture.RecordGateProbs(l, device_ids, config.id_type, arrays.Upload(weights), config.top_k,
                                           device_slots, config.slot_type, n, flags, nullptr);
        } else {
          status = capture.Record(l, device_ids, config.id_type, config.top_k, device_slots, config.slot_type, n, flags,
                                  nullptr);
        }
        EXPECT_TRUE(status.ok()) << status;
      }
      ++out.batches;
    }

    // Release what finished a step ago (its garbage is recorded by now).
    for (int index : awaiting_release) {
      if (still_needed_as_source(index)) continue;
      for (int32_t b : all[index].blocks) release(b);
      all[index].blocks.clear();
      all[index].blocks.shrink_to_fit();
    }
    awaiting_release.erase(std::remove_if(awaiting_release.begin(), awaiting_release.end(),
                                          [&](int index) { return all[index].blocks.empty(); }),
                           awaiting_release.end());
    // A source still needed keeps its blocks; mark its garbage as done so it is written once.

    // Advance and finish.
    std::vector<int> finishing;
    if (has_prompt_tokens) {
      std::vector<int> counted(num_requests, 0);
      for (const BatchToken& token : batch) {
        if (token.request >= 0) ++counted[token.request];
      }
      for (int index : active) {
        all[index].position += counted[index];
        if (all[index].position == requests[index].tokens) finishing.push_back(index);
      }
    }
    for (size_t begin = 0; begin < finishing.size(); begin += static_cast<size_t>(config.max_finish_per_call)) {
      const size_t end = std::min(finishing.size(), begin + config.max_finish_per_call);
      const int group = static_cast<int>(end - begin);
      int64_t stride = 0;
      for (size_t i = begin; i < end; ++i) {
        stride = std::max<int64_t>(stride, all[finishing[i]].blocks.size());
      }
      stride += 2;
      std::vector<int32_t> tables(group * stride, 0);
      std::vector<int64_t> lengths(group);
      for (int g = 0; g < group; ++g) {
        const ActiveRequest& a = all[finishing[begin + g]];
        lengths[g] = requests[a.index].tokens;
        std::copy(a.blocks.begin(), a.blocks.end(), tables.begin() + g * stride);
        if (config.poison_table_padding) {
          // Entries past the request's blocks must never be read: one out of range (would count
          // as a bad block id) and the rest real blocks of other requests (would add counts).
          tables[g * stride + a.blocks.size()] = static_cast<int32_t>(config.num_blocks + 7);
          for (int64_t j = a.blocks.size() + 1; j < stride; ++j) {
            tables[g * stride + j] = static_cast<int32_t>(rng() % config.num_blocks);
          }
        }
      }
      DeviceArrays arrays(device);
      const bool device_tables =
          device == Device::kCuda && (!config.alternate_table_memory || out.finish_calls % 2 == 1);
      const int32_t* table_pointer = device_tables ? arrays.Upload(tables) : tables.data();
      auto result = capture.Finish(table_pointer, stride, lengths.data(), group, config.output_type, nullptr);
      EXPECT_TRUE(result.ok()) << result.status();
      if (!result.ok()) break;
      EXPECT_TRUE((*result)->Wait().ok());
      for (int g = 0; g < group; ++g) {
        std::vector<int32_t> counts(cells);
        if (config.output_type == OutputType::kInt16) {
          const int16_t* data = (*result)->counts_int16() + g * cells;
          std::copy(data, data + cells, counts.begin());
        } else {
          const int32_t* data = (*result)->counts_int32() + g * cells;
          std::copy(data, data + cells, counts.begin());
        }
        out.finished[finishing[begin + g]] = std::move(counts);
      }
      out.finish_stats.push_back((*result)->stats());
      ++out.finish_calls;
      if (config.gate_probs) {
        auto gate = capture.FinishGateProbs(table_pointer, stride, lengths.data(), group, nullptr);
        EXPECT_TRUE(gate.ok()) << gate.status();
        if (!gate.ok()) break;
        EXPECT_TRUE((*gate)->Wait().ok());
        EXPECT_EQ((*gate)->output_type(), OutputType::kFloat32);
        EXPECT_EQ((*gate)->counts_int32(), nullptr);
        for (int g = 0; g < group; ++g) {
          const float* data = (*gate)->gate_prob_sums() + g * cells;
          out.finished_gate[finishing[begin + g]].assign(data, data + cells);
        }
      }
    }
    for (int index : finishing) {
      all[index].finished = true;
      ++finished_count;
      awaiting_release.push_back(index);
      active.erase(std::find(active.begin(), active.end(), index));
    }
    if (active.empty() && next_request < num_requests && awaiting_release.empty() && !has_prompt_tokens) {
      // Nothing runs and the head request cannot be admitted: the scenario is too big.
      const RequestSpec& spec = requests[next_request];
      if (spec.shared_from < 0 || all[spec.shared_from].finished) {
        ADD_FAILURE() << "request " << next_request << " does not fit in " << config.num_blocks << " blocks";
        break;
      }
    }
  }

  absl::StatusOr<Stats> stats = capture.ReadStats(nullptr);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (stats.ok()) out.stats = *stats;
  out.block_counts.resize(config.num_blocks * cells);
  EXPECT_TRUE(capture.ReadBlockCounts(0, config.num_blocks, out.block_counts.data(), nullptr).ok());
  return out;
}

absl::StatusOr<LoadedTraces> LoadBundledTraces(int max_sequences_per_domain) {
  const char* data_dir = std::getenv("ELDR_DATA_DIR");
  const std::string dir = absl::StrCat(data_dir != nullptr ? data_dir : "data", "/esft-routing");
  absl::StatusOr<ExpertTrace> trace = LoadExpertTrace(dir, 64);
  if (!trace.ok()) return trace.status();
  LoadedTraces loaded;
  loaded.layers = trace->layers;
  loaded.experts = trace->experts;
  loaded.top_k = trace->top_k;
  std::vector<int> taken(trace->domains.size(), 0);
  for (const TraceSequence& seq : trace->sequences) {
    if (taken[seq.domain] >= max_sequences_per_domain) continue;
    ++taken[seq.domain];
    loaded.sequences.push_back(seq.topk);
    loaded.tokens.push_back(seq.tokens);
  }
  return loaded;
}

}  // namespace eldr::capture::testing
