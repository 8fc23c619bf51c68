// File utilities shared by every module: bounded, non-blocking whole-file reads of regular files,
// atomic writes, full writes to a descriptor, an owning descriptor, and confinement of a
// caller-given path to a directory.
//
// Reads never hang and never run away: files are opened with O_NONBLOCK and must be regular files
// (a FIFO, a device such as /dev/zero, a socket or a directory is refused before any byte is read),
// and a file larger than the caller's limit is refused from its size, before it is read. Error
// messages name the path and what was wrong, never the file's contents.
//
// Thread-safety: every function may be called from any thread.
#ifndef ELDR_COMMON_FILE_H_
#define ELDR_COMMON_FILE_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace eldr {

// Default limit of ReadFile: far above any artifact, token or certificate this project reads, and
// low enough that a wrong path cannot make a process allocate without bound.
inline constexpr size_t kDefaultMaxFileBytes = size_t{1} << 30;

// Reads the whole regular file at `path` (symlinks followed). The type and size are checked with
// stat() before the file is opened (a device is never opened) and again on the open descriptor (a
// path swapped in between is caught too). The bytes are read straight into the result, and wiped
// before an error is returned, so a secret (a TLS key) leaves no stray copy behind.
// Errors, each naming the path in quotes: the errno-derived code of stat/open/read (NOT_FOUND,
// PERMISSION_DENIED, ...; "cannot read 'PATH': <strerror>"); FAILED_PRECONDITION when the path is
// not a regular file ("'PATH' is a FIFO, not a regular file"; likewise a directory, a character
// device, a block device, a socket); RESOURCE_EXHAUSTED when it holds more than `max_bytes` ("'PATH'
// is N bytes, over the limit of M bytes"; also when it grows past the limit while being read).
absl::StatusOr<std::string> ReadFile(const std::string& path, size_t max_bytes = kDefaultMaxFileBytes);

// Writes all of `bytes` to `fd`, retrying short writes and EINTR. Errors: the errno-derived code of
// write(2), message "write: <strerror>".
absl::Status WriteAll(int fd, absl::string_view bytes);

// Owns a file descriptor and closes it on destruction (a negative one is not owned). Move-only.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept;
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership without closing.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// Writes `contents` to `path` atomically: a temporary file in the same folder, fsync, rename over
// `path`, fsync of the folder. A reader sees either the old file or the complete new one. `mode`
// applies to the new file (before the umask).
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents, mode_t mode = 0644);

// Confines `path` to `directory`: resolves both (symlinks, `..`, relative paths against the working
// directory) and returns the resolved path when it lies strictly inside the resolved directory.
// A relative `path` is taken relative to `directory`. Errors: INVALID_ARGUMENT when `directory` is
// empty or cannot be resolved; PERMISSION_DENIED, with one message whatever the cause (missing,
// outside, a symlink loop, an unreadable component), when `path` does not resolve inside it, so the
// answer does not reveal what exists outside the directory.
absl::StatusOr<std::string> ResolvePathInside(const std::string& directory, const std::string& path);

}  // namespace eldr

#endif  // ELDR_COMMON_FILE_H_
