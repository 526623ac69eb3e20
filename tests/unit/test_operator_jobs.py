"""The orchestrator's durable jobs on a cluster: spec.deployment.orchestrator.jobs (and the chart's default job
store for video pipelines) become the orchestrator Deployment's flags, store URL env and content volume."""

from __future__ import annotations

import kopf
import pytest
import yaml

from omnistage.api import SpecError, parse_pipeline
from omnistage.contract import launch
from omnistage.store_url import redacted_url
from omnistage_operator.builders import JOBS_CONTENT, JOBS_CONTENT_EPHEMERAL, JOBS_MOUNT, build_children, jobs_errors
from omnistage_operator.compare import matches
from omnistage_operator.config import ConfigError, ModelVolume, OperatorConfig, from_env
from omnistage_operator.pipeline_object import parse
from omnistage_operator.vocabulary import ANNOTATION_CONFIG_HASH, R_INVALID_SPEC

from ..conftest import EXAMPLES

CFG = OperatorConfig(model_volume=ModelVolume("hostPath", "/srv/models", "/models"))
CHART_DEFAULT = OperatorConfig(model_volume=ModelVolume("hostPath", "/srv/models", "/models"),
                               jobs_store_secret=("video-db", "dsn"), jobs_content_claim="video-content")


def video_doc(jobs: dict | None = None, replicas: int | None = None) -> dict:
    """The tiny Wan text-to-video pipeline (encoder -> denoise -> VAE, video out) with `jobs` as its jobs entry."""
    doc = yaml.safe_load((EXAMPLES / "wan-t2v-tiny.yaml").read_text())
    doc["metadata"]["namespace"] = "team-v"
    orch = doc["spec"]["deployment"]["orchestrator"]
    if jobs is not None:
        orch["jobs"] = jobs
    if replicas is not None:
        orch["replicas"] = replicas
    return doc


def orchestrator(doc: dict, cfg: OperatorConfig = CFG) -> dict:
    """The orchestrator pod template's spec."""
    return build_children(parse(doc), cfg).orchestrator_deployment["spec"]["template"]["spec"]


def args(pod: dict) -> dict[str, str]:
    """The orchestrator's --jobs-* flags, by flag."""
    cmd = pod["containers"][0]["command"]
    return {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--jobs-")}


def env(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["containers"][0]["env"]}


def test_store_from_a_secret_and_content_on_the_claim_reach_the_orchestrator():
    pod = orchestrator(video_doc({"store": {"secretRef": {"name": "pg", "key": "dsn"}}, "contentVolume": "clips",
                                  "ttlSeconds": 3600, "concurrency": 3, "maxQueuedPerKey": 5}, replicas=2))
    assert args(pod) == {"--jobs-content": JOBS_CONTENT, "--jobs-ttl-s": "3600", "--jobs-concurrency": "3",
                         "--jobs-max-queued-per-key": "5"}
    # the URL (it holds a password) by the kubelet from the Secret, never on the command line
    assert env(pod)[launch.ENV_JOBS_STORE] == {"name": launch.ENV_JOBS_STORE,
                                               "valueFrom": {"secretKeyRef": {"name": "pg", "key": "dsn"}}}
    assert "--jobs-store" not in pod["containers"][0]["command"]
    assert {"name": "jobs", "persistentVolumeClaim": {"claimName": "clips"}} in pod["volumes"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "jobs")
    assert mount == {"name": "jobs", "mountPath": JOBS_MOUNT}   # writable: the replicas write content there
    assert JOBS_CONTENT.startswith(JOBS_MOUNT + "/")
    # what the builder writes is what the orchestrator's parser reads back
    parsed = launch.orchestrator_parser(env={}).parse_args(pod["containers"][0]["command"][3:])
    assert (parsed.jobs_content, parsed.jobs_ttl_s, parsed.jobs_concurrency, parsed.jobs_max_queued_per_key) == \
        (JOBS_CONTENT, 3600.0, 3, 5)


def test_store_url_written_in_the_spec_is_a_plain_env_value():
    pod = orchestrator(video_doc({"store": {"url": "sqlite:///var/lib/omnistage-jobs/jobs.db"},
                                  "contentVolume": "clips"}))
    assert env(pod)[launch.ENV_JOBS_STORE] == {"name": launch.ENV_JOBS_STORE,
                                               "value": "sqlite:///var/lib/omnistage-jobs/jobs.db"}
    assert args(pod)["--jobs-ttl-s"] == "86400"   # the defaults are passed too: one place says them (the model)


def test_no_store_no_jobs_parts():
    pod = orchestrator(video_doc())
    assert args(pod) == {}
    assert launch.ENV_JOBS_STORE not in env(pod)
    assert all(v["name"] != "jobs" for v in pod["volumes"])


def test_store_without_a_volume_keeps_content_in_the_pods_own_tmp():
    pod = orchestrator(video_doc({"store": {"secretRef": {"name": "pg"}}}))
    assert args(pod)["--jobs-content"] == JOBS_CONTENT_EPHEMERAL
    assert JOBS_CONTENT_EPHEMERAL.startswith("/tmp/")   # the pod's writable emptyDir; the root is read-only
    assert env(pod)[launch.ENV_JOBS_STORE]["valueFrom"]["secretKeyRef"] == {"name": "pg", "key": "url"}


def test_chart_default_store_serves_video_pipelines_that_name_none():
    pod = orchestrator(video_doc(), CHART_DEFAULT)
    assert env(pod)[launch.ENV_JOBS_STORE]["valueFrom"]["secretKeyRef"] == {"name": "video-db", "key": "dsn"}
    assert {"name": "jobs", "persistentVolumeClaim": {"claimName": "video-content"}} in pod["volumes"]
    assert args(pod)["--jobs-content"] == JOBS_CONTENT


def test_a_pipelines_own_store_wins_over_the_chart_default():
    pod = orchestrator(video_doc({"store": {"secretRef": {"name": "mine"}}, "contentVolume": "my-clips"}),
                       CHART_DEFAULT)
    assert env(pod)[launch.ENV_JOBS_STORE]["valueFrom"]["secretKeyRef"]["name"] == "mine"
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert "my-clips" in claims and "video-content" not in claims


def test_chart_default_leaves_pipelines_without_video_alone():
    doc = yaml.safe_load((EXAMPLES / "text-to-image-tiny.yaml").read_text())
    pod = orchestrator(doc, CHART_DEFAULT)
    assert args(pod) == {} and launch.ENV_JOBS_STORE not in env(pod)


def test_jobs_settings_roll_the_orchestrator():
    base = build_children(parse(video_doc({"store": {"secretRef": {"name": "pg"}}})), CFG)
    more = build_children(parse(video_doc({"store": {"secretRef": {"name": "pg"}}, "concurrency": 4})), CFG)
    key = ANNOTATION_CONFIG_HASH
    assert base.orchestrator_deployment["spec"]["template"]["metadata"]["annotations"][key] != \
        more.orchestrator_deployment["spec"]["template"]["metadata"]["annotations"][key]


@pytest.mark.parametrize("jobs, replicas, path, words", [
    ({"store": {"url": "postgresql://u:p@db/jobs", "secretRef": {"name": "pg"}}}, None,
     "spec.deployment.orchestrator.jobs.store", "not both"),
    ({"contentVolume": "clips"}, None, "spec.deployment.orchestrator.jobs.contentVolume", "name jobs.store"),
    ({"store": {"url": "sqlite:///var/lib/omnistage-jobs/jobs.db"}, "contentVolume": "clips"}, 2,
     "spec.deployment.orchestrator.jobs.store.url", "SQLite serves one orchestrator replica"),
    ({"store": {"url": "sqlite:///var/lib/omnistage-jobs/jobs.db"}}, None,
     "spec.deployment.orchestrator.jobs.contentVolume", "outlives the pod"),
    ({"store": {"secretRef": {"name": "pg"}}}, 3, "spec.deployment.orchestrator.jobs.contentVolume",
     "ReadWriteMany"),
    ({"store": {"url": "mysql://db/jobs"}}, None, "spec.deployment.orchestrator.jobs.store.url", "postgresql://"),
    ({"store": {"secretRef": {"name": "pg"}}, "concurrency": 0}, None,
     "spec.deployment.orchestrator.jobs.concurrency", ">= 1"),
])
def test_bad_jobs_entries_are_refused_by_path(jobs, replicas, path, words):
    with pytest.raises(SpecError) as e:
        parse_pipeline(video_doc(jobs, replicas))
    hits = [err for err in e.value.errors if err.path == path]
    assert hits and words in hits[0].message, e.value.errors


@pytest.mark.parametrize("raw, want", [
    ({"OMNISTAGE_JOBS_STORE_SECRET": "video-db"}, (("video-db", "url"), "")),
    ({"OMNISTAGE_JOBS_STORE_SECRET": "video-db:dsn", "OMNISTAGE_JOBS_CONTENT_CLAIM": "clips"},
     (("video-db", "dsn"), "clips")),
    ({}, (None, "")),
])
def test_operator_reads_the_charts_job_store(raw, want):
    cfg = from_env(raw)
    assert (cfg.jobs_store_secret, cfg.jobs_content_claim) == want


@pytest.mark.parametrize("raw, words", [
    ({"OMNISTAGE_JOBS_STORE_SECRET": "Bad_Name"}, "OMNISTAGE_JOBS_STORE_SECRET"),
    ({"OMNISTAGE_JOBS_CONTENT_CLAIM": "clips"}, "OMNISTAGE_JOBS_STORE_SECRET too"),
])
def test_operator_refuses_a_bad_job_store_setting(raw, words):
    with pytest.raises(ConfigError, match=words):
        from_env(raw)



# ------------------------------------------------------------------ a store URL's password is never echoed

@pytest.mark.parametrize("url", [
    "mysql://admin:hunter2@db/jobs",                      # a scheme the orchestrator does not open
    "postgresql://admin:hunter2 and more@db/jobs",        # whitespace: not a URL
    "postgresql://admin:hunter2@db/" + "x" * 2100,        # too long
    "postgresql://admin:hun/ter2@db jobs",                # a "/" in the password, whitespace after
])
def test_a_refused_store_urls_password_is_not_in_the_message(url):
    with pytest.raises(SpecError) as e:
        parse_pipeline(video_doc({"store": {"url": url}, "contentVolume": "clips"}))
    message = "\n".join(str(err) for err in e.value.errors)
    assert "spec.deployment.orchestrator.jobs.store.url" in message
    assert "hunter2" not in message and "hun/ter2" not in message and "admin:***@" in message, message


@pytest.mark.parametrize("url, shown", [
    ("postgresql://omni:secret@127.0.0.1:5432/jobs", "postgresql://omni:***@127.0.0.1:5432/jobs"),
    ("postgresql://omni:se/cr@t@db/jobs", "postgresql://omni:***@db/jobs"),   # unescaped "/" and "@" in it
    ("postgresql://omni@db/jobs", "postgresql://omni@db/jobs"),               # no password
    ("sqlite:///var/lib/omnistage-jobs/jobs.db", "sqlite:///var/lib/omnistage-jobs/jobs.db"),
    ("hf://Org/Name@main", "hf://Org/Name@main"),                             # an "@" in a path is no userinfo
    ("not a url", "not a url"),
])
def test_redacted_url_hides_only_the_password(url, shown):
    assert redacted_url(url) == shown


# ------------------------------------------------------------------ the orchestrator's rollout with a job volume

def strategy(doc: dict, cfg: OperatorConfig = CFG) -> dict:
    return build_children(parse(doc), cfg).orchestrator_deployment["spec"]["strategy"]


# the old pod goes before the new one starts: no second pod on the claim (a ReadWriteOnce claim stalls the new
# pod in Multi-Attach on another node; two SQLite writers on one file otherwise). rollingUpdate null: a merge
# patch from RollingUpdate must drop it (the API server refuses Recreate with a rollingUpdate).
RECREATE = {"type": "Recreate", "rollingUpdate": None}
ROLLING = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


@pytest.mark.parametrize("jobs, replicas, cfg, want", [
    ({"store": {"url": "sqlite:///var/lib/omnistage-jobs/jobs.db"}, "contentVolume": "clips"}, None, CFG, RECREATE),
    ({"store": {"secretRef": {"name": "pg"}}, "contentVolume": "clips"}, 1, CFG, RECREATE),
    (None, None, CHART_DEFAULT, RECREATE),   # the operator's default claim, one replica
    ({"store": {"secretRef": {"name": "pg"}}, "contentVolume": "clips"}, 2, CFG, ROLLING),   # ReadWriteMany
    ({"store": {"secretRef": {"name": "pg"}}}, 1, CFG, ROLLING),   # no volume: nothing shared
    (None, None, CFG, ROLLING),   # no job store
])
def test_an_orchestrator_on_a_single_writer_volume_is_recreated_not_surged(jobs, replicas, cfg, want):
    assert strategy(video_doc(jobs, replicas), cfg) == want


def test_recreate_matches_the_live_deployment_the_api_server_keeps():
    built = build_children(parse(video_doc({"store": {"secretRef": {"name": "pg"}}, "contentVolume": "clips"})),
                           CFG).orchestrator_deployment
    live = {**built, "spec": {**built["spec"], "strategy": {"type": "Recreate"}}}
    assert matches(built, live)


# ------------------------------------------------------------------ the operator's default store needs its claim

NO_CLAIM = OperatorConfig(model_volume=ModelVolume("hostPath", "/srv/models", "/models"),
                          jobs_store_secret=("video-db", "dsn"))


def test_the_default_store_without_a_claim_refuses_several_orchestrator_replicas():
    from omnistage_operator.reconcile import reconcile

    from .test_operator_adoption import MemoryApi

    body = video_doc(replicas=2)
    body["metadata"].update(uid="pipeline-uid", generation=1)
    api = MemoryApi(body)
    with pytest.raises(kopf.PermanentError):
        reconcile(api, NO_CLAIM, "team-v", body["metadata"]["name"])   # type: ignore[arg-type]
    ready = next(c for c in api.pipeline["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == R_INVALID_SPEC
    assert "spec.deployment.orchestrator.jobs.contentVolume" in ready["message"]
    assert "OMNISTAGE_JOBS_CONTENT_CLAIM" in ready["message"] and "2 orchestrator replicas" in ready["message"]
    assert api.objects == {}   # nothing created
    assert [e[1] for e in api.events] == [R_INVALID_SPEC]


def test_the_default_store_without_a_claim_serves_one_orchestrator_replica():
    assert jobs_errors(parse(video_doc(replicas=1)), NO_CLAIM) == []
    assert jobs_errors(parse(video_doc(replicas=2)), CHART_DEFAULT) == []   # the claim is shared
    # a pipeline naming its own store is validated by its own rules (validation.jobs)
    own = video_doc({"store": {"secretRef": {"name": "pg"}}, "contentVolume": "clips"}, replicas=2)
    assert jobs_errors(parse(own), NO_CLAIM) == []


# ------------------------------------------------------------------ a SQLite file must be on the job volume

@pytest.mark.parametrize("url", ["sqlite:///data/jobs.db", "sqlite:///var/lib/omnistage-jobs/../jobs.db",
                                 f"sqlite://{JOBS_MOUNT}/", f"sqlite:///{JOBS_MOUNT}-other/jobs.db"])
def test_a_sqlite_file_off_the_job_volume_is_refused_on_a_cluster(url):
    with pytest.raises(SpecError) as e:
        parse(video_doc({"store": {"url": url}, "contentVolume": "clips"}))
    hits = [err for err in e.value.errors if err.path == "spec.deployment.orchestrator.jobs.store.url"]
    assert hits and JOBS_MOUNT in hits[0].message, e.value.errors


def test_a_sqlite_file_on_the_job_volume_is_served():
    parse(video_doc({"store": {"url": f"sqlite://{JOBS_MOUNT}/db/jobs.db"}, "contentVolume": "clips"}))
