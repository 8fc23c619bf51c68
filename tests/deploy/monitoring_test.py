"""Static checks of deploy/monitoring: the alert rules parse and behave (promtool), the dashboard's
queries parse, and both cover what operators need on the daemon's real metric names.
(Whether every name appears in a live scrape is live_daemon_test.py's job.)"""

import os
import re
import shutil
import tempfile
import unittest

import yaml

import deploy_testlib as lib


def metrics_defined_in_source():
    """Metric family names the daemon's sources register (string literals "eldr_..." and "process_...")."""
    names = set()
    for folder in ("src/server", "src/core", "src/loadsignals", "src/calib", "src/refit", "src/metrics", "src/proxy"):
        root = os.path.join(lib.SOURCE_DIR, folder)
        if not os.path.isdir(root):
            continue
        for dirpath, _, files in os.walk(root):
            for name in files:
                if name.endswith((".cc", ".h")):
                    with open(os.path.join(dirpath, name), errors="replace") as f:
                        names.update(re.findall(r'"((?:eldr|process)_[a-z0-9_]+)"', f.read()))
    return names


# Kubernetes discovery's metrics (src/discovery, registered by eldr-router with role="decode" and by
# eldr-proxy with role="prefill"): the names the monitoring files may use besides those found in
# the folders above.
DISCOVERY_METRICS = {
    "eldr_discovery_workers",                 # gauge {role, state="ready|not_ready|terminating"}
    "eldr_discovery_watch_restarts_total",    # {role, reason="closed|gone|error|silence|parse"}
    "eldr_discovery_errors_total",            # {role, kind="unreachable|http|auth|parse|annotation|sink"}
    "eldr_discovery_last_sync_age_seconds",   # gauge {role}
    "eldr_discovery_pool_changes_total",      # {role, action="upsert|drain|remove"}
    "eldr_discovery_synced",                  # gauge {role}, 0/1
}


def exported_metrics():
    """Every metric family the daemons export, as far as the monitoring checks know."""
    return metrics_defined_in_source() | DISCOVERY_METRICS


# Online refit's metrics (refits by outcome, last fit duration) once the daemon exports them: the
# monitoring files must then use them (a refit panel, an alert on failures), and cannot before.
REFIT_METRIC = re.compile(r"eldr_refits?_[a-z0-9_]+")


# The cluster's metrics (src/server/cluster_component.h, routers run with --cluster_redis) that the
# alerts and the dashboard's row "Replicas (cluster)" must show.
CLUSTER_METRICS = {
    "eldr_cluster_role",                   # gauge {role="leader|follower"}
    "eldr_cluster_fencing_generation",     # gauge
    "eldr_cluster_centroid_generation",    # gauge {kind="published|installed"}
    "eldr_cluster_redis_errors_total",     # counter {kind}
    "eldr_cluster_redis_up",               # gauge 0/1
    "eldr_cluster_peers",                  # gauge
    "eldr_cluster_window_length",          # gauge
}
# Where alert runbooks live: docs/operations.md, and the cluster's in docs/deploy-cluster.md.
RUNBOOK_DOCS = ("docs/operations.md", "docs/deploy-cluster.md")


def markdown_anchors(path):
    with open(os.path.join(lib.SOURCE_DIR, path)) as f:
        text = f.read()
    return {re.sub(r"[^a-z0-9 -]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def refit_metrics_in_source():
    return sorted(m for m in metrics_defined_in_source() if REFIT_METRIC.fullmatch(m))


def base_metric(sample_name, defined):
    """The family a sample name belongs to (histogram samples carry _bucket, _sum or _count)."""
    if sample_name in defined:
        return sample_name
    for suffix in ("_bucket", "_sum", "_count"):
        if sample_name.endswith(suffix) and sample_name[:-len(suffix)] in defined:
            return sample_name[:-len(suffix)]
    return None


class AlertRulesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rules = lib.load_rules()
        cls.workdir = tempfile.mkdtemp(prefix="eldr-rules-")
        cls.rules_file = os.path.join(cls.workdir, "rules.yaml")
        with open(cls.rules_file, "w") as f:
            yaml.safe_dump(cls.rules["spec"], f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.workdir, ignore_errors=True)

    def alerts(self):
        return {rule["alert"]: rule for group in self.rules["spec"]["groups"]
                for rule in group["rules"] if "alert" in rule}

    def test_prometheus_rule_object(self):
        self.assertEqual(self.rules["apiVersion"], "monitoring.coreos.com/v1")
        self.assertEqual(self.rules["kind"], "PrometheusRule")

    def test_promtool_check_rules(self):
        result = lib.run([lib.PROMTOOL, "check", "rules", self.rules_file])
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn(f"SUCCESS: {len(self.alerts())} rules found", result.stdout)

    def test_promtool_unit_tests(self):
        shutil.copy(os.path.join(os.path.dirname(__file__), "alerts_test.yaml"), self.workdir)
        result = lib.run([lib.PROMTOOL, "test", "rules", "alerts_test.yaml"], cwd=self.workdir)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_every_alert_has_a_unit_test(self):
        with open(os.path.join(os.path.dirname(__file__), "alerts_test.yaml")) as f:
            tests = yaml.safe_load(f)["tests"]
        firing = {case["alertname"] for test in tests for case in test["alert_rule_test"]
                  if case["exp_alerts"]}
        self.assertEqual(set(self.alerts()) - firing, set(),
                         "alerts never shown to fire in alerts_test.yaml")

    def test_required_alerts_exist(self):
        alerts = self.alerts()
        exprs = {name: rule["expr"] for name, rule in alerts.items()}

        def uses(fragment):
            return [name for name, expr in exprs.items() if fragment in expr]

        self.assertTrue(uses("eldr_fallback_total"), "no alert on fallbacks")
        self.assertTrue(uses('outcome="invalid"'), "no alert on rejections")
        self.assertTrue(uses("eldr_worker_report_age_seconds"), "no alert on stale worker reports")
        self.assertTrue(uses("eldr_route_duration_seconds_bucket"), "no alert on decision latency")
        self.assertIn("EldrRouterNoRoutes", alerts)
        # Discovery: a pool frozen on its last known state, and errors that do not stop.
        self.assertIn("eldr_discovery_last_sync_age_seconds", exprs.get("EldrDiscoveryStale", ""))
        self.assertIn("eldr_discovery_errors_total", exprs.get("EldrDiscoveryErrors", ""))
        stale = alerts["EldrDiscoveryStale"]
        self.assertIn("> 300", stale["expr"], "stale past 5 minutes")
        self.assertEqual(stale.get("for"), "5m")
        for name in ("EldrDiscoveryStale", "EldrDiscoveryErrors"):
            self.assertRegex(exprs[name], r"by \([^)]*\brole\b", f"{name} keeps the role label")
            self.assertTrue(alerts[name].get("for"), f"{name} fires on a sustained condition only")
        # Cluster: replicas on different generations for over a minute (grouped per pool, that
        # is per namespace and job: the series carry no cluster name), Redis unreachable, no
        # leader while Redis answers.
        generations = alerts["EldrReplicasOnDifferentGenerations"]
        self.assertIn('eldr_cluster_centroid_generation{kind="installed"}', generations["expr"])
        self.assertRegex(generations["expr"], r"max by \(namespace, job\)")
        self.assertRegex(generations["expr"], r"min by \(namespace, job\)")
        self.assertEqual(generations.get("for"), "1m")
        redis_down = alerts["EldrClusterRedisDown"]
        self.assertIn("eldr_cluster_redis_up == 0", redis_down["expr"])
        self.assertRegex(redis_down.get("for", ""), r"^[2-9]m$|^1[0-5]m$", "some minutes")
        no_leader = alerts["EldrNoClusterLeader"]
        self.assertIn('eldr_cluster_role{role="leader"}', no_leader["expr"])
        self.assertIn("eldr_cluster_redis_up", no_leader["expr"], "Redis down is EldrClusterRedisDown's")
        self.assertEqual(no_leader.get("for"), "1m")
        for name in ("EldrReplicasOnDifferentGenerations", "EldrClusterRedisDown", "EldrNoClusterLeader"):
            self.assertNotRegex(alerts[name]["expr"], r"by \([^)]*\bpod\b",
                                f"{name}: one alert per pool, not per pod")
        refit_alerts = [name for name, expr in exprs.items() if REFIT_METRIC.search(expr)]
        if refit_metrics_in_source():
            self.assertTrue([name for name in refit_alerts if "fail" in exprs[name]],
                            "the daemon exports refit metrics: alert on refit failures")
        else:
            self.assertEqual(refit_alerts, [], "refit metrics are not exported yet")

    def test_alert_metadata(self):
        anchors = {doc: markdown_anchors(doc) for doc in RUNBOOK_DOCS}
        for name, rule in self.alerts().items():
            with self.subTest(alert=name):
                self.assertIn(rule["labels"].get("severity"), {"warning", "critical"})
                for key in ("summary", "description", "runbook"):
                    self.assertTrue(rule["annotations"].get(key), f"{name} lacks {key}")
                runbook = rule["annotations"]["runbook"]
                doc, _, anchor = runbook.partition("#")
                self.assertIn(doc, RUNBOOK_DOCS, runbook)
                cluster = any(m.startswith("eldr_cluster_") for m in lib.metric_names(rule["expr"]))
                self.assertEqual(doc == "docs/deploy-cluster.md", cluster,
                                 "the cluster's alerts are explained in docs/deploy-cluster.md")
                self.assertIn(anchor, anchors[doc], f"{name}: runbook anchor missing from {doc}")

    def test_metric_names_are_the_daemons(self):
        defined = exported_metrics()
        for name, expr in lib.rule_exprs(self.rules):
            for metric in lib.metric_names(expr) - lib.PROMETHEUS_SYNTHETIC:
                with self.subTest(alert=name, metric=metric):
                    self.assertIsNotNone(base_metric(metric, defined),
                                         f"{metric} is not a metric the daemons export")


class DiscoveryMetricsTest(unittest.TestCase):
    def test_names_match_the_discovery_sources(self):
        # The list above is the contract; while src/discovery exists, it must register them all.
        root = os.path.join(lib.SOURCE_DIR, "src", "discovery")
        if not os.path.isdir(root):
            self.skipTest("no src/discovery")
        text = ""
        for dirpath, _, files in os.walk(root):
            for name in files:
                if name.endswith((".cc", ".h")):
                    with open(os.path.join(dirpath, name), errors="replace") as f:
                        text += f.read()
        registered = set(re.findall(r'"(eldr_discovery_[a-z0-9_]+)"', text))
        self.assertEqual(registered, DISCOVERY_METRICS)


class DashboardTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dashboard = lib.load_dashboard()

    def test_structure(self):
        dashboard = self.dashboard
        self.assertEqual(dashboard["uid"], "eldr-router")
        ids = [panel["id"] for panel in lib.dashboard_panels(dashboard)]
        self.assertEqual(len(ids), len(set(ids)), "panel ids must be unique")
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        self.assertEqual(variables["datasource"]["type"], "datasource")
        self.assertEqual(variables["datasource"]["query"], "prometheus")
        for panel in lib.dashboard_panels(dashboard):
            if panel["type"] == "row":
                continue
            with self.subTest(panel=panel["title"]):
                self.assertEqual(panel["datasource"]["uid"], "${datasource}")
                self.assertTrue(panel.get("description"), "every panel explains itself")
                self.assertTrue(panel["targets"])
                for target in panel["targets"]:
                    self.assertEqual(target["datasource"]["uid"], "${datasource}")
                    for variable in ("$namespace", "$job", "$pod"):
                        self.assertIn(variable, target["expr"],
                                      "every query honours the namespace, job and pod selectors")

    def test_panels_do_not_overlap(self):
        cells = {}
        for panel in self.dashboard["panels"]:
            pos = panel["gridPos"]
            self.assertLessEqual(pos["x"] + pos["w"], 24, panel["title"])
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    self.assertNotIn((x, y), cells,
                                     f"{panel['title']} overlaps {cells.get((x, y))}")
                    cells[(x, y)] = panel["title"]

    def test_queries_parse(self):
        # promtool parses every query as a recording rule (Grafana variables replaced first).
        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:query_{i}", "expr": lib.grafana_to_promql(expr)}
            for i, (_, expr) in enumerate(lib.dashboard_exprs(self.dashboard))]}]}
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(rules, f)
        try:
            result = lib.run([lib.PROMTOOL, "check", "rules", f.name])
        finally:
            os.unlink(f.name)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_covers_what_operators_watch(self):
        used = set()
        for _, expr in lib.dashboard_exprs(self.dashboard):
            used |= lib.metric_names(expr)
        required = {
            "eldr_route_requests_total",                 # route rate by policy and outcome
            "eldr_route_duration_seconds_bucket",        # decision latency percentiles
            "eldr_band_size_bucket",                     # band size
            "eldr_route_similarity_bucket",              # similarity
            "eldr_worker_inflight",                      # per-worker in-flight
            "eldr_worker_reported_load",                 # per-worker reported load
            "eldr_worker_report_age_seconds",            # report age
            "eldr_fallback_total",                       # fallbacks by reason
            "eldr_rejected_total",                       # rejections by reason
            "eldr_centroid_generation",                  # centroid generation
        }
        self.assertEqual(required - used, set())
        refit_panels = [m for m in used if REFIT_METRIC.fullmatch(m)]
        if refit_metrics_in_source():
            self.assertTrue(refit_panels, "the daemon exports refit metrics: show them")
        else:
            self.assertEqual(refit_panels, [], "refit metrics are not exported yet")
        by_reason = [expr for _, expr in lib.dashboard_exprs(self.dashboard)
                     if "by (reason)" in expr]
        self.assertTrue(any("eldr_fallback_total" in e for e in by_reason))
        self.assertTrue(any("eldr_rejected_total" in e for e in by_reason))
        self.assertTrue(any("by (policy, outcome)" in e for _, e in lib.dashboard_exprs(self.dashboard)))

    def test_discovery_row(self):
        # The Discovery row: discovered workers by state (stacked), last sync age (stat with
        # thresholds), watch restarts by reason, errors by kind and pool changes by action (rates).
        panels = self.dashboard["panels"]
        (row,) = [i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Discovery"]
        section = []
        for panel in panels[row + 1:]:
            if panel["type"] == "row":
                break
            section.append(panel)

        def panel_using(metric, grouping=None):
            hits = [p for p in section for t in p["targets"]
                    if metric in lib.metric_names(t["expr"])
                    and (grouping is None or re.search(rf"by \([^)]*\b{grouping}\b", t["expr"]))]
            self.assertTrue(hits, f"no Discovery panel shows {metric}" +
                            (f" by {grouping}" if grouping else ""))
            return hits[0]

        workers = panel_using("eldr_discovery_workers", "state")
        self.assertEqual(workers["type"], "timeseries")
        self.assertEqual(workers["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"], "normal")
        age = panel_using("eldr_discovery_last_sync_age_seconds")
        self.assertEqual(age["type"], "stat")
        self.assertEqual(age["fieldConfig"]["defaults"]["unit"], "s")
        steps = age["fieldConfig"]["defaults"]["thresholds"]["steps"]
        self.assertGreaterEqual(len(steps), 2, "the sync age stat needs thresholds")
        self.assertIn(300, [step["value"] for step in steps],
                      "the stat turns red where EldrDiscoveryStale starts counting")
        for metric, grouping in (("eldr_discovery_watch_restarts_total", "reason"),
                                 ("eldr_discovery_errors_total", "kind"),
                                 ("eldr_discovery_pool_changes_total", "action")):
            panel = panel_using(metric, grouping)
            self.assertEqual(panel["type"], "timeseries")
            for target in panel["targets"]:
                if metric in target["expr"]:
                    self.assertIn(f"rate({metric}", target["expr"], "a counter is shown as a rate")
        for panel in section:
            for target in panel["targets"]:
                for metric in lib.metric_names(target["expr"]):
                    self.assertIn(metric, exported_metrics(), panel["title"])

    def test_cluster_row(self):
        # The row "Replicas (cluster)": role per replica, installed and published generation per
        # replica and their lag, the fencing generation, Redis up and errors by kind (a rate),
        # peers seen, the shared window's length.
        panels = self.dashboard["panels"]
        (row,) = [i for i, p in enumerate(panels)
                  if p["type"] == "row" and p["title"] == "Replicas (cluster)"]
        section = list(panels[row].get("panels", []))
        for panel in panels[row + 1:]:
            if panel["type"] == "row":
                break
            section.append(panel)
        exprs = [(p, t["expr"]) for p in section for t in p["targets"]]
        used = set()
        for _, expr in exprs:
            used |= lib.metric_names(expr)
        self.assertEqual(CLUSTER_METRICS - used, set(), "not shown on the cluster row")
        self.assertEqual(used - exported_metrics(), set())

        def panels_with(pattern):
            hits = [p for p, e in exprs if re.search(pattern, e)]
            self.assertTrue(hits, f"no cluster panel matches {pattern}")
            return hits
        panels_with(r'eldr_cluster_role\{[^}]*role="leader"')
        self.assertTrue([p for p in panels_with(r"eldr_cluster_role") if "by (pod)" in
                         " ".join(t["expr"] for t in p["targets"])], "role per replica")
        generation = panels_with(r"by \(pod, kind\) \(eldr_cluster_centroid_generation")
        self.assertTrue(generation, "installed and published generation per replica")
        lag = [e for _, e in exprs if 'kind="published"' in e and 'kind="installed"' in e and " - " in e]
        self.assertTrue(lag, "the lag: published - installed")
        self.assertTrue([e for _, e in exprs if "rate(eldr_cluster_redis_errors_total" in e
                         and re.search(r"by \([^)]*\bkind\b", e)], "Redis errors by kind, as a rate")
        for panel in section:
            self.assertIn(panel["type"], {"timeseries", "state-timeline", "stat"})
            for target in panel["targets"]:
                if "_total" in target["expr"]:
                    self.assertIn("rate(", target["expr"], f"{panel['title']}: counters as rates")

    def test_metric_names_are_the_daemons(self):
        defined = exported_metrics()
        for title, expr in lib.dashboard_exprs(self.dashboard):
            for metric in lib.metric_names(expr) - lib.PROMETHEUS_SYNTHETIC:
                with self.subTest(panel=title, metric=metric):
                    self.assertIsNotNone(base_metric(metric, defined),
                                         f"{metric} is not a metric the daemons export")

    def test_dashboard_config_map_matches_file(self):
        for overlay in ("standalone", "sidecar", "standalone-cluster"):
            objects = lib.render_overlay(overlay)
            config_map = lib.find_one(objects, "ConfigMap", "eldr-router-dashboard")
            self.assertEqual(config_map["metadata"]["labels"].get("grafana_dashboard"), "1")
            import json
            self.assertEqual(json.loads(config_map["data"]["eldr-router-dashboard.json"]),
                             self.dashboard)
            self.assertEqual(len(lib.find(objects, "PrometheusRule", "eldr-router")), 1)


class MetricNameParserTest(unittest.TestCase):
    """The PromQL name extraction the coverage checks rely on."""

    def test_extracts_only_metric_names(self):
        expr = ('histogram_quantile(0.99, sum by (namespace, job, le) (rate(eldr_route_duration_seconds_bucket'
                '{namespace=~"$namespace", outcome="ok"}[$__rate_interval]))) > 0.00025 and '
                'sum without (pod) (eldr_worker_inflight) / ignoring(reason) group_left() up')
        self.assertEqual(lib.metric_names(expr),
                         {"eldr_route_duration_seconds_bucket", "eldr_worker_inflight", "up"})


if __name__ == "__main__":
    unittest.main(verbosity=2)
