// eldr-health-probe: asks a gRPC server for its health (grpc.health.v1.Health/Check) and turns the
// answer into an exit code, for exec probes (Kubernetes with TLS, or a router listening on the
// pod's loopback only) and the image's HEALTHCHECK.
//
//   eldr-health-probe --addr=127.0.0.1:50051 [--service=NAME] [--timeout=2s]
//                     [--tls_ca=ca.pem [--tls_cert=cert.pem --tls_key=key.pem]
//                      [--tls_server_name=NAME]]
//
// Exit codes: 0 SERVING; 1 usage error or unreadable file; 2 no connection within the timeout
// (refused, TLS handshake failed, unreachable); 3 the Check RPC failed (status named on stderr,
// e.g. NOT_FOUND for an unknown service); 4 the server answered, but not SERVING.
//
// The request and response are encoded by hand (grpc.health.v1 has two one-field messages), so
// the tool needs no generated code for the health protocol.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"

ABSL_FLAG(std::string, addr, "127.0.0.1:50051", "host:port of the gRPC server to check.");
ABSL_FLAG(std::string, service, "", "Health service name to check; empty: the server as a whole.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(2), "Limit for connecting and for the Check RPC together.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM file of the CAs that sign the server certificate: connect with TLS. Empty: plaintext.");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate chain for mutual TLS (with --tls_key and --tls_ca).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_server_name, "", "Name to verify in the server certificate instead of the host of --addr.");

namespace {

enum ExitCode : int {
  kServing = 0,
  kUsage = 1,
  kNoConnection = 2,
  kRpcFailed = 3,
  kNotServing = 4,
};

constexpr char kCheckMethod[] = "/grpc.health.v1.Health/Check";

// grpc.health.v1.HealthCheckResponse.ServingStatus
const char* ServingStatusName(uint64_t status) {
  switch (status) {
    case 0:
      return "UNKNOWN";
    case 1:
      return "SERVING";
    case 2:
      return "NOT_SERVING";
    case 3:
      return "SERVICE_UNKNOWN";
    default:
      return "UNRECOGNISED";
  }
}
constexpr uint64_t kServingStatus = 1;

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " file ", path));
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// HealthCheckRequest { string service = 1; }
grpc::ByteBuffer EncodeRequest(const std::string& service) {
  std::string bytes;
  if (!service.empty()) {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream out(&stream);
    out.WriteTag((1 << 3) | 2);  // field 1, length-delimited
    out.WriteVarint32(static_cast<uint32_t>(service.size()));
    out.WriteString(service);
  }
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// HealthCheckResponse { ServingStatus status = 1; }: the status, skipping unknown fields.
absl::StatusOr<uint64_t> DecodeResponse(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return absl::DataLossError("unreadable response buffer");
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  uint64_t status = 0;  // proto3 default: UNKNOWN
  while (uint32_t tag = in.ReadTag()) {
    const uint32_t field = tag >> 3;
    const uint32_t wire_type = tag & 7;
    if (field == 1 && wire_type == 0) {
      if (!in.ReadVarint64(&status)) return absl::DataLossError("truncated status field");
    } else if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) {
      return absl::DataLossError(absl::StrCat("malformed response (field ", field, ")"));
    }
  }
  if (!in.ConsumedEntireMessage()) return absl::DataLossError("malformed response");
  return status;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials() {
  const std::string ca_path = absl::GetFlag(FLAGS_tls_ca);
  const std::string cert_path = absl::GetFlag(FLAGS_tls_cert);
  const std::string key_path = absl::GetFlag(FLAGS_tls_key);
  if (ca_path.empty()) {
    if (!cert_path.empty() || !key_path.empty()) {
      return absl::InvalidArgumentError("--tls_cert and --tls_key need --tls_ca");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (cert_path.empty() != key_path.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  grpc::SslCredentialsOptions options;
  auto ca = ReadFile(ca_path, "--tls_ca");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *std::move(ca);
  if (!cert_path.empty()) {
    auto cert = ReadFile(cert_path, "--tls_cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadFile(key_path, "--tls_key");
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *std::move(cert);
    options.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(options);
}

int Probe() {
  const std::string addr = absl::GetFlag(FLAGS_addr);
  const std::string service = absl::GetFlag(FLAGS_service);
  const absl::Duration timeout = absl::GetFlag(FLAGS_timeout);
  if (addr.empty()) {
    std::cerr << "eldr-health-probe: --addr is empty\n";
    return kUsage;
  }
  if (timeout <= absl::ZeroDuration() || timeout == absl::InfiniteDuration()) {
    std::cerr << "eldr-health-probe: --timeout must be positive and finite\n";
    return kUsage;
  }
  auto credentials = Credentials();
  if (!credentials.ok()) {
    std::cerr << "eldr-health-probe: " << credentials.status().message() << "\n";
    return kUsage;
  }
  grpc::ChannelArguments args;
  const std::string server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (!server_name.empty()) args.SetSslTargetNameOverride(server_name);
  // One attempt, no retries: a probe must report what it sees now.
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  auto channel = grpc::CreateCustomChannel(addr, *credentials, args);

  const absl::Time deadline = absl::Now() + timeout;
  if (!channel->WaitForConnected(absl::ToChronoTime(deadline))) {
    std::cerr << "eldr-health-probe: no connection to " << addr << " within " << absl::FormatDuration(timeout) << "\n";
    return kNoConnection;
  }

  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  const grpc::ByteBuffer request = EncodeRequest(service);
  grpc::ByteBuffer response;
  grpc::Status rpc_status;
  absl::Notification done;
  stub.UnaryCall(&context, kCheckMethod, grpc::StubOptions(), &request, &response, [&](grpc::Status status) {
    rpc_status = std::move(status);
    done.Notify();
  });
  done.WaitForNotification();
  if (!rpc_status.ok()) {
    std::cerr << "eldr-health-probe: Check on " << addr << " failed: code " << rpc_status.error_code() << ": "
              << rpc_status.error_message() << "\n";
    return kRpcFailed;
  }
  auto status = DecodeResponse(response);
  if (!status.ok()) {
    std::cerr << "eldr-health-probe: " << status.status().message() << "\n";
    return kRpcFailed;
  }
  const std::string target = service.empty() ? addr : absl::StrCat(addr, " service ", service);
  if (*status != kServingStatus) {
    std::cerr << "eldr-health-probe: " << target << " is " << ServingStatusName(*status) << "\n";
    return kNotServing;
  }
  std::cout << target << " is SERVING\n";
  return kServing;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Checks a gRPC server's health (grpc.health.v1). Exit 0 SERVING, 1 usage, 2 no connection, "
      "3 RPC failed, 4 not serving.\n  eldr-health-probe --addr=host:port [--service=NAME] "
      "[--timeout=2s] [--tls_ca=PEM [--tls_cert=PEM --tls_key=PEM] [--tls_server_name=NAME]]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "eldr-health-probe: unexpected argument '" << rest[1] << "'\n";
    return kUsage;
  }
  return Probe();
}
