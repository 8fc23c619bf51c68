// CentroidLoader: every centroid artifact the daemon takes from outside (the configured file at
// start, SIGHUP, the file watch, the ReloadCentroids admin RPC by path or inline) is read, parsed
// and handed to the one door, Router::InstallCentroids, here. The router's observers then log,
// count and re-evaluate readiness for every source alike (online refit installs through the same
// door from its own thread).
//
// Reading is safe on any path an admin may send: a path must resolve (symlinks and `..` followed)
// to a regular file inside the allowed directory (--centroids_dir, default the folder of
// --centroids), it is opened without blocking, and its size is checked against
// --max_artifact_bytes before it is read; a FIFO, a device or anything outside the directory is
// refused with one PERMISSION_DENIED/FAILED_PRECONDITION message that reveals nothing about what
// exists elsewhere, and no error ever quotes the file's contents.
//
// Requests are queued: one runs at a time on the loader's own thread and at most one more waits.
// A reload of the configured file joins a waiting one (SIGHUP storms and file-watch events
// coalesce: one reload answers them all); any other request while one is waiting is refused at
// once with RESOURCE_EXHAUSTED. So memory and work stay bounded whatever callers do, and a slow
// load never blocks a gRPC thread or the signal thread.
//
// Thread-safety: every method may be called from any thread. Callbacks run on the loader's thread
// (or, for refusals, on the calling thread) and must not block.
#ifndef ELDR_SERVER_CENTROID_LOADER_H_
#define ELDR_SERVER_CENTROID_LOADER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "eldr/core/router.h"

namespace eldr::server {

struct CentroidLoaderOptions {
  std::string configured_path;  // --centroids; empty: none configured
  // Where path reloads may read; empty: the folder of configured_path; both empty: no path reloads.
  std::string allowed_dir;
  size_t max_artifact_bytes = size_t{256} << 20;
  // Discovered pools (--discovery=kubernetes): worker ids are pod names, unknown when the
  // artifact was calibrated, so every artifact is fitted to the pool (FitRowsToPool) before it is
  // installed.
  bool fit_rows_to_pool = false;
};

// The artifact with every row named after a worker of `pool` (ids in pool order): a row already
// named after a worker of the pool keeps it; every other row goes to the next worker of the pool
// that has no row yet; rows left over (more rows than workers) are dropped. The artifact is
// returned unchanged when `pool` is empty or no row would be left.
CentroidArtifact FitRowsToPool(CentroidArtifact artifact, const std::vector<std::string>& pool);

struct LoadedCentroids {
  uint64_t generation = 0;
  int rows = 0;
};
using LoadCallback = std::function<void(const absl::StatusOr<LoadedCentroids>& result)>;

class CentroidLoader {
 public:
  // `router` must outlive the loader (see Shutdown). INVALID_ARGUMENT when the allowed directory
  // cannot be resolved. Starts the loader's thread.
  static absl::StatusOr<std::unique_ptr<CentroidLoader>> Create(CentroidLoaderOptions options, Router* router);
  // Shutdown(InfiniteFuture) and joins the thread.
  ~CentroidLoader();

  // Reads, parses and installs the configured file now, on the calling thread (startup).
  // FAILED_PRECONDITION when none is configured.
  absl::StatusOr<LoadedCentroids> LoadConfiguredNow(CentroidSource source);

  // Queued loads (see above). `done` is called exactly once with the outcome.
  void ReloadConfigured(CentroidSource source, LoadCallback done = nullptr);
  void ReloadPath(std::string path, LoadCallback done);
  void ReloadInline(std::string artifact_json, LoadCallback done);

  // Stops taking requests (later ones get UNAVAILABLE), answers a waiting one UNAVAILABLE, and
  // waits until the running one finished or `deadline` passed. Returns whether nothing runs any
  // more; when false the loader still uses the router and must not be destroyed (the daemon then
  // exits without destroying anything). Idempotent.
  bool Shutdown(absl::Time deadline);

  // The resolved directory path reloads read from (empty: path reloads are disabled).
  const std::string& allowed_dir() const { return allowed_dir_; }

 private:
  enum class Kind { kConfigured, kPath, kInline };
  struct Request {
    Kind kind = Kind::kConfigured;
    CentroidSource source = CentroidSource::kAdmin;
    std::string text;                // the path or the artifact JSON
    std::vector<LoadCallback> done;  // everyone waiting for this load
  };

  CentroidLoader(CentroidLoaderOptions options, std::string allowed_dir, Router* router);
  void Enqueue(Request request);
  void Run();
  absl::StatusOr<LoadedCentroids> Load(const Request& request);
  // The artifact text of a request: the file (confined, bounded) or the inline JSON.
  absl::StatusOr<std::string> ReadArtifactText(const Request& request) const;

  const CentroidLoaderOptions options_;
  const std::string allowed_dir_;
  Router* const router_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // a load is in progress on the thread
  std::optional<Request> waiting_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace eldr::server

#endif  // ELDR_SERVER_CENTROID_LOADER_H_
