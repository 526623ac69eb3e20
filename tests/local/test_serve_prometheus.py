"""The chart's alerting rules and Grafana dashboard (charts/omnistage/files/) against a real Prometheus (the
distribution's `prometheus` package, started here) scraping `omnistage serve`'s targets file under load:
every rule and every dashboard query returns data, `promtool check rules` passes, and the no-ready-replica
alert fires once a stage's only replica is gone."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from ..conftest import EXAMPLES, REPO
from ..polling import wait_until_sync
from .test_cli_serve import Served, generate

FILES = REPO / "charts" / "omnistage" / "files"
PIPELINE = "qwen3-omni-tiny"
REQUESTS = 3        # finished requests before the queries: every histogram and counter has samples
# Grafana's variables, as the dashboard's pipeline picker and Grafana would fill them
DASHBOARD_VARS = {"$pipeline": PIPELINE, "$__rate_interval": "1m", "${datasource}": ""}
# An alert's condition: what it compares, then a comparison with a constant (`> 1`, `< 14 * 86400`) or with
# another metric (`omnistage_planner_needed_replicas > omnistage_planner_desired_replicas`)
COMPARISON = re.compile(r"^(?P<inner>.*?)\s*(==|!=|>=|<=|>|<)\s*[-\d.e*+ ]+$", re.S)
SERIES_COMPARISON = re.compile(r"^(?P<inner>[a-z_:]+)\s*(==|!=|>=|<=|>|<)\s*(?P<other>[a-z_:]+)$")


def prometheus_binaries() -> tuple[str, str]:
    """`make test` (scripts/run_tests.sh) installs the distribution's `prometheus` package (it brings promtool)."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    assert all(found), "no prometheus/promtool on PATH: `make test` installs them (apt-get install prometheus)"
    return found  # type: ignore[return-value]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autoscaled_omni(tmp: Path) -> Path:
    """The omni example with its planner on (its metrics are what the planner's rule reads), each stage held
    at the one replica it has."""
    doc = yaml.safe_load((EXAMPLES / f"{PIPELINE}.yaml").read_text())
    stages = doc["spec"]["deployment"]["stages"]
    doc["spec"]["deployment"]["autoscaling"] = {
        "enabled": True, "intervalSeconds": 1, "stages": {s: {"minReplicas": 1, "maxReplicas": 1} for s in stages}}
    path = tmp / f"{PIPELINE}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class Prometheus:
    """/usr/bin/prometheus on a free loopback port, with its own storage under `tmp`."""

    def __init__(self, tmp: Path, targets_file: Path, planner: str, rules: Path):
        binary, _ = prometheus_binaries()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
                  "scrape_configs": [{"job_name": "omnistage", "file_sd_configs": [{"files": [str(targets_file)]}]},
                                     {"job_name": "omnistage-planner", "metrics_path": planner.path,
                                      "static_configs": [{"targets": [planner.netloc]}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tmp / "prometheus.log"
        self.proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={tmp / 'tsdb'}", "--web.listen-address=" + self.url[7:]],
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        wait_until_sync(self._ready, 60, 0.2, what="prometheus ready", detail=self.log.read_text)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            return urllib.request.urlopen(self.url + "/-/ready", timeout=5).status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load((FILES / "rules.yaml").read_text())
    return {r["alert"]: r["expr"].strip() for g in doc["groups"] for r in g["rules"]}


def dashboard_exprs() -> list[str]:
    dash = json.loads((FILES / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for name, value in DASHBOARD_VARS.items():
        exprs = [e.replace(name, value) for e in exprs]
    assert exprs and not any("$" in e for e in exprs), exprs
    return exprs


def rules_with_short_for(tmp: Path) -> Path:
    """The rules as shipped but for `for:` (0s): an alert fires at the first evaluation its condition holds."""
    doc = yaml.safe_load((FILES / "rules.yaml").read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r["for"] = "0s"
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def monitored(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    served = Served(autoscaled_omni(tmp), model_dir, tmp, "--no-api")
    prom = None
    try:
        targets = Path(served.wait_for(r"Prometheus targets \(file_sd_configs\): (\S+)", 30))
        planner = urllib.parse.urlparse(served.wait_for(r"decisions at (http://\S+)", 30))
        prom = Prometheus(tmp, targets, planner, rules_with_short_for(tmp))
        for i in range(REQUESTS):
            r = generate(served.endpoint, "--prompt", "Hello there", "--max-tokens", "8", "--max-codec-frames", "30",
                         "--out", str(tmp / f"{i}.wav"))
            assert r.returncode == 0, r.stderr
        yield served, prom
    finally:
        if prom is not None:
            prom.stop()
        if served.proc.poll() is None:
            served.stop()


def returns_data(prom: Prometheus, expr: str) -> bool:
    return bool(prom.query(expr))


def test_promtool_checks_the_rules():
    _, promtool = prometheus_binaries()
    r = subprocess.run([promtool, "check", "rules", str(FILES / "rules.yaml")], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_rule_and_dashboard_query_returns_data(monitored):
    """An empty answer is a misspelled metric or label. An alert whose condition is (rightly) false answers
    nothing, so for each rule what it compares (the expression before its comparison) must answer, and the
    whole expression must be one Prometheus evaluates (`query` asserts its status)."""
    served, prom = monitored
    wait_until_sync(lambda: prom.query(f'sum(omnistage_requests_ended_total{{outcome="finished"}}) >= {REQUESTS}'),
                    120, 0.5, what="the finished requests scraped")
    conditions = {name: COMPARISON.match(expr) or SERIES_COMPARISON.match(expr) for name, expr in rule_exprs().items()}
    assert all(conditions.values()), f"a rule without a comparison: {conditions}"
    for expr in rule_exprs().values():
        prom.query(expr)
    queries = {f"rule {name}": m["inner"] for name, m in conditions.items()}
    queries.update({f"rule {name} (right side)": m["other"] for name, m in conditions.items()
                    if "other" in m.groupdict()})
    queries.update({f"dashboard {e}": e for e in dashboard_exprs()})

    def empty() -> list[str]:
        return [name for name, e in queries.items() if not returns_data(prom, e)]

    # generous: the planner's gauges come with its next decision, the last requests' histograms with the next scrape
    wait_until_sync(lambda: not empty(), 120, 0.5, what="every query answering", detail=lambda: empty())


def test_no_ready_replica_alert_fires_when_a_stage_loses_its_only_replica(monitored):
    served, prom = monitored
    alert = "OmnistageStageNoReadyReplica"

    def firing() -> list[dict]:
        return [a for a in prom.api("alerts")["alerts"] if a["labels"]["alertname"] == alert]

    assert firing() == []   # every stage ready: nothing to say
    victim = served.processes["stage talker[0]"]
    stop = threading.Event()

    def keep_it_down():
        """serve restarts a dead replica (as a Deployment would): each restart is killed as it appears, so the
        stage stays without a ready replica until the alert is seen."""
        seen = {victim}
        while not stop.wait(0.1):
            for pid in map(int, re.findall(r"stage talker\[0\]: restarted \(pid (\d+)\)", served.output())):
                if pid not in seen and psutil.pid_exists(pid):
                    os.kill(pid, signal.SIGKILL)
                    seen.add(pid)

    killer = threading.Thread(target=keep_it_down, daemon=True)
    os.kill(victim, signal.SIGKILL)
    killer.start()
    try:
        alerts = wait_until_sync(lambda: [a for a in firing() if a["state"] == "firing"], 120, 0.5,
                                 what=f"{alert} firing", detail=lambda: prom.query("omnistage_stage_capacity"))
    finally:
        stop.set()
        killer.join()
    assert [(a["labels"]["stage"], a["labels"]["pipeline"]) for a in alerts] == [("talker", PIPELINE)]
