// eldr-prom-text-bench: what one scrape costs the router in parsing. A vLLM /metrics page of
// `engines` data-parallel engines (histograms included, as vLLM serves it) parsed in full, and
// parsed the way the scraper does it (every line checked, only the load gauges kept).
//
//   eldr-prom-text-bench --benchmark_min_time=0.5
#include <string>

#include "benchmark/benchmark.h"
#include "eldr/loadsignals/prom_text.h"
#include "loadsignals/fake_metrics_server.h"

namespace {

std::string Page(int engines) {
  return eldr::testing::VllmMetricsPage({12, 3, 0.4}, "deepseek-ai/DeepSeek-V2-Lite", engines);
}

void BM_ParseFullPage(benchmark::State& state) {
  const std::string page = Page(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    auto parsed = eldr::ParsePromText(page);
    benchmark::DoNotOptimize(parsed);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(page.size()));
  state.counters["page_bytes"] = static_cast<double>(page.size());
}
BENCHMARK(BM_ParseFullPage)->Arg(1)->Arg(8);

void BM_ParseEngineLoad(benchmark::State& state) {
  const std::string page = Page(static_cast<int>(state.range(0)));
  eldr::EngineLoadOptions options;
  options.model_name = "deepseek-ai/DeepSeek-V2-Lite";
  for (auto _ : state) {
    auto load = eldr::ParseEngineLoad(page, options);
    if (!load.ok()) state.SkipWithError("the page did not parse");
    benchmark::DoNotOptimize(load);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(page.size()));
  state.counters["page_bytes"] = static_cast<double>(page.size());
}
BENCHMARK(BM_ParseEngineLoad)->Arg(1)->Arg(8);

}  // namespace

BENCHMARK_MAIN();
