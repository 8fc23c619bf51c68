// Greedy forward layer selection (docs/calibration.md, "What calibration computes"): at each of the
// L steps add the layer that most raises the Spearman correlation between prefill-signature cosine
// distances and decode-usage cosine distances over request pairs; keep the prefix up to the
// global maximum of that curve (the reference's rule), or stop at its first non-increase.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "calib/calib_internal.h"
#include "eldr/calib/calibration.h"

namespace eldr {
namespace {

// Average ranks (1-based; ties share the mean of their positions). `order` is scratch. Sorting
// (value, index) pairs in place keeps the comparisons cache-friendly: this is the hot loop of the
// layer search.
void AverageRanks(absl::Span<const double> values, std::vector<std::pair<double, int>>& order,
                  std::vector<double>& ranks) {
  const int n = static_cast<int>(values.size());
  order.resize(n);
  ranks.resize(n);
  for (int i = 0; i < n; ++i) order[i] = {values[i], i};
  std::sort(order.begin(), order.end());
  for (int start = 0; start < n;) {
    int end = start + 1;
    while (end < n && order[end].first == order[start].first) ++end;
    const double rank = 0.5 * (start + 1 + end);  // mean of positions start+1 .. end
    for (int i = start; i < end; ++i) ranks[order[i].second] = rank;
    start = end;
  }
}

// Centres `ranks` in place and returns its norm (0 for a constant vector).
double CentreAndNorm(std::vector<double>& ranks) {
  if (ranks.empty()) return 0;
  const double mean = std::accumulate(ranks.begin(), ranks.end(), 0.0) / ranks.size();
  double sum = 0;
  for (double& r : ranks) {
    r -= mean;
    sum += r * r;
  }
  return std::sqrt(sum);
}

// Spearman correlation of `values` against pre-centred reference ranks with norm `reference_norm`.
double CorrelationWithReference(absl::Span<const double> values, const std::vector<double>& reference,
                                double reference_norm, std::vector<std::pair<double, int>>& order,
                                std::vector<double>& ranks) {
  AverageRanks(values, order, ranks);
  const double norm = CentreAndNorm(ranks);
  if (norm == 0 || reference_norm == 0) return 0;
  double dot = 0;
  for (size_t i = 0; i < ranks.size(); ++i) dot += ranks[i] * reference[i];
  return dot / (norm * reference_norm);
}

// Checks SearchLayerMask's arguments: geometry, counts of every request (gate sums for gate_prob),
// at least 3 requests, one IDF weight per cell for count_idf (none otherwise), max_pairs >= 2.
absl::Status ValidateSearchInputs(const CalibrationData& data, absl::Span<const float> idf,
                                  const LayerMaskSearchOptions& options) {
  const int max_pairs = options.max_pairs;
  const int n = data.n, layers = data.layers, experts = data.experts;
  const size_t per_request = static_cast<size_t>(layers) * experts;
  if (layers < 1 || experts < 1) {
    return absl::InvalidArgumentError(absl::StrCat("layer mask: bad geometry L=", layers, " E=", experts));
  }
  if (data.decode_counts.size() != per_request * n || data.prefill_counts.size() != per_request * n) {
    return absl::InvalidArgumentError(
        "layer mask: needs prefill and decode counts of every request (decode counts are missing)");
  }
  if (n < 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer mask: ", n, " requests; need at least 3 to rank request pairs"));
  }
  if (options.variant == SignatureVariant::kCountIdf && idf.size() != per_request) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer mask: ", idf.size(), " IDF weights, expected layers * experts = ", per_request));
  }
  if (options.variant != SignatureVariant::kCountIdf && !idf.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("layer mask: IDF weights given for variant ",
                                                   SignatureVariantName(options.variant), ", which has none"));
  }
  if (options.variant == SignatureVariant::kGateProb && data.gate_prob_sums.size() != per_request * n) {
    return absl::InvalidArgumentError("layer mask: variant gate_prob needs the gate-probability sums of every request");
  }
  if (max_pairs < 2) {
    return absl::InvalidArgumentError(absl::StrCat("layer mask: max_pairs = ", max_pairs, ", need >= 2"));
  }
  return absl::OkStatus();
}

// The request pairs to rank: every pair (a < b) when there are at most `max_pairs`, else
// `max_pairs` seeded random pairs of distinct requests.
std::vector<std::pair<int, int>> SampleRequestPairs(int n, int max_pairs, uint64_t seed) {
  std::vector<std::pair<int, int>> pairs;
  const int64_t all_pairs = static_cast<int64_t>(n) * (n - 1) / 2;
  if (all_pairs <= max_pairs) {
    pairs.reserve(all_pairs);
    for (int a = 0; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) pairs.emplace_back(a, b);
    }
  } else {
    std::mt19937_64 rng(seed ^ 0x6c61796572ULL);  // "layer": independent of the k-means stream
    pairs.reserve(max_pairs);
    for (int p = 0; p < max_pairs; ++p) {
      const int a = std::min(static_cast<int>(UniformUnit(rng) * n), n - 1);
      int b = std::min(static_cast<int>(UniformUnit(rng) * (n - 1)), n - 2);
      if (b >= a) ++b;
      pairs.emplace_back(a, b);
    }
  }
  return pairs;
}

// Per-layer pieces of the prefill signatures (before normalisation: IDF-weighted counts for
// count_idf, counts for count, gate sums for gate_prob): the cosine distance of a pair over any
// set of layers follows from sums of them.
struct LayerPieces {
  std::vector<double> norm;  // [request][layer]: squared norm of the request's layer
  std::vector<double> dot;   // [pair][layer]: dot product of the pair's layers
};

// Computes the squared norms of every request's layers and the dot products of every pair's, from
// `values` ([request][layer][expert]) weighted per cell by idf_squared.
template <typename Value>
LayerPieces ComputeLayerPieces(const Value* values, const CalibrationData& data, const std::vector<double>& idf_squared,
                               const std::vector<std::pair<int, int>>& pairs) {
  const int n = data.n, layers = data.layers, experts = data.experts;
  const size_t per_request = static_cast<size_t>(layers) * experts;
  const int num_pairs = static_cast<int>(pairs.size());
  LayerPieces pieces;
  pieces.norm.assign(static_cast<size_t>(n) * layers, 0.0);
  for (int r = 0; r < n; ++r) {
    const Value* counts = values + r * per_request;
    for (int l = 0; l < layers; ++l) {
      double sum = 0;
      for (int e = 0; e < experts; ++e) {
        const size_t at = static_cast<size_t>(l) * experts + e;
        sum += static_cast<double>(counts[at]) * counts[at] * idf_squared[at];
      }
      pieces.norm[static_cast<size_t>(r) * layers + l] = sum;
    }
  }
  pieces.dot.resize(static_cast<size_t>(num_pairs) * layers);
  for (int p = 0; p < num_pairs; ++p) {
    const Value* pa = values + pairs[p].first * per_request;
    const Value* pb = values + pairs[p].second * per_request;
    for (int l = 0; l < layers; ++l) {
      double sum = 0;
      for (int e = 0; e < experts; ++e) {
        const size_t at = static_cast<size_t>(l) * experts + e;
        sum += static_cast<double>(pa[at]) * pb[at] * idf_squared[at];
      }
      pieces.dot[static_cast<size_t>(p) * layers + l] = sum;
    }
  }
  return pieces;
}

// The pieces of the variant's prefill signatures.
LayerPieces ComputeVariantPieces(const CalibrationData& data, absl::Span<const float> idf, SignatureVariant variant,
                                 const std::vector<std::pair<int, int>>& pairs) {
  const size_t per_request = static_cast<size_t>(data.layers) * data.experts;
  std::vector<double> idf_squared(per_request, 1.0);
  if (variant == SignatureVariant::kCountIdf) {
    for (size_t i = 0; i < per_request; ++i) idf_squared[i] = static_cast<double>(idf[i]) * idf[i];
  }
  if (variant == SignatureVariant::kGateProb) {
    return ComputeLayerPieces(data.gate_prob_sums.data(), data, idf_squared, pairs);
  }
  return ComputeLayerPieces(data.prefill_counts.data(), data, idf_squared, pairs);
}

// Cosine distance of every pair's decode usage over all layers (1 when either is all zero).
std::vector<double> DecodeDistances(const CalibrationData& data, const std::vector<std::pair<int, int>>& pairs) {
  const size_t per_request = static_cast<size_t>(data.layers) * data.experts;
  const int num_pairs = static_cast<int>(pairs.size());
  std::vector<double> decode_distance(num_pairs);
  for (int p = 0; p < num_pairs; ++p) {
    const int32_t* da = data.decode_counts.data() + pairs[p].first * per_request;
    const int32_t* db = data.decode_counts.data() + pairs[p].second * per_request;
    double dot = 0, na = 0, nb = 0;
    for (size_t i = 0; i < per_request; ++i) {
      dot += static_cast<double>(da[i]) * db[i];
      na += static_cast<double>(da[i]) * da[i];
      nb += static_cast<double>(db[i]) * db[i];
    }
    decode_distance[p] = (na > 0 && nb > 0) ? 1.0 - dot / std::sqrt(na * nb) : 1.0;
  }
  return decode_distance;
}

// Spearman correlation of signature distances over a set of layers (the chosen ones, plus one
// candidate) with the decode distances, whose centred ranks are `reference`.
class LayerSetScorer {
 public:
  LayerSetScorer(const std::vector<std::pair<int, int>>& pairs, const LayerPieces& pieces, int layers,
                 const std::vector<double>& reference, double reference_norm)
      : pairs_(pairs),
        pieces_(pieces),
        layers_(layers),
        num_pairs_(static_cast<int>(pairs.size())),
        reference_(reference),
        reference_norm_(reference_norm),
        threads_(std::max(1, std::min<int>(layers, std::min(4u, std::thread::hardware_concurrency())))),
        chosen_dot_(num_pairs_, 0.0),
        chosen_norm_a_(num_pairs_, 0.0),
        chosen_norm_b_(num_pairs_, 0.0) {}

  // Adds `layer` to the chosen layers.
  void AddLayer(int layer) {
    for (int p = 0; p < num_pairs_; ++p) {
      chosen_dot_[p] += pieces_.dot[static_cast<size_t>(p) * layers_ + layer];
      chosen_norm_a_[p] += pieces_.norm[static_cast<size_t>(pairs_[p].first) * layers_ + layer];
      chosen_norm_b_[p] += pieces_.norm[static_cast<size_t>(pairs_[p].second) * layers_ + layer];
    }
  }

  // correlation[c]: the correlation with candidates[c] added to the chosen layers. Candidates are
  // independent: scored on a few threads.
  void ScoreCandidates(const std::vector<int>& candidates, std::vector<double>& correlation) const {
    correlation.assign(candidates.size(), 0.0);
    auto work = [&](int first) {
      std::vector<double> distance, thread_ranks;
      std::vector<std::pair<double, int>> thread_order;
      for (size_t c = first; c < candidates.size(); c += threads_) {
        SignatureDistances(candidates[c], distance);
        correlation[c] = CorrelationWithReference(distance, reference_, reference_norm_, thread_order, thread_ranks);
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads_; ++t) pool.emplace_back(work, t);
    work(0);
    for (std::thread& thread : pool) thread.join();
  }

  // The correlation with every layer (for comparison in the report); chooses every layer.
  double AllLayersCorrelation() {
    std::fill(chosen_dot_.begin(), chosen_dot_.end(), 0.0);
    std::fill(chosen_norm_a_.begin(), chosen_norm_a_.end(), 0.0);
    std::fill(chosen_norm_b_.begin(), chosen_norm_b_.end(), 0.0);
    for (int l = 0; l < layers_; ++l) AddLayer(l);
    std::vector<double> distance, ranks;
    std::vector<std::pair<double, int>> order;
    SignatureDistances(-1, distance);
    return CorrelationWithReference(distance, reference_, reference_norm_, order, ranks);
  }

 private:
  // Signature distances of every pair with `layer` added to the chosen ones (layer < 0: none).
  void SignatureDistances(int layer, std::vector<double>& distance) const {
    distance.resize(num_pairs_);
    for (int p = 0; p < num_pairs_; ++p) {
      double dot = chosen_dot_[p], na = chosen_norm_a_[p], nb = chosen_norm_b_[p];
      if (layer >= 0) {
        dot += pieces_.dot[static_cast<size_t>(p) * layers_ + layer];
        na += pieces_.norm[static_cast<size_t>(pairs_[p].first) * layers_ + layer];
        nb += pieces_.norm[static_cast<size_t>(pairs_[p].second) * layers_ + layer];
      }
      distance[p] = (na > 0 && nb > 0) ? 1.0 - dot / std::sqrt(na * nb) : 1.0;
    }
  }

  const std::vector<std::pair<int, int>>& pairs_;
  const LayerPieces& pieces_;
  const int layers_;
  const int num_pairs_;
  const std::vector<double>& reference_;
  const double reference_norm_;
  const int threads_;
  // Accumulated dot / norms of the layers chosen so far; a candidate adds its own layer on top.
  std::vector<double> chosen_dot_, chosen_norm_a_, chosen_norm_b_;
};

// Greedy forward selection: at each step adds the layer that most raises the correlation (the
// lowest layer among equal ones). kGlobalMaximum runs all L steps and keeps the prefix up to the
// curve's maximum (the earliest step among equal maxima); kFirstDecrease stops at the first step
// that does not raise the correlation and keeps what came before. Fills result->steps (the whole
// curve walked), peak_step, layer_mask (ascending) and correlation.
void SelectLayersGreedily(LayerSetScorer& scorer, int layers, LayerMaskRule rule, LayerMaskSearchResult* result) {
  std::vector<char> chosen(layers, 0);
  double best_so_far = -std::numeric_limits<double>::infinity();
  int peak = -1;
  std::vector<int> candidates;
  std::vector<double> correlation;
  for (int step = 0; step < layers; ++step) {
    candidates.clear();
    for (int l = 0; l < layers; ++l) {
      if (!chosen[l]) candidates.push_back(l);
    }
    scorer.ScoreCandidates(candidates, correlation);
    int best = -1;
    for (size_t c = 0; c < candidates.size(); ++c) {
      if (best < 0 || correlation[c] > correlation[best]) best = static_cast<int>(c);
    }
    const bool raises = correlation[best] > best_so_far + 1e-12;
    if (rule == LayerMaskRule::kFirstDecrease && !raises) break;
    chosen[candidates[best]] = 1;
    scorer.AddLayer(candidates[best]);
    result->steps.push_back(LayerMaskStep{candidates[best], correlation[best]});
    if (raises) {
      best_so_far = correlation[best];
      peak = step;
    }
  }
  result->peak_step = peak;
  for (int s = 0; s <= peak; ++s) result->layer_mask.push_back(result->steps[s].layer);
  std::sort(result->layer_mask.begin(), result->layer_mask.end());
  result->correlation = peak < 0 ? 0 : result->steps[peak].correlation;
}

}  // namespace

double SpearmanCorrelation(absl::Span<const double> x, absl::Span<const double> y) {
  if (x.size() != y.size() || x.size() < 2) return 0;
  std::vector<std::pair<double, int>> order;
  std::vector<double> reference, ranks;
  AverageRanks(y, order, reference);
  const double reference_norm = CentreAndNorm(reference);
  return CorrelationWithReference(x, reference, reference_norm, order, ranks);
}

const char* LayerMaskRuleName(LayerMaskRule rule) {
  return rule == LayerMaskRule::kFirstDecrease ? "first_decrease" : "global_maximum";
}

absl::StatusOr<LayerMaskRule> ParseLayerMaskRule(absl::string_view name) {
  if (name == "global_maximum") return LayerMaskRule::kGlobalMaximum;
  if (name == "first_decrease") return LayerMaskRule::kFirstDecrease;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown layer-mask rule '", name, "' (expected global_maximum or first_decrease)"));
}

absl::StatusOr<LayerMaskSearchResult> SearchLayerMask(const CalibrationData& data, absl::Span<const float> idf,
                                                      int max_pairs, uint64_t seed) {
  LayerMaskSearchOptions options;
  options.max_pairs = max_pairs;
  options.seed = seed;
  return SearchLayerMask(data, idf, options);
}

absl::StatusOr<LayerMaskSearchResult> SearchLayerMask(const CalibrationData& data, absl::Span<const float> idf,
                                                      const LayerMaskSearchOptions& options) {
  if (absl::Status s = ValidateSearchInputs(data, idf, options); !s.ok()) return s;
  const std::vector<std::pair<int, int>> pairs = SampleRequestPairs(data.n, options.max_pairs, options.seed);
  const LayerPieces pieces = ComputeVariantPieces(data, idf, options.variant, pairs);

  std::vector<std::pair<double, int>> order;
  std::vector<double> reference;
  AverageRanks(DecodeDistances(data, pairs), order, reference);
  const double reference_norm = CentreAndNorm(reference);

  LayerSetScorer scorer(pairs, pieces, data.layers, reference, reference_norm);
  LayerMaskSearchResult result;
  result.pairs = static_cast<int>(pairs.size());
  result.rule = options.rule;
  SelectLayersGreedily(scorer, data.layers, options.rule, &result);
  result.all_layers_correlation = scorer.AllLayersCorrelation();
  return result;
}

}  // namespace eldr
