// eldr-router: the ELDR decode-routing daemon. See docs/api.md and docs/operations.md.
//
// Settings come from one table (server/config.h): --config=FILE, then --key=value flags; --help
// lists them all.
//
// Signals: SIGTERM/SIGINT drain and exit 0; SIGHUP queues a reload of the centroid file and
// re-reads the token files. The handler only sets a flag and writes a wake-up byte to a
// non-blocking pipe (async-signal-safe; a full pipe just means a wake-up is already pending, so a
// storm of signals costs nothing and SIGHUPs coalesce). A dedicated thread sleeps on the pipe and
// acts on the flags; it never does the slow work itself (reloads run on the loader's thread), so
// SIGTERM is acted on at once, whatever a reload is doing. A plain sigwait thread is not enough:
// libraries start threads before main (OpenBLAS does), those threads do not inherit a mask set
// here, and a SIGTERM delivered to one of them would kill the process instead of draining it.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/cluster_component.h"
#include "server/config.h"
#include "server/discovery_component.h"
#include "server/load_scrape_component.h"
#include "server/logging.h"
#include "server/refit_component.h"
#include "server/server.h"

namespace {

int g_wake_pipe[2] = {-1, -1};
std::atomic<bool> g_terminate{false};
std::atomic<bool> g_reload{false};
std::atomic<int> g_terminate_signal{0};

extern "C" void OnSignal(int signal) {
  const int saved_errno = errno;
  if (signal == SIGHUP) {
    g_reload.store(true, std::memory_order_release);
  } else {
    g_terminate_signal.store(signal, std::memory_order_relaxed);
    g_terminate.store(true, std::memory_order_release);
  }
  const unsigned char byte = 1;
  [[maybe_unused]] ssize_t n = write(g_wake_pipe[1], &byte, 1);  // EAGAIN: a wake-up is pending
  errno = saved_errno;
}

bool InstallSignalHandling() {
  if (pipe2(g_wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int signal : {SIGTERM, SIGINT, SIGHUP}) {
    if (sigaction(signal, &action, nullptr) != 0) return false;
  }
  return true;
}

// Sleeps until a signal set a flag; drains the wake-up bytes.
void WaitForSignal() {
  while (!g_terminate.load(std::memory_order_acquire) && !g_reload.load(std::memory_order_acquire)) {
    pollfd wake{g_wake_pipe[0], POLLIN, 0};
    (void)poll(&wake, 1, 1000);
    unsigned char buffer[256];
    while (read(g_wake_pipe[0], buffer, sizeof(buffer)) > 0) {
    }
  }
}

int Fail(absl::string_view event, const absl::Status& status) {
  ELDR_LOG(Error, event).With("code", status);
  return 1;
}

// Ends the process at `deadline` whatever is still running: the bound --shutdown_grace promises.
void StartShutdownWatchdog(absl::Time deadline) {
  std::thread([deadline] {
    absl::SleepFor(deadline - absl::Now());
    ELDR_LOG(Warning, "shutdown_forced").With("note", "shutdown took longer than drain delay + grace; exiting now");
    std::_Exit(0);
  }).detach();
}

}  // namespace

int main(int argc, char** argv) {
  // First thing: a SIGTERM during startup must not kill the process half-initialised; it is
  // acted on once the server runs.
  if (!InstallSignalHandling()) return Fail("startup_failed", absl::InternalError("cannot install signal handlers"));
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

  eldr::server::ServerOptions options;
  absl::StatusOr<eldr::server::CommandLine> command_line = eldr::server::ParseCommandLine(argc, argv, &options);
  if (!command_line.ok()) return Fail("config_invalid", command_line.status());
  if (command_line->help) {
    std::fputs(eldr::server::UsageText().c_str(), stdout);
    return 0;
  }
  if (command_line->version) {
    std::puts("eldr-router 0.1.0");
    return 0;
  }
  eldr::server::SetLogLevel(options.log_level);
  eldr::server::SetLogFormat(options.log_format);
  ELDR_LOG(Debug, "effective_config").With("settings", eldr::server::ServerOptionsToJson(options));

  eldr::server::ServerExtensions extensions;
  extensions.components.push_back(eldr::server::LoadScrapeComponentFactory());
  // The cluster component closes the refit gate on followers: only the cluster's leader refits.
  auto refit_gate = std::make_shared<eldr::server::RefitGate>();
  extensions.components.push_back(eldr::server::RefitComponentFactory(refit_gate));
  // After refit: a leader publishes the refitter's installs; the state_dir set is installed first.
  extensions.components.push_back(eldr::server::ClusterComponentFactory(refit_gate));
  // Last: the others are subscribed to the router before discovered workers arrive.
  extensions.components.push_back(eldr::server::DiscoveryComponentFactory());
  auto server = eldr::server::RouterServer::Create(options, std::move(extensions));
  if (!server.ok()) return Fail("startup_failed", server.status());
  if (absl::Status s = (*server)->Start(); !s.ok()) return Fail("startup_failed", s);

  eldr::server::RouterServer* router_server = server->get();
  const absl::Duration shutdown_bound = options.shutdown_drain_delay + options.shutdown_grace + absl::Seconds(2);
  std::thread signal_thread([router_server, forwarded, shutdown_bound] {
    // Signals that arrived during startup are pending; they are handled now.
    pthread_sigmask(SIG_UNBLOCK, &forwarded, nullptr);
    while (true) {
      WaitForSignal();
      if (g_terminate.load(std::memory_order_acquire)) break;
      if (g_reload.exchange(false, std::memory_order_acq_rel)) router_server->ReloadFromSignal();
    }
    const int signal = g_terminate_signal.load(std::memory_order_relaxed);
    ELDR_LOG(Info, "signal_received").With("signal", signal == SIGINT ? "SIGINT" : "SIGTERM");
    StartShutdownWatchdog(absl::Now() + shutdown_bound);
    router_server->Shutdown();
  });
  router_server->Wait();
  signal_thread.join();
  if (!router_server->clean_shutdown()) {
    // A centroid load still runs and uses the router: leave without destroying anything.
    ELDR_LOG(Warning, "exited").With("code", 0).With("note", "a centroid load was still running at the deadline");
    std::_Exit(0);
  }
  server->reset();
  ELDR_LOG(Info, "exited").With("code", 0);
  return 0;
}
