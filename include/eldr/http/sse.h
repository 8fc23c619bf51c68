// Server-sent events (text/event-stream, WHATWG HTML "Server-sent events", section 9.2.6), the
// framing of OpenAI-compatible streaming responses ("data: {...}\n\n" ... "data: [DONE]\n\n").
//
// SseParser turns a byte stream, fed in arbitrary pieces, into events: lines end with LF, CRLF or
// CR; "field: value" lines (one optional space after the colon stripped) accumulate into the
// current event; a blank line dispatches it; lines starting with ':' are comments; `data` lines
// are joined with LF; a leading UTF-8 BOM is skipped; an event with no data is not dispatched
// (as the standard says), and bytes after the last blank line stay pending until more arrive.
// Unknown fields are ignored. `retry` is parsed into SseEvent::retry_ms when all digits.
//
// Thread-safety: none (one parser per stream).
#ifndef ELDR_HTTP_SSE_H_
#define ELDR_HTTP_SSE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace eldr::http {

struct SseEvent {
  std::string event;  // the `event` field; empty means "message"
  std::string data;   // the `data` lines joined with LF
  std::string id;     // the `id` field of this event, if any
  std::optional<int64_t> retry_ms;
};

class SseParser {
 public:
  // An event (its fields together) or a line longer than `max_event_bytes` makes Feed fail with
  // RESOURCE_EXHAUSTED; the parser then stays failed.
  explicit SseParser(size_t max_event_bytes = 1 << 20);

  // Consumes `bytes`, calling `on_event` for every event completed by them, in order. Returns the
  // failure above, else OK.
  absl::Status Feed(absl::string_view bytes, const std::function<void(const SseEvent&)>& on_event);

  // Bytes received but not yet part of a dispatched event.
  size_t pending_bytes() const;

 private:
  size_t max_event_bytes_;
  std::string line_;  // the incomplete current line
  bool last_was_cr_ = false;
  bool started_ = false;  // BOM check done
  bool failed_ = false;
  SseEvent current_;
  bool has_data_ = false;
};

// "data: <payload>\n\n" for one JSON payload (no LF inside: a payload with LFs is split into
// several data lines, which a parser joins back).
std::string SseDataEvent(absl::string_view payload);

}  // namespace eldr::http

#endif  // ELDR_HTTP_SSE_H_
