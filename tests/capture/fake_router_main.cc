// capture_fake_router: the capture tests' fake DecodeRouter as a process, for the Python tests.
// Prints "PORT <n>" on stdout once listening on 127.0.0.1 and serves until its stdin closes (so it
// dies with the test that started it).
#include <cstdio>
#include <iostream>
#include <string>

#include "capture/fake_router.h"

int main() {
  eldr::capture::testing::FakeRouter router;
  if (router.port() <= 0) {
    std::fprintf(stderr, "capture_fake_router: could not listen on 127.0.0.1\n");
    return 1;
  }
  std::printf("PORT %d\n", router.port());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  return 0;
}
