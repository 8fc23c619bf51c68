// The thread an engine emulator's engine runs on in the real binary: an asio io_context with one
// thread, and the EngineClock on top of it (std::chrono::steady_clock, asio steady_timers).
//
// Thread-safety: Post and NowUs may be called from any thread; RunAt on the
// loop's thread (it is the engine's clock); Start and Stop from one controlling thread, never from
// the loop's own.
#ifndef ELDR_ENGINE_EMU_ENGINE_LOOP_H_
#define ELDR_ENGINE_EMU_ENGINE_LOOP_H_

#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include "engine_emu/engine.h"

namespace eldr::engine_emu {

class EngineLoop : public EngineClock {
 public:
  EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;
  // Stop()s. Callbacks and posted functions that never ran are destroyed without running.
  ~EngineLoop() override;

  // Starts the loop's thread. Functions posted before run then, in order. Once only.
  void Start();
  // Stops the loop (what is running finishes; nothing else runs afterwards) and joins its thread.
  // Idempotent.
  void Stop();

  // Runs `fn` on the loop's thread, after what was posted before it. After Stop, `fn` never runs.
  void Post(std::function<void()> fn);

  // Microseconds since the loop was created (steady clock).
  double NowUs() const override;
  void RunAt(double at_us, std::function<void()> callback) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::chrono::steady_clock::time_point origin_;
  std::thread thread_;
};

}  // namespace eldr::engine_emu

#endif  // ELDR_ENGINE_EMU_ENGINE_LOOP_H_
