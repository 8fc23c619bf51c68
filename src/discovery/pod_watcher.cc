#include "eldr/discovery/pod_watcher.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

namespace eldr::discovery {
namespace {

using Json = nlohmann::json;

// A failed LIST whose continue token expired is restarted from the first page at once this many
// times before the failure takes a backoff delay.
constexpr int kMaxImmediateListRestarts = 3;
// A watch that the server closed cleanly sooner than this, having delivered nothing, is followed
// by a backoff delay (a server that closes every watch at once must not be hammered).
constexpr absl::Duration kMinUsefulWatch = absl::Seconds(1);

uint64_t RandomSeed() {
  absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen);
}

std::string PodsBase(const PodWatcherOptions& options) {
  if (options.namespace_.empty()) return "/api/v1/pods";
  return absl::StrCat("/api/v1/namespaces/", UrlEncode(options.namespace_), "/pods");
}

void AppendSelectors(const PodWatcherOptions& options, std::string* query) {
  if (!options.label_selector.empty()) absl::StrAppend(query, "&labelSelector=", UrlEncode(options.label_selector));
  if (!options.field_selector.empty()) absl::StrAppend(query, "&fieldSelector=", UrlEncode(options.field_selector));
}

const Json* Member(const Json& parent, const char* key) {
  auto it = parent.find(key);
  if (it == parent.end() || it->is_null()) return nullptr;
  return &*it;
}

// metadata.resourceVersion of an object; empty when absent or not a string.
std::string ResourceVersionOf(const Json& object) {
  const Json* metadata = Member(object, "metadata");
  if (metadata == nullptr || !metadata->is_object()) return "";
  const Json* rv = Member(*metadata, "resourceVersion");
  if (rv == nullptr || !rv->is_string()) return "";
  return rv->get<std::string>();
}

absl::Status Invalid(absl::string_view why) { return absl::InvalidArgumentError(absl::StrCat("watch event ", why)); }

}  // namespace

Backoff::Backoff(BackoffOptions options, uint64_t seed) : options_(options), rng_(seed != 0 ? seed : RandomSeed()) {}

absl::Duration Backoff::NextCap() const {
  const double initial = absl::ToDoubleSeconds(options_.initial);
  const double max = absl::ToDoubleSeconds(options_.max);
  const double cap = std::min(max, initial * std::pow(std::max(1.0, options_.factor), attempt_));
  return absl::Seconds(std::isfinite(cap) ? cap : max);
}

absl::Duration Backoff::Next() {
  const absl::Duration cap = NextCap();
  if (attempt_ < 64) ++attempt_;
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  return cap * uniform(rng_);
}

absl::Status ValidatePodWatcherOptions(const PodWatcherOptions& options) {
  if (options.list_page_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("list_page_size must be >= 1, got ", options.list_page_size));
  }
  for (auto [name, value] :
       {std::pair{"list_timeout", options.list_timeout}, std::pair{"silence_timeout", options.silence_timeout},
        std::pair{"connect_timeout", options.connect_timeout}, std::pair{"backoff.initial", options.backoff.initial}}) {
    if (value <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be > 0, got ", absl::FormatDuration(value)));
    }
  }
  if (options.watch_timeout < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("watch_timeout must be >= 1s, got ", absl::FormatDuration(options.watch_timeout)));
  }
  if (!(options.watch_timeout_jitter >= 0 && options.watch_timeout_jitter < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("watch_timeout_jitter must be in [0, 1), got ", options.watch_timeout_jitter));
  }
  if (options.backoff.max < options.backoff.initial) {
    return absl::InvalidArgumentError("backoff.max must be >= backoff.initial");
  }
  if (!(options.backoff.factor >= 1) || !std::isfinite(options.backoff.factor)) {
    return absl::InvalidArgumentError(absl::StrCat("backoff.factor must be >= 1, got ", options.backoff.factor));
  }
  if (options.max_event_bytes == 0) return absl::InvalidArgumentError("max_event_bytes must be > 0");
  return absl::OkStatus();
}

std::string PodListPath(const PodWatcherOptions& options, const std::string& continue_token) {
  std::string query = absl::StrCat("limit=", options.list_page_size);
  AppendSelectors(options, &query);
  if (!continue_token.empty()) absl::StrAppend(&query, "&continue=", UrlEncode(continue_token));
  return absl::StrCat(PodsBase(options), "?", query);
}

std::string PodWatchPath(const PodWatcherOptions& options, const std::string& resource_version,
                         int64_t timeout_seconds) {
  std::string query = absl::StrCat("watch=1&resourceVersion=", UrlEncode(resource_version));
  if (options.allow_bookmarks) absl::StrAppend(&query, "&allowWatchBookmarks=true");
  absl::StrAppend(&query, "&timeoutSeconds=", timeout_seconds);
  AppendSelectors(options, &query);
  return absl::StrCat(PodsBase(options), "?", query);
}

absl::StatusOr<PodListPage> ParsePodList(absl::string_view body) {
  const Json parsed = Json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return absl::InvalidArgumentError("pod list answer is not JSON");
  if (!parsed.is_object()) return absl::InvalidArgumentError("pod list answer is not a JSON object");
  if (const Json* kind = Member(parsed, "kind")) {
    if (!kind->is_string() || kind->get_ref<const std::string&>() != "PodList") {
      return absl::InvalidArgumentError(absl::StrCat("pod list answer is of kind ", kind->dump().substr(0, 64)));
    }
  }
  PodListPage page;
  const Json* metadata = Member(parsed, "metadata");
  if (metadata == nullptr || !metadata->is_object()) {
    return absl::InvalidArgumentError("pod list answer has no metadata");
  }
  const Json* rv = Member(*metadata, "resourceVersion");
  if (rv == nullptr || !rv->is_string() || rv->get_ref<const std::string&>().empty()) {
    return absl::InvalidArgumentError("pod list answer has no metadata.resourceVersion");
  }
  page.resource_version = rv->get<std::string>();
  if (const Json* token = Member(*metadata, "continue")) {
    if (!token->is_string()) return absl::InvalidArgumentError("pod list metadata.continue must be a string");
    page.continue_token = token->get<std::string>();
  }
  const Json* items = Member(parsed, "items");
  if (items == nullptr || !items->is_array()) return absl::InvalidArgumentError("pod list answer has no items array");
  page.pods.reserve(items->size());
  for (size_t i = 0; i < items->size(); ++i) {
    absl::StatusOr<PodInfo> pod = ParsePod((*items)[i]);
    if (!pod.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("pod list item ", i, ": ", pod.status().message()));
    }
    page.pods.push_back(std::move(*pod));
  }
  return page;
}

void PodSet::Replace(std::vector<PodInfo> pods, std::string resource_version) {
  pods_.clear();
  for (PodInfo& pod : pods) {
    std::pair<std::string, std::string> key{pod.namespace_, pod.name};
    pods_.insert_or_assign(std::move(key), std::move(pod));
  }
  resource_version_ = std::move(resource_version);
}

PodSet::Result PodSet::ApplyLine(absl::string_view line) {
  const Json event = Json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (event.is_discarded()) return {Outcome::kInvalid, Invalid("is not JSON")};
  if (!event.is_object()) return {Outcome::kInvalid, Invalid("is not a JSON object")};
  const Json* type = Member(event, "type");
  if (type == nullptr || !type->is_string()) return {Outcome::kInvalid, Invalid("has no type")};
  const std::string& kind = type->get_ref<const std::string&>();
  const Json* object = Member(event, "object");
  if (object == nullptr || !object->is_object()) {
    return {Outcome::kInvalid, Invalid(absl::StrCat(kind.substr(0, 32), " has no object"))};
  }
  if (kind == "ERROR") {
    int64_t code = 0;
    if (const Json* value = Member(*object, "code"); value != nullptr && value->is_number_integer()) {
      code = value->get<int64_t>();
    }
    std::string message;
    if (const Json* value = Member(*object, "message"); value != nullptr && value->is_string()) {
      message = value->get<std::string>();
    }
    if (code == 410) {
      return {Outcome::kGone, absl::Status(kGoneCode, absl::StrCat("watch ERROR 410 Gone: ", message))};
    }
    const absl::Status status = code >= 100 && code < 600
                                    ? KubeHttpStatus(static_cast<int>(code), object->dump())
                                    : absl::UnknownError(absl::StrCat("watch ERROR event: ", message));
    return {Outcome::kError, status};
  }
  const bool bookmark = kind == "BOOKMARK";
  if (!bookmark && kind != "ADDED" && kind != "MODIFIED" && kind != "DELETED") {
    return {Outcome::kInvalid,
            Invalid(absl::StrCat("has unknown type \"", absl::CHexEscape(kind.substr(0, 32)), "\""))};
  }
  if (bookmark) {
    if (const Json* object_kind = Member(*object, "kind");
        object_kind != nullptr && (!object_kind->is_string() || object_kind->get_ref<const std::string&>() != "Pod")) {
      return {Outcome::kInvalid, Invalid("BOOKMARK is not of a Pod")};
    }
    std::string rv = ResourceVersionOf(*object);
    if (rv.empty()) return {Outcome::kInvalid, Invalid("BOOKMARK has no resourceVersion")};
    resource_version_ = std::move(rv);
    return {Outcome::kBookmark, absl::OkStatus()};
  }
  absl::StatusOr<PodInfo> pod = ParsePod(*object);
  if (!pod.ok()) return {Outcome::kInvalid, Invalid(absl::StrCat(kind, ": ", pod.status().message()))};
  if (pod->resource_version.empty()) return {Outcome::kInvalid, Invalid(absl::StrCat(kind, " has no resourceVersion"))};
  std::string rv = pod->resource_version;
  std::pair<std::string, std::string> key{pod->namespace_, pod->name};
  if (kind == "DELETED") {
    auto it = pods_.find(key);
    // A late DELETED of a pod already replaced by another of its name leaves the new one alone.
    if (it != pods_.end() && (it->second.uid.empty() || pod->uid.empty() || it->second.uid == pod->uid)) {
      pods_.erase(it);
    }
  } else {
    pods_.insert_or_assign(std::move(key), std::move(*pod));
  }
  resource_version_ = std::move(rv);
  return {Outcome::kApplied, absl::OkStatus()};
}

PodSnapshot PodSet::Snapshot(absl::Time synced_at, bool from_list) const {
  PodSnapshot snapshot;
  snapshot.pods.reserve(pods_.size());
  for (const auto& [key, pod] : pods_) snapshot.pods.push_back(pod);
  snapshot.resource_version = resource_version_;
  snapshot.synced_at = synced_at;
  snapshot.from_list = from_list;
  return snapshot;
}

const PodInfo* PodSet::Find(const std::string& namespace_, const std::string& name) const {
  auto it = pods_.find({namespace_, name});
  return it == pods_.end() ? nullptr : &it->second;
}

absl::string_view WatchRestartReasonLabel(WatchRestartReason reason) {
  switch (reason) {
    case WatchRestartReason::kClosed:
      return "closed";
    case WatchRestartReason::kGone:
      return "gone";
    case WatchRestartReason::kError:
      return "error";
    case WatchRestartReason::kSilence:
      return "silence";
    case WatchRestartReason::kParse:
      return "parse";
  }
  return "unknown";
}

absl::string_view WatchErrorKindLabel(WatchErrorKind kind) {
  switch (kind) {
    case WatchErrorKind::kUnreachable:
      return "unreachable";
    case WatchErrorKind::kHttp:
      return "http";
    case WatchErrorKind::kAuth:
      return "auth";
    case WatchErrorKind::kParse:
      return "parse";
  }
  return "unknown";
}

namespace {

// The kind of a failed request's status (KubeClient's errors).
WatchErrorKind KindOf(const absl::Status& status) {
  if (std::optional<int> http = HttpStatusOf(status)) {
    return *http == 401 || *http == 403 ? WatchErrorKind::kAuth : WatchErrorKind::kHttp;
  }
  if (status.code() == absl::StatusCode::kFailedPrecondition) return WatchErrorKind::kAuth;  // token file
  if (status.code() == absl::StatusCode::kInvalidArgument) return WatchErrorKind::kParse;
  if (status.code() == absl::StatusCode::kResourceExhausted) return WatchErrorKind::kParse;
  return WatchErrorKind::kUnreachable;
}

class PodWatcherImpl final : public PodWatcher {
 public:
  PodWatcherImpl(KubeClient* client, PodWatcherOptions options, PodWatcherObserver* observer)
      : client_(client),
        options_(std::move(options)),
        observer_(observer),
        seed_(options_.seed != 0 ? options_.seed : RandomSeed()) {}

  ~PodWatcherImpl() override { Stop(); }

  absl::Status Start() override {
    absl::MutexLock control(&control_mu_);
    if (thread_.joinable()) return absl::FailedPreconditionError("the pod watcher is already started");
    stop_.store(false);
    {
      absl::MutexLock lock(&mu_);
      stopping_ = false;
    }
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  void Stop() override {
    absl::MutexLock control(&control_mu_);
    if (!thread_.joinable()) return;
    stop_.store(true);
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }

  PodWatcherStats stats() const override {
    absl::MutexLock lock(&mu_);
    return stats_;
  }

 private:
  struct ListFailure {
    WatchErrorKind kind;
    absl::Status status;
  };

  // What ended one watch.
  struct WatchEnd {
    WatchRestartReason reason = WatchRestartReason::kClosed;
    absl::Status cause;
    bool progress = false;  // it delivered an event or a bookmark
    absl::Duration lasted;
  };

  bool stopped() const { return stop_.load(std::memory_order_relaxed); }

  // Waits `delay`, or less when Stop is called.
  void Sleep(absl::Duration delay) {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), delay);
  }

  void Run() {
    Backoff backoff(options_.backoff, seed_);
    std::mt19937_64 rng(seed_ ^ 0x9e3779b97f4a7c15ULL);
    set_ = PodSet();
    bool need_list = true;
    while (!stopped()) {
      if (need_list) {
        std::optional<ListFailure> failure = List();
        if (stopped()) break;
        if (failure.has_value()) {
          {
            absl::MutexLock lock(&mu_);
            ++stats_.list_failures;
            ++stats_.errors[static_cast<int>(failure->kind)];
            if (failure->kind == WatchErrorKind::kParse) ++stats_.parse_errors;
            stats_.synced = false;
            stats_.last_error = std::string(failure->status.message());
          }
          observer_->OnError(failure->kind, failure->status);
          Sleep(backoff.Next());
          continue;
        }
        backoff.Reset();
        need_list = false;
      }
      const WatchEnd end = WatchOnce(rng);
      if (stopped()) break;
      if (end.progress) backoff.Reset();
      {
        absl::MutexLock lock(&mu_);
        ++stats_.restarts[static_cast<int>(end.reason)];
        if (end.reason == WatchRestartReason::kError || end.reason == WatchRestartReason::kSilence ||
            end.reason == WatchRestartReason::kParse) {
          stats_.synced = false;
        }
        if (!end.cause.ok()) stats_.last_error = std::string(end.cause.message());
      }
      observer_->OnWatchRestart(end.reason, end.cause);
      switch (end.reason) {
        case WatchRestartReason::kClosed:
          if (!end.progress && end.lasted < kMinUsefulWatch) Sleep(backoff.Next());
          break;
        case WatchRestartReason::kGone:
          need_list = true;
          break;
        case WatchRestartReason::kSilence:
          break;
        case WatchRestartReason::kError:
        case WatchRestartReason::kParse:
          Sleep(backoff.Next());
          break;
      }
    }
  }

  // One paginated LIST; on success the set is replaced and published.
  std::optional<ListFailure> List() {
    std::vector<PodInfo> pods;
    std::string resource_version;
    std::string continue_token;
    int restarts = 0;
    while (true) {
      absl::StatusOr<KubeResponse> response =
          client_->Get(PodListPath(options_, continue_token), options_.list_timeout, &stop_);
      if (!response.ok()) return ListFailure{KindOf(response.status()), response.status()};
      {
        absl::MutexLock lock(&mu_);
        ++stats_.list_pages;
      }
      if (response->http_status != 200) {
        const absl::Status status = KubeHttpStatus(response->http_status, response->body);
        if (IsGone(status) && !continue_token.empty() && restarts < kMaxImmediateListRestarts) {
          // The continue token expired: the pages so far belong to a snapshot that is gone.
          ++restarts;
          pods.clear();
          continue_token.clear();
          continue;
        }
        return ListFailure{KindOf(status), absl::Status(status.code(), absl::StrCat("pod list: ", status.message()))};
      }
      absl::StatusOr<PodListPage> page = ParsePodList(response->body);
      if (!page.ok()) return ListFailure{WatchErrorKind::kParse, page.status()};
      if (pods.empty()) {
        pods = std::move(page->pods);
      } else {
        pods.insert(pods.end(), std::make_move_iterator(page->pods.begin()), std::make_move_iterator(page->pods.end()));
      }
      resource_version = std::move(page->resource_version);
      continue_token = std::move(page->continue_token);
      if (continue_token.empty()) break;
      if (stopped()) return ListFailure{WatchErrorKind::kUnreachable, absl::CancelledError("stopped")};
    }
    set_.Replace(std::move(pods), std::move(resource_version));
    const absl::Time now = absl::Now();
    {
      absl::MutexLock lock(&mu_);
      ++stats_.lists;
      stats_.synced = true;
      stats_.last_sync = now;
      stats_.resource_version = set_.resource_version();
      stats_.pods = set_.size();
    }
    observer_->OnSnapshot(set_.Snapshot(now, /*from_list=*/true));
    return std::nullopt;
  }

  int64_t WatchTimeoutSeconds(std::mt19937_64& rng) const {
    const double base = absl::ToDoubleSeconds(options_.watch_timeout);
    std::uniform_real_distribution<double> jitter(1.0 - options_.watch_timeout_jitter,
                                                  1.0 + options_.watch_timeout_jitter);
    return std::max<int64_t>(1, static_cast<int64_t>(std::llround(base * jitter(rng))));
  }

  WatchEnd WatchOnce(std::mt19937_64& rng) {
    const absl::Time started = absl::Now();
    WatchEnd end;
    std::optional<PodSet::Result> ending;
    bool dirty = false;
    const std::string path = PodWatchPath(options_, set_.resource_version(), WatchTimeoutSeconds(rng));
    auto publish = [&] {
      if (!dirty) return;
      dirty = false;
      absl::Time synced_at;
      {
        absl::MutexLock lock(&mu_);
        synced_at = stats_.last_sync.value_or(absl::Now());
      }
      observer_->OnSnapshot(set_.Snapshot(synced_at, /*from_list=*/false));
    };
    auto on_line = [&](absl::string_view line) {
      PodSet::Result result = set_.ApplyLine(line);
      const absl::Time now = absl::Now();
      switch (result.outcome) {
        case PodSet::Outcome::kApplied: {
          absl::MutexLock lock(&mu_);
          ++stats_.events;
          stats_.last_sync = now;
          stats_.resource_version = set_.resource_version();
          stats_.pods = set_.size();
          dirty = true;
          end.progress = true;
          return true;
        }
        case PodSet::Outcome::kBookmark: {
          absl::MutexLock lock(&mu_);
          ++stats_.bookmarks;
          stats_.last_sync = now;
          stats_.resource_version = set_.resource_version();
          end.progress = true;
          return true;
        }
        case PodSet::Outcome::kGone:
        case PodSet::Outcome::kError:
        case PodSet::Outcome::kInvalid:
          ending = std::move(result);
          return false;
      }
      return false;
    };
    WatchHooks hooks;
    hooks.on_open = [&] {
      absl::MutexLock lock(&mu_);
      ++stats_.watches;
      stats_.synced = true;
    };
    hooks.on_batch_end = publish;
    WatchLimits limits;
    limits.connect_timeout = options_.connect_timeout;
    limits.silence_timeout = options_.silence_timeout;
    limits.max_line_bytes = options_.max_event_bytes;
    const absl::Status status = client_->Watch(path, limits, on_line, stop_, hooks);
    publish();
    end.lasted = absl::Now() - started;
    if (ending.has_value()) {
      switch (ending->outcome) {
        case PodSet::Outcome::kGone:
          end.reason = WatchRestartReason::kGone;
          break;
        case PodSet::Outcome::kError:
          end.reason = WatchRestartReason::kError;
          ReportError(KindOf(ending->status), ending->status);
          break;
        default:
          end.reason = WatchRestartReason::kParse;
          ReportError(WatchErrorKind::kParse, ending->status);
          break;
      }
      end.cause = ending->status;
      return end;
    }
    end.cause = status;
    if (status.ok()) {
      end.reason = WatchRestartReason::kClosed;
    } else if (IsGone(status)) {
      end.reason = WatchRestartReason::kGone;
    } else if (status.code() == absl::StatusCode::kDeadlineExceeded) {
      end.reason = WatchRestartReason::kSilence;
    } else if (status.code() == absl::StatusCode::kResourceExhausted) {
      end.reason = WatchRestartReason::kParse;
      ReportError(WatchErrorKind::kParse, status);
    } else if (status.code() != absl::StatusCode::kCancelled) {
      end.reason = WatchRestartReason::kError;
      ReportError(KindOf(status), status);
    }
    return end;
  }

  void ReportError(WatchErrorKind kind, const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      ++stats_.errors[static_cast<int>(kind)];
      if (kind == WatchErrorKind::kParse) ++stats_.parse_errors;
      stats_.last_error = std::string(status.message());
    }
    observer_->OnError(kind, status);
  }

  KubeClient* const client_;
  const PodWatcherOptions options_;
  PodWatcherObserver* const observer_;
  const uint64_t seed_;
  std::atomic<bool> stop_{false};
  PodSet set_;  // the watcher thread's

  absl::Mutex control_mu_;
  std::thread thread_ ABSL_GUARDED_BY(control_mu_);

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  PodWatcherStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<PodWatcher>> PodWatcher::Create(KubeClient* client, PodWatcherOptions options,
                                                               PodWatcherObserver* observer) {
  if (client == nullptr) return absl::InvalidArgumentError("the pod watcher needs a Kubernetes client");
  if (observer == nullptr) return absl::InvalidArgumentError("the pod watcher needs an observer");
  absl::Status valid = ValidatePodWatcherOptions(options);
  if (!valid.ok()) return valid;
  return std::unique_ptr<PodWatcher>(new PodWatcherImpl(client, std::move(options), observer));
}

}  // namespace eldr::discovery
