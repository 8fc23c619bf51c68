#include "eldr/discovery/pool_reconciler.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"

namespace eldr::discovery {
namespace {

using State = DiscoveredWorker::State;

}  // namespace

absl::string_view PoolActionLabel(PoolAction action) {
  switch (action) {
    case PoolAction::kUpsert:
      return "upsert";
    case PoolAction::kDrain:
      return "drain";
    case PoolAction::kRemove:
      return "remove";
  }
  return "unknown";
}

PoolReconciler::PoolReconciler(PoolSink* sink, ReconcilerOptions options) : sink_(sink), options_(std::move(options)) {}

void PoolReconciler::Update(const std::vector<DiscoveredWorker>& desired, absl::Time now) {
  const bool initial = first_update_ && !options_.settle_initial;
  first_update_ = false;
  absl::flat_hash_set<absl::string_view> seen;
  seen.reserve(desired.size());
  for (const DiscoveredWorker& worker : desired) {
    if (!seen.insert(worker.spec.id).second) continue;
    auto [it, inserted] = entries_.try_emplace(worker.spec.id);
    Entry& entry = it->second;
    const bool changed = inserted || !entry.desired.has_value() || entry.desired->state != worker.state ||
                         entry.desired->uid != worker.uid || !SameWorkerSpec(entry.desired->spec, worker.spec);
    if (changed) {
      entry.desired = Desired{worker.spec, worker.state, worker.uid};
      // A worker of the first set counts as settled: there is no history to debounce against.
      entry.since = initial ? now - options_.settle : now;
    }
  }
  for (auto& [id, entry] : entries_) {
    if (entry.desired.has_value() && !seen.contains(id)) {
      entry.desired.reset();
      entry.since = now;
    }
  }
  Tick(now);
}

void PoolReconciler::Tick(absl::Time now) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (Reconcile(it->first, it->second, now)) {
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

bool PoolReconciler::Call(PoolAction action, const std::string& id, const WorkerSpec* spec, Entry& entry,
                          absl::Time now) {
  absl::Status result;
  switch (action) {
    case PoolAction::kUpsert:
      result = sink_->Upsert(*spec);
      break;
    case PoolAction::kDrain:
      result = sink_->Drain(id);
      break;
    case PoolAction::kRemove:
      result = sink_->Remove(id);
      break;
  }
  const int index = static_cast<int>(action);
  if (result.ok()) {
    ++stats_.applied[index];
    entry.retry_at = absl::InfinitePast();
    entry.failures = 0;
  } else {
    ++stats_.failed[index];
    absl::Duration wait = options_.retry_interval;
    for (int i = 0; i < entry.failures && wait < options_.max_retry_interval; ++i) wait *= 2;
    entry.retry_at = now + std::min(wait, std::max(options_.retry_interval, options_.max_retry_interval));
    ++entry.failures;
  }
  if (options_.on_change) options_.on_change(action, id, result);
  return result.ok();
}

bool PoolReconciler::Reconcile(const std::string& id, Entry& entry, absl::Time now) {
  if (now < entry.retry_at) return false;
  auto applied = applied_.find(id);
  // Stop routing at once: gone, replaced, or no longer ready.
  if (applied != applied_.end()) {
    const bool absent = !entry.desired.has_value();
    const bool replaced = !absent && entry.desired->uid != applied->second.uid;
    if (absent || replaced) {
      if (!Call(PoolAction::kRemove, id, nullptr, entry, now)) return false;
      applied_.erase(applied);
      applied = applied_.end();
    } else if (entry.desired->state != State::kReady && !applied->second.draining) {
      if (!Call(PoolAction::kDrain, id, nullptr, entry, now)) return false;
      applied->second.draining = true;
    }
  }
  if (!entry.desired.has_value()) return applied == applied_.end();
  // Start routing only once settled.
  const Desired& desired = *entry.desired;
  if (desired.state != State::kReady) return false;
  const bool needed =
      applied == applied_.end() || applied->second.draining || !SameWorkerSpec(applied->second.spec, desired.spec);
  if (!needed || now - entry.since < options_.settle) return false;
  if (!Call(PoolAction::kUpsert, id, &desired.spec, entry, now)) return false;
  applied_[id] = Applied{desired.spec, desired.uid, /*draining=*/false};
  return false;
}

std::optional<absl::Time> PoolReconciler::Due(const std::string& id, const Entry& entry) const {
  auto applied = applied_.find(id);
  std::optional<absl::Time> due;
  if (applied != applied_.end()) {
    const bool absent = !entry.desired.has_value();
    if (absent || entry.desired->uid != applied->second.uid ||
        (entry.desired->state != State::kReady && !applied->second.draining)) {
      due = absl::InfinitePast();  // a stop-routing transition: due at once
    }
  }
  if (!due.has_value() && entry.desired.has_value() && entry.desired->state == State::kReady) {
    const bool replaced = applied != applied_.end() && entry.desired->uid != applied->second.uid;
    const bool needed = applied == applied_.end() || replaced || applied->second.draining ||
                        !SameWorkerSpec(applied->second.spec, entry.desired->spec);
    if (needed) due = entry.since + options_.settle;
  }
  if (due.has_value()) due = std::max(*due, entry.retry_at);
  return due;
}

absl::Time PoolReconciler::NextDeadline() const {
  absl::Time next = absl::InfiniteFuture();
  for (const auto& [id, entry] : entries_) {
    if (std::optional<absl::Time> due = Due(id, entry)) next = std::min(next, *due);
  }
  return next;
}

ReconcilerStats PoolReconciler::stats() const {
  ReconcilerStats stats = stats_;
  stats.pending = 0;
  for (const auto& [id, entry] : entries_) {
    if (Due(id, entry).has_value()) ++stats.pending;
  }
  return stats;
}

}  // namespace eldr::discovery
