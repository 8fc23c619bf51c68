#include "eldr/discovery/kube_config.h"

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "eldr/common/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/process.h"

namespace eldr::discovery {
namespace {

using ::testing::HasSubstr;

void Write(const std::string& path, const std::string& text) {
  ASSERT_TRUE(WriteFileAtomically(path, text).ok()) << path;
}

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

class InClusterConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Write(dir_.File("token"), "eyJhbGciOi.token\n");
    Write(dir_.File("ca.crt"), "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n");
    Write(dir_.File("namespace"), "inference\n");
  }
  eldr::testing::TempDir dir_;
};

TEST_F(InClusterConfigTest, ReadsTheServiceAccount) {
  auto config =
      InClusterConfig(dir_.path(), Env({{"KUBERNETES_SERVICE_HOST", "10.96.0.1"}, {"KUBERNETES_SERVICE_PORT", "443"}}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->server, "https://10.96.0.1:443");
  EXPECT_EQ(config->token_file, dir_.File("token"));
  EXPECT_TRUE(config->token.empty());  // re-read by the client, never copied
  EXPECT_EQ(config->ca_file, dir_.File("ca.crt"));
  EXPECT_EQ(config->namespace_, "inference");
  EXPECT_FALSE(config->insecure_skip_tls_verify);
  EXPECT_TRUE(ValidateKubeApiConfig(*config).ok());
}

TEST_F(InClusterConfigTest, BracketsAnIpv6Host) {
  auto config = InClusterConfig(
      dir_.path(), Env({{"KUBERNETES_SERVICE_HOST", "fd00:10:96::1"}, {"KUBERNETES_SERVICE_PORT", "6443"}}));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->server, "https://[fd00:10:96::1]:6443");
}

TEST_F(InClusterConfigTest, NamesWhatIsMissing) {
  auto no_host = InClusterConfig(dir_.path(), Env({{"KUBERNETES_SERVICE_PORT", "443"}}));
  EXPECT_EQ(no_host.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_host.status().message(), HasSubstr("KUBERNETES_SERVICE_HOST"));

  auto no_port = InClusterConfig(dir_.path(), Env({{"KUBERNETES_SERVICE_HOST", "10.96.0.1"}}));
  EXPECT_THAT(no_port.status().message(), HasSubstr("KUBERNETES_SERVICE_PORT"));

  auto bad_port = InClusterConfig(
      dir_.path(), Env({{"KUBERNETES_SERVICE_HOST", "10.96.0.1"}, {"KUBERNETES_SERVICE_PORT", "https"}}));
  EXPECT_THAT(bad_port.status().message(), HasSubstr("not a port number"));

  const auto env = Env({{"KUBERNETES_SERVICE_HOST", "10.96.0.1"}, {"KUBERNETES_SERVICE_PORT", "443"}});
  eldr::testing::TempDir empty;
  auto no_token = InClusterConfig(empty.path(), env);
  EXPECT_EQ(no_token.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_token.status().message(), HasSubstr("service-account token"));

  Write(empty.File("token"), "t");
  auto no_ca = InClusterConfig(empty.path(), env);
  EXPECT_THAT(no_ca.status().message(), HasSubstr("service-account CA certificate"));

  Write(empty.File("ca.crt"), "pem");
  auto no_namespace = InClusterConfig(empty.path(), env);
  EXPECT_THAT(no_namespace.status().message(), HasSubstr("service-account namespace"));

  Write(empty.File("namespace"), "  \n");
  auto blank_namespace = InClusterConfig(empty.path(), env);
  EXPECT_EQ(blank_namespace.status().code(), absl::StatusCode::kFailedPrecondition);

  Write(empty.File("token"), "\n");
  auto blank_token = InClusterConfig(empty.path(), env);
  EXPECT_THAT(blank_token.status().message(), HasSubstr("is empty"));
}

constexpr char kKubeconfig[] = R"(apiVersion: v1
kind: Config
current-context: dev
clusters:
- name: dev-cluster
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority: certs/ca.crt
- name: prod-cluster
  cluster:
    server: https://[fd00::1]:443/
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUIKLS0tLS1FTkQgQ0VSVElGSUNBVEUtLS0tLQo=
- name: lab-cluster
  cluster:
    server: https://lab:6443
    insecure-skip-tls-verify: true
users:
- name: dev-user
  user:
    token: dev-token
- name: prod-user
  user:
    tokenFile: /var/run/token
    client-certificate-data: Y2VydA==
    client-key-data: a2V5
- name: lab-user
  user:
    client-certificate: lab.crt
    client-key: /abs/lab.key
- name: exec-user
  user:
    exec:
      apiVersion: client.authentication.k8s.io/v1beta1
      command: aws
- name: oidc-user
  user:
    auth-provider:
      name: oidc
- name: basic-user
  user:
    username: admin
    password: secret
contexts:
- name: dev
  context:
    cluster: dev-cluster
    user: dev-user
    namespace: inference
- name: prod
  context:
    cluster: prod-cluster
    user: prod-user
- name: lab
  context:
    cluster: lab-cluster
    user: lab-user
    namespace: lab
- name: anonymous
  context:
    cluster: lab-cluster
- name: exec
  context:
    cluster: dev-cluster
    user: exec-user
- name: oidc
  context:
    cluster: dev-cluster
    user: oidc-user
- name: basic
  context:
    cluster: dev-cluster
    user: basic-user
- name: dangling
  context:
    cluster: nowhere
    user: dev-user
- name: no-such-user
  context:
    cluster: dev-cluster
    user: nobody
)";

class KubeconfigTest : public ::testing::Test {
 protected:
  void SetUp() override { Write(path_, kKubeconfig); }
  eldr::testing::TempDir dir_;
  const std::string path_ = dir_.File("config");
};

TEST_F(KubeconfigTest, CurrentContextByDefault) {
  auto config = LoadKubeconfig(path_);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->server, "https://127.0.0.1:6443");
  EXPECT_EQ(config->ca_file, dir_.File("certs/ca.crt"));  // relative to the kubeconfig's folder
  EXPECT_EQ(config->token, "dev-token");
  EXPECT_EQ(config->namespace_, "inference");
  EXPECT_FALSE(config->insecure_skip_tls_verify);
}

TEST_F(KubeconfigTest, InlineDataIsDecoded) {
  auto config = LoadKubeconfig(path_, "prod");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->server, "https://[fd00::1]:443/");
  EXPECT_EQ(config->ca_pem, "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n");
  EXPECT_TRUE(config->ca_file.empty());
  EXPECT_EQ(config->token_file, "/var/run/token");
  EXPECT_EQ(config->client_cert_pem, "cert");
  EXPECT_EQ(config->client_key_pem, "key");
  EXPECT_EQ(config->namespace_, "default");  // the context names none
}

TEST_F(KubeconfigTest, ClientCertificateFilesAndInsecure) {
  auto config = LoadKubeconfig(path_, "lab");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->insecure_skip_tls_verify);
  EXPECT_EQ(config->client_cert_file, dir_.File("lab.crt"));
  EXPECT_EQ(config->client_key_file, "/abs/lab.key");
  EXPECT_EQ(config->namespace_, "lab");
}

TEST_F(KubeconfigTest, ContextWithoutUser) {
  auto config = LoadKubeconfig(path_, "anonymous");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->token.empty());
  EXPECT_TRUE(config->token_file.empty());
}

TEST_F(KubeconfigTest, HelpersAreRefusedWithAHint) {
  for (const char* context : {"exec", "oidc", "basic"}) {
    auto config = LoadKubeconfig(path_, context);
    EXPECT_EQ(config.status().code(), absl::StatusCode::kUnimplemented) << context;
    EXPECT_THAT(config.status().message(), HasSubstr("token")) << context;
  }
  EXPECT_THAT(LoadKubeconfig(path_, "exec").status().message(), HasSubstr("`exec`"));
}

TEST_F(KubeconfigTest, MissingEntriesAreNotFound) {
  auto no_context = LoadKubeconfig(path_, "staging");
  EXPECT_EQ(no_context.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_context.status().message(), HasSubstr("no context named \"staging\""));
  EXPECT_THAT(no_context.status().message(), HasSubstr(path_));
  EXPECT_THAT(LoadKubeconfig(path_, "dangling").status().message(), HasSubstr("no cluster named \"nowhere\""));
  EXPECT_THAT(LoadKubeconfig(path_, "no-such-user").status().message(), HasSubstr("no user named \"nobody\""));
  EXPECT_EQ(LoadKubeconfig(dir_.File("absent")).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(KubeconfigTest, NoCurrentContext) {
  Write(path_, "apiVersion: v1\nkind: Config\nclusters: []\n");
  auto config = LoadKubeconfig(path_);
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(config.status().message(), HasSubstr("current-context"));
}

TEST_F(KubeconfigTest, MalformedFilesAreInvalidArgument) {
  const std::map<std::string, std::string> cases = {
      {"not yaml", "clusters: [unclosed\n"},
      {"a list", "- a\n- b\n"},
      {"a scalar", "just text\n"},
      {"clusters not a list",
       "current-context: c\ncontexts: [{name: c, context: {cluster: x}}]\nclusters: {name: x}\n"},
      {"server a map",
       "current-context: c\ncontexts: [{name: c, context: {cluster: x}}]\n"
       "clusters: [{name: x, cluster: {server: {a: b}}}]\n"},
      {"no server",
       "current-context: c\ncontexts: [{name: c, context: {cluster: x}}]\nclusters: [{name: x, cluster: {}}]\n"},
      {"bad base64",
       "current-context: c\ncontexts: [{name: c, context: {cluster: x}}]\n"
       "clusters: [{name: x, cluster: {server: 'https://a', certificate-authority-data: '!!!'}}]\n"},
      {"insecure not a bool",
       "current-context: c\ncontexts: [{name: c, context: {cluster: x}}]\n"
       "clusters: [{name: x, cluster: {server: 'https://a', insecure-skip-tls-verify: maybe}}]\n"},
      {"server without scheme",
       "current-context: c\ncontexts: [{name: c, context: {cluster: x}}]\n"
       "clusters: [{name: x, cluster: {server: 'a:443'}}]\n"},
      {"context not a map", "current-context: c\ncontexts: [{name: c, context: [1, 2]}]\n"},
      {"entry not a map", "current-context: c\ncontexts: [7]\n"},
      {"cert without key",
       "current-context: c\ncontexts: [{name: c, context: {cluster: x, user: u}}]\n"
       "clusters: [{name: x, cluster: {server: 'https://a'}}]\n"
       "users: [{name: u, user: {client-certificate: c.crt}}]\n"},
  };
  for (const auto& [name, text] : cases) {
    Write(path_, text);
    auto config = LoadKubeconfig(path_);
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << name << ": " << config.status();
  }
}

TEST_F(KubeconfigTest, ResolveKubeApiConfigPicksTheSource) {
  auto from_file = ResolveKubeApiConfig(path_, "lab");
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_EQ(from_file->namespace_, "lab");
  auto missing = ResolveKubeApiConfig(path_, "staging");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("staging"));
  if (std::getenv("KUBERNETES_SERVICE_HOST") == nullptr) {
    auto in_cluster = ResolveKubeApiConfig("", "");
    EXPECT_EQ(in_cluster.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(in_cluster.status().message(), HasSubstr("in-cluster"));
  }
}

TEST(ValidateKubeApiConfigTest, Rules) {
  KubeApiConfig config;
  config.server = "https://10.0.0.1:6443";
  EXPECT_TRUE(ValidateKubeApiConfig(config).ok());
  config.server = "http://127.0.0.1:8001";
  EXPECT_TRUE(ValidateKubeApiConfig(config).ok());
  for (const char* bad : {"", "10.0.0.1:6443", "https://", "https://:443", "ftp://x", "https://a b"}) {
    config.server = bad;
    EXPECT_EQ(ValidateKubeApiConfig(config).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  config.server = "https://k";
  config.ca_file = "a";
  config.ca_pem = "b";
  EXPECT_THAT(ValidateKubeApiConfig(config).message(), HasSubstr("not both"));
  config.ca_pem.clear();
  config.client_key_pem = "k";
  EXPECT_THAT(ValidateKubeApiConfig(config).message(), HasSubstr("needs its client certificate"));
  config.client_cert_file = "c";
  EXPECT_TRUE(ValidateKubeApiConfig(config).ok());
}

}  // namespace
}  // namespace eldr::discovery
