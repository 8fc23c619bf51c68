// Online refit and elastic pools (see include/eldr/refit/refit.h for the contract).
#include "eldr/refit/refit.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/centroid_index.h"
#include "refit/signature_chunk.h"

namespace eldr {
namespace {

// Window chunks: at most this many bytes of halves (and at most 1/kMinChunksPerBudget of the
// budget), at most kChunkMaxRows rows.
constexpr size_t kChunkBytes = size_t{256} << 10;
constexpr size_t kMinChunksPerBudget = 16;
constexpr int kChunkMaxRows = 256;

// Clients remembered by the fair-share admission; beyond this, clients not seen for a window are
// forgotten first, and a flood of fresh names shares one account.
constexpr size_t kMaxTrackedClients = 1024;
constexpr char kOverflowClient[] = "\x01overflow";

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool PeriodicEnabled(absl::Duration interval) {
  return interval > absl::ZeroDuration() && interval != absl::InfiniteDuration();
}

double Dot(absl::Span<const float> a, absl::Span<const float> b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += static_cast<double>(a[i]) * b[i];
  return sum;
}

// Rotates unit `from` towards unit `to` (in their plane) until 1 - cos(from, result) equals
// `max_distance`, when `to` is further than that; writes the unit result into `to`. Returns whether
// it rotated. Antipodal vectors have no plane: `to` then becomes `from`.
bool LimitRotation(absl::Span<const float> from, absl::Span<float> to, double max_distance) {
  const double cos_theta = std::clamp(Dot(from, to), -1.0, 1.0);
  if (1.0 - cos_theta <= max_distance) return false;
  const double theta = std::acos(cos_theta);
  const double phi = std::acos(std::clamp(1.0 - max_distance, -1.0, 1.0));
  const double sin_theta = std::sin(theta);
  if (sin_theta < 1e-9) {
    std::copy(from.begin(), from.end(), to.begin());
    return true;
  }
  const double a = std::sin(theta - phi) / sin_theta;
  const double b = std::sin(phi) / sin_theta;
  double norm = 0;
  for (size_t i = 0; i < to.size(); ++i) {
    const double v = a * from[i] + b * to[i];
    to[i] = static_cast<float>(v);
    norm += v * v;
  }
  norm = std::sqrt(norm);
  if (norm > 0) {
    for (float& v : to) v = static_cast<float>(v / norm);
  }
  return true;
}

// Warm-start rows for workers that have none yet: split the clusters that would gain most. Each
// window point goes to its nearest kept centroid; the cluster with the largest total cosine
// distance (the most spread-out zone, whose split lowers the objective most) gives up its point
// farthest from the centre as the new worker's seed, then the next largest, and so on.
std::vector<float> SplitSeeds(const PointRows& points, const std::vector<float>& kept, int kept_k, int added) {
  const int m = points.rows();
  std::vector<float> seeds;
  std::vector<float> scores(static_cast<size_t>(m) * kept_k);
  std::vector<float> scratch;
  ScorePointRows(points, kept, kept_k, absl::MakeSpan(scores), &scratch);
  std::vector<double> spread(kept_k, 0.0);
  std::vector<int> farthest(kept_k, -1);
  std::vector<double> farthest_distance(kept_k, -1.0);
  std::vector<double> point_distance(m);
  for (int i = 0; i < m; ++i) {
    const float* row = scores.data() + static_cast<size_t>(i) * kept_k;
    const int c = static_cast<int>(std::max_element(row, row + kept_k) - row);
    const double distance = 1.0 - row[c];
    point_distance[i] = distance;
    spread[c] += distance;
    if (distance > farthest_distance[c]) {
      farthest_distance[c] = distance;
      farthest[c] = i;
    }
  }
  std::vector<char> used_point(m, 0);
  for (int a = 0; a < added; ++a) {
    int cluster = -1;
    for (int c = 0; c < kept_k; ++c) {
      if (farthest[c] >= 0 && !used_point[farthest[c]] && (cluster < 0 || spread[c] > spread[cluster])) {
        cluster = c;
      }
    }
    int seed_point;
    if (cluster >= 0) {
      seed_point = farthest[cluster];
      spread[cluster] = -1;  // split each zone at most once
    } else {                 // more new workers than splittable zones: the worst-served point left
      seed_point = -1;
      for (int i = 0; i < m; ++i) {
        if (!used_point[i] && (seed_point < 0 || point_distance[i] > point_distance[seed_point])) seed_point = i;
      }
    }
    used_point[seed_point] = 1;
    const absl::Span<const float> seed = points.Read(seed_point, 1, &scratch);
    seeds.insert(seeds.end(), seed.begin(), seed.end());
  }
  return seeds;
}

}  // namespace

struct OnlineRefitter::RefitPlan {
  uint64_t external_installs_before = 0;
  CentroidArtifact current;         // the centroids in service
  std::vector<std::string> target;  // kept workers in row order, then workers without a row
  std::vector<double> capacity;     // capacity weight per target
  std::vector<float> kept_rows;     // the kept workers' rows
  int kept_k = 0;
  int added = 0;
  int dropped = 0;
  refit_internal::SignatureRows points;  // the window, usable for these centroids
  std::vector<double> weights;           // each point's weight (decode work)
  int m = 0;
};

// ---- Construction and lifecycle ----------------------------------------------------------------

OnlineRefitter::OnlineRefitter(RefitOptions options, Router* router)
    : options_(std::move(options)),
      router_(router),
      encode_scratch_(std::make_unique<refit_internal::EncodeScratch>()) {
  absl::MutexLock lock(&window_mu_);
  window_capacity_ = options_.max_window_signatures;  // until the first signature sets the geometry
}

absl::StatusOr<std::unique_ptr<OnlineRefitter>> OnlineRefitter::Create(RefitOptions options, Router* router) {
  if (router == nullptr) return absl::InvalidArgumentError("refit: router must not be null");
  if (options.window <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: window must be positive, got ", absl::FormatDuration(options.window)));
  }
  if (options.interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: interval must not be negative, got ", absl::FormatDuration(options.interval)));
  }
  if (options.max_window_signatures < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: max_window_signatures = ", options.max_window_signatures, ", need >= 1"));
  }
  if (options.max_window_bytes < kMinRefitWindowBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: max_window_bytes = ", options.max_window_bytes, ", need >= ", kMinRefitWindowBytes));
  }
  if (!(options.max_client_share > 0 && options.max_client_share <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: max_client_share = ", options.max_client_share, ", need a fraction in (0, 1]"));
  }
  if (options.min_signatures_per_centroid < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: min_signatures_per_centroid = ", options.min_signatures_per_centroid, ", need >= 1"));
  }
  if (options.max_iterations < 1) {
    return absl::InvalidArgumentError(absl::StrCat("refit: max_iterations = ", options.max_iterations, ", need >= 1"));
  }
  if (!(options.tolerance >= 0) || !std::isfinite(options.tolerance)) {
    return absl::InvalidArgumentError(absl::StrCat("refit: tolerance = ", options.tolerance, ", need >= 0"));
  }
  for (const auto& [name, bound] : {std::pair<const char*, double>{"max_step_distance", options.max_step_distance},
                                    {"max_drift_distance", options.max_drift_distance}}) {
    if (!(bound > 0 && bound <= 2)) {
      return absl::InvalidArgumentError(
          absl::StrCat("refit: ", name, " = ", bound, ", need a cosine distance in (0, 2] (2: unbounded)"));
    }
  }
  for (const auto& [name, value] :
       {std::pair<const char*, double>{"default_output_tokens", options.default_output_tokens}}) {
    if (!(value >= 0) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat("refit: ", name, " = ", value, ", need a finite number >= 0"));
    }
  }
  if (!(options.default_tokens_per_second > 0) || !std::isfinite(options.default_tokens_per_second)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refit: default_tokens_per_second = ", options.default_tokens_per_second, ", need a finite rate > 0"));
  }
  if (options.max_pending_signatures < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: max_pending_signatures = ", options.max_pending_signatures, ", need >= 1"));
  }
  if (options.max_pending_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: max_pending_bytes = ", options.max_pending_bytes, ", need >= 1"));
  }
  if (!(options.max_imbalance_increase >= 0) || !std::isfinite(options.max_imbalance_increase)) {
    return absl::InvalidArgumentError(absl::StrCat("refit: max_imbalance_increase = ", options.max_imbalance_increase,
                                                   ", need a finite number >= 0"));
  }
  if (!(options.max_locality_decrease >= 0 && options.max_locality_decrease <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("refit: max_locality_decrease = ", options.max_locality_decrease,
                                                   ", need a number in [0, 1] (1: no bound)"));
  }
  if (!(options.min_experts_gain >= -1 && options.min_experts_gain < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("refit: min_experts_gain = ", options.min_experts_gain,
                                                   ", need a number in [-1, 1) (-1: no bound)"));
  }
  if (!(options.expert_picks > 0 && std::isfinite(options.expert_picks))) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: expert_picks = ", options.expert_picks, ", need a positive number"));
  }
  if (!(options.max_churn > 0 && options.max_churn <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: max_churn = ", options.max_churn, ", need a fraction in (0, 1] (1: no bound)"));
  }
  if (options.pool_change_settle < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("refit: pool_change_settle must not be negative");
  }
  if (!options.state_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(options.state_dir, error);
    if (error) {
      return absl::InvalidArgumentError(
          absl::StrCat("refit: cannot create state folder ", options.state_dir, ": ", error.message()));
    }
  }
  std::unique_ptr<OnlineRefitter> refitter(new OnlineRefitter(std::move(options), router));
  // The centroids in service are the first calibrated anchor.
  if (absl::StatusOr<CentroidArtifact> current = router->CurrentCentroids(); current.ok()) {
    absl::MutexLock lock(&refitter->anchors_mu_);
    for (int r = 0; r < current->k; ++r) {
      const auto row = current->row(r);
      refitter->anchors_[current->workers[r]].assign(row.begin(), row.end());
    }
  }
  router->AddObserver(refitter.get());
  return refitter;
}

OnlineRefitter::~OnlineRefitter() {
  Stop();
  router_->RemoveObserver(this);
}

void OnlineRefitter::Start() {
  absl::MutexLock lifecycle(&lifecycle_mu_);
  if (thread_.joinable()) return;
  {
    absl::MutexLock lock(&thread_mu_);
    stopping_ = false;
  }
  thread_ = std::thread([this] { RunBackground(); });
}

void OnlineRefitter::Stop() {
  absl::MutexLock lifecycle(&lifecycle_mu_);
  if (!thread_.joinable()) return;
  {
    absl::MutexLock lock(&thread_mu_);
    stopping_ = true;
    thread_cv_.SignalAll();
  }
  thread_.join();
  thread_ = std::thread();
}

void OnlineRefitter::RunBackground() {
  // Fits yield the CPU to routing. On Linux a thread has its own scheduling policy and nice value:
  // SCHED_IDLE runs the fit only on CPU time routing leaves over, so a fit on a saturated core
  // takes longer instead of delaying routes. Best effort (an unprivileged thread may always lower
  // its priority); nice 19 is the fallback where SCHED_IDLE is refused.
  const sched_param idle_param{};
  if (sched_setscheduler(0, SCHED_IDLE, &idle_param) != 0) {
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
  }
  const bool periodic = PeriodicEnabled(options_.interval);
  absl::Time next_periodic = periodic ? absl::Now() + options_.interval : absl::InfiniteFuture();
  thread_mu_.Lock();
  while (!stopping_) {
    while (!stopping_ && !pool_changed_ && absl::Now() < next_periodic) {
      thread_cv_.WaitWithDeadline(&thread_mu_, next_periodic);
    }
    if (stopping_) break;
    bool pool_change = pool_changed_;
    if (pool_change) {
      // Let a burst of changes (a rollout, a flapping pod) settle, then reconcile once.
      const absl::Time settle_until = absl::Now() + options_.pool_change_settle;
      while (!stopping_ && absl::Now() < settle_until) thread_cv_.WaitWithDeadline(&thread_mu_, settle_until);
      if (stopping_) break;
      pool_changed_ = false;
    }
    thread_mu_.Unlock();
    // The outcome is in the stats and the on_refit callback; nobody waits for it here.
    Refit(pool_change).IgnoreError();
    if (periodic && absl::Now() >= next_periodic) next_periodic = absl::Now() + options_.interval;
    thread_mu_.Lock();
  }
  thread_mu_.Unlock();
}

// ---- Router notifications ----------------------------------------------------------------------

void OnlineRefitter::OnSignatureRouted(const RoutedSignature& routed) {
  if (routed.lease_id == 0) {  // cannot happen (the router's ids are never 0): join unweighted
    Observe(routed.signature(), routed.client);
    return;
  }
  if (routed.signature_dim <= 0) return;
  const int dim = routed.signature_dim;
  const absl::Time now = Now();
  std::vector<std::shared_ptr<Chunk>> released;  // freed after the lock is released
  absl::MutexLock lock(&window_mu_);
  if (!AdmitLocked(dim, routed.client, now, &released)) return;
  // Built here, for the admitted signatures only (see RoutedSignature::signature).
  const absl::Span<const float> signature = routed.signature();
  if (static_cast<int>(signature.size()) != dim) return;
  const refit_internal::EncodedSignature encoded = refit_internal::EncodeSignature(signature, encode_scratch_.get());
  const int64_t bytes = static_cast<int64_t>(encoded.elements.size() * sizeof(uint16_t));
  while (!pending_.empty() && (static_cast<int64_t>(pending_.size()) >= options_.max_pending_signatures ||
                               pending_bytes_ + bytes > options_.max_pending_bytes)) {
    DropOldestPendingLocked();
  }
  if (bytes > options_.max_pending_bytes) {  // larger than the whole pending budget
    ++pending_dropped_;
    return;
  }
  auto [it, created] = pending_.try_emplace(routed.lease_id);
  if (!created) pending_bytes_ -= static_cast<int64_t>(it->second.elements.size() * sizeof(uint16_t));
  PendingSignature& pending = it->second;
  if (created && !pending_buffers_.empty()) {
    pending.elements = std::move(pending_buffers_.back());
    pending_buffers_.pop_back();
  }
  pending.elements.assign(encoded.elements.begin(), encoded.elements.end());
  pending.encoding = static_cast<uint8_t>(encoded.encoding);
  pending.exponent = encoded.exponent;
  pending.dim = dim;
  pending.routed_at = now;
  pending_bytes_ += bytes;
  if (created) pending_order_.push_back(routed.lease_id);
}

void OnlineRefitter::OnLeaseEnded(const LeaseEnd& ended) {
  const absl::Time now = Now();
  std::vector<std::shared_ptr<Chunk>> released;  // freed after the lock is released
  absl::MutexLock lock(&window_mu_);
  auto it = pending_.find(ended.lease_id);
  if (it == pending_.end()) return;  // not admitted, dropped, or routed before we subscribed
  PendingSignature pending = std::move(it->second);
  pending_.erase(it);
  pending_bytes_ -= static_cast<int64_t>(pending.elements.size() * sizeof(uint16_t));
  // Pop ids of signatures that left already, so the queue stays about as long as the map; behind
  // a long-lived lease at the front, compact it when it is mostly such ids.
  while (!pending_order_.empty() && !pending_.contains(pending_order_.front())) pending_order_.pop_front();
  if (pending_order_.size() > 2 * pending_.size() + 1024) {
    std::deque<uint64_t> live;
    for (const uint64_t id : pending_order_) {
      if (pending_.contains(id)) live.push_back(id);
    }
    pending_order_ = std::move(live);
  }
  const auto recycle = [&] {
    if (pending_buffers_.size() < 64) pending_buffers_.push_back(std::move(pending.elements));
  };
  const double held_seconds = absl::ToDoubleSeconds(ended.held);
  double weight = 0;
  WeightSource source = WeightSource::kDefault;
  if (ended.kind == LeaseEndKind::kCompleted && ended.output_tokens > 0) {
    weight = static_cast<double>(ended.output_tokens);
    source = WeightSource::kOutputTokens;
    if (held_seconds > 0) {
      // Forgets with a half-life of about 180 leases.
      constexpr double kKeep = 1.0 - 1.0 / 256;
      rate_tokens_ = rate_tokens_ * kKeep + weight;
      rate_seconds_ = rate_seconds_ * kKeep + held_seconds;
    }
  } else if (ended.kind == LeaseEndKind::kCompleted) {
    const double rate = rate_seconds_ > 0 ? rate_tokens_ / rate_seconds_ : options_.default_tokens_per_second;
    weight = held_seconds * rate;
    source = WeightSource::kHoldTime;
  } else {
    weight = options_.default_output_tokens;
    if (weight <= 0) {  // unmeasured work is not counted at all
      ++pending_dropped_;
      recycle();
      return;
    }
  }
  weight = std::max(1.0, weight);
  if (source != WeightSource::kDefault) {
    constexpr double kKeep = 1.0 - 1.0 / 1024;
    measured_weight_sum_ = measured_weight_sum_ * kKeep + weight;
    measured_weight_count_ = measured_weight_count_ * kKeep + 1;
  }
  if (pending.dim != window_dim_ || max_chunks_ == 0) {  // the window restarted for another transform
    ++pending_dropped_;
    recycle();
    return;
  }
  refit_internal::EncodedSignature encoded;
  encoded.encoding = static_cast<refit_internal::RowEncoding>(pending.encoding);
  encoded.exponent = pending.exponent;
  encoded.elements = pending.elements;
  CountWeightLocked(source);
  AppendLocked(encoded, static_cast<float>(weight), now, &released);
  recycle();
}

void OnlineRefitter::CountWeightLocked(WeightSource source) {
  switch (source) {
    case WeightSource::kOutputTokens:
      ++weights_output_tokens_;
      break;
    case WeightSource::kHoldTime:
      ++weights_hold_time_;
      break;
    case WeightSource::kDefault:
      ++weights_default_;
      break;
    case WeightSource::kUnleased:
      ++weights_unleased_;
      break;
  }
}

void OnlineRefitter::DropOldestPendingLocked() {
  while (!pending_order_.empty()) {
    const uint64_t id = pending_order_.front();
    pending_order_.pop_front();
    auto it = pending_.find(id);
    if (it == pending_.end()) continue;  // left already
    pending_bytes_ -= static_cast<int64_t>(it->second.elements.size() * sizeof(uint16_t));
    if (pending_buffers_.size() < 64) pending_buffers_.push_back(std::move(it->second.elements));
    pending_.erase(it);
    ++pending_dropped_;
    return;
  }
}

void OnlineRefitter::ClearPendingLocked() {
  pending_.clear();
  pending_order_.clear();
  pending_bytes_ = 0;
}

double OnlineRefitter::UnleasedWeightLocked() const {
  if (measured_weight_count_ > 0) return std::max(1.0, measured_weight_sum_ / measured_weight_count_);
  return std::max(1.0, options_.default_output_tokens);
}

void OnlineRefitter::OnPoolChanged(const PoolChange& change) {
  // A health change moves no zone; everything else may add or remove a row.
  if (change.kind == PoolChangeKind::kHealthChanged) return;
  absl::MutexLock lock(&thread_mu_);
  pool_changed_ = true;
  thread_cv_.Signal();
}

void OnlineRefitter::OnCentroidsInstalled(const CentroidInstall& install) {
  if (install.source == CentroidSource::kRefit) return;
  external_installs_.fetch_add(1, std::memory_order_acq_rel);
  // A restart's persisted state continues the refits learnt under the calibration: it is not a
  // new anchor. Anything else is a calibration the operator chose.
  if (install.source != CentroidSource::kStateDir) {
    absl::StatusOr<CentroidArtifact> current = router_->CurrentCentroids();
    if (current.ok() && current->k == install.rows) {
      absl::MutexLock lock(&anchors_mu_);
      anchors_.clear();
      for (int r = 0; r < current->k; ++r) {
        const auto row = current->row(r);
        anchors_[current->workers[r]].assign(row.begin(), row.end());
      }
    }
  }
  if (install.transform_changed) ResetWindow();
}

// ---- Window ------------------------------------------------------------------------------------

bool OnlineRefitter::AdmitClient(absl::string_view client, absl::Time now) {
  // The number of active clients (admitted a signature within the window), recounted at most once
  // a second; stale accounts are dropped then.
  if (now - clients_counted_at_ >= absl::Seconds(1) || clients_counted_at_ > now) {
    active_clients_ = 0;
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (now - it->second.last_admitted > options_.window) {
        clients_.erase(it++);
      } else {
        ++active_clients_;
        ++it;
      }
    }
    clients_counted_at_ = now;
  }
  std::string key(client);
  if (!clients_.contains(key) && clients_.size() >= kMaxTrackedClients) key = kOverflowClient;
  auto [it, created] = clients_.try_emplace(key);
  ClientBucket& bucket = it->second;
  if (created) ++active_clients_;
  const double fair = 1.0 / static_cast<double>(std::max<int64_t>(1, active_clients_));
  const double capacity = window_capacity_ * std::min(options_.max_client_share, fair);
  if (created) {
    bucket.tokens = capacity;
    bucket.refilled_at = now;
    bucket.last_admitted = now;
  } else if (now > bucket.refilled_at) {
    bucket.tokens += capacity * absl::FDivDuration(now - bucket.refilled_at, options_.window);
    bucket.refilled_at = now;
  }
  bucket.tokens = std::min(bucket.tokens, capacity);
  if (bucket.tokens < 1) return false;
  bucket.tokens -= 1;
  bucket.last_admitted = now;
  return true;
}

void OnlineRefitter::RestartWindow(int dim, std::vector<std::shared_ptr<Chunk>>* released) {
  released->insert(released->end(), chunks_.begin(), chunks_.end());
  chunks_.clear();
  if (spare_chunk_ != nullptr) released->push_back(std::move(spare_chunk_));
  spare_chunk_.reset();
  front_skip_ = 0;
  window_rows_ = 0;
  window_elements_ = 0;
  window_weight_ = 0;
  window_dim_ = dim;
  ClearPendingLocked();
  // Chunks of at most kChunkBytes and at most 1/kMinChunksPerBudget of the budget (so a small
  // budget is still evicted in fine steps), but always room for one dense row.
  const size_t budget = static_cast<size_t>(options_.max_window_bytes);
  const size_t bytes = std::min(kChunkBytes, budget / kMinChunksPerBudget);
  chunk_elements_ = std::max(static_cast<size_t>(dim), bytes / sizeof(uint16_t));
  chunk_bytes_ = Chunk::FootprintBytes(chunk_elements_, kChunkMaxRows);
  max_chunks_ = budget / chunk_bytes_;
  UpdateWindowCapacity(static_cast<size_t>(dim));  // until rows arrive: as if they were dense
}

void OnlineRefitter::EvictOldestRow(std::vector<std::shared_ptr<Chunk>>* released) {
  const Chunk& front = *chunks_.front();
  window_elements_ -= static_cast<int64_t>(front.row_elements(front_skip_));
  window_weight_ = std::max(0.0, window_weight_ - front.weight(front_skip_));
  --window_rows_;
  ++front_skip_;
  // The newest chunk stays even when emptied: it is the one being appended to.
  if (front_skip_ < front.size() || chunks_.size() == 1) return;
  // Kept as the spare when no fit reads it any more; the previous spare is released.
  if (spare_chunk_ != nullptr) released->push_back(std::move(spare_chunk_));
  spare_chunk_ = std::move(chunks_.front());
  chunks_.erase(chunks_.begin());
  front_skip_ = 0;
}

void OnlineRefitter::OpenChunk(std::vector<std::shared_ptr<Chunk>>* released) {
  // A chunk is reused only once the window holds its last reference: a fit's snapshot may still
  // read it. The acquire fence pairs with the release of the snapshot's reference, so the fit's
  // reads happen before the chunk is overwritten.
  const auto reusable = [](const std::shared_ptr<Chunk>& chunk) {
    if (chunk.use_count() != 1) return false;
    std::atomic_thread_fence(std::memory_order_acquire);
    return true;
  };
  std::shared_ptr<Chunk> chunk;
  if (spare_chunk_ != nullptr && reusable(spare_chunk_)) chunk = std::move(spare_chunk_);
  if (spare_chunk_ != nullptr) released->push_back(std::move(spare_chunk_));  // still read by a fit
  spare_chunk_.reset();
  // The byte budget: with the new chunk, at most max_chunks_; the oldest signatures make room. A
  // fully evicted chunk (kept only while it was the newest) goes too.
  while (!chunks_.empty() && (chunks_.size() + 1 > max_chunks_ || front_skip_ == chunks_.front()->size())) {
    std::shared_ptr<Chunk> oldest = std::move(chunks_.front());
    chunks_.erase(chunks_.begin());
    window_rows_ -= oldest->size() - front_skip_;
    for (int r = front_skip_; r < oldest->size(); ++r) {
      window_elements_ -= static_cast<int64_t>(oldest->row_elements(r));
      window_weight_ = std::max(0.0, window_weight_ - oldest->weight(r));
    }
    if (window_rows_ == 0) window_weight_ = 0;
    front_skip_ = 0;
    if (chunk == nullptr && reusable(oldest)) {
      chunk = std::move(oldest);
    } else {
      released->push_back(std::move(oldest));
    }
  }
  if (chunk != nullptr) {
    chunk->Clear();
  } else {
    chunk = std::make_shared<Chunk>(window_dim_, chunk_elements_, kChunkMaxRows);
  }
  chunks_.push_back(std::move(chunk));
}

void OnlineRefitter::UpdateWindowCapacity(size_t last_elements) {
  // What the budget holds at the window's mean row size: whole chunks, less two for the partly
  // evicted oldest and the partly filled newest (so a window at capacity is evicted by age, the
  // even sample, rather than by the budget).
  const double mean_elements = window_rows_ > 0 ? static_cast<double>(window_elements_) / window_rows_
                                                : static_cast<double>(std::max<size_t>(1, last_elements));
  const double rows_per_chunk =
      std::min<double>(kChunkMaxRows, std::floor(static_cast<double>(chunk_elements_) / mean_elements));
  const double chunks = static_cast<double>(max_chunks_ > 2 ? max_chunks_ - 2 : 1);
  window_capacity_ =
      std::max(1.0, std::min<double>(options_.max_window_signatures, std::floor(chunks * rows_per_chunk)));
}

int64_t OnlineRefitter::WindowBytes() const {
  const size_t held = chunks_.size() + (spare_chunk_ != nullptr ? 1 : 0);
  return static_cast<int64_t>(held * chunk_bytes_);
}

bool OnlineRefitter::AdmitLocked(int dim, absl::string_view client, absl::Time now,
                                 std::vector<std::shared_ptr<Chunk>>* released) {
  ++observed_;
  if (dim != window_dim_) RestartWindow(dim, released);  // another transform: the old rows are useless
  if (max_chunks_ == 0) {                                // one chunk of this dimension is larger than the whole budget
    ++sampled_out_;
    return false;
  }
  const double capacity = window_capacity_;
  if (admission_tokens_ < 0) {
    admission_tokens_ = capacity;
  } else if (now > admission_refilled_at_) {
    const double refill = capacity * absl::FDivDuration(now - admission_refilled_at_, options_.window);
    admission_tokens_ = std::min(capacity, admission_tokens_ + refill);
  }
  admission_refilled_at_ = now;
  if (admission_tokens_ < 1) {
    ++sampled_out_;
    return false;
  }
  if (!AdmitClient(client, now)) {
    ++client_limited_;
    return false;
  }
  admission_tokens_ -= 1;
  return true;
}

void OnlineRefitter::AppendLocked(const refit_internal::EncodedSignature& encoded, float weight, absl::Time now,
                                  std::vector<std::shared_ptr<Chunk>>* released) {
  if (chunks_.empty() || !chunks_.back()->Append(encoded, now, weight)) {
    OpenChunk(released);
    chunks_.back()->Append(encoded, now, weight);  // an empty chunk has room for any one row
  }
  ++window_rows_;
  window_elements_ += static_cast<int64_t>(encoded.elements.size());
  window_weight_ += weight;
  // Signatures too old or beyond the size bound leave, oldest first.
  const absl::Time oldest_kept = now - options_.window;
  while (window_rows_ > 0 &&
         (window_rows_ > options_.max_window_signatures || chunks_.front()->time(front_skip_) < oldest_kept)) {
    EvictOldestRow(released);
  }
  UpdateWindowCapacity(encoded.elements.size());
}

void OnlineRefitter::Observe(absl::Span<const float> signature, absl::string_view client) {
  Observe(signature, client, /*weight=*/0);
}

void OnlineRefitter::Observe(absl::Span<const float> signature, absl::string_view client, double weight) {
  if (signature.empty()) return;
  const int dim = static_cast<int>(signature.size());
  const absl::Time now = Now();
  std::vector<std::shared_ptr<Chunk>> released;  // freed after the lock is released
  absl::MutexLock lock(&window_mu_);
  if (!AdmitLocked(dim, client, now, &released)) return;
  if (!(weight > 0) || !std::isfinite(weight)) {
    weight = UnleasedWeightLocked();
    CountWeightLocked(WeightSource::kUnleased);
  } else {
    CountWeightLocked(WeightSource::kOutputTokens);
  }
  const refit_internal::EncodedSignature encoded = refit_internal::EncodeSignature(signature, encode_scratch_.get());
  AppendLocked(encoded, static_cast<float>(weight), now, &released);
}

void OnlineRefitter::ResetWindow() {
  std::vector<std::shared_ptr<Chunk>> released;
  absl::MutexLock lock(&window_mu_);
  RestartWindow(window_dim_, &released);
  clients_.clear();
  active_clients_ = 0;
}

refit_internal::SignatureRows OnlineRefitter::SnapshotWindow(absl::Time now) {
  refit_internal::SignatureRows snapshot;
  {
    absl::MutexLock lock(&window_mu_);
    snapshot.set_dim(window_dim_);
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const int first = c == 0 ? front_skip_ : 0;
      snapshot.Add(chunks_[c], first, chunks_[c]->size() - first);
    }
  }
  // Outside the lock (the rows are immutable): keep the newest max_window_signatures that are
  // young enough.
  const absl::Time oldest_kept = now - options_.window;
  int old = 0;
  while (old < snapshot.rows() && snapshot.time(old) < oldest_kept) ++old;
  snapshot.DropOldest(std::max(old, snapshot.rows() - options_.max_window_signatures));
  return snapshot;
}

// ---- Refit -------------------------------------------------------------------------------------

absl::Status OnlineRefitter::RecordFailure(const absl::Status& status, RefitOutcome outcome) {
  outcome.kind = RefitOutcome::Kind::kFailed;
  outcome.reason = std::string(status.message());
  {
    absl::MutexLock lock(&stats_mu_);
    ++stats_.refits_failed;
    stats_.last_error = outcome.reason;
    PublishGuardFiguresLocked(outcome);
  }
  if (options_.on_refit) options_.on_refit(outcome);
  return status;
}

absl::Status OnlineRefitter::RecordSkip(const std::string& why, RefitOutcome outcome) {
  outcome.kind = RefitOutcome::Kind::kSkipped;
  outcome.reason = why;
  {
    absl::MutexLock lock(&stats_mu_);
    ++stats_.refits_skipped;
    stats_.last_error = why;
    PublishGuardFiguresLocked(outcome);
  }
  if (options_.on_refit) options_.on_refit(outcome);
  return absl::OkStatus();
}

void OnlineRefitter::NoteRefusal(RefitRefusal refusal, RefitOutcome* outcome) {
  outcome->refusal = refusal;
  uint64_t RefitStats::*counter = &RefitStats::refits_refused_churn;
  switch (refusal) {
    case RefitRefusal::kImbalance:
      outcome->reason =
          absl::StrFormat("refit refused: predicted work imbalance %.3f against %.3f now (allowed +%g)",
                          outcome->candidate.imbalance, outcome->current.imbalance, options_.max_imbalance_increase);
      counter = &RefitStats::refits_refused_imbalance;
      break;
    case RefitRefusal::kLocality:
      outcome->reason = absl::StrFormat(
          "refit refused: predicted locality %.4f against %.4f now (allowed -%g) and %.2f experts per layer per "
          "decode step against %.2f (a refit must save at least %g%%)",
          outcome->candidate.locality, outcome->current.locality, options_.max_locality_decrease,
          outcome->candidate.experts_per_step, outcome->current.experts_per_step, 100 * options_.min_experts_gain);
      counter = &RefitStats::refits_refused_locality;
      break;
    case RefitRefusal::kChurn:
    case RefitRefusal::kNone:
      outcome->reason = absl::StrFormat(
          "refit refused: %.1f%% of the window's signatures would change worker (at most %.1f%%), "
          "and still more with an eighth of the movement",
          100 * outcome->churn, 100 * options_.max_churn);
      break;
  }
  absl::MutexLock lock(&stats_mu_);
  ++(stats_.*counter);
  stats_.last_error = outcome->reason;
  PublishGuardFiguresLocked(*outcome);
}

void OnlineRefitter::PublishGuardFiguresLocked(const RefitOutcome& outcome) {
  if (!outcome.guarded) return;
  stats_.guarded = true;
  stats_.current_prediction = outcome.current;
  stats_.candidate_prediction = outcome.candidate;
  stats_.last_churn = outcome.churn;
}

absl::Status OnlineRefitter::RecordRefusal(RefitRefusal refusal, RefitOutcome outcome) {
  outcome.kind = RefitOutcome::Kind::kRefused;
  NoteRefusal(refusal, &outcome);
  if (options_.on_refit) options_.on_refit(outcome);
  return absl::OkStatus();
}

std::vector<std::pair<std::string, double>> OnlineRefitter::SortedCapacities(const RefitPlan& plan, size_t count) {
  std::vector<std::pair<std::string, double>> capacities;
  for (size_t t = 0; t < std::min(count, plan.target.size()); ++t) {
    capacities.emplace_back(plan.target[t], plan.capacity[t]);
  }
  std::sort(capacities.begin(), capacities.end());
  return capacities;
}

std::optional<RefitRefusal> OnlineRefitter::GuardInstall(const RefitPlan& plan, std::vector<float>* rows,
                                                         bool pool_change, RefitOutcome* outcome) {
  outcome->window_weight = 0;
  for (const double w : plan.weights) outcome->window_weight += w;
  if (plan.kept_k == 0 || plan.m == 0) return std::nullopt;  // nothing in service to compare with
  const int k = static_cast<int>(plan.target.size());
  const int dim = plan.current.dim();
  std::vector<int> nearest_current;
  std::vector<double> margin_current;
  // The zones as the router uses them: a signature's work spreads over the rows of its band.
  PredictionModel model;
  model.band = router_->options().tau;
  model.experts_per_layer = plan.current.spec.experts;
  model.expert_picks = options_.expert_picks;
  outcome->current =
      PredictSet(plan.points, plan.weights, plan.kept_rows, plan.kept_k,
                 absl::MakeConstSpan(plan.capacity).subspan(0, plan.kept_k), model, &nearest_current, &margin_current);
  // Workers without a row get nothing from the set in service: its balance is over every target
  // worker (the added ones' shares are 0, so the mean is k / kept_k times lower).
  outcome->current.imbalance *= static_cast<double>(k) / plan.kept_k;
  // Churn counts the signatures the set in service places firmly: ahead of the next row by more
  // than the band width. Within the band the router already spreads a signature by load, so which
  // of those rows is nearest is no zone of anyone's.
  // The prediction of a candidate and its churn: both sets index plan.target (the kept rows are
  // its first kept_k entries).
  std::vector<int> nearest;
  const auto evaluate = [&](const std::vector<float>& candidate, SetPrediction* prediction) {
    *prediction = PredictSet(plan.points, plan.weights, candidate, k, plan.capacity, model, &nearest);
    int changed = 0;
    for (int i = 0; i < plan.m; ++i)
      changed += margin_current[i] > model.band && nearest_current[i] != nearest[i] ? 1 : 0;
    return static_cast<double>(changed) / plan.m;
  };
  const auto balanced_enough = [&](const SetPrediction& prediction) {
    return prediction.imbalance <= outcome->current.imbalance + options_.max_imbalance_increase;
  };
  // A pool change's reconciliation is exempt from the churn and locality bounds: moving zones is
  // what it is for, and the set in service covers only the workers that stay. So is a refit after
  // the workers' capacities changed from those of the last install (or of the refitter's start):
  // resizing zones to new capacities costs locality by design.
  outcome->churn_exempt = pool_change || plan.added > 0 || plan.dropped > 0;
  std::vector<std::pair<std::string, double>> capacities = SortedCapacities(plan, plan.target.size());
  if (capacities_at_install_.empty()) capacities_at_install_ = capacities;
  const bool capacities_changed = capacities != capacities_at_install_;
  const auto local_enough = [&](const SetPrediction& prediction) {
    return outcome->churn_exempt || capacities_changed ||
           prediction.locality >= outcome->current.locality - options_.max_locality_decrease ||
           options_.min_experts_gain <= -1 ||
           prediction.experts_per_step <= outcome->current.experts_per_step * (1 - options_.min_experts_gain);
  };
  outcome->churn = evaluate(*rows, &outcome->candidate);
  outcome->guarded = true;
  std::optional<RefitRefusal> refusal;
  if (!balanced_enough(outcome->candidate)) {
    refusal = RefitRefusal::kImbalance;
  } else if (!local_enough(outcome->candidate)) {
    refusal = RefitRefusal::kLocality;
  } else if (!outcome->churn_exempt && outcome->churn > options_.max_churn) {
    // Too many signatures would change worker at once: move every row only part of the way (a
    // half, a quarter, an eighth of its rotation) and take the largest part within both bounds.
    refusal = RefitRefusal::kChurn;
    outcome->fitted_churn = outcome->churn;
    for (const double fraction : {0.5, 0.25, 0.125}) {
      std::vector<float> partial = *rows;
      for (int t = 0; t < plan.kept_k; ++t) {
        const absl::Span<const float> from(plan.kept_rows.data() + static_cast<size_t>(t) * dim, dim);
        const absl::Span<float> to = absl::MakeSpan(partial).subspan(static_cast<size_t>(t) * dim, dim);
        const double theta = std::acos(std::clamp(Dot(from, to), -1.0, 1.0));
        LimitRotation(from, to, 1.0 - std::cos(fraction * theta));
      }
      SetPrediction prediction;
      const double churn = evaluate(partial, &prediction);
      if (churn <= options_.max_churn && balanced_enough(prediction) && local_enough(prediction)) {
        *rows = std::move(partial);
        outcome->candidate = prediction;
        outcome->churn = churn;
        outcome->movement_fraction = fraction;
        refusal.reset();
        break;
      }
    }
  }
  return refusal;
}

SetPrediction OnlineRefitter::PredictSet(const PointRows& points, absl::Span<const double> weights,
                                         absl::Span<const float> rows, int k, absl::Span<const double> capacity,
                                         const PredictionModel& model, std::vector<int>* nearest,
                                         std::vector<double>* margin) {
  SetPrediction prediction;
  const int m = points.rows();
  const int dim = points.dim();
  if (nearest != nullptr) nearest->assign(static_cast<size_t>(m), -1);
  if (margin != nullptr) margin->assign(static_cast<size_t>(m), 0.0);
  if (k <= 0 || m == 0) return prediction;
  const auto capacity_of = [&](int row) { return capacity.empty() ? 1.0 : capacity[row]; };
  // usage[row * dim + c]: the work-weighted sum of the squared entries of the row's signatures.
  const bool predict_experts = model.experts_per_layer > 0;
  // Single precision: a predictor's sums, and the accumulation is most of this function's time.
  std::vector<float> usage(predict_experts ? static_cast<size_t>(k) * dim : 0, 0.f);
  std::vector<double> work(static_cast<size_t>(k), 0.0);
  std::vector<std::pair<int, double>> band_rows;  // (row, fraction of the signature's work)
  double total = 0;
  double similarity = 0;
  // One pass over the points, a block (PointRows::block_rows) at a time: the decoded block is
  // scored and then read for the usage, so a compact window is decoded once.
  std::vector<float> block_scores;
  std::vector<float> scratch;
  std::vector<float> unused_scratch;  // a dense block needs none
  const int block = points.block_rows();
  for (int begin = 0; begin < m; begin += block) {
    const int count = std::min(block, m - begin);
    const absl::Span<const float> decoded = points.Read(begin, count, &scratch);
    block_scores.resize(static_cast<size_t>(count) * k);
    ScorePointRows(DensePointRows(decoded, count, dim), rows, k, absl::MakeSpan(block_scores), &unused_scratch);
    for (int i = begin; i < begin + count; ++i) {
      const float* row = block_scores.data() + static_cast<size_t>(i - begin) * k;
      const int c = static_cast<int>(std::max_element(row, row + k) - row);
      const double w = weights.empty() ? 1.0 : weights[i];
      band_rows.clear();
      if (model.band > 0) {
        // The router sends the request to the least loaded (per capacity) row of its band: in
        // expectation its work spreads over the band in proportion to capacity.
        double band_capacity = 0;
        for (int j = 0; j < k; ++j) {
          if (row[j] >= row[c] - model.band) {
            band_rows.emplace_back(j, capacity_of(j));
            band_capacity += capacity_of(j);
          }
        }
        for (auto& [j, fraction] : band_rows) fraction /= band_capacity;
      } else {
        band_rows.emplace_back(c, 1.0);
      }
      for (const auto& [j, fraction] : band_rows) work[j] += w * fraction;
      if (predict_experts) {
        const absl::Span<const float> signature = decoded.subspan(static_cast<size_t>(i - begin) * dim, dim);
        for (const auto& [j, fraction] : band_rows) {
          float* sums = usage.data() + static_cast<size_t>(j) * dim;
          const float share = static_cast<float>(w * fraction);
          for (int d = 0; d < dim; ++d) sums[d] += share * signature[d] * signature[d];
        }
      }
      total += w;
      similarity += w * row[c];
      if (nearest != nullptr) (*nearest)[i] = c;
      if (margin != nullptr) {
        float second = -2;
        for (int j = 0; j < k; ++j) {
          if (j != c) second = std::max(second, row[j]);
        }
        (*margin)[i] = k > 1 ? static_cast<double>(row[c]) - second : 2.0;
      }
    }
  }
  double max_share = 0;
  double sum_share = 0;
  for (int c = 0; c < k; ++c) {
    const double share = work[c] / capacity_of(c);
    max_share = std::max(max_share, share);
    sum_share += share;
  }
  prediction.imbalance = sum_share > 0 ? max_share / (sum_share / k) : 1.0;
  prediction.locality = total > 0 ? similarity / total : 0.0;
  if (predict_experts) {
    // Per zone and layer: the picks follow the layer's normalised usage; a column drawn with
    // probability p is loaded with probability 1 - exp(-picks * p). Signatures whose columns do not
    // come in whole layers count as one layer.
    const int width = dim % model.experts_per_layer == 0 ? model.experts_per_layer : dim;
    const int layers = dim / width;
    double weighted = 0;
    double zone_work = 0;
    for (int j = 0; j < k; ++j) {
      if (work[j] <= 0) continue;
      const float* sums = usage.data() + static_cast<size_t>(j) * dim;
      double distinct = 0;
      for (int layer = 0; layer < layers; ++layer) {
        const float* columns = sums + static_cast<size_t>(layer) * width;
        const double layer_sum = std::accumulate(columns, columns + width, 0.0);
        if (layer_sum <= 0) continue;
        for (int e = 0; e < width; ++e) distinct += 1.0 - std::exp(-model.expert_picks * columns[e] / layer_sum);
      }
      weighted += work[j] * distinct / layers;
      zone_work += work[j];
    }
    prediction.experts_per_step = zone_work > 0 ? weighted / zone_work : 0.0;
  }
  return prediction;
}

absl::Status OnlineRefitter::Refit(bool pool_change) {
  absl::MutexLock lock(&fit_mu_);
  return RefitLocked(pool_change);
}

absl::Status OnlineRefitter::RefitNow() { return Refit(/*pool_change=*/false); }

absl::Status OnlineRefitter::OnWorkerAdded(const std::string& worker_id) {
  absl::MutexLock lock(&fit_mu_);
  const RouterState state = router_->GetState(Now());
  const auto it = std::find_if(state.workers.begin(), state.workers.end(),
                               [&](const WorkerStatus& w) { return w.spec.id == worker_id; });
  if (it == state.workers.end() || it->state != WorkerState::kActive) {
    return absl::FailedPreconditionError(absl::StrCat("refit: worker '", worker_id, "' is ",
                                                      it == state.workers.end() ? "unknown" : "draining",
                                                      " to the router; upsert it first"));
  }
  if (absl::Status refit = RefitLocked(/*pool_change=*/true); !refit.ok()) return refit;
  absl::StatusOr<CentroidArtifact> current = router_->CurrentCentroids();
  if (current.ok() &&
      std::find(current->workers.begin(), current->workers.end(), worker_id) != current->workers.end()) {
    return absl::OkStatus();
  }
  absl::MutexLock stats_lock(&stats_mu_);
  return absl::FailedPreconditionError(
      absl::StrCat("refit: worker '", worker_id, "' got no zone: ", stats_.last_error));
}

absl::Status OnlineRefitter::OnWorkerRemoved(const std::string& worker_id) {
  absl::MutexLock lock(&fit_mu_);
  const RouterState state = router_->GetState(Now());
  for (const WorkerStatus& w : state.workers) {
    if (w.spec.id == worker_id && w.state == WorkerState::kActive) {
      return absl::FailedPreconditionError(
          absl::StrCat("refit: worker '", worker_id, "' is still active; drain or remove it from the router first"));
    }
  }
  return RefitLocked(/*pool_change=*/true);
}

absl::StatusOr<OnlineRefitter::RefitPlan> OnlineRefitter::PlanRefit(absl::Time now) {
  RefitPlan plan;
  plan.external_installs_before = external_installs_.load(std::memory_order_acquire);
  const RouterState state = router_->GetState(now);
  absl::StatusOr<CentroidArtifact> current = router_->CurrentCentroids();
  if (!current.ok()) return absl::FailedPreconditionError("refit skipped: no centroids are installed yet");
  plan.current = *std::move(current);
  const int dim = plan.current.dim();

  // Target rows: the kept workers (active, with a row) in their row order, then the active workers
  // that have no row yet, in router order.
  absl::flat_hash_map<std::string, double> active_capacity;
  for (const WorkerStatus& w : state.workers) {
    if (w.state == WorkerState::kActive) active_capacity[w.spec.id] = w.spec.capacity;
  }
  absl::flat_hash_set<std::string> has_row;
  for (int r = 0; r < plan.current.k; ++r) {
    const std::string& id = plan.current.workers[r];
    has_row.insert(id);
    if (!active_capacity.contains(id)) continue;
    plan.target.push_back(id);
    const auto row = plan.current.row(r);
    plan.kept_rows.insert(plan.kept_rows.end(), row.begin(), row.end());
  }
  plan.kept_k = static_cast<int>(plan.target.size());
  for (const WorkerStatus& w : state.workers) {
    if (w.state == WorkerState::kActive && !has_row.contains(w.spec.id)) plan.target.push_back(w.spec.id);
  }
  for (const std::string& id : plan.target) plan.capacity.push_back(active_capacity[id]);
  plan.added = static_cast<int>(plan.target.size()) - plan.kept_k;
  plan.dropped = plan.current.k - plan.kept_k;
  if (plan.target.empty()) return absl::FailedPreconditionError("refit skipped: no active workers");

  plan.points = SnapshotWindow(now);
  plan.m = plan.points.rows();
  if (plan.m > 0 && plan.points.dim() != dim) {  // signatures of another transform: unusable here
    plan.m = 0;
    plan.points = refit_internal::SignatureRows();
  }
  plan.weights = plan.points.Weights();
  return plan;
}

absl::StatusOr<std::vector<float>> OnlineRefitter::FitAligned(const RefitPlan& plan, RefitOutcome* outcome) {
  const int k = static_cast<int>(plan.target.size());
  const int dim = plan.current.dim();
  BalancedKMeansOptions fit_options;
  fit_options.clusters = k;
  fit_options.seed = options_.seed;
  fit_options.max_iterations = options_.max_iterations;
  fit_options.tolerance = options_.tolerance;
  fit_options.capacity_weights = plan.capacity;
  // Balance the decode work the window's signatures caused, not their count.
  fit_options.point_weights = plan.weights;
  if (plan.kept_k > 0) {
    fit_options.initial_centroids = plan.kept_rows;
    if (plan.added > 0) {
      const std::vector<float> seeds = SplitSeeds(plan.points, plan.kept_rows, plan.kept_k, plan.added);
      fit_options.initial_centroids.insert(fit_options.initial_centroids.end(), seeds.begin(), seeds.end());
    }
  }
  absl::StatusOr<BalancedKMeansResult> fit = FitBalancedKMeans(plan.points, fit_options);
  if (!fit.ok()) return absl::Status(fit.status().code(), absl::StrCat("refit: ", fit.status().message()));
  outcome->iterations = fit->iterations;
  outcome->converged = fit->converged;
  if (plan.kept_k == 0) return std::move(fit->centroids);
  // Align the fitted rows to the warm start's identities (kept workers' old rows and the new
  // workers' seeds), so each worker keeps the zone nearest its old one.
  const std::vector<int> row_of_target = AlignCentroids(fit_options.initial_centroids, fit->centroids, k, dim);
  if (row_of_target.size() != static_cast<size_t>(k)) return absl::InternalError("refit: centroid alignment failed");
  std::vector<float> rows(static_cast<size_t>(k) * dim);
  for (int t = 0; t < k; ++t) {
    std::copy_n(fit->centroids.begin() + static_cast<size_t>(row_of_target[t]) * dim, dim,
                rows.begin() + static_cast<size_t>(t) * dim);
  }
  return rows;
}

void OnlineRefitter::BoundMovement(const RefitPlan& plan, std::vector<float>* rows, RefitOutcome* outcome) {
  const int dim = plan.current.dim();
  absl::MutexLock lock(&anchors_mu_);
  for (int t = 0; t < static_cast<int>(plan.target.size()); ++t) {
    const absl::Span<float> row = absl::MakeSpan(*rows).subspan(static_cast<size_t>(t) * dim, dim);
    if (t < plan.kept_k) {
      const absl::Span<const float> before(plan.kept_rows.data() + static_cast<size_t>(t) * dim, dim);
      if (LimitRotation(before, row, options_.max_step_distance)) ++outcome->rows_step_bounded;
    }
    auto anchor = anchors_.find(plan.target[t]);
    if (anchor == anchors_.end() || anchor->second.size() != static_cast<size_t>(dim)) {
      // A worker's first zone from a refit is where its drift is measured from.
      anchors_[plan.target[t]].assign(row.begin(), row.end());
      continue;
    }
    if (LimitRotation(anchor->second, row, options_.max_drift_distance)) ++outcome->rows_drift_bounded;
  }
}

absl::Status OnlineRefitter::RefitLocked(bool pool_change) {
  const auto started = std::chrono::steady_clock::now();
  {
    absl::MutexLock lock(&stats_mu_);
    ++stats_.refits_started;
  }
  const absl::Time now = Now();
  RefitOutcome outcome;
  outcome.pool_change = pool_change;
  if (options_.may_refit && !options_.may_refit()) {
    return RecordSkip("refit paused: this replica is not the cluster's refit leader", outcome);
  }
  absl::StatusOr<RefitPlan> planned = PlanRefit(now);
  if (!planned.ok()) return RecordSkip(std::string(planned.status().message()), outcome);
  RefitPlan& plan = *planned;
  const int k = static_cast<int>(plan.target.size());
  outcome.window_signatures = plan.m;

  CentroidArtifact next;
  next.spec = plan.current.spec;
  next.model = plan.current.model;
  next.seed = plan.current.seed;
  next.k = k;
  next.workers = plan.target;
  const int64_t needed = std::max<int64_t>(k, static_cast<int64_t>(options_.min_signatures_per_centroid) * k);
  if (plan.m < needed) {
    const std::string shortage =
        absl::StrCat("the window holds ", plan.m, " usable signatures, a fit of ", k, " centroids needs ", needed);
    if (plan.dropped == 0 || plan.kept_k == 0) {
      return RecordSkip(
          plan.added > 0 ? absl::StrCat("refit skipped: cannot give ", plan.added, " new worker(s) a zone: ", shortage)
                         : absl::StrCat("refit skipped: ", shortage),
          outcome);
    }
    // Too little data to refit, but workers left: drop their rows, so the nearest remaining zones
    // absorb their traffic. Workers without a row wait for a later refit.
    next.k = plan.kept_k;
    next.workers.resize(plan.kept_k);
    next.centroids = plan.kept_rows;
  } else {
    absl::StatusOr<std::vector<float>> rows = FitAligned(plan, &outcome);
    if (!rows.ok()) return RecordFailure(rows.status(), outcome);
    next.centroids = *std::move(rows);
    BoundMovement(plan, &next.centroids, &outcome);
    if (const std::optional<RefitRefusal> refused = GuardInstall(plan, &next.centroids, pool_change, &outcome)) {
      if (plan.dropped == 0 || plan.kept_k == 0) return RecordRefusal(*refused, outcome);
      // Workers left: the refused fit is not installed, but their rows still go (as when the
      // window is too small), so the nearest remaining zones absorb their traffic.
      NoteRefusal(*refused, &outcome);
      next.k = plan.kept_k;
      next.workers.resize(plan.kept_k);
      next.centroids = plan.kept_rows;
    }
  }

  // A reload (or another writer) replaced the centroids while we fitted: theirs win.
  if (external_installs_.load(std::memory_order_acquire) != plan.external_installs_before) {
    return RecordSkip("refit discarded: the centroids were replaced during the fit", outcome);
  }
  if (options_.may_refit && !options_.may_refit()) {
    return RecordSkip("refit discarded: this replica stopped being the cluster's refit leader during the fit", outcome);
  }
  absl::StatusOr<uint64_t> generation = router_->InstallCentroids(next, CentroidSource::kRefit);
  if (!generation.ok()) {
    return RecordFailure(absl::Status(generation.status().code(),
                                      absl::StrCat("refit: install failed: ", generation.status().message())),
                         outcome);
  }
  std::string persist_error;
  if (!options_.state_dir.empty()) {
    const absl::Status saved = SaveCentroidArtifact(next, StatePath(options_.state_dir));
    if (!saved.ok()) persist_error = absl::StrCat("refit installed, but persisting failed: ", saved.message());
  }
  outcome.kind = RefitOutcome::Kind::kInstalled;
  outcome.generation = *generation;
  capacities_at_install_ = SortedCapacities(plan, static_cast<size_t>(next.k));
  outcome.rows = next.k;
  outcome.seconds = SecondsSince(started);
  if (outcome.refusal != RefitRefusal::kNone) {
    outcome.reason = absl::StrCat(outcome.reason, "; only the rows of workers that left were dropped",
                                  persist_error.empty() ? "" : "; ", persist_error);
  } else {
    outcome.reason = persist_error;
  }
  {
    absl::MutexLock lock(&stats_mu_);
    ++stats_.refits_completed;
    PublishGuardFiguresLocked(outcome);
    if (outcome.refusal == RefitRefusal::kNone && outcome.movement_fraction < 1) ++stats_.refits_churn_limited;
    stats_.last_fit_seconds = outcome.seconds;
    stats_.centroid_generation = *generation;
    stats_.last_refit_time = now;
    stats_.last_error = persist_error;
    stats_.rows_step_bounded += outcome.rows_step_bounded;
    stats_.rows_drift_bounded += outcome.rows_drift_bounded;
    if (!persist_error.empty()) ++stats_.persist_failures;
  }
  if (options_.on_refit) options_.on_refit(outcome);
  return absl::OkStatus();
}

RefitStats OnlineRefitter::stats() const {
  RefitStats stats;
  {
    absl::MutexLock lock(&stats_mu_);
    stats = stats_;
  }
  absl::MutexLock lock(&window_mu_);
  stats.window_signatures = window_rows_;
  stats.window_bytes = WindowBytes();
  stats.window_capacity = static_cast<int64_t>(window_capacity_);
  stats.window_clients = active_clients_;
  stats.signatures_observed = observed_;
  stats.signatures_sampled_out = sampled_out_;
  stats.signatures_client_limited = client_limited_;
  stats.weights_output_tokens = weights_output_tokens_;
  stats.weights_hold_time = weights_hold_time_;
  stats.weights_default = weights_default_;
  stats.weights_unleased = weights_unleased_;
  stats.pending_dropped = pending_dropped_;
  stats.pending_signatures = static_cast<int64_t>(pending_.size());
  stats.pending_bytes = pending_bytes_;
  stats.window_weight = window_weight_;
  stats.decode_tokens_per_second =
      rate_seconds_ > 0 ? rate_tokens_ / rate_seconds_ : options_.default_tokens_per_second;
  return stats;
}

absl::string_view RefitRefusalLabel(RefitRefusal refusal) {
  switch (refusal) {
    case RefitRefusal::kNone:
      return "none";
    case RefitRefusal::kImbalance:
      return "imbalance";
    case RefitRefusal::kChurn:
      return "churn";
    case RefitRefusal::kLocality:
      return "locality";
  }
  return "none";
}

// ---- Persistence -------------------------------------------------------------------------------

std::string OnlineRefitter::StatePath(const std::string& state_dir) {
  return (std::filesystem::path(state_dir) / "centroids.json").string();
}

absl::StatusOr<StartupCentroids> OnlineRefitter::LoadStartupCentroids(const std::string& state_dir,
                                                                      const std::string& configured_path,
                                                                      const std::vector<std::string>& worker_ids) {
  std::optional<absl::StatusOr<CentroidArtifact>> configured;
  if (!configured_path.empty()) configured = LoadCentroidArtifact(configured_path);

  StartupCentroids chosen;
  if (!state_dir.empty()) {
    const std::string path = StatePath(state_dir);
    std::error_code error;
    if (std::filesystem::exists(path, error)) {
      absl::StatusOr<CentroidArtifact> state = LoadCentroidArtifact(path);
      if (!state.ok()) {
        chosen.note = absl::StrCat("state ", path, " not used: ", state.status().message());
      } else if (configured.has_value() && configured->ok() && !SameTransform(state->spec, (*configured)->spec)) {
        chosen.note = absl::StrCat("state ", path,
                                   " not used: its transform differs from the configured artifact's "
                                   "(a new calibration replaces what was learnt under the old one)");
      } else {
        // Keep the rows of workers that still exist.
        CentroidArtifact kept = *state;
        if (!worker_ids.empty() && !state->workers.empty()) {
          const absl::flat_hash_set<std::string> known(worker_ids.begin(), worker_ids.end());
          kept.centroids.clear();
          kept.workers.clear();
          for (int r = 0; r < state->k; ++r) {
            if (!known.contains(state->workers[r])) continue;
            kept.workers.push_back(state->workers[r]);
            const auto row = state->row(r);
            kept.centroids.insert(kept.centroids.end(), row.begin(), row.end());
          }
          kept.k = static_cast<int>(kept.workers.size());
        }
        if (kept.k > 0) {
          chosen.artifact = std::move(kept);
          chosen.from_state = true;
          return chosen;
        }
        chosen.note = absl::StrCat("state ", path, " not used: none of its workers is in the pool");
      }
    }
  }
  if (!configured.has_value()) {
    return absl::NotFoundError(chosen.note.empty()
                                   ? std::string("no centroids: neither a state nor an artifact is available")
                                   : absl::StrCat("no centroids: ", chosen.note));
  }
  if (!configured->ok()) return configured->status();
  chosen.artifact = **configured;
  return chosen;
}

}  // namespace eldr
