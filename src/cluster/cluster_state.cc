#include "eldr/cluster/cluster_state.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace eldr::cluster {
namespace {

constexpr absl::Duration kSubscriberSlice = absl::Milliseconds(100);

bool IsClientNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
         c == '.' || c == ':' || c == '@' || c == '/' || c == '+';
}

// The options with their zero defaults resolved.
ClusterOptions Resolve(ClusterOptions options) {
  if (options.renew_interval == absl::ZeroDuration()) options.renew_interval = options.leader_lease / 3;
  if (options.load_ttl == absl::ZeroDuration()) {
    options.load_ttl = std::max(options.load_interval * 10, absl::Seconds(1));
  }
  if (options.redis.client_name.empty()) {
    std::string name = absl::StrCat("eldr-router:", options.replica_id);
    if (std::all_of(name.begin(), name.end(), IsClientNameChar)) options.redis.client_name = std::move(name);
  }
  return options;
}

}  // namespace

absl::string_view ClusterRoleLabel(ClusterRole role) { return role == ClusterRole::kLeader ? "leader" : "follower"; }

absl::Status ValidateClusterOptions(const ClusterOptions& options) {
  if (absl::Status s = ValidateRedisConnectionOptions(options.redis); !s.ok()) return s;
  if (absl::Status s = ValidateClusterName(options.cluster_name); !s.ok()) return s;
  if (absl::Status s = ValidateReplicaId(options.replica_id); !s.ok()) return s;
  if (options.leader_lease < absl::Milliseconds(10)) return absl::InvalidArgumentError("leader_lease below 10ms");
  if (options.renew_interval < absl::ZeroDuration() || options.renew_interval >= options.leader_lease) {
    return absl::InvalidArgumentError("renew_interval must be in [0, leader_lease)");
  }
  if (options.centroid_check_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("centroid_check_interval must be positive");
  }
  if (options.load_interval <= absl::ZeroDuration())
    return absl::InvalidArgumentError("load_interval must be positive");
  if (options.load_ttl < absl::ZeroDuration() ||
      (options.load_ttl > absl::ZeroDuration() && options.load_ttl <= options.load_interval)) {
    return absl::InvalidArgumentError("load_ttl must be 0 (default) or longer than load_interval");
  }
  if (options.window_max_entries < 1 || options.max_pending_signatures < 0 || options.window_read_batch < 1) {
    return absl::InvalidArgumentError("window sizes: window_max_entries and window_read_batch >= 1, pending >= 0");
  }
  if (options.tick <= absl::ZeroDuration()) return absl::InvalidArgumentError("tick must be positive");
  return absl::OkStatus();
}

class ClusterState::Impl {
 public:
  using LeaseCount = ClusterState::LeaseCount;

  Impl(ClusterOptions options, std::unique_ptr<RedisConnection> control, std::unique_ptr<RedisConnection> subscriber)
      : options_(std::move(options)),
        keys_(options_.cluster_name),
        control_conn_(std::move(control)),
        sub_conn_(std::move(subscriber)),
        store_(control_conn_.get(), keys_) {}

  ~Impl() { Stop(true); }

  absl::Status Start() {
    absl::MutexLock lifecycle(&lifecycle_mu_);
    if (control_thread_.joinable()) return absl::FailedPreconditionError("the cluster state is already started");
    {
      absl::MutexLock lock(&mu_);
      stopping_ = false;
      status_.started = true;
    }
    stop_requested_.store(false);
    control_thread_ = std::thread([this] { RunControl(); });
    sub_thread_ = std::thread([this] { RunSubscriber(); });
    return absl::OkStatus();
  }

  void Stop(bool cleanup) {
    absl::MutexLock lifecycle(&lifecycle_mu_);
    if (!control_thread_.joinable()) return;
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      cleanup_on_stop_ = cleanup;
    }
    stop_requested_.store(true);
    sub_thread_.join();
    control_thread_.join();
    control_conn_->Disconnect();
    sub_conn_->Disconnect();
    absl::MutexLock lock(&mu_);
    status_.started = false;
  }

  absl::Status Publish(const CentroidArtifact& artifact, uint64_t fencing_generation) {
    if (absl::Status valid = ValidateCentroidArtifact(artifact); !valid.ok()) return valid;
    {
      absl::MutexLock lock(&mu_);
      if (status_.role != ClusterRole::kLeader) {
        return absl::FailedPreconditionError("publish: this replica is not the refit leader");
      }
      if (fencing_generation != status_.fencing_generation) {
        return absl::FailedPreconditionError(absl::StrCat("publish: fencing generation ", fencing_generation,
                                                          " is not this leader's (", status_.fencing_generation, ")"));
      }
    }
    auto copy = std::make_unique<CentroidArtifact>(artifact);  // outside the lock
    absl::MutexLock lock(&mu_);
    if (pending_publish_ != nullptr) ++status_.publishes_coalesced;
    pending_publish_ = std::move(copy);
    pending_fence_ = fencing_generation;
    wake_ = true;
    return absl::OkStatus();
  }

  void AppendSignatures(absl::Span<const WindowSignature> entries) {
    if (entries.empty()) return;
    size_t room;
    {
      absl::MutexLock lock(&mu_);
      room = static_cast<size_t>(options_.max_pending_signatures) -
             std::min(pending_signatures_.size(), static_cast<size_t>(options_.max_pending_signatures));
    }
    const size_t take = std::min(room, entries.size());
    std::vector<WindowSignature> copies(entries.begin(), entries.begin() + take);  // outside the lock
    absl::MutexLock lock(&mu_);
    status_.window_dropped += entries.size() - take;
    for (WindowSignature& entry : copies) {
      if (pending_signatures_.size() >= static_cast<size_t>(options_.max_pending_signatures)) {
        ++status_.window_dropped;
        continue;
      }
      pending_signatures_.push_back(std::move(entry));
    }
  }

  std::map<std::string, int64_t> OthersLeases() const {
    std::map<std::string, int64_t> live;
    absl::MutexLock lock(&mu_);
    for (const auto& [worker, count] : others_) live.emplace_hint(live.end(), worker, count.live);
    return live;
  }

  std::map<std::string, LeaseCount> OthersLeaseCounts() const {
    absl::MutexLock lock(&mu_);
    return others_;
  }

  std::vector<PeerLoad> PeerLoads() const {
    absl::MutexLock lock(&mu_);
    return peers_;
  }

  int PeerCount() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(peers_.size());
  }

  ClusterRole role() const {
    absl::MutexLock lock(&mu_);
    return status_.role;
  }

  ClusterStatus status() const {
    ClusterStatus status;
    {
      absl::MutexLock lock(&mu_);
      status = status_;
    }
    for (const RedisConnection* conn : {control_conn_.get(), sub_conn_.get()}) {
      const RedisConnectionStats stats = conn->Stats();
      for (int i = 0; i < kRedisErrorKinds; ++i) status.redis_errors[i] += stats.errors[i];
      status.noscript_fallbacks += stats.noscript_fallbacks;
      status.reconnects += std::max<int64_t>(0, stats.connects - 1);
    }
    return status;
  }

  const ClusterOptions& options() const { return options_; }

  void PauseForTesting(bool paused) {
    absl::MutexLock lock(&mu_);
    paused_ = paused;
    wake_ = true;
  }

 private:
  // ---- Helpers ----------------------------------------------------------------------------------
  void Log(ClusterLogSeverity severity, const std::string& message) {
    if (options_.log)
      options_.log(severity,
                   absl::StrCat("cluster ", options_.cluster_name, " replica ", options_.replica_id, ": ", message));
  }

  // Records the outcome of one exchange with Redis; logs the transitions between working and not.
  template <typename T>
  bool Check(const absl::StatusOr<T>& result) {
    return Check(result.status());
  }
  bool Check(const absl::Status& status) {
    bool was_ok;
    {
      absl::MutexLock lock(&mu_);
      was_ok = status_.redis_ok;
      if (status.ok()) {
        status_.redis_ok = true;
        status_.last_ok = absl::Now();
      } else {
        status_.redis_ok = false;
        status_.last_error = std::string(status.message());
      }
    }
    if (status.ok() && !was_ok) {
      Log(ClusterLogSeverity::kInfo, "redis reachable");
    } else if (!status.ok() && (was_ok || !logged_first_error_)) {
      logged_first_error_ = true;
      Log(ClusterLogSeverity::kWarning, absl::StrCat("redis error (keeping the last state): ", status.message()));
    }
    return status.ok();
  }

  void SetRole(ClusterRole role, const std::string& why) {
    {
      absl::MutexLock lock(&mu_);
      status_.role = role;
      status_.fencing_generation = role == ClusterRole::kLeader ? fence_ : max_fence_seen_;
      if (role == ClusterRole::kLeader) {
        status_.leader_id = options_.replica_id;
        ++status_.leader_acquisitions;
      } else if (status_.leader_id == options_.replica_id) {
        status_.leader_id.clear();
      }
    }
    Log(role == ClusterRole::kLeader ? ClusterLogSeverity::kInfo : ClusterLogSeverity::kWarning,
        absl::StrCat(role == ClusterRole::kLeader ? "became leader" : "now follower", " (fencing generation ",
                     role == ClusterRole::kLeader ? fence_ : max_fence_seen_, "): ", why));
    if (options_.on_role_change) options_.on_role_change(role, role == ClusterRole::kLeader ? fence_ : max_fence_seen_);
  }

  void SeeFence(uint64_t fence, const std::string& holder) {
    max_fence_seen_ = std::max(max_fence_seen_, fence);
    absl::MutexLock lock(&mu_);
    if (!leader_) {
      status_.fencing_generation = max_fence_seen_;
      status_.leader_id = holder;
    }
  }

  void SeeGeneration(uint64_t generation) { max_generation_seen_ = std::max(max_generation_seen_, generation); }

  bool StopRequested() const { return stop_requested_.load(std::memory_order_relaxed); }

  // ---- The control thread ---------------------------------------------------------------------
  void RunControl() {
    const absl::Time start = absl::Now();
    next_leadership_ = next_load_ = next_check_ = start;
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        const absl::Time now = absl::Now();
        const absl::Time deadline = paused_ ? now + options_.tick : std::min(NextDue(), now + options_.tick);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || wake_; };
        mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
        if (stopping_) break;
        wake_ = false;
        if (paused_) continue;
        if (announced_generation_ > installed_ || check_now_requested_) check_now_ = true;
        check_now_requested_ = false;
        if (leader_released_ && !leader_) next_leadership_ = absl::Now();
        leader_released_ = false;
      }
      Round();
    }
    bool cleanup;
    {
      absl::MutexLock lock(&mu_);
      cleanup = cleanup_on_stop_;
    }
    if (cleanup) Cleanup();
  }

  absl::Time NextDue() const {
    absl::Time due = std::min(next_load_, next_check_);
    if (leader_) {
      due = std::min({due, next_leadership_, lease_deadline_});
    } else if (options_.leader_eligible) {
      due = std::min(due, next_leadership_);
    }
    return due;
  }

  void Round() {
    // A publication first: a leader that was paused past its lease and resumes tries what it had
    // queued, and the fencing script (not this replica's view of itself) refuses it.
    DoPublish();
    if (StopRequested()) return;
    Leadership();
    if (StopRequested()) return;
    absl::Time now = absl::Now();
    if (now >= next_load_) {
      next_load_ = now + options_.load_interval;
      ShareLoad();
      if (StopRequested()) return;
      FlushWindow();
      if (StopRequested()) return;
      if (leader_) TailWindow();
    }
    if (StopRequested()) return;
    now = absl::Now();
    if (check_now_ || now >= next_check_) {
      const bool periodic = now >= next_check_;
      if (periodic) next_check_ = now + options_.centroid_check_interval;
      check_now_ = false;
      CheckCentroids(periodic);
    }
  }

  void Leadership() {
    const absl::Time now = absl::Now();
    if (leader_) {
      if (now >= lease_deadline_) {
        leader_ = false;
        SetRole(ClusterRole::kFollower, "the lease ran out before a renewal succeeded");
        next_leadership_ = now;
        return;
      }
      if (now < next_leadership_) return;
      const absl::Time sent = absl::Now();
      absl::StatusOr<bool> renewed = store_.RenewLeader(options_.replica_id, fence_, options_.leader_lease);
      if (!Check(renewed)) {
        next_leadership_ = absl::Now() + options_.tick;
        return;
      }
      if (!*renewed) {
        leader_ = false;
        SetRole(ClusterRole::kFollower, "the lease is no longer ours (expired or taken over)");
        next_leadership_ = absl::Now();
        return;
      }
      lease_deadline_ = sent + options_.leader_lease;
      next_leadership_ = sent + options_.renew_interval;
      return;
    }
    if (!options_.leader_eligible || now < next_leadership_) return;
    const absl::Time sent = absl::Now();
    absl::StatusOr<LeaderAcquisition> attempt =
        store_.TryAcquireLeader(options_.replica_id, options_.leader_lease, max_fence_seen_);
    if (!Check(attempt)) {
      next_leadership_ = absl::Now() + options_.tick;
      return;
    }
    if (!attempt->acquired) {
      SeeFence(attempt->fence, attempt->holder);
      // Try again right after the holder's lease should have run out, and at least every renewal
      // period (the holder may have died just after renewing).
      const absl::Duration wait = std::min(options_.renew_interval, attempt->remaining + absl::Milliseconds(5));
      next_leadership_ = sent + wait;
      return;
    }
    leader_ = true;
    fence_ = attempt->fence;
    max_fence_seen_ = std::max(max_fence_seen_, fence_);
    lease_deadline_ = sent + options_.leader_lease;
    next_leadership_ = sent + options_.renew_interval;
    window_cursor_ = "0-0";  // the new leader reads the whole retained window
    peers_read_since_acquired_ = false;
    check_now_ = true;  // and makes sure Redis holds the newest set
    SetRole(ClusterRole::kLeader, "acquired the leader lease");
  }

  void DoPublish() {
    std::unique_ptr<CentroidArtifact> artifact;
    uint64_t fence;
    {
      absl::MutexLock lock(&mu_);
      if (pending_publish_ == nullptr) return;
      artifact = std::move(pending_publish_);
      fence = pending_fence_;
    }
    if (!leader_ || fence != fence_) {
      // Queued before this replica stepped down.
      absl::MutexLock lock(&mu_);
      ++status_.publishes_fenced;
      return;
    }
    absl::StatusOr<std::string> encoded = EncodeCentroidArtifact(*artifact);
    if (!encoded.ok()) {
      Log(ClusterLogSeverity::kError, absl::StrCat("cannot encode the centroid set: ", encoded.status().message()));
      absl::MutexLock lock(&mu_);
      ++status_.publish_failures;
      return;
    }
    if (!StoreCentroids(*std::move(encoded), /*republish=*/false)) {
      absl::MutexLock lock(&mu_);
      if (pending_publish_ == nullptr && leader_) {  // retry unless a newer one is queued
        pending_publish_ = std::move(artifact);
        pending_fence_ = fence;
      }
    }
  }

  // Publishes `data` under this leader's fence. False on a Redis error (worth retrying).
  bool StoreCentroids(std::string data, bool republish) {
    absl::StatusOr<PublishResult> result =
        store_.PublishCentroids(data, fence_, max_generation_seen_, options_.replica_id);
    if (!Check(result)) {
      absl::MutexLock lock(&mu_);
      ++status_.publish_failures;
      return false;
    }
    if (result->fenced) {
      {
        absl::MutexLock lock(&mu_);
        ++status_.publishes_fenced;
      }
      Log(ClusterLogSeverity::kWarning, absl::StrCat("publication refused: fencing generation ", fence_,
                                                     " is stale (current ", result->current_fence, ")"));
      max_fence_seen_ = std::max(max_fence_seen_, result->current_fence);
      if (leader_) {
        leader_ = false;
        SetRole(ClusterRole::kFollower, "a publication was fenced");
        next_leadership_ = absl::Now();
      }
      return true;
    }
    current_data_ = std::move(data);
    installed_ = result->generation;
    SeeGeneration(installed_);
    {
      absl::MutexLock lock(&mu_);
      ++status_.publishes;
      if (republish) ++status_.republishes;
      status_.published_generation = installed_;
      status_.installed_generation = installed_;
    }
    Log(ClusterLogSeverity::kInfo, absl::StrCat(republish ? "re-published" : "published", " centroid generation ",
                                                installed_, " (fencing generation ", fence_, ")"));
    return true;
  }

  void CheckCentroids(bool periodic) {
    absl::StatusOr<LeaderInfo> leader = store_.ReadLeader();
    if (!Check(leader)) return;
    SeeFence(leader->fence, leader->holder);
    absl::StatusOr<ClusterStore::Generations> generations = store_.ReadGenerations();
    if (!Check(generations)) return;
    absl::StatusOr<int64_t> window = store_.WindowLength();
    if (Check(window)) {
      absl::MutexLock lock(&mu_);
      status_.window_length = *window;
    }
    {
      absl::MutexLock lock(&mu_);
      status_.published_generation = generations->stored;
    }
    if (generations->stored > installed_) Install(generations->stored, periodic);
    SeeGeneration(generations->counter);
    SeeGeneration(generations->stored);
    if (StopRequested()) return;
    if (!leader_) {
      // Redis knows less than this replica serves (it restarted empty): raise the counter, so the
      // leader's next publication is one this replica installs instead of refusing as older.
      if (generations->counter < installed_) Check(store_.RaiseGenerationFloor(installed_));
      return;
    }
    // The leader makes sure Redis holds the newest set: after a restart that lost it (or before
    // anything was ever published) it publishes its own above every generation seen, its peers'
    // included, which is why it waits for one read of their load hashes after taking over.
    if (!peers_read_since_acquired_) return;
    const uint64_t target = std::max(generations->counter, max_generation_seen_);
    if (generations->stored != 0 && generations->stored >= target) return;
    if (!current_data_.empty()) {
      StoreCentroids(current_data_, /*republish=*/true);
      return;
    }
    if (generations->stored == 0 && options_.local_centroids) {
      absl::StatusOr<CentroidArtifact> local = options_.local_centroids();
      if (!local.ok()) return;  // nothing in service yet
      absl::StatusOr<std::string> encoded = EncodeCentroidArtifact(*local);
      if (!encoded.ok()) {
        Log(ClusterLogSeverity::kError,
            absl::StrCat("cannot encode the local centroids: ", encoded.status().message()));
        return;
      }
      StoreCentroids(*std::move(encoded), /*republish=*/false);
    }
  }

  void Install(uint64_t generation, bool periodic) {
    if (generation == failed_generation_ && (failed_corrupt_ || !periodic)) return;
    absl::StatusOr<std::optional<StoredCentroids>> stored = store_.FetchCentroids();
    if (!Check(stored)) return;
    if (!stored->has_value() || (*stored)->generation <= installed_) return;
    const uint64_t fetched = (*stored)->generation;
    absl::StatusOr<CentroidArtifact> artifact = DecodeCentroidArtifact((*stored)->data);
    if (!artifact.ok()) {
      failed_generation_ = fetched;
      failed_corrupt_ = true;
      {
        absl::MutexLock lock(&mu_);
        ++status_.corrupt_sets;
      }
      Log(ClusterLogSeverity::kError,
          absl::StrCat("centroid generation ", fetched, " refused: ", artifact.status().message()));
      return;
    }
    if (options_.on_centroids) {
      absl::Status installed = options_.on_centroids(*artifact, fetched);
      if (!installed.ok()) {
        failed_generation_ = fetched;
        failed_corrupt_ = false;
        {
          absl::MutexLock lock(&mu_);
          ++status_.install_failures;
        }
        Log(ClusterLogSeverity::kError,
            absl::StrCat("centroid generation ", fetched, " not installed: ", installed.message()));
        return;
      }
    }
    installed_ = fetched;
    current_data_ = std::move((*stored)->data);
    SeeGeneration(fetched);
    absl::MutexLock lock(&mu_);
    ++status_.installs;
    status_.installed_generation = fetched;
    status_.published_generation = std::max(status_.published_generation, fetched);
  }

  void ShareLoad() {
    ReplicaLoad load;
    if (options_.local_leases) load.workers = options_.local_leases();
    load.installed_generation = installed_;
    load.leader = leader_;
    absl::StatusOr<absl::Time> server_now =
        store_.PublishLoad(options_.replica_id, load, options_.load_ttl, options_.load_ttl * 10);
    absl::StatusOr<std::vector<PeerLoad>> loads;
    if (Check(server_now)) {
      loads = store_.ReadLoads();
      Check(loads);
    }
    if (!server_now.ok() || !loads.ok()) {
      // Without Redis the others' leases age like their hashes would: after load_ttl this replica
      // counts its own leases only (it cannot tell whether the others are still alive).
      if (absl::Now() - last_load_read_ > options_.load_ttl) {
        absl::MutexLock lock(&mu_);
        peers_.clear();
        others_.clear();
        status_.peers.clear();
      }
      return;
    }
    last_load_read_ = absl::Now();
    if (leader_ && !peers_read_since_acquired_) {
      peers_read_since_acquired_ = true;
      check_now_ = true;  // now the peers' generations are known: make sure Redis holds the newest
    }
    std::vector<PeerLoad> peers;
    std::vector<PeerStatus> statuses;
    std::map<std::string, LeaseCount> others;
    for (PeerLoad& peer : *loads) {
      if (peer.replica_id == options_.replica_id) continue;
      PeerStatus status;
      status.replica_id = peer.replica_id;
      status.leader = peer.load.leader;
      status.installed_generation = peer.load.installed_generation;
      status.age = std::max(absl::ZeroDuration(), *server_now - peer.published_at);
      for (const WorkerLeases& worker : peer.load.workers) {
        LeaseCount& count = others[worker.worker_id];
        count.live += worker.live;
        count.since_snapshot += worker.since_snapshot;
        status.live_leases += worker.live;
      }
      SeeGeneration(peer.load.installed_generation);
      statuses.push_back(std::move(status));
      peers.push_back(std::move(peer));
    }
    absl::MutexLock lock(&mu_);
    peers_ = std::move(peers);
    others_ = std::move(others);
    status_.peers = std::move(statuses);
  }

  void FlushWindow() {
    std::vector<WindowSignature> batch;
    {
      absl::MutexLock lock(&mu_);
      batch.swap(pending_signatures_);
    }
    if (batch.empty()) return;
    absl::Status appended = store_.AppendWindow(options_.replica_id, batch, options_.window_max_entries);
    Check(appended);
    absl::MutexLock lock(&mu_);
    if (appended.ok()) {
      status_.window_appended += batch.size();
    } else {
      status_.window_dropped += batch.size();
    }
  }

  void TailWindow() {
    if (!options_.on_window_entries) return;
    for (int round = 0; round < 4 && !StopRequested(); ++round) {
      absl::StatusOr<WindowBatch> batch = store_.ReadWindow(window_cursor_, options_.window_read_batch);
      if (!Check(batch)) return;
      const size_t read = batch->entries.size() + static_cast<size_t>(batch->undecodable);
      window_cursor_ = batch->last_id;
      std::vector<WindowEntry> others;
      for (WindowEntry& entry : batch->entries) {
        if (entry.replica != options_.replica_id) others.push_back(std::move(entry));
      }
      if (!others.empty()) {
        {
          absl::MutexLock lock(&mu_);
          status_.window_delivered += others.size();
        }
        options_.on_window_entries(std::move(others));
      }
      if (read < static_cast<size_t>(options_.window_read_batch)) return;
    }
  }

  void Cleanup() {
    if (leader_) {
      absl::StatusOr<bool> released = store_.ReleaseLeader(options_.replica_id, fence_);
      Check(released);
      leader_ = false;
    }
    Check(store_.DeleteLoad(options_.replica_id));
    absl::MutexLock lock(&mu_);
    status_.role = ClusterRole::kFollower;
    if (status_.leader_id == options_.replica_id) status_.leader_id.clear();
  }

  // ---- The subscriber thread ------------------------------------------------------------------
  void RunSubscriber() {
    bool subscribed = false;
    const std::string channel = keys_.centroids_announce();
    const std::string leader_channel = keys_.leader_announce();
    while (!StopRequested()) {
      if (!subscribed) {
        // Two confirmations come back; Command reads the first, ReadPush skips the second.
        absl::StatusOr<RedisReply> reply = sub_conn_->Command({"SUBSCRIBE", channel, leader_channel});
        if (!reply.ok()) {
          absl::SleepFor(options_.tick);
          continue;
        }
        subscribed = true;
        absl::MutexLock lock(&mu_);
        wake_ = true;  // announcements may have been missed while unsubscribed
        check_now_requested_ = true;
        continue;
      }
      absl::StatusOr<std::optional<RedisReply>> push = sub_conn_->ReadPush(kSubscriberSlice);
      if (!push.ok()) {
        subscribed = false;
        continue;
      }
      if (!push->has_value()) continue;
      const RedisReply& message = **push;
      if (message.type != RedisReply::Type::kArray || message.elements.size() != 3 ||
          message.elements[0].str != "message") {
        continue;
      }
      if (message.elements[1].str == leader_channel) {
        absl::MutexLock lock(&mu_);
        leader_released_ = true;
        wake_ = true;
        continue;
      }
      uint64_t generation = 0;
      if (!absl::SimpleAtoi(message.elements[2].str, &generation)) continue;
      absl::MutexLock lock(&mu_);
      ++status_.announcements;
      if (generation > announced_generation_) announced_generation_ = generation;
      wake_ = true;
    }
  }

  const ClusterOptions options_;
  const ClusterKeys keys_;
  const std::unique_ptr<RedisConnection> control_conn_;
  const std::unique_ptr<RedisConnection> sub_conn_;
  ClusterStore store_;  // on control_conn_, used by the control thread only

  absl::Mutex lifecycle_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::thread control_thread_ ABSL_GUARDED_BY(lifecycle_mu_);
  std::thread sub_thread_ ABSL_GUARDED_BY(lifecycle_mu_);
  std::atomic<bool> stop_requested_{false};

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool cleanup_on_stop_ ABSL_GUARDED_BY(mu_) = true;
  bool paused_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  bool check_now_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool leader_released_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t announced_generation_ ABSL_GUARDED_BY(mu_) = 0;
  ClusterStatus status_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<CentroidArtifact> pending_publish_ ABSL_GUARDED_BY(mu_);
  uint64_t pending_fence_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<WindowSignature> pending_signatures_ ABSL_GUARDED_BY(mu_);
  std::vector<PeerLoad> peers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, LeaseCount> others_ ABSL_GUARDED_BY(mu_);

  // Owned by the control thread (read elsewhere only through status_).
  bool leader_ = false;
  uint64_t fence_ = 0;
  absl::Time lease_deadline_ = absl::InfiniteFuture();
  absl::Time next_leadership_ = absl::InfinitePast();
  absl::Time next_load_ = absl::InfinitePast();
  absl::Time next_check_ = absl::InfinitePast();
  bool check_now_ = false;
  uint64_t max_fence_seen_ = 0;
  uint64_t max_generation_seen_ = 0;  // in Redis, installed here, or installed by a peer
  uint64_t installed_ = 0;
  std::string current_data_;  // the encoding of generation installed_ (what a re-publication sends)
  uint64_t failed_generation_ = 0;
  bool failed_corrupt_ = false;
  std::string window_cursor_ = "0-0";
  bool logged_first_error_ = false;
  absl::Time last_load_read_ = absl::InfinitePast();
  bool peers_read_since_acquired_ = false;
};

absl::StatusOr<std::unique_ptr<ClusterState>> ClusterState::Create(ClusterOptions options) {
  if (absl::Status valid = ValidateClusterOptions(options); !valid.ok()) return valid;
  options = Resolve(std::move(options));
  absl::StatusOr<std::unique_ptr<RedisConnection>> control = RedisConnection::Create(options.redis);
  if (!control.ok()) return control.status();
  RedisConnectionOptions sub_options = options.redis;
  if (!sub_options.client_name.empty()) sub_options.client_name += ":sub";
  absl::StatusOr<std::unique_ptr<RedisConnection>> subscriber = RedisConnection::Create(sub_options);
  if (!subscriber.ok()) return subscriber.status();
  return std::unique_ptr<ClusterState>(
      new ClusterState(std::make_unique<Impl>(std::move(options), *std::move(control), *std::move(subscriber))));
}

ClusterState::ClusterState(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ClusterState::~ClusterState() = default;
absl::Status ClusterState::Start() { return impl_->Start(); }
void ClusterState::Stop() { impl_->Stop(true); }
void ClusterState::StopWithoutCleanup() { impl_->Stop(false); }
absl::Status ClusterState::Publish(const CentroidArtifact& artifact, uint64_t fencing_generation) {
  return impl_->Publish(artifact, fencing_generation);
}
void ClusterState::AppendSignatures(absl::Span<const WindowSignature> entries) { impl_->AppendSignatures(entries); }
std::map<std::string, int64_t> ClusterState::OthersLeases() const { return impl_->OthersLeases(); }
std::map<std::string, ClusterState::LeaseCount> ClusterState::OthersLeaseCounts() const {
  return impl_->OthersLeaseCounts();
}
std::vector<PeerLoad> ClusterState::PeerLoads() const { return impl_->PeerLoads(); }
int ClusterState::PeerCount() const { return impl_->PeerCount(); }
ClusterRole ClusterState::role() const { return impl_->role(); }
ClusterStatus ClusterState::status() const { return impl_->status(); }
const ClusterOptions& ClusterState::options() const { return impl_->options(); }
void ClusterState::PauseForTesting(bool paused) { impl_->PauseForTesting(paused); }

}  // namespace eldr::cluster
