// eldr-router: the ELDR decode-routing daemon. See docs/api.md and docs/operations.md.
//
// Signals: SIGTERM/SIGINT drain and exit 0; SIGHUP reloads the centroid file and the admin token.
// The handler only writes the signal number to a pipe (async-signal-safe); a dedicated thread reads
// it and does the work. A plain sigwait thread is not enough here: libraries start threads before
// main (OpenBLAS does), those threads do not inherit a mask set in main, and a SIGTERM delivered to
// one of them would kill the process instead of draining it.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/config.h"
#include "server/load_scrape_component.h"
#include "server/logging.h"
#include "server/refit_component.h"
#include "server/server.h"

namespace {
const eldr::server::ServerOptions kDefaults;
}  // namespace

ABSL_FLAG(std::string, config, "",
          "JSON file with any of the settings below (same names); flags given on the command line "
          "override it.");
ABSL_FLAG(std::string, listen, kDefaults.listen, "host:port of the gRPC data plane (port 0: any free port).");
ABSL_FLAG(std::string, metrics_listen, kDefaults.metrics_listen,
          "host:port of the Prometheus /metrics endpoint; empty disables it.");
ABSL_FLAG(std::string, admin_listen, kDefaults.admin_listen,
          "host:port of a separate listener for RouterAdmin; empty serves it on --listen.");
ABSL_FLAG(std::string, port_file, kDefaults.port_file,
          "Write the bound ports here as JSON once listening (for port 0).");
ABSL_FLAG(std::string, centroids, kDefaults.centroids,
          "Centroid artifact (JSON). Empty: start without centroids (eldr falls back to jsq).");
ABSL_FLAG(std::string, workers, "",
          "Decode workers: 'id=host:port,...' or a JSON file of {id, address, capacity, max_inflight}.");
ABSL_FLAG(std::string, policy, "eldr", "Routing policy: eldr, rr, random, jsq or p2c.");
ABSL_FLAG(double, tau, kDefaults.tau, "Locality band width in [0, 1] (eldr).");
ABSL_FLAG(absl::Duration, lease_ttl, kDefaults.lease_ttl, "A lease without Complete expires after this.");
ABSL_FLAG(absl::Duration, snapshot_staleness, kDefaults.snapshot_staleness,
          "Load reports older than this are ignored (the router's lease count is used).");
ABSL_FLAG(absl::Duration, lease_expiry_interval, kDefaults.lease_expiry_interval,
          "How often expired leases are released.");
ABSL_FLAG(uint64_t, seed, kDefaults.seed, "Seed of the tie-breaking / sampling generator.");
ABSL_FLAG(std::string, worker_metrics, kDefaults.worker_metrics,
          "Decode workers' Prometheus pages to scrape for load: 'id=url,...' (vLLM or SGLang); overrides "
          "`metrics_url` in the workers file.");
ABSL_FLAG(int64_t, scrape_interval_ms, kDefaults.scrape_interval_ms, "Milliseconds between two scrapes of a worker.");
ABSL_FLAG(int64_t, scrape_timeout_ms, kDefaults.scrape_timeout_ms, "A scrape taking longer fails.");
ABSL_FLAG(int64_t, unhealthy_after_failures, kDefaults.unhealthy_after_failures,
          "Consecutive failed scrapes that mark a worker unhealthy until one succeeds (0: never).");
ABSL_FLAG(std::string, scrape_model_name, kDefaults.scrape_model_name,
          "Sum only the series with this model_name label (empty: all series on the page).");
ABSL_FLAG(int64_t, refit_window_s, kDefaults.refit_window_s,
          "Online refit: signatures older than this many seconds leave the refit window.");
ABSL_FLAG(int64_t, refit_interval_s, kDefaults.refit_interval_s,
          "Online refit: seconds between periodic refits; 0 turns periodic refit off (pool changes "
          "still refit when --state_dir is set). Refit runs when this is > 0 or --state_dir is set.");
ABSL_FLAG(std::string, state_dir, kDefaults.state_dir,
          "Folder where refitted centroids are persisted and reloaded from at start (same transform "
          "as --centroids); empty: no persistence.");
ABSL_FLAG(std::string, tls_cert, kDefaults.tls_cert, "PEM certificate chain: enables TLS on the gRPC ports.");
ABSL_FLAG(std::string, tls_key, kDefaults.tls_key, "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, kDefaults.tls_client_ca,
          "PEM client CA bundle: enables mutual TLS (clients without a valid certificate are refused).");
ABSL_FLAG(absl::Duration, tls_reload_interval, kDefaults.tls_reload_interval,
          "How often the TLS files are re-read (new certificates apply to new connections).");
ABSL_FLAG(std::string, admin_token_file, kDefaults.admin_token_file,
          "File with the bearer token every RouterAdmin RPC must present (re-read on SIGHUP).");
ABSL_FLAG(int64_t, max_message_bytes, kDefaults.max_message_bytes,
          "Largest Route request on the data plane: larger ones are INVALID_ARGUMENT (counted as "
          "oversized); gRPC refuses beyond 4x this with RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, admin_max_message_bytes, kDefaults.admin_max_message_bytes,
          "Largest message on the --admin_listen port (inline artifacts).");
ABSL_FLAG(int64_t, max_concurrent_streams, kDefaults.max_concurrent_streams,
          "Concurrent RPCs per connection.");
ABSL_FLAG(absl::Duration, keepalive_time, kDefaults.keepalive_time,
          "Idle time before the server pings a connection.");
ABSL_FLAG(absl::Duration, keepalive_timeout, kDefaults.keepalive_timeout,
          "Time to wait for a keepalive ack before closing the connection.");
ABSL_FLAG(absl::Duration, keepalive_min_ping_interval, kDefaults.keepalive_min_ping_interval,
          "Minimum interval between client pings the server tolerates.");
ABSL_FLAG(bool, keepalive_permit_without_calls, kDefaults.keepalive_permit_without_calls,
          "Allow client keepalive pings on connections without calls.");
ABSL_FLAG(absl::Duration, max_connection_idle, kDefaults.max_connection_idle,
          "Close connections idle this long (inf: never).");
ABSL_FLAG(absl::Duration, max_connection_age, kDefaults.max_connection_age,
          "Close connections older than this (inf: never).");
ABSL_FLAG(absl::Duration, max_connection_age_grace, kDefaults.max_connection_age_grace,
          "Grace for calls on a connection closed for its age (inf: unlimited).");
ABSL_FLAG(absl::Duration, shutdown_drain_delay, kDefaults.shutdown_drain_delay,
          "On SIGTERM, keep serving this long after health turns NOT_SERVING, before closing.");
ABSL_FLAG(absl::Duration, shutdown_grace, kDefaults.shutdown_grace,
          "On SIGTERM, in-flight RPCs get this long to finish.");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error.");
ABSL_FLAG(std::string, log_format, "kv", "kv (key=value) or json, one line per event on stderr.");

namespace {

int g_signal_pipe[2] = {-1, -1};

extern "C" void ForwardSignal(int signal) {
  const int saved_errno = errno;
  const auto byte = static_cast<unsigned char>(signal);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

absl::Status InstallSignalForwarding() {
  if (pipe2(g_signal_pipe, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed for signal handling");
  struct sigaction action = {};
  action.sa_handler = ForwardSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int signal : {SIGTERM, SIGINT, SIGHUP}) {
    if (sigaction(signal, &action, nullptr) != 0) return absl::InternalError("sigaction failed");
  }
  return absl::OkStatus();
}

// Blocks until a forwarded signal arrives.
int NextSignal() {
  while (true) {
    unsigned char byte = 0;
    const ssize_t n = read(g_signal_pipe[0], &byte, 1);
    if (n == 1) return byte;
    if (n < 0 && errno == EINTR) continue;
    return -1;
  }
}

// Names of the flags present in argv (absl's own syntax: -name, --name, --name=v, --noname).
std::vector<std::string> FlagsOnCommandLine(int argc, char** argv) {
  std::vector<std::string> names;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    arg = arg.substr(0, arg.find('='));
    names.emplace_back(arg);
    if (absl::StartsWith(arg, "no")) names.emplace_back(arg.substr(2));
  }
  return names;
}

int Fail(absl::string_view event, const absl::Status& status) {
  ELDR_LOG(Error, event).With("code", status);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // First thing: a SIGTERM during startup must not kill the process half-initialised; it is
  // acted on once the server runs.
  if (absl::Status s = InstallSignalForwarding(); !s.ok()) return Fail("startup_failed", s);
  // Every thread created from here on inherits these signals blocked; only the signal thread
  // below unblocks them, so the kernel delivers them to the thread that waits on the pipe (some
  // runtimes, ThreadSanitizer's among them, defer a handler until its thread makes a call they
  // intercept, which a thread parked in a library's futex never does).
  sigset_t forwarded;
  sigemptyset(&forwarded);
  for (int signal : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&forwarded, signal);
  pthread_sigmask(SIG_BLOCK, &forwarded, nullptr);

  // Debian's Abseil is built with mutex deadlock detection on, which records a lock graph on every
  // absl::Mutex acquisition (about a tenth of the daemon's CPU under load, by perf). The lock
  // order is fixed by design and covered by the TSan build; production runs without the graph.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "ELDR decode router: routes each request to the decode worker whose expert centroid matches "
      "its prefill signature, balanced with load.\nUsage: eldr-router --workers=... --centroids=... [flags]");
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    return Fail("startup_failed",
                absl::InvalidArgumentError(absl::StrCat("unexpected argument '", positional[1], "'")));
  }

  eldr::server::ServerOptions options;
  if (const std::string config = absl::GetFlag(FLAGS_config); !config.empty()) {
    if (absl::Status s = eldr::server::ApplyConfigFile(config, &options); !s.ok()) {
      return Fail("config_invalid", s);
    }
  }
  for (const std::string& name : FlagsOnCommandLine(argc, argv)) {
    const auto& keys = eldr::server::ServerOptionKeys();
    if (std::find(keys.begin(), keys.end(), name) == keys.end()) continue;  // e.g. --config
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) {
      return Fail("startup_failed", absl::InternalError(absl::StrCat("setting '", name, "' has no flag")));
    }
    if (absl::Status s = eldr::server::SetServerOption(name, flag->CurrentValue(), &options); !s.ok()) {
      return Fail("config_invalid", s);
    }
  }
  eldr::server::SetLogLevel(options.log_level);
  eldr::server::SetLogFormat(options.log_format);
  ELDR_LOG(Debug, "effective_config").With("settings", eldr::server::ServerOptionsToJson(options));

  eldr::server::ServerExtensions extensions;
  extensions.components.push_back(eldr::server::LoadScrapeComponentFactory());
  eldr::server::AddRefitComponent(options, &extensions);
  auto server = eldr::server::RouterServer::Create(options, std::move(extensions));
  if (!server.ok()) return Fail("startup_failed", server.status());
  if (absl::Status s = (*server)->Start(); !s.ok()) return Fail("startup_failed", s);

  eldr::server::RouterServer* router_server = server->get();
  std::thread signal_thread([router_server, forwarded] {
    // Signals that arrived during startup are pending; they are handled now.
    pthread_sigmask(SIG_UNBLOCK, &forwarded, nullptr);
    while (true) {
      const int signal = NextSignal();
      if (signal == SIGHUP) {
        router_server->ReloadFromSignal();
        continue;
      }
      ELDR_LOG(Info, "signal_received")
          .With("signal", signal == SIGTERM ? "SIGTERM" : signal == SIGINT ? "SIGINT" : "signal pipe closed");
      router_server->Shutdown();
      return;
    }
  });
  router_server->Wait();
  signal_thread.join();
  server->reset();
  ELDR_LOG(Info, "exited").With("code", 0);
  return 0;
}
