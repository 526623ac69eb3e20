"""The chart's default job store for video pipelines (pipelinePods.jobs): rendered into the operator's
environment, read by it, and given to a video pipeline's orchestrator; values the operator would refuse are
refused at render time."""

from __future__ import annotations

import pytest

from omnistage.contract import launch
from omnistage_operator.builders import JOBS_CONTENT, build_orchestrator_deployment
from omnistage_operator.config import from_env
from omnistage_operator.pipeline_object import parse

from .test_operator_chart import CHART, helm, needs_helm, render
from .test_operator_jobs import video_doc


def operator_env(*sets: str) -> dict[str, str]:
    objs = render(*sets)
    (c,) = objs[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in c["env"]}


@needs_helm
def test_by_default_no_job_store_is_given():
    env = operator_env()
    cfg = from_env({**env, "POD_ID": "omnistage-0"})
    assert cfg.jobs_store_secret is None and cfg.jobs_content_claim == ""


@needs_helm
def test_an_existing_database_and_claim_reach_a_video_pipelines_orchestrator():
    env = operator_env("pipelinePods.jobs.store.existingSecret=video-db",
                       "pipelinePods.jobs.store.existingSecretKey=dsn",
                       "pipelinePods.jobs.content.persistentVolumeClaim=video-content")
    cfg = from_env({**env, "POD_ID": "omnistage-0"})
    assert (cfg.jobs_store_secret, cfg.jobs_content_claim) == (("video-db", "dsn"), "video-content")
    pod = build_orchestrator_deployment(parse(video_doc()), cfg)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    url = next(e for e in c["env"] if e["name"] == launch.ENV_JOBS_STORE)
    assert url["valueFrom"] == {"secretKeyRef": {"name": "video-db", "key": "dsn"}}
    assert {"name": "jobs", "persistentVolumeClaim": {"claimName": "video-content"}} in pod["volumes"]
    assert c["command"][c["command"].index("--jobs-content") + 1] == JOBS_CONTENT


@needs_helm
@pytest.mark.parametrize("sets, says", [
    (["pipelinePods.jobs.content.persistentVolumeClaim=clips"], "set pipelinePods.jobs.store.existingSecret too"),
    (["pipelinePods.jobs.store.existingSecret=Not_A_Name"], "existingSecret"),
    # each orchestrator pod's own folder would answer 404 for another's videos and lose them on a rollout
    (["pipelinePods.jobs.store.existingSecret=video-db"], "set pipelinePods.jobs.content.persistentVolumeClaim too"),
])
def test_values_the_operator_would_refuse_fail_the_render(sets, says):
    args = ["template", "x", str(CHART)]
    for s in sets:
        args += ["--set", s]
    r = helm(*args)
    assert r.returncode != 0 and says in r.stderr, r.stderr
