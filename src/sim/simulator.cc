#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <queue>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "sim/distinct_experts.h"

namespace eldr::sim {
namespace {

enum class EventKind { kArrival, kPrefillDone, kDecodeArrive, kStepDone, kRefit, kSample };

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
  uint64_t lease_id = 0;
  int64_t kv_tokens = 0;
};

struct DecodeWorker {
  std::vector<int> running;  // arrival indices
  std::deque<int> waiting;
  int64_t kv_used = 0;
  bool busy = false;
  int assigned = 0;  // routed and not finished (what the router counts as load)
};

class Simulation {
 public:
  Simulation(const Workload& workload, const std::vector<Arrival>& arrivals, const ClusterOptions& cluster,
             RoutingBackend* backend, SimRefitDriver* refit)
      : workload_(workload),
        arrivals_(arrivals),
        cluster_(cluster),
        backend_(backend),
        refit_(refit),
        counter_(workload.layers, workload.experts, workload.top_k),
        workers_(cluster.decoders),
        state_(arrivals.size()) {}

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

    for (int i = 0; i < n; ++i) {
      RequestRecord& record = result_.requests[i];
      record.pool_index = arrivals_[i].request;
      record.arrival_us = arrivals_[i].time_us;
      record.measured = i >= warm_ && i <= last_measured_;
      record.decode_steps = workload_.pool[arrivals_[i].request].decode_steps;
      Push(arrivals_[i].time_us, EventKind::kArrival, i);
    }
    Push(window_begin_us_, EventKind::kSample, 0);
    if (refit_ != nullptr) {
      Push(refit_->options().interval_s * 1e6, EventKind::kRefit, 0);
    }
    free_prefill_ = cluster_.prefill_workers;

    while (!events_.empty()) {
      const Event event = events_.top();
      events_.pop();
      now_us_ = event.time_us;
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
      }
    }
    result_.simulated_seconds = now_us_ / 1e6;
    result_.refits = refit_ != nullptr ? refit_->refits() : 0;
    Summarise();
    return std::move(result_);
  }

 private:
  void Push(double time_us, EventKind kind, int subject) {
    events_.push(Event{time_us, next_sequence_++, kind, subject});
  }

  const SimRequest& RequestOf(int arrival) const { return workload_.pool[arrivals_[arrival].request]; }

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
    call.prompt_tokens = request.prompt_tokens;
    absl::StatusOr<RouteDecision> decision = backend_->Route(call, now_us_);
    if (!decision.ok()) {
      return absl::Status(decision.status().code(), absl::StrCat("routing request ", arrival, " (", request.source,
                                                                 "): ", decision.status().message()));
    }
    if (decision->worker < 0 || decision->worker >= cluster_.decoders) {
      return absl::InternalError(absl::StrCat("backend returned worker index ", decision->worker, " outside the ",
                                              cluster_.decoders, " decoders"));
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
    if (refit_ != nullptr) {
      refit_->Observe(request.prompt_counts, workload_.layers, workload_.experts, now_us_);
    }
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
      ++window_steps_;
      window_distinct_per_layer_ += static_cast<double>(distinct) / workload_.layers;
      window_batch_ += batch;
    }
    Push(now_us_ + DecodeStepUs(cluster_.cost, batch, distinct), EventKind::kStepDone, w);
  }

  absl::Status OnStepDone(int w) {
    DecodeWorker& worker = workers_[w];
    const bool in_window = now_us_ >= window_begin_us_ && now_us_ <= window_end_us_;
    size_t kept = 0;
    for (size_t i = 0; i < worker.running.size(); ++i) {
      const int arrival = worker.running[i];
      InFlight& state = state_[arrival];
      RequestRecord& record = result_.requests[arrival];
      ++state.tokens_done;
      if (in_window) ++window_tokens_;
      if (state.tokens_done == 1) record.first_token_us = now_us_;
      if (state.tokens_done == record.decode_steps) {
        record.finish_us = now_us_;
        worker.kv_used -= state.kv_tokens;
        --worker.assigned;
        const absl::Status completed = backend_->Complete(state.lease_id, record.decode_steps, now_us_);
        if (!completed.ok()) {
          return absl::Status(completed.code(),
                              absl::StrCat("completing request ", arrival, ": ", completed.message()));
        }
      } else {
        worker.running[kept++] = arrival;
      }
    }
    worker.running.resize(kept);
    StartStep(w);
    return absl::OkStatus();
  }

  absl::Status OnRefit() {
    absl::StatusOr<std::optional<CentroidArtifact>> refitted = refit_->Refit(now_us_);
    if (!refitted.ok()) return refitted.status();
    if (refitted->has_value()) {
      const absl::Status installed = backend_->InstallCentroids(**refitted);
      if (!installed.ok()) {
        return absl::Status(installed.code(), absl::StrCat("installing refitted centroids: ", installed.message()));
      }
    }
    const double next = now_us_ + refit_->options().interval_s * 1e6;
    if (next <= arrivals_.back().time_us) Push(next, EventKind::kRefit, 0);
    return absl::OkStatus();
  }

  void OnSample() {
    int total = 0, most = 0;
    for (const DecodeWorker& worker : workers_) {
      total += worker.assigned;
      most = std::max(most, worker.assigned);
    }
    if (total > 0) {
      imbalance_sum_ += most / (static_cast<double>(total) / workers_.size());
      ++imbalance_samples_;
    }
    const double next = now_us_ + cluster_.imbalance_sample_ms * 1e3;
    if (next <= window_end_us_) Push(next, EventKind::kSample, 0);
  }

  void Summarise() {
    RunMetrics& m = result_.metrics;
    std::vector<double> ttft_ms;
    double similarity = 0, band = 0;
    for (const RequestRecord& record : result_.requests) {
      if (!record.measured) continue;
      ++m.measured_requests;
      ttft_ms.push_back((record.first_token_us - record.arrival_us) / 1e3);
      if (record.decode_steps >= 2) {
        m.tpot_ms.push_back((record.finish_us - record.first_token_us) / 1e3 / (record.decode_steps - 1));
      }
      similarity += record.similarity;
      band += record.band_size;
    }
    m.tpot_p50_ms = Percentile(m.tpot_ms, 50);
    m.tpot_p90_ms = Percentile(m.tpot_ms, 90);
    m.tpot_p99_ms = Percentile(m.tpot_ms, 99);
    m.ttft_p50_ms = Percentile(ttft_ms, 50);
    m.ttft_p99_ms = Percentile(ttft_ms, 99);
    if (m.measured_requests > 0) {
      m.mean_similarity = similarity / m.measured_requests;
      m.mean_band_size = band / m.measured_requests;
    }
    if (window_steps_ > 0) {
      m.distinct_experts_per_layer = window_distinct_per_layer_ / window_steps_;
      m.mean_batch = window_batch_ / window_steps_;
    }
    if (imbalance_samples_ > 0) m.load_imbalance = imbalance_sum_ / imbalance_samples_;
    const double span_s = (window_end_us_ - window_begin_us_) / 1e6;
    if (span_s > 0) m.decode_tokens_per_s = window_tokens_ / span_s;
  }

  const Workload& workload_;
  const std::vector<Arrival>& arrivals_;
  const ClusterOptions& cluster_;
  RoutingBackend* backend_;
  SimRefitDriver* refit_;
  DistinctExpertCounter counter_;

  std::priority_queue<Event, std::vector<Event>, LaterEvent> events_;
  uint64_t next_sequence_ = 0;
  double now_us_ = 0;
  int free_prefill_ = 0;
  std::deque<int> prefill_queue_;
  std::vector<DecodeWorker> workers_;
  std::vector<InFlight> state_;
  RunResult result_;

  int warm_ = 0, last_measured_ = 0;
  double window_begin_us_ = 0, window_end_us_ = 0;
  int64_t window_steps_ = 0;
  double window_distinct_per_layer_ = 0, window_batch_ = 0;
  int64_t window_tokens_ = 0;
  double imbalance_sum_ = 0;
  int64_t imbalance_samples_ = 0;
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
  return ValidateCostModel(o.cost);
}

absl::StatusOr<RunResult> SimulateRun(const Workload& workload, const std::vector<Arrival>& arrivals,
                                      const ClusterOptions& cluster, RoutingBackend* backend, SimRefitDriver* refit) {
  ELDR_RETURN_IF_ERROR(ValidateClusterOptions(cluster));
  if (arrivals.empty()) return absl::InvalidArgumentError("no arrivals to simulate");
  if (backend == nullptr) return absl::InvalidArgumentError("no routing backend");
  if (static_cast<int>(backend->worker_ids().size()) != cluster.decoders) {
    return absl::FailedPreconditionError(absl::StrCat("the router has ", backend->worker_ids().size(),
                                                      " decode workers but the simulation has ", cluster.decoders,
                                                      " (--decoders)"));
  }
  for (const Arrival& arrival : arrivals) {
    if (arrival.request < 0 || arrival.request >= static_cast<int>(workload.pool.size())) {
      return absl::InvalidArgumentError("arrival refers to a request outside the workload pool");
    }
  }
  backend->StartRun();
  Simulation simulation(workload, arrivals, cluster, backend, refit);
  return simulation.Run();
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
