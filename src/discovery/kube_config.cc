#include "eldr/discovery/kube_config.h"

#include <cstdlib>
#include <exception>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "yaml-cpp/yaml.h"

namespace eldr::discovery {
namespace {

// Service-account files and kubeconfigs are small; a larger one is a wrong path.
constexpr size_t kMaxConfigFileBytes = size_t{4} << 20;

std::optional<std::string> GetEnv(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

absl::Status WithContext(const absl::Status& status, absl::string_view what) {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

std::string Folder(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string ResolveRelative(const std::string& folder, const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  return absl::StrCat(folder, "/", path);
}

// A scalar field of a YAML map, as a string; nullopt when absent or null.
absl::StatusOr<std::optional<std::string>> StringField(const YAML::Node& map, const char* key,
                                                       absl::string_view where) {
  const YAML::Node value = map[key];
  if (!value.IsDefined() || value.IsNull()) return std::optional<std::string>();
  if (!value.IsScalar()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, " must be a string"));
  }
  return std::optional<std::string>(value.Scalar());
}

absl::StatusOr<bool> BoolField(const YAML::Node& map, const char* key, absl::string_view where) {
  const YAML::Node value = map[key];
  if (!value.IsDefined() || value.IsNull()) return false;
  bool result = false;
  if (!value.IsScalar() || !YAML::convert<bool>::decode(value, result)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, " must be true or false"));
  }
  return result;
}

absl::StatusOr<std::string> Base64Field(const std::string& text, absl::string_view where) {
  std::string compact;
  compact.reserve(text.size());
  for (char c : text) {
    if (!absl::ascii_isspace(static_cast<unsigned char>(c))) compact.push_back(c);
  }
  std::string decoded;
  if (!absl::Base64Unescape(compact, &decoded)) {
    return absl::InvalidArgumentError(absl::StrCat(where, " is not valid base64"));
  }
  return decoded;
}

// The entry of list `key` (clusters, users, contexts) whose name is `name`: its `inner` map
// (cluster, user, context). NOT_FOUND when there is none.
absl::StatusOr<YAML::Node> NamedEntry(const YAML::Node& root, const char* key, const char* inner,
                                      const std::string& name) {
  const YAML::Node list = root[key];
  if (list.IsDefined() && !list.IsNull() && !list.IsSequence()) {
    return absl::InvalidArgumentError(absl::StrCat(key, " must be a list"));
  }
  if (list.IsSequence()) {
    for (const YAML::Node& entry : list) {
      if (!entry.IsMap()) return absl::InvalidArgumentError(absl::StrCat(key, " entry is not a map"));
      ELDR_ASSIGN_OR_RETURN(std::optional<std::string> entry_name, StringField(entry, "name", key));
      if (!entry_name.has_value() || *entry_name != name) continue;
      const YAML::Node body = entry[inner];
      if (!body.IsDefined() || body.IsNull()) return YAML::Node(YAML::NodeType::Map);
      if (!body.IsMap()) {
        return absl::InvalidArgumentError(absl::StrCat(key, " \"", name, "\": ", inner, " must be a map"));
      }
      return body;
    }
  }
  return absl::NotFoundError(absl::StrCat("has no ", inner, " named \"", name, "\""));
}

absl::StatusOr<KubeApiConfig> ParseKubeconfig(const YAML::Node& root, const std::string& folder,
                                              const std::string& wanted_context) {
  if (!root.IsMap()) return absl::InvalidArgumentError("not a YAML map");
  std::string context_name = wanted_context;
  if (context_name.empty()) {
    ELDR_ASSIGN_OR_RETURN(std::optional<std::string> current, StringField(root, "current-context", "root"));
    if (!current.has_value() || current->empty()) {
      return absl::NotFoundError("has no current-context and no context was given");
    }
    context_name = *current;
  }
  ELDR_ASSIGN_OR_RETURN(YAML::Node context, NamedEntry(root, "contexts", "context", context_name));
  const std::string where_context = absl::StrCat("context \"", context_name, "\"");
  ELDR_ASSIGN_OR_RETURN(std::optional<std::string> cluster_name, StringField(context, "cluster", where_context));
  if (!cluster_name.has_value() || cluster_name->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where_context, " names no cluster"));
  }
  ELDR_ASSIGN_OR_RETURN(std::optional<std::string> user_name, StringField(context, "user", where_context));
  ELDR_ASSIGN_OR_RETURN(std::optional<std::string> name_space, StringField(context, "namespace", where_context));

  KubeApiConfig config;
  config.namespace_ = name_space.has_value() && !name_space->empty() ? *name_space : "default";

  ELDR_ASSIGN_OR_RETURN(YAML::Node cluster, NamedEntry(root, "clusters", "cluster", *cluster_name));
  const std::string where_cluster = absl::StrCat("cluster \"", *cluster_name, "\"");
  ELDR_ASSIGN_OR_RETURN(std::optional<std::string> server, StringField(cluster, "server", where_cluster));
  if (!server.has_value() || server->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where_cluster, " has no server"));
  }
  config.server = *server;
  ELDR_ASSIGN_OR_RETURN(std::optional<std::string> ca_file,
                        StringField(cluster, "certificate-authority", where_cluster));
  ELDR_ASSIGN_OR_RETURN(std::optional<std::string> ca_data,
                        StringField(cluster, "certificate-authority-data", where_cluster));
  if (ca_data.has_value() && !ca_data->empty()) {
    ELDR_ASSIGN_OR_RETURN(config.ca_pem,
                          Base64Field(*ca_data, absl::StrCat(where_cluster, ".certificate-authority-data")));
  } else if (ca_file.has_value() && !ca_file->empty()) {
    config.ca_file = ResolveRelative(folder, *ca_file);
  }
  ELDR_ASSIGN_OR_RETURN(config.insecure_skip_tls_verify, BoolField(cluster, "insecure-skip-tls-verify", where_cluster));

  if (user_name.has_value() && !user_name->empty()) {
    ELDR_ASSIGN_OR_RETURN(YAML::Node user, NamedEntry(root, "users", "user", *user_name));
    const std::string where_user = absl::StrCat("user \"", *user_name, "\"");
    for (const char* helper : {"exec", "auth-provider"}) {
      const YAML::Node node = user[helper];
      if (node.IsDefined() && !node.IsNull()) {
        return absl::UnimplementedError(absl::StrCat(
            where_user, " authenticates with `", helper,
            "`, which eldr does not run: give the user a bearer token (token or tokenFile, e.g. from `kubectl "
            "create token <service-account>`) or a client certificate"));
      }
    }
    for (const char* basic : {"username", "password"}) {
      const YAML::Node node = user[basic];
      if (node.IsDefined() && !node.IsNull()) {
        return absl::UnimplementedError(absl::StrCat(where_user,
                                                     " uses basic authentication, which eldr does not support: "
                                                     "give the user a bearer token or a client certificate"));
      }
    }
    ELDR_ASSIGN_OR_RETURN(std::optional<std::string> token, StringField(user, "token", where_user));
    ELDR_ASSIGN_OR_RETURN(std::optional<std::string> token_file, StringField(user, "tokenFile", where_user));
    if (token.has_value()) config.token = *token;
    if (token_file.has_value() && !token_file->empty()) config.token_file = ResolveRelative(folder, *token_file);

    ELDR_ASSIGN_OR_RETURN(std::optional<std::string> cert_file, StringField(user, "client-certificate", where_user));
    ELDR_ASSIGN_OR_RETURN(std::optional<std::string> cert_data,
                          StringField(user, "client-certificate-data", where_user));
    ELDR_ASSIGN_OR_RETURN(std::optional<std::string> key_file, StringField(user, "client-key", where_user));
    ELDR_ASSIGN_OR_RETURN(std::optional<std::string> key_data, StringField(user, "client-key-data", where_user));
    if (cert_data.has_value() && !cert_data->empty()) {
      ELDR_ASSIGN_OR_RETURN(config.client_cert_pem,
                            Base64Field(*cert_data, absl::StrCat(where_user, ".client-certificate-data")));
    } else if (cert_file.has_value() && !cert_file->empty()) {
      config.client_cert_file = ResolveRelative(folder, *cert_file);
    }
    if (key_data.has_value() && !key_data->empty()) {
      ELDR_ASSIGN_OR_RETURN(config.client_key_pem,
                            Base64Field(*key_data, absl::StrCat(where_user, ".client-key-data")));
    } else if (key_file.has_value() && !key_file->empty()) {
      config.client_key_file = ResolveRelative(folder, *key_file);
    }
  }
  ELDR_RETURN_IF_ERROR(ValidateKubeApiConfig(config));
  return config;
}

bool IsDigits(absl::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

absl::Status ValidateKubeApiConfig(const KubeApiConfig& config) {
  absl::string_view rest = config.server;
  if (!absl::ConsumePrefix(&rest, "https://") && !absl::ConsumePrefix(&rest, "http://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("Kubernetes API server \"", config.server, "\" must start with https:// (or http://)"));
  }
  if (rest.empty() || rest[0] == '/' || rest[0] == ':') {
    return absl::InvalidArgumentError(absl::StrCat("Kubernetes API server \"", config.server, "\" has no host"));
  }
  if (config.server.find_first_of(" \t\r\n") != std::string::npos) {
    return absl::InvalidArgumentError("Kubernetes API server URL contains whitespace");
  }
  if (!config.ca_file.empty() && !config.ca_pem.empty()) {
    return absl::InvalidArgumentError("give the Kubernetes CA as a file or as PEM text, not both");
  }
  if (!config.client_cert_file.empty() && !config.client_cert_pem.empty()) {
    return absl::InvalidArgumentError("give the client certificate as a file or as PEM text, not both");
  }
  if (!config.client_key_file.empty() && !config.client_key_pem.empty()) {
    return absl::InvalidArgumentError("give the client key as a file or as PEM text, not both");
  }
  const bool has_cert = !config.client_cert_file.empty() || !config.client_cert_pem.empty();
  const bool has_key = !config.client_key_file.empty() || !config.client_key_pem.empty();
  if (has_cert != has_key) {
    return absl::InvalidArgumentError(has_cert ? "a client certificate needs its client key"
                                               : "a client key needs its client certificate");
  }
  return absl::OkStatus();
}

absl::StatusOr<KubeApiConfig> InClusterConfig(const std::string& service_account_dir, const EnvLookup& env) {
  const EnvLookup lookup = env ? env : EnvLookup(&GetEnv);
  const std::optional<std::string> host = lookup("KUBERNETES_SERVICE_HOST");
  if (!host.has_value() || host->empty()) {
    return absl::FailedPreconditionError("not running in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not set");
  }
  const std::optional<std::string> port = lookup("KUBERNETES_SERVICE_PORT");
  if (!port.has_value() || port->empty()) {
    return absl::FailedPreconditionError("not running in a Kubernetes pod: KUBERNETES_SERVICE_PORT is not set");
  }
  int port_number = 0;
  if (!IsDigits(*port) || !absl::SimpleAtoi(*port, &port_number) || port_number < 1 || port_number > 65535) {
    return absl::FailedPreconditionError(
        absl::StrCat("KUBERNETES_SERVICE_PORT \"", *port, "\" is not a port number (1-65535)"));
  }
  KubeApiConfig config;
  const bool ipv6 = host->find(':') != std::string::npos && (*host)[0] != '[';
  config.server = absl::StrCat("https://", ipv6 ? "[" : "", *host, ipv6 ? "]" : "", ":", port_number);

  const std::string token_path = absl::StrCat(service_account_dir, "/token");
  absl::StatusOr<std::string> token = ReadFile(token_path, kMaxConfigFileBytes);
  if (!token.ok()) return WithContext(token.status(), "service-account token");
  if (absl::StripAsciiWhitespace(*token).empty()) {
    return absl::FailedPreconditionError(absl::StrCat("service-account token file '", token_path, "' is empty"));
  }
  config.token_file = token_path;

  const std::string ca_path = absl::StrCat(service_account_dir, "/ca.crt");
  absl::StatusOr<std::string> ca = ReadFile(ca_path, kMaxConfigFileBytes);
  if (!ca.ok()) return WithContext(ca.status(), "service-account CA certificate");
  config.ca_file = ca_path;

  const std::string namespace_path = absl::StrCat(service_account_dir, "/namespace");
  absl::StatusOr<std::string> name_space = ReadFile(namespace_path, kMaxConfigFileBytes);
  if (!name_space.ok()) return WithContext(name_space.status(), "service-account namespace");
  config.namespace_ = std::string(absl::StripAsciiWhitespace(*name_space));
  if (config.namespace_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("service-account namespace file '", namespace_path, "' is empty"));
  }
  return config;
}

absl::StatusOr<KubeApiConfig> LoadKubeconfig(const std::string& path, const std::string& context) {
  absl::StatusOr<std::string> text = ReadFile(path, kMaxConfigFileBytes);
  if (!text.ok()) return WithContext(text.status(), "kubeconfig");
  YAML::Node root;
  try {
    root = YAML::Load(*text);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("kubeconfig '", path, "' is not valid YAML: ", e.what()));
  }
  try {
    absl::StatusOr<KubeApiConfig> config = ParseKubeconfig(root, Folder(path), context);
    if (!config.ok()) return WithContext(config.status(), absl::StrCat("kubeconfig '", path, "'"));
    return config;
  } catch (const std::exception& e) {
    // yaml-cpp throws on some malformed structures; no exception leaves this function.
    return absl::InvalidArgumentError(absl::StrCat("kubeconfig '", path, "' is malformed: ", e.what()));
  }
}

absl::StatusOr<KubeApiConfig> ResolveKubeApiConfig(const std::string& kubeconfig, const std::string& context) {
  absl::StatusOr<KubeApiConfig> config = kubeconfig.empty() ? InClusterConfig() : LoadKubeconfig(kubeconfig, context);
  if (config.ok()) return config;
  return absl::Status(config.status().code(),
                      kubeconfig.empty()
                          ? absl::StrCat("in-cluster configuration (no --kubeconfig): ", config.status().message())
                          : absl::StrCat("kubeconfig: ", config.status().message()));
}

}  // namespace eldr::discovery
