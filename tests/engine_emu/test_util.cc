#include "engine_emu/test_util.h"

#include <cstdlib>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "sim/workload.h"
#include "testing/process.h"

namespace eldr::engine_emu::testing {

std::shared_ptr<const TraceCatalog> BundledCatalog() {
  static const std::shared_ptr<const TraceCatalog> catalog = [] {
    sim::TraceWorkloadOptions options;
    options.dir = ::eldr::testing::BundledTraceDir();
    absl::StatusOr<sim::Workload> workload = sim::LoadTraceWorkload(options);
    if (!workload.ok()) std::abort();
    absl::StatusOr<std::shared_ptr<const TraceCatalog>> made = TraceCatalog::Create(*std::move(workload));
    if (!made.ok()) std::abort();
    return *made;
  }();
  return catalog;
}

void ManualClock::RunAt(double at_us, std::function<void()> callback) {
  queue_.emplace(std::make_pair(at_us, seq_++), std::move(callback));
}

void ManualClock::AdvanceTo(double t_us) {
  while (!queue_.empty() && queue_.begin()->first.first <= t_us) {
    auto node = queue_.extract(queue_.begin());
    now_us_ = std::max(now_us_, node.key().first);
    node.mapped()();
  }
  now_us_ = std::max(now_us_, t_us);
}

int ManualClock::RunUntilIdle(int max_callbacks) {
  int ran = 0;
  while (!queue_.empty() && ran < max_callbacks) {
    auto node = queue_.extract(queue_.begin());
    now_us_ = std::max(now_us_, node.key().first);
    node.mapped()();
    ++ran;
  }
  return ran;
}

void FakeStream::Respond(http::HttpResponse response) {
  NoteCall();
  if (ended_ || begun_) return;
  response_ = std::move(response);
  responded_at_us_ = clock_->NowUs();
  ended_ = true;
}

void FakeStream::Begin(int status, std::string content_type, std::vector<std::pair<std::string, std::string>> headers) {
  NoteCall();
  if (ended_ || begun_) return;
  begun_ = true;
  begin_status_ = status;
  begin_content_type_ = std::move(content_type);
  begin_headers_ = std::move(headers);
}

void FakeStream::Write(std::string bytes, std::function<void(bool written)> written) {
  NoteCall();
  const bool ok = begun_ && !ended_ && !closed_;
  if (ok && !bytes.empty()) pieces_.push_back(Piece{clock_->NowUs(), std::move(bytes)});
  if (written) written(ok);
}

void FakeStream::Finish() {
  NoteCall();
  if (!begun_ || ended_) return;
  finished_ = true;
  ended_ = true;
}

std::string FakeStream::body() const {
  std::string all;
  for (const Piece& p : pieces_) all += p.bytes;
  return all;
}

std::vector<std::string> SseData(absl::string_view body) {
  std::vector<std::string> events;
  for (absl::string_view event : absl::StrSplit(body, "\n\n", absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&event, "data: ")) events.emplace_back(event);
  }
  return events;
}

std::vector<int16_t> DecodeCountsBase64(const std::string& base64) {
  std::string raw;
  if (!absl::Base64Unescape(base64, &raw) || raw.size() % 2 != 0) return {};
  std::vector<int16_t> counts(raw.size() / 2);
  for (size_t i = 0; i < counts.size(); ++i) {
    counts[i] = static_cast<int16_t>(static_cast<uint8_t>(raw[2 * i]) | (static_cast<uint8_t>(raw[2 * i + 1]) << 8));
  }
  return counts;
}

}  // namespace eldr::engine_emu::testing
