#include "cluster/redis_server.h"

#include <signal.h>

#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "eldr/cluster/redis_connection.h"

namespace eldr::cluster::testing {

std::string RedisServerBinary() {
  const char* env = std::getenv("ELDR_REDIS_SERVER");
  return env != nullptr && *env != '\0' ? env : "/usr/bin/redis-server";
}

absl::StatusOr<std::unique_ptr<RedisServer>> RedisServer::Start(std::vector<std::string> extra_args) {
  absl::Status last = absl::UnavailableError("no free port");
  for (int attempt = 0; attempt < 5; ++attempt) {
    const int port = eldr::testing::UnusedLoopbackPort();
    if (port == 0) continue;
    std::unique_ptr<RedisServer> server(new RedisServer(port, extra_args));
    last = server->Launch();
    if (last.ok()) return server;
  }
  return last;
}

RedisServer::~RedisServer() { Kill(); }

absl::Status RedisServer::Launch() {
  ++launches_;
  std::vector<std::string> argv = {RedisServerBinary(),
                                   "--port",
                                   std::to_string(port_),
                                   "--bind",
                                   "127.0.0.1",
                                   "--dir",
                                   dir_.path(),
                                   "--save",
                                   "",
                                   "--appendonly",
                                   "no",
                                   "--daemonize",
                                   "no",
                                   "--enable-debug-command",
                                   "yes",
                                   "--loglevel",
                                   "warning"};
  argv.insert(argv.end(), extra_args_.begin(), extra_args_.end());
  absl::StatusOr<std::unique_ptr<eldr::testing::ChildProcess>> child =
      eldr::testing::ChildProcess::Spawn(argv, dir_.File(absl::StrCat("redis-", launches_, ".log")));
  if (!child.ok()) return child.status();
  process_ = *std::move(child);
  RedisConnectionOptions options;
  options.address = address();
  options.connect_timeout = absl::Milliseconds(200);
  options.command_timeout = absl::Milliseconds(500);
  options.min_backoff = absl::Milliseconds(5);
  options.max_backoff = absl::Milliseconds(20);
  std::unique_ptr<RedisConnection> probe = *RedisConnection::Create(options);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (!process_->Running()) {
      return absl::UnavailableError(absl::StrCat("redis-server exited: ", process_->Log()));
    }
    absl::StatusOr<RedisReply> pong = probe->Command({"PING"});
    // A server started with requirepass answers NOAUTH: it is up.
    if (pong.ok() || RedisErrorKindOf(pong.status()) == RedisErrorKind::kAuth) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(10));
  }
  Kill();
  return absl::DeadlineExceededError(absl::StrCat("redis-server did not answer PING: ", Log()));
}

void RedisServer::Kill() {
  if (process_ == nullptr) return;
  process_->Signal(SIGCONT);
  process_->Signal(SIGKILL);
  process_->Wait(absl::Seconds(10)).IgnoreError();
  process_.reset();
}

absl::Status RedisServer::Restart() {
  Kill();
  absl::Status last;
  for (int attempt = 0; attempt < 20; ++attempt) {  // the port may take a moment to be free
    last = Launch();
    if (last.ok()) return last;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return last;
}

void RedisServer::Pause() {
  if (process_ != nullptr) process_->Signal(SIGSTOP);
}

void RedisServer::Resume() {
  if (process_ != nullptr) process_->Signal(SIGCONT);
}

std::string RedisServer::Log() const { return process_ != nullptr ? process_->Log() : std::string(); }

CentroidArtifact TestArtifact(int k, int variant) {
  CentroidArtifact artifact;
  artifact.spec.layers = 4;
  artifact.spec.experts = 8;
  artifact.spec.variant = SignatureVariant::kCount;
  artifact.k = k;
  const int dim = artifact.dim();
  artifact.centroids.assign(static_cast<size_t>(k) * dim, 0.0f);
  for (int row = 0; row < k; ++row) {
    // Two non-zero entries per row, placed by row and variant, normalised.
    const int a = (row * 5 + variant) % dim;
    const int b = (row * 5 + variant + 3) % dim;
    artifact.centroids[static_cast<size_t>(row) * dim + a] = 0.6f;
    artifact.centroids[static_cast<size_t>(row) * dim + b] += 0.8f;
    artifact.workers.push_back(absl::StrCat("w", row));
  }
  artifact.model = "test-model";
  artifact.seed = 42 + variant;
  return artifact;
}

}  // namespace eldr::cluster::testing
