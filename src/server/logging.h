// Structured, leveled logging for the daemon: one line per event on stderr, either key=value
// (`ts=... level=info event=route_rejected reason=geometry ...`) or one JSON object per line.
//
// Usage:
//   ELDR_LOG(Info, "centroids_loaded").With("path", path).With("rows", rows);
// The line is written when the temporary goes out of scope. Disabled levels cost one relaxed
// atomic load and build nothing.
//
// Thread-safety: every function may be called from any thread; each line is written with a single
// write(2) under a mutex, so lines from different threads never interleave. Not for use in signal
// handlers (it allocates).
#ifndef ELDR_SERVER_LOGGING_H_
#define ELDR_SERVER_LOGGING_H_

#include <cstdint>
#include <string>
#include <type_traits>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace eldr::server {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class LogFormat { kKeyValue, kJson };

// "debug", "info", "warning" (or "warn"), "error".
absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name);
absl::string_view LogLevelName(LogLevel level);
// "kv" (or "keyvalue") and "json".
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);
absl::string_view LogFormatName(LogFormat format);

// Process-wide settings; defaults: kInfo, kKeyValue.
void SetLogLevel(LogLevel level);
void SetLogFormat(LogFormat format);
bool LogEnabled(LogLevel level);

// Redirects log lines to a file descriptor (default 2, stderr). For tests.
void SetLogFd(int fd);

class LogRateLimiter;

// One log line under construction. Keys should be lower_snake_case; values are escaped as needed.
class LogEvent {
 public:
  LogEvent(LogLevel level, absl::string_view event);
  // A line subject to `limiter` under `key`: when the limiter suppresses it, the event is inert
  // (With does nothing, nothing is written); otherwise it carries suppressed=<count> when lines
  // were suppressed before it.
  LogEvent(LogLevel level, absl::string_view event, LogRateLimiter* limiter, absl::string_view key);
  ~LogEvent();
  LogEvent(const LogEvent&) = delete;
  LogEvent& operator=(const LogEvent&) = delete;

  LogEvent& With(absl::string_view key, absl::string_view value);
  LogEvent& With(absl::string_view key, const char* value) { return With(key, absl::string_view(value)); }
  LogEvent& With(absl::string_view key, const std::string& value) { return With(key, absl::string_view(value)); }
  LogEvent& With(absl::string_view key, bool value);
  LogEvent& With(absl::string_view key, double value);
  LogEvent& With(absl::string_view key, absl::Duration value);
  // code=<canonical code name> and error=<message>.
  LogEvent& With(absl::string_view key, const absl::Status& status);
  template <typename Int, std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>, int> = 0>
  LogEvent& With(absl::string_view key, Int value) {
    return WithInteger(key, static_cast<int64_t>(value), std::is_signed_v<Int>);
  }

 private:
  LogEvent& WithInteger(absl::string_view key, int64_t value, bool is_signed);
  LogEvent& WithRaw(absl::string_view key, absl::string_view literal);  // unquoted JSON literal

  LogFormat format_;
  bool enabled_ = true;
  std::string line_;
};

// Bounds how often lines of one kind are written, so a flood of refused calls or failed routes
// cannot flood the log: each key (e.g. "admin_refused/UpsertWorker") gets a token bucket of
// `per_second` lines per second (burst: the same number); a line beyond it is suppressed and
// counted, and the next line written for that key reports how many were suppressed.
// Thread-safe. Keys are few and fixed (event and reason labels), never raw client input.
class LogRateLimiter {
 public:
  explicit LogRateLimiter(double per_second) : per_second_(per_second) {}
  // Whether to write a line for `key` now; *suppressed receives the lines suppressed since the
  // last one written (0 when none, or when this one is suppressed too).
  bool Allow(absl::string_view key, absl::Time now, int64_t* suppressed);
  bool Allow(absl::string_view key, int64_t* suppressed) { return Allow(key, absl::Now(), suppressed); }
  void set_per_second(double per_second);

 private:
  struct Bucket {
    double tokens = 0;
    absl::Time refilled_at;
    int64_t suppressed = 0;
  };
  absl::Mutex mu_;
  double per_second_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(mu_);
};

// The daemon's limiter (rate from --log_rate_limit, set at start).
LogRateLimiter& DaemonLogLimiter();

// Renders a line without writing it (exposed for tests).
std::string FormatLogValueForTest(LogFormat format, absl::string_view value);

// Swallows the LogEvent expression of the macros below, so they are one expression (safe in an
// unbraced if/else) whose temporary writes the line at the end of the statement.
struct LogVoidify {
  void operator&(const LogEvent&) const {}
};

}  // namespace eldr::server

// Skips building the line entirely when `level` is disabled.
#define ELDR_LOG(level, event)                                    \
  !::eldr::server::LogEnabled(::eldr::server::LogLevel::k##level) \
      ? (void)0                                                   \
      : ::eldr::server::LogVoidify() & ::eldr::server::LogEvent(::eldr::server::LogLevel::k##level, (event))

// ELDR_LOG through DaemonLogLimiter(): at most --log_rate_limit lines a second for `key` (a fixed
// label such as "route_failed/geometry"); a written line carries suppressed=<lines dropped since
// the previous one>, a suppressed one builds nothing.
#define ELDR_LOG_LIMITED(level, event, key)                                                                  \
  !::eldr::server::LogEnabled(::eldr::server::LogLevel::k##level)                                            \
      ? (void)0                                                                                              \
      : ::eldr::server::LogVoidify() & ::eldr::server::LogEvent(::eldr::server::LogLevel::k##level, (event), \
                                                                &::eldr::server::DaemonLogLimiter(), (key))

#endif  // ELDR_SERVER_LOGGING_H_
