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
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
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
  // Route (and refit) on each request's prompt gate-probability sums instead of its counts (the
  // gate_prob variant); the workload must carry them (synthetic workloads do).
  bool gate_prob_signatures = false;
  // Replay pace, simulated seconds per wall-clock second: > 0 holds each event back until its
  // simulated time, divided by the pace, has passed on the wall clock since the run began (a
  // daemon's wall-clock timers, its online refit and the refit's settle delay, then see the
  // simulated timeline compressed by the pace); 0 replays as fast as the routers answer. It only
  // delays events: the order of calls, hence every decision of a deterministic router, is the same.
  double replay_pace = 0;
};

absl::Status ValidateClusterOptions(const ClusterOptions& options);

struct RequestRecord {
  int pool_index = 0;
  int worker = -1;
  int replica = 0;  // the router replica that routed it (0 with one router)
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
  // The reference implementation's TTFT: arrival to the end of prefill, when its proxy delivers
  // the prefill instance's first token to the client (before the KV handoff and decode).
  double ttft_prefill_p50_ms = 0, ttft_prefill_p99_ms = 0;
  // Mean over measured-window steps of (distinct experts summed over layers) / layers.
  double distinct_experts_per_layer = 0;
  // Time average of max_w(in-flight_w) / mean_w(in-flight_w) over the measured window, where a
  // worker's in-flight requests are those routed to it and not finished, over the workers in the
  // pool (not yet added or already drained ones are left out; 1 = perfectly even).
  double load_imbalance = 0;
  double mean_batch = 0;           // mean running requests per step
  double decode_tokens_per_s = 0;  // pool throughput over the measured window
  double mean_similarity = 0;      // eldr: mean best centroid similarity of measured routes
  double mean_band_size = 0;       // eldr: mean band size of measured routes
  std::vector<double> tpot_ms;     // per measured request (for the figure)
};

// One phase of a run with a schedule (RunSchedule::phase_starts): the arrivals [first_arrival,
// end_arrival) and the time span [start_s, end_s) from the first one's arrival to the next phase's
// first arrival (the last phase: to the last arrival). Its metrics are RunMetrics over the measured
// requests that arrived in the phase, and over the steps and load samples of the span inside the
// measured window (RunMetrics::tpot_ms is left empty).
struct PhaseResult {
  int first_arrival = 0;
  int end_arrival = 0;
  double start_s = 0, end_s = 0;
  RunMetrics metrics;
};

// Changes during a run (the drift scenarios of experiment.h).
struct RunSchedule {
  // Arrival indices at which phases 1, 2, ... begin: strictly increasing, each in (0, arrivals).
  // Empty: one phase and no per-phase figures. The backends' SetDomainShares is called at the start
  // of the run and of every phase with the decode work (decode steps) per domain of the phase's arrivals.
  std::vector<int> phase_starts;
  // A pool change at the arrival time of arrivals[pool_change_arrival] (-1: none): `add_worker`
  // joins every replica (RoutingBackend::AddWorker, index cluster.decoders) and every refit driver's
  // router, `drain_worker` is drained in both at the same instant and removed once its last request
  // has completed, and every refit driver refits (and its set is installed as OnRefit installs)
  // `pool_refit_delay_s` later: eldr-router's refitter reconciles its rows with the pool after the
  // same settle delay (RefitOptions::pool_change_settle).
  int pool_change_arrival = -1;
  std::string add_worker, drain_worker;
  double pool_refit_delay_s = 0.25;
};

struct RunResult {
  std::vector<RequestRecord> requests;  // in arrival order
  RunMetrics metrics;
  std::vector<PhaseResult> phases;       // one per phase with RunSchedule::phase_starts; empty otherwise
  int refits = 0;                        // completed refits, summed over the refit drivers
  std::vector<int> routes_per_replica;   // every arrival, measured or not, by the replica that routed it
  int replica_syncs = 0;                 // shared-load sync instants (SyncReplicaLeases) during the run
  std::map<std::string, int> fallbacks;  // reason -> routes
  double simulated_seconds = 0;
};

// Simulates every arrival to completion. `refit` (may be null) is fed every routed signature and
// asked to refit every interval; its artifacts are installed through `backend`. The same as
// SimulateReplicatedRun with one replica (and `refit` as its one driver).
absl::StatusOr<RunResult> SimulateRun(const Workload& workload, const std::vector<Arrival>& arrivals,
                                      const ClusterOptions& cluster, RoutingBackend* backend, SimRefitDriver* refit);

// Router replicas: R eldr-router replicas deciding for one decode pool (the standalone
// Deployment's replicas, or one sidecar router beside each prefill pod), each routing its own share
// of the arrivals onto the same decode workers. What they may share is what eldr_cluster shares
// through Redis (docs/cluster.md): lease counts, and one refit leader's centroid generations.
enum class ReplicaAssignment {
  kModulo,  // arrival i goes to replica i mod R: exactly 1/R of the arrivals each, interleaved
  kRandom,  // each arrival to a replica drawn uniformly from assignment_seed: 1/R each on average
};
absl::string_view ReplicaAssignmentName(ReplicaAssignment assignment);  // "modulo", "random"
absl::StatusOr<ReplicaAssignment> ParseReplicaAssignment(absl::string_view name);

struct ReplicaOptions {
  ReplicaAssignment assignment = ReplicaAssignment::kModulo;
  uint64_t assignment_seed = 1;
  // Shared load. Every sync_period_ms of simulated time (eldr-router's cluster_load_interval),
  // SyncReplicaLeases gives every replica the other replicas' live leases per worker; in between
  // a replica adds the others' leases as of its last sync to its own exact count. Without shared
  // load a replica counts its own leases only (no SetPeerLeases at all). No effect with one replica.
  bool shared_load = false;
  double sync_period_ms = 100;
  // Aligned: every replica syncs at k * period, all at the same instant. Staggered: replica r
  // syncs at (k + r / R) * period (k >= 1), as replicas whose timers started at different times.
  bool staggered_sync = false;
  // Shared refit (ReplicaRouters::refits holds one driver): the leader, replica 0, installs every
  // refitted set at once and the followers this much later (eldr_cluster's announcement reaches
  // them in ~5 ms, its periodic check alone within centroid_check_interval, 1 s). 0: all at once.
  double install_lag_ms = 100;
  // Called after every shared-load sync with the simulated time, the replica that synced (-1: all,
  // aligned) and the pool's live leases per worker (routed and not completed, whichever replica
  // routed them). May be empty.
  std::function<void(double now_us, int replica, absl::Span<const int> pool_leases)> on_sync;
};

// The routers of a replicated run.
struct ReplicaRouters {
  // R >= 1 routers over the same decode workers (identical worker_ids(), in the same order).
  std::vector<RoutingBackend*> replicas;
  // Online refit. Empty: none. One driver: the pool's one refitter (eldr_cluster's leader fitting
  // on every replica's sampled signatures), fed every routed signature, its sets installed into
  // every replica (see install_lag_ms). R drivers (R > 1): each replica refits alone, driver r fed
  // only replica r's routes and installing into replica r only. Every driver has the same interval.
  std::vector<SimRefitDriver*> refits;
};

absl::StatusOr<RunResult> SimulateReplicatedRun(const Workload& workload, const std::vector<Arrival>& arrivals,
                                                const ClusterOptions& cluster, const ReplicaRouters& routers,
                                                const ReplicaOptions& replica,
                                                const RunSchedule& schedule = RunSchedule());

// One shared-load sync at simulated time `now_us`: reads each replica's own leases per worker from
// its state (`live` = its leases, `since_snapshot` = those acquired after its last fresh load
// snapshot, 0 without one: what eldr-router's cluster component publishes) and gives `target`
// (-1: every replica) the sum over the OTHER replicas through SetPeerLeases. The router then adds
// the peers' `live` to a worker without a fresh snapshot (the simulator reports no load snapshots)
// and their `since_snapshot` to one with a fresh snapshot, as the daemon does.
absl::Status SyncReplicaLeases(absl::Span<RoutingBackend* const> replicas, double now_us, int target = -1);

// Percentile with linear interpolation between closest ranks (NumPy's default); 0 when empty.
double Percentile(std::vector<double> values, double q);

}  // namespace eldr::sim

#endif  // ELDR_SIM_SIMULATOR_H_
