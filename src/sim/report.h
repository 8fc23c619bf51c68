// eldr-sim's outputs: the comparison table, one JSON object, CSV rows, and the data file the
// plotting script (scripts/plot_sim.py) reads.
#ifndef ELDR_SIM_REPORT_H_
#define ELDR_SIM_REPORT_H_

#include <string>

#include "nlohmann/json.hpp"
#include "sim/experiment.h"

namespace eldr::sim {

// Human-readable table: one block per rate, one row per policy, and for each eldr variant its
// median and P99 TPOT relative to the best load balancer (rr, random, jsq, p2c) at that rate (the
// oracle gets one too; it is not a load balancer). With a drift scenario, each rate's block has the
// whole run, then each phase, each against the best load balancer of the same span. With
// router replicas, each rate's block has one labelled group of rows per router setup, and the best
// load balancer is the best of that setup's (the load balancers split over the same replicas).
std::string FormatTable(const ExperimentResult& result);

// One JSON object: "workload", "locality", "capacity", "calibration", "router", "rates",
// "router_setups", "replica_options", and "results", a list with one object per (rate, setup,
// policy) holding "rate_rps", "policy", "oracle", "replicas", "shared_state", "label" (CellLabel)
// and the keys tpot_p50_ms, tpot_p90_ms, tpot_p99_ms, ttft_p50_ms, ttft_p99_ms,
// distinct_experts_per_layer, load_imbalance (plus a few more figures). With a drift scenario,
// "drift" describes it (scenario, change_arrival, phases, phase_domain_shares, phase_rate_scale,
// excluded_domain, add_worker, drain_worker, domains) and every result carries "phases": per phase
// its label ("phase"), first_arrival, end_arrival, start_s, end_s and the same figures. With
// `with_samples`, each result also carries "tpot_ms_samples" (every measured request), which the
// figure needs.
nlohmann::json ToJson(const ExperimentResult& result, bool with_samples);

// A header line and one line per (rate, setup, policy), same figures as the JSON results. With a
// drift scenario, a last column "phase" and, after each whole-run line ("all"), one line per phase.
std::string FormatCsv(const ExperimentResult& result);

}  // namespace eldr::sim

#endif  // ELDR_SIM_REPORT_H_
