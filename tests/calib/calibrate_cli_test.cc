// eldr-calibrate as a process: real traces in, artifact and report out; bad input leaves nothing.
#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_artifact.h"
#include "eldr/trace/trace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace eldr {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

struct Outcome {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

class CalibrateCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("cli_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static std::string Binary() {
    const char* bin = std::getenv("ELDR_BIN_DIR");
    return std::string(bin != nullptr ? bin : "bin") + "/eldr-calibrate";
  }
  static std::string TraceDir() {
    const char* data = std::getenv("ELDR_DATA_DIR");
    return std::string(data != nullptr ? data : "data") + "/esft-routing";
  }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }

  Outcome Run(const std::string& arguments) const {
    const std::string log = Path("log.txt");
    const std::string command = "timeout 100 " + Binary() + " " + arguments + " > " + log + " 2>&1";
    const int status = std::system(command.c_str());
    Outcome outcome;
    outcome.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    outcome.output = text.str();
    return outcome;
  }

  // A capture file of the first `n` trace requests.
  std::string TraceCaptures(int n) const {
    absl::StatusOr<ExpertTrace> trace = LoadExpertTrace(TraceDir(), 64);
    EXPECT_TRUE(trace.ok()) << trace.status();
    std::vector<int> sequences;
    for (int i = 0; i < n; ++i) sequences.push_back(i * static_cast<int>(trace->sequences.size()) / n);
    absl::StatusOr<CalibrationData> data = CalibrationDataFromTrace(*trace, 0.5, sequences);
    EXPECT_TRUE(data.ok()) << data.status();
    const std::string path = Path("requests.cap");
    EXPECT_TRUE(WriteCaptureFile(path, *data).ok());
    return path;
  }

  std::filesystem::path dir_;
};

TEST_F(CalibrateCliTest, CalibratesTheRealTraces) {
  const Outcome outcome = Run("--trace " + TraceDir() +
                              " --prefill_fraction 0.5 --clusters 4 --seed 1 "
                              "--holdout_fraction 0.2 --workers a,b,c,d --capacities 1,1,2,2 --out " +
                              Path("centroids.json") + " --report " + Path("report.json"));
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  EXPECT_THAT(outcome.output, AllOf(HasSubstr("loaded 213 requests"), HasSubstr("purity")));
  absl::StatusOr<CentroidArtifact> artifact = LoadCentroidArtifact(Path("centroids.json"));
  ASSERT_TRUE(artifact.ok()) << artifact.status();
  EXPECT_EQ(artifact->k, 4);
  EXPECT_EQ(artifact->workers, (std::vector<std::string>{"a", "b", "c", "d"}));
  EXPECT_FALSE(artifact->spec.layer_mask.empty());
  std::ifstream in(Path("report.json"));
  const nlohmann::json report = nlohmann::json::parse(in);
  EXPECT_EQ(report["clusters"], 4);
  EXPECT_EQ(report["requests"], 213 - 43);
  // Balanced by decode tokens (the default): 170 requests of 8 units on average are 1,360 units;
  // capacities 1:1:2:2 of them: ceil(1360/6), ceil(1360/6), ceil(2720/6), ceil(2720/6).
  EXPECT_EQ(report["weighting"], "decode_tokens");
  EXPECT_EQ(report["cluster_capacities"], nlohmann::json({227, 227, 454, 454}));
  EXPECT_EQ(report["cluster_weights"].size(), 4u);
  EXPECT_EQ(report["mask"]["rule"], "global_maximum");
  EXPECT_EQ(report["mask"]["steps"].size(), 26u);
  EXPECT_THAT(outcome.output, HasSubstr("layer curve"));
  EXPECT_FALSE(report["mask"]["steps"].empty());
  EXPECT_GT(report["evaluation"]["holdout_requests"].get<int>(), 0);
  for (const char* phase : {"idf", "mask", "kmeans", "total"}) EXPECT_TRUE(report["seconds"].contains(phase));
}

TEST_F(CalibrateCliTest, CalibratesCaptureFilesIncludingPlainFrames) {
  const std::string captures = TraceCaptures(40);
  Outcome outcome = Run("--captures " + captures + " --clusters 4 --out " + Path("a.json"));
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  EXPECT_TRUE(LoadCentroidArtifact(Path("a.json")).ok());

  // The reference engine's plain frames: prefill counts only, geometry from the flags.
  absl::StatusOr<CalibrationData> data = ReadCaptureFiles({captures}, 0, 0);
  ASSERT_TRUE(data.ok());
  CaptureWriteOptions reference;
  reference.reference_framing = true;
  ASSERT_TRUE(WriteCaptureFile(Path("plain.bin"), *data, reference).ok());
  outcome = Run("--captures " + Path("plain.bin") + " --layers 26 --experts 64 --clusters 4 --out " + Path("b.json"));
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  absl::StatusOr<CentroidArtifact> plain = LoadCentroidArtifact(Path("b.json"));
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->spec.layer_mask.empty() || plain->spec.layer_mask.size() == 26u);  // no decode counts
}

TEST_F(CalibrateCliTest, TruncatedCaptureFailsAndWritesNothing) {
  const std::string captures = TraceCaptures(40);
  std::string bytes;
  {
    std::ifstream in(captures, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    bytes = s.str();
  }
  std::ofstream(Path("cut.cap"), std::ios::binary) << bytes.substr(0, bytes.size() - 100);
  const Outcome outcome =
      Run("--captures " + Path("cut.cap") + " --clusters 4 --out " + Path("c.json") + " --report " + Path("r.json"));
  EXPECT_EQ(outcome.exit_code, 1);
  EXPECT_THAT(outcome.output, AllOf(HasSubstr("cut.cap"), HasSubstr("record 39"), HasSubstr("truncated")));
  EXPECT_FALSE(std::filesystem::exists(Path("c.json")));
  EXPECT_FALSE(std::filesystem::exists(Path("r.json")));
}

TEST_F(CalibrateCliTest, WrongGeometryTooFewRequestsAndUsageErrors) {
  const std::string captures = TraceCaptures(10);
  Outcome outcome = Run("--captures " + captures + " --layers 48 --experts 128 --clusters 4 --out " + Path("d.json"));
  EXPECT_EQ(outcome.exit_code, 1);
  EXPECT_THAT(outcome.output, HasSubstr("geometry L=26 E=64 does not match the expected L=48 E=128"));
  outcome = Run("--captures " + captures + " --clusters 16 --out " + Path("d.json"));
  EXPECT_EQ(outcome.exit_code, 1);
  EXPECT_THAT(outcome.output, HasSubstr("too few requests: 10 for 16 clusters"));
  EXPECT_FALSE(std::filesystem::exists(Path("d.json")));

  outcome = Run("--clusters 4 --out " + Path("d.json"));
  EXPECT_EQ(outcome.exit_code, 2);
  EXPECT_THAT(outcome.output, HasSubstr("--trace DIR or --captures"));
  outcome = Run("--captures " + captures + " --clusters 4 --capacities 1,2 --out " + Path("d.json"));
  EXPECT_EQ(outcome.exit_code, 2);
  EXPECT_THAT(outcome.output, HasSubstr("--capacities has 2 weights for --clusters=4"));
  outcome = Run("--captures " + captures + " --clusters 4 --capacities 1,x,1,1 --out " + Path("d.json"));
  EXPECT_EQ(outcome.exit_code, 2);
  outcome = Run("--captures " + captures + " --clusters 4 --variant bogus --out " + Path("d.json"));
  EXPECT_EQ(outcome.exit_code, 2);
  outcome = Run("--trace " + Path("nowhere") + " --clusters 4 --out " + Path("d.json"));
  EXPECT_EQ(outcome.exit_code, 1);
  EXPECT_THAT(outcome.output, HasSubstr("nowhere"));
  EXPECT_FALSE(std::filesystem::exists(Path("d.json")));
}

TEST_F(CalibrateCliTest, UnbalancedCountWeightedAndFirstDecreaseRuns) {
  const Outcome outcome = Run("--trace " + TraceDir() +
                              " --clusters 4 --seed 1 --balanced=false --weight_by_decode_tokens=false "
                              "--mask_rule first_decrease --out " +
                              Path("u.json") + " --report " + Path("u-report.json"));
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  std::ifstream in(Path("u-report.json"));
  const nlohmann::json report = nlohmann::json::parse(in);
  EXPECT_EQ(report["balanced"], false);
  EXPECT_EQ(report["weighting"], "none");
  EXPECT_FALSE(report.contains("cluster_weights"));
  // No capacities: every cluster may take all 213 requests, and each request is at its nearest.
  EXPECT_EQ(report["cluster_capacities"], nlohmann::json({213, 213, 213, 213}));
  EXPECT_EQ(report["evaluation"]["calibration_nearest_agreement"], 1.0);
  EXPECT_EQ(report["mask"]["rule"], "first_decrease");
  // first_decrease walks up to the peak and one step past it at most.
  EXPECT_LE(report["mask"]["steps"].size(), report["layer_mask"].size());

  Outcome bad = Run("--trace " + TraceDir() + " --clusters 4 --mask_rule peak --out " + Path("v.json"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.output, HasSubstr("unknown layer-mask rule 'peak'"));
  bad = Run("--trace " + TraceDir() + " --clusters 4 --weight_resolution 0 --out " + Path("v.json"));
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.output, HasSubstr("--weight_resolution must be >= 1"));
}

TEST_F(CalibrateCliTest, NonFiniteGateSumsAreRejected) {
  CalibrationData data;
  data.layers = 2;
  data.experts = 4;
  data.n = 6;
  data.prefill_counts.assign(6 * 8, 1);
  data.gate_prob_sums.assign(6 * 8, 0.25f);
  absl::StatusOr<std::string> bytes = SerializeCaptureFile(data);
  ASSERT_TRUE(bytes.ok());
  // Record 4's last gate sum becomes +inf: record = 4 + 16 + 32 bytes after the 24-byte header.
  const float inf = std::numeric_limits<float>::infinity();
  std::string patched = *bytes;
  std::memcpy(&patched[24 + 4 * 52 + 4 + 16 + 28], &inf, 4);
  std::ofstream(Path("inf.cap"), std::ios::binary) << patched;
  const Outcome outcome =
      Run("--captures " + Path("inf.cap") + " --variant gate_prob --clusters 2 --out " + Path("e.json"));
  EXPECT_EQ(outcome.exit_code, 1);
  EXPECT_THAT(outcome.output, AllOf(HasSubstr("record 4"), HasSubstr("layer 1, expert 3 is not finite")));
  EXPECT_FALSE(std::filesystem::exists(Path("e.json")));
}

}  // namespace
}  // namespace eldr
