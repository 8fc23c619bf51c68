#include "server/config.h"

#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "nlohmann/json.hpp"

namespace eldr::server {
namespace {

using Json = nlohmann::json;

absl::Status BadValue(absl::string_view key, absl::string_view value, absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("setting '", key, "': invalid value '", value, "' (expected ", expected, ")"));
}

absl::StatusOr<absl::Duration> ParseDurationValue(absl::string_view key, absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  double seconds = 0;
  if (absl::SimpleAtod(trimmed, &seconds) && std::isfinite(seconds)) {
    return absl::Seconds(seconds);
  }
  absl::Duration d;
  if (absl::ParseDuration(trimmed, &d)) return d;
  return BadValue(key, text, "a duration such as 250ms, 10s, 10m or inf");
}

absl::StatusOr<int64_t> ParseIntValue(absl::string_view key, absl::string_view text) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  int64_t v = 0;
  if (absl::SimpleAtoi(trimmed, &v)) return v;
  return BadValue(key, text, "an integer");
}

absl::StatusOr<uint64_t> ParseUintValue(absl::string_view key, absl::string_view text) {
  absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  uint64_t v = 0;
  if (absl::ConsumePrefix(&trimmed, "0x") || absl::ConsumePrefix(&trimmed, "0X")) {
    if (absl::SimpleHexAtoi(trimmed, &v)) return v;
  } else if (absl::SimpleAtoi(trimmed, &v)) {
    return v;
  }
  return BadValue(key, text, "a non-negative integer (decimal or 0x hex)");
}

absl::StatusOr<double> ParseDoubleValue(absl::string_view key, absl::string_view text) {
  double v = 0;
  if (absl::SimpleAtod(absl::StripAsciiWhitespace(text), &v) && std::isfinite(v)) return v;
  return BadValue(key, text, "a finite number");
}

absl::StatusOr<bool> ParseBoolValue(absl::string_view key, absl::string_view text) {
  bool v = false;
  if (absl::SimpleAtob(absl::StripAsciiWhitespace(text), &v)) return v;
  return BadValue(key, text, "true or false");
}

// One setting: how to set it from text and how to show it.
struct OptionDef {
  std::string key;
  std::function<absl::Status(absl::string_view, ServerOptions*)> set;
  std::function<Json(const ServerOptions&)> get;
};

Json DurationJson(absl::Duration d) { return absl::FormatDuration(d); }

template <typename Field>
OptionDef StringOption(std::string key, Field field) {
  return OptionDef{
      key,
      [field](absl::string_view v, ServerOptions* o) {
        o->*field = std::string(v);
        return absl::OkStatus();
      },
      [field](const ServerOptions& o) { return Json(o.*field); }};
}

OptionDef DurationOption(std::string key, absl::Duration ServerOptions::*field) {
  return OptionDef{
      key,
      [key, field](absl::string_view v, ServerOptions* o) -> absl::Status {
        ELDR_ASSIGN_OR_RETURN(o->*field, ParseDurationValue(key, v));
        return absl::OkStatus();
      },
      [field](const ServerOptions& o) { return DurationJson(o.*field); }};
}

OptionDef IntOption(std::string key, int64_t ServerOptions::*field) {
  return OptionDef{
      key,
      [key, field](absl::string_view v, ServerOptions* o) -> absl::Status {
        ELDR_ASSIGN_OR_RETURN(o->*field, ParseIntValue(key, v));
        return absl::OkStatus();
      },
      [field](const ServerOptions& o) { return Json(o.*field); }};
}

OptionDef BoolOption(std::string key, bool ServerOptions::*field) {
  return OptionDef{
      key,
      [key, field](absl::string_view v, ServerOptions* o) -> absl::Status {
        ELDR_ASSIGN_OR_RETURN(o->*field, ParseBoolValue(key, v));
        return absl::OkStatus();
      },
      [field](const ServerOptions& o) { return Json(o.*field); }};
}

Json WorkerToJson(const WorkerSpec& w) {
  Json j = {{"id", w.id}, {"address", w.address}, {"capacity", w.capacity}};
  if (w.max_inflight != 0) j["max_inflight"] = w.max_inflight;
  if (!w.metrics_url.empty()) j["metrics_url"] = w.metrics_url;
  return j;
}

const std::vector<OptionDef>& OptionTable() {
  static const auto* table = new std::vector<OptionDef>{
      StringOption("listen", &ServerOptions::listen),
      StringOption("metrics_listen", &ServerOptions::metrics_listen),
      StringOption("admin_listen", &ServerOptions::admin_listen),
      StringOption("port_file", &ServerOptions::port_file),
      StringOption("centroids", &ServerOptions::centroids),
      OptionDef{"workers",
                [](absl::string_view v, ServerOptions* o) -> absl::Status {
                  if (absl::StripAsciiWhitespace(v).empty()) {
                    o->workers.clear();
                    return absl::OkStatus();
                  }
                  auto workers = ParseWorkerList(v);
                  if (!workers.ok()) {
                    return absl::Status(workers.status().code(),
                                        absl::StrCat("setting 'workers': ", workers.status().message()));
                  }
                  o->workers = *std::move(workers);
                  return absl::OkStatus();
                },
                [](const ServerOptions& o) {
                  Json list = Json::array();
                  for (const WorkerSpec& w : o.workers) list.push_back(WorkerToJson(w));
                  return list;
                }},
      OptionDef{"policy",
                [](absl::string_view v, ServerOptions* o) -> absl::Status {
                  auto kind = ParsePolicyKind(absl::StripAsciiWhitespace(v));
                  if (!kind.ok()) return BadValue("policy", v, "eldr, rr, random, jsq or p2c");
                  o->policy = *kind;
                  return absl::OkStatus();
                },
                [](const ServerOptions& o) { return Json(std::string(PolicyKindName(o.policy))); }},
      OptionDef{"tau",
                [](absl::string_view v, ServerOptions* o) -> absl::Status {
                  ELDR_ASSIGN_OR_RETURN(o->tau, ParseDoubleValue("tau", v));
                  return absl::OkStatus();
                },
                [](const ServerOptions& o) { return Json(o.tau); }},
      DurationOption("lease_ttl", &ServerOptions::lease_ttl),
      DurationOption("snapshot_staleness", &ServerOptions::snapshot_staleness),
      DurationOption("lease_expiry_interval", &ServerOptions::lease_expiry_interval),
      StringOption("worker_metrics", &ServerOptions::worker_metrics),
      IntOption("scrape_interval_ms", &ServerOptions::scrape_interval_ms),
      IntOption("scrape_timeout_ms", &ServerOptions::scrape_timeout_ms),
      IntOption("unhealthy_after_failures", &ServerOptions::unhealthy_after_failures),
      StringOption("scrape_model_name", &ServerOptions::scrape_model_name),
      IntOption("refit_window_s", &ServerOptions::refit_window_s),
      IntOption("refit_interval_s", &ServerOptions::refit_interval_s),
      StringOption("state_dir", &ServerOptions::state_dir),
      OptionDef{"seed",
                [](absl::string_view v, ServerOptions* o) -> absl::Status {
                  ELDR_ASSIGN_OR_RETURN(o->seed, ParseUintValue("seed", v));
                  return absl::OkStatus();
                },
                [](const ServerOptions& o) { return Json(o.seed); }},
      StringOption("tls_cert", &ServerOptions::tls_cert),
      StringOption("tls_key", &ServerOptions::tls_key),
      StringOption("tls_client_ca", &ServerOptions::tls_client_ca),
      DurationOption("tls_reload_interval", &ServerOptions::tls_reload_interval),
      StringOption("admin_token_file", &ServerOptions::admin_token_file),
      IntOption("max_message_bytes", &ServerOptions::max_message_bytes),
      IntOption("admin_max_message_bytes", &ServerOptions::admin_max_message_bytes),
      IntOption("max_concurrent_streams", &ServerOptions::max_concurrent_streams),
      DurationOption("keepalive_time", &ServerOptions::keepalive_time),
      DurationOption("keepalive_timeout", &ServerOptions::keepalive_timeout),
      DurationOption("keepalive_min_ping_interval", &ServerOptions::keepalive_min_ping_interval),
      BoolOption("keepalive_permit_without_calls", &ServerOptions::keepalive_permit_without_calls),
      DurationOption("max_connection_idle", &ServerOptions::max_connection_idle),
      DurationOption("max_connection_age", &ServerOptions::max_connection_age),
      DurationOption("max_connection_age_grace", &ServerOptions::max_connection_age_grace),
      DurationOption("shutdown_drain_delay", &ServerOptions::shutdown_drain_delay),
      DurationOption("shutdown_grace", &ServerOptions::shutdown_grace),
      OptionDef{"log_level",
                [](absl::string_view v, ServerOptions* o) -> absl::Status {
                  auto level = ParseLogLevel(absl::StripAsciiWhitespace(v));
                  if (!level.ok()) return BadValue("log_level", v, "debug, info, warning or error");
                  o->log_level = *level;
                  return absl::OkStatus();
                },
                [](const ServerOptions& o) { return Json(std::string(LogLevelName(o.log_level))); }},
      OptionDef{"log_format",
                [](absl::string_view v, ServerOptions* o) -> absl::Status {
                  auto format = ParseLogFormat(absl::StripAsciiWhitespace(v));
                  if (!format.ok()) return BadValue("log_format", v, "kv or json");
                  o->log_format = *format;
                  return absl::OkStatus();
                },
                [](const ServerOptions& o) { return Json(std::string(LogFormatName(o.log_format))); }},
  };
  return *table;
}

const OptionDef* FindOption(absl::string_view key) {
  for (const OptionDef& def : OptionTable()) {
    if (def.key == key) return &def;
  }
  return nullptr;
}

absl::StatusOr<WorkerSpec> WorkerFromJson(const Json& j, size_t index) {
  const std::string where = absl::StrCat("worker #", index);
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected an object with id and address"));
  }
  WorkerSpec w;
  for (const auto& [key, value] : j.items()) {
    if (key == "id") {
      if (!value.is_string()) return absl::InvalidArgumentError(absl::StrCat(where, ": 'id' must be a string"));
      w.id = value.get<std::string>();
    } else if (key == "address") {
      if (!value.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": 'address' must be a string"));
      }
      w.address = value.get<std::string>();
    } else if (key == "capacity") {
      if (!value.is_number()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": 'capacity' must be a number"));
      }
      w.capacity = value.get<double>();
    } else if (key == "max_inflight") {
      if (!value.is_number_integer()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": 'max_inflight' must be an integer"));
      }
      w.max_inflight = value.get<int64_t>();
    } else if (key == "metrics_url") {
      if (!value.is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": 'metrics_url' must be a string"));
      }
      w.metrics_url = value.get<std::string>();
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": unknown key '", key, "' (expected id, address, capacity, max_inflight, metrics_url)"));
    }
  }
  return w;
}

absl::StatusOr<std::vector<WorkerSpec>> CheckWorkers(std::vector<WorkerSpec> workers) {
  absl::flat_hash_set<std::string> seen;
  for (const WorkerSpec& w : workers) {
    ELDR_RETURN_IF_ERROR(ValidateWorkerSpec(w));
    if (!seen.insert(w.id).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate worker id '", w.id, "'"));
    }
  }
  return workers;
}

}  // namespace

const std::vector<std::string>& ServerOptionKeys() {
  static const auto* keys = [] {
    auto* out = new std::vector<std::string>();
    for (const OptionDef& def : OptionTable()) out->push_back(def.key);
    return out;
  }();
  return *keys;
}

absl::Status SetServerOption(absl::string_view key, absl::string_view value, ServerOptions* options) {
  const OptionDef* def = FindOption(key);
  if (def == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown setting '", key, "'"));
  return def->set(value, options);
}

absl::Status ApplyConfigJson(absl::string_view json_text, ServerOptions* options) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("config: not valid JSON");
  if (!root.is_object()) return absl::InvalidArgumentError("config: expected a JSON object of settings");
  for (const auto& [key, value] : root.items()) {
    const OptionDef* def = FindOption(key);
    if (def == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("config: unknown setting '", key, "'"));
    }
    if (key == "workers" && (value.is_array() || value.is_object())) {
      auto workers = ParseWorkerJson(value.dump());
      if (!workers.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("config: setting 'workers': ", workers.status().message()));
      }
      options->workers = *std::move(workers);
      continue;
    }
    std::string text;
    if (value.is_string()) {
      text = value.get<std::string>();
    } else if (value.is_boolean()) {
      text = value.get<bool>() ? "true" : "false";
    } else if (value.is_number_integer()) {
      text = value.is_number_unsigned() ? absl::StrCat(value.get<uint64_t>()) : absl::StrCat(value.get<int64_t>());
    } else if (value.is_number()) {
      text = absl::StrCat(value.get<double>());
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("config: setting '", key, "': expected a string, number or boolean"));
    }
    absl::Status status = def->set(text, options);
    if (!status.ok()) return absl::InvalidArgumentError(absl::StrCat("config: ", status.message()));
  }
  return absl::OkStatus();
}

absl::Status ApplyConfigFile(const std::string& path, ServerOptions* options) {
  ELDR_ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
  absl::Status status = ApplyConfigJson(text, options);
  if (!status.ok()) return absl::Status(status.code(), absl::StrCat(path, ": ", status.message()));
  return absl::OkStatus();
}

absl::Status ValidateServerOptions(const ServerOptions& o) {
  auto bad = [](absl::string_view key, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("setting '", key, "': ", why));
  };
  if (o.listen.empty()) return bad("listen", "must be host:port");
  if (!o.admin_listen.empty() && o.admin_listen == o.listen && !absl::EndsWith(o.listen, ":0")) {
    return bad("admin_listen", "must differ from listen (leave it empty to serve admin on listen)");
  }
  if (!(o.tau >= 0.0 && o.tau <= 1.0)) return bad("tau", "must be in [0, 1]");
  if (o.lease_ttl <= absl::ZeroDuration()) return bad("lease_ttl", "must be positive");
  if (o.snapshot_staleness <= absl::ZeroDuration()) return bad("snapshot_staleness", "must be positive");
  if (o.lease_expiry_interval <= absl::ZeroDuration() || o.lease_expiry_interval == absl::InfiniteDuration()) {
    return bad("lease_expiry_interval", "must be positive and finite");
  }
  if (o.scrape_interval_ms < 1) return bad("scrape_interval_ms", "must be >= 1");
  if (o.refit_window_s < 1) return bad("refit_window_s", "must be >= 1");
  if (o.refit_interval_s < 0) return bad("refit_interval_s", "must be >= 0");
  if (o.scrape_timeout_ms < 1) return bad("scrape_timeout_ms", "must be >= 1");
  if (o.unhealthy_after_failures < 0 || o.unhealthy_after_failures > 1'000'000) {
    return bad("unhealthy_after_failures", "must be in [0, 1000000] (0: never mark unhealthy)");
  }
  if (o.tls_cert.empty() != o.tls_key.empty()) {
    return bad(o.tls_cert.empty() ? "tls_cert" : "tls_key", "tls_cert and tls_key go together");
  }
  if (!o.tls_client_ca.empty() && o.tls_cert.empty()) {
    return bad("tls_client_ca", "mutual TLS needs tls_cert and tls_key as well");
  }
  if (o.tls_reload_interval < absl::Seconds(1) || o.tls_reload_interval == absl::InfiniteDuration()) {
    return bad("tls_reload_interval", "must be at least 1s and finite");
  }
  constexpr int64_t kMinMessage = 4096;
  constexpr int64_t kMaxMessage = std::numeric_limits<int32_t>::max();
  if (o.max_message_bytes < kMinMessage || o.max_message_bytes > kMaxMessage) {
    return bad("max_message_bytes", "must be between 4096 and 2147483647");
  }
  if (o.admin_max_message_bytes < kMinMessage || o.admin_max_message_bytes > kMaxMessage) {
    return bad("admin_max_message_bytes", "must be between 4096 and 2147483647");
  }
  if (o.max_concurrent_streams < 1 || o.max_concurrent_streams > std::numeric_limits<int32_t>::max()) {
    return bad("max_concurrent_streams", "must be between 1 and 2147483647");
  }
  for (const auto& [key, d] : {std::pair<const char*, absl::Duration>{"keepalive_time", o.keepalive_time},
                               {"keepalive_timeout", o.keepalive_timeout},
                               {"keepalive_min_ping_interval", o.keepalive_min_ping_interval},
                               {"max_connection_idle", o.max_connection_idle},
                               {"max_connection_age", o.max_connection_age},
                               {"max_connection_age_grace", o.max_connection_age_grace}}) {
    if (d <= absl::ZeroDuration()) return bad(key, "must be positive (inf: never)");
  }
  if (o.shutdown_drain_delay < absl::ZeroDuration() || o.shutdown_drain_delay == absl::InfiniteDuration()) {
    return bad("shutdown_drain_delay", "must be finite and not negative");
  }
  if (o.shutdown_grace < absl::ZeroDuration() || o.shutdown_grace == absl::InfiniteDuration()) {
    return bad("shutdown_grace", "must be finite and not negative");
  }
  auto ids = CheckWorkers(o.workers);
  if (!ids.ok()) return bad("workers", ids.status().message());
  return absl::OkStatus();
}

absl::Status ValidateWorkerSpec(const WorkerSpec& w) {
  if (w.id.empty()) return absl::InvalidArgumentError("worker id must not be empty");
  if (w.address.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("worker '", w.id, "': address must not be empty"));
  }
  if (!(w.capacity > 0) || !std::isfinite(w.capacity)) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker '", w.id, "': capacity must be a finite number > 0, got ", w.capacity));
  }
  if (w.max_inflight < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker '", w.id, "': max_inflight must be >= 0, got ", w.max_inflight));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<WorkerSpec>> ParseWorkerJson(absl::string_view json_text) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("workers: not valid JSON");
  if (root.is_object()) {
    if (!root.contains("workers") || root.size() != 1) {
      return absl::InvalidArgumentError("workers: expected an array, or an object whose only key is 'workers'");
    }
    root = root["workers"];
  }
  if (!root.is_array()) return absl::InvalidArgumentError("workers: expected an array of worker objects");
  std::vector<WorkerSpec> workers;
  workers.reserve(root.size());
  for (size_t i = 0; i < root.size(); ++i) {
    ELDR_ASSIGN_OR_RETURN(WorkerSpec w, WorkerFromJson(root[i], i));
    workers.push_back(std::move(w));
  }
  return CheckWorkers(std::move(workers));
}

absl::StatusOr<std::vector<WorkerSpec>> ParseWorkerList(absl::string_view spec) {
  spec = absl::StripAsciiWhitespace(spec);
  if (!absl::StrContains(spec, '=')) {
    const std::string path(spec);
    ELDR_ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
    auto workers = ParseWorkerJson(text);
    if (!workers.ok()) {
      return absl::Status(workers.status().code(), absl::StrCat(path, ": ", workers.status().message()));
    }
    return workers;
  }
  std::vector<WorkerSpec> workers;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("workers: item '", item, "' is not id=host:port"));
    }
    WorkerSpec w;
    w.id = std::string(absl::StripAsciiWhitespace(item.substr(0, eq)));
    w.address = std::string(absl::StripAsciiWhitespace(item.substr(eq + 1)));
    if (w.id.empty() || w.address.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("workers: item '", item, "' is not id=host:port"));
    }
    workers.push_back(std::move(w));
  }
  if (workers.empty()) return absl::InvalidArgumentError("workers: the list is empty");
  return CheckWorkers(std::move(workers));
}

std::string ServerOptionsToJson(const ServerOptions& options) {
  Json j = Json::object();
  for (const OptionDef& def : OptionTable()) j[def.key] = def.get(options);
  return j.dump();
}

}  // namespace eldr::server
