// eldr-engine-emu: a vLLM prefill or decode engine without a GPU (docs/engine-emulator.md).
//
//   eldr-engine-emu --role=prefill --port_file=/tmp/p.json
//   eldr-engine-emu --role=decode --max_batch=64 --time_scale=0.1
//
// Startup errors (bad flags, traces not found, address in use) print one line and exit 2.
// SIGTERM or SIGINT: stop accepting, close the connections, exit 0.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "eldr/common/daemon.h"
#include "eldr/common/file.h"
#include "engine_emu/catalog.h"
#include "engine_emu/service.h"
#include "sim/cost_model.h"
#include "sim/workload.h"

namespace {
const eldr::sim::TraceWorkloadOptions kTrace;
const eldr::sim::CostModelOptions kCost;
const eldr::engine_emu::EngineOptions kEngine;
}  // namespace

ABSL_FLAG(std::string, role, "", "Required: prefill or decode");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "HTTP address host:port (port 0: any free port)");
ABSL_FLAG(std::string, port_file, "", "Write {\"port\": N, \"pid\": P} here once listening");
ABSL_FLAG(std::string, advertise_host, "127.0.0.1", "remote_host in prefill answers");
ABSL_FLAG(std::string, engine_id, "", "remote_engine_id of this engine (empty: random)");
ABSL_FLAG(std::string, model, kEngine.model, "Served model name");
ABSL_FLAG(std::string, trace, "data/esft-routing", "Folder of the expert traces (as eldr-sim's --trace)");
ABSL_FLAG(int, experts, kTrace.experts, "Routed experts of the traced model (as eldr-sim's)");
ABSL_FLAG(double, prefill_fraction, kTrace.prefill_fraction, "Prompt share of each trace sequence (as eldr-sim's)");
ABSL_FLAG(double, calibration_fraction, kTrace.calibration_fraction,
          "Share of each domain's sequences kept for calibration (as eldr-sim's)");
ABSL_FLAG(uint64_t, split_seed, kTrace.seed, "Seed of the calibration/evaluation split (eldr-sim's --seed)");
ABSL_FLAG(int, max_batch, 64, "Decode: requests per step at most");
ABSL_FLAG(int, max_waiting, kEngine.max_waiting, "Queued requests at most; beyond: 429");
ABSL_FLAG(double, time_scale, 1.0, "Multiplies every simulated duration (0.1: ten times faster)");
ABSL_FLAG(double, t_fixed_us, kCost.t_fixed_us, "Decode step: fixed cost, us");
ABSL_FLAG(double, t_token_us, kCost.t_token_us, "Decode step: cost per token in the batch, us");
ABSL_FLAG(double, t_expert_us, kCost.t_expert_us, "Decode step: cost per distinct expert per layer, us");
ABSL_FLAG(double, prefill_fixed_us, kCost.prefill_fixed_us, "Prefill: fixed cost, us");
ABSL_FLAG(double, prefill_token_us, kCost.prefill_token_us, "Prefill: cost per prompt token, us");
ABSL_FLAG(double, kv_transfer_us, kCost.kv_transfer_us, "KV handoff prefill -> decode, us");
ABSL_FLAG(absl::Duration, kv_hold_timeout, absl::Seconds(30), "Prefill: held KV is freed after this");
ABSL_FLAG(bool, gate_prob_sums, false,
          "Prefill: also attach eldr_gate_prob_sums (float32_le): each prompt count / top_k, a stand-in for the "
          "gate probabilities the bundled traces do not record");
ABSL_FLAG(std::string, signature_key, "eldr_expert_counts",
          "Prefill: what carries the counts: eldr_expert_counts, eldr_sig, both, none");
ABSL_FLAG(int, threads, 1, "HTTP io threads");

namespace {

constexpr char kProgram[] = "eldr-engine-emu";

int Fail(absl::string_view message) {
  std::cerr << kProgram << ": " << message << std::endl;
  return 2;
}

// The flags of this file, for --help.
std::string Usage() {
  std::string text = absl::StrCat(absl::ProgramUsageMessage(), "\n\nFlags:\n");
  std::vector<std::pair<std::string, std::string>> lines;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::StrContains(flag->Filename(), "engine_emu/main.cc")) continue;
    lines.emplace_back(std::string(name),
                       absl::StrCat("  --", name, "  ", flag->Help(), " (default: \"", flag->DefaultValue(), "\")\n"));
  }
  std::sort(lines.begin(), lines.end());
  for (const auto& line : lines) text += line.second;
  return text;
}

// Parses the command line as absl::ParseCommandLine does (--name=value, --name value, --bool,
// --nobool), but reports a bad flag as a status instead of exiting with 1: this binary's startup
// errors all exit 2.
absl::Status ParseFlags(int argc, char** argv, bool* help) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (!absl::ConsumePrefix(&arg, "--") && !absl::ConsumePrefix(&arg, "-")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", argv[i], "' (flags are --name=value)"));
    }
    if (arg.empty()) return absl::InvalidArgumentError("unexpected argument '--' (flags are --name=value)");
    absl::string_view name = arg;
    std::optional<std::string> value;
    if (const size_t eq = arg.find('='); eq != absl::string_view::npos) {
      name = arg.substr(0, eq);
      value = std::string(arg.substr(eq + 1));
    }
    if (name == "help" || name == "helpfull") {
      *help = true;
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    bool negated = false;
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      flag = absl::FindCommandLineFlag(name.substr(2));
      negated = flag != nullptr;
    }
    if (flag == nullptr || flag->IsRetired()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
    }
    if (negated) {
      if (!flag->IsOfType<bool>() || value.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, " (see --help)"));
      }
      value = "false";
    }
    if (!value.has_value()) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      }
    }
    std::string error;
    if (!flag->ParseFrom(*value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, "=", *value, ": ", error));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<eldr::engine_emu::EmuServiceOptions> OptionsFromFlags() {
  using eldr::engine_emu::EngineRole;
  eldr::engine_emu::EmuServiceOptions options;
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role == "prefill") {
    options.role = EngineRole::kPrefill;
  } else if (role == "decode") {
    options.role = EngineRole::kDecode;
  } else if (role.empty()) {
    return absl::InvalidArgumentError("--role is required: prefill or decode");
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--role must be prefill or decode, got '", role, "'"));
  }
  options.listen = absl::GetFlag(FLAGS_listen);
  options.threads = absl::GetFlag(FLAGS_threads);
  options.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  options.engine_id = absl::GetFlag(FLAGS_engine_id);
  options.max_batch = absl::GetFlag(FLAGS_max_batch);
  options.kv_hold_timeout = absl::GetFlag(FLAGS_kv_hold_timeout);
  absl::StatusOr<eldr::engine_emu::SignatureKey> key =
      eldr::engine_emu::ParseSignatureKey(absl::GetFlag(FLAGS_signature_key));
  if (!key.ok()) return key.status();
  options.signature_key = *key;
  options.gate_prob_sums = absl::GetFlag(FLAGS_gate_prob_sums);

  eldr::engine_emu::EngineOptions& engine = options.engine;
  engine.model = absl::GetFlag(FLAGS_model);
  engine.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  engine.time_scale = absl::GetFlag(FLAGS_time_scale);
  engine.cost.t_fixed_us = absl::GetFlag(FLAGS_t_fixed_us);
  engine.cost.t_token_us = absl::GetFlag(FLAGS_t_token_us);
  engine.cost.t_expert_us = absl::GetFlag(FLAGS_t_expert_us);
  engine.cost.prefill_fixed_us = absl::GetFlag(FLAGS_prefill_fixed_us);
  engine.cost.prefill_token_us = absl::GetFlag(FLAGS_prefill_token_us);
  engine.cost.kv_transfer_us = absl::GetFlag(FLAGS_kv_transfer_us);
  // Every flag is checked before the traces are loaded (a second or so): a typo fails at once.
  if (absl::Status s = eldr::engine_emu::ValidateEmuServiceOptions(options); !s.ok()) return s;

  eldr::sim::TraceWorkloadOptions trace;
  trace.dir = absl::GetFlag(FLAGS_trace);
  trace.experts = absl::GetFlag(FLAGS_experts);
  trace.prefill_fraction = absl::GetFlag(FLAGS_prefill_fraction);
  trace.calibration_fraction = absl::GetFlag(FLAGS_calibration_fraction);
  trace.seed = absl::GetFlag(FLAGS_split_seed);
  absl::StatusOr<eldr::sim::Workload> workload = eldr::sim::LoadTraceWorkload(trace);
  if (!workload.ok()) return workload.status();
  absl::StatusOr<std::shared_ptr<const eldr::engine_emu::TraceCatalog>> catalog =
      eldr::engine_emu::TraceCatalog::Create(*std::move(workload));
  if (!catalog.ok()) return catalog.status();
  engine.catalog = *std::move(catalog);
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  // Stop signals reach the main thread's wait only; thousands of streams need as many descriptors.
  const sigset_t stop_signals = eldr::BlockStopSignals();
  eldr::RaiseOpenFilesLimit();

  absl::SetProgramUsageMessage(
      "Emulates a vLLM prefill or decode engine (OpenAI API, kv_transfer_params) without a GPU.\n"
      "  eldr-engine-emu --role=prefill|decode [--listen=127.0.0.1:0] [--port_file=FILE]\n"
      "See docs/engine-emulator.md.");
  bool help = false;
  if (absl::Status parsed = ParseFlags(argc, argv, &help); !parsed.ok()) return Fail(parsed.message());
  if (help) {
    std::fputs(Usage().c_str(), stdout);
    return 0;
  }
  absl::StatusOr<eldr::engine_emu::EmuServiceOptions> options = OptionsFromFlags();
  if (!options.ok()) return Fail(options.status().message());
  const std::string description = options->engine.catalog->workload().description;
  const std::string role(eldr::engine_emu::RoleName(options->role));

  absl::StatusOr<std::unique_ptr<eldr::engine_emu::EmuService>> service =
      eldr::engine_emu::EmuService::Create(*std::move(options));
  if (!service.ok()) return Fail(service.status().message());
  if (absl::Status started = (*service)->Start(); !started.ok()) return Fail(started.message());
  const int port = (*service)->port();
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    const std::string contents = absl::StrCat("{\"port\": ", port, ", \"pid\": ", getpid(), "}\n");
    if (absl::Status written = eldr::WriteFileAtomically(port_file, contents); !written.ok()) {
      (*service)->Stop();
      return Fail(absl::StrCat("cannot write --port_file: ", written.message()));
    }
  }
  std::cerr << kProgram << ": " << role << " engine " << (*service)->engine_id() << " serving "
            << absl::GetFlag(FLAGS_model) << " on port " << port << " (" << description << ")" << std::endl;

  const int signal_number = eldr::WaitForStopSignal(stop_signals);
  std::cerr << kProgram << ": " << (signal_number == SIGINT ? "SIGINT" : "SIGTERM") << ", stopping" << std::endl;
  (*service)->Stop();
  return 0;
}
