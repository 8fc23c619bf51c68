#include "sim/simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <queue>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "sim/distinct_experts.h"
#include "sim/random.h"

namespace eldr::sim {
namespace {

// The random stream of kRandom replica assignment (apart from the workload's and the capacity
// estimate's streams).
constexpr uint64_t kStreamReplicaAssignment = 21;

enum class EventKind {
  kArrival,
  kPrefillDone,
  kDecodeArrive,
  kStepDone,
  kRefit,
  kSample,
  kReplicaSync,      // shared load: SyncReplicaLeases (subject: the replica, -1 all)
  kFollowerInstall,  // shared refit: the followers install a refitted set (subject: its index)
  kPhaseStart,       // RunSchedule: a phase begins (subject: its index)
  kPoolChange,       // RunSchedule: a worker joins and one is drained
  kPoolRefit,        // RunSchedule: the refit drivers reconcile with the changed pool
};

struct Event {
  double time_us;
  uint64_t sequence;  // insertion order: equal times are processed first-in first-out
  EventKind kind;
  int subject;  // arrival index, or worker index for kStepDone
};

struct LaterEvent {
  bool operator()(const Event& a, const Event& b) const {
    if (a.time_us != b.time_us) return a.time_us > b.time_us;
    return a.sequence > b.sequence;
  }
};

struct InFlight {
  int tokens_done = 0;
  uint64_t lease_id = 0;  // in the lease space of the replica that routed it
  int64_t kv_tokens = 0;
};

struct DecodeWorker {
  std::vector<int> running;  // arrival indices
  std::deque<int> waiting;
  int64_t kv_used = 0;
  bool busy = false;
  int assigned = 0;       // routed and not finished (what the router counts as load)
  bool in_pool = true;    // routable: false before it joins and once it is drained
  bool draining = false;  // drained and not yet removed (removed when `assigned` reaches 0)
};

// Per-step and load-sample figures of a time span (the measured window, or a phase inside it).
struct SpanStats {
  int64_t steps = 0;
  double distinct_per_layer = 0, batch = 0;
  int64_t tokens = 0;
  double imbalance_sum = 0;
  int64_t imbalance_samples = 0;
};

class Simulation {
 public:
  Simulation(const Workload& workload, const std::vector<Arrival>& arrivals, const ClusterOptions& cluster,
             const ReplicaRouters& routers, const ReplicaOptions& replica, const RunSchedule& schedule)
      : workload_(workload),
        arrivals_(arrivals),
        cluster_(cluster),
        routers_(routers),
        replica_(replica),
        schedule_(schedule),
        counter_(workload.layers, workload.experts, workload.top_k),
        workers_(cluster.decoders + (HasPoolChange() ? 1 : 0)),
        state_(arrivals.size()) {
    if (HasPoolChange()) workers_.back().in_pool = false;
    phase_first_.push_back(0);
    for (int start : schedule.phase_starts) phase_first_.push_back(start);
    for (int first : phase_first_) phase_start_us_.push_back(first == 0 ? 0.0 : arrivals[first].time_us);
    phase_stats_.resize(phase_first_.size());
  }

  absl::StatusOr<RunResult> Run() {
    const int n = static_cast<int>(arrivals_.size());
    result_.requests.resize(n);
    warm_ = static_cast<int>(std::floor(cluster_.warmup_fraction * n));
    last_measured_ = n - 1 - static_cast<int>(std::floor(cluster_.cooldown_fraction * n));
    if (last_measured_ < warm_) {
      return absl::InvalidArgumentError(
          absl::StrCat("warm-up and cool-down fractions leave no measured request out of ", n));
    }
    window_begin_us_ = arrivals_[warm_].time_us;
    window_end_us_ = arrivals_[last_measured_].time_us;

    const int replicas = static_cast<int>(routers_.replicas.size());
    result_.routes_per_replica.assign(replicas, 0);
    Rng assignment = Rng::ForStream(replica_.assignment_seed, kStreamReplicaAssignment);
    for (int i = 0; i < n; ++i) {
      RequestRecord& record = result_.requests[i];
      record.replica = replica_.assignment == ReplicaAssignment::kModulo
                           ? i % replicas
                           : static_cast<int>(assignment.Below(static_cast<uint64_t>(replicas)));
      record.pool_index = arrivals_[i].request;
      record.arrival_us = arrivals_[i].time_us;
      record.measured = i >= warm_ && i <= last_measured_;
      record.decode_steps = workload_.pool[arrivals_[i].request].decode_steps;
      Push(arrivals_[i].time_us, EventKind::kArrival, i);
    }
    Push(window_begin_us_, EventKind::kSample, 0);
    ELDR_RETURN_IF_ERROR(SetDomainShares(0));
    for (size_t p = 1; p < phase_first_.size(); ++p) {
      Push(phase_start_us_[p], EventKind::kPhaseStart, static_cast<int>(p));
    }
    if (HasPoolChange()) Push(arrivals_[schedule_.pool_change_arrival].time_us, EventKind::kPoolChange, 0);
    if (!routers_.refits.empty()) {
      Push(RefitIntervalUs(), EventKind::kRefit, 0);
    }
    if (SharesLoad()) {
      const double period_us = replica_.sync_period_ms * 1e3;
      if (!replica_.staggered_sync) {
        Push(period_us, EventKind::kReplicaSync, -1);
      } else {
        for (int r = 0; r < replicas; ++r) {
          Push(period_us * (1 + static_cast<double>(r) / replicas), EventKind::kReplicaSync, r);
        }
      }
    }
    free_prefill_ = cluster_.prefill_workers;

    const auto wall_start = std::chrono::steady_clock::now();
    while (!events_.empty()) {
      const Event event = events_.top();
      events_.pop();
      now_us_ = event.time_us;
      if (cluster_.replay_pace > 0) {
        std::this_thread::sleep_until(wall_start +
                                      std::chrono::microseconds(static_cast<int64_t>(now_us_ / cluster_.replay_pace)));
      }
      switch (event.kind) {
        case EventKind::kArrival:
          OnArrival(event.subject);
          break;
        case EventKind::kPrefillDone:
          ELDR_RETURN_IF_ERROR(OnPrefillDone(event.subject));
          break;
        case EventKind::kDecodeArrive:
          OnDecodeArrive(event.subject);
          break;
        case EventKind::kStepDone:
          ELDR_RETURN_IF_ERROR(OnStepDone(event.subject));
          break;
        case EventKind::kRefit:
          ELDR_RETURN_IF_ERROR(OnRefit());
          break;
        case EventKind::kSample:
          OnSample();
          break;
        case EventKind::kReplicaSync:
          ELDR_RETURN_IF_ERROR(OnReplicaSync(event.subject));
          break;
        case EventKind::kFollowerInstall:
          ELDR_RETURN_IF_ERROR(OnFollowerInstall(event.subject));
          break;
        case EventKind::kPhaseStart:
          ELDR_RETURN_IF_ERROR(SetDomainShares(event.subject));
          break;
        case EventKind::kPoolChange:
          ELDR_RETURN_IF_ERROR(OnPoolChange());
          break;
        case EventKind::kPoolRefit:
          ELDR_RETURN_IF_ERROR(RefitAndInstall());
          break;
      }
    }
    result_.simulated_seconds = now_us_ / 1e6;
    for (const SimRefitDriver* refit : routers_.refits) result_.refits += refit->refits();
    Summarise();
    return std::move(result_);
  }

 private:
  void Push(double time_us, EventKind kind, int subject) {
    events_.push(Event{time_us, next_sequence_++, kind, subject});
  }

  const SimRequest& RequestOf(int arrival) const { return workload_.pool[arrivals_[arrival].request]; }

  bool SharesLoad() const { return replica_.shared_load && routers_.replicas.size() > 1; }
  bool HasPoolChange() const { return schedule_.pool_change_arrival >= 0; }
  // The phase whose time span holds `time_us`.
  int PhaseAt(double time_us) const {
    const auto after = std::upper_bound(phase_start_us_.begin(), phase_start_us_.end(), time_us);
    return std::max(0, static_cast<int>(after - phase_start_us_.begin()) - 1);
  }

  // Every backend learns the decode work per domain of phase `phase`'s arrivals.
  absl::Status SetDomainShares(int phase) {
    const int begin = phase_first_[phase];
    const int end = phase + 1 < static_cast<int>(phase_first_.size()) ? phase_first_[phase + 1]
                                                                      : static_cast<int>(arrivals_.size());
    std::vector<double> shares(workload_.domains.size(), 0.0);
    for (int i = begin; i < end; ++i) {
      const SimRequest& request = RequestOf(i);
      if (request.domain >= 0 && request.domain < static_cast<int>(shares.size())) {
        shares[request.domain] += request.decode_steps;
      }
    }
    for (RoutingBackend* backend : routers_.replicas) ELDR_RETURN_IF_ERROR(backend->SetDomainShares(shares));
    return absl::OkStatus();
  }

  // The pool change: the new worker joins every replica and refit router, the leaving one is
  // drained (removed at once when it holds no request), and the drivers refit after the delay.
  absl::Status OnPoolChange() {
    const int added = static_cast<int>(workers_.size()) - 1;
    for (RoutingBackend* backend : routers_.replicas) {
      absl::StatusOr<int> index = backend->AddWorker(schedule_.add_worker);
      if (!index.ok()) {
        return absl::Status(index.status().code(),
                            absl::StrCat("adding worker ", schedule_.add_worker, ": ", index.status().message()));
      }
      if (*index != added) {
        return absl::InternalError(absl::StrCat("the added worker got index ", *index, ", expected ", added));
      }
      ELDR_RETURN_IF_ERROR(backend->DrainWorker(schedule_.drain_worker));
    }
    for (SimRefitDriver* refit : routers_.refits) {
      ELDR_RETURN_IF_ERROR(refit->AddWorker(schedule_.add_worker));
      ELDR_RETURN_IF_ERROR(refit->DrainWorker(schedule_.drain_worker));
    }
    workers_[added].in_pool = true;
    const std::vector<std::string>& ids = routers_.replicas.front()->worker_ids();
    const int drained = static_cast<int>(std::find(ids.begin(), ids.end(), schedule_.drain_worker) - ids.begin());
    if (drained >= added) return absl::InvalidArgumentError(absl::StrCat("no worker ", schedule_.drain_worker));
    drained_ = drained;
    workers_[drained].in_pool = false;
    workers_[drained].draining = true;
    if (workers_[drained].assigned == 0) ELDR_RETURN_IF_ERROR(RemoveDrained());
    if (!routers_.refits.empty()) Push(now_us_ + schedule_.pool_refit_delay_s * 1e6, EventKind::kPoolRefit, 0);
    return absl::OkStatus();
  }

  absl::Status RemoveDrained() {
    workers_[drained_].draining = false;
    for (RoutingBackend* backend : routers_.replicas) {
      ELDR_RETURN_IF_ERROR(backend->RemoveWorker(schedule_.drain_worker));
    }
    for (SimRefitDriver* refit : routers_.refits) ELDR_RETURN_IF_ERROR(refit->RemoveWorker(schedule_.drain_worker));
    return absl::OkStatus();
  }
  double RefitIntervalUs() const { return routers_.refits.front()->options().interval_s * 1e6; }
  RoutingBackend* ReplicaOf(int arrival) const { return routers_.replicas[result_.requests[arrival].replica]; }
  // The refit driver that observes the routes of `replica`.
  SimRefitDriver* RefitOf(int replica) const {
    if (routers_.refits.empty()) return nullptr;
    return routers_.refits.size() == 1 ? routers_.refits.front() : routers_.refits[replica];
  }

  void StartPrefill(int arrival) {
    --free_prefill_;
    Push(now_us_ + PrefillUs(cluster_.cost, RequestOf(arrival).prompt_tokens), EventKind::kPrefillDone, arrival);
  }

  void OnArrival(int arrival) {
    if (free_prefill_ > 0) {
      StartPrefill(arrival);
    } else {
      prefill_queue_.push_back(arrival);
    }
  }

  absl::Status OnPrefillDone(int arrival) {
    ++free_prefill_;
    if (!prefill_queue_.empty()) {
      const int next = prefill_queue_.front();
      prefill_queue_.pop_front();
      StartPrefill(next);
    }
    const SimRequest& request = RequestOf(arrival);
    RouteCall call;
    call.request_id = arrival;
    call.layers = workload_.layers;
    call.experts = workload_.experts;
    call.prompt_counts = request.prompt_counts;
    if (cluster_.gate_prob_signatures) call.prompt_gate_sums = request.prompt_gate_sums;
    call.prompt_tokens = request.prompt_tokens;
    call.domain = request.domain;
    absl::StatusOr<RouteDecision> decision = ReplicaOf(arrival)->Route(call, now_us_);
    if (!decision.ok()) {
      return absl::Status(decision.status().code(), absl::StrCat("routing request ", arrival, " (", request.source,
                                                                 "): ", decision.status().message()));
    }
    if (decision->worker < 0 || decision->worker >= static_cast<int>(workers_.size()) ||
        !workers_[decision->worker].in_pool) {
      return absl::InternalError(
          absl::StrCat("backend returned worker index ", decision->worker, ", not one of the pool's decoders"));
    }
    RequestRecord& record = result_.requests[arrival];
    record.worker = decision->worker;
    record.routed_us = now_us_;
    record.similarity = decision->similarity;
    record.band_size = decision->band_size;
    if (!decision->fallback.empty()) ++result_.fallbacks[decision->fallback];
    state_[arrival].lease_id = decision->lease_id;
    state_[arrival].kv_tokens = request.prompt_tokens + request.decode_steps;
    ++workers_[decision->worker].assigned;
    ++routed_;
    ++result_.routes_per_replica[record.replica];
    Push(now_us_ + cluster_.cost.kv_transfer_us, EventKind::kDecodeArrive, arrival);
    return absl::OkStatus();
  }

  void OnDecodeArrive(int arrival) {
    const int w = result_.requests[arrival].worker;
    workers_[w].waiting.push_back(arrival);
    if (!workers_[w].busy) StartStep(w);
  }

  void StartStep(int w) {
    DecodeWorker& worker = workers_[w];
    while (!worker.waiting.empty() && static_cast<int>(worker.running.size()) < cluster_.max_batch) {
      const int next = worker.waiting.front();
      const int64_t kv = state_[next].kv_tokens;
      // A request larger than the whole budget still runs alone rather than blocking forever.
      if (worker.kv_used + kv > cluster_.kv_budget_tokens && !worker.running.empty()) break;
      worker.waiting.pop_front();
      worker.kv_used += kv;
      worker.running.push_back(next);
    }
    if (worker.running.empty()) {
      worker.busy = false;
      return;
    }
    worker.busy = true;
    counter_.Reset();
    for (int arrival : worker.running) {
      counter_.AddToken(workload_.DecodeToken(RequestOf(arrival), state_[arrival].tokens_done));
    }
    const int batch = static_cast<int>(worker.running.size());
    const int64_t distinct = counter_.DistinctAllLayers();
    if (now_us_ >= window_begin_us_ && now_us_ <= window_end_us_) {
      for (SpanStats* stats : {&window_, &phase_stats_[PhaseAt(now_us_)]}) {
        ++stats->steps;
        stats->distinct_per_layer += static_cast<double>(distinct) / workload_.layers;
        stats->batch += batch;
      }
    }
    Push(now_us_ + DecodeStepUs(cluster_.cost, batch, distinct), EventKind::kStepDone, w);
  }

  absl::Status OnStepDone(int w) {
    DecodeWorker& worker = workers_[w];
    const bool in_window = now_us_ >= window_begin_us_ && now_us_ <= window_end_us_;
    SpanStats& phase = phase_stats_[PhaseAt(now_us_)];
    size_t kept = 0;
    for (size_t i = 0; i < worker.running.size(); ++i) {
      const int arrival = worker.running[i];
      InFlight& state = state_[arrival];
      RequestRecord& record = result_.requests[arrival];
      ++state.tokens_done;
      if (in_window) {
        ++window_.tokens;
        ++phase.tokens;
      }
      if (state.tokens_done == 1) record.first_token_us = now_us_;
      if (state.tokens_done == record.decode_steps) {
        record.finish_us = now_us_;
        worker.kv_used -= state.kv_tokens;
        --worker.assigned;
        const absl::Status completed = ReplicaOf(arrival)->Complete(state.lease_id, record.decode_steps, now_us_);
        if (!completed.ok()) {
          return absl::Status(completed.code(),
                              absl::StrCat("completing request ", arrival, ": ", completed.message()));
        }
        // As in the daemon, a routed signature joins the refit window when its request completes,
        // weighted by the decode work it caused (its output tokens, which Complete reports).
        if (SimRefitDriver* refit = RefitOf(record.replica); refit != nullptr) {
          const SimRequest& request = RequestOf(arrival);
          if (cluster_.gate_prob_signatures) {
            refit->Observe(GateProbSums{workload_.layers, workload_.experts, request.prompt_gate_sums}, now_us_,
                           record.decode_steps);
          } else {
            refit->Observe(request.prompt_counts, workload_.layers, workload_.experts, now_us_, record.decode_steps);
          }
        }
        if (worker.draining && worker.assigned == 0) ELDR_RETURN_IF_ERROR(RemoveDrained());
      } else {
        worker.running[kept++] = arrival;
      }
    }
    worker.running.resize(kept);
    StartStep(w);
    return absl::OkStatus();
  }

  absl::Status Install(int replica, const CentroidArtifact& artifact) {
    const absl::Status installed = routers_.replicas[replica]->InstallCentroids(artifact);
    if (!installed.ok()) {
      return absl::Status(installed.code(), absl::StrCat("installing refitted centroids into replica ", replica, ": ",
                                                         installed.message()));
    }
    return absl::OkStatus();
  }

  // Every driver refits, in replica order. One shared driver: the leader (replica 0) installs at
  // once, the followers after the install lag. One driver per replica: each installs its own.
  absl::Status OnRefit() {
    ELDR_RETURN_IF_ERROR(RefitAndInstall());
    const double next = now_us_ + RefitIntervalUs();
    if (next <= arrivals_.back().time_us) Push(next, EventKind::kRefit, 0);
    return absl::OkStatus();
  }

  absl::Status RefitAndInstall() {
    const bool shared = routers_.refits.size() == 1;
    for (size_t d = 0; d < routers_.refits.size(); ++d) {
      absl::StatusOr<std::optional<CentroidArtifact>> refitted = routers_.refits[d]->Refit(now_us_);
      if (!refitted.ok()) return refitted.status();
      if (!refitted->has_value()) continue;
      ELDR_RETURN_IF_ERROR(Install(static_cast<int>(d), **refitted));
      if (!shared || routers_.replicas.size() == 1) continue;
      if (replica_.install_lag_ms > 0) {
        follower_installs_.push_back(**std::move(refitted));
        Push(now_us_ + replica_.install_lag_ms * 1e3, EventKind::kFollowerInstall,
             static_cast<int>(follower_installs_.size() - 1));
      } else {
        for (size_t r = 1; r < routers_.replicas.size(); ++r) {
          ELDR_RETURN_IF_ERROR(Install(static_cast<int>(r), **refitted));
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status OnFollowerInstall(int index) {
    for (size_t r = 1; r < routers_.replicas.size(); ++r) {
      ELDR_RETURN_IF_ERROR(Install(static_cast<int>(r), follower_installs_[index]));
    }
    follower_installs_[index] = CentroidArtifact();  // installed everywhere: free it
    return absl::OkStatus();
  }

  // Shared load; the next sync only while arrivals remain to be routed (peer leases matter to
  // routes alone).
  absl::Status OnReplicaSync(int target) {
    ELDR_RETURN_IF_ERROR(SyncReplicaLeases(routers_.replicas, now_us_, target));
    ++result_.replica_syncs;
    if (replica_.on_sync) {
      pool_leases_.resize(workers_.size());
      for (size_t w = 0; w < workers_.size(); ++w) pool_leases_[w] = workers_[w].assigned;
      replica_.on_sync(now_us_, target, pool_leases_);
    }
    if (routed_ < static_cast<int>(arrivals_.size())) {
      Push(now_us_ + replica_.sync_period_ms * 1e3, EventKind::kReplicaSync, target);
    }
    return absl::OkStatus();
  }

  void OnSample() {
    int total = 0, most = 0, in_pool = 0;
    for (const DecodeWorker& worker : workers_) {
      if (!worker.in_pool) continue;
      ++in_pool;
      total += worker.assigned;
      most = std::max(most, worker.assigned);
    }
    if (total > 0) {
      const double imbalance = most / (static_cast<double>(total) / in_pool);
      for (SpanStats* stats : {&window_, &phase_stats_[PhaseAt(now_us_)]}) {
        stats->imbalance_sum += imbalance;
        ++stats->imbalance_samples;
      }
    }
    const double next = now_us_ + cluster_.imbalance_sample_ms * 1e3;
    if (next <= window_end_us_) Push(next, EventKind::kSample, 0);
  }

  void Summarise() {
    result_.metrics = Measure(0, static_cast<int>(arrivals_.size()), window_, window_end_us_ - window_begin_us_,
                              /*keep_samples=*/true);
    if (schedule_.phase_starts.empty()) return;
    for (size_t p = 0; p < phase_first_.size(); ++p) {
      PhaseResult phase;
      phase.first_arrival = phase_first_[p];
      phase.end_arrival = p + 1 < phase_first_.size() ? phase_first_[p + 1] : static_cast<int>(arrivals_.size());
      phase.start_s = phase_start_us_[p] / 1e6;
      const double end_us = p + 1 < phase_first_.size() ? phase_start_us_[p + 1] : arrivals_.back().time_us;
      phase.end_s = end_us / 1e6;
      const double span_us =
          std::max(0.0, std::min(end_us, window_end_us_) - std::max(phase_start_us_[p], window_begin_us_));
      phase.metrics = Measure(phase.first_arrival, phase.end_arrival, phase_stats_[p], span_us, false);
      result_.phases.push_back(std::move(phase));
    }
  }

  // The figures of the measured requests among arrivals [begin, end) and of `stats` over `span_us`.
  RunMetrics Measure(int begin, int end, const SpanStats& stats, double span_us, bool keep_samples) const {
    RunMetrics m;
    std::vector<double> tpot_ms;
    std::vector<double> ttft_ms;
    std::vector<double> ttft_prefill_ms;
    double similarity = 0, band = 0;
    for (int i = begin; i < end; ++i) {
      const RequestRecord& record = result_.requests[i];
      if (!record.measured) continue;
      ++m.measured_requests;
      ttft_ms.push_back((record.first_token_us - record.arrival_us) / 1e3);
      // Route runs at the instant prefill ends (the pipeline above).
      ttft_prefill_ms.push_back((record.routed_us - record.arrival_us) / 1e3);
      if (record.decode_steps >= 2) {
        tpot_ms.push_back((record.finish_us - record.first_token_us) / 1e3 / (record.decode_steps - 1));
      }
      similarity += record.similarity;
      band += record.band_size;
    }
    m.tpot_p50_ms = Percentile(tpot_ms, 50);
    m.tpot_p90_ms = Percentile(tpot_ms, 90);
    m.tpot_p99_ms = Percentile(tpot_ms, 99);
    m.ttft_p50_ms = Percentile(ttft_ms, 50);
    m.ttft_p99_ms = Percentile(ttft_ms, 99);
    m.ttft_prefill_p50_ms = Percentile(ttft_prefill_ms, 50);
    m.ttft_prefill_p99_ms = Percentile(ttft_prefill_ms, 99);
    if (m.measured_requests > 0) {
      m.mean_similarity = similarity / m.measured_requests;
      m.mean_band_size = band / m.measured_requests;
    }
    if (stats.steps > 0) {
      m.distinct_experts_per_layer = stats.distinct_per_layer / stats.steps;
      m.mean_batch = stats.batch / stats.steps;
    }
    if (stats.imbalance_samples > 0) m.load_imbalance = stats.imbalance_sum / stats.imbalance_samples;
    const double span_s = span_us / 1e6;
    if (span_s > 0) m.decode_tokens_per_s = stats.tokens / span_s;
    if (keep_samples) m.tpot_ms = std::move(tpot_ms);
    return m;
  }

  const Workload& workload_;
  const std::vector<Arrival>& arrivals_;
  const ClusterOptions& cluster_;
  const ReplicaRouters& routers_;
  const ReplicaOptions& replica_;
  const RunSchedule& schedule_;
  DistinctExpertCounter counter_;

  std::priority_queue<Event, std::vector<Event>, LaterEvent> events_;
  uint64_t next_sequence_ = 0;
  double now_us_ = 0;
  int free_prefill_ = 0;
  std::deque<int> prefill_queue_;
  std::vector<DecodeWorker> workers_;
  std::vector<InFlight> state_;
  RunResult result_;
  int routed_ = 0;
  std::vector<CentroidArtifact> follower_installs_;  // shared refit: sets the followers have yet to install
  std::vector<int> pool_leases_;                     // on_sync's argument

  int warm_ = 0, last_measured_ = 0;
  double window_begin_us_ = 0, window_end_us_ = 0;
  SpanStats window_;
  // Phases (one without a schedule): first arrival, start time, and their figures.
  std::vector<int> phase_first_;
  std::vector<double> phase_start_us_;
  std::vector<SpanStats> phase_stats_;
  int drained_ = -1;  // the drained worker's index once the pool changed
};

}  // namespace

absl::Status ValidateClusterOptions(const ClusterOptions& o) {
  if (o.decoders < 1) return absl::InvalidArgumentError("--decoders must be >= 1");
  if (o.prefill_workers < 1) return absl::InvalidArgumentError("--prefill_workers must be >= 1");
  if (o.max_batch < 1) return absl::InvalidArgumentError("--max_batch must be >= 1");
  if (o.kv_budget_tokens < 1) return absl::InvalidArgumentError("--kv_budget_tokens must be >= 1");
  if (!(o.warmup_fraction >= 0 && o.cooldown_fraction >= 0 && o.warmup_fraction + o.cooldown_fraction < 0.9)) {
    return absl::InvalidArgumentError(
        "--warmup_fraction and --cooldown_fraction must be >= 0 and sum to less than 0.9");
  }
  if (!(o.imbalance_sample_ms > 0)) {
    return absl::InvalidArgumentError("--imbalance_sample_ms must be > 0");
  }
  if (!(o.replay_pace >= 0) || std::isinf(o.replay_pace)) {
    return absl::InvalidArgumentError("--pace must be finite and >= 0");
  }
  return ValidateCostModel(o.cost);
}

absl::StatusOr<RunResult> SimulateRun(const Workload& workload, const std::vector<Arrival>& arrivals,
                                      const ClusterOptions& cluster, RoutingBackend* backend, SimRefitDriver* refit) {
  if (backend == nullptr) return absl::InvalidArgumentError("no routing backend");
  ReplicaRouters routers;
  routers.replicas.push_back(backend);
  if (refit != nullptr) routers.refits.push_back(refit);
  return SimulateReplicatedRun(workload, arrivals, cluster, routers, ReplicaOptions());
}

absl::StatusOr<RunResult> SimulateReplicatedRun(const Workload& workload, const std::vector<Arrival>& arrivals,
                                                const ClusterOptions& cluster, const ReplicaRouters& routers,
                                                const ReplicaOptions& replica, const RunSchedule& schedule) {
  ELDR_RETURN_IF_ERROR(ValidateClusterOptions(cluster));
  if (arrivals.empty()) return absl::InvalidArgumentError("no arrivals to simulate");
  if (routers.replicas.empty()) return absl::InvalidArgumentError("no routing backend");
  for (const RoutingBackend* backend : routers.replicas) {
    if (backend == nullptr) return absl::InvalidArgumentError("no routing backend");
    if (static_cast<int>(backend->worker_ids().size()) != cluster.decoders) {
      return absl::FailedPreconditionError(absl::StrCat("the router has ", backend->worker_ids().size(),
                                                        " decode workers but the simulation has ", cluster.decoders,
                                                        " (--decoders)"));
    }
    if (backend->worker_ids() != routers.replicas.front()->worker_ids()) {
      return absl::FailedPreconditionError("router replicas must have the same decode workers in the same order");
    }
  }
  const size_t replicas = routers.replicas.size();
  if (!routers.refits.empty()) {
    if (routers.refits.size() != 1 && routers.refits.size() != replicas) {
      return absl::InvalidArgumentError(absl::StrCat("refit: ", routers.refits.size(), " drivers for ", replicas,
                                                     " replicas (one shared, or one per replica)"));
    }
    for (const SimRefitDriver* refit : routers.refits) {
      if (refit == nullptr) return absl::InvalidArgumentError("refit: a null refit driver");
      if (refit->options().interval_s != routers.refits.front()->options().interval_s) {
        return absl::InvalidArgumentError("refit: every replica's driver must refit at the same interval");
      }
    }
  }
  if (replica.shared_load && !(replica.sync_period_ms > 0)) {
    return absl::InvalidArgumentError("--replica_sync_ms must be > 0");
  }
  if (!(replica.install_lag_ms >= 0)) return absl::InvalidArgumentError("--replica_install_lag_ms must be >= 0");
  for (const Arrival& arrival : arrivals) {
    if (arrival.request < 0 || arrival.request >= static_cast<int>(workload.pool.size())) {
      return absl::InvalidArgumentError("arrival refers to a request outside the workload pool");
    }
  }
  for (size_t p = 0; p < schedule.phase_starts.size(); ++p) {
    const int start = schedule.phase_starts[p];
    if (start <= 0 || start >= static_cast<int>(arrivals.size()) || (p > 0 && start <= schedule.phase_starts[p - 1])) {
      return absl::InvalidArgumentError("phase starts must be increasing arrival indices inside the run");
    }
  }
  if (schedule.pool_change_arrival >= static_cast<int>(arrivals.size()) ||
      (schedule.pool_change_arrival >= 0 && (schedule.add_worker.empty() || schedule.drain_worker.empty()))) {
    return absl::InvalidArgumentError(
        "a pool change needs an arrival inside the run, a worker to add and one to drain");
  }
  for (RoutingBackend* backend : routers.replicas) backend->StartRun();
  Simulation simulation(workload, arrivals, cluster, routers, replica, schedule);
  return simulation.Run();
}

absl::Status SyncReplicaLeases(absl::Span<RoutingBackend* const> replicas, double now_us, int target) {
  if (target < -1 || target >= static_cast<int>(replicas.size())) {
    return absl::InvalidArgumentError(absl::StrCat("no replica ", target, " among ", replicas.size()));
  }
  std::vector<absl::flat_hash_map<std::string, PeerLeaseCount>> own(replicas.size());
  absl::flat_hash_map<std::string, PeerLeaseCount> total;
  for (size_t r = 0; r < replicas.size(); ++r) {
    ELDR_ASSIGN_OR_RETURN(const RouterState state, replicas[r]->GetState(now_us));
    for (const WorkerStatus& worker : state.workers) {
      // Own leases only: the peers' leases a replica adds are never passed on (as the daemon).
      const PeerLeaseCount count{worker.load.leases, worker.load.leases_since_snapshot};
      own[r][worker.spec.id] = count;
      PeerLeaseCount& sum = total[worker.spec.id];
      sum.live += count.live;
      sum.since_snapshot += count.since_snapshot;
    }
  }
  for (size_t r = 0; r < replicas.size(); ++r) {
    if (target >= 0 && static_cast<int>(r) != target) continue;
    absl::flat_hash_map<std::string, PeerLeaseCount> others;
    others.reserve(total.size());
    for (const auto& entry : total) {
      const auto mine = own[r].find(entry.first);
      const PeerLeaseCount self = mine == own[r].end() ? PeerLeaseCount{} : mine->second;
      others[entry.first] =
          PeerLeaseCount{entry.second.live - self.live, entry.second.since_snapshot - self.since_snapshot};
    }
    ELDR_RETURN_IF_ERROR(replicas[r]->SetPeerLeases(others));
  }
  return absl::OkStatus();
}

absl::string_view ReplicaAssignmentName(ReplicaAssignment assignment) {
  switch (assignment) {
    case ReplicaAssignment::kModulo:
      return "modulo";
    case ReplicaAssignment::kRandom:
      return "random";
  }
  return "unknown";
}

absl::StatusOr<ReplicaAssignment> ParseReplicaAssignment(absl::string_view name) {
  if (name == "modulo") return ReplicaAssignment::kModulo;
  if (name == "random") return ReplicaAssignment::kRandom;
  return absl::InvalidArgumentError(
      absl::StrCat("--replica_assignment: unknown rule '", name, "' (expected modulo or random)"));
}

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double position = q / 100.0 * static_cast<double>(values.size() - 1);
  const size_t below = static_cast<size_t>(std::floor(position));
  const size_t above = std::min(below + 1, values.size() - 1);
  const double fraction = position - static_cast<double>(below);
  return values[below] + (values[above] - values[below]) * fraction;
}

}  // namespace eldr::sim
