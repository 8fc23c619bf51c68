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

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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

// One log line under construction. Keys should be lower_snake_case; values are escaped as needed.
class LogEvent {
 public:
  LogEvent(LogLevel level, absl::string_view event);
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
  std::string line_;
};

// Renders a line without writing it (exposed for tests).
std::string FormatLogValueForTest(LogFormat format, absl::string_view value);

}  // namespace eldr::server

// Skips building the line entirely when `level` is disabled.
#define ELDR_LOG(level, event)                                                  \
  if (!::eldr::server::LogEnabled(::eldr::server::LogLevel::k##level)) {        \
  } else                                                                        \
    ::eldr::server::LogEvent(::eldr::server::LogLevel::k##level, (event))

#endif  // ELDR_SERVER_LOGGING_H_
