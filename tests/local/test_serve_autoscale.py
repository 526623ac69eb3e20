"""`omnistage serve` of a file with autoscaling enabled: under load the planner adds a replica that serves,
and once the load is gone it drains it; no request fails on the way. Real processes, a real tiny LM
(transformers)."""

from __future__ import annotations

import re
import threading
import urllib.request

import pytest
import yaml

from omnistage.client import OmniClient
from omnistage.contract.launch import METRICS_PATH, http_url, read_ready
from omnistage.planner.scrape import UNITS

from ..conftest import EXAMPLES
from ..polling import wait_until_sync
from .test_cli_serve import Served

CLIENTS = 4  # requests kept in flight against a stage that serves one at a time


def autoscaled_llm(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())
    doc["metadata"]["name"] = "llm-auto"
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    dep = doc["spec"]["deployment"]
    dep["stages"]["llm"] = {"replicas": 1, "scheduler": {"maxBatch": 1, "maxQueued": 64}}
    dep["autoscaling"] = {"enabled": True, "intervalSeconds": 0.5, "targets": {"utilization": 0.8},
                          "stages": {"llm": {"minReplicas": 1, "maxReplicas": 2, "scaleDownDelaySeconds": 2}}}
    path = tmp_path / "llm-auto.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def units_served(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{UNITS}_total{{[^}}]*}} (\S+)$", text, re.M))


def test_a_replica_is_added_under_load_serves_and_is_drained_after(model_dir, tmp_path):
    # no --autoscale: the file's `enabled: true` is enough, as it is for the operator
    served = Served(autoscaled_llm(tmp_path), model_dir, tmp_path, "--no-api", "--no-tls")
    stop, failures, done = threading.Event(), [], []

    def client():
        with OmniClient(served.endpoint) as c:
            while not stop.is_set():
                try:
                    r = c.generate("count to ten", max_tokens=48, ignore_eos=True, timeout=120)
                    done.append(len(r.token_ids))
                except Exception as e:  # noqa: BLE001 - any failure is what the test reports
                    failures.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        served.wait_for(r"(planner: llm 1 -> 2 replicas)", 60)
        added = served.wait_for(r"(stage llm\[\+1\]): ready on .* in service", 120)
        # the new replica takes requests: its engine produces tokens
        ports = read_ready(tmp_path / "logs-llm-auto" / "llm-added1.ready")
        metrics = http_url("127.0.0.1", ports.http, METRICS_PATH)
        wait_until_sync(lambda: units_served(metrics) > 0, 60, 0.5, what=f"{added} serving tokens")
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    served.wait_for(r"(planner: llm 2 -> 1 replicas)", 60)
    served.wait_for(r"(stage llm\[\+1\]: drained, exited with code 0)", 60)
    assert failures == []
    assert done and set(done) == {48}
    # the orchestrator's request-class counters reached the planner: a text request takes its 48 tokens at the LM
    planner = urllib.request.urlopen(served.wait_for(r"decisions at (http://\S+)", 5), timeout=5).read().decode()
    demand = re.search(r'^omnistage_planner_class_demand\{class="text->text",pipeline="llm-auto",stage="llm"\} (\S+)$',
                       planner, re.M)
    assert demand and float(demand.group(1)) == pytest.approx(48.0), planner
    assert served.stop() == 0


def test_a_missed_first_packet_target_adds_a_replica_utilisation_alone_would_not(model_dir, tmp_path):
    # one client at a time: the stage is busy but never queues, and planned at full utilisation it needs one
    # replica; a first-packet target no request can meet (1 ms) makes the planner give it a second
    path = autoscaled_llm(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["deployment"]["autoscaling"]["targets"] = {"utilization": 1.0, "ttfpP95Ms": 1}
    path.write_text(yaml.safe_dump(doc))
    served = Served(path, model_dir, tmp_path, "--no-api", "--no-tls")
    stop, failures = threading.Event(), []

    def client():
        with OmniClient(served.endpoint) as c:
            while not stop.is_set():
                try:
                    c.generate("count to ten", max_tokens=16, ignore_eos=True, timeout=120)
                except Exception as e:  # noqa: BLE001 - any failure is what the test reports
                    failures.append(repr(e))

    t = threading.Thread(target=client)
    try:
        t.start()
        line = served.wait_for(r"(planner: llm 1 -> 2 replicas .*)", 90)
        assert re.search(r"first packet p95 \d+ ms over the 1 ms target: llm planned at [\d.]+x its load", line), line
    finally:
        stop.set()
        t.join(180)
    assert failures == []
    assert served.stop() == 0
