// Calibration data sets: validation, selection, the seeded held-out split, and requests built from
// the bundled real traces.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "calib/calib_internal.h"
#include "eldr/calib/calibration.h"
#include "eldr/trace/trace.h"

namespace eldr {
namespace {

absl::Status CheckCounts(const std::vector<int32_t>& counts, const char* what, int layers, int experts) {
  const size_t per_request = static_cast<size_t>(layers) * experts;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0) {
      const size_t within = i % per_request;
      return absl::InvalidArgumentError(absl::StrCat("request ", i / per_request, ": negative ", what, " count ",
                                                     counts[i], " at layer ", within / experts, ", expert ",
                                                     within % experts));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateCalibrationData(const CalibrationData& data) {
  if (data.layers < 1 || data.experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration data: bad geometry L=", data.layers, " E=", data.experts, " (both must be >= 1)"));
  }
  if (data.n < 0) return absl::InvalidArgumentError(absl::StrCat("calibration data: n = ", data.n));
  const size_t expected = static_cast<size_t>(data.n) * data.layers * data.experts;
  if (data.prefill_counts.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat("calibration data: ", data.prefill_counts.size(),
                                                   " prefill counts, expected n * L * E = ", expected, " (n=", data.n,
                                                   ", L=", data.layers, ", E=", data.experts, ")"));
  }
  if (!data.decode_counts.empty() && data.decode_counts.size() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration data: ", data.decode_counts.size(), " decode counts, expected 0 or ", expected));
  }
  if (!data.gate_prob_sums.empty() && data.gate_prob_sums.size() != expected) {
    return absl::InvalidArgumentError(absl::StrCat("calibration data: ", data.gate_prob_sums.size(),
                                                   " gate-probability sums, expected 0 or ", expected));
  }
  if (!data.labels.empty() && data.labels.size() != static_cast<size_t>(data.n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration data: ", data.labels.size(), " labels for ", data.n, " requests"));
  }
  if (absl::Status s = CheckCounts(data.prefill_counts, "prefill", data.layers, data.experts); !s.ok()) return s;
  if (absl::Status s = CheckCounts(data.decode_counts, "decode", data.layers, data.experts); !s.ok()) return s;
  const size_t per_request = static_cast<size_t>(data.layers) * data.experts;
  for (size_t i = 0; i < data.gate_prob_sums.size(); ++i) {
    const float v = data.gate_prob_sums[i];
    if (!std::isfinite(v) || v < 0) {
      const size_t within = i % per_request;
      return absl::InvalidArgumentError(
          absl::StrCat("request ", i / per_request, ": gate-probability sum ", v, " at layer ", within / data.experts,
                       ", expert ", within % data.experts, " is ", std::isfinite(v) ? "negative" : "not finite"));
    }
  }
  for (size_t i = 0; i < data.labels.size(); ++i) {
    const int label = data.labels[i];
    if (label < 0 || (!data.label_names.empty() && label >= static_cast<int>(data.label_names.size()))) {
      return absl::InvalidArgumentError(absl::StrCat("request ", i, ": label ", label, " out of range"));
    }
  }
  return absl::OkStatus();
}

CalibrationData SelectRequests(const CalibrationData& data, absl::Span<const int> indices) {
  CalibrationData out;
  out.layers = data.layers;
  out.experts = data.experts;
  out.n = static_cast<int>(indices.size());
  out.label_names = data.label_names;
  const size_t per_request = static_cast<size_t>(data.layers) * data.experts;
  auto copy_rows = [&](const auto& from, auto& to) {
    if (from.empty()) return;
    to.reserve(indices.size() * per_request);
    for (int i : indices) {
      to.insert(to.end(), from.begin() + i * per_request, from.begin() + (i + 1) * per_request);
    }
  };
  copy_rows(data.prefill_counts, out.prefill_counts);
  copy_rows(data.decode_counts, out.decode_counts);
  copy_rows(data.gate_prob_sums, out.gate_prob_sums);
  if (!data.labels.empty()) {
    for (int i : indices) out.labels.push_back(data.labels[i]);
  }
  return out;
}

absl::StatusOr<CalibrationSplit> SplitCalibrationData(const CalibrationData& data, double holdout_fraction,
                                                      uint64_t seed) {
  if (!(holdout_fraction >= 0 && holdout_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("holdout fraction ", holdout_fraction, " must be in [0, 1)"));
  }
  if (absl::Status s = ValidateCalibrationData(data); !s.ok()) return s;
  // Group requests by label (one group without labels), in label order.
  std::map<int, std::vector<int>> groups;
  for (int i = 0; i < data.n; ++i) groups[data.labels.empty() ? 0 : data.labels[i]].push_back(i);
  std::mt19937_64 rng(seed ^ 0x686f6c646f7574ULL);  // "holdout": independent of the k-means stream
  CalibrationSplit split;
  for (auto& [label, members] : groups) {
    // Seeded Fisher-Yates shuffle, then the first `held` members are held out.
    for (int i = static_cast<int>(members.size()) - 1; i > 0; --i) {
      const int j = std::min(static_cast<int>(UniformUnit(rng) * (i + 1)), i);
      std::swap(members[i], members[j]);
    }
    int held = static_cast<int>(std::lround(holdout_fraction * members.size()));
    held = std::min(held, static_cast<int>(members.size()) - 1);
    split.holdout_indices.insert(split.holdout_indices.end(), members.begin(), members.begin() + held);
    split.calibration_indices.insert(split.calibration_indices.end(), members.begin() + held, members.end());
  }
  std::sort(split.holdout_indices.begin(), split.holdout_indices.end());
  std::sort(split.calibration_indices.begin(), split.calibration_indices.end());
  split.calibration = SelectRequests(data, split.calibration_indices);
  split.holdout = SelectRequests(data, split.holdout_indices);
  return split;
}

absl::StatusOr<CalibrationData> CalibrationDataFromTrace(const ExpertTrace& trace, double prefill_fraction,
                                                         absl::Span<const int> sequences) {
  if (!(prefill_fraction > 0 && prefill_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("prefill fraction ", prefill_fraction, " must be in (0, 1)"));
  }
  if (trace.layers < 1 || trace.experts < 1) {
    return absl::InvalidArgumentError(absl::StrCat("trace: bad geometry L=", trace.layers, " E=", trace.experts));
  }
  std::vector<int> selected(sequences.begin(), sequences.end());
  if (selected.empty()) {
    selected.resize(trace.sequences.size());
    std::iota(selected.begin(), selected.end(), 0);
  }
  CalibrationData data;
  data.layers = trace.layers;
  data.experts = trace.experts;
  data.n = static_cast<int>(selected.size());
  data.label_names = trace.domains;
  const size_t per_request = static_cast<size_t>(trace.layers) * trace.experts;
  data.prefill_counts.assign(per_request * data.n, 0);
  data.decode_counts.assign(per_request * data.n, 0);
  data.labels.reserve(data.n);
  for (int r = 0; r < data.n; ++r) {
    const int s = selected[r];
    if (s < 0 || s >= static_cast<int>(trace.sequences.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("trace: sequence index ", s, " out of range [0, ", trace.sequences.size(), ")"));
    }
    const TraceSequence& seq = trace.sequences[s];
    const int prompt = PrefillTokens(seq.tokens, prefill_fraction);
    AccumulateCounts(trace, seq, 0, prompt, absl::MakeSpan(data.prefill_counts).subspan(r * per_request, per_request));
    AccumulateCounts(trace, seq, prompt, seq.tokens,
                     absl::MakeSpan(data.decode_counts).subspan(r * per_request, per_request));
    data.labels.push_back(seq.domain);
  }
  return data;
}

}  // namespace eldr
