// The OpenAI-compatible answer bodies of an engine emulator, exactly as docs/engine-emulator.md
// shows them: prefill answers with kv_transfer_params, streamed chunk events (server-sent
// events), usage events, `data: [DONE]`, and whole non-streamed answers; for /v1/completions and
// /v1/chat/completions.
//
// Streamed events are built by appending to a caller's string (a token event is a handful of
// appends onto a head computed once per request), so a decode step of thousands of requests
// costs one small string per request and nothing else.
//
// Thread-safety: AnswerFormatter is immutable after construction; its methods may be called from
// any thread. The free functions are pure.
#ifndef ELDR_ENGINE_EMU_OPENAI_FORMAT_H_
#define ELDR_ENGINE_EMU_OPENAI_FORMAT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine_emu/request.h"

namespace eldr::engine_emu {

// What carries a prefill answer's expert counts (--signature_key).
enum class SignatureKey {
  kEldrExpertCounts,  // "eldr_expert_counts": {"layers","experts","encoding":"int16_le","data"}
  kEldrSig,           // "eldr_sig": the same base64 bytes as a bare string
  kBoth,              // both entries
  kNone,              // neither (a prefill engine without the capture library)
};

// "eldr_expert_counts", "eldr_sig", "both", "none"; INVALID_ARGUMENT otherwise.
absl::StatusOr<SignatureKey> ParseSignatureKey(absl::string_view text);

// The finish_reason of a request's last token.
enum class FinishReason { kLength, kStop };
absl::string_view FinishReasonName(FinishReason reason);

// Appends the text of the k-th generated token of trace request `trace_index`: " t<N>_<k>".
void AppendTokenText(int trace_index, int64_t k, std::string* out);

// The kv_transfer_params of a prefill answer.
struct PrefillKvParams {
  std::string engine_id;
  std::string request_id;
  std::vector<int64_t> block_ids;
  std::string host;
  int port = 0;
  SignatureKey signature_key = SignatureKey::kEldrExpertCounts;
  int layers = 0;
  int experts = 0;
  std::string counts_base64;  // EncodeCountsBase64 of the prompt's counts
  // EncodeGateProbSumsBase64 of the prompt's counts, sent as eldr_gate_prob_sums
  // ({"layers","experts","encoding":"float32_le","data"}) when not empty (--gate_prob_sums).
  std::string gate_prob_sums_base64;
};

// The bodies of one request.
class AnswerFormatter {
 public:
  // `request_id` is the id without prefix ("cmpl-" / "chatcmpl-" are added); any bytes (escaped).
  AnswerFormatter(ApiKind api, absl::string_view request_id, int64_t created, absl::string_view model);

  ApiKind api() const { return api_; }

  // `data: {...chunk...}\n\n` of one generated token, `text` being its text (AppendTokenText; it
  // is not escaped, so it must need no JSON escaping). `last`: the event carries `finish_reason`.
  void AppendTokenEvent(absl::string_view text, bool last, FinishReason reason, std::string* out) const;
  // Chat only: the first event, `"delta":{"role":"assistant","content":""}`.
  void AppendRoleEvent(std::string* out) const;
  // The usage event (`"choices":[]` and `usage`), for stream_options.include_usage.
  void AppendUsageEvent(int prompt_tokens, int completion_tokens, std::string* out) const;
  // `data: [DONE]\n\n`.
  static void AppendDoneEvent(std::string* out);

  // The whole non-streamed answer: `text` (completions: choices[0].text; chat:
  // choices[0].message.content) and usage; with `kv_params` (a prefill answer) also
  // kv_transfer_params.
  std::string WholeAnswer(absl::string_view text, FinishReason reason, int prompt_tokens, int completion_tokens,
                          const PrefillKvParams* kv_params = nullptr) const;

 private:
  ApiKind api_;
  std::string full_id_;  // "cmpl-<id>" / "chatcmpl-<id>", unescaped
  int64_t created_;
  std::string model_;
  // `data: {"id":"...","object":"...","created":T,"model":"...",` : every event starts with it.
  std::string event_head_;
};

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_OPENAI_FORMAT_H_
