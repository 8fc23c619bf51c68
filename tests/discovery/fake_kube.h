// The stand-in Kubernetes API server (tests/discovery/fake_kube_apiserver.py) as a child of a C++
// test: started on kernel-chosen loopback ports with its own CA and a bearer token file, and a
// client of its plain-HTTP control API (create / modify / terminate / delete / replace pods,
// faults, stats). For discovery's integration tests and the daemons' tests that use discovery.
// No GoogleTest dependency. Every call is bounded.
#ifndef ELDR_TESTS_DISCOVERY_FAKE_KUBE_H_
#define ELDR_TESTS_DISCOVERY_FAKE_KUBE_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "eldr/discovery/kube_config.h"
#include "nlohmann/json.hpp"
#include "testing/process.h"

namespace eldr::testing {

struct FakeKubeOptions {
  // Where the CA and server certificate live (made once, reused when present: share one folder
  // between the servers of a test binary, the openssl CLI takes a while). Required.
  std::string tls_dir;
  // The token the API port accepts at first (WriteToken changes it).
  std::string token = "token-0";
  double bookmark_interval_s = 0.5;
  // History of events kept for watches that resume (beyond it: 410 Expired).
  int history = 10000;
};

class FakeKube {
 public:
  // Starts the server in `dir` (port file, token file, log). Fails with its log when it does not
  // come up within 30 s.
  static absl::StatusOr<std::unique_ptr<FakeKube>> Start(const TempDir& dir, FakeKubeOptions options);

  // server (https://127.0.0.1:port), ca_file, token_file, namespace "default".
  discovery::KubeApiConfig ApiConfig() const;
  const std::string& token_file() const { return token_file_; }
  int port() const { return port_; }
  int control_port() const { return control_port_; }
  // Rewrites the token file atomically (the server re-reads it at every request).
  absl::Status WriteToken(const std::string& token) const;
  // Writes a kubeconfig at `path` that reaches this server: its CA, a `tokenFile` user naming the
  // token file (so a rotation reaches the client as a projected token would), namespace
  // `namespace_`. For daemons started with --kubeconfig.
  absl::Status WriteKubeconfig(const std::string& path, const std::string& namespace_ = "default") const;

  // A control API call; the parsed JSON answer, or an error naming the status and body when the
  // answer is not 2xx.
  absl::StatusOr<nlohmann::json> Call(const std::string& method, const std::string& path,
                                      const nlohmann::json& body = nullptr) const;
  // Shorthands of Call.
  absl::Status CreatePod(const nlohmann::json& pod) const;
  absl::Status PatchPod(const std::string& name, const nlohmann::json& fields) const;  // namespace default
  absl::Status TerminatePod(const std::string& name) const;
  absl::Status DeletePod(const std::string& name) const;
  absl::Status ReplacePod(const std::string& name) const;
  absl::Status Faults(const nlohmann::json& faults) const;
  absl::StatusOr<nlohmann::json> Stats() const;

  ChildProcess& process() { return *process_; }

 private:
  FakeKube() = default;
  std::unique_ptr<ChildProcess> process_;
  std::string server_;
  std::string ca_file_;
  std::string token_file_;
  int port_ = 0;
  int control_port_ = 0;
};

// <ELDR_SOURCE_DIR>/tests/discovery/fake_kube_apiserver.py (ELDR_SOURCE_DIR is set by CTest;
// the working directory without it).
std::string FakeKubeScript();

}  // namespace eldr::testing

#endif  // ELDR_TESTS_DISCOVERY_FAKE_KUBE_H_
