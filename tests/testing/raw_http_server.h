// A TCP server on 127.0.0.1 for tests that play the server's part themselves, byte by byte: each
// accepted connection runs a handler on its own thread, which reads the requests with
// RawRequestReader and writes whatever it likes (SendAll). For what a well-behaved server never
// does: slow or malformed answers, closing mid-body, stalling. No GoogleTest dependency.
#ifndef ELDR_TESTS_TESTING_RAW_HTTP_SERVER_H_
#define ELDR_TESTS_TESTING_RAW_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "testing/raw_http_client.h"  // SendAll

namespace eldr::testing {

// Waits until `fd` is readable (or at its end); false on timeout.
bool WaitReadable(int fd, absl::Duration timeout);

// True once the peer closed or reset the connection (read returns 0 or an error), within `timeout`.
// What arrives meanwhile is read and dropped.
bool WaitForPeerClose(int fd, absl::Duration timeout);

// The requests of one connection, read one at a time.
class RawRequestReader {
 public:
  explicit RawRequestReader(int fd) : fd_(fd) {}

  // The next request (head and Content-Length body), or nullopt when the peer closed, or nothing
  // arrived within `timeout`.
  std::optional<std::string> Next(absl::Duration timeout = absl::Seconds(10));

 private:
  int fd_;
  std::string buffer_;
};

// Runs `handler` for every accepted connection, each on its own thread; the connection is closed
// when the handler returns. The destructor shuts every connection down (unblocking handlers that
// read or write) and joins the threads.
class RawHttpServer {
 public:
  using Handler = std::function<void(int fd, int connection_index)>;

  // Listens on 127.0.0.1:0 with `backlog`; without `accept_connections` nothing is ever accepted
  // (connections wait in the backlog). When it cannot listen, port() is 0 and error() says why.
  explicit RawHttpServer(Handler handler, int backlog = 512, bool accept_connections = true);
  ~RawHttpServer();
  RawHttpServer(const RawHttpServer&) = delete;
  RawHttpServer& operator=(const RawHttpServer&) = delete;

  int port() const { return port_; }
  const std::string& error() const { return error_; }
  // Connections accepted so far.
  int accepted() const { return accepted_.load(); }

 private:
  void AcceptLoop();

  Handler handler_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::string error_;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::thread accept_thread_;
  absl::Mutex mu_;
  std::vector<int> open_fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;  // only touched by the accept thread, then the destructor
};

}  // namespace eldr::testing

#endif  // ELDR_TESTS_TESTING_RAW_HTTP_SERVER_H_
