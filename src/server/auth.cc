#include "server/auth.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "nlohmann/json.hpp"

namespace eldr::server {
namespace {

// Token files are small; anything larger is a wrong path.
constexpr size_t kMaxTokenFileBytes = 64 << 10;

}  // namespace

bool ConstantTimeEquals(absl::string_view expected, absl::string_view given) {
  // Every byte of `expected` is visited whatever `given` holds; a length mismatch is folded into
  // the accumulator instead of returning early.
  volatile unsigned char diff = expected.size() == given.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff = diff | static_cast<unsigned char>(static_cast<unsigned char>(expected[i]) ^ g);
  }
  return diff == 0;
}

absl::StatusOr<std::string> BearerTokenOf(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  const auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError("this RPC needs the metadata 'authorization: Bearer <token>'");
  }
  absl::string_view value(it->second.data(), it->second.size());
  value = absl::StripAsciiWhitespace(value);
  // The scheme is case-insensitive (RFC 7235).
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) {
    return absl::UnauthenticatedError("the authorization metadata is not a bearer token");
  }
  return std::string(absl::StripLeadingAsciiWhitespace(value.substr(7)));
}

absl::StatusOr<std::unique_ptr<BearerTokenFile>> BearerTokenFile::Create(std::string setting, std::string path) {
  std::unique_ptr<BearerTokenFile> file(new BearerTokenFile(std::move(setting), std::move(path)));
  if (file->enabled()) ELDR_RETURN_IF_ERROR(file->Reload());
  return file;
}

absl::Status BearerTokenFile::Reload() {
  if (!enabled()) return absl::OkStatus();
  absl::StatusOr<std::string> text = ReadFile(path_, kMaxTokenFileBytes);
  if (!text.ok()) return absl::Status(text.status().code(), absl::StrCat(setting_, ": ", text.status().message()));
  const absl::string_view token = absl::StripAsciiWhitespace(*text);
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(setting_, " ", path_, ": the token is empty"));
  absl::MutexLock lock(&mu_);
  token_ = std::string(token);
  return absl::OkStatus();
}

absl::Status BearerTokenFile::Check(const grpc::ServerContextBase& context) const {
  if (!enabled()) return absl::OkStatus();
  ELDR_ASSIGN_OR_RETURN(const std::string given, BearerTokenOf(context));
  absl::MutexLock lock(&mu_);
  if (!ConstantTimeEquals(token_, given)) return absl::PermissionDeniedError("wrong bearer token");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WorkerTokenFile>> WorkerTokenFile::Create(std::string path) {
  std::unique_ptr<WorkerTokenFile> file(new WorkerTokenFile(std::move(path)));
  ELDR_RETURN_IF_ERROR(file->Reload());
  return file;
}

absl::Status WorkerTokenFile::Reload() {
  absl::StatusOr<std::string> text = ReadFile(path_, kMaxTokenFileBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(), absl::StrCat("reporter_tokens_file: ", text.status().message()));
  }
  const nlohmann::json root = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reporter_tokens_file ", path_, ": expected a JSON object {\"worker id\": \"token\"}"));
  }
  absl::flat_hash_map<std::string, std::string> tokens;
  for (const auto& [worker, token] : root.items()) {
    if (!token.is_string() || absl::StripAsciiWhitespace(token.get<std::string>()).empty()) {
      return absl::InvalidArgumentError(absl::StrCat("reporter_tokens_file ", path_, ": the token of worker '", worker,
                                                     "' must be a non-empty string"));
    }
    tokens[worker] = std::string(absl::StripAsciiWhitespace(token.get<std::string>()));
  }
  absl::MutexLock lock(&mu_);
  tokens_ = std::move(tokens);
  return absl::OkStatus();
}

bool WorkerTokenFile::Matches(absl::string_view worker_id, absl::string_view token) const {
  absl::MutexLock lock(&mu_);
  auto it = tokens_.find(worker_id);
  if (it == tokens_.end()) return false;
  return ConstantTimeEquals(it->second, token);
}

std::vector<std::string> PeerCertificateIdentities(const grpc::ServerContextBase& context) {
  std::vector<std::string> identities;
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return identities;
  for (const char* property : {"x509_common_name", "x509_subject_alternative_name"}) {
    for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
      identities.emplace_back(value.data(), value.size());
    }
  }
  return identities;
}

std::string ClientKey(const grpc::ServerContextBase& context, bool mutual_tls) {
  if (mutual_tls) {
    const std::vector<std::string> identities = PeerCertificateIdentities(context);
    if (!identities.empty()) return absl::StrCat("cert:", identities.front());
  }
  // "ipv4:10.0.0.7:51234", "ipv6:[::1]:51234", "unix:...": drop the port.
  std::string peer = context.peer();
  if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:")) {
    const size_t colon = peer.rfind(':');
    if (colon != std::string::npos && colon > 5) peer.resize(colon);
  }
  return peer;
}

}  // namespace eldr::server
