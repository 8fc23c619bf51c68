// CentroidFileWatch: reloads the --centroids file when it changes on disk, so an edited Kubernetes
// ConfigMap reaches the router without a restart or a SIGHUP.
//
// The kubelet updates a mounted ConfigMap by writing the new data into a fresh folder and swapping
// a `..data` symlink to it; the mounted file name is a symlink through `..data`. inotify on the
// file name sees none of that, so the watch polls instead: every `interval` it stat()s the path
// (following symlinks) and compares the file's identity (device, inode, size, modification and
// change times). A changed identity is reloaded once it has stayed the same for one more poll, so
// a file still being written in place is not read half-way. A path that cannot be stat()ed (a
// moment between an editor's unlink and rename, or a removed file) is logged once and waited out;
// the centroids in service stay.
//
// The reload callback is the server's reload path (parse, validate, install, log, count); a bad
// artifact is refused there and the previous set stays in service.
//
// Thread-safety: Start and Stop are called by the owner (RouterServer), once each; the callback
// runs on the watch's own thread.
#ifndef ELDR_SERVER_CENTROID_FILE_WATCH_H_
#define ELDR_SERVER_CENTROID_FILE_WATCH_H_

#include <sys/types.h>

#include <ctime>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/server.h"

namespace eldr::server {

// What identifies one version of a file's contents without reading it.
struct FileIdentity {
  dev_t device = 0;
  ino_t inode = 0;
  off_t size = 0;
  timespec modified{};
  timespec changed{};

  bool operator==(const FileIdentity& other) const;
  bool operator!=(const FileIdentity& other) const { return !(*this == other); }
};

// The identity of `path` (symlinks followed); nullopt when it cannot be stat()ed.
std::optional<FileIdentity> StatFileIdentity(const std::string& path);

class CentroidFileWatch final : public BackgroundComponent {
 public:
  // Records the identity of `path` now, as the version already loaded. `interval` > 0.
  CentroidFileWatch(std::string path, absl::Duration interval, std::function<void()> reload);
  ~CentroidFileWatch() override;

  std::string name() const override { return "centroid_file_watch"; }
  absl::Status Start() override;
  void Stop() override;

  // One poll; the thread calls it every interval. Returns true when it called `reload`.
  // Exposed for tests, which drive it without the thread.
  bool PollOnce();

 private:
  const std::string path_;
  const absl::Duration interval_;
  const std::function<void()> reload_;

  // Only the polling thread (or a test calling PollOnce) touches these.
  std::optional<FileIdentity> loaded_;   // the version in service (or last attempted)
  std::optional<FileIdentity> pending_;  // a changed version waiting to be stable for one poll
  bool reported_missing_ = false;

  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_CENTROID_FILE_WATCH_H_
