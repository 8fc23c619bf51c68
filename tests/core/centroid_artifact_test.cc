#include "eldr/core/centroid_artifact.h"
#include "eldr/common/file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "eldr/core/errors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "testing/process.h"

namespace eldr {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

std::vector<float> UnitRows(int k, int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(0.f, 1.f);
  std::vector<float> rows(static_cast<size_t>(k) * dim);
  for (int r = 0; r < k; ++r) {
    double norm = 0;
    for (int i = 0; i < dim; ++i) {
      rows[r * dim + i] = dist(rng);
      norm += rows[r * dim + i] * rows[r * dim + i];
    }
    for (int i = 0; i < dim; ++i) rows[r * dim + i] /= static_cast<float>(std::sqrt(norm));
  }
  return rows;
}

CentroidArtifact MakeArtifact() {
  CentroidArtifact artifact;
  artifact.spec.layers = 5;
  artifact.spec.experts = 6;
  artifact.spec.variant = SignatureVariant::kCountIdf;
  artifact.spec.layer_mask = {0, 2, 3};
  for (int i = 0; i < artifact.spec.dim(); ++i) artifact.spec.idf.push_back(0.25f + 0.1f * i);
  artifact.k = 3;
  artifact.centroids = UnitRows(3, artifact.dim(), 1);
  artifact.workers = {"decode-a", "decode-b", "decode-c"};
  artifact.model = "DeepSeek-V2-Lite";
  artifact.seed = 1234567890123ULL;
  return artifact;
}

void ExpectSame(const CentroidArtifact& a, const CentroidArtifact& b) {
  EXPECT_EQ(a.spec.layers, b.spec.layers);
  EXPECT_EQ(a.spec.experts, b.spec.experts);
  EXPECT_EQ(a.spec.variant, b.spec.variant);
  EXPECT_EQ(a.spec.EffectiveMask(), b.spec.EffectiveMask());
  EXPECT_EQ(a.spec.idf, b.spec.idf);  // bit-exact: floats are written as shortest round-trip text
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.centroids, b.centroids);
  EXPECT_EQ(a.workers, b.workers);
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.seed, b.seed);
}

using ::eldr::testing::TempDir;

absl::Status ParseStatus(const Json& doc) { return ParseCentroidArtifact(doc.dump()).status(); }

// ---- Round trips --------------------------------------------------------------------------------

TEST(CentroidArtifactTest, SerializeParseRoundTripIsExact) {
  const CentroidArtifact artifact = MakeArtifact();
  ASSERT_TRUE(ValidateCentroidArtifact(artifact).ok());
  const std::string text = SerializeCentroidArtifact(artifact);
  absl::StatusOr<CentroidArtifact> parsed = ParseCentroidArtifact(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSame(artifact, *parsed);
  // The file is the reference format: these keys are what the reference loader reads.
  const Json doc = Json::parse(text);
  EXPECT_EQ(doc["L"], 5);
  EXPECT_EQ(doc["e"], 6);
  EXPECT_EQ(doc["k"], 3);
  EXPECT_EQ(doc["variant"], "count_idf");
  EXPECT_EQ(doc["layer_mask"], Json({0, 2, 3}));
  EXPECT_EQ(doc["sig_idf"].size(), 18u);
  EXPECT_EQ(doc["sig_dtype"], "<i2");
  EXPECT_EQ(doc["centroids"].size(), 3u);
  EXPECT_EQ(doc["seed"], 1234567890123ULL);
}

TEST(CentroidArtifactTest, GateProbWritesReferenceVariantNameAndNoIdf) {
  CentroidArtifact artifact = MakeArtifact();
  artifact.spec.variant = SignatureVariant::kGateProb;
  artifact.spec.idf.clear();
  artifact.workers.clear();
  const std::string text = SerializeCentroidArtifact(artifact);
  const Json doc = Json::parse(text);
  EXPECT_EQ(doc["variant"], "gate_prob_all");
  EXPECT_EQ(doc["sig_dtype"], "<f4");
  EXPECT_FALSE(doc.contains("sig_idf"));
  EXPECT_FALSE(doc.contains("workers"));
  absl::StatusOr<CentroidArtifact> parsed = ParseCentroidArtifact(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ExpectSame(artifact, *parsed);
}

TEST(CentroidArtifactTest, SaveAndLoadThroughFile) {
  TempDir dir;
  const std::string path = dir.File("centroids.json");
  const CentroidArtifact artifact = MakeArtifact();
  ASSERT_TRUE(SaveCentroidArtifact(artifact, path).ok());
  absl::StatusOr<CentroidArtifact> loaded = LoadCentroidArtifact(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSame(artifact, *loaded);
  // Overwrite in place; no temporary files are left behind.
  CentroidArtifact second = artifact;
  second.model = "second";
  ASSERT_TRUE(SaveCentroidArtifact(second, path).ok());
  EXPECT_EQ(LoadCentroidArtifact(path)->model, "second");
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(CentroidArtifactTest, SaveRefusesAnInvalidArtifactAndKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir.File("centroids.json");
  ASSERT_TRUE(SaveCentroidArtifact(MakeArtifact(), path).ok());
  CentroidArtifact bad = MakeArtifact();
  bad.centroids[0] = 5.f;
  EXPECT_EQ(SaveCentroidArtifact(bad, path).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(LoadCentroidArtifact(path).ok());
}

// A file as the reference implementation writes it (json.dump(indent=2) of its fit result), with
// the keys we do not use: algo, m, n_fit, sig_dtype, layer_select, hashes, fit_peak_rho.
TEST(CentroidArtifactTest, ReferenceFormatFileLoads) {
  const std::vector<float> rows = UnitRows(2, 2 * 3, 9);
  Json doc = {
      {"model", "Qwen3-30B-A3B"},
      {"algo", "kmbal"},
      {"k", 2},
      {"m", 2},
      {"L", 4},
      {"e", 3},
      {"n_fit", 512},
      {"variant", "count_idf"},
      {"layer_select", "forward_greedy"},
      {"layer_mask", {1, 3}},
      {"fit_peak_rho", 0.79},
      {"seed", 0},
      {"sig_dtype", "<i2"},
      {"sig_idf", {0.1, 0.2, 0.3, 1.5, 2.5, 0.0}},
      {"centroids",
       {std::vector<float>(rows.begin(), rows.begin() + 6), std::vector<float>(rows.begin() + 6, rows.end())}},
      {"training_sha256", std::string(64, 'a')},
      {"calibration_format", "eldr-calibration-v1"},
  };
  absl::StatusOr<CentroidArtifact> parsed = ParseCentroidArtifact(doc.dump(2));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.layers, 4);
  EXPECT_EQ(parsed->spec.experts, 3);
  EXPECT_EQ(parsed->spec.layer_mask, (std::vector<int>{1, 3}));
  EXPECT_EQ(parsed->spec.variant, SignatureVariant::kCountIdf);
  EXPECT_FLOAT_EQ(parsed->spec.idf[3], 1.5f);
  EXPECT_EQ(parsed->k, 2);
  EXPECT_EQ(parsed->dim(), 6);
  EXPECT_EQ(parsed->model, "Qwen3-30B-A3B");
  EXPECT_TRUE(parsed->workers.empty());
}

TEST(CentroidArtifactTest, ReferenceDefaultsForOptionalKeys) {
  // The reference's fit_centroids output for the count variant: explicit all-layer mask, no IDF;
  // a missing variant means count, a missing k means the row count, a missing mask every layer.
  const std::vector<float> rows = UnitRows(1, 2 * 2, 3);
  Json doc = {{"L", 2}, {"e", 2}, {"centroids", {rows}}, {"sig_idf", nullptr}};
  absl::StatusOr<CentroidArtifact> parsed = ParseCentroidArtifact(doc.dump());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.variant, SignatureVariant::kCount);
  EXPECT_EQ(parsed->k, 1);
  EXPECT_TRUE(parsed->spec.layer_mask.empty());
  EXPECT_EQ(parsed->dim(), 4);
  EXPECT_EQ(parsed->seed, 0u);
  doc["layer_mask"] = {0, 1};  // explicit identity mask = every layer
  parsed = ParseCentroidArtifact(doc.dump());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->spec.layer_mask.empty());
  doc["variant"] = "gate_prob_all";
  parsed = ParseCentroidArtifact(doc.dump());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->spec.variant, SignatureVariant::kGateProb);
}

// ---- Each validation failure ---------------------------------------------------------------------

class ArtifactValidationTest : public ::testing::Test {
 protected:
  ArtifactValidationTest() : doc_(Json::parse(SerializeCentroidArtifact(MakeArtifact()))) {}

  void ExpectFails(const Json& doc, RejectReason reason, const std::string& text) {
    const absl::Status status = ParseStatus(doc);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_EQ(RejectReasonOf(status), reason) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(text));
  }

  Json doc_;
};

TEST_F(ArtifactValidationTest, BaselineIsValid) { EXPECT_TRUE(ParseStatus(doc_).ok()); }

TEST_F(ArtifactValidationTest, Syntax) {
  const absl::Status status = ParseCentroidArtifact("{\"L\": 4,").status();
  EXPECT_EQ(RejectReasonOf(status), RejectReason::kMalformed);
  EXPECT_THAT(std::string(status.message()), HasSubstr("invalid JSON"));
  EXPECT_THAT(std::string(ParseCentroidArtifact("[1, 2]").status().message()),
              HasSubstr("top level must be a JSON object"));
}

TEST_F(ArtifactValidationTest, MissingAndMistypedKeys) {
  for (const char* key : {"L", "e", "centroids"}) {
    Json doc = doc_;
    doc.erase(key);
    ExpectFails(doc, RejectReason::kMalformed, absl::StrCat("missing required key `", key, "`"));
  }
  Json doc = doc_;
  doc["L"] = 5.0;
  ExpectFails(doc, RejectReason::kMalformed, "`L` must be an integer");
  doc = doc_;
  doc["e"] = "6";
  ExpectFails(doc, RejectReason::kMalformed, "`e` must be an integer");
  doc = doc_;
  doc["k"] = true;
  ExpectFails(doc, RejectReason::kMalformed, "`k` must be an integer");
  doc = doc_;
  doc["variant"] = "tfidf";
  ExpectFails(doc, RejectReason::kMalformed, "unknown signature variant 'tfidf'");
  doc = doc_;
  doc["variant"] = 3;
  ExpectFails(doc, RejectReason::kMalformed, "`variant` must be a string");
  doc = doc_;
  doc["layer_mask"] = {0, "2", 3};
  ExpectFails(doc, RejectReason::kMalformed, "`layer_mask`[1] must be an integer");
  doc = doc_;
  doc["centroids"][1][2] = "x";
  ExpectFails(doc, RejectReason::kMalformed, "`centroids[1]`[2] must be a number");
  doc = doc_;
  doc["centroids"] = {1, 2};
  ExpectFails(doc, RejectReason::kMalformed, "`centroids`[0] must be a list");
  doc = doc_;
  doc["workers"] = {"a", 2, "c"};
  ExpectFails(doc, RejectReason::kMalformed, "`workers`[1] must be a string");
  doc = doc_;
  doc["model"] = 7;
  ExpectFails(doc, RejectReason::kMalformed, "`model` must be a string");
  doc = doc_;
  doc["seed"] = -1;
  ExpectFails(doc, RejectReason::kMalformed, "`seed` must be a non-negative integer");
}

TEST_F(ArtifactValidationTest, GeometryChecks) {
  Json doc = doc_;
  doc["L"] = 0;
  ExpectFails(doc, RejectReason::kGeometry, "`L` must be >= 1");
  doc = doc_;
  doc["e"] = -6;
  ExpectFails(doc, RejectReason::kGeometry, "`e` must be >= 1");
  doc = doc_;
  doc["k"] = 4;
  ExpectFails(doc, RejectReason::kGeometry, "k = 4 but `centroids` has 3 rows");
  doc = doc_;
  doc["centroids"][2].erase(0);
  ExpectFails(doc, RejectReason::kGeometry,
              "centroids row 2 has 17 values, expected dimension |layer_mask| * e = 3 * 6 = 18");
  doc = doc_;
  doc["centroids"] = Json::array();
  doc["k"] = 0;
  ExpectFails(doc, RejectReason::kGeometry, "k must be >= 1");
}

TEST_F(ArtifactValidationTest, MaskChecks) {
  Json doc = doc_;
  doc["layer_mask"] = {0, 3, 2};
  ExpectFails(doc, RejectReason::kMalformed, "layer_mask must be sorted and distinct");
  doc = doc_;
  doc["layer_mask"] = {0, 2, 2};
  ExpectFails(doc, RejectReason::kMalformed, "sorted and distinct");
  doc = doc_;
  doc["layer_mask"] = {0, 2, 5};
  ExpectFails(doc, RejectReason::kGeometry, "layer_mask[2] = 5 is outside [0, 5)");
  doc = doc_;
  doc["layer_mask"] = Json::array();
  ExpectFails(doc, RejectReason::kMalformed, "`layer_mask` is empty");
}

TEST_F(ArtifactValidationTest, IdfChecks) {
  Json doc = doc_;
  doc.erase("sig_idf");
  ExpectFails(doc, RejectReason::kMalformed, "count_idf requires `sig_idf`");
  doc = doc_;
  doc["sig_idf"].erase(0);
  ExpectFails(doc, RejectReason::kGeometry, "sig_idf has 17 weights, expected");
  doc = doc_;
  doc["sig_idf"][4] = -1.0;
  ExpectFails(doc, RejectReason::kMalformed, "sig_idf[4]");
  doc = doc_;
  doc["sig_idf"][4] = 1e300;  // becomes +Inf as a float
  ExpectFails(doc, RejectReason::kNonFinite, "sig_idf[4]");
  doc = doc_;
  doc["variant"] = "count";
  ExpectFails(doc, RejectReason::kMalformed, "`sig_idf` is only valid for variant count_idf");
}

// Every artifact the reference implementation's loader refuses is refused here too, with the
// reason (its validate_signature_metadata and load_centroid_file): the transforms it does not
// implement, dtypes that do not match the variant, the per-variant mask rules, null keys.
TEST_F(ArtifactValidationTest, WhatTheReferenceRefuses) {
  struct Case {
    const char* what;
    std::function<void(Json&)> change;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"sig_mean set",
       [](Json& d) {
         d["sig_mean"] = Json::array({0, 0});
       },
       "`sig_mean` is set"},
      {"sig_mean zero", [](Json& d) { d["sig_mean"] = 0; }, "`sig_mean` is set"},
      {"_mean set", [](Json& d) { d["_mean"] = Json::array({0}); }, "`_mean` is set"},
      {"per-layer norm", [](Json& d) { d["sig_per_layer_norm"] = true; }, "`sig_per_layer_norm` is true"},
      {"per-layer norm 1", [](Json& d) { d["sig_per_layer_norm"] = 1; }, "`sig_per_layer_norm` is true"},
      {"_per_layer_norm", [](Json& d) { d["_per_layer_norm"] = "yes"; }, "`_per_layer_norm` is true"},
      {"dtype f4 for count_idf", [](Json& d) { d["sig_dtype"] = "<f4"; }, "`sig_dtype` is \"<f4\""},
      {"dtype null", [](Json& d) { d["sig_dtype"] = nullptr; }, "`sig_dtype` is null"},
      {"dtype i2 for gate_prob",
       [](Json& d) {
         d["variant"] = "gate_prob_all";
         d.erase("sig_idf");
       },
       "travels as \"<f4\""},
      {"count with a partial mask",
       [](Json& d) {
         d["variant"] = "count";
         d.erase("sig_idf");
       },
       "variant count uses every layer, but `layer_mask` keeps 3 of 5"},
      {"count_idf without a mask", [](Json& d) { d.erase("layer_mask"); },
       "count_idf requires an explicit `layer_mask`"},
      {"gate_prob without a mask",
       [](Json& d) {
         d["variant"] = "gate_prob_all";
         d["sig_dtype"] = "<f4";
         d.erase("sig_idf");
         d.erase("layer_mask");
       },
       "gate_prob requires an explicit `layer_mask`"},
      {"variant null", [](Json& d) { d["variant"] = nullptr; }, "`variant` must be a string, got null"},
      {"mask null", [](Json& d) { d["layer_mask"] = nullptr; }, "`layer_mask` must be a list"},
      {"mask of booleans",
       [](Json& d) {
         d["layer_mask"] = Json::array({true, 2, 3});
       },
       "`layer_mask`[0] must be"},
      {"all-zero IDF", [](Json& d) { d["sig_idf"] = std::vector<double>(d["sig_idf"].size(), 0.0); }, "sig_idf"},
      {"_mask differs",
       [](Json& d) {
         d["_mask"] = Json::array({0, 1, 2});
       },
       "`_mask` differs"},
      {"_idf differs", [](Json& d) { d["_idf"] = std::vector<double>(d["sig_idf"].size(), 1.0); }, "`_idf` differs"},
      {"k null", [](Json& d) { d["k"] = nullptr; }, "`k` is null"},
      {"centroids null beside micro_centroids",
       [](Json& d) {
         d["micro_centroids"] = d["centroids"];
         d["centroids"] = nullptr;
       },
       "`centroids` is null"},
  };
  for (const Case& c : cases) {
    Json doc = doc_;
    c.change(doc);
    const absl::Status status = ParseStatus(doc);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message)) << c.what;
  }
}

// ... and everything it accepts still loads: the defaults it assumes, null values it ignores, the
// older key, a row norm at its tolerance.
TEST_F(ArtifactValidationTest, WhatTheReferenceAcceptsStillLoads) {
  const std::vector<std::function<void(Json&)>> accepted = {
      [](Json& d) { d.erase("sig_dtype"); },  // "<i2" assumed
      [](Json& d) { d["sig_mean"] = nullptr; },
      [](Json& d) { d["sig_per_layer_norm"] = false; },
      [](Json& d) { d["_per_layer_norm"] = 0; },
      [](Json& d) { d["_mask"] = d["layer_mask"]; },
      [](Json& d) { d["_idf"] = d["sig_idf"]; },
      [](Json& d) {
        d["micro_centroids"] = d["centroids"];
        d.erase("centroids");
      },
      [](Json& d) {
        d["variant"] = "gate_prob_all";
        d["sig_dtype"] = "<f4";
        d["sig_idf"] = nullptr;
      },
      [](Json& d) {
        d["variant"] = "count";
        d["layer_mask"] = Json::array({0, 1, 2, 3, 4});
        d.erase("sig_idf");
        d.erase("sig_dtype");
        d["centroids"] = Json::array();
        d["k"] = 1;
        d.erase("workers");
        std::vector<double> row(5 * 6, 1.0 / std::sqrt(30.0));
        d["centroids"].push_back(row);
      },
      [](Json& d) {
        // |norm - 1| = 1.009e-3: inside numpy's allclose(atol=1e-3, rtol=1e-5).
        for (auto& v : d["centroids"][0]) v = v.get<double>() * 1.001009;
      },
  };
  for (size_t i = 0; i < accepted.size(); ++i) {
    Json doc = doc_;
    accepted[i](doc);
    EXPECT_TRUE(ParseStatus(doc).ok()) << i << ": " << ParseStatus(doc);
  }
}

TEST_F(ArtifactValidationTest, CentroidValueChecks) {
  Json doc = doc_;
  doc["centroids"][1][3] = 1e300;
  ExpectFails(doc, RejectReason::kNonFinite, "centroids row 1 value 3 is not finite");
  doc = doc_;
  for (auto& v : doc["centroids"][2]) v = v.get<double>() * 1.01;
  ExpectFails(doc, RejectReason::kMalformed, "centroids row 2 has L2 norm 1.01");
  // Within the 1e-3 tolerance passes.
  doc = doc_;
  for (auto& v : doc["centroids"][2]) v = v.get<double>() * 1.0005;
  EXPECT_TRUE(ParseStatus(doc).ok());
}

TEST_F(ArtifactValidationTest, WorkerChecks) {
  Json doc = doc_;
  doc["workers"] = {"a", "b"};
  ExpectFails(doc, RejectReason::kGeometry, "workers names 2 rows, k = 3");
  doc = doc_;
  doc["workers"] = {"a", "", "c"};
  ExpectFails(doc, RejectReason::kMalformed, "workers[1] is empty");
  doc = doc_;
  doc["workers"] = {"a", "b", "a"};
  ExpectFails(doc, RejectReason::kMalformed, "workers[2] = 'a' repeats workers[0]");
}

TEST(CentroidArtifactTest, ValidateNamesTheFailedCheckForStructs) {
  CentroidArtifact artifact = MakeArtifact();
  artifact.centroids.pop_back();
  const absl::Status status = ValidateCentroidArtifact(artifact);
  EXPECT_EQ(RejectReasonOf(status), RejectReason::kGeometry);
  EXPECT_THAT(std::string(status.message()), HasSubstr("expected k = 3 rows of dimension"));
  artifact = MakeArtifact();
  artifact.spec.layer_mask = {3, 1};
  EXPECT_THAT(std::string(ValidateCentroidArtifact(artifact).message()),
              HasSubstr("centroid artifact: signature spec: layer_mask must be sorted"));
}

TEST(CentroidArtifactTest, EveryTruncationIsAMalformedError) {
  CentroidArtifact artifact = MakeArtifact();
  const std::string text = SerializeCentroidArtifact(artifact);
  for (size_t length = 0; length + 2 < text.size(); length += 7) {
    const absl::Status status = ParseCentroidArtifact(text.substr(0, length)).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << length;
    EXPECT_EQ(RejectReasonOf(status), RejectReason::kMalformed) << length;
  }
}

// ---- Files -------------------------------------------------------------------------------------

TEST(CentroidArtifactFileTest, LoadErrorsNameThePath) {
  const absl::Status load = LoadCentroidArtifact("/nonexistent/x.json").status();
  EXPECT_EQ(load.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(load.message()), HasSubstr("/nonexistent/x.json"));
}

TEST(CentroidArtifactFileTest, LoadErrorsNamePathAndCheck) {
  TempDir dir;
  const std::string path = dir.File("bad.json");
  ASSERT_TRUE(WriteFileAtomically(path, "{\"L\": 2}").ok());
  const absl::Status status = LoadCentroidArtifact(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RejectReasonOf(status), RejectReason::kMalformed);
  EXPECT_THAT(std::string(status.message()), HasSubstr(path));
  EXPECT_THAT(std::string(status.message()), HasSubstr("missing required key `e`"));
}

}  // namespace
}  // namespace eldr
