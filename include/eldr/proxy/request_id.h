// Request ids of eldr-proxy: the id a request carries through the prefill engine, eldr-router
// (RouteRequest.request_id) and the decode engine (the X-Request-Id header of both upstream calls),
// and on which the A/B split is decided.
//
// Thread-safety: both functions may run concurrently.
#ifndef ELDR_PROXY_REQUEST_ID_H_
#define ELDR_PROXY_REQUEST_ID_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace eldr::proxy {

// Longest request id accepted (eldr-router's limit on RouteRequest.request_id).
inline constexpr size_t kMaxRequestIdBytes = 256;

// A fresh id: 32 lowercase hex digits of 128 bits from the kernel's random source (getrandom(2);
// a per-thread generator seeded from it if the call is unavailable). vLLM prefixes its own
// ("cmpl-", "chatcmpl-") to the X-Request-Id it receives.
std::string NewRequestId();

// Whether a client-supplied id (an X-Request-Id header) can be used as is: 1 to kMaxRequestIdBytes
// bytes of visible ASCII (0x21-0x7e), so that it is safe in a header, a log line and the router's
// request_id. INVALID_ARGUMENT saying which rule it breaks.
absl::Status ValidateRequestId(absl::string_view id);

}  // namespace eldr::proxy

#endif  // ELDR_PROXY_REQUEST_ID_H_
