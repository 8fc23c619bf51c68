// What eldr-proxy learns from a decode engine's answer while passing it to the client unchanged:
// when the first token arrived (TTFT), how many tokens came (TPOT, and output_tokens for the
// router's Complete), whether the stream ended with [DONE] or an error. (The error bodies and
// events the proxy itself sends are eldr/openai/errors.h's.)
//
// Streamed answers are OpenAI chunk events ("data: {...}\n\n", docs/engine-emulator.md), parsed
// by eldr::http::SseParser (include/eldr/http/sse.h) and handed to DecodeStreamObserver one event
// at a time.
//
// Thread-safety: DecodeStreamObserver is not thread-safe (one per stream; the HTTP client runs a
// call's callbacks one at a time). The free functions are pure.
#ifndef ELDR_PROXY_STREAM_ACCOUNTING_H_
#define ELDR_PROXY_STREAM_ACCOUNTING_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "eldr/http/sse.h"

namespace eldr::proxy {

// What one event carried.
struct DecodeEventInfo {
  // A generated piece: non-empty choices[i].text (completions), or choices[i].delta.content,
  // .reasoning_content, .reasoning, or a non-empty .tool_calls (chat), for any choice i.
  bool token = false;
  // This event carried the stream's first token (measure TTFT here).
  bool first_token = false;
  // usage.completion_tokens was present (vLLM's final usage chunk, with "choices": [], or
  // continuous usage stats on every chunk).
  bool usage = false;
  // The data was "[DONE]".
  bool done = false;
  // An error object: {"error": ...} (OpenAI, newer vLLM) or {"object": "error", ...} (older vLLM).
  bool error = false;
  // The data is neither [DONE] nor a JSON object: counted and otherwise ignored.
  bool malformed = false;
};

class DecodeStreamObserver {
 public:
  DecodeStreamObserver() = default;

  // Observes one event's data (the `data` lines, joined with LF; SseEvent::data).
  DecodeEventInfo OnEventData(absl::string_view data);
  DecodeEventInfo OnEvent(const eldr::http::SseEvent& event) { return OnEventData(event.data); }

  // Events observed, and of them: with a token, malformed.
  int64_t events() const { return events_; }
  int64_t token_events() const { return token_events_; }
  int64_t malformed_events() const { return malformed_events_; }
  bool first_token_seen() const { return token_events_ > 0; }
  // The last usage.completion_tokens seen (cumulative in vLLM's continuous usage stats).
  std::optional<int64_t> usage_completion_tokens() const { return usage_completion_tokens_; }
  std::optional<int64_t> usage_prompt_tokens() const { return usage_prompt_tokens_; }
  // usage.completion_tokens when seen, else the token events (a lower-bound estimate: an engine may
  // put several tokens in one event, and stop strings hide some).
  int64_t output_tokens() const { return usage_completion_tokens_.value_or(token_events_); }
  // The last non-null choices[0].finish_reason ("stop", "length", "abort", ...); empty until one.
  const std::string& finish_reason() const { return finish_reason_; }
  bool done_seen() const { return done_seen_; }
  bool error_seen() const { return error_seen_; }
  // The first error's message (error.message or message; the raw data when neither is a string).
  const std::string& error_message() const { return error_message_; }

 private:
  int64_t events_ = 0;
  int64_t token_events_ = 0;
  int64_t malformed_events_ = 0;
  std::optional<int64_t> usage_completion_tokens_;
  std::optional<int64_t> usage_prompt_tokens_;
  std::string finish_reason_;
  bool done_seen_ = false;
  bool error_seen_ = false;
  std::string error_message_;
};

// Output tokens of a non-streamed answer.
struct ResponseTokens {
  // usage.completion_tokens; 0 when the answer has no usage.
  int64_t output_tokens = 0;
  // Whether usage.completion_tokens was present (a non-negative integer).
  bool from_usage = false;
};

// Reads usage.completion_tokens from a decode engine's JSON answer. INVALID_ARGUMENT when the
// body is not a JSON object; an answer without usage is OK with from_usage false.
absl::StatusOr<ResponseTokens> OutputTokensOfResponse(absl::string_view body);

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_STREAM_ACCOUNTING_H_
