// The discrete-event simulation of one run: one arrival sequence, one routing backend.
//
// Pipeline of a request: Poisson arrival -> FCFS queue of the prefill pool (prefill_workers
// servers, PrefillUs each) -> Route (the backend picks the decode worker, at the instant prefill
// ends) -> KV handoff (kv_transfer_us) -> the decode worker's waiting queue -> continuous batching:
// at every step boundary the worker admits waiting requests in order while the batch is below
// max_batch and their KV reservation (prompt + output tokens) fits the KV budget; a step costs
// DecodeStepUs(batch, distinct experts of the batch's tokens at that step) and produces one token
// for each running request -> when a request's last token is out, Complete releases its lease.
//
// Metrics of a request: TTFT = arrival to the end of its first decode step (the first token the
// user receives from the decode worker); TPOT = (finish - first token) / (decode steps - 1).
// Requests arriving in the warm-up and cool-down fractions are simulated but not measured, and the
// per-step figures are taken over the time span of the measured arrivals.
#ifndef ELDR_SIM_SIMULATOR_H_
#define ELDR_SIM_SIMULATOR_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "sim/cost_model.h"
#include "sim/routing_backend.h"
#include "sim/sim_refit.h"
#include "sim/workload.h"

namespace eldr::sim {

struct ClusterOptions {
  int decoders = 16;
  // Prefill servers (one prompt at a time each). Sized so prefill queueing stays small at the
  // default heavy rate: the prefill stage is not what the routing policies compete on.
  int prefill_workers = 8;
  // Continuous batching limit of a decode worker (vLLM's max_num_seqs).
  int max_batch = 64;
  // KV cache of a decode worker in tokens. One 80 GB GPU holding Qwen3-30B-A3B in bf16 (~61 GB)
  // keeps ~15 GB for KV; at 98 KB per token (48 layers x 4 KV heads x 128 x 2 x bf16) that is ~150k.
  int64_t kv_budget_tokens = 150000;
  CostModelOptions cost;
  double warmup_fraction = 0.25;    // of the arrivals, not measured
  double cooldown_fraction = 0.1;   // of the arrivals, not measured
  double imbalance_sample_ms = 10;  // load imbalance is sampled at this simulated period
};

absl::Status ValidateClusterOptions(const ClusterOptions& options);

struct RequestRecord {
  int pool_index = 0;
  int worker = -1;
  bool measured = false;
  int decode_steps = 0;
  double arrival_us = 0;
  double routed_us = 0;
  double first_token_us = 0;
  double finish_us = 0;
  float similarity = 0;
  int band_size = 0;
};

struct RunMetrics {
  int measured_requests = 0;
  double tpot_p50_ms = 0, tpot_p90_ms = 0, tpot_p99_ms = 0;
  double ttft_p50_ms = 0, ttft_p99_ms = 0;
  // Mean over measured-window steps of (distinct experts summed over layers) / layers.
  double distinct_experts_per_layer = 0;
  // Time average of max_w(in-flight_w) / mean_w(in-flight_w) over the measured window, where a
  // worker's in-flight requests are its running and waiting ones (1 = perfectly even).
  double load_imbalance = 0;
  double mean_batch = 0;           // mean running requests per step
  double decode_tokens_per_s = 0;  // pool throughput over the measured window
  double mean_similarity = 0;      // eldr: mean best centroid similarity of measured routes
  double mean_band_size = 0;       // eldr: mean band size of measured routes
  std::vector<double> tpot_ms;     // per measured request (for the figure)
};

struct RunResult {
  std::vector<RequestRecord> requests;  // in arrival order
  RunMetrics metrics;
  int refits = 0;
  std::map<std::string, int> fallbacks;  // reason -> routes
  double simulated_seconds = 0;
};

// Simulates every arrival to completion. `refit` (may be null) is fed every routed signature and
// asked to refit every interval; its artifacts are installed through `backend`.
absl::StatusOr<RunResult> SimulateRun(const Workload& workload, const std::vector<Arrival>& arrivals,
                                      const ClusterOptions& cluster, RoutingBackend* backend, SimRefitDriver* refit);

// Percentile with linear interpolation between closest ranks (NumPy's default); 0 when empty.
double Percentile(std::vector<double> values, double q);

}  // namespace eldr::sim

#endif  // ELDR_SIM_SIMULATOR_H_
