#include "engine_emu/engine_loop.h"

#include <cmath>
#include <utility>

#include "boost/asio/executor_work_guard.hpp"
#include "boost/asio/io_context.hpp"
#include "boost/asio/post.hpp"
#include "boost/asio/steady_timer.hpp"

namespace eldr::engine_emu {

struct EngineLoop::Impl {
  boost::asio::io_context io{1};
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work = boost::asio::make_work_guard(io);
};

EngineLoop::EngineLoop() : impl_(std::make_unique<Impl>()), origin_(std::chrono::steady_clock::now()) {}

EngineLoop::~EngineLoop() { Stop(); }

void EngineLoop::Start() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] {
    // An exception from a callback must not end the process: the engine's callbacks do not
    // throw, but the loop outlives any one of them.
    while (true) {
      try {
        impl_->io.run();
        return;
      } catch (...) {
        if (impl_->io.stopped()) return;
      }
    }
  });
}

void EngineLoop::Stop() {
  impl_->work.reset();
  impl_->io.stop();
  if (thread_.joinable()) thread_.join();
}

void EngineLoop::Post(std::function<void()> fn) { boost::asio::post(impl_->io, std::move(fn)); }

double EngineLoop::NowUs() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_).count();
}

void EngineLoop::RunAt(double at_us, std::function<void()> callback) {
  auto timer = std::make_shared<boost::asio::steady_timer>(impl_->io);
  const double clamped = std::isfinite(at_us) ? std::max(at_us, 0.0) : 0.0;
  timer->expires_at(origin_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                  std::chrono::duration<double, std::micro>(clamped)));
  timer->async_wait([timer, callback = std::move(callback)](const boost::system::error_code& error) {
    if (!error) callback();
  });
}

}  // namespace eldr::engine_emu
