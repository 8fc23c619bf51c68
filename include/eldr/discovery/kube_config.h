// How to reach a Kubernetes API server: the address, the CA that signs its certificate, and the
// credentials to present. Built from the pod's service account when running inside the cluster
// (InClusterConfig), or from a kubeconfig file (LoadKubeconfig) for development and tests.
//
// Only what a long-running watcher can use without an external helper is supported: a bearer
// token (inline, or a file re-read as it rotates), a client certificate, or no credentials at all.
// Kubeconfig `exec` plugins, `auth-provider`s and basic auth are refused (UNIMPLEMENTED) with a
// message saying to use a token instead.
//
// Thread-safety: the functions are pure apart from reading the files and the environment they are
// given; they may be called from any thread.
#ifndef ELDR_DISCOVERY_KUBE_CONFIG_H_
#define ELDR_DISCOVERY_KUBE_CONFIG_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace eldr::discovery {

struct KubeApiConfig {
  // The API server's base URL, "https://host:port" (an IPv6 host bracketed), optionally with a
  // path prefix; "http://" only for a local proxy (kubectl proxy). No trailing slash needed.
  std::string server;

  // The CA bundle that verifies the server's certificate: a PEM file, or the PEM text itself (at
  // most one of the two). With neither, the system's trust store is used. When one is given, only
  // it is trusted (the system store is not).
  std::string ca_file;
  std::string ca_pem;
  // Do not verify the server's certificate or host name (a test cluster only).
  bool insecure_skip_tls_verify = false;

  // Bearer credentials, sent as "Authorization: Bearer <token>". `token_file` is read on every
  // request (bound service-account tokens rotate; kubelet swaps the file), and once more after a
  // 401 before the request fails; when it cannot be read, the last token read from it is used,
  // then `token`. Both empty: no Authorization header.
  std::string token;
  std::string token_file;

  // A client certificate and its key, as PEM files or PEM text (at most one form of each; a
  // certificate needs a key).
  std::string client_cert_file;
  std::string client_key_file;
  std::string client_cert_pem;
  std::string client_key_pem;

  // The namespace the credentials belong to (the service account's, or the kubeconfig context's;
  // "default" when a context names none). Callers may watch another one.
  std::string namespace_;
};

// Checks the form: server present with an http(s) scheme and a host; at most one of ca_file /
// ca_pem, of client_cert_file / client_cert_pem, of client_key_file / client_key_pem; a client
// certificate and key given together. INVALID_ARGUMENT naming the field. Files are not opened.
absl::Status ValidateKubeApiConfig(const KubeApiConfig& config);

// Where a pod's service account is mounted.
inline constexpr char kServiceAccountDir[] = "/var/run/secrets/kubernetes.io/serviceaccount";

// Reads an environment variable; nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The configuration of a process running in a pod: server https://$KUBERNETES_SERVICE_HOST:
// $KUBERNETES_SERVICE_PORT (an IPv6 host bracketed), token_file <dir>/token (checked readable and
// non-empty now, re-read by the client later), ca_file <dir>/ca.crt (checked readable), namespace
// from <dir>/namespace (whitespace trimmed). `env` defaults to getenv.
// Errors: FAILED_PRECONDITION "not running in a Kubernetes pod: KUBERNETES_SERVICE_HOST is not
// set" (likewise the port, or an invalid port); the file errors of eldr::ReadFile (NOT_FOUND,
// PERMISSION_DENIED, ...) with a message naming the service-account file; FAILED_PRECONDITION for
// an empty token or namespace file.
absl::StatusOr<KubeApiConfig> InClusterConfig(const std::string& service_account_dir = kServiceAccountDir,
                                              const EnvLookup& env = nullptr);

// The configuration of kubeconfig `path` for `context` (empty: the file's current-context):
// its cluster's server, certificate-authority (a file) or certificate-authority-data (base64 PEM),
// insecure-skip-tls-verify; its user's token or tokenFile, client-certificate(-data) and
// client-key(-data); the context's namespace ("default" when absent). Relative file paths are
// taken relative to the kubeconfig's folder; files are not opened here (the client reads them).
// Errors: those of eldr::ReadFile for the kubeconfig itself; INVALID_ARGUMENT for text that is not
// a kubeconfig (unparsable YAML, a field of the wrong type, bad base64, no server), naming the
// field; NOT_FOUND for a context, cluster or user that the file does not define (or no context
// chosen); UNIMPLEMENTED for a user authenticating with `exec`, `auth-provider`, or username/
// password.
absl::StatusOr<KubeApiConfig> LoadKubeconfig(const std::string& path, const std::string& context = "");

// What a daemon's flags ask for: LoadKubeconfig(kubeconfig, context) when `kubeconfig` is set,
// else InClusterConfig(). Errors are theirs, prefixed with which of the two failed
// ("kubeconfig: ..." (whose message names the file) or "in-cluster configuration (no
// --kubeconfig): ...").
absl::StatusOr<KubeApiConfig> ResolveKubeApiConfig(const std::string& kubeconfig, const std::string& context);

}  // namespace eldr::discovery

#endif  // ELDR_DISCOVERY_KUBE_CONFIG_H_
