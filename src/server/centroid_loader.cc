#include "server/centroid_loader.h"

#include <filesystem>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/core/errors.h"

namespace eldr::server {
namespace {

std::string DefaultAllowedDir(const CentroidLoaderOptions& options) {
  if (!options.allowed_dir.empty()) return options.allowed_dir;
  if (options.configured_path.empty()) return std::string();
  const std::filesystem::path parent = std::filesystem::path(options.configured_path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CentroidLoader>> CentroidLoader::Create(CentroidLoaderOptions options, Router* router) {
  std::string allowed = DefaultAllowedDir(options);
  if (!allowed.empty()) {
    // Resolve once, so later symlink swaps of the folder itself cannot widen what is readable.
    std::error_code error;
    const std::filesystem::path canonical = std::filesystem::canonical(allowed, error);
    if (error || !std::filesystem::is_directory(canonical, error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("setting 'centroids_dir': ", allowed, " is not a directory that can be resolved"));
    }
    allowed = canonical.string();
  }
  return std::unique_ptr<CentroidLoader>(new CentroidLoader(std::move(options), std::move(allowed), router));
}

CentroidLoader::CentroidLoader(CentroidLoaderOptions options, std::string allowed_dir, Router* router)
    : options_(std::move(options)), allowed_dir_(std::move(allowed_dir)), router_(router) {
  thread_ = std::thread([this] { Run(); });
}

CentroidLoader::~CentroidLoader() {
  Shutdown(absl::InfiniteFuture());
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<LoadedCentroids> CentroidLoader::LoadConfiguredNow(CentroidSource source) {
  Request request;
  request.kind = Kind::kConfigured;
  request.source = source;
  return Load(request);
}

void CentroidLoader::ReloadConfigured(CentroidSource source, LoadCallback done) {
  Request request;
  request.kind = Kind::kConfigured;
  request.source = source;
  if (done) request.done.push_back(std::move(done));
  Enqueue(std::move(request));
}

void CentroidLoader::ReloadPath(std::string path, LoadCallback done) {
  Request request;
  request.kind = path.empty() ? Kind::kConfigured : Kind::kPath;
  request.source = CentroidSource::kAdmin;
  request.text = std::move(path);
  request.done.push_back(std::move(done));
  Enqueue(std::move(request));
}

void CentroidLoader::ReloadInline(std::string artifact_json, LoadCallback done) {
  Request request;
  request.kind = Kind::kInline;
  request.source = CentroidSource::kAdmin;
  request.text = std::move(artifact_json);
  request.done.push_back(std::move(done));
  Enqueue(std::move(request));
}

void CentroidLoader::Enqueue(Request request) {
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      refused = absl::UnavailableError("the router is shutting down");
    } else if (!waiting_.has_value()) {
      waiting_ = std::move(request);
      return;
    } else if (waiting_->kind == Kind::kConfigured && request.kind == Kind::kConfigured) {
      // The waiting reload reads the same file after this request arrived: it answers both.
      for (LoadCallback& done : request.done) waiting_->done.push_back(std::move(done));
      return;
    } else {
      refused = absl::ResourceExhaustedError(
          "a centroid reload is running and another is waiting; retry once one has finished");
    }
  }
  for (const LoadCallback& done : request.done) {
    if (done) done(refused);
  }
}

void CentroidLoader::Run() {
  while (true) {
    Request request;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CentroidLoader* self)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->stopping_ || self->waiting_.has_value(); },
          this));
      if (stopping_) return;
      request = *std::move(waiting_);
      waiting_.reset();
      running_ = true;
    }
    const absl::StatusOr<LoadedCentroids> result = Load(request);
    for (const LoadCallback& done : request.done) {
      if (done) done(result);
    }
    absl::MutexLock lock(&mu_);
    running_ = false;
  }
}

bool CentroidLoader::Shutdown(absl::Time deadline) {
  std::optional<Request> dropped;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    dropped.swap(waiting_);
  }
  if (dropped.has_value()) {
    for (const LoadCallback& done : dropped->done) {
      if (done) done(absl::UnavailableError("the router is shutting down"));
    }
  }
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(
      absl::Condition(
          +[](CentroidLoader* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return !self->running_; }, this),
      deadline);
}

absl::StatusOr<std::string> CentroidLoader::ReadArtifactText(const Request& request) const {
  if (request.kind == Kind::kInline) {
    if (request.text.size() > options_.max_artifact_bytes) {
      return MakeInputError(absl::StatusCode::kInvalidArgument, RejectReason::kOversized,
                            absl::StrCat("the inline artifact is ", request.text.size(), " bytes; at most ",
                                         options_.max_artifact_bytes, " are accepted (--max_artifact_bytes)"));
    }
    return request.text;
  }
  std::string path;
  if (request.kind == Kind::kConfigured) {
    if (options_.configured_path.empty()) {
      return absl::FailedPreconditionError("no path given and no --centroids file configured");
    }
    path = options_.configured_path;
  } else {
    if (allowed_dir_.empty()) {
      return absl::FailedPreconditionError(
          "reloads from a path are disabled: the router has no --centroids_dir (or --centroids) to read from");
    }
    ELDR_ASSIGN_OR_RETURN(path, ResolvePathInside(allowed_dir_, request.text));
  }
  absl::StatusOr<std::string> text = ReadFile(path, options_.max_artifact_bytes);
  if (!text.ok() && absl::IsResourceExhausted(text.status())) {
    return MakeInputError(absl::StatusCode::kInvalidArgument, RejectReason::kOversized, text.status().message());
  }
  return text;
}

absl::StatusOr<LoadedCentroids> CentroidLoader::Load(const Request& request) {
  absl::StatusOr<std::string> text = ReadArtifactText(request);
  absl::StatusOr<CentroidArtifact> artifact =
      text.ok() ? ParseCentroidArtifact(*text) : absl::StatusOr<CentroidArtifact>(text.status());
  if (!artifact.ok()) {
    // Never reached the router: tell its observers, so this refusal is logged and counted like
    // every other.
    router_->NotifyCentroidsRejected(request.source, artifact.status());
    return artifact.status();
  }
  if (options_.fit_rows_to_pool) {
    std::vector<std::string> pool;
    for (const WorkerStatus& worker : router_->GetState(absl::Now()).workers) pool.push_back(worker.spec.id);
    *artifact = FitRowsToPool(*std::move(artifact), pool);
  }
  ELDR_ASSIGN_OR_RETURN(const uint64_t generation, router_->InstallCentroids(*artifact, request.source));
  return LoadedCentroids{generation, artifact->k};
}

CentroidArtifact FitRowsToPool(CentroidArtifact artifact, const std::vector<std::string>& pool) {
  if (pool.empty() || artifact.k <= 0) return artifact;
  const absl::flat_hash_set<std::string> in_pool(pool.begin(), pool.end());
  absl::flat_hash_set<std::string> owned;
  std::vector<std::string> owner(static_cast<size_t>(artifact.k));
  for (int row = 0; row < artifact.k; ++row) {
    if (row < static_cast<int>(artifact.workers.size()) && in_pool.contains(artifact.workers[row]) &&
        owned.insert(artifact.workers[row]).second) {
      owner[row] = artifact.workers[row];
    }
  }
  auto next_free = pool.begin();
  for (int row = 0; row < artifact.k; ++row) {
    if (!owner[row].empty()) continue;
    while (next_free != pool.end() && owned.contains(*next_free)) ++next_free;
    if (next_free == pool.end()) break;
    owner[row] = *next_free;
    owned.insert(*next_free);
  }
  const size_t dim = static_cast<size_t>(artifact.dim());
  CentroidArtifact fitted = artifact;
  fitted.workers.clear();
  fitted.centroids.clear();
  for (int row = 0; row < artifact.k; ++row) {
    if (owner[row].empty()) continue;
    fitted.workers.push_back(owner[row]);
    fitted.centroids.insert(fitted.centroids.end(), artifact.centroids.begin() + row * dim,
                            artifact.centroids.begin() + (row + 1) * dim);
  }
  if (fitted.workers.empty()) return artifact;
  fitted.k = static_cast<int>(fitted.workers.size());
  return fitted;
}

}  // namespace eldr::server
