// The two-phase request rewriting of eldr-proxy: OpenAI-compatible completions and chat
// completions served by a prefill engine and a decode engine (vLLM's NIXL-connector flow, the
// protocol docs/engine-emulator.md specifies), with the expert counts this project's prefill
// connector attaches (integrations/vllm).
//
//   client body --ParseClientRequest--> ClientRequest
//     --MakePrefillBody--> prefill engine (max_tokens 1, not streamed, do_remote_decode)
//     --ParsePrefillResponse--> PrefillResult {kv_transfer_params, signature, prompt_tokens}
//     (signature -> eldr-router Route)
//     --MakeDecodeBody--> decode engine (the client's body + the prefill's kv_transfer_params)
//
// The request id travels in the X-Request-Id header of both upstream calls (as vLLM's proxy does),
// never in a body. Bodies are rewritten as JSON values: key order is not preserved (keys come out
// sorted) and numbers are re-serialised (integers exactly, floats in shortest round-trip form);
// every other field of the client's body reaches the engines unchanged.
//
// Status codes:
//   ParseClientRequest: INVALID_ARGUMENT (answer 400; the message names the field and is meant
//   for the client) or RESOURCE_EXHAUSTED (the body is larger than allowed: 413).
//   ParsePrefillResponse: FAILED_PRECONDITION (the prefill engine answered without
//   kv_transfer_params) or INTERNAL (its answer is not a JSON object): the prefill engine is at
//   fault, so the client should get 502.
// A missing or unusable expert signature never fails a request: PrefillResult::signature is then
// empty and signature_problem says why, and the request is routed on load alone.
//
// Thread-safety: pure functions; a ClientRequest is a value.
#ifndef ELDR_PROXY_OPENAI_PROTOCOL_H_
#define ELDR_PROXY_OPENAI_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace eldr::proxy {

enum class Endpoint { kCompletions, kChatCompletions };

// "/v1/completions" or "/v1/chat/completions": the path the client used and the engines serve.
absl::string_view EndpointPath(Endpoint endpoint);

// Arrays and objects nested deeper than this are rejected (in client bodies and engine answers),
// so that no body can exhaust the stack of the serialiser.
inline constexpr int kMaxJsonDepth = 128;

// A validated client request.
struct ClientRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  // The client's JSON object, as received (parsed once; MakePrefillBody and MakeDecodeBody copy it).
  nlohmann::json body;
  // What the prefill picker hashes (PrefillPicker::Pick takes its first prefix_bytes):
  //   completions: the prompt text; token-id prompts: the decimal ids joined by ',' ("1,2,3");
  //   chat: for each message in order, "<role>\n<text>\n", where <text> is the content string, or
  //   its text parts concatenated (other parts, such as images, contribute nothing).
  std::string prompt_key;
  // `stream` (absent or null: false), and `stream_options.include_usage` (absent or null: false).
  bool stream = false;
  bool include_usage = false;
  // chat: `max_completion_tokens` when set, else `max_tokens`; completions: `max_tokens`.
  // nullopt when absent or null (the engine then decides).
  std::optional<int64_t> max_tokens;
  // `model`; empty when absent or null.
  std::string model;
};

// Parses and validates a client's body for `endpoint`. Rules (each failure is INVALID_ARGUMENT and
// names the field; a field given as JSON null counts as absent, except `prompt` and `messages`):
//   - at most `max_body_bytes` bytes (else RESOURCE_EXHAUSTED); valid JSON, nested at most
//     kMaxJsonDepth deep; a JSON object;
//   - completions: `prompt` is a non-empty string, or a non-empty array of token ids (integers
//     >= 0), or an array of exactly one of those (an array of several prompts asks for several
//     choices, which the two-phase flow cannot serve);
//   - chat: `messages` is a non-empty array of objects, each with a string `role` and a `content`
//     that is a string or an array of content part objects (each with a string `type`; a "text"
//     part needs a string `text`); `content` may be absent or null for role "assistant" only (a
//     message with tool calls);
//   - `stream`: a boolean; `stream_options`: an object, only when `stream` is true (vLLM's rule),
//     whose `include_usage` is a boolean;
//   - `max_tokens` and (chat) `max_completion_tokens`: integers >= 1;
//   - `n` and (completions) `best_of`: 1 (one choice per request in the two-phase flow);
//   - `model`: a string.
// "Integer" includes a JSON float with an integral value (64.0), which vLLM's pydantic models
// accept too. Every other field passes through untouched.
absl::StatusOr<ClientRequest> ParseClientRequest(Endpoint endpoint, absl::string_view body, size_t max_body_bytes);

// The body for the prefill engine, as vLLM's proxy builds it: a copy of the client's body with
//   kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
//                         "remote_engine_id": null, "remote_block_ids": null,
//                         "remote_host": null, "remote_port": null}
// (replacing any the client sent), stream = false, max_tokens = 1, max_completion_tokens = 1 when
// the client's body has that key, and without stream_options, min_tokens and min_completion_tokens.
std::string MakePrefillBody(const ClientRequest& request);

// An expert signature read from the prefill's kv_transfer_params.
struct Signature {
  // Geometry from eldr_expert_counts; 0 and 0 for eldr_sig, whose geometry is the calibration's
  // (the caller fills ExpertCounts.layers/experts from its configuration then).
  int32_t layers = 0;
  int32_t experts = 0;
  // The counts, little-endian int16, row-major [layers][experts]: ExpertCounts.int16_le as is.
  // Empty when only gate-probability sums came.
  std::string int16_le;
  // Gate-probability sums from eldr_gate_prob_sums, little-endian float32, row-major
  // [layers][experts]: GateProbSums.float32_le as is (empty when none came).
  std::string float32_le;
  // "eldr_expert_counts", "eldr_sig" or "eldr_gate_prob_sums" (only gate sums): which key the
  // counts came from (a metric label).
  std::string source;
};

struct PrefillResult {
  // The prefill's kv_transfer_params without eldr_expert_counts, eldr_sig and eldr_gate_prob_sums:
  // for MakeDecodeBody.
  nlohmann::json kv_transfer_params;
  // The signature for eldr-router's Route; empty when none was attached or none was usable.
  std::optional<Signature> signature;
  // Why a signature payload that was present was not used (empty when there was none, or when it
  // was used). For logs and a rejection counter; never fails the request.
  std::string signature_problem;
  // usage.prompt_tokens of the prefill's answer; 0 when absent or not a non-negative integer.
  int64_t prompt_tokens = 0;
};

// Reads the prefill engine's JSON answer (HTTP 200). A body that is not a JSON object is INTERNAL
// (the engine broke the protocol). kv_transfer_params must be an object, else
// FAILED_PRECONDITION "the prefill engine returned no kv_transfer_params: is it running with a KV
// connector (kv_role kv_producer or kv_both)?". The signature:
//   - `eldr_expert_counts` (preferred): an object with integer `layers` and `experts` in
//     [1, 65536] (layers * experts at most 1 << 24), `encoding` "int16_le", and `data`, strict
//     standard base64 (Base64DecodeStrict) of exactly 2 * layers * experts bytes;
//   - else `eldr_sig`: a strict base64 string of a non-empty, even number of bytes;
//   - every count must be >= 0 (the connector clips to [0, 32767]: a negative value is a corrupt
//     payload, dropped here rather than sent to the router to be rejected there).
//   - `eldr_gate_prob_sums` (also taken beside counts): an object like eldr_expert_counts with
//     `encoding` "float32_le" and 4 * layers * experts bytes of finite, non-negative float32 sums;
//     with counts of eldr_expert_counts its geometry must be theirs.
// A payload breaking a rule is dropped and signature_problem names the rule; when
// eldr_expert_counts is unusable, a usable eldr_sig is still taken (the problem is still reported).
// The three keys are removed from the forwarded kv_transfer_params whatever their content.
absl::StatusOr<PrefillResult> ParsePrefillResponse(absl::string_view body);

// The body for the chosen decode engine: the client's body, unchanged but for kv_transfer_params,
// set to `kv_transfer_params` (PrefillResult::kv_transfer_params).
std::string MakeDecodeBody(const ClientRequest& request, const nlohmann::json& kv_transfer_params);

// Parses `text` as one JSON value (RFC 8259; nlohmann's parser, which also checks UTF-8), with
// arrays and objects nested at most `max_depth` deep (checked before parsing). INVALID_ARGUMENT
// with the parser's position and reason ("parse error at line 1, column 7: ...") or the depth.
absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, int max_depth = kMaxJsonDepth);

// Strict standard base64 (RFC 4648 section 4, the alphabet A-Z a-z 0-9 + /): the length is a
// multiple of 4, '=' padding only at the end (at most two), no whitespace or other characters, and
// the unused bits of the last symbol are zero (the canonical encoding, as Python's base64 and
// absl::Base64Escape write it). absl::Base64Unescape alone would accept whitespace, missing padding
// and non-zero trailing bits. INVALID_ARGUMENT naming the first offending position.
absl::StatusOr<std::string> Base64DecodeStrict(absl::string_view text);

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_OPENAI_PROTOCOL_H_
