// The error vocabulary of the OpenAI-compatible HTTP API as vLLM speaks it, shared by eldr-proxy
// (its own refusals, and failures in the middle of a stream) and eldr-engine-emu (the engine's
// refusals): one body shape, one table from HTTP status to error type.
//
// Thread-safety: pure functions.
#ifndef ELDR_OPENAI_ERRORS_H_
#define ELDR_OPENAI_ERRORS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace eldr::openai {

// The `type` of vLLM's error bodies for an HTTP status: 400 and other 4xx "BadRequestError",
// 401 "AuthenticationError", 403 "PermissionDeniedError", 404 "NotFoundError", 409
// "ConflictError", 429 "TooManyRequestsError", 502/503/504 "ServiceUnavailableError", 500 and
// anything else "InternalServerError".
absl::string_view ErrorTypeForStatus(int http_status);

// vLLM's error body, fields in its order:
//   {"object":"error","message":<message>,"type":ErrorTypeForStatus(status),"param":null,"code":<status>}
// OpenAI's clients read it (openai-python takes the message from the body, the class from the
// status). Invalid UTF-8 in `message` (a client's bytes quoted back) is replaced, never an error.
std::string ErrorBody(int http_status, absl::string_view message);

// The events that end a stream whose head was already sent, when the answer cannot go on (only
// the body can still say it):
//   data: {"error":{"message":<message>,"type":<type>,"param":null,"code":<code>}}\n\n
//   data: [DONE]\n\n
// This is what vLLM sends for an error during a stream. openai-python raises APIError on a chunk
// whose `error` is set (it checks before reading choices); clients that do not look for it still
// see [DONE] and end cleanly instead of hanging or failing to parse.
std::string SseErrorEvent(absl::string_view message, absl::string_view type, int code);

}  // namespace eldr::openai

#endif  // ELDR_OPENAI_ERRORS_H_
