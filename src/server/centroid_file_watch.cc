#include "server/centroid_file_watch.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "server/logging.h"

namespace eldr::server {

bool FileIdentity::operator==(const FileIdentity& other) const {
  return device == other.device && inode == other.inode && size == other.size &&
         modified.tv_sec == other.modified.tv_sec && modified.tv_nsec == other.modified.tv_nsec &&
         changed.tv_sec == other.changed.tv_sec && changed.tv_nsec == other.changed.tv_nsec;
}

std::optional<FileIdentity> StatFileIdentity(const std::string& path) {
  struct stat info;
  if (stat(path.c_str(), &info) != 0) return std::nullopt;
  FileIdentity identity;
  identity.device = info.st_dev;
  identity.inode = info.st_ino;
  identity.size = info.st_size;
  identity.modified = info.st_mtim;
  identity.changed = info.st_ctim;
  return identity;
}

CentroidFileWatch::CentroidFileWatch(std::string path, absl::Duration interval, std::function<void()> reload)
    : path_(std::move(path)), interval_(interval), reload_(std::move(reload)), loaded_(StatFileIdentity(path_)) {}

CentroidFileWatch::~CentroidFileWatch() { Stop(); }

absl::Status CentroidFileWatch::Start() {
  if (interval_ <= absl::ZeroDuration() || interval_ == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError("centroid file watch: the interval must be positive and finite");
  }
  thread_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(interval_)) PollOnce();
  });
  return absl::OkStatus();
}

void CentroidFileWatch::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

bool CentroidFileWatch::PollOnce() {
  const std::optional<FileIdentity> now = StatFileIdentity(path_);
  if (!now.has_value()) {
    const int error = errno;
    if (!reported_missing_) {
      ELDR_LOG(Warning, "centroid_file_unreadable").With("path", path_).With("error", std::strerror(error));
      reported_missing_ = true;
    }
    pending_.reset();
    return false;
  }
  reported_missing_ = false;
  if (loaded_.has_value() && *now == *loaded_) {
    pending_.reset();
    return false;
  }
  if (!pending_.has_value() || *pending_ != *now) {
    // First sight of this version: reload it once it is still the same at the next poll.
    pending_ = now;
    return false;
  }
  ELDR_LOG(Info, "centroid_file_changed").With("path", path_);
  loaded_ = now;
  pending_.reset();
  reload_();
  return true;
}

}  // namespace eldr::server
