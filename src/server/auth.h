// Credentials of the daemon's callers: bearer tokens read from files (admin, data plane, per-worker
// reporter tokens), and the identities a client certificate carries (mutual TLS).
//
// Tokens are compared in constant time, are re-read by Reload (SIGHUP) and keep the previous
// value when a reload fails. Nothing here logs or returns a token.
//
// Thread-safety: every method may be called from any thread; Reload runs while checks happen.
#ifndef ELDR_SERVER_AUTH_H_
#define ELDR_SERVER_AUTH_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"

namespace eldr::server {

// Compares without early exit: the time taken depends only on the length of `expected`.
bool ConstantTimeEquals(absl::string_view expected, absl::string_view given);

// The bearer token of a call (`authorization: Bearer <token>`, scheme case-insensitive), or
// UNAUTHENTICATED saying what is missing.
absl::StatusOr<std::string> BearerTokenOf(const grpc::ServerContextBase& context);

// One bearer token kept in a file (surrounding whitespace ignored). `setting` names the flag in
// messages ("admin_token_file").
class BearerTokenFile {
 public:
  // Empty `path`: disabled (Check always passes). Otherwise the file must hold a non-empty token.
  static absl::StatusOr<std::unique_ptr<BearerTokenFile>> Create(std::string setting, std::string path);

  bool enabled() const { return !path_.empty(); }
  // Re-reads the file; on error the previous token stays in force.
  absl::Status Reload();
  // OK; UNAUTHENTICATED without a bearer token; PERMISSION_DENIED for a wrong one.
  absl::Status Check(const grpc::ServerContextBase& context) const;

 private:
  BearerTokenFile(std::string setting, std::string path) : setting_(std::move(setting)), path_(std::move(path)) {}

  const std::string setting_;
  const std::string path_;
  mutable absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
};

// Per-worker reporter tokens: a JSON object {"<worker id>": "<token>", ...} (reporter_auth=token).
class WorkerTokenFile {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerTokenFile>> Create(std::string path);
  absl::Status Reload();
  // Whether `token` is the token of `worker_id` (constant time in the stored token's length).
  bool Matches(absl::string_view worker_id, absl::string_view token) const;

 private:
  explicit WorkerTokenFile(std::string path) : path_(std::move(path)) {}

  const std::string path_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> tokens_ ABSL_GUARDED_BY(mu_);
};

// The identities of a verified client certificate: its subject common name and its DNS subject
// alternative names. Empty without mutual TLS.
std::vector<std::string> PeerCertificateIdentities(const grpc::ServerContextBase& context);

// A stable name for the caller, for per-client accounting (refit window admission, stream limits):
// with `mutual_tls`, the verified certificate's first identity; otherwise (or without one) the
// peer address without its port ("ipv4:10.0.0.7"), so one host's many connections count as one.
std::string ClientKey(const grpc::ServerContextBase& context, bool mutual_tls);

}  // namespace eldr::server

#endif  // ELDR_SERVER_AUTH_H_
