// Requests to an engine emulator: parsing and validating the OpenAI-compatible request bodies of
// /v1/completions and /v1/chat/completions (the fields of docs/engine-emulator.md), and vLLM's
// error answers.
//
// Errors are absl::Status values whose code selects the HTTP status (HttpStatusForError):
// INVALID_ARGUMENT 400, NOT_FOUND 404, FAILED_PRECONDITION 409, RESOURCE_EXHAUSTED 429,
// UNAVAILABLE 503, anything else 500; the message is the answer's `message`.
//
// Thread-safety: every function is pure and may be called from any thread.
#ifndef ELDR_ENGINE_EMU_REQUEST_H_
#define ELDR_ENGINE_EMU_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "eldr/http/http_server.h"
#include "engine_emu/catalog.h"

namespace eldr::engine_emu {

enum class EngineRole { kPrefill, kDecode };
enum class ApiKind { kCompletions, kChat };

// "prefill" / "decode"; "completions" / "chat".
absl::string_view RoleName(EngineRole role);
absl::string_view ApiName(ApiKind api);

// Where a decode request's KV is held: the `remote_*` fields of a prefill answer's
// kv_transfer_params.
struct RemotePrefill {
  std::string engine_id;
  std::string request_id;
  std::vector<int64_t> block_ids;
  std::string host;
  int port = 0;
};

// A validated request.
struct EngineRequest {
  ApiKind api = ApiKind::kCompletions;
  // The request id (X-Request-Id, or a random one): set by the caller, not by the parser.
  std::string id;
  // Unix seconds of the arrival, the answers' `created`: set by the caller.
  int64_t created = 0;
  // The evaluation-pool index the prompt names (TraceCatalog::IndexForPrompt).
  int trace_index = 0;
  // `max_tokens` (chat: `max_completion_tokens` first), >= 1; nullopt when absent or null.
  std::optional<int> max_tokens;
  bool stream = false;
  // stream_options.include_usage (only meaningful with `stream`).
  bool include_usage = false;
  // Decode role: set when kv_transfer_params.do_remote_prefill is true.
  std::optional<RemotePrefill> remote_prefill;
};

struct RequestParserOptions {
  EngineRole role = EngineRole::kDecode;
  // The served model name (--model): a request's `model`, when present, must equal it.
  std::string model = "deepseek-v2-lite-esft";
  // The context length a request must fit in (prompt tokens of the trace request + max_tokens),
  // as vLLM's max_model_len; /v1/models announces it.
  int max_model_len = 32768;
};

// Parses `body` for `api`. Errors (the message is what the client reads):
//   INVALID_ARGUMENT  the body is not JSON or not an object; a field of the wrong type; a missing or
//                     empty prompt (completions: `prompt`, a string or a non-empty array of
//                     strings whose first is used; chat: the `content` strings of `messages`);
//                     max_tokens < 1 or beyond max_model_len; prefill role without
//                     kv_transfer_params.do_remote_decode == true; decode role with
//                     do_remote_prefill == true but incomplete or malformed remote_* fields
//   NOT_FOUND         `model` present and not the served one ("The model `X` does not exist.")
absl::StatusOr<EngineRequest> ParseEngineRequest(const RequestParserOptions& options, const TraceCatalog& catalog,
                                                 ApiKind api, absl::string_view body);

// The HTTP status of an error (see the top of this file).
int HttpStatusForError(const absl::Status& status);

// vLLM's error body: {"object":"error","message":...,"type":...,"param":null,"code":N}, with the
// type of the status (400 BadRequestError, 404 NotFoundError, 409 ConflictError, 429
// TooManyRequestsError, 500 InternalServerError, 503 ServiceUnavailableError).
std::string ErrorBody(const absl::Status& status);

// A whole JSON answer with `status` and `body`, and X-Request-Id when `request_id` is not empty.
http::HttpResponse JsonResponse(int status, std::string body, absl::string_view request_id);

// JsonResponse(HttpStatusForError(status), ErrorBody(status), request_id).
http::HttpResponse ErrorResponse(const absl::Status& status, absl::string_view request_id);

// Escapes `text` as the inside of a JSON string (without the quotes).
std::string JsonEscape(absl::string_view text);

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_REQUEST_H_
