// eldr-lease-bench: what a mass of leases costs the routing path. Builds an in-process Router
// (the daemon's own), takes --leases leases on it at one instant (Routes whose Complete never
// comes), then lets them all expire at once through Router::ExpireLeases on one thread while
// another thread keeps routing (Route + Complete) and times every decision. Prints the figures as
// JSON: how long the expiry took, and the routes' latency percentiles during it next to the same
// percentiles measured with the leases live but nothing expiring (the baseline; compare the ratio,
// not the absolute figures, on a shared machine).
//
//   eldr-lease-bench --leases=1000000
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "eldr/core/router.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int64_t, leases, 1000000, "Leases taken (and never completed) before they all expire at once.");
ABSL_FLAG(int, workers, 16, "Decode workers of the router.");
ABSL_FLAG(int64_t, max_live_leases, 2000000, "The router's live-lease limit.");

namespace {

double Percentile(std::vector<double>& values, double q) {
  if (values.empty()) return 0;
  const size_t index = std::min(values.size() - 1, static_cast<size_t>(q * static_cast<double>(values.size())));
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(index), values.end());
  return values[index];
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Route latency while a mass of leases expires (in-process Router).");
  absl::ParseCommandLine(argc, argv);
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);  // as the daemon runs
  const int64_t leases = absl::GetFlag(FLAGS_leases);
  eldr::RouterOptions options;
  options.policy = eldr::PolicyKind::kJsq;
  options.load.lease_ttl = absl::Minutes(10);
  options.max_live_leases = absl::GetFlag(FLAGS_max_live_leases);
  std::vector<eldr::WorkerSpec> workers;
  for (int w = 0; w < absl::GetFlag(FLAGS_workers); ++w) {
    workers.push_back(eldr::WorkerSpec{absl::StrCat("w", w), absl::StrCat("10.0.0.", w, ":8000")});
  }
  absl::StatusOr<std::unique_ptr<eldr::Router>> router = eldr::Router::Create(options, workers);
  if (!router.ok()) {
    std::fprintf(stderr, "eldr-lease-bench: %s\n", std::string(router.status().message()).c_str());
    return 1;
  }
  // All leases at one instant t0, so they expire together.
  const absl::Time t0 = absl::Now() - options.load.lease_ttl - absl::Seconds(1);
  const auto fill_start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < leases; ++i) (void)(*router)->Route(nullptr, t0);
  const double fill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - fill_start).count();

  // Baseline: the same routing loop with a million live leases and nothing expiring.
  std::vector<double> baseline_us;
  baseline_us.reserve(50000);
  for (int i = 0; i < 50000; ++i) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<eldr::RouteResult> routed = (*router)->Route(nullptr, absl::Now());
    baseline_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    if (routed.ok()) (void)(*router)->Complete(routed->lease_id);
  }

  std::atomic<bool> expiring{true};
  std::vector<double> latencies_us;
  latencies_us.reserve(1 << 20);
  std::thread routing([&] {
    // Routes (and completes) at the current time throughout the expiry, and a little after.
    int after = 0;
    while (expiring.load() || after++ < 20000) {
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<eldr::RouteResult> routed = (*router)->Route(nullptr, absl::Now());
      latencies_us.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
      if (routed.ok()) (void)(*router)->Complete(routed->lease_id);
    }
  });
  absl::SleepFor(absl::Milliseconds(20));  // the routing thread is running
  const auto expire_start = std::chrono::steady_clock::now();
  const int64_t expired = (*router)->ExpireLeases(absl::Now());
  const double expire_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - expire_start).count();
  expiring.store(false);
  routing.join();
  const size_t routes = latencies_us.size();

  nlohmann::json out = {
      {"leases", leases},
      {"workers", workers.size()},
      {"fill_seconds", fill_seconds},
      {"expired", expired},
      {"expire_seconds", expire_seconds},
      {"baseline_p50_us", Percentile(baseline_us, 0.50)},
      {"baseline_p99_us", Percentile(baseline_us, 0.99)},
      {"baseline_p999_us", Percentile(baseline_us, 0.999)},
      {"baseline_max_us", Percentile(baseline_us, 1.0)},
      {"routes_timed", routes},
      {"route_p50_us", Percentile(latencies_us, 0.50)},
      {"route_p99_us", Percentile(latencies_us, 0.99)},
      {"route_p999_us", Percentile(latencies_us, 0.999)},
      {"route_max_us", Percentile(latencies_us, 1.0)},
      {"live_leases_after", (*router)->GetState(absl::Now()).live_leases},
  };
  std::printf("%s\n", out.dump(2).c_str());
  return expired == leases ? 0 : 1;
}
