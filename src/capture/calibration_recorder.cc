// The calibration recorder (include/eldr/capture/calibration_recorder.hpp): token attribution to
// per-request direct slots, and the ELDR capture file writer (the format src/calib/capture_file.cc
// reads, docs/calibration.md "Capture file format").
#include "eldr/capture/calibration_recorder.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "eldr/capture/capture.hpp"

namespace eldr::capture {
namespace {

constexpr char kMagic[8] = {'E', 'L', 'D', 'R', 'C', 'A', 'P', 'T'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kHasDecode = 1u << 0;
constexpr uint32_t kHasLabel = 1u << 1;
constexpr uint32_t kInt32Counts = 1u << 2;
constexpr uint32_t kHasGateSums = 1u << 3;

void AppendU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void AppendCounts(std::string& out, const std::vector<int32_t>& counts, bool wide) {
  for (int32_t v : counts) {
    if (wide) {
      AppendU32(out, static_cast<uint32_t>(v));
    } else {
      out.push_back(static_cast<char>(v & 0xff));
      out.push_back(static_cast<char>((v >> 8) & 0xff));
    }
  }
}

}  // namespace

CalibrationRecorder::CalibrationRecorder(Capture* capture, int direct_slots, int decode_tokens)
    : capture_(capture), decode_tokens_(decode_tokens) {
  for (int slot = direct_slots - 1; slot >= 0; --slot) free_slots_.push_back(slot);
}

absl::StatusOr<std::unique_ptr<CalibrationRecorder>> CalibrationRecorder::Create(Capture* capture, int decode_tokens) {
  if (capture == nullptr) return absl::InvalidArgumentError("calibration recorder: capture is null");
  const Info& info = capture->info();
  if (info.gate_prob_fraction_bits == 0) {
    return absl::InvalidArgumentError(
        "calibration recorder: the capture context must be created with record_gate_probs");
  }
  if (info.max_direct_requests < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "calibration recorder: the capture context needs max_direct_requests >= 2 (two per request in flight), has ",
        info.max_direct_requests));
  }
  if (decode_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration recorder: decode_tokens must be >= 1, got ", decode_tokens));
  }
  return std::unique_ptr<CalibrationRecorder>(
      new CalibrationRecorder(capture, info.max_direct_requests, decode_tokens));
}

absl::Status CalibrationRecorder::BeginRequest(const std::string& key, int64_t prompt_tokens, int label) {
  if (active_.count(key) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("calibration request '", key, "' is already being recorded"));
  }
  if (prompt_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_tokens must be >= 1, got ", prompt_tokens));
  }
  if (free_slots_.size() < 2) {
    return absl::ResourceExhaustedError(
        "calibration recorder: no two free direct slots (raise max_direct_requests or finish requests first)");
  }
  Active active;
  active.prompt_slot = free_slots_.back();
  free_slots_.pop_back();
  active.decode_slot = free_slots_.back();
  free_slots_.pop_back();
  active.prompt_tokens = prompt_tokens;
  active.label = label;
  active_.emplace(key, active);
  return absl::OkStatus();
}

absl::StatusOr<absl::Span<const int32_t>> CalibrationRecorder::SetBatch(
    absl::Span<const std::pair<std::string, int64_t>> entries) {
  token_slots_.clear();
  for (const auto& [key, tokens] : entries) {
    if (tokens < 0) return absl::InvalidArgumentError(absl::StrCat("batch entry '", key, "' has ", tokens, " tokens"));
    const auto it = active_.find(key);
    if (it == active_.end()) {
      token_slots_.insert(token_slots_.end(), static_cast<size_t>(tokens), -1);
      continue;
    }
    Active& active = it->second;
    for (int64_t p = active.position; p < active.position + tokens; ++p) {
      if (p < active.prompt_tokens) {
        token_slots_.push_back(active.prompt_slot);
      } else if (p < active.prompt_tokens + decode_tokens_) {
        token_slots_.push_back(active.decode_slot);
      } else {
        token_slots_.push_back(-1);
      }
    }
    active.position += tokens;
  }
  return absl::MakeConstSpan(token_slots_);
}

absl::StatusOr<CalibrationRecord> CalibrationRecorder::FinishRequest(const std::string& key, void* stream) {
  const auto it = active_.find(key);
  if (it == active_.end()) {
    return absl::NotFoundError(absl::StrCat("calibration request '", key, "' is not being recorded"));
  }
  const Active active = it->second;
  const int32_t slots[2] = {active.prompt_slot, active.decode_slot};
  const size_t cells = static_cast<size_t>(capture_->info().num_layers) * capture_->info().num_experts;
  CalibrationRecord record;
  {
    absl::StatusOr<std::unique_ptr<FinishResult>> counts = capture_->FinishDirect(slots, 2, OutputType::kInt32, stream);
    if (!counts.ok()) return counts.status();
    if (absl::Status s = (*counts)->Wait(); !s.ok()) return s;
    const int32_t* values = (*counts)->counts_int32();
    record.prefill_counts.assign(values, values + cells);
    record.decode_counts.assign(values + cells, values + 2 * cells);
  }
  {
    // Both slots' gate sums are read so that the decode slot's (unused) ones are zeroed too.
    absl::StatusOr<std::unique_ptr<FinishResult>> gate = capture_->FinishDirectGateProbs(slots, 2, stream);
    if (!gate.ok()) return gate.status();
    if (absl::Status s = (*gate)->Wait(); !s.ok()) return s;
    record.gate_prob_sums.assign((*gate)->gate_prob_sums(), (*gate)->gate_prob_sums() + cells);
  }
  active_.erase(it);
  free_slots_.push_back(active.decode_slot);
  free_slots_.push_back(active.prompt_slot);
  record.key = key;
  record.prompt_tokens = active.prompt_tokens;
  record.decode_tokens = std::clamp<int64_t>(active.position - active.prompt_tokens, 0, decode_tokens_);
  record.label = active.label;
  records_.push_back(record);
  return record;
}

absl::StatusOr<std::string> CalibrationRecorder::SerializeCaptureFile() const {
  if (records_.empty()) return absl::FailedPreconditionError("no finished calibration requests to write");
  const Info& info = capture_->info();
  const size_t cells = static_cast<size_t>(info.num_layers) * info.num_experts;
  bool wide = false;
  bool labelled = true;
  for (const CalibrationRecord& r : records_) {
    for (const std::vector<int32_t>* counts : {&r.prefill_counts, &r.decode_counts}) {
      wide = wide || std::any_of(counts->begin(), counts->end(), [](int32_t v) { return v > 32767; });
    }
    labelled = labelled && r.label >= 0;
  }
  uint32_t flags = kHasDecode | kHasGateSums;
  if (wide) flags |= kInt32Counts;
  if (labelled) flags |= kHasLabel;
  const size_t record_bytes = cells * (wide ? 4 : 2) * 2 + cells * 4 + (labelled ? 4 : 0);
  std::string out(kMagic, sizeof(kMagic));
  AppendU32(out, kVersion);
  AppendU32(out, static_cast<uint32_t>(info.num_layers));
  AppendU32(out, static_cast<uint32_t>(info.num_experts));
  AppendU32(out, flags);
  out.reserve(out.size() + records_.size() * (4 + record_bytes));
  for (const CalibrationRecord& r : records_) {
    AppendU32(out, static_cast<uint32_t>(record_bytes));
    AppendCounts(out, r.prefill_counts, wide);
    AppendCounts(out, r.decode_counts, wide);
    for (float sum : r.gate_prob_sums) {
      uint32_t bits;
      std::memcpy(&bits, &sum, sizeof(bits));
      AppendU32(out, bits);
    }
    if (labelled) AppendU32(out, static_cast<uint32_t>(r.label));
  }
  return out;
}

absl::Status CalibrationRecorder::WriteCaptureFile(const std::string& path) const {
  absl::StatusOr<std::string> bytes = SerializeCaptureFile();
  if (!bytes.ok()) return bytes.status();
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", temporary));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::remove(temporary.c_str());
    return absl::InternalError(absl::StrCat("cannot rename ", temporary, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace eldr::capture
