#include "eldr/core/centroid_artifact.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "eldr/common/file.h"
#include "eldr/core/errors.h"
#include "nlohmann/json.hpp"

namespace eldr {
namespace {

using Json = nlohmann::json;

// The reference's np.allclose(norm, 1, atol=1e-3): |norm - 1| <= atol + rtol * 1 with numpy's
// default rtol 1e-5. The same bound, so every row the reference accepts loads here too.
constexpr double kUnitNormTolerance = 1e-3 + 1e-5;

absl::Status Malformed(absl::string_view message) {
  return InvalidInput(RejectReason::kMalformed, absl::StrCat("centroid artifact: ", message));
}

// Reads a required or optional integer key. JSON floats (26.0) and booleans are rejected: the
// reference writes plain integers and anything else is a sign of a hand-edited or foreign file.
absl::StatusOr<int64_t> IntegerKey(const Json& doc, const char* key, bool required, int64_t default_value) {
  auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) {
    if (required) return Malformed(absl::StrCat("missing required key `", key, "`"));
    return default_value;
  }
  if (!it->is_number_integer()) {
    return Malformed(absl::StrCat("`", key, "` must be an integer, got ", it->type_name()));
  }
  if (it->is_number_unsigned()) {
    const uint64_t value = it->get<uint64_t>();
    if (value > static_cast<uint64_t>(INT64_MAX)) {
      return Malformed(absl::StrCat("`", key, "` is out of range"));
    }
    return static_cast<int64_t>(value);
  }
  return it->get<int64_t>();
}

// A list of numbers -> floats. Values too large for a float become Inf and are reported by the
// finiteness checks with their position.
absl::Status FloatList(const Json& list, absl::string_view what, std::vector<float>* out) {
  if (!list.is_array()) {
    return Malformed(absl::StrCat("`", what, "` must be a list of numbers, got ", list.type_name()));
  }
  out->reserve(out->size() + list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const Json& value = list[i];
    if (!value.is_number()) {
      return Malformed(absl::StrFormat("`%s`[%d] must be a number, got %s", what, i, value.type_name()));
    }
    out->push_back(static_cast<float>(value.get<double>()));
  }
  return absl::OkStatus();
}

// Shortest decimal text that reads back as the same float.
void AppendFloat(std::string* out, float value) {
  char buffer[32];
  auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out->append(buffer, result.ptr);
}

void AppendFloatList(std::string* out, absl::Span<const float> values) {
  out->push_back('[');
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out->push_back(',');
    AppendFloat(out, values[i]);
  }
  out->push_back(']');
}

// The reference implementation's name for the gate-probability variant; writing it keeps our
// files loadable by the reference.
absl::string_view ReferenceVariantName(SignatureVariant variant) {
  return variant == SignatureVariant::kGateProb ? "gate_prob_all" : SignatureVariantName(variant);
}

// ---- ParseCentroidArtifact, one helper per key group, in the order the keys are checked ----

// Parses `json_text` into a JSON object; errors name only the byte position, never the text.
absl::StatusOr<Json> ParseJsonObject(absl::string_view json_text) {
  Json doc;
  try {
    doc = Json::parse(json_text.begin(), json_text.end());
  } catch (const Json::parse_error& e) {
    // Only the position: nlohmann's message quotes the bytes it read ("last read: ..."), and the
    // text may be a file that was never meant to be shown (a wrong path, a secret).
    return Malformed(absl::StrCat("invalid JSON at byte ", e.byte));
  } catch (const Json::exception& e) {
    return Malformed(absl::StrCat("invalid JSON (error ", e.id, ")"));
  }
  if (!doc.is_object()) {
    return Malformed(absl::StrCat("top level must be a JSON object, got ", doc.type_name()));
  }
  return doc;
}

// Reads the required `L` and `e` (each >= 1 and within int) into spec->layers and experts.
absl::Status ReadGeometryKeys(const Json& doc, SignatureSpec* spec) {
  ELDR_ASSIGN_OR_RETURN(const int64_t layers, IntegerKey(doc, "L", /*required=*/true, 0));
  ELDR_ASSIGN_OR_RETURN(const int64_t experts, IntegerKey(doc, "e", /*required=*/true, 0));
  if (layers < 1 || layers > INT32_MAX) {
    return InvalidInput(RejectReason::kGeometry, absl::StrCat("centroid artifact: `L` must be >= 1, got ", layers));
  }
  if (experts < 1 || experts > INT32_MAX) {
    return InvalidInput(RejectReason::kGeometry, absl::StrCat("centroid artifact: `e` must be >= 1, got ", experts));
  }
  spec->layers = static_cast<int>(layers);
  spec->experts = static_cast<int>(experts);
  return absl::OkStatus();
}

// Reads the optional `variant` into spec->variant; the reference treats a missing one as "count"
// (and refuses a null one, like any other non-name).
absl::Status ReadVariantKey(const Json& doc, SignatureSpec* spec) {
  spec->variant = SignatureVariant::kCount;
  if (auto it = doc.find("variant"); it != doc.end()) {
    if (!it->is_string()) {
      return Malformed(absl::StrCat("`variant` must be a string, got ", it->type_name()));
    }
    absl::StatusOr<SignatureVariant> variant = ParseSignatureVariant(it->get<std::string>());
    if (!variant.ok()) return Malformed(variant.status().message());
    spec->variant = *variant;
  }
  return absl::OkStatus();
}

// Reads the optional, non-empty `layer_mask` (indices in [0, L)) into spec->layer_mask; a mask of
// every layer in order is stored as none. A null one is refused (the reference wants a list).
absl::Status ReadLayerMaskKey(const Json& doc, SignatureSpec* spec) {
  auto it = doc.find("layer_mask");
  if (it == doc.end()) return absl::OkStatus();
  if (!it->is_array()) {
    return Malformed(absl::StrCat("`layer_mask` must be a list of layer indices, got ", it->type_name()));
  }
  if (it->empty()) return Malformed("`layer_mask` is empty; omit it to keep every layer");
  const int64_t layers = spec->layers;
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& layer = (*it)[i];
    if (!layer.is_number_integer()) {
      return Malformed(absl::StrFormat("`layer_mask`[%d] must be an integer, got %s", i, layer.type_name()));
    }
    const int64_t value = layer.get<int64_t>();
    if (value < 0 || value >= layers) {
      return InvalidInput(RejectReason::kGeometry, absl::StrFormat("centroid artifact: layer_mask[%d] = %d is outside "
                                                                   "[0, %d)",
                                                                   i, value, layers));
    }
    spec->layer_mask.push_back(static_cast<int>(value));
  }
  // An explicit mask of every layer is the same transform as no mask: store it canonically.
  if (static_cast<int64_t>(spec->layer_mask.size()) == layers) {
    bool identity = true;
    for (int l = 0; l < layers; ++l) identity = identity && spec->layer_mask[l] == l;
    if (identity) spec->layer_mask.clear();
  }
  return absl::OkStatus();
}

// Reads `sig_idf` into spec->idf: required for count_idf, rejected for the other variants.
absl::Status ReadIdfKey(const Json& doc, SignatureSpec* spec) {
  if (auto it = doc.find("sig_idf"); it != doc.end() && !it->is_null()) {
    if (spec->variant != SignatureVariant::kCountIdf) {
      return Malformed(
          absl::StrCat("`sig_idf` is only valid for variant count_idf, not ", SignatureVariantName(spec->variant)));
    }
    ELDR_RETURN_IF_ERROR(FloatList(*it, "sig_idf", &spec->idf));
  } else if (spec->variant == SignatureVariant::kCountIdf) {
    return Malformed("variant count_idf requires `sig_idf` (|layer_mask| * e IDF weights)");
  }
  return absl::OkStatus();
}

// Python's truth value of a JSON value, as the reference's `if data.get(key, False)` reads it.
bool Truthy(const Json& value) {
  if (value.is_null()) return false;
  if (value.is_boolean()) return value.get<bool>();
  if (value.is_number()) return value.get<double>() != 0;
  if (value.is_string() || value.is_array() || value.is_object()) return !value.empty();
  return true;
}

// The transforms the reference refuses, which this router would otherwise serve silently with
// another transform than the one the artifact was fitted with: a mean-centred signature
// (`sig_mean` or `_mean` not null), per-layer normalisation (`sig_per_layer_norm` or
// `_per_layer_norm` true), a wire dtype other than the variant's (`sig_dtype`: "<i2" for the
// count variants, "<f4" for gate_prob; a missing one means "<i2"), and the per-variant mask rules:
// `count` uses every layer and no IDF, `count_idf` and `gate_prob` need an explicit `layer_mask`.
// The reference's in-memory copies (`_mask`, `_idf`), when a file carries them, must agree.
absl::Status CheckReferenceTransformKeys(const Json& doc, const SignatureSpec& spec) {
  for (const char* key : {"sig_mean", "_mean"}) {
    if (auto it = doc.find(key); it != doc.end() && !it->is_null()) {
      return Malformed(absl::StrCat("`", key,
                                    "` is set: mean-centred signatures are not supported (the reference "
                                    "refuses them too); refit without it"));
    }
  }
  for (const char* key : {"sig_per_layer_norm", "_per_layer_norm"}) {
    if (auto it = doc.find(key); it != doc.end() && Truthy(*it)) {
      return Malformed(absl::StrCat("`", key,
                                    "` is true: per-layer normalised signatures are not supported (the "
                                    "reference refuses them too)"));
    }
  }
  const std::string expected_dtype = spec.variant == SignatureVariant::kGateProb ? "<f4" : "<i2";
  if (auto it = doc.find("sig_dtype"); it != doc.end()) {
    if (!it->is_string() || it->get<std::string>() != expected_dtype) {
      return Malformed(absl::StrCat("`sig_dtype` is ", it->dump(), ", but variant ", SignatureVariantName(spec.variant),
                                    " travels as \"", expected_dtype, "\""));
    }
  }
  const bool explicit_mask = doc.contains("layer_mask");
  switch (spec.variant) {
    case SignatureVariant::kCount:  // every layer: ValidateCentroidArtifact
      break;
    case SignatureVariant::kCountIdf:
    case SignatureVariant::kGateProb:
      if (!explicit_mask) {
        return Malformed(absl::StrCat("variant ", SignatureVariantName(spec.variant),
                                      " requires an explicit `layer_mask` (list every layer to keep them all)"));
      }
      break;
  }
  if (auto it = doc.find("_mask"); it != doc.end()) {
    const std::vector<int> mask = spec.EffectiveMask();
    bool same = it->is_array() && it->size() == mask.size();
    for (size_t i = 0; same && i < mask.size(); ++i) {
      same = (*it)[i].is_number_integer() && (*it)[i].get<int64_t>() == mask[i];
    }
    if (!same) return Malformed("`_mask` differs from `layer_mask`");
  }
  if (auto it = doc.find("_idf"); it != doc.end() && !it->is_null()) {
    std::vector<float> idf;
    if (spec.variant != SignatureVariant::kCountIdf || !FloatList(*it, "_idf", &idf).ok() || idf != spec.idf) {
      return Malformed("`_idf` differs from `sig_idf`");
    }
  }
  return absl::OkStatus();
}

// Reads the required `centroids` (or the older `micro_centroids`) rows of spec.dim() numbers into
// artifact->centroids, and `k`, which must match the row count when given.
absl::Status ReadCentroidRows(const Json& doc, CentroidArtifact* artifact) {
  // `micro_centroids` is an older reference key for the same matrix.
  // A `centroids` key that is present wins, even when null (then refused), as in the reference.
  auto rows = doc.find("centroids");
  if (rows == doc.end()) rows = doc.find("micro_centroids");
  if (rows == doc.end()) return Malformed("missing required key `centroids`");
  if (rows->is_null()) return Malformed("`centroids` is null");
  if (!rows->is_array()) {
    return Malformed(absl::StrCat("`centroids` must be a list of rows, got ", rows->type_name()));
  }
  const int64_t dim = artifact->spec.dim();
  for (size_t r = 0; r < rows->size(); ++r) {
    const Json& row = (*rows)[r];
    if (!row.is_array()) {
      return Malformed(absl::StrFormat("`centroids`[%d] must be a list of numbers, got %s", r, row.type_name()));
    }
    if (static_cast<int64_t>(row.size()) != dim) {
      return InvalidInput(RejectReason::kGeometry, absl::StrFormat("centroid artifact: centroids row %d has %d values, "
                                                                   "expected dimension |layer_mask| * e = %d * %d = %d",
                                                                   r, row.size(), artifact->spec.masked_layers(),
                                                                   int64_t{artifact->spec.experts}, dim));
    }
    ELDR_RETURN_IF_ERROR(FloatList(row, absl::StrCat("centroids[", r, "]"), &artifact->centroids));
  }
  const int64_t row_count = static_cast<int64_t>(rows->size());
  if (auto it = doc.find("k"); it != doc.end() && it->is_null()) {
    return Malformed("`k` is null; omit it to mean the row count");
  }
  ELDR_ASSIGN_OR_RETURN(const int64_t k, IntegerKey(doc, "k", /*required=*/false, row_count));
  if (k != row_count) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("centroid artifact: k = %d but `centroids` has %d rows", k, row_count));
  }
  artifact->k = static_cast<int>(k);
  return absl::OkStatus();
}

// Reads the optional `workers` (a list of strings) into artifact->workers.
absl::Status ReadWorkersKey(const Json& doc, CentroidArtifact* artifact) {
  auto it = doc.find("workers");
  if (it == doc.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_array()) {
    return Malformed(absl::StrCat("`workers` must be a list of worker ids, got ", it->type_name()));
  }
  for (size_t i = 0; i < it->size(); ++i) {
    if (!(*it)[i].is_string()) {
      return Malformed(absl::StrFormat("`workers`[%d] must be a string, got %s", i, (*it)[i].type_name()));
    }
    artifact->workers.push_back((*it)[i].get<std::string>());
  }
  return absl::OkStatus();
}

// Reads the optional `model` (a string) and `seed` (a non-negative integer).
absl::Status ReadModelAndSeedKeys(const Json& doc, CentroidArtifact* artifact) {
  if (auto it = doc.find("model"); it != doc.end() && !it->is_null()) {
    if (!it->is_string()) {
      return Malformed(absl::StrCat("`model` must be a string, got ", it->type_name()));
    }
    artifact->model = it->get<std::string>();
  }
  if (auto it = doc.find("seed"); it != doc.end() && !it->is_null()) {
    if (!it->is_number_integer() || (it->is_number_integer() && !it->is_number_unsigned() && it->get<int64_t>() < 0)) {
      return Malformed(absl::StrCat("`seed` must be a non-negative integer, got ", it->dump()));
    }
    artifact->seed = it->get<uint64_t>();
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateCentroidArtifact(const CentroidArtifact& artifact) {
  absl::Status spec_status = ValidateSignatureSpec(artifact.spec);
  if (!spec_status.ok()) {
    return MakeInputError(spec_status.code(), RejectReasonOf(spec_status),
                          absl::StrCat("centroid artifact: ", spec_status.message()));
  }
  if (artifact.spec.variant == SignatureVariant::kCount && !artifact.spec.layer_mask.empty()) {
    // The reference's rule: its count transform normalises every layer and has no mask.
    return InvalidInput(RejectReason::kMalformed,
                        absl::StrCat("centroid artifact: variant count uses every layer, but `layer_mask` keeps ",
                                     artifact.spec.layer_mask.size(), " of ", artifact.spec.layers,
                                     " (a partial mask needs count_idf or gate_prob_all)"));
  }
  if (artifact.k < 1) {
    return InvalidInput(RejectReason::kGeometry, absl::StrCat("centroid artifact: k must be >= 1, got ", artifact.k));
  }
  const int64_t dim = artifact.dim();
  if (static_cast<int64_t>(artifact.centroids.size()) != int64_t{artifact.k} * dim) {
    return InvalidInput(RejectReason::kGeometry,
                        absl::StrFormat("centroid artifact: expected k = %d rows of dimension |layer_mask| * e = "
                                        "%d (%d values), got %d values",
                                        artifact.k, dim, int64_t{artifact.k} * dim, artifact.centroids.size()));
  }
  for (int r = 0; r < artifact.k; ++r) {
    absl::Span<const float> row = artifact.row(r);
    double sum_of_squares = 0;
    for (size_t i = 0; i < row.size(); ++i) {
      if (!std::isfinite(row[i])) {
        return InvalidInput(RejectReason::kNonFinite,
                            absl::StrFormat("centroid artifact: centroids row %d value %d is not "
                                            "finite (%g)",
                                            r, i, row[i]));
      }
      sum_of_squares += static_cast<double>(row[i]) * row[i];
    }
    const double norm = std::sqrt(sum_of_squares);
    if (std::abs(norm - 1.0) > kUnitNormTolerance) {
      return InvalidInput(RejectReason::kMalformed,
                          absl::StrFormat("centroid artifact: centroids row %d has L2 norm %.6f; "
                                          "rows must be unit norm within %g",
                                          r, norm, kUnitNormTolerance));
    }
  }
  if (!artifact.workers.empty()) {
    if (static_cast<int>(artifact.workers.size()) != artifact.k) {
      return InvalidInput(RejectReason::kGeometry, absl::StrFormat("centroid artifact: workers names %d rows, k = %d",
                                                                   artifact.workers.size(), artifact.k));
    }
    absl::flat_hash_map<absl::string_view, size_t> seen;
    for (size_t i = 0; i < artifact.workers.size(); ++i) {
      const std::string& id = artifact.workers[i];
      if (id.empty()) {
        return InvalidInput(RejectReason::kMalformed, absl::StrFormat("centroid artifact: workers[%d] is empty", i));
      }
      auto [it, inserted] = seen.emplace(id, i);
      if (!inserted) {
        return InvalidInput(RejectReason::kMalformed,
                            absl::StrFormat("centroid artifact: workers must be distinct, but "
                                            "workers[%d] = '%s' repeats workers[%d]",
                                            i, id, it->second));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CentroidArtifact> ParseCentroidArtifact(absl::string_view json_text) {
  ELDR_ASSIGN_OR_RETURN(const Json doc, ParseJsonObject(json_text));
  CentroidArtifact artifact;
  ELDR_RETURN_IF_ERROR(ReadGeometryKeys(doc, &artifact.spec));
  ELDR_RETURN_IF_ERROR(ReadVariantKey(doc, &artifact.spec));
  ELDR_RETURN_IF_ERROR(ReadLayerMaskKey(doc, &artifact.spec));
  ELDR_RETURN_IF_ERROR(ReadIdfKey(doc, &artifact.spec));
  ELDR_RETURN_IF_ERROR(CheckReferenceTransformKeys(doc, artifact.spec));
  ELDR_RETURN_IF_ERROR(ReadCentroidRows(doc, &artifact));
  ELDR_RETURN_IF_ERROR(ReadWorkersKey(doc, &artifact));
  ELDR_RETURN_IF_ERROR(ReadModelAndSeedKeys(doc, &artifact));
  ELDR_RETURN_IF_ERROR(ValidateCentroidArtifact(artifact));
  return artifact;
}

absl::StatusOr<CentroidArtifact> LoadCentroidArtifact(const std::string& path, size_t max_bytes) {
  ELDR_ASSIGN_OR_RETURN(std::string text, ReadFile(path, max_bytes));
  absl::StatusOr<CentroidArtifact> artifact = ParseCentroidArtifact(text);
  if (!artifact.ok()) {
    return MakeInputError(artifact.status().code(), RejectReasonOf(artifact.status()),
                          absl::StrCat(path, ": ", artifact.status().message()));
  }
  return artifact;
}

std::string SerializeCentroidArtifact(const CentroidArtifact& artifact) {
  const SignatureSpec& spec = artifact.spec;
  std::string out = "{\n";
  absl::StrAppend(&out, "  \"model\": ", Json(artifact.model).dump(), ",\n");
  absl::StrAppend(&out, "  \"k\": ", artifact.k, ",\n");
  absl::StrAppend(&out, "  \"L\": ", spec.layers, ",\n");
  absl::StrAppend(&out, "  \"e\": ", spec.experts, ",\n");
  absl::StrAppend(&out, "  \"variant\": \"", ReferenceVariantName(spec.variant), "\",\n");
  // Always explicit: the reference requires a mask for count_idf and gate_prob_all.
  absl::StrAppend(&out, "  \"layer_mask\": [");
  const std::vector<int> mask = spec.EffectiveMask();
  for (size_t i = 0; i < mask.size(); ++i) absl::StrAppend(&out, i > 0 ? "," : "", mask[i]);
  absl::StrAppend(&out, "],\n");
  if (spec.variant == SignatureVariant::kCountIdf) {
    out += "  \"sig_idf\": ";
    AppendFloatList(&out, spec.idf);
    out += ",\n";
  }
  // The wire dtype the reference expects for the variant.
  absl::StrAppend(&out, "  \"sig_dtype\": \"", spec.variant == SignatureVariant::kGateProb ? "<f4" : "<i2", "\",\n");
  absl::StrAppend(&out, "  \"seed\": ", artifact.seed, ",\n");
  if (!artifact.workers.empty()) {
    absl::StrAppend(&out, "  \"workers\": ", Json(artifact.workers).dump(), ",\n");
  }
  out += "  \"centroids\": [";
  for (int r = 0; r < artifact.k; ++r) {
    out += r > 0 ? ",\n    " : "\n    ";
    if (static_cast<int64_t>(artifact.centroids.size()) >= int64_t{r + 1} * artifact.dim()) {
      AppendFloatList(&out, artifact.row(r));
    } else {
      out += "[]";
    }
  }
  out += "\n  ]\n}\n";
  return out;
}

absl::Status SaveCentroidArtifact(const CentroidArtifact& artifact, const std::string& path) {
  ELDR_RETURN_IF_ERROR(ValidateCentroidArtifact(artifact));
  return WriteFileAtomically(path, SerializeCentroidArtifact(artifact));
}

}  // namespace eldr
