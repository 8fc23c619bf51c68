// The bodies of ELDR's fuzz targets: one function per parser that takes outside bytes.
//
// Each body feeds the bytes to the parser and checks the invariants a successful parse promises
// (round trips, unit norms, sizes); a broken invariant aborts with a message, which libFuzzer
// reports as a crash. The bodies are a plain library so that the same code runs under libFuzzer
// (fuzz/fuzz_main.cc, clang builds with ELDR_BUILD_FUZZERS=ON) and in the ordinary unit test that
// replays the seed corpora and the kept crashing inputs (tests/loadsignals/fuzz_replay_test.cc).
#ifndef ELDR_FUZZ_FUZZ_TARGETS_H_
#define ELDR_FUZZ_FUZZ_TARGETS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace eldr::fuzz {

// SignatureTransform::Create + Apply/Weighted on every wire encoding (int16 LE bytes, int32,
// gate-probability floats, transformed vectors), with a spec and claimed geometry drawn from the
// first bytes.
int FuzzSignature(const uint8_t* data, size_t size);
// ParseCentroidArtifact (JSON); a success must serialise and parse back to the same artifact.
int FuzzCentroidArtifact(const uint8_t* data, size_t size);
// ParsePromText with and without a kept-metrics filter (they must agree), and EngineLoadFromPage.
int FuzzPromText(const uint8_t* data, size_t size);
// ParseNpy; a success must hold exactly elements x item size bytes.
int FuzzNpy(const uint8_t* data, size_t size);
// The daemon's worker list parser (JSON file contents).
int FuzzWorkerFile(const uint8_t* data, size_t size);
// The daemon's config file parser (JSON) and the flag-syntax setter (`key=value`).
int FuzzConfig(const uint8_t* data, size_t size);
// A serialized eldr.v1.RouteRequest through the daemon's conversion (SignatureFromProto) and a
// transform.
int FuzzRouteRequest(const uint8_t* data, size_t size);

// ParseHttpRequest (the HTTP server's request parser and checks) with the server's default limits
// and tight ones: a success must satisfy what the parser promises (origin-form target, tokens,
// clean header values, body within the limit), tighter limits may only refuse more (and only as
// RESOURCE_EXHAUSTED), and a canonical re-serialisation must parse back to the same request.
int FuzzHttpRequest(const uint8_t* data, size_t size);

#ifdef ELDR_FUZZ_HAVE_PROXY
// eldr-proxy's client request rules (ParseClientRequest; the first byte picks completions or chat,
// the rest is the body): a refusal is INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a message; an
// accepted request yields a prefill body (JSON object, max_tokens 1, not streamed, do_remote_decode)
// and a decode body that parses back to the same request with the kv_transfer_params it was given.
int FuzzOpenAiRequest(const uint8_t* data, size_t size);

// A prefill engine's answer through ParsePrefillResponse: refusals are INTERNAL or
// FAILED_PRECONDITION; an accepted answer never forwards eldr_expert_counts or eldr_sig, and a
// signature it takes is non-empty, whole int16 values (exactly layers x experts of them when the
// geometry is given), none negative.
int FuzzPrefillResponse(const uint8_t* data, size_t size);

// A decode engine's event stream: SseParser fed in pieces (sizes drawn from the input) dispatches
// exactly the events it dispatches on the whole stream, and DecodeStreamObserver's counts over them
// stay consistent (tokens and malformed events at most the events, output tokens never negative).
int FuzzSseStream(const uint8_t* data, size_t size);
#endif

struct FuzzTarget {
  const char* name;  // fuzz_<name> is the libFuzzer binary; fuzz/corpus/<name>/ its seeds
  int (*body)(const uint8_t* data, size_t size);
};

// Every target built into this library, in a fixed order.
const std::vector<FuzzTarget>& AllFuzzTargets();

}  // namespace eldr::fuzz

#endif  // ELDR_FUZZ_FUZZ_TARGETS_H_
