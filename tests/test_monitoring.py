"""k8s/monitoring: alert rules unit-tested with promtool; the dashboard only uses metrics we export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request

import pytest
import yaml
from conftest import REPO, clean_env, free_port, tiny
from helpers import kill_group, start_cli, wait_for_log

MON = REPO / "k8s" / "monitoring"
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian's prometheus)")


@pytest.fixture
def rules_dir(tmp_path):
    rule = yaml.safe_load((MON / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    shutil.copy(MON / "rules.test.yaml", tmp_path / "rules.test.yaml")
    return tmp_path


@pytest.mark.slow
@needs_promtool
def test_alert_rules_are_valid(rules_dir):
    r = subprocess.run(["promtool", "check", "rules", "rules.yaml"], cwd=rules_dir, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 rules found" in r.stdout


@pytest.mark.slow
@needs_promtool
def test_each_alert_fires_and_stays_quiet_in_promtool_unit_tests(rules_dir):
    tests = yaml.safe_load((rules_dir / "rules.test.yaml").read_text())["tests"]
    alerts = {"GentrainNoStepProgress", "GentrainCheckpointStale", "GentrainCrashLooping", "GentrainLossNaN"}
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests for t in case["alert_rule_test"] if not t["exp_alerts"]}
    assert fired == alerts and quiet == alerts
    r = subprocess.run(["promtool", "test", "rules", "rules.test.yaml"], cwd=rules_dir, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@pytest.fixture(scope="module")
def exported_names(tmp_path_factory) -> set[str]:
    """Metric family names from a scrape of a real (short) training run."""
    tmp = tmp_path_factory.mktemp("scrape")
    port = free_port()
    args = tiny(tmp, f"metrics.port={port}", "metrics.host=127.0.0.1", "metrics.linger_seconds=30", max_steps=3)
    log = tmp / "train.log"
    proc = start_cli("train", *args, env=clean_env(), log_path=log)
    try:
        wait_for_log(log, "sample grid", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        kill_group(proc)
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


@pytest.mark.slow
def test_dashboard_uses_only_exported_metrics(exported_names):
    dash = json.loads((MON / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bgentrain_[a-z_]+", e)}
    assert used
    suffixes = ("_bucket", "_sum", "_count", "_total", "_created")
    for name in used:
        base = next((name[: -len(s)] for s in suffixes if name.endswith(s) and name[: -len(s)] in exported_names), name)
        assert base in exported_names or name in exported_names, f"dashboard uses {name}, not exported"
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for needed in ("loss", "learning rate", "samples / s", "p50", "p95", "checkpoint age", "restarts", "world size"):
        assert needed in titles


@pytest.mark.slow
def test_alert_rules_use_only_exported_metrics(exported_names):
    rule = yaml.safe_load((MON / "prometheusrule.yaml").read_text())
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    for name in {m for e in exprs for m in re.findall(r"\bgentrain_[a-z_]+", e)}:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert base in exported_names or name in exported_names, name


def test_podmonitor_scrapes_the_named_metrics_port():
    pm = yaml.safe_load((MON / "podmonitor.yaml").read_text())
    assert pm["kind"] == "PodMonitor"
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "gentrain"}
