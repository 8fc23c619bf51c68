#include "eldr/loadsignals/load_scraper.h"

#include <curl/curl.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"

namespace eldr {
namespace {

// libcurl's global state is initialised once per process and never torn down: other libraries
// (or a second scraper) may still use it.
void InitCurlOnce() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

bool HasHttpScheme(absl::string_view url) {
  return absl::StartsWithIgnoreCase(url, "http://") || absl::StartsWithIgnoreCase(url, "https://");
}

// One worker's transfer. Owned by whoever drives the transfers (the background thread, or the
// caller of ScrapeOnce); the easy handle is kept across scrapes so its connection is reused.
struct Transfer {
  std::string worker_id;
  std::string url;
  uint64_t generation = 0;
  CURL* easy = nullptr;
  std::string body;
  size_t max_bytes = 0;
  bool overflow = false;
  bool in_flight = false;
  absl::Time next_due = absl::InfinitePast();
  absl::Time started_at;
  char error_buffer[CURL_ERROR_SIZE] = {};

  ~Transfer() {
    if (easy != nullptr) curl_easy_cleanup(easy);
  }
};

size_t AppendBody(char* data, size_t size, size_t count, void* user) {
  auto* transfer = static_cast<Transfer*>(user);
  const size_t bytes = size * count;
  if (transfer->body.size() + bytes > transfer->max_bytes) {
    transfer->overflow = true;
    return 0;  // makes libcurl abort the transfer with CURLE_WRITE_ERROR
  }
  transfer->body.append(data, bytes);
  return bytes;
}

enum class Outcome { kSuccess, kTransportError, kHttpError, kMalformed };

struct ScrapeResult {
  Outcome outcome = Outcome::kSuccess;
  EngineLoad load;
  std::string error;
};

class LoadScraperImpl final : public LoadScraper {
 public:
  LoadScraperImpl(Router* router, LoadScraperOptions options)
      : router_(router), options_(std::move(options)), multi_(curl_multi_init()) {
    headers_ = curl_slist_append(headers_, "Accept: text/plain;version=0.0.4;q=1,*/*;q=0.1");
  }

  ~LoadScraperImpl() override {
    Stop();
    for (auto& [id, transfer] : transfers_) {
      if (transfer->in_flight) curl_multi_remove_handle(multi_, transfer->easy);
    }
    transfers_.clear();
    curl_multi_cleanup(multi_);
    curl_slist_free_all(headers_);
  }

  bool initialised() const { return multi_ != nullptr && headers_ != nullptr; }

  absl::Status Start() override {
    absl::MutexLock control(&control_mu_);
    if (thread_.joinable()) return absl::FailedPreconditionError("the load scraper is already started");
    {
      absl::MutexLock lock(&mu_);
      stop_ = false;
    }
    thread_ = std::thread([this] { RunLoop(); });
    return absl::OkStatus();
  }

  void Stop() override {
    absl::MutexLock control(&control_mu_);
    if (thread_.joinable()) {
      {
        absl::MutexLock lock(&mu_);
        stop_ = true;
      }
      curl_multi_wakeup(multi_);
      thread_.join();
      AbandonTransfers();
    }
    absl::MutexLock lock(&mu_);
    for (auto& [id, target] : targets_) RestoreHealthLocked(target);
  }

  absl::Status SetTargets(std::vector<ScrapeTarget> targets) override {
    absl::Status valid = ValidateScrapeTargets(targets);
    if (!valid.ok()) return valid;
    absl::flat_hash_set<std::string> keep;
    for (const ScrapeTarget& target : targets) keep.insert(target.worker_id);
    {
      absl::MutexLock lock(&mu_);
      for (auto it = targets_.begin(); it != targets_.end();) {
        if (keep.contains(it->first)) {
          ++it;
          continue;
        }
        RestoreHealthLocked(it->second);
        targets_.erase(it++);
      }
      for (ScrapeTarget& target : targets) UpsertLocked(std::move(target));
      ++targets_version_;
    }
    curl_multi_wakeup(multi_);
    return absl::OkStatus();
  }

  absl::Status UpsertTarget(ScrapeTarget target) override {
    absl::Status valid = ValidateScrapeTargets({target});
    if (!valid.ok()) return valid;
    {
      absl::MutexLock lock(&mu_);
      UpsertLocked(std::move(target));
      ++targets_version_;
    }
    curl_multi_wakeup(multi_);
    return absl::OkStatus();
  }

  absl::Status RemoveTarget(const std::string& worker_id) override {
    {
      absl::MutexLock lock(&mu_);
      auto it = targets_.find(worker_id);
      if (it == targets_.end()) {
        return absl::NotFoundError(absl::StrCat("no scrape target for worker \"", worker_id, "\""));
      }
      RestoreHealthLocked(it->second);
      targets_.erase(it);
      ++targets_version_;
    }
    curl_multi_wakeup(multi_);
    return absl::OkStatus();
  }

  absl::Status ScrapeOnce() override {
    absl::MutexLock control(&control_mu_);
    if (thread_.joinable()) {
      return absl::FailedPreconditionError("ScrapeOnce while the background scraper runs");
    }
    SyncTransfers();
    const absl::Time now = absl::Now();
    for (auto& [id, transfer] : transfers_) {
      if (!transfer->in_flight) StartTransfer(*transfer, now);
    }
    while (
        std::any_of(transfers_.begin(), transfers_.end(), [](const auto& entry) { return entry.second->in_flight; })) {
      DriveTransfers(absl::Milliseconds(50));
    }
    return absl::OkStatus();
  }

  std::vector<WorkerScrapeStats> Stats() const override {
    absl::MutexLock lock(&mu_);
    std::vector<WorkerScrapeStats> stats;
    stats.reserve(targets_.size());
    for (const auto& [id, target] : targets_) stats.push_back(target.stats);
    return stats;
  }

  const LoadScraperOptions& options() const override { return options_; }

 private:
  struct TargetState {
    uint64_t generation = 0;
    WorkerScrapeStats stats;
  };

  void UpsertLocked(ScrapeTarget target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto [it, inserted] = targets_.try_emplace(target.worker_id);
    TargetState& state = it->second;
    if (inserted || state.stats.url != target.url) state.generation = ++next_generation_;
    state.stats.worker_id = std::move(target.worker_id);
    state.stats.url = std::move(target.url);
  }

  // Undoes this scraper's unhealthy mark. A worker the Router no longer knows is fine: there is
  // nothing left to restore.
  void RestoreHealthLocked(TargetState& target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (target.stats.healthy) return;
    router_->SetWorkerHealthy(target.stats.worker_id, true).IgnoreError();
    target.stats.healthy = true;
    target.stats.consecutive_failures = 0;
  }

  void RunLoop() {
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
      }
      SyncTransfers();
      const absl::Time now = absl::Now();
      absl::Duration wait = absl::Seconds(1);  // bounded so a lost wakeup cannot stall the loop
      for (auto& [id, transfer] : transfers_) {
        if (transfer->in_flight) continue;
        if (transfer->next_due <= now) {
          StartTransfer(*transfer, now);
        } else {
          wait = std::min(wait, transfer->next_due - now);
        }
      }
      DriveTransfers(wait);
    }
  }

  // Brings the transfer set in line with the target list (new, removed and re-pointed targets).
  void SyncTransfers() {
    std::vector<std::pair<std::string, std::pair<std::string, uint64_t>>> wanted;
    uint64_t version = 0;
    {
      absl::MutexLock lock(&mu_);
      if (targets_version_ == synced_version_) return;
      version = targets_version_;
      wanted.reserve(targets_.size());
      for (const auto& [id, target] : targets_) {
        wanted.push_back({id, {target.stats.url, target.generation}});
      }
    }
    absl::flat_hash_map<std::string, std::pair<std::string, uint64_t>> by_id(wanted.begin(), wanted.end());
    for (auto it = transfers_.begin(); it != transfers_.end();) {
      auto found = by_id.find(it->first);
      if (found != by_id.end() && found->second.second == it->second->generation) {
        ++it;
        continue;
      }
      if (it->second->in_flight) curl_multi_remove_handle(multi_, it->second->easy);
      transfers_.erase(it++);
    }
    bool complete = true;
    for (auto& [id, url_and_generation] : by_id) {
      if (transfers_.contains(id)) continue;
      auto transfer = std::make_unique<Transfer>();
      transfer->worker_id = id;
      transfer->url = url_and_generation.first;
      transfer->generation = url_and_generation.second;
      transfer->max_bytes = options_.max_page_bytes;
      transfer->easy = curl_easy_init();
      if (transfer->easy == nullptr) {
        complete = false;  // out of memory: retried at the next sync
        continue;
      }
      ConfigureEasy(*transfer);
      transfers_.emplace(id, std::move(transfer));
    }
    if (complete) synced_version_ = version;
  }

  void ConfigureEasy(Transfer& transfer) {
    CURL* easy = transfer.easy;
    const long timeout_ms = static_cast<long>(std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.timeout)));
    curl_easy_setopt(easy, CURLOPT_URL, transfer.url.c_str());
    curl_easy_setopt(easy, CURLOPT_PRIVATE, &transfer);
    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, &AppendBody);
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, &transfer);
    curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, transfer.error_buffer);
    curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, timeout_ms);
    curl_easy_setopt(easy, CURLOPT_HTTPHEADER, headers_);
    curl_easy_setopt(easy, CURLOPT_USERAGENT, options_.user_agent.c_str());
    curl_easy_setopt(easy, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(easy, CURLOPT_FOLLOWLOCATION, 0L);
    // Workers are scraped directly, as Prometheus does: an http_proxy variable in the router's
    // environment must not send scrapes elsewhere.
    curl_easy_setopt(easy, CURLOPT_PROXY, "");
  }

  void StartTransfer(Transfer& transfer, absl::Time now) {
    transfer.body.clear();
    transfer.overflow = false;
    transfer.error_buffer[0] = '\0';
    transfer.started_at = now;
    transfer.next_due = now + options_.interval;
    if (curl_multi_add_handle(multi_, transfer.easy) == CURLM_OK) {
      transfer.in_flight = true;
    } else {
      ApplyResult(transfer, {Outcome::kTransportError, {}, "could not start the transfer"}, absl::ZeroDuration());
    }
  }

  // Runs transfers until there is socket activity, a finished transfer, a wakeup, or `wait`.
  void DriveTransfers(absl::Duration wait) {
    int running = 0;
    curl_multi_perform(multi_, &running);
    // A finished transfer changes the schedule (its next scrape is now due at a known time): let
    // the caller recompute the wait instead of sleeping on a stale one.
    if (HandleFinished() > 0) return;
    const int wait_ms = static_cast<int>(
        std::clamp<int64_t>(static_cast<int64_t>(std::ceil(absl::ToDoubleMilliseconds(wait))), 0, 1000));
    if (wait_ms > 0) curl_multi_poll(multi_, nullptr, 0, wait_ms, nullptr);
    curl_multi_perform(multi_, &running);
    HandleFinished();
  }

  // Applies the results of finished transfers; returns how many there were.
  int HandleFinished() {
    int finished = 0;
    int queued = 0;
    while (CURLMsg* message = curl_multi_info_read(multi_, &queued)) {
      if (message->msg != CURLMSG_DONE) continue;
      ++finished;
      CURL* easy = message->easy_handle;
      const CURLcode code = message->data.result;
      Transfer* transfer = nullptr;
      curl_easy_getinfo(easy, CURLINFO_PRIVATE, &transfer);
      curl_multi_remove_handle(multi_, easy);
      if (transfer == nullptr) continue;
      transfer->in_flight = false;
      const absl::Duration took = absl::Now() - transfer->started_at;
      ApplyResult(*transfer, Evaluate(*transfer, code), took);
      // Keep the buffer for the next page of this worker unless an unusually large one grew it.
      if (transfer->body.capacity() > (1u << 20)) {
        std::string().swap(transfer->body);
      } else {
        transfer->body.clear();
      }
    }
    return finished;
  }

  ScrapeResult Evaluate(const Transfer& transfer, CURLcode code) const {
    ScrapeResult result;
    if (code == CURLE_WRITE_ERROR && transfer.overflow) {
      result.outcome = Outcome::kMalformed;
      result.error = absl::StrCat("page larger than ", options_.max_page_bytes, " bytes");
      return result;
    }
    if (code != CURLE_OK) {
      result.outcome = Outcome::kTransportError;
      result.error =
          transfer.error_buffer[0] != '\0' ? std::string(transfer.error_buffer) : std::string(curl_easy_strerror(code));
      return result;
    }
    long status = 0;
    curl_easy_getinfo(transfer.easy, CURLINFO_RESPONSE_CODE, &status);
    if (status != 200) {
      result.outcome = Outcome::kHttpError;
      result.error = absl::StrCat("HTTP status ", status);
      return result;
    }
    absl::StatusOr<EngineLoad> load = ParseEngineLoad(transfer.body, options_.engine);
    if (!load.ok()) {
      result.outcome = Outcome::kMalformed;
      result.error = std::string(load.status().message());
      return result;
    }
    result.load = *load;
    return result;
  }

  void ApplyResult(const Transfer& transfer, const ScrapeResult& result, absl::Duration took) {
    std::optional<bool> health_change;
    std::string reason;
    {
      absl::MutexLock lock(&mu_);
      health_change = ApplyResultLocked(transfer, result, took);
      if (health_change.has_value() && !*health_change) reason = result.error;
    }
    if (health_change.has_value() && options_.on_health_change) {
      options_.on_health_change(transfer.worker_id, *health_change, reason);
    }
  }

  // Returns the worker's new health when this result changed it.
  std::optional<bool> ApplyResultLocked(const Transfer& transfer, const ScrapeResult& result, absl::Duration took)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = targets_.find(transfer.worker_id);
    // A target removed or re-pointed while the scrape ran: its result describes nothing current.
    if (it == targets_.end() || it->second.generation != transfer.generation) return std::nullopt;
    WorkerScrapeStats& stats = it->second.stats;
    stats.last_duration = took;
    if (result.outcome == Outcome::kSuccess) {
      ++stats.successes;
      stats.consecutive_failures = 0;
      stats.last_success = transfer.started_at;
      stats.last_load = result.load;
      stats.last_error.clear();
      LoadSnapshot snapshot;
      snapshot.running = result.load.running;
      snapshot.waiting = result.load.waiting;
      snapshot.kv_usage = result.load.kv_usage.value_or(0.0);
      snapshot.taken_at = transfer.started_at;
      absl::Status reported = router_->ReportLoad(stats.worker_id, snapshot, absl::Now());
      if (!reported.ok()) {
        ++stats.rejected_reports;
        stats.last_error = absl::StrCat("router refused the snapshot: ", reported.message());
      }
      if (!stats.healthy) {
        router_->SetWorkerHealthy(stats.worker_id, true).IgnoreError();
        stats.healthy = true;
        return true;
      }
      return std::nullopt;
    }
    switch (result.outcome) {
      case Outcome::kTransportError:
        ++stats.transport_errors;
        break;
      case Outcome::kHttpError:
        ++stats.http_errors;
        break;
      case Outcome::kMalformed:
        ++stats.malformed_pages;
        break;
      case Outcome::kSuccess:
        break;
    }
    ++stats.consecutive_failures;
    stats.last_error = result.error;
    if (options_.unhealthy_after_failures > 0 && stats.consecutive_failures >= options_.unhealthy_after_failures) {
      // Asserted on every failure past the threshold, not only the first: a worker removed from
      // and re-added to the router comes back healthy and must be marked again.
      const absl::Status marked = router_->SetWorkerHealthy(stats.worker_id, false);
      if (marked.ok() && stats.healthy) {
        stats.healthy = false;
        ++stats.unhealthy_transitions;
        return false;
      }
    }
    return std::nullopt;
  }

  void AbandonTransfers() {
    for (auto& [id, transfer] : transfers_) {
      if (!transfer->in_flight) continue;
      curl_multi_remove_handle(multi_, transfer->easy);
      transfer->in_flight = false;
      transfer->next_due = absl::InfinitePast();
    }
  }

  Router* const router_;
  const LoadScraperOptions options_;
  CURLM* const multi_;
  curl_slist* headers_ = nullptr;

  // Serialises Start, Stop and ScrapeOnce. The transfers (below) belong to the background thread
  // while it runs, and otherwise to the holder of control_mu_.
  absl::Mutex control_mu_;
  std::thread thread_ ABSL_GUARDED_BY(control_mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<Transfer>> transfers_;
  uint64_t synced_version_ = 0;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, TargetState> targets_ ABSL_GUARDED_BY(mu_);  // ordered: Stats() by id
  uint64_t targets_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::Status ValidateLoadScraperOptions(const LoadScraperOptions& options) {
  if (options.interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("scrape interval must be > 0, got ", absl::FormatDuration(options.interval)));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("scrape timeout must be > 0, got ", absl::FormatDuration(options.timeout)));
  }
  if (options.unhealthy_after_failures < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unhealthy_after_failures must be >= 0, got ", options.unhealthy_after_failures));
  }
  if (options.max_page_bytes == 0) return absl::InvalidArgumentError("max_page_bytes must be > 0");
  return absl::OkStatus();
}

absl::Status ValidateScrapeTargets(const std::vector<ScrapeTarget>& targets) {
  absl::flat_hash_set<absl::string_view> seen;
  for (const ScrapeTarget& target : targets) {
    if (target.worker_id.empty()) return absl::InvalidArgumentError("scrape target with an empty worker id");
    if (!seen.insert(target.worker_id).second) {
      return absl::InvalidArgumentError(absl::StrCat("two scrape targets for worker \"", target.worker_id, "\""));
    }
    if (!HasHttpScheme(target.url)) {
      return absl::InvalidArgumentError(absl::StrCat("metrics URL of worker \"", target.worker_id,
                                                     "\" must start with http:// or https://, got \"", target.url,
                                                     "\""));
    }
    if (target.url.find_first_of(" \t\r\n") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics URL of worker \"", target.worker_id, "\" contains whitespace"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ScrapeTarget>> ParseScrapeTargets(absl::string_view text) {
  std::vector<ScrapeTarget> targets;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    const size_t equals = item.find('=');
    if (equals == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("worker metrics entry \"", item, "\" is not of the form id=url"));
    }
    targets.push_back({std::string(absl::StripAsciiWhitespace(item.substr(0, equals))),
                       std::string(absl::StripAsciiWhitespace(item.substr(equals + 1)))});
  }
  absl::Status valid = ValidateScrapeTargets(targets);
  if (!valid.ok()) return valid;
  return targets;
}

absl::StatusOr<std::unique_ptr<LoadScraper>> LoadScraper::Create(Router* router, LoadScraperOptions options,
                                                                 std::vector<ScrapeTarget> targets) {
  if (router == nullptr) return absl::InvalidArgumentError("the load scraper needs a router");
  absl::Status valid = ValidateLoadScraperOptions(options);
  if (!valid.ok()) return valid;
  valid = ValidateScrapeTargets(targets);
  if (!valid.ok()) return valid;
  InitCurlOnce();
  auto scraper = std::make_unique<LoadScraperImpl>(router, std::move(options));
  if (!scraper->initialised()) return absl::InternalError("libcurl could not create a multi handle");
  valid = scraper->SetTargets(std::move(targets));
  if (!valid.ok()) return valid;
  return scraper;
}

}  // namespace eldr
