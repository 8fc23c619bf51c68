#include "eldr/common/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <string>
#include <thread>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/process.h"

namespace eldr {
namespace {

using ::eldr::testing::TempDir;
using ::testing::HasSubstr;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST(ReadFileTest, ReadsARegularFileWhole) {
  TempDir dir;
  const std::string big(3 << 20, 'z');  // several reads
  ASSERT_TRUE(WriteFileAtomically(dir.File("big"), big).ok());
  absl::StatusOr<std::string> read = ReadFile(dir.File("big"));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, big);
  ASSERT_TRUE(WriteFileAtomically(dir.File("empty"), "").ok());
  EXPECT_EQ(*ReadFile(dir.File("empty")), "");
}

TEST(ReadFileTest, AMissingFileIsNotFoundNamingThePath) {
  const absl::Status status = ReadFile("/nonexistent/eldr/centroids.json").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(status), HasSubstr("cannot read '/nonexistent/eldr/centroids.json'"));
  EXPECT_THAT(Message(status), HasSubstr("No such file or directory"));
}

TEST(ReadFileTest, RefusesWhatIsNotARegularFileWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir.File("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // A FIFO without a writer would block a plain open(); ReadFile must answer at once.
  const absl::Status fifo_status = ReadFile(fifo).status();
  EXPECT_EQ(fifo_status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(fifo_status), HasSubstr("'" + fifo + "' is a FIFO, not a regular file"));

  const absl::Status folder = ReadFile(dir.path()).status();
  EXPECT_EQ(folder.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(folder), HasSubstr("is a directory, not a regular file"));

  // /dev/zero never ends: refused from its type, before a byte is read.
  const absl::Status device = ReadFile("/dev/zero").status();
  EXPECT_EQ(device.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(device), HasSubstr("'/dev/zero' is a character device, not a regular file"));
}

TEST(ReadFileTest, AFileOverTheLimitIsRefusedFromItsSize) {
  TempDir dir;
  ASSERT_TRUE(WriteFileAtomically(dir.File("ten"), "0123456789").ok());
  EXPECT_EQ(*ReadFile(dir.File("ten"), 10), "0123456789");  // the limit itself is allowed
  const absl::Status status = ReadFile(dir.File("ten"), 9).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Message(status), HasSubstr("is 10 bytes, over the limit of 9 bytes"));
}

TEST(ReadFileTest, SymlinksAreFollowed) {
  TempDir dir;
  ASSERT_TRUE(WriteFileAtomically(dir.File("target"), "payload").ok());
  ASSERT_EQ(::symlink(dir.File("target").c_str(), dir.File("link").c_str()), 0);
  EXPECT_EQ(*ReadFile(dir.File("link")), "payload");
}

TEST(WriteFileAtomicallyTest, ReplacesContentsAndSetsTheMode) {
  TempDir dir;
  const std::string path = dir.File("state.txt");
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  EXPECT_EQ(*ReadFile(path), "first");
  ASSERT_TRUE(WriteFileAtomically(path, "second", 0600).ok());
  EXPECT_EQ(*ReadFile(path), "second");
  struct stat info {};
  ASSERT_EQ(::stat(path.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0077, 0u);
  ASSERT_TRUE(WriteFileAtomically(path, "").ok());
  EXPECT_EQ(*ReadFile(path), "");
}

TEST(WriteFileAtomicallyTest, FailsCleanlyInAMissingFolder) {
  const absl::Status status = WriteFileAtomically("/nonexistent/eldr/out.json", "x");
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(Message(status), HasSubstr("/nonexistent/eldr/out.json"));
  EXPECT_FALSE(WriteFileAtomically("", "x").ok());
}

TEST(WriteAllTest, WritesEverythingThroughAPipe) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ScopedFd read_end(fds[0]);
  const std::string bytes(1 << 20, 'q');  // far more than a pipe buffer: many short writes
  std::string received;
  std::thread reader([&] {
    char buffer[4096];
    ssize_t got;
    while ((got = ::read(read_end.get(), buffer, sizeof(buffer))) > 0) received.append(buffer, got);
  });
  {
    ScopedFd write_end(fds[1]);
    EXPECT_TRUE(WriteAll(write_end.get(), bytes).ok());
  }  // closed: the reader sees the end
  reader.join();
  EXPECT_EQ(received, bytes);
}

TEST(WriteAllTest, AnErrorCarriesTheErrno) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ScopedFd write_end(fds[1]);
  ::close(fds[0]);
  ::signal(SIGPIPE, SIG_IGN);
  const absl::Status status = WriteAll(write_end.get(), "x");
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(Message(status), HasSubstr("write"));
  EXPECT_THAT(Message(status), HasSubstr("Broken pipe"));
}

TEST(ScopedFdTest, ClosesOnceAndMovesOwnership) {
  TempDir dir;
  ASSERT_TRUE(WriteFileAtomically(dir.File("f"), "x").ok());
  int raw = -1;
  {
    ScopedFd first(::open(dir.File("f").c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(first.valid());
    raw = first.get();
    ScopedFd second(std::move(first));
    EXPECT_FALSE(first.valid());  // NOLINT(bugprone-use-after-move): the moved-from state is the contract
    EXPECT_EQ(second.get(), raw);
    EXPECT_EQ(::fcntl(raw, F_GETFD), FD_CLOEXEC);  // still open
  }
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);  // closed by the destructor
  EXPECT_EQ(errno, EBADF);
  ScopedFd released(::open(dir.File("f").c_str(), O_RDONLY | O_CLOEXEC));
  const int kept = released.release();
  EXPECT_FALSE(released.valid());
  EXPECT_NE(::fcntl(kept, F_GETFD), -1);
  ::close(kept);
}

TEST(ResolvePathInsideTest, AcceptsWhatResolvesInsideTheFolder) {
  TempDir dir;
  ASSERT_EQ(::mkdir(dir.File("sub").c_str(), 0700), 0);
  ASSERT_TRUE(WriteFileAtomically(dir.File("sub/a.json"), "{}").ok());
  absl::StatusOr<std::string> relative = ResolvePathInside(dir.path(), "sub/a.json");
  ASSERT_TRUE(relative.ok()) << relative.status();
  EXPECT_THAT(*relative, HasSubstr("/sub/a.json"));
  absl::StatusOr<std::string> absolute = ResolvePathInside(dir.path(), dir.File("sub/../sub/a.json"));
  ASSERT_TRUE(absolute.ok()) << absolute.status();
  EXPECT_EQ(*absolute, *relative);
  // A symlink inside that points inside is fine.
  ASSERT_EQ(::symlink("sub/a.json", dir.File("inner-link").c_str()), 0);
  EXPECT_EQ(*ResolvePathInside(dir.path(), "inner-link"), *relative);
}

TEST(ResolvePathInsideTest, EverythingElseGetsOneAnswer) {
  TempDir dir;
  TempDir outside;
  ASSERT_TRUE(WriteFileAtomically(outside.File("secret"), "x").ok());
  ASSERT_EQ(::symlink(outside.File("secret").c_str(), dir.File("escape").c_str()), 0);
  ASSERT_EQ(::symlink("loop", dir.File("loop").c_str()), 0);
  const std::string paths[] = {
      "../" + outside.path().substr(outside.path().rfind('/') + 1) + "/secret",  // .. out of the folder
      outside.File("secret"),                                                    // absolute, outside
      "escape",                                                                  // symlink out
      "missing.json",                                                            // does not exist
      "loop",                                                                    // symlink loop
      "",                                                                        // nothing
      ".",                                                                       // the folder itself
      std::string("a\0b", 3),                                                    // NUL inside
  };
  std::string first_message;
  for (const std::string& path : paths) {
    const absl::Status status = ResolvePathInside(dir.path(), path).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied) << path;
    if (first_message.empty()) first_message = Message(status);
    EXPECT_EQ(Message(status), first_message) << "the answer must not tell the causes apart: " << path;
  }
}

TEST(ResolvePathInsideTest, TheFolderMustExist) {
  EXPECT_EQ(ResolvePathInside("", "a").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolvePathInside("/nonexistent/eldr", "a").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace eldr
