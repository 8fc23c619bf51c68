#include "eldr/proxy/request_id.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"

namespace eldr::proxy {
namespace {

// Fills `out` from getrandom(2); false when the kernel source is unavailable.
bool KernelRandom(unsigned char* out, size_t size) {
  size_t filled = 0;
  while (filled < size) {
    const ssize_t n = getrandom(out + filled, size - filled, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    filled += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

std::string NewRequestId() {
  unsigned char bytes[16];
  if (!KernelRandom(bytes, sizeof(bytes))) {
    // absl::BitGen seeds itself from the OS's entropy (or its own fallback) once per thread.
    thread_local absl::BitGen generator;
    for (unsigned char& byte : bytes) byte = absl::Uniform<unsigned char>(generator);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

absl::Status ValidateRequestId(absl::string_view id) {
  if (id.empty()) return absl::InvalidArgumentError("the request id is empty");
  if (id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("the request id is %d bytes long; at most %d are accepted", id.size(), kMaxRequestIdBytes));
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const auto c = static_cast<unsigned char>(id[i]);
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the request id has byte 0x%02x at position %d; only visible ASCII (0x21-0x7e) is accepted", c, i));
    }
  }
  return absl::OkStatus();
}

}  // namespace eldr::proxy
