#include "discovery/fake_kube.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "eldr/common/file.h"

namespace eldr::testing {

std::string FakeKubeScript() {
  const char* dir = std::getenv("ELDR_SOURCE_DIR");
  return absl::StrCat(dir != nullptr ? dir : ".", "/tests/discovery/fake_kube_apiserver.py");
}

absl::StatusOr<std::unique_ptr<FakeKube>> FakeKube::Start(const TempDir& dir, FakeKubeOptions options) {
  if (options.tls_dir.empty()) return absl::InvalidArgumentError("FakeKube needs a tls_dir");
  std::unique_ptr<FakeKube> kube(new FakeKube());
  kube->token_file_ = dir.File("kube-token");
  absl::Status written = kube->WriteToken(options.token);
  if (!written.ok()) return written;
  const std::string port_file = dir.File("kube-port.json");
  absl::StatusOr<std::unique_ptr<ChildProcess>> process = ChildProcess::Spawn(
      {"/usr/bin/python3", FakeKubeScript(), absl::StrCat("--port_file=", port_file),
       absl::StrCat("--tls_dir=", options.tls_dir), absl::StrCat("--token_file=", kube->token_file_),
       absl::StrCat("--bookmark_interval_s=", options.bookmark_interval_s), absl::StrCat("--history=", options.history),
       "--quiet"},
      dir.File("fake-kube.log"));
  if (!process.ok()) return process.status();
  kube->process_ = std::move(*process);
  absl::StatusOr<int> port = WaitForPort(port_file, "port", *kube->process_, absl::Seconds(30));
  if (!port.ok()) return port.status();
  absl::StatusOr<std::string> text = ReadFile(port_file);
  if (!text.ok()) return text.status();
  const nlohmann::json info = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (!info.is_object() || !info.contains("control_port") || !info["control_port"].is_number_integer() ||
      !info.contains("server") || !info["server"].is_string() || !info.contains("ca_file") ||
      !info["ca_file"].is_string()) {
    return absl::InternalError(absl::StrCat("unexpected port file: ", *text));
  }
  kube->port_ = *port;
  kube->control_port_ = info["control_port"].get<int>();
  kube->server_ = info["server"].get<std::string>();
  kube->ca_file_ = info["ca_file"].get<std::string>();
  return kube;
}

discovery::KubeApiConfig FakeKube::ApiConfig() const {
  discovery::KubeApiConfig config;
  config.server = server_;
  config.ca_file = ca_file_;
  config.token_file = token_file_;
  config.namespace_ = "default";
  return config;
}

absl::Status FakeKube::WriteKubeconfig(const std::string& path, const std::string& namespace_) const {
  return WriteFileAtomically(
      path, absl::StrCat("apiVersion: v1\nkind: Config\ncurrent-context: fake\nclusters:\n- name: fake\n  cluster:\n",
                         "    server: ", server_, "\n    certificate-authority: ", ca_file_,
                         "\nusers:\n- name: fake\n  user:\n    tokenFile: ", token_file_,
                         "\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: ",
                         namespace_, "\n"));
}

absl::Status FakeKube::WriteToken(const std::string& token) const {
  return WriteFileAtomically(token_file_, absl::StrCat(token, "\n"), 0600);
}

absl::StatusOr<nlohmann::json> FakeKube::Call(const std::string& method, const std::string& path,
                                              const nlohmann::json& body) const {
  const std::string payload = body.is_null() ? std::string() : body.dump();
  const std::string request =
      absl::StrCat(method, " ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
                   "Content-Length: ", payload.size(), "\r\n\r\n", payload);
  absl::StatusOr<std::string> response = HttpExchange(control_port_, request, absl::Seconds(30));
  if (!response.ok()) return response.status();
  const int status = HttpStatusOf(*response);
  const size_t head_end = response->find("\r\n\r\n");
  const std::string answer = head_end == std::string::npos ? std::string() : response->substr(head_end + 4);
  if (status < 200 || status >= 300) {
    return absl::InternalError(absl::StrCat("control ", method, " ", path, " answered ", status, ": ", answer));
  }
  nlohmann::json parsed = nlohmann::json::parse(answer, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return absl::InternalError(absl::StrCat("control answer is not JSON: ", answer));
  return parsed;
}

absl::Status FakeKube::CreatePod(const nlohmann::json& pod) const { return Call("POST", "/pods", pod).status(); }

absl::Status FakeKube::PatchPod(const std::string& name, const nlohmann::json& fields) const {
  return Call("PATCH", absl::StrCat("/pods/default/", name), fields).status();
}

absl::Status FakeKube::TerminatePod(const std::string& name) const {
  return Call("POST", absl::StrCat("/pods/default/", name, "/terminate"), nlohmann::json::object()).status();
}

absl::Status FakeKube::DeletePod(const std::string& name) const {
  return Call("DELETE", absl::StrCat("/pods/default/", name)).status();
}

absl::Status FakeKube::ReplacePod(const std::string& name) const {
  return Call("POST", "/replace", {{"namespace", "default"}, {"name", name}}).status();
}

absl::Status FakeKube::Faults(const nlohmann::json& faults) const { return Call("POST", "/faults", faults).status(); }

absl::StatusOr<nlohmann::json> FakeKube::Stats() const { return Call("GET", "/stats"); }

}  // namespace eldr::testing
