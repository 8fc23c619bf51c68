#include "server/logging.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace eldr::server {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> g_format{static_cast<int>(LogFormat::kKeyValue)};
std::atomic<int> g_fd{2};
std::mutex g_write_mu;

void AppendJsonString(absl::string_view value, std::string* out) {
  out->push_back('"');
  for (unsigned char c : value) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", c);
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

// key=value values are bare when they are non-empty and hold no space, quote, '=' or control
// character; otherwise they are quoted with JSON escaping, which every logfmt parser accepts.
void AppendKvValue(absl::string_view value, std::string* out) {
  bool bare = !value.empty();
  for (unsigned char c : value) {
    if (c <= ' ' || c == '"' || c == '=' || c == '\\' || c == 0x7f) {
      bare = false;
      break;
    }
  }
  if (bare) {
    out->append(value.data(), value.size());
  } else {
    AppendJsonString(value, out);
  }
}

std::string Timestamp() { return absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::Now(), absl::UTCTimeZone()); }

}  // namespace

absl::StatusOr<LogLevel> ParseLogLevel(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "debug") return LogLevel::kDebug;
  if (lower == "info") return LogLevel::kInfo;
  if (lower == "warning" || lower == "warn") return LogLevel::kWarning;
  if (lower == "error") return LogLevel::kError;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown log level '", name, "' (expected debug, info, warning or error)"));
}

absl::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
  }
  return "info";
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  if (lower == "kv" || lower == "keyvalue" || lower == "logfmt") return LogFormat::kKeyValue;
  if (lower == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(absl::StrCat("unknown log format '", name, "' (expected kv or json)"));
}

absl::string_view LogFormatName(LogFormat format) { return format == LogFormat::kJson ? "json" : "kv"; }

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }
void SetLogFormat(LogFormat format) { g_format.store(static_cast<int>(format), std::memory_order_relaxed); }
bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed); }
void SetLogFd(int fd) { g_fd.store(fd, std::memory_order_relaxed); }

LogEvent::LogEvent(LogLevel level, absl::string_view event)
    : format_(static_cast<LogFormat>(g_format.load(std::memory_order_relaxed))) {
  line_.reserve(160);
  if (format_ == LogFormat::kJson) {
    absl::StrAppend(&line_, "{\"ts\":\"", Timestamp(), "\",\"level\":\"", LogLevelName(level), "\",\"event\":");
    AppendJsonString(event, &line_);
  } else {
    absl::StrAppend(&line_, "ts=", Timestamp(), " level=", LogLevelName(level), " event=");
    AppendKvValue(event, &line_);
  }
}

LogEvent::LogEvent(LogLevel level, absl::string_view event, LogRateLimiter* limiter, absl::string_view key)
    : LogEvent(level, event) {
  int64_t suppressed = 0;
  if (!limiter->Allow(key, &suppressed)) {
    enabled_ = false;
    return;
  }
  if (suppressed > 0) WithInteger("suppressed", suppressed, /*is_signed=*/true);
}

LogEvent::~LogEvent() {
  if (!enabled_) return;
  line_.append(format_ == LogFormat::kJson ? "}\n" : "\n");
  std::lock_guard<std::mutex> lock(g_write_mu);
  const int fd = g_fd.load(std::memory_order_relaxed);
  const char* data = line_.data();
  size_t left = line_.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, data, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // nowhere to report a failing log sink
    }
    data += n;
    left -= static_cast<size_t>(n);
  }
}

LogEvent& LogEvent::With(absl::string_view key, absl::string_view value) {
  if (!enabled_) return *this;
  if (format_ == LogFormat::kJson) {
    line_.push_back(',');
    AppendJsonString(key, &line_);
    line_.push_back(':');
    AppendJsonString(value, &line_);
  } else {
    line_.push_back(' ');
    line_.append(key.data(), key.size()).push_back('=');
    AppendKvValue(value, &line_);
  }
  return *this;
}

LogEvent& LogEvent::WithRaw(absl::string_view key, absl::string_view literal) {
  if (!enabled_) return *this;
  if (format_ == LogFormat::kJson) {
    line_.push_back(',');
    AppendJsonString(key, &line_);
    line_.push_back(':');
  } else {
    line_.push_back(' ');
    line_.append(key.data(), key.size()).push_back('=');
  }
  line_.append(literal.data(), literal.size());
  return *this;
}

LogEvent& LogEvent::With(absl::string_view key, bool value) { return WithRaw(key, value ? "true" : "false"); }

LogEvent& LogEvent::With(absl::string_view key, double value) {
  if (!std::isfinite(value)) return With(key, absl::string_view(absl::StrCat(value)));
  return WithRaw(key, absl::StrFormat("%.6g", value));
}

LogEvent& LogEvent::With(absl::string_view key, absl::Duration value) {
  return With(key, absl::string_view(absl::FormatDuration(value)));
}

LogEvent& LogEvent::With(absl::string_view key, const absl::Status& status) {
  With(key, absl::string_view(absl::StatusCodeToString(status.code())));
  if (!status.ok()) With("error", status.message());
  return *this;
}

LogEvent& LogEvent::WithInteger(absl::string_view key, int64_t value, bool is_signed) {
  return WithRaw(key, is_signed ? absl::StrCat(value) : absl::StrCat(static_cast<uint64_t>(value)));
}

std::string FormatLogValueForTest(LogFormat format, absl::string_view value) {
  std::string out;
  if (format == LogFormat::kJson) {
    AppendJsonString(value, &out);
  } else {
    AppendKvValue(value, &out);
  }
  return out;
}

bool LogRateLimiter::Allow(absl::string_view key, absl::Time now, int64_t* suppressed) {
  absl::MutexLock lock(&mu_);
  auto [it, created] = buckets_.try_emplace(key);
  Bucket& bucket = it->second;
  if (created) {
    bucket.tokens = per_second_;
    bucket.refilled_at = now;
  } else if (now > bucket.refilled_at) {
    bucket.tokens =
        std::min(per_second_, bucket.tokens + per_second_ * absl::ToDoubleSeconds(now - bucket.refilled_at));
    bucket.refilled_at = now;
  }
  if (bucket.tokens < 1) {
    ++bucket.suppressed;
    *suppressed = 0;
    return false;
  }
  bucket.tokens -= 1;
  *suppressed = bucket.suppressed;
  bucket.suppressed = 0;
  return true;
}

void LogRateLimiter::set_per_second(double per_second) {
  absl::MutexLock lock(&mu_);
  per_second_ = per_second;
}

LogRateLimiter& DaemonLogLimiter() {
  static auto* limiter = new LogRateLimiter(10);
  return *limiter;
}

}  // namespace eldr::server
