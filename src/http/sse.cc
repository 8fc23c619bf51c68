#include "eldr/http/sse.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace eldr::http {
namespace {

constexpr absl::string_view kByteOrderMark = "\xEF\xBB\xBF";

bool AllDigits(absl::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return absl::ascii_isdigit(c); });
}

}  // namespace

SseParser::SseParser(size_t max_event_bytes) : max_event_bytes_(max_event_bytes) {}

// What counts against max_event_bytes and pending_bytes: the current line as received, and the
// values the current event holds so far (event type, data lines with their joining LFs, id);
// field names, comments and line terminators are not kept and do not count.
size_t SseParser::pending_bytes() const {
  return line_.size() + current_.event.size() + current_.data.size() + current_.id.size();
}

absl::Status SseParser::Feed(absl::string_view bytes, const std::function<void(const SseEvent&)>& on_event) {
  if (failed_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "server-sent event stream failed earlier: an event or a line exceeded ", max_event_bytes_, " bytes"));
  }
  const auto fail = [this](absl::string_view what) {
    failed_ = true;
    line_.clear();
    current_ = SseEvent();
    has_data_ = false;
    return absl::ResourceExhaustedError(
        absl::StrCat("server-sent event stream: ", what, " exceeds ", max_event_bytes_, " bytes"));
  };
  const auto event_bytes = [this] { return current_.event.size() + current_.data.size() + current_.id.size(); };

  // One complete line (without its terminator).
  const auto process_line = [&](absl::string_view line) -> bool {
    if (line.empty()) {
      if (has_data_ && on_event) on_event(current_);
      current_ = SseEvent();
      has_data_ = false;
      return true;
    }
    if (line.front() == ':') return true;  // a comment
    absl::string_view field = line, value;
    const size_t colon = line.find(':');
    if (colon != absl::string_view::npos) {
      field = line.substr(0, colon);
      value = line.substr(colon + 1);
      if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    }
    if (field == "data") {
      if (event_bytes() + value.size() + (has_data_ ? 1 : 0) > max_event_bytes_) return false;
      if (has_data_) current_.data.push_back('\n');
      current_.data.append(value.data(), value.size());
      has_data_ = true;
    } else if (field == "event") {
      if (event_bytes() - current_.event.size() + value.size() > max_event_bytes_) return false;
      current_.event.assign(value.data(), value.size());
    } else if (field == "id") {
      // The standard ignores an id holding NUL.
      if (value.find('\0') == absl::string_view::npos) {
        if (event_bytes() - current_.id.size() + value.size() > max_event_bytes_) return false;
        current_.id.assign(value.data(), value.size());
      }
    } else if (field == "retry") {
      int64_t retry = 0;
      if (AllDigits(value) && absl::SimpleAtoi(value, &retry)) current_.retry_ms = retry;
    }
    return true;
  };

  while (!bytes.empty()) {
    if (!started_) {
      // A leading byte order mark, possibly split over pieces: its bytes wait in line_ until it is
      // complete (dropped) or a byte differs (they were the start of the first line).
      if (bytes.front() == kByteOrderMark[line_.size()]) {
        line_.push_back(bytes.front());
        bytes.remove_prefix(1);
        if (line_.size() == kByteOrderMark.size()) {
          line_.clear();
          started_ = true;
        }
        continue;
      }
      started_ = true;
    }
    if (last_was_cr_) {
      last_was_cr_ = false;
      if (bytes.front() == '\n') {
        bytes.remove_prefix(1);
        continue;
      }
    }
    const size_t end = bytes.find_first_of("\r\n");
    if (end == absl::string_view::npos) {
      if (line_.size() + bytes.size() > max_event_bytes_) return fail("a line");
      line_.append(bytes.data(), bytes.size());
      return absl::OkStatus();
    }
    if (line_.size() + end > max_event_bytes_) return fail("a line");
    bool fits;
    if (line_.empty()) {
      fits = process_line(bytes.substr(0, end));
    } else {
      line_.append(bytes.data(), end);
      const std::string line = std::move(line_);
      line_.clear();
      fits = process_line(line);
    }
    if (!fits) return fail("an event");
    last_was_cr_ = bytes[end] == '\r';
    bytes.remove_prefix(end + 1);
  }
  return absl::OkStatus();
}

std::string SseDataEvent(absl::string_view payload) {
  std::string event;
  event.reserve(payload.size() + 8);
  for (;;) {
    const size_t end = payload.find_first_of("\r\n");
    event += "data: ";
    if (end == absl::string_view::npos) {
      event.append(payload.data(), payload.size());
      event += "\n\n";
      return event;
    }
    event.append(payload.data(), end);
    event += '\n';
    const bool crlf = payload[end] == '\r' && end + 1 < payload.size() && payload[end + 1] == '\n';
    payload.remove_prefix(end + (crlf ? 2 : 1));
  }
}

}  // namespace eldr::http
