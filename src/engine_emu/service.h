// eldr-engine-emu's server: the HTTP front end (eldr::http::HttpServer with the routes of
// docs/engine-emulator.md) around one engine (PrefillEngine or DecodeEngine) running on its own
// EngineLoop, the KV registry (prefill) or the KV puller over eldr::http::HttpClient (decode), and
// the metrics.
//
// Threads: the server's io threads parse and validate requests and post them to the engine's
// loop; the engine answers through the requests' ResponseStreams; a client that goes away
// (ResponseStream::OnClosed) aborts its request. kv_pull calls are answered on the io threads
// (the registry is thread-safe).
//
// Thread-safety: Create, Start and Stop from one controlling thread; port() and engine_id() from
// any thread once Start returned.
#ifndef ELDR_ENGINE_EMU_SERVICE_H_
#define ELDR_ENGINE_EMU_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "eldr/http/http_client.h"
#include "eldr/http/http_server.h"
#include "engine_emu/decode_engine.h"
#include "engine_emu/engine_loop.h"
#include "engine_emu/kv_registry.h"
#include "engine_emu/metrics.h"
#include "engine_emu/openai_format.h"
#include "engine_emu/prefill_engine.h"

namespace eldr::engine_emu {

struct EmuServiceOptions {
  EngineRole role = EngineRole::kDecode;
  // HTTP address (--listen); port 0 picks a free one.
  std::string listen = "127.0.0.1:0";
  // io threads of the HTTP server (--threads), [1, 256].
  int threads = 1;
  // remote_host in prefill answers (--advertise_host).
  std::string advertise_host = "127.0.0.1";
  // remote_engine_id (--engine_id); empty: a random one.
  std::string engine_id;
  // Catalog, cost model, time scale, model, max_waiting.
  EngineOptions engine;
  // Decode: requests per step at most (--max_batch).
  int max_batch = 64;
  // Prefill: held KV is freed after this (--kv_hold_timeout), real time (not scaled). > 0.
  absl::Duration kv_hold_timeout = absl::Seconds(30);
  // Prefill: what carries the counts (--signature_key).
  SignatureKey signature_key = SignatureKey::kEldrExpertCounts;
  // Prefill: also attach eldr_gate_prob_sums, stand-ins of count / top_k (--gate_prob_sums).
  bool gate_prob_sums = false;
  // Decode: a KV pull that has not answered within this fails the request (503).
  absl::Duration kv_pull_timeout = absl::Seconds(10);
  // HTTP limits: open connections (thousands of concurrent streams) and request body bytes
  // (long prompts).
  int max_connections = 100000;
  size_t max_body_bytes = 16 << 20;
};

// Everything Create checks but the catalog; the message names the flag.
absl::Status ValidateEmuServiceOptions(const EmuServiceOptions& options);

// A random id: 32 lowercase hex digits (as vLLM's request ids). Thread-safe.
std::string RandomHexId();

class EmuService {
 public:
  // Builds the engine and the server (not yet listening). INVALID_ARGUMENT for bad options or a
  // missing catalog.
  static absl::StatusOr<std::unique_ptr<EmuService>> Create(EmuServiceOptions options);
  EmuService(const EmuService&) = delete;
  EmuService& operator=(const EmuService&) = delete;
  // Stop()s.
  ~EmuService();

  // Listens and starts the engine. UNAVAILABLE when the address cannot be bound.
  absl::Status Start();
  // Stops accepting and closes every connection (requests in flight end without an answer), then
  // stops the engine. Idempotent.
  void Stop();

  int port() const;
  const std::string& engine_id() const { return engine_id_; }

 private:
  class HttpKvPuller;

  explicit EmuService(EmuServiceOptions options);
  http::HttpRouter MakeRouter();
  void ServeGenerate(ApiKind api, http::HttpRequest request, std::shared_ptr<http::ResponseStream> stream);
  http::HttpResponse ServeKvPull(const http::HttpRequest& request);
  http::HttpResponse ServeModels() const;

  const EmuServiceOptions options_;
  std::string engine_id_;
  RequestParserOptions parser_options_;
  int64_t started_unix_s_ = 0;
  std::atomic<uint64_t> next_handle_{1};

  // Destroyed in reverse order: the server (no handler runs afterwards), then the client (no
  // pull completes afterwards), then the engine, and the loop last.
  EngineLoop loop_;
  std::unique_ptr<EmuMetrics> metrics_;
  std::unique_ptr<KvRegistry> registry_;
  std::unique_ptr<Engine> engine_;
  PrefillEngine* prefill_ = nullptr;  // engine_, prefill role
  std::unique_ptr<http::HttpClient> client_;
  std::unique_ptr<HttpKvPuller> puller_;
  std::unique_ptr<http::HttpServer> server_;
  bool stopped_ = false;
};

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_SERVICE_H_
