// Online refit and elastic pools (see include/eldr/refit/refit.h for the contract).
#include "eldr/refit/refit.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
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
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/centroid_index.h"

namespace eldr {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool PeriodicEnabled(absl::Duration interval) {
  return interval > absl::ZeroDuration() && interval != absl::InfiniteDuration();
}

// Same transform: a persisted state is only trusted for the calibration it was learnt under.
bool SameTransform(const SignatureSpec& a, const SignatureSpec& b) {
  if (a.layers != b.layers || a.experts != b.experts || a.variant != b.variant) return false;
  if (a.EffectiveMask() != b.EffectiveMask() || a.idf.size() != b.idf.size()) return false;
  for (size_t i = 0; i < a.idf.size(); ++i) {
    if (std::abs(a.idf[i] - b.idf[i]) > 1e-6f * std::max(1.0f, std::abs(a.idf[i]))) return false;
  }
  return true;
}

// Warm-start rows for workers that have none yet: split the clusters that would gain most. Each
// window point goes to its nearest kept centroid; the cluster with the largest total cosine
// distance (the most spread-out zone, whose split lowers the objective most) gives up its point
// farthest from the centre as the new worker's seed, then the next largest, and so on.
std::vector<float> SplitSeeds(const std::vector<float>& points, int m, const std::vector<float>& kept,
                              int kept_k, int dim, int added) {
  std::vector<float> seeds;
  std::vector<float> scores(static_cast<size_t>(m) * kept_k);
  ScoreAllPairs(points, m, kept, kept_k, dim, absl::MakeSpan(scores));
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
    } else {  // more new workers than splittable zones: the worst-served point left
      seed_point = -1;
      for (int i = 0; i < m; ++i) {
        if (!used_point[i] && (seed_point < 0 || point_distance[i] > point_distance[seed_point])) seed_point = i;
      }
    }
    used_point[seed_point] = 1;
    seeds.insert(seeds.end(), points.begin() + static_cast<size_t>(seed_point) * dim,
                 points.begin() + static_cast<size_t>(seed_point + 1) * dim);
  }
  return seeds;
}

}  // namespace

// ---- Construction and lifecycle ----------------------------------------------------------------

OnlineRefitter::OnlineRefitter(RefitOptions options, Router* router)
    : options_(std::move(options)), router_(router) {}

absl::StatusOr<std::unique_ptr<OnlineRefitter>> OnlineRefitter::Create(RefitOptions options,
                                                                       Router* router) {
  if (router == nullptr) return absl::InvalidArgumentError("refit: router must not be null");
  if (options.window <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: window must be positive, got ", absl::FormatDuration(options.window)));
  }
  if (options.interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refit: interval must not be negative, got ", absl::FormatDuration(options.interval)));
  }
  if (options.max_window_signatures < 1) {
    return absl::InvalidArgumentError(absl::StrCat("refit: max_window_signatures = ",
                                                   options.max_window_signatures, ", need >= 1"));
  }
  if (options.min_signatures_per_centroid < 1) {
    return absl::InvalidArgumentError(absl::StrCat("refit: min_signatures_per_centroid = ",
                                                   options.min_signatures_per_centroid, ", need >= 1"));
  }
  if (options.max_iterations < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("refit: max_iterations = ", options.max_iterations, ", need >= 1"));
  }
  if (!(options.tolerance >= 0) || !std::isfinite(options.tolerance)) {
    return absl::InvalidArgumentError(absl::StrCat("refit: tolerance = ", options.tolerance, ", need >= 0"));
  }
  if (!options.state_dir.empty()) {
    std::error_code error;
    std::filesystem::create_directories(options.state_dir, error);
    if (error) {
      return absl::InvalidArgumentError(absl::StrCat("refit: cannot create state folder ",
                                                     options.state_dir, ": ", error.message()));
    }
  }
  return std::unique_ptr<OnlineRefitter>(new OnlineRefitter(std::move(options), router));
}

OnlineRefitter::~OnlineRefitter() { Stop(); }

void OnlineRefitter::Start() {
  if (!PeriodicEnabled(options_.interval)) return;
  absl::MutexLock lifecycle(&lifecycle_mu_);
  if (thread_.joinable()) return;
  {
    absl::MutexLock lock(&thread_mu_);
    stopping_ = false;
  }
  thread_ = std::thread([this] { RunPeriodic(); });
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

void OnlineRefitter::RunPeriodic() {
  // Fits yield the CPU to routing. On Linux a thread has its own scheduling policy and nice value:
  // SCHED_IDLE runs the fit only on CPU time routing leaves over, so a fit on a saturated core
  // takes longer instead of delaying routes. Best effort (an unprivileged thread may always lower
  // its priority); nice 19 is the fallback where SCHED_IDLE is refused.
  const sched_param idle_param{};
  if (sched_setscheduler(0, SCHED_IDLE, &idle_param) != 0) {
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
  }
  thread_mu_.Lock();
  while (!stopping_) {
    const absl::Time deadline = absl::Now() + options_.interval;
    while (!stopping_ && absl::Now() < deadline) thread_cv_.WaitWithDeadline(&thread_mu_, deadline);
    if (stopping_) break;
    thread_mu_.Unlock();
    // The outcome is in the stats; a periodic refit has nobody to return it to.
    Refit().IgnoreError();
    thread_mu_.Lock();
  }
  thread_mu_.Unlock();
}

// ---- Window ------------------------------------------------------------------------------------

void OnlineRefitter::Observe(absl::Span<const float> signature, const std::string& /*worker*/) {
  if (signature.empty()) return;
  const int dim = static_cast<int>(signature.size());
  const absl::Time now = Now();
  std::vector<std::shared_ptr<Chunk>> evicted;  // freed after the lock is released
  absl::MutexLock lock(&window_mu_);
  ++observed_;
  if (dim != window_dim_) {  // a different transform is in service: the old rows are useless
    evicted.swap(chunks_);
    spare_chunk_.reset();
    window_rows_ = 0;
    window_dim_ = dim;
  }
  const double capacity = options_.max_window_signatures;
  if (admission_tokens_ < 0) {
    admission_tokens_ = capacity;
  } else if (now > admission_refilled_at_) {
    const double refill = capacity * absl::FDivDuration(now - admission_refilled_at_, options_.window);
    admission_tokens_ = std::min(capacity, admission_tokens_ + refill);
  }
  admission_refilled_at_ = now;
  if (admission_tokens_ < 1) {
    ++sampled_out_;
    return;
  }
  admission_tokens_ -= 1;
  if (chunks_.empty() || chunks_.back()->count == kChunkRows) {
    std::shared_ptr<Chunk> chunk;
    // A snapshot may still read an evicted chunk; it is reused only once the window holds the
    // last reference.
    if (spare_chunk_ != nullptr && spare_chunk_.use_count() == 1) {
      chunk = std::move(spare_chunk_);
      chunk->count = 0;
      chunk->times.clear();
    } else {
      chunk = std::make_shared<Chunk>();
      chunk->rows.resize(static_cast<size_t>(kChunkRows) * dim);
      chunk->times.reserve(kChunkRows);
    }
    spare_chunk_.reset();
    chunks_.push_back(std::move(chunk));
  }
  Chunk& chunk = *chunks_.back();
  std::copy(signature.begin(), signature.end(), chunk.rows.begin() + static_cast<size_t>(chunk.count) * dim);
  chunk.times.push_back(now);
  ++chunk.count;
  ++window_rows_;
  // Drop whole chunks that are too old or beyond the size bound (kept: at most one chunk more).
  const absl::Time oldest_kept = now - options_.window;
  size_t drop = 0;
  while (drop + 1 < chunks_.size()) {
    const Chunk& front = *chunks_[drop];
    const bool too_many = window_rows_ - front.count >= options_.max_window_signatures;
    const bool too_old = front.times.back() < oldest_kept;
    if (!too_many && !too_old) break;
    window_rows_ -= front.count;
    ++drop;
  }
  if (drop > 0) {
    spare_chunk_ = chunks_[drop - 1];
    evicted.insert(evicted.end(), chunks_.begin(), chunks_.begin() + drop - 1);
    chunks_.erase(chunks_.begin(), chunks_.begin() + drop);
  }
}

void OnlineRefitter::ResetWindow() {
  std::vector<std::shared_ptr<Chunk>> evicted;
  absl::MutexLock lock(&window_mu_);
  evicted.swap(chunks_);
  window_rows_ = 0;
}

int OnlineRefitter::SnapshotWindow(absl::Time now, std::vector<float>* points, int* dim) {
  std::vector<std::shared_ptr<Chunk>> full;  // immutable: read outside the lock
  std::vector<float> tail_rows;              // the chunk still being written: copied under it
  std::vector<absl::Time> tail_times;
  {
    absl::MutexLock lock(&window_mu_);
    *dim = window_dim_;
    for (const auto& chunk : chunks_) {
      if (chunk->count == kChunkRows) {
        full.push_back(chunk);
      } else {
        tail_rows.assign(chunk->rows.begin(), chunk->rows.begin() + static_cast<size_t>(chunk->count) * window_dim_);
        tail_times = chunk->times;
      }
    }
  }
  const int d = *dim;
  const absl::Time oldest_kept = now - options_.window;
  // Rows in time order: full chunks, then the tail. Keep the newest max_window_signatures that are
  // young enough.
  std::vector<std::pair<const float*, absl::Time>> rows;
  for (const auto& chunk : full) {
    for (int r = 0; r < chunk->count; ++r) rows.emplace_back(chunk->rows.data() + static_cast<size_t>(r) * d, chunk->times[r]);
  }
  for (size_t r = 0; r < tail_times.size(); ++r) rows.emplace_back(tail_rows.data() + r * d, tail_times[r]);
  size_t first = 0;
  while (first < rows.size() && rows[first].second < oldest_kept) ++first;
  first = std::max(first, rows.size() > static_cast<size_t>(options_.max_window_signatures)
                              ? rows.size() - options_.max_window_signatures
                              : size_t{0});
  const int m = static_cast<int>(rows.size() - first);
  points->resize(static_cast<size_t>(m) * d);
  for (int i = 0; i < m; ++i) std::copy_n(rows[first + i].first, d, points->data() + static_cast<size_t>(i) * d);
  return m;
}

// ---- Refit -------------------------------------------------------------------------------------

absl::Status OnlineRefitter::RecordFailure(const absl::Status& status) {
  absl::MutexLock lock(&stats_mu_);
  ++stats_.refits_failed;
  stats_.last_error = std::string(status.message());
  return status;
}

absl::Status OnlineRefitter::RecordSkip(const std::string& why) {
  absl::MutexLock lock(&stats_mu_);
  ++stats_.refits_skipped;
  stats_.last_error = why;
  return absl::OkStatus();
}

absl::Status OnlineRefitter::Refit() {
  absl::MutexLock lock(&fit_mu_);
  return RefitLocked();
}

absl::Status OnlineRefitter::RefitNow() { return Refit(); }

absl::Status OnlineRefitter::OnWorkerAdded(const std::string& worker_id) {
  absl::MutexLock lock(&fit_mu_);
  const RouterState state = router_->GetState(Now());
  const auto it = std::find_if(state.workers.begin(), state.workers.end(),
                               [&](const WorkerStatus& w) { return w.spec.id == worker_id; });
  if (it == state.workers.end() || it->state != WorkerState::kActive) {
    return absl::FailedPreconditionError(absl::StrCat(
        "refit: worker '", worker_id, "' is ", it == state.workers.end() ? "unknown" : "draining",
        " to the router; upsert it first"));
  }
  if (absl::Status refit = RefitLocked(); !refit.ok()) return refit;
  absl::StatusOr<CentroidArtifact> current = router_->CurrentCentroids();
  if (current.ok() && std::find(current->workers.begin(), current->workers.end(), worker_id) !=
                          current->workers.end()) {
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
      return absl::FailedPreconditionError(absl::StrCat(
          "refit: worker '", worker_id, "' is still active; drain or remove it from the router first"));
    }
  }
  return RefitLocked();
}

absl::Status OnlineRefitter::RefitLocked() {
  const auto started = std::chrono::steady_clock::now();
  {
    absl::MutexLock lock(&stats_mu_);
    ++stats_.refits_started;
  }
  const absl::Time now = Now();
  const RouterState state = router_->GetState(now);
  const uint64_t generation_before = state.centroid_generation;
  absl::StatusOr<CentroidArtifact> current = router_->CurrentCentroids();
  if (!current.ok()) return RecordSkip("refit skipped: no centroids are installed yet");
  const int dim = current->dim();

  // Target rows: the kept workers (active, with a row) in their row order, then the active workers
  // that have no row yet, in router order.
  absl::flat_hash_map<std::string, double> active_capacity;
  for (const WorkerStatus& w : state.workers) {
    if (w.state == WorkerState::kActive) active_capacity[w.spec.id] = w.spec.capacity;
  }
  std::vector<std::string> target;
  std::vector<float> kept_rows;
  absl::flat_hash_set<std::string> has_row;
  for (int r = 0; r < current->k; ++r) {
    const std::string& id = current->workers[r];
    has_row.insert(id);
    if (!active_capacity.contains(id)) continue;
    target.push_back(id);
    const auto row = current->row(r);
    kept_rows.insert(kept_rows.end(), row.begin(), row.end());
  }
  const int kept_k = static_cast<int>(target.size());
  for (const WorkerStatus& w : state.workers) {
    if (w.state == WorkerState::kActive && !has_row.contains(w.spec.id)) target.push_back(w.spec.id);
  }
  const int k = static_cast<int>(target.size());
  const int added = k - kept_k;
  const int dropped = current->k - kept_k;
  if (k == 0) return RecordSkip("refit skipped: no active workers");

  std::vector<float> points;
  int window_dim = 0;
  int m = SnapshotWindow(now, &points, &window_dim);
  if (m > 0 && window_dim != dim) {
    m = 0;  // signatures of another transform: unusable for these centroids
    points.clear();
  }
  const int64_t needed = std::max<int64_t>(k, static_cast<int64_t>(options_.min_signatures_per_centroid) * k);

  CentroidArtifact next;
  next.spec = current->spec;
  next.model = current->model;
  next.seed = current->seed;
  next.k = k;
  next.workers = target;
  if (m < needed) {
    const std::string shortage = absl::StrCat("the window holds ", m, " usable signatures, a fit of ", k,
                                              " centroids needs ", needed);
    if (dropped == 0 || kept_k == 0) {
      return RecordSkip(added > 0 ? absl::StrCat("refit skipped: cannot give ", added,
                                                 " new worker(s) a zone: ", shortage)
                                  : absl::StrCat("refit skipped: ", shortage));
    }
    // Too little data to refit, but workers left: drop their rows, so the nearest remaining zones
    // absorb their traffic. Workers without a row wait for a later refit.
    next.k = kept_k;
    next.workers.resize(kept_k);
    next.centroids = std::move(kept_rows);
  } else {
    BalancedKMeansOptions fit_options;
    fit_options.clusters = k;
    fit_options.seed = options_.seed;
    fit_options.max_iterations = options_.max_iterations;
    fit_options.tolerance = options_.tolerance;
    for (const std::string& id : target) fit_options.capacity_weights.push_back(active_capacity[id]);
    if (kept_k > 0) {
      fit_options.initial_centroids = kept_rows;
      if (added > 0) {
        const std::vector<float> seeds = SplitSeeds(points, m, kept_rows, kept_k, dim, added);
        fit_options.initial_centroids.insert(fit_options.initial_centroids.end(), seeds.begin(), seeds.end());
      }
    }
    absl::StatusOr<BalancedKMeansResult> fit = FitBalancedKMeans(points, m, dim, fit_options);
    if (!fit.ok()) return RecordFailure(absl::Status(fit.status().code(), absl::StrCat("refit: ", fit.status().message())));
    // Align the fitted rows to the warm start's identities (kept workers' old rows and the new
    // workers' seeds), so each worker keeps the zone nearest its old one.
    std::vector<int> row_of_target(k);
    if (kept_k > 0) {
      row_of_target = AlignCentroids(fit_options.initial_centroids, fit->centroids, k, dim);
      if (row_of_target.size() != static_cast<size_t>(k)) {
        return RecordFailure(absl::InternalError("refit: centroid alignment failed"));
      }
    } else {
      for (int t = 0; t < k; ++t) row_of_target[t] = t;
    }
    next.centroids.resize(static_cast<size_t>(k) * dim);
    for (int t = 0; t < k; ++t) {
      std::copy_n(fit->centroids.begin() + static_cast<size_t>(row_of_target[t]) * dim, dim,
                  next.centroids.begin() + static_cast<size_t>(t) * dim);
    }
  }

  // A reload (or another writer) replaced the centroids while we fitted: theirs win.
  if (router_->GetState(Now()).centroid_generation != generation_before) {
    return RecordSkip("refit discarded: the centroids were replaced during the fit");
  }
  if (absl::Status installed = router_->InstallCentroids(next); !installed.ok()) {
    return RecordFailure(absl::Status(installed.code(), absl::StrCat("refit: install failed: ", installed.message())));
  }
  const uint64_t generation_after = router_->GetState(Now()).centroid_generation;

  std::string persist_error;
  if (!options_.state_dir.empty()) {
    const absl::Status saved = SaveCentroidArtifact(next, StatePath(options_.state_dir));
    if (!saved.ok()) persist_error = absl::StrCat("refit installed, but persisting failed: ", saved.message());
  }
  absl::MutexLock lock(&stats_mu_);
  ++stats_.refits_completed;
  stats_.last_fit_seconds = SecondsSince(started);
  stats_.centroid_generation = generation_after;
  stats_.last_refit_time = now;
  stats_.last_error = persist_error;
  if (!persist_error.empty()) ++stats_.persist_failures;
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
  stats.signatures_observed = observed_;
  stats.signatures_sampled_out = sampled_out_;
  return stats;
}

// ---- Persistence -------------------------------------------------------------------------------

std::string OnlineRefitter::StatePath(const std::string& state_dir) {
  return (std::filesystem::path(state_dir) / "centroids.json").string();
}

absl::StatusOr<StartupCentroids> OnlineRefitter::LoadStartupCentroids(
    const std::string& state_dir, const std::string& configured_path,
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
      } else if (configured.has_value() && configured->ok() &&
                 !SameTransform(state->spec, (*configured)->spec)) {
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

// ---- Observer slot -----------------------------------------------------------------------------

RefitObserverSlot::RefitObserverSlot() : shared_(std::make_shared<Shared>()) {}

std::function<void(absl::Span<const float>, const std::string&)> RefitObserverSlot::Callback() const {
  std::shared_ptr<Shared> shared = shared_;
  return [shared](absl::Span<const float> signature, const std::string& worker) {
    absl::ReaderMutexLock lock(&shared->mu);
    if (shared->refitter != nullptr) shared->refitter->Observe(signature, worker);
  };
}

void RefitObserverSlot::Attach(OnlineRefitter* refitter) {
  absl::MutexLock lock(&shared_->mu);
  shared_->refitter = refitter;
}

}  // namespace eldr
