#include "engine_emu/kv_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace eldr::engine_emu {

KvRegistry::KvRegistry(KvRegistryOptions options, EmuMetrics* metrics)
    : options_(std::move(options)), metrics_(metrics) {}

std::vector<int64_t> KvRegistry::Hold(const std::string& request_id, int prompt_tokens, double now_us) {
  const int block_tokens = std::max(options_.block_tokens, 1);
  const int count = (std::max(prompt_tokens, 0) + block_tokens - 1) / block_tokens;
  absl::MutexLock lock(&mu_);
  HeldKv held;
  held.seq = next_seq_++;
  held.blocks.reserve(count);
  for (int i = 0; i < count; ++i) held.blocks.push_back(next_block_++);
  held.deadline_us = now_us + options_.hold_timeout_us;
  std::vector<int64_t> blocks = held.blocks;
  deadlines_.push_back(Deadline{held.deadline_us, request_id, held.seq});
  held_[request_id].push_back(std::move(held));
  ++held_requests_;
  held_blocks_ += count;
  PublishLocked();
  return blocks;
}

absl::StatusOr<int> KvRegistry::Pull(absl::string_view engine_id, absl::string_view request_id,
                                     absl::Span<const int64_t> block_ids, double now_us) {
  absl::MutexLock lock(&mu_);
  ExpireDueLocked(now_us);
  const auto it = held_.find(request_id);
  if (it == held_.end()) {
    return absl::NotFoundError(absl::StrCat("no KV is held for request '", request_id,
                                            "' (never prefilled here, already pulled, or freed after the timeout)"));
  }
  if (engine_id != options_.engine_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("remote_engine_id '", engine_id, "' is not this engine ('", options_.engine_id, "')"));
  }
  std::vector<HeldKv>& holds = it->second;
  const auto match = std::find_if(holds.begin(), holds.end(), [&](const HeldKv& held) {
    return std::equal(held.blocks.begin(), held.blocks.end(), block_ids.begin(), block_ids.end());
  });
  if (match == holds.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("remote_block_ids do not match the KV blocks held for request '", request_id, "'"));
  }
  const int blocks = static_cast<int>(match->blocks.size());
  EraseLocked(it->first, match->seq);
  if (metrics_ != nullptr) metrics_->CountKvFreed(KvFreeReason::kPulled);
  PublishLocked();
  return blocks;
}

int KvRegistry::ExpireDue(double now_us) {
  absl::MutexLock lock(&mu_);
  return ExpireDueLocked(now_us);
}

int KvRegistry::ExpireDueLocked(double now_us) {
  int freed = 0;
  while (!deadlines_.empty() && deadlines_.front().deadline_us <= now_us) {
    const Deadline due = std::move(deadlines_.front());
    deadlines_.pop_front();
    const auto it = held_.find(due.request_id);
    if (it == held_.end()) continue;
    const bool present =
        std::any_of(it->second.begin(), it->second.end(), [&](const HeldKv& held) { return held.seq == due.seq; });
    if (!present) continue;  // pulled before its deadline
    EraseLocked(due.request_id, due.seq);
    ++freed;
    if (metrics_ != nullptr) metrics_->CountKvFreed(KvFreeReason::kTimeout);
  }
  if (freed > 0) PublishLocked();
  return freed;
}

void KvRegistry::EraseLocked(const std::string& request_id, uint64_t seq) {
  const auto it = held_.find(request_id);
  if (it == held_.end()) return;
  std::vector<HeldKv>& holds = it->second;
  for (auto h = holds.begin(); h != holds.end(); ++h) {
    if (h->seq != seq) continue;
    --held_requests_;
    held_blocks_ -= static_cast<int64_t>(h->blocks.size());
    holds.erase(h);
    break;
  }
  if (holds.empty()) held_.erase(it);
}

void KvRegistry::PublishLocked() {
  if (metrics_ == nullptr) return;
  metrics_->SetKvHeld(held_requests_);
  metrics_->SetKvUsage(static_cast<double>(held_blocks_) * std::max(options_.block_tokens, 1) /
                       static_cast<double>(std::max<int64_t>(options_.capacity_tokens, 1)));
}

std::optional<double> KvRegistry::NextDeadline() const {
  absl::MutexLock lock(&mu_);
  if (deadlines_.empty()) return std::nullopt;
  return deadlines_.front().deadline_us;
}

int64_t KvRegistry::held_requests() const {
  absl::MutexLock lock(&mu_);
  return held_requests_;
}

int64_t KvRegistry::held_blocks() const {
  absl::MutexLock lock(&mu_);
  return held_blocks_;
}

}  // namespace eldr::engine_emu
