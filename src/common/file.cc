#include "eldr/common/file.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace eldr {
namespace {

absl::Status ErrnoError(int error_number, absl::string_view what, const std::string& path) {
  return absl::ErrnoToStatus(error_number, absl::StrCat(what, " ", path));
}

// Closes a descriptor when it goes out of scope.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  const int fd_;
};

absl::Status WriteAll(int fd, absl::string_view contents) {
  const char* data = contents.data();
  size_t left = contents.size();
  while (left > 0) {
    const ssize_t wrote = ::write(fd, data, left);
    if (wrote < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno, "write");
    }
    data += wrote;
    left -= static_cast<size_t>(wrote);
  }
  return absl::OkStatus();
}

absl::string_view FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// realpath(3) into a std::string; nullopt-style: empty on failure with errno set.
std::string RealPath(const std::string& path) {
  std::unique_ptr<char, decltype(&::free)> resolved(::realpath(path.c_str(), nullptr), &::free);
  return resolved == nullptr ? std::string() : std::string(resolved.get());
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::string& path, size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO without a writer, or a device, must not block; regular files
  // ignore the flag.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return ErrnoError(errno, "cannot open", path);
  FdCloser closer(fd);
  struct stat info;
  if (::fstat(fd, &info) != 0) return ErrnoError(errno, "cannot stat", path);
  if (!S_ISREG(info.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("cannot read ", path, ": ", FileKind(info.st_mode)));
  }
  if (info.st_size < 0 || static_cast<uint64_t>(info.st_size) > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot read ", path, ": ", info.st_size, " bytes is over the limit of ", max_bytes));
  }
  std::string contents;
  contents.reserve(static_cast<size_t>(info.st_size));
  char buffer[1 << 16];
  while (true) {
    const ssize_t got = ::read(fd, buffer, sizeof(buffer));
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot read", path);
    }
    if (got == 0) break;
    if (contents.size() + static_cast<size_t>(got) > max_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot read ", path, ": it grew over the limit of ", max_bytes, " bytes while read"));
    }
    contents.append(buffer, static_cast<size_t>(got));
  }
  return contents;
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents, mode_t mode) {
  if (path.empty()) return absl::InvalidArgumentError("WriteFileAtomically: empty path");
  static std::atomic<uint64_t> sequence{0};
  const std::string temporary =
      absl::StrCat(path, ".tmp.", ::getpid(), ".", sequence.fetch_add(1, std::memory_order_relaxed));
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) return ErrnoError(errno, "cannot create", temporary);
  absl::Status status = WriteAll(fd, contents);
  if (status.ok() && ::fsync(fd) != 0) status = absl::ErrnoToStatus(errno, "fsync");
  if (::close(fd) != 0 && status.ok()) status = absl::ErrnoToStatus(errno, "close");
  if (status.ok() && ::rename(temporary.c_str(), path.c_str()) != 0) {
    status = absl::ErrnoToStatus(errno, "rename");
  }
  if (!status.ok()) {
    ::unlink(temporary.c_str());
    return absl::Status(status.code(), absl::StrCat("writing ", path, ": ", status.message()));
  }
  // Make the rename itself durable.
  const size_t slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dir_fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ResolvePathInside(const std::string& directory, const std::string& path) {
  if (directory.empty()) return absl::InvalidArgumentError("no directory to confine paths to");
  const std::string root = RealPath(directory);
  if (root.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("directory ", directory, " cannot be resolved"));
  }
  const std::string refused = absl::StrCat("path is not a file inside the allowed directory ", root);
  if (path.empty() || path.find('\0') != std::string::npos) return absl::PermissionDeniedError(refused);
  const std::string joined = path[0] == '/' ? path : absl::StrCat(root, "/", path);
  const std::string resolved = RealPath(joined);
  if (resolved.empty()) return absl::PermissionDeniedError(refused);
  const std::string prefix = root == "/" ? root : absl::StrCat(root, "/");
  if (!absl::StartsWith(resolved, prefix) || resolved.size() == prefix.size()) {
    return absl::PermissionDeniedError(refused);
  }
  return resolved;
}

}  // namespace eldr
