// Test doubles for the engine emulator's logic: a manual clock (time moves only when a test says
// so), a ResponseStream that records what an engine wrote, a KV puller completed by hand, and the
// bundled traces loaded once.
#ifndef ELDR_TESTS_ENGINE_EMU_TEST_UTIL_H_
#define ELDR_TESTS_ENGINE_EMU_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "eldr/http/http_server.h"
#include "engine_emu/catalog.h"
#include "engine_emu/decode_engine.h"
#include "engine_emu/engine.h"

namespace eldr::engine_emu::testing {

// The bundled traces ($ELDR_DATA_DIR/esft-routing) with eldr-sim's default split, loaded once.
std::shared_ptr<const TraceCatalog> BundledCatalog();

// The `data:` payloads of the events of an SSE body, in order (events split at blank lines).
std::vector<std::string> SseData(absl::string_view body);

// An EngineClock whose time moves only in AdvanceTo/AdvanceBy; callbacks run in order of their
// times (equal times: in the order they were scheduled), each with NowUs() equal to its time.
class ManualClock : public EngineClock {
 public:
  double NowUs() const override { return now_us_; }
  void RunAt(double at_us, std::function<void()> callback) override;

  // Runs every callback due at or before `t_us` (including those they schedule), then sets the
  // time to `t_us` (never backwards).
  void AdvanceTo(double t_us);
  void AdvanceBy(double delta_us) { AdvanceTo(now_us_ + delta_us); }
  // Runs callbacks until none is pending, at most `max_callbacks`; returns how many ran.
  int RunUntilIdle(int max_callbacks = 1000000);
  size_t pending() const { return queue_.size(); }
  // The time of the earliest pending callback, or -1.
  double NextAtUs() const { return queue_.empty() ? -1 : queue_.begin()->first.first; }

 private:
  double now_us_ = 0;
  uint64_t seq_ = 0;
  std::map<std::pair<double, uint64_t>, std::function<void()>> queue_;
};

// A ResponseStream that records every call, with the clock's time.
class FakeStream : public http::ResponseStream {
 public:
  struct Piece {
    double time_us;
    std::string bytes;
  };

  explicit FakeStream(const EngineClock* clock) : clock_(clock) {}

  void Respond(http::HttpResponse response) override;
  void Begin(int status, std::string content_type,
             std::vector<std::pair<std::string, std::string>> headers = {}) override;
  void Write(std::string bytes, std::function<void(bool written)> written = nullptr) override;
  void Finish() override;
  void Abort() override { ended_ = true; }
  void OnClosed(std::function<void()> callback) override { on_closed_ = std::move(callback); }
  size_t queued_bytes() const override { return 0; }
  bool done() const override { return ended_ || closed_; }

  // The client goes away: done() turns true (the engine is not told; see Engine::Abort).
  void Close() { closed_ = true; }

  // What was written.
  bool responded() const { return response_.has_value(); }
  const http::HttpResponse& response() const { return *response_; }
  double responded_at_us() const { return responded_at_us_; }
  bool begun() const { return begun_; }
  int begin_status() const { return begin_status_; }
  const std::string& begin_content_type() const { return begin_content_type_; }
  const std::vector<std::pair<std::string, std::string>>& begin_headers() const { return begin_headers_; }
  const std::vector<Piece>& pieces() const { return pieces_; }
  bool finished() const { return finished_; }
  // Every piece concatenated.
  std::string body() const;
  // The `data:` payloads of the events written so far (SseData of body()).
  std::vector<std::string> Events() const { return SseData(body()); }
  // Calls made after the stream ended (Finish or Respond): an engine must make none.
  int calls_after_end() const { return calls_after_end_; }

 private:
  void NoteCall() {
    if (ended_) ++calls_after_end_;
  }

  const EngineClock* clock_;
  std::optional<http::HttpResponse> response_;
  double responded_at_us_ = -1;
  bool begun_ = false;
  int begin_status_ = 0;
  std::string begin_content_type_;
  std::vector<std::pair<std::string, std::string>> begin_headers_;
  std::vector<Piece> pieces_;
  bool finished_ = false;
  bool ended_ = false;
  bool closed_ = false;
  int calls_after_end_ = 0;
  std::function<void()> on_closed_;
};

// A KvPuller whose pulls the test completes (Complete) on the engine's thread, i.e. the test's.
class FakeKvPuller : public KvPuller {
 public:
  void Pull(const RemotePrefill& remote, std::function<void(absl::Status)> done) override {
    pulls_.push_back(remote);
    pending_.push_back(std::move(done));
  }
  // Completes the `i`-th pull (in the order they were made) with `status`.
  void Complete(size_t i, absl::Status status) {
    std::function<void(absl::Status)> done = std::move(pending_.at(i));
    pending_.at(i) = nullptr;
    if (done) done(std::move(status));
  }
  const std::vector<RemotePrefill>& pulls() const { return pulls_; }

 private:
  std::vector<RemotePrefill> pulls_;
  std::vector<std::function<void(absl::Status)>> pending_;
};

// Decodes a base64 int16-LE payload back to counts; empty on malformed input.
std::vector<int16_t> DecodeCountsBase64(const std::string& base64);

}  // namespace eldr::engine_emu::testing

#endif  // ELDR_TESTS_ENGINE_EMU_TEST_UTIL_H_
