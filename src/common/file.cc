#include "eldr/common/file.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace eldr {
namespace {

absl::Status ErrnoError(int error_number, absl::string_view what, const std::string& path) {
  return absl::ErrnoToStatus(error_number, absl::StrCat(what, " '", path, "'"));
}

absl::string_view FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "something other than a file";
}

// What ReadFile accepts: a regular file of at most `max_bytes`.
absl::Status CheckReadable(const std::string& path, const struct stat& info, size_t max_bytes) {
  if (!S_ISREG(info.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", path, "' is ", FileKind(info.st_mode), ", not a regular file"));
  }
  if (info.st_size < 0 || static_cast<uint64_t>(info.st_size) > max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("'", path, "' is ", info.st_size, " bytes, over the limit of ", max_bytes, " bytes"));
  }
  return absl::OkStatus();
}

// realpath(3) into a std::string; nullopt-style: empty on failure with errno set.
std::string RealPath(const std::string& path) {
  std::unique_ptr<char, decltype(&::free)> resolved(::realpath(path.c_str(), nullptr), &::free);
  return resolved == nullptr ? std::string() : std::string(resolved.get());
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::string& path, size_t max_bytes) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) return ErrnoError(errno, "cannot read", path);
  if (absl::Status readable = CheckReadable(path, info, max_bytes); !readable.ok()) return readable;
  // O_NONBLOCK: should a FIFO or a device be swapped in after the stat, opening it does not block.
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (!fd.valid()) return ErrnoError(errno, "cannot read", path);
  if (::fstat(fd.get(), &info) != 0) return ErrnoError(errno, "cannot read", path);
  if (absl::Status readable = CheckReadable(path, info, max_bytes); !readable.ok()) return readable;
  std::string contents;
  const auto fail = [&contents](absl::Status status) {
    ::explicit_bzero(contents.data(), contents.size());
    return status;
  };
  // Sized for the file as fstat saw it; one byte more than the limit tells a file that grew past it.
  contents.reserve(std::min(static_cast<size_t>(info.st_size), max_bytes) + 1);
  while (true) {
    const size_t used = contents.size();
    const size_t room = std::min<size_t>(size_t{1} << 16, max_bytes + 1 - used);
    contents.resize(used + room);
    const ssize_t got = ::read(fd.get(), contents.data() + used, room);
    const int read_error = errno;
    contents.resize(used + static_cast<size_t>(std::max<ssize_t>(got, 0)));
    if (got < 0) {
      if (read_error == EINTR) continue;
      return fail(ErrnoError(read_error, "cannot read", path));
    }
    if (got == 0) break;
    if (contents.size() > max_bytes) {
      return fail(absl::ResourceExhaustedError(
          absl::StrCat("'", path, "' grew over the limit of ", max_bytes, " bytes while being read")));
    }
  }
  return contents;
}

absl::Status WriteAll(int fd, absl::string_view bytes) {
  const char* data = bytes.data();
  size_t left = bytes.size();
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

ScopedFd& ScopedFd::operator=(ScopedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
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
