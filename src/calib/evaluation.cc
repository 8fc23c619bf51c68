// How good is a calibration: cluster purity against labels, and held-out routing agreement
// (docs/calibration.md, "Verifying"). Also the report JSON.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "calib/signatures.h"
#include "eldr/calib/calibration.h"
#include "eldr/core/centroid_index.h"
#include "eldr/core/signature.h"
#include "nlohmann/json.hpp"

namespace eldr {
namespace {

// Nearest centroid (highest score; lowest row on ties) of each row of `points`.
std::vector<int> NearestRows(const std::vector<float>& points, int n, const CentroidArtifact& artifact) {
  const int k = artifact.k;
  std::vector<float> scores(static_cast<size_t>(n) * k);
  if (n > 0) ScoreAllPairs(points, n, artifact.centroids, k, artifact.dim(), absl::MakeSpan(scores));
  std::vector<int> nearest(n);
  for (int i = 0; i < n; ++i) {
    const float* row = scores.data() + static_cast<size_t>(i) * k;
    nearest[i] = static_cast<int>(std::max_element(row, row + k) - row);
  }
  return nearest;
}

int LabelCount(const CalibrationData& a, const CalibrationData* b) {
  int count = static_cast<int>(a.label_names.size());
  for (int l : a.labels) count = std::max(count, l + 1);
  if (b != nullptr) {
    count = std::max(count, static_cast<int>(b->label_names.size()));
    for (int l : b->labels) count = std::max(count, l + 1);
  }
  return count;
}

// Sum over groups of the most common label's count, divided by the members counted.
double Purity(const std::vector<std::vector<int>>& group_label_counts) {
  int64_t majority = 0, total = 0;
  for (const auto& counts : group_label_counts) {
    int best = 0;
    for (int c : counts) {
      best = std::max(best, c);
      total += c;
    }
    majority += best;
  }
  return total > 0 ? static_cast<double>(majority) / total : 0.0;
}

}  // namespace

absl::StatusOr<CalibrationEvaluation> EvaluateCalibration(const CalibrationResult& result,
                                                          const CalibrationData& calibration,
                                                          const CalibrationData* holdout,
                                                          const CalibrationOptions& options) {
  const CentroidArtifact& artifact = result.artifact;
  const int k = artifact.k;
  const int dim = artifact.dim();
  if (result.report.assignment.size() != static_cast<size_t>(calibration.n)) {
    return absl::InvalidArgumentError(absl::StrCat("the report assigns ", result.report.assignment.size(),
                                                   " requests, the calibration data has ", calibration.n));
  }
  absl::StatusOr<SignatureTransform> transform = SignatureTransform::Create(artifact.spec);
  if (!transform.ok()) return transform.status();

  CalibrationEvaluation evaluation;
  const bool labelled = !calibration.labels.empty();
  const int label_count = LabelCount(calibration, holdout);

  // ---- Calibration clusters ----
  evaluation.cluster_label_counts.assign(k, std::vector<int>(label_count, 0));
  if (labelled) {
    for (int r = 0; r < calibration.n; ++r) {
      const int c = result.report.assignment[r];
      if (c >= 0) ++evaluation.cluster_label_counts[c][calibration.labels[r]];
    }
    evaluation.purity = Purity(evaluation.cluster_label_counts);
  }
  evaluation.cluster_majority_label.assign(k, -1);
  for (int c = 0; c < k; ++c) {
    const auto& counts = evaluation.cluster_label_counts[c];
    if (label_count == 0) continue;
    const auto top = std::max_element(counts.begin(), counts.end());
    if (*top > 0) evaluation.cluster_majority_label[c] = static_cast<int>(top - counts.begin());
  }

  std::vector<int> usable;
  absl::StatusOr<std::vector<float>> points = TransformRequests(calibration, *transform, &usable);
  if (!points.ok()) return points.status();
  const int n = static_cast<int>(usable.size());
  const std::vector<int> nearest = NearestRows(*points, n, artifact);
  int agree = 0;
  for (int i = 0; i < n; ++i) agree += nearest[i] == result.report.assignment[usable[i]];
  evaluation.calibration_nearest_agreement = n > 0 ? static_cast<double>(agree) / n : 0.0;

  if (holdout == nullptr || holdout->n == 0) return evaluation;

  // ---- Held-out requests ----
  std::vector<int> held_usable;
  absl::StatusOr<std::vector<float>> held = TransformRequests(*holdout, *transform, &held_usable);
  if (!held.ok()) return absl::Status(held.status().code(), absl::StrCat("held-out ", held.status().message()));
  const int m = static_cast<int>(held_usable.size());
  evaluation.holdout_requests = m;
  if (m == 0) return evaluation;
  const std::vector<int> held_nearest = NearestRows(*held, m, artifact);

  // Joint balanced assignment of calibration + held-out requests against the fitted centroids.
  std::vector<float> joint = *points;
  joint.insert(joint.end(), held->begin(), held->end());
  const int total = n + m;
  std::vector<float> scores(static_cast<size_t>(total) * k);
  ScoreAllPairs(joint, total, artifact.centroids, k, dim, absl::MakeSpan(scores));
  std::vector<double> cost(scores.size());
  for (size_t i = 0; i < scores.size(); ++i) cost[i] = 1.0 - static_cast<double>(scores[i]);
  // Balanced the way the fit was: by decode tokens when it was (explicit weights exist for the
  // calibration requests only, so their evaluation balances counts), else by counts.
  std::optional<WeightUnits> units;
  if (result.report.weighting == "decode_tokens") {
    const std::vector<double> calibration_tokens = DecodeTokenWeights(calibration);
    const std::vector<double> holdout_tokens = DecodeTokenWeights(*holdout);
    std::vector<double> joint_weights;
    for (int r : usable) joint_weights.push_back(calibration_tokens[r]);
    for (int r : held_usable) joint_weights.push_back(holdout_tokens.empty() ? 0.0 : holdout_tokens[r]);
    absl::StatusOr<WeightUnits> quantised = QuantiseWeights(joint_weights, k, options.weight_resolution);
    if (!quantised.ok()) return quantised.status();
    units = *std::move(quantised);
  }
  const int amount = units.has_value() ? static_cast<int>(units->total) : total;
  std::vector<int> capacity = ClusterCapacities(amount, k, options.capacity_weights);
  if (capacity.empty()) return absl::InvalidArgumentError("bad capacity weights");
  if (!options.balanced) capacity.assign(k, amount);  // unbalanced fit: the nearest centroid
  absl::StatusOr<std::vector<int>> joint_assignment;
  if (units.has_value()) {
    absl::StatusOr<WeightedAssignment> weighted =
        SolveWeightedBalancedAssignment(cost, total, k, units->units, capacity);
    if (!weighted.ok()) return weighted.status();
    joint_assignment = std::move(weighted->assignment);
  } else {
    joint_assignment = SolveBalancedAssignment(cost, total, k, capacity);
  }
  if (!joint_assignment.ok()) return joint_assignment.status();
  int assignment_agree = 0;
  for (int i = 0; i < m; ++i) assignment_agree += held_nearest[i] == (*joint_assignment)[n + i];
  evaluation.holdout_assignment_agreement = static_cast<double>(assignment_agree) / m;

  if (labelled && !holdout->labels.empty()) {
    int label_agree = 0;
    std::vector<std::vector<int>> by_nearest(k, std::vector<int>(label_count, 0));
    for (int i = 0; i < m; ++i) {
      const int label = holdout->labels[held_usable[i]];
      label_agree += evaluation.cluster_majority_label[held_nearest[i]] == label;
      ++by_nearest[held_nearest[i]][label];
    }
    evaluation.holdout_label_agreement = static_cast<double>(label_agree) / m;
    evaluation.holdout_purity = Purity(by_nearest);
  }
  return evaluation;
}

std::string CalibrationReportJson(const CalibrationResult& result, const CalibrationOptions& options,
                                  const CalibrationEvaluation* evaluation, const CalibrationData& calibration) {
  const CalibrationReport& report = result.report;
  nlohmann::ordered_json json;
  json["objective"] = report.objective;
  json["clusters"] = result.artifact.k;
  json["requests"] = calibration.n;
  json["variant"] = std::string(SignatureVariantName(result.artifact.spec.variant));
  json["dim"] = result.artifact.dim();
  json["seed"] = options.seed;
  json["cluster_sizes"] = report.cluster_sizes;
  json["cluster_capacities"] = report.cluster_capacities;
  json["capacity_weights"] = options.capacity_weights;
  json["workers"] = result.artifact.workers;
  json["excluded_requests"] = report.excluded_requests;
  json["iterations"] = report.iterations;
  json["converged"] = report.converged;
  json["objective_per_iteration"] = report.objective_per_iteration;
  json["layer_mask"] = report.layer_mask;
  json["balanced"] = report.balanced;
  json["weighting"] = report.weighting;
  if (report.weighting != "none") {
    json["cluster_weights"] = report.cluster_weights;
    json["unit_weight"] = report.unit_weight;
  }
  nlohmann::ordered_json mask;
  mask["searched"] = !report.mask_steps.empty();
  mask["rule"] = LayerMaskRuleName(report.mask_rule);
  mask["peak_step"] = report.mask_peak_step;
  mask["correlation"] = report.mask_correlation;
  mask["all_layers_correlation"] = report.all_layers_correlation;
  mask["pairs"] = report.mask_pairs;
  mask["steps"] = nlohmann::ordered_json::array();
  for (const LayerMaskStep& step : report.mask_steps) {
    mask["steps"].push_back({{"layer", step.layer}, {"correlation", step.correlation}});
  }
  json["mask"] = mask;
  json["seconds"] = {{"idf", report.seconds_idf},
                     {"mask", report.seconds_mask},
                     {"signatures", report.seconds_signatures},
                     {"kmeans", report.seconds_kmeans},
                     {"kmeans_seeding", report.seconds_seeding},
                     {"kmeans_scoring", report.seconds_scoring},
                     {"kmeans_assignment", report.seconds_assignment},
                     {"kmeans_update", report.seconds_update},
                     {"total", report.seconds_total}};
  if (evaluation != nullptr) {
    nlohmann::ordered_json e;
    e["label_names"] = calibration.label_names;
    e["purity"] = evaluation->purity;
    e["cluster_label_counts"] = evaluation->cluster_label_counts;
    e["cluster_majority_label"] = evaluation->cluster_majority_label;
    e["calibration_nearest_agreement"] = evaluation->calibration_nearest_agreement;
    e["holdout_requests"] = evaluation->holdout_requests;
    e["holdout_assignment_agreement"] = evaluation->holdout_assignment_agreement;
    e["holdout_label_agreement"] = evaluation->holdout_label_agreement;
    e["holdout_purity"] = evaluation->holdout_purity;
    json["evaluation"] = e;
  }
  return json.dump(2) + "\n";
}

}  // namespace eldr
