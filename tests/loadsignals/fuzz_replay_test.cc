// Replays every fuzz target's seed corpus (fuzz/corpus/<name>/) and its kept crashing inputs
// (fuzz/regressions/<name>/) through the same bodies libFuzzer runs, in every ordinary build:
// a fixed crash stays fixed without a fuzzing build. A broken invariant aborts the test.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz/fuzz_targets.h"
#include "gtest/gtest.h"

namespace eldr::fuzz {
namespace {

namespace fs = std::filesystem;

std::string SourceDir() {
  const char* dir = std::getenv("ELDR_SOURCE_DIR");
  return dir != nullptr ? dir : ".";
}

std::vector<fs::path> FilesIn(const fs::path& dir) {
  std::vector<fs::path> files;
  std::error_code error;
  if (!fs::is_directory(dir, error)) return files;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && entry.path().filename().string()[0] != '.') files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

}  // namespace

// Test names show the target's name, not the struct's bytes.
void PrintTo(const FuzzTarget& target, std::ostream* out) { *out << target.name; }

namespace {

class FuzzReplayTest : public ::testing::TestWithParam<FuzzTarget> {};

TEST_P(FuzzReplayTest, SeedsAndRegressionsRunClean) {
  const FuzzTarget& target = GetParam();
  const fs::path root = fs::path(SourceDir()) / "fuzz";
  const std::vector<fs::path> seeds = FilesIn(root / "corpus" / target.name);
  ASSERT_GE(seeds.size(), 3u) << "fuzz/corpus/" << target.name << " needs seed inputs";
  std::vector<fs::path> inputs = seeds;
  for (const fs::path& regression : FilesIn(root / "regressions" / target.name)) inputs.push_back(regression);
  for (const fs::path& input : inputs) {
    SCOPED_TRACE(input.string());
    const std::string bytes = ReadAll(input);
    EXPECT_EQ(target.body(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0);
  }
  // The empty input and every prefix of the first seed, as the fuzzer would try them first.
  EXPECT_EQ(target.body(nullptr, 0), 0);
  const std::string first = ReadAll(seeds.front());
  for (size_t length = 0; length <= first.size(); ++length) {
    ASSERT_EQ(target.body(reinterpret_cast<const uint8_t*>(first.data()), length), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(AllTargets, FuzzReplayTest, ::testing::ValuesIn(AllFuzzTargets()),
                         [](const ::testing::TestParamInfo<FuzzTarget>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace eldr::fuzz
