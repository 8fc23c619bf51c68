// Calibrate(): IDF weights, greedy layer mask, signatures, balanced spherical k-means, artifact.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "calib/calib_internal.h"
#include "calib/signatures.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/errors.h"
#include "eldr/core/signature.h"

namespace eldr {

absl::StatusOr<std::vector<float>> TransformRequests(const CalibrationData& data, const SignatureTransform& transform,
                                                     std::vector<int>* usable) {
  const SignatureSpec& spec = transform.spec();
  if (spec.layers != data.layers || spec.experts != data.experts) {
    return absl::InvalidArgumentError(absl::StrCat("data geometry L=", data.layers, " E=", data.experts,
                                                   " does not match the transform's L=", spec.layers,
                                                   " E=", spec.experts));
  }
  if (spec.variant == SignatureVariant::kGateProb && data.gate_prob_sums.empty()) {
    return absl::InvalidArgumentError("variant gate_prob needs gate-probability sums, and the data carries none");
  }
  const size_t per_request = static_cast<size_t>(data.layers) * data.experts;
  const int dim = transform.dim();
  std::vector<float> out;
  out.reserve(static_cast<size_t>(data.n) * dim);
  usable->clear();
  std::vector<float> row(dim);
  for (int r = 0; r < data.n; ++r) {
    absl::Status status;
    if (spec.variant == SignatureVariant::kGateProb) {
      status =
          transform.Apply(GateProbSums{data.layers, data.experts,
                                       absl::MakeConstSpan(data.gate_prob_sums).subspan(r * per_request, per_request)},
                          absl::MakeSpan(row));
    } else {
      status =
          transform.Apply(CountsInt32{data.layers, data.experts,
                                      absl::MakeConstSpan(data.prefill_counts).subspan(r * per_request, per_request)},
                          absl::MakeSpan(row));
    }
    if (!status.ok()) {
      // An all-zero signature has no direction: the router falls back to load balancing for such
      // requests, and calibration leaves them out.
      if (RejectReasonOf(status) == RejectReason::kZeroSignature) continue;
      return absl::Status(status.code(), absl::StrCat("request ", r, ": ", status.message()));
    }
    out.insert(out.end(), row.begin(), row.end());
    usable->push_back(r);
  }
  return out;
}

std::vector<double> DecodeTokenWeights(const CalibrationData& data) {
  if (data.decode_counts.empty() || data.n == 0) return {};
  const size_t plane = static_cast<size_t>(data.layers) * data.experts;
  std::vector<double> tokens(data.n, 0.0);
  for (int i = 0; i < data.n; ++i) {
    for (int e = 0; e < data.experts; ++e) tokens[i] += data.decode_counts[plane * i + e];
  }
  return tokens;
}

namespace {

// Checks the data (ValidateCalibrationData) and the options Calibrate needs: clusters, capacity
// weights, worker ids, gate sums for gate_prob.
absl::Status ValidateCalibrateInputs(const CalibrationData& data, const CalibrationOptions& options) {
  if (absl::Status s = ValidateCalibrationData(data); !s.ok()) return s;
  const int k = options.clusters;
  if (k < 1) return absl::InvalidArgumentError(absl::StrCat("clusters = ", k, ", need >= 1"));
  if (data.n < k) {
    return absl::InvalidArgumentError(
        absl::StrCat("too few requests: ", data.n, " for ", k, " clusters (need at least one per cluster)"));
  }
  if (!options.capacity_weights.empty() && options.capacity_weights.size() != static_cast<size_t>(k)) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.capacity_weights.size(), " capacity weights for ", k, " clusters"));
  }
  for (double w : options.capacity_weights) {
    if (!std::isfinite(w) || w <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("capacity weight ", w, " must be finite and > 0"));
    }
  }
  if (!options.worker_ids.empty()) {
    if (options.worker_ids.size() != static_cast<size_t>(k)) {
      return absl::InvalidArgumentError(absl::StrCat(options.worker_ids.size(), " worker ids for ", k, " clusters"));
    }
    std::set<std::string> distinct;
    for (const std::string& id : options.worker_ids) {
      if (id.empty()) return absl::InvalidArgumentError("a worker id is empty");
      if (!distinct.insert(id).second) {
        return absl::InvalidArgumentError(absl::StrCat("worker id \"", id, "\" appears twice"));
      }
    }
  }
  if (options.variant == SignatureVariant::kGateProb && data.gate_prob_sums.empty()) {
    return absl::InvalidArgumentError("variant gate_prob needs gate-probability sums, and the data carries none");
  }
  return absl::OkStatus();
}

// The signature spec to calibrate: for count_idf, IDF weights; for count_idf and gate_prob (when
// asked and decode counts exist) the greedy layer mask; count keeps every layer, unweighted. Fills
// the IDF and mask parts of `report`. Every request counts once here, whatever the clustering's
// weights.
absl::StatusOr<SignatureSpec> ChooseSignatureSpec(const CalibrationData& data, const CalibrationOptions& options,
                                                  CalibrationReport* report) {
  SignatureSpec spec;
  spec.layers = data.layers;
  spec.experts = data.experts;
  spec.variant = options.variant;

  auto phase = std::chrono::steady_clock::now();
  std::vector<float> idf;
  if (options.variant == SignatureVariant::kCountIdf) {
    idf = ComputeIdf(data.prefill_counts, data.n, data.layers, data.experts);
    if (idf.empty()) return absl::InternalError("IDF weights could not be computed");
  }
  report->seconds_idf = SecondsSince(phase);

  phase = std::chrono::steady_clock::now();
  report->mask_rule = options.mask_rule;
  const bool searchable =
      options.variant == SignatureVariant::kCountIdf || options.variant == SignatureVariant::kGateProb;
  if (searchable && options.select_layers && !data.decode_counts.empty() && data.n >= 3) {
    LayerMaskSearchOptions search;
    search.max_pairs = options.mask_pairs;
    search.seed = options.seed;
    search.rule = options.mask_rule;
    search.variant = options.variant;
    absl::StatusOr<LayerMaskSearchResult> mask = SearchLayerMask(data, idf, search);
    if (!mask.ok()) return mask.status();
    spec.layer_mask = mask->layer_mask;
    report->mask_steps = mask->steps;
    report->mask_peak_step = mask->peak_step;
    report->mask_correlation = mask->correlation;
    report->all_layers_correlation = mask->all_layers_correlation;
    report->mask_pairs = mask->pairs;
  }
  report->seconds_mask = SecondsSince(phase);
  if (options.variant == SignatureVariant::kCountIdf) {
    for (int l : spec.EffectiveMask()) {
      spec.idf.insert(spec.idf.end(), idf.begin() + static_cast<size_t>(l) * data.experts,
                      idf.begin() + static_cast<size_t>(l + 1) * data.experts);
    }
  }
  report->layer_mask = spec.EffectiveMask();
  return spec;
}

// The unit signatures of the requests that have one, in request order.
struct CalibrationPoints {
  std::vector<float> values;  // usable.size() rows of dim floats
  std::vector<int> usable;    // the request of each row
  int dim = 0;
};

// Transforms every request with `spec`; records the all-zero ones in report->excluded_requests
// and fails when fewer than `clusters` remain.
absl::StatusOr<CalibrationPoints> TransformUsableRequests(const CalibrationData& data, const SignatureSpec& spec,
                                                          int clusters, CalibrationReport* report) {
  const auto phase = std::chrono::steady_clock::now();
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(spec);
  if (!transform.ok()) return transform.status();
  CalibrationPoints points;
  absl::StatusOr<std::vector<float>> values = TransformRequests(data, *transform, &points.usable);
  if (!values.ok()) return values.status();
  points.values = *std::move(values);
  points.dim = transform->dim();
  report->seconds_signatures = SecondsSince(phase);
  size_t next = 0;
  for (int r = 0; r < data.n; ++r) {
    if (next < points.usable.size() && points.usable[next] == r) {
      ++next;
    } else {
      report->excluded_requests.push_back(r);
    }
  }
  const int usable_n = static_cast<int>(points.usable.size());
  if (usable_n < clusters) {
    return absl::InvalidArgumentError(
        absl::StrCat("too few requests with a non-zero signature: ", usable_n, " of ", data.n, " for ", clusters,
                     " clusters (", report->excluded_requests.size(), " are all zero on the chosen layers)"));
  }
  return points;
}

// The clustering's weight of each usable request (empty: unweighted) and its name for the
// report: explicit weights, decode tokens, or none.
absl::StatusOr<std::vector<double>> ClusteringWeights(const CalibrationData& data, const CalibrationOptions& options,
                                                      const std::vector<int>& usable, std::string* weighting) {
  std::vector<double> per_request;
  *weighting = "none";
  if (!options.request_weights.empty()) {
    if (options.request_weights.size() != static_cast<size_t>(data.n)) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.request_weights.size(), " request weights for ", data.n, " requests"));
    }
    per_request = options.request_weights;
    *weighting = "explicit";
  } else if (options.weight_by_decode_tokens && !data.decode_counts.empty()) {
    per_request = DecodeTokenWeights(data);
    *weighting = "decode_tokens";
  }
  if (per_request.empty()) return per_request;
  std::vector<double> weights;
  weights.reserve(usable.size());
  for (int r : usable) {
    if (!std::isfinite(per_request[r]) || per_request[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", r, " has weight ", per_request[r], "; need a finite value >= 0"));
    }
    weights.push_back(per_request[r]);
  }
  double total = 0;
  for (double w : weights) total += w;
  if (!(total > 0)) {
    if (*weighting == "explicit") return absl::InvalidArgumentError("the request weights sum to zero");
    // No request generated a decode token: nothing to weight by.
    *weighting = "none";
    weights.clear();
  }
  return weights;
}

// Balanced spherical k-means of the points with the options' clusters, weights, seed and limits;
// records its time in report->seconds_kmeans.
absl::StatusOr<BalancedKMeansResult> FitCentroids(const CalibrationPoints& points, const CalibrationOptions& options,
                                                  std::vector<double> weights, CalibrationReport* report) {
  const auto phase = std::chrono::steady_clock::now();
  BalancedKMeansOptions kmeans;
  kmeans.point_weights = std::move(weights);
  kmeans.weight_resolution = options.weight_resolution;
  kmeans.balanced = options.balanced;
  kmeans.clusters = options.clusters;
  kmeans.capacity_weights = options.capacity_weights;
  kmeans.seed = options.seed;
  kmeans.max_iterations = options.max_iterations;
  kmeans.tolerance = options.tolerance;
  kmeans.seeding_sample = options.seeding_sample;
  absl::StatusOr<BalancedKMeansResult> fit =
      FitBalancedKMeans(points.values, static_cast<int>(points.usable.size()), points.dim, kmeans);
  if (!fit.ok()) return fit.status();
  report->seconds_kmeans = SecondsSince(phase);
  return fit;
}

// Copies the fit's objective, sizes, iterations and phase times into `report`, and its assignment
// back onto the n calibration requests (-1 for the excluded ones).
void RecordFit(const BalancedKMeansResult& fit, const std::vector<int>& usable, int n, CalibrationReport* report) {
  report->objective = fit.objective;
  report->cluster_sizes = fit.sizes;
  report->cluster_capacities = fit.capacities;
  report->iterations = fit.iterations;
  report->converged = fit.converged;
  report->objective_per_iteration = fit.objective_per_iteration;
  report->seconds_seeding = fit.seconds_seeding;
  report->seconds_scoring = fit.seconds_scoring;
  report->seconds_assignment = fit.seconds_assignment;
  report->seconds_update = fit.seconds_update;
  report->cluster_weights = fit.cluster_weights;
  report->unit_weight = fit.unit_weight;
  report->split_points = fit.split_points;
  report->assignment.assign(n, -1);
  for (size_t i = 0; i < usable.size(); ++i) report->assignment[usable[i]] = fit.assignment[i];
}

}  // namespace

absl::StatusOr<CalibrationResult> Calibrate(const CalibrationData& data, const CalibrationOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (absl::Status s = ValidateCalibrateInputs(data, options); !s.ok()) return s;
  const int k = options.clusters;

  CalibrationResult result;
  CalibrationReport& report = result.report;
  absl::StatusOr<SignatureSpec> spec = ChooseSignatureSpec(data, options, &report);
  if (!spec.ok()) return spec.status();
  absl::StatusOr<CalibrationPoints> points = TransformUsableRequests(data, *spec, k, &report);
  if (!points.ok()) return points.status();
  absl::StatusOr<std::vector<double>> weights = ClusteringWeights(data, options, points->usable, &report.weighting);
  if (!weights.ok()) return weights.status();
  report.balanced = options.balanced;
  absl::StatusOr<BalancedKMeansResult> fit = FitCentroids(*points, options, *std::move(weights), &report);
  if (!fit.ok()) return fit.status();
  RecordFit(*fit, points->usable, data.n, &report);

  CentroidArtifact& artifact = result.artifact;
  artifact.spec = *std::move(spec);
  artifact.k = k;
  artifact.centroids = std::move(fit->centroids);
  artifact.workers = options.worker_ids;
  artifact.model = options.model;
  artifact.seed = options.seed;
  if (absl::Status s = ValidateCentroidArtifact(artifact); !s.ok()) {
    return absl::InternalError(absl::StrCat("fitted artifact failed validation: ", s.message()));
  }
  report.seconds_total = SecondsSince(start);
  return result;
}

}  // namespace eldr
