// The list-then-watch loop over the pods matching a label selector, in a thread of its own (what
// client-go's reflector does for one resource).
//
//   1. LIST, paginated (limit/continue). All pages come from one snapshot; when a continue token
//      expires (410 Gone) the list restarts from the first page. The whole known set is replaced
//      at once, and the list's resourceVersion recorded.
//   2. WATCH from that resourceVersion, with allowWatchBookmarks and a server-side timeoutSeconds
//      (watch_timeout, randomised by +-watch_timeout_jitter per watch). ADDED/MODIFIED/DELETED
//      change the set; BOOKMARK only advances the resourceVersion.
//   3. The watch ends, and:
//        closed  the server ended it cleanly: watch again from the last resourceVersion at once
//                (after a backoff delay when it lasted under a second and brought nothing)
//        gone    an ERROR event of code 410, or HTTP 410: the resourceVersion is too old: LIST
//        error   the connection failed or dropped, an ERROR event of another code, an HTTP error:
//                watch again from the last resourceVersion after a backoff delay
//        silence nothing at all (not even a bookmark) for silence_timeout: watch again at once
//        parse   a line that is not a valid event, or an object that is not a Pod: nothing of it
//                is applied; watch again from the last good resourceVersion after a backoff delay
//   A failed LIST (unreachable, HTTP error, an answer that does not parse) keeps the last known
//   set, waits a backoff delay and lists again: an error never publishes an empty set. Backoff:
//   full jitter (a delay uniform in [0, d], d = initial * factor^n capped at max), reset by a
//   successful LIST and by a watch that delivered an event or a bookmark.
//
// Publication: after every successful LIST, and after every batch of watch events applied (events
// that arrived together are applied one by one and published once), the observer gets the whole
// set as a PodSnapshot. All observer calls are made on the watcher thread, one at a time; a slow
// observer delays the watch (the server buffers), so hand heavy work to another thread.
//
// Thread-safety: Start, Stop and stats may be called from any thread. Stop returns within about
// 100 ms wherever the loop is (connecting, listing, watching, waiting out a backoff delay), plus
// the time of an observer call in progress.
#ifndef ELDR_DISCOVERY_POD_WATCHER_H_
#define ELDR_DISCOVERY_POD_WATCHER_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "eldr/discovery/kube_client.h"
#include "eldr/discovery/pod.h"

namespace eldr::discovery {

struct BackoffOptions {
  absl::Duration initial = absl::Milliseconds(200);
  absl::Duration max = absl::Seconds(30);
  double factor = 2.0;  // >= 1
};

// Full-jitter exponential backoff (AWS's "full jitter"): the n-th delay since the last Reset is
// uniform in [0, min(max, initial * factor^n)]. Not thread-safe.
class Backoff {
 public:
  explicit Backoff(BackoffOptions options, uint64_t seed = 0);  // seed 0: a random seed
  absl::Duration Next();
  void Reset() { attempt_ = 0; }
  // The upper bound the next delay is drawn under.
  absl::Duration NextCap() const;

 private:
  BackoffOptions options_;
  int attempt_ = 0;
  std::mt19937_64 rng_;
};

struct PodWatcherOptions {
  // The namespace to watch; empty: every namespace (needs cluster-wide list/watch permission).
  std::string namespace_;
  // Kubernetes label selector ("app=decode,tier in (a,b)"), passed through; empty: every pod.
  std::string label_selector;
  // Optional field selector ("status.phase=Running"), passed through.
  std::string field_selector;
  // Pods per LIST page (limit/continue), >= 1.
  int list_page_size = 500;
  // Whole-exchange limit of one LIST page request.
  absl::Duration list_timeout = absl::Seconds(30);
  // The server-side watch timeout (timeoutSeconds), randomised per watch by +-watch_timeout_jitter
  // (a fraction in [0, 1)); the server then ends the watch cleanly. >= 1 s.
  absl::Duration watch_timeout = absl::Minutes(5);
  double watch_timeout_jitter = 0.2;
  // A watch silent (no event, no bookmark, no byte) this long is restarted (reason "silence").
  absl::Duration silence_timeout = absl::Seconds(90);
  // Connection set-up limit of a watch request.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Ask the server for BOOKMARK events (allowWatchBookmarks=true): they keep the resourceVersion
  // fresh (fewer 410s after a reconnect) and prove the watch alive.
  bool allow_bookmarks = true;
  BackoffOptions backoff;
  // One watch event larger than this ends the watch (counted as a parse error).
  size_t max_event_bytes = size_t{16} << 20;
  // Seed of the backoff and watch-timeout jitter; 0: random.
  uint64_t seed = 0;
};

// >= 1 page size, positive durations, jitter in [0, 1), watch_timeout >= 1 s, backoff initial > 0,
// max >= initial, factor >= 1. INVALID_ARGUMENT naming the field.
absl::Status ValidatePodWatcherOptions(const PodWatcherOptions& options);

// /api/v1[/namespaces/<ns>]/pods?labelSelector=..&fieldSelector=..&limit=<n>[&continue=<token>]
std::string PodListPath(const PodWatcherOptions& options, const std::string& continue_token);
// /api/v1[/namespaces/<ns>]/pods?watch=1&resourceVersion=<rv>&allowWatchBookmarks=true
//   &timeoutSeconds=<s>&labelSelector=..&fieldSelector=..
std::string PodWatchPath(const PodWatcherOptions& options, const std::string& resource_version,
                         int64_t timeout_seconds);

// Every pod known, as published to the observer.
struct PodSnapshot {
  std::vector<PodInfo> pods;     // sorted by (namespace, name)
  std::string resource_version;  // of the last LIST, event or bookmark applied
  absl::Time synced_at;          // when the view was last confirmed (LIST, event or bookmark)
  bool from_list = false;        // published after a LIST (else after watch events)
};

// One page of a PodList answer.
struct PodListPage {
  std::vector<PodInfo> pods;
  std::string resource_version;  // metadata.resourceVersion (required, non-empty)
  std::string continue_token;    // metadata.continue; empty on the last page
};

// Parses a PodList page. INVALID_ARGUMENT when the body is not JSON, not an object, `kind` is
// present and not "PodList", `items` is missing or not an array, metadata.resourceVersion is
// missing or empty, or an item fails ParsePod (one bad item fails the page: nothing is applied).
absl::StatusOr<PodListPage> ParsePodList(absl::string_view body);

// The watcher's view: the pods by (namespace, name) and the last resourceVersion, with the rules
// of the watch events. Pure state; the watcher thread owns one. Not thread-safe.
class PodSet {
 public:
  // What one watch line did.
  enum class Outcome {
    kApplied,   // ADDED, MODIFIED or DELETED applied; the resourceVersion advanced
    kBookmark,  // BOOKMARK: only the resourceVersion advanced
    kGone,      // ERROR event with code 410 (status: kGoneCode with the server's message)
    kError,     // ERROR event with another code (status: that of the HTTP code, see KubeHttpStatus)
    kInvalid,   // not a valid event, or its object is not a valid Pod: nothing changed (status says why)
  };
  struct Result {
    Outcome outcome = Outcome::kInvalid;
    absl::Status status;
  };

  // Replaces the whole set (after a LIST).
  void Replace(std::vector<PodInfo> pods, std::string resource_version);
  // Applies one watch line ({"type":..,"object":{..}}). ADDED and MODIFIED insert or replace the
  // pod; DELETED removes it (unless the set holds another pod of that name, with another uid).
  // Events and bookmarks must carry metadata.resourceVersion (else kInvalid).
  Result ApplyLine(absl::string_view line);
  PodSnapshot Snapshot(absl::Time synced_at, bool from_list) const;

  const std::string& resource_version() const { return resource_version_; }
  size_t size() const { return pods_.size(); }
  const PodInfo* Find(const std::string& namespace_, const std::string& name) const;

 private:
  std::map<std::pair<std::string, std::string>, PodInfo> pods_;
  std::string resource_version_;
};

enum class WatchRestartReason { kClosed, kGone, kError, kSilence, kParse };
inline constexpr int kNumWatchRestartReasons = 5;
absl::string_view WatchRestartReasonLabel(WatchRestartReason reason);  // "closed", "gone", ...

enum class WatchErrorKind {
  kUnreachable,  // transport: refused, DNS, TLS, dropped, timed out, silent
  kHttp,         // an HTTP error status other than 401/403 (and 410, which is not an error)
  kAuth,         // 401 or 403
  kParse,        // a list answer or a watch line that does not parse
};
inline constexpr int kNumWatchErrorKinds = 4;
absl::string_view WatchErrorKindLabel(WatchErrorKind kind);  // "unreachable", "http", "auth", "parse"

struct PodWatcherStats {
  int64_t lists = 0;          // successful LISTs
  int64_t list_failures = 0;  // LIST attempts that failed (each followed by a backoff delay)
  int64_t list_pages = 0;     // pages fetched by successful and failed LISTs
  int64_t watches = 0;        // watch requests that the server accepted (HTTP 200)
  int64_t events = 0;         // ADDED/MODIFIED/DELETED applied
  int64_t bookmarks = 0;
  int64_t parse_errors = 0;                                 // invalid list answers and watch lines
  std::array<int64_t, kNumWatchRestartReasons> restarts{};  // by WatchRestartReason
  std::array<int64_t, kNumWatchErrorKinds> errors{};        // by WatchErrorKind
  // True once a LIST succeeded while the last request (LIST or watch) did not fail; false before
  // the first LIST, and from a failed LIST or a failed, dropped or silent watch until the next
  // LIST succeeds or a watch opens.
  bool synced = false;
  std::optional<absl::Time> last_sync;  // the last successful LIST, applied event or bookmark
  std::string resource_version;
  size_t pods = 0;
  std::string last_error;  // the last failure's message (kept after recovery)
};

// Receives the watcher's results, on the watcher thread (see the file comment).
class PodWatcherObserver {
 public:
  virtual ~PodWatcherObserver() = default;
  // The whole current set, after a LIST or a batch of events.
  virtual void OnSnapshot(const PodSnapshot& snapshot) = 0;
  // A watch ended and another (or a LIST, for kGone) follows; `cause` says why (OK for kClosed).
  virtual void OnWatchRestart(WatchRestartReason /*reason*/, const absl::Status& /*cause*/) {}
  // A failed request or an unparsable answer.
  virtual void OnError(WatchErrorKind /*kind*/, const absl::Status& /*status*/) {}
};

class PodWatcher {
 public:
  // `client` and `observer` must outlive the watcher. INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<PodWatcher>> Create(KubeClient* client, PodWatcherOptions options,
                                                            PodWatcherObserver* observer);
  // Stops first.
  virtual ~PodWatcher() = default;

  // Starts the thread (the first LIST at once). FAILED_PRECONDITION when already started.
  virtual absl::Status Start() = 0;
  // Stops and joins the thread (see the file comment for how soon). Idempotent; the watcher may be
  // started again, and then lists first.
  virtual void Stop() = 0;
  virtual PodWatcherStats stats() const = 0;
};

}  // namespace eldr::discovery

#endif  // ELDR_DISCOVERY_POD_WATCHER_H_
