"""What `omnistage serve` hands its orchestrator for a video pipeline (LocalPipeline's jobs flags and
environment) opens a real job store in a real orchestrator process: the job API answers from it, the SQLite
file and content folder are where serve says, and /metrics carries the queued-jobs gauge the planner reads."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import urllib.request
from pathlib import Path

import yaml

from omnistage.api import parse_pipeline
from omnistage.contract import launch
from omnistage.local.serve import LocalPipeline
from omnistage.planner.jobs import JobsReading
from omnistage.planner.scrape import orchestrator_jobs, orchestrator_jobs_queued
from orchestrator_service.jobs.sql_store import TABLE

from ..conftest import REPO
from ..polling import wait_until_sync
from ..unit.test_operator_jobs import video_doc


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read()


def post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.status, r.read()


def test_serves_job_store_reaches_a_real_orchestrator(tmp_path):
    doc = video_doc()
    path = tmp_path / "video.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    local = LocalPipeline(path, parse_pipeline(doc), tmp_path / "models", log_dir=tmp_path / "logs",
                          work_dir=tmp_path / "work")
    assert local.jobs is not None
    ready_file, log = tmp_path / "orchestrator.ready", tmp_path / "orchestrator.log"
    # the flags and environment serve starts its orchestrator with; stages pointing nowhere (none is called)
    argv = launch.orchestrator_command(path, port=0, http_port=0, api_port=0, ready_file=ready_file,
                                       stage_endpoints={s.name: ["127.0.0.1:1"] for s in local.pipeline.stages},
                                       **local._jobs_flags())
    env = {**os.environ, **launch.service_env(), **local._jobs_env()}
    env.pop(launch.ENV_JOBS_CONTENT, None)   # as serve's own env() does: serve decides
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        def ready():
            assert proc.poll() is None, log.read_text()
            return launch.read_ready(ready_file)

        ports = wait_until_sync(ready, 60, 0.05, what="orchestrator ready", detail=log.read_text)
        _, metrics = get(launch.http_url("127.0.0.1", ports.http, launch.METRICS_PATH))
        assert orchestrator_jobs_queued(metrics.decode()) == 0.0
        # its job slots, which bound what the planner counts of the queued jobs
        assert orchestrator_jobs(metrics.decode()) == \
            JobsReading(0.0, local.pipeline.deployment.orchestrator.jobs.concurrency, 0.0)
        # The store is there: a job created is read back, and is a row in serve's file (without a store creating
        # answers 503 "no job store").
        videos = launch.http_url("127.0.0.1", ports.api, launch.API_PATH) + "/videos"
        status, body = post(videos, {"prompt": "a cat", "size": "48x32", "num_frames": 9})
        assert status == 200 and json.loads(body)["status"] == "queued", body
        video_id = json.loads(body)["id"]
        status, body = get(f"{videos}/{video_id}")
        assert status == 200 and json.loads(body)["id"] == video_id, body
        status, body = get(videos)
        assert [v["id"] for v in json.loads(body)["data"]] == [video_id], body
        db = Path(local.jobs.store.removeprefix("sqlite://"))
        assert db == (tmp_path / "work" / ".omnistage" / "jobs" / "jobs.db").resolve() and db.is_file()
        with contextlib.closing(sqlite3.connect(db)) as rows:  # the job is a row in serve's file
            assert rows.execute(f"SELECT id FROM {TABLE}").fetchall() == [(video_id,)]
        assert local.jobs.content.is_dir()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
