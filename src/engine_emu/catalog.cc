#include "engine_emu/catalog.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace eldr::engine_emu {

std::optional<int> ParseTraceMarker(absl::string_view text, int pool_size) {
  static constexpr absl::string_view kMarker = "eldr-trace:";
  size_t from = 0;
  while (true) {
    const size_t at = text.find(kMarker, from);
    if (at == absl::string_view::npos) return std::nullopt;
    size_t pos = at + kMarker.size();
    if (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') {
      uint64_t value = 0;
      for (; pos < text.size() && text[pos] >= '0' && text[pos] <= '9'; ++pos) {
        // (value * 10 + digit) mod pool_size never exceeds 10 * 2^31 + 9: no overflow.
        value = (value * 10 + static_cast<uint64_t>(text[pos] - '0')) % static_cast<uint64_t>(pool_size);
      }
      return static_cast<int>(value);
    }
    from = at + 1;
  }
}

int TraceIndexForPrompt(absl::string_view text, int pool_size) {
  if (std::optional<int> marked = ParseTraceMarker(text, pool_size)) return *marked;
  return static_cast<int>(Fnv1a64(text) % static_cast<uint64_t>(pool_size));
}

std::string EncodeCountsBase64(absl::Span<const int16_t> counts) {
  std::string wire(counts.size() * 2, '\0');
  for (size_t i = 0; i < counts.size(); ++i) {
    const uint16_t value = static_cast<uint16_t>(std::max<int16_t>(counts[i], 0));
    wire[2 * i] = static_cast<char>(value & 0xff);
    wire[2 * i + 1] = static_cast<char>(value >> 8);
  }
  return absl::Base64Escape(wire);
}

std::string EncodeGateProbSumsBase64(absl::Span<const int16_t> counts, int top_k) {
  std::string wire(counts.size() * 4, '\0');
  for (size_t i = 0; i < counts.size(); ++i) {
    const float sum = static_cast<float>(std::max<int16_t>(counts[i], 0)) / static_cast<float>(top_k);
    uint32_t bits;
    std::memcpy(&bits, &sum, sizeof(bits));
    for (int b = 0; b < 4; ++b) wire[4 * i + b] = static_cast<char>((bits >> (8 * b)) & 0xff);
  }
  return absl::Base64Escape(wire);
}

TraceCatalog::TraceCatalog(sim::Workload workload) : workload_(std::move(workload)) {
  counts_base64_.reserve(workload_.pool.size());
  gate_prob_sums_base64_.reserve(workload_.pool.size());
  for (const sim::SimRequest& request : workload_.pool) {
    counts_base64_.push_back(EncodeCountsBase64(request.prompt_counts));
    gate_prob_sums_base64_.push_back(EncodeGateProbSumsBase64(request.prompt_counts, workload_.top_k));
  }
}

absl::StatusOr<std::shared_ptr<const TraceCatalog>> TraceCatalog::Create(sim::Workload workload) {
  if (workload.pool.empty()) return absl::InvalidArgumentError("the workload's evaluation pool is empty");
  if (workload.layers < 1 || workload.top_k < 1 || workload.experts < 1 || workload.experts > 256) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workload geometry %dx%d top-%d: need layers >= 1, 1 <= experts <= 256, top_k >= 1",
                        workload.layers, workload.experts, workload.top_k));
  }
  const size_t plane = static_cast<size_t>(workload.layers) * workload.experts;
  for (size_t i = 0; i < workload.pool.size(); ++i) {
    const sim::SimRequest& request = workload.pool[i];
    if (request.decode_steps < 1 || request.decode_topk == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("workload request ", i, " (", request.source, ") has no decode steps to replay"));
    }
    if (request.prompt_counts.size() != plane) {
      return absl::InvalidArgumentError(absl::StrCat("workload request ", i, " (", request.source, ") has ",
                                                     request.prompt_counts.size(), " prompt counts, expected ", plane));
    }
    if (request.prompt_tokens < 0) {
      return absl::InvalidArgumentError(absl::StrCat("workload request ", i, " has a negative prompt length"));
    }
  }
  return std::shared_ptr<const TraceCatalog>(new TraceCatalog(std::move(workload)));
}

const uint8_t* TraceCatalog::DecodeExperts(int index, int64_t step) const {
  const sim::SimRequest& r = workload_.pool[index];
  return workload_.DecodeToken(r, static_cast<int>(step % r.decode_steps));
}

}  // namespace eldr::engine_emu
