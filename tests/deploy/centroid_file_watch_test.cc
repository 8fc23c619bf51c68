// CentroidFileWatch against the ways a centroid file changes in practice: the kubelet's atomic
// ConfigMap update (a `..data` symlink swapped to a new folder), an in-place rewrite, an editor's
// unlink + rename, and a file that disappears for a while.
#include "server/centroid_file_watch.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace eldr::server {
namespace {

namespace fs = std::filesystem;

class CentroidFileWatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "eldr-watch-XXXXXX").string();
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  static void Write(const fs::path& path, const std::string& contents) {
    std::ofstream out(path, std::ios::trunc);
    out << contents;
  }

  // The kubelet's layout: <dir>/..<stamp>/centroids.json, ..data -> ..<stamp>, and
  // centroids.json -> ..data/centroids.json. Each call publishes a new generation atomically.
  fs::path PublishConfigMap(const std::string& contents) {
    const fs::path generation = dir_ / ("..gen" + std::to_string(++generations_));
    fs::create_directory(generation);
    Write(generation / "centroids.json", contents);
    const fs::path tmp = dir_ / "..data_tmp";
    fs::create_symlink(generation.filename(), tmp);
    fs::rename(tmp, dir_ / "..data");
    const fs::path file = dir_ / "centroids.json";
    if (!fs::is_symlink(file)) fs::create_symlink(fs::path("..data") / "centroids.json", file);
    if (generations_ > 1) fs::remove_all(dir_ / ("..gen" + std::to_string(generations_ - 1)));
    return file;
  }

  fs::path dir_;
  int generations_ = 0;
};

TEST_F(CentroidFileWatchTest, UnchangedFileIsNeverReloaded) {
  const fs::path file = PublishConfigMap("{\"k\": 1}");
  int reloads = 0;
  CentroidFileWatch watch(file.string(), absl::Seconds(1), [&] { ++reloads; });
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(watch.PollOnce());
  EXPECT_EQ(reloads, 0);
}

TEST_F(CentroidFileWatchTest, ConfigMapSwapIsReloadedOnceItIsStable) {
  const fs::path file = PublishConfigMap("{\"k\": 1}");
  int reloads = 0;
  CentroidFileWatch watch(file.string(), absl::Seconds(1), [&] { ++reloads; });
  PublishConfigMap("{\"k\": 2}");
  EXPECT_FALSE(watch.PollOnce()) << "first sight of a new version waits for one more poll";
  EXPECT_TRUE(watch.PollOnce());
  EXPECT_EQ(reloads, 1);
  EXPECT_FALSE(watch.PollOnce());
  EXPECT_EQ(reloads, 1) << "a version is reloaded once";
}

TEST_F(CentroidFileWatchTest, FileStillBeingWrittenWaitsUntilItSettles) {
  const fs::path file = dir_ / "centroids.json";
  Write(file, "{\"k\": 1}");
  int reloads = 0;
  CentroidFileWatch watch(file.string(), absl::Seconds(1), [&] { ++reloads; });
  Write(file, "{\"k\": 2, \"centroids\": [");  // a writer half-way through
  EXPECT_FALSE(watch.PollOnce());
  Write(file, "{\"k\": 2, \"centroids\": [[1.0]]}");  // the writer finished
  EXPECT_FALSE(watch.PollOnce()) << "changed again since the last poll: not stable yet";
  EXPECT_TRUE(watch.PollOnce());
  EXPECT_EQ(reloads, 1);
}

TEST_F(CentroidFileWatchTest, EditorReplaceIsReloaded) {
  const fs::path file = dir_ / "centroids.json";
  Write(file, "{\"k\": 1}");
  int reloads = 0;
  CentroidFileWatch watch(file.string(), absl::Seconds(1), [&] { ++reloads; });
  const fs::path tmp = dir_ / ".centroids.json.swp";
  Write(tmp, "{\"k\": 1}");  // same size and contents, new inode
  fs::rename(tmp, file);
  watch.PollOnce();
  EXPECT_TRUE(watch.PollOnce());
  EXPECT_EQ(reloads, 1);
}

TEST_F(CentroidFileWatchTest, MissingFileIsWaitedOutAndItsReturnReloaded) {
  const fs::path file = dir_ / "centroids.json";
  Write(file, "{\"k\": 1}");
  int reloads = 0;
  CentroidFileWatch watch(file.string(), absl::Seconds(1), [&] { ++reloads; });
  fs::remove(file);
  EXPECT_FALSE(watch.PollOnce());
  EXPECT_FALSE(watch.PollOnce());
  Write(file, "{\"k\": 3}");
  watch.PollOnce();
  EXPECT_TRUE(watch.PollOnce());
  EXPECT_EQ(reloads, 1);
}

TEST_F(CentroidFileWatchTest, ThreadReloadsAChangeAndStopsPromptly) {
  const fs::path file = PublishConfigMap("{\"k\": 1}");
  std::atomic<int> reloads{0};
  absl::Notification reloaded;
  CentroidFileWatch watch(file.string(), absl::Milliseconds(20), [&] {
    if (++reloads == 1) reloaded.Notify();
  });
  ASSERT_TRUE(watch.Start().ok());
  PublishConfigMap("{\"k\": 2}");
  EXPECT_TRUE(reloaded.WaitForNotificationWithTimeout(absl::Seconds(5)));
  const absl::Time before = absl::Now();
  watch.Stop();
  EXPECT_LT(absl::Now() - before, absl::Seconds(1));
  EXPECT_EQ(reloads.load(), 1);
}

TEST_F(CentroidFileWatchTest, RejectsANonPositiveInterval) {
  CentroidFileWatch watch((dir_ / "x").string(), absl::ZeroDuration(), [] {});
  EXPECT_EQ(watch.Start().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace eldr::server
