// ELDR capture library, calibration capture (C++ API, static library `eldr_capture_static`).
//
// A calibration run (docs/calibration.md, "The calibration run") records, per request, its prompt
// counts, its prompt gate-probability sums and the counts of its first N generated tokens, and
// writes them as an ELDR capture file (version 1) that eldr-calibrate reads. This class does the
// bookkeeping on top of a Capture context in direct mode (docs/capture.md, "Calibration capture"):
// each request in flight holds two direct slots, one for its prompt positions, one for its decode
// positions prompt_tokens .. prompt_tokens + N - 1; later positions are padding. The engine
// declares each forward pass's layout with SetBatch, records every MoE layer of the pass with the
// returned token -> slot array (copied to device memory first on a CUDA context), and calls
// FinishRequest when a request ends. The record call chooses the gate sums' mode:
// Capture::RecordDirectGateLogits with the gate's router logits for the reference's gate_prob_all
// (softmax over all experts; what eldr-calibrate's gate_prob variant means), or
// Capture::RecordDirectGateProbs with the router's top-k weights. The file does not say which; the
// artifact must be served with gate sums captured in the same mode.
//
// integrations/vllm/eldr_calibration.py is the same recorder for Python engines.
//
// Thread safety: none; one engine loop drives a recorder. The Capture context stays owned by the
// caller and must outlive the recorder.
#ifndef ELDR_CAPTURE_CALIBRATION_RECORDER_HPP_
#define ELDR_CAPTURE_CALIBRATION_RECORDER_HPP_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "eldr/capture/capture.hpp"

namespace eldr::capture {

inline constexpr int kDefaultCalibrationDecodeTokens = 128;

// One finished calibration request: [L][E] each.
struct CalibrationRecord {
  std::string key;
  int64_t prompt_tokens = 0;
  int64_t decode_tokens = 0;  // decode positions counted (at most the recorder's decode_tokens)
  std::vector<int32_t> prefill_counts;
  std::vector<int32_t> decode_counts;
  std::vector<float> gate_prob_sums;
  int label = -1;  // -1: none
};

class CalibrationRecorder {
 public:
  // `capture` must have been created with record_gate_probs and max_direct_requests >= 2 (two
  // per request in flight). INVALID_ARGUMENT otherwise, or for decode_tokens < 1.
  static absl::StatusOr<std::unique_ptr<CalibrationRecorder>> Create(
      Capture* capture, int decode_tokens = kDefaultCalibrationDecodeTokens);

  // Starts recording request `key` of `prompt_tokens` (>= 1) tokens; label >= 0 is stored with it.
  // RESOURCE_EXHAUSTED when no two slots are free, INVALID_ARGUMENT for a key in flight.
  absl::Status BeginRequest(const std::string& key, int64_t prompt_tokens, int label = -1);

  // Declares the next forward pass: its tokens in order, each entry a request's next `tokens`
  // positions (a key not in flight, e.g. a warm-up pass, gives padding). Returns the pass's
  // token -> direct slot array (-1: not recorded), host memory, valid until the next call.
  absl::StatusOr<absl::Span<const int32_t>> SetBatch(absl::Span<const std::pair<std::string, int64_t>> entries);

  // Reads the request's counts and gate sums (zeroing its slots for their next requests), frees its
  // slots and keeps the record. NOT_FOUND for a key not in flight.
  absl::StatusOr<CalibrationRecord> FinishRequest(const std::string& key, void* stream = nullptr);

  const std::vector<CalibrationRecord>& records() const { return records_; }
  int in_flight() const { return static_cast<int>(active_.size()); }

  // The ELDR capture file (version 1) of every finished record: prefill counts, decode counts,
  // gate sums, and labels when every record has one. Counts are int16 when every value fits,
  // int32 otherwise (the format src/calib/capture_file.cc reads). FAILED_PRECONDITION without records.
  absl::StatusOr<std::string> SerializeCaptureFile() const;
  // SerializeCaptureFile written to `path` (a temporary file, then renamed).
  absl::Status WriteCaptureFile(const std::string& path) const;

 private:
  struct Active {
    int prompt_slot = 0;
    int decode_slot = 0;
    int64_t prompt_tokens = 0;
    int64_t position = 0;  // where the request's next tokens start
    int label = -1;
  };

  CalibrationRecorder(Capture* capture, int direct_slots, int decode_tokens);

  Capture* const capture_;
  const int decode_tokens_;
  std::vector<int> free_slots_;
  std::map<std::string, Active> active_;
  std::vector<int32_t> token_slots_;
  std::vector<CalibrationRecord> records_;
};

}  // namespace eldr::capture

#endif  // ELDR_CAPTURE_CALIBRATION_RECORDER_HPP_
