"""`omnistage serve`'s job store: a pipeline with a video output gets SQLite and a content folder under the
working directory, handed to its orchestrator (the URL by environment, the rest as flags)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from omnistage.api import parse_pipeline
from omnistage.contract import launch
from omnistage.local.serve import JOBS_DIR, LaunchError, LocalPipeline
from omnistage.store_url import redacted_url

from ..conftest import EXAMPLES
from .test_operator_jobs import video_doc


def local(doc: dict, tmp_path: Path, **kw) -> LocalPipeline:
    return LocalPipeline(tmp_path / "p.yaml", parse_pipeline(doc), tmp_path / "models", log_dir=tmp_path / "logs",
                         work_dir=tmp_path / "work", **kw)


def orchestrator_args(lp: LocalPipeline):
    """What the orchestrator serve starts parses from its command line and environment."""
    env = lp._jobs_env()
    argv = lp._orchestrator_proc(0, 0, None).argv
    return launch.orchestrator_parser(env=env).parse_args(argv[3:]), env


def test_a_video_pipeline_gets_sqlite_and_a_content_folder_in_the_working_directory(tmp_path):
    lp = local(video_doc({"ttlSeconds": 600, "concurrency": 3}), tmp_path)
    args, env = orchestrator_args(lp)
    root = (tmp_path / "work" / JOBS_DIR).resolve()
    assert args.jobs_store == f"sqlite://{root / 'jobs.db'}"   # sqlite:///abs/path/jobs.db
    assert "--jobs-store" not in lp._orchestrator_proc(0, 0, None).argv   # by environment only
    assert Path(args.jobs_content) == root / "content"
    assert (args.jobs_ttl_s, args.jobs_concurrency, args.jobs_max_queued_per_key) == (600.0, 3, 16)
    # made, private to the user: prompts and videos are theirs
    for folder in (root, root / "content"):
        assert folder.is_dir() and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert env == {launch.ENV_JOBS_STORE: args.jobs_store}


def test_a_pipeline_without_video_gets_no_store(tmp_path):
    lp = local(yaml.safe_load((EXAMPLES / "text-to-image-tiny.yaml").read_text()), tmp_path)
    args, env = orchestrator_args(lp)
    assert lp.jobs is None and env == {} and args.jobs_store is None and args.jobs_content is None
    assert not (tmp_path / "work" / JOBS_DIR).exists()


def test_a_given_store_and_content_win(tmp_path):
    url = "postgresql://omni:secret@127.0.0.1:5432/jobs"
    lp = local(video_doc(), tmp_path, jobs_store=url, jobs_content=tmp_path / "clips")
    args, _ = orchestrator_args(lp)
    assert args.jobs_store == url and Path(args.jobs_content) == tmp_path / "clips"
    assert "secret" not in " ".join(lp._orchestrator_proc(0, 0, None).argv)
    assert redacted_url(url) == "postgresql://omni:***@127.0.0.1:5432/jobs"


def test_the_files_own_url_is_used_locally_but_not_its_secret(tmp_path):
    db = tmp_path / "mine.db"
    lp = local(video_doc({"store": {"url": f"sqlite:///{db}"}, "contentVolume": "clips"}), tmp_path)
    assert orchestrator_args(lp)[0].jobs_store == f"sqlite:///{db}"
    lp = local(video_doc({"store": {"secretRef": {"name": "pg"}}}), tmp_path)
    assert orchestrator_args(lp)[0].jobs_store.startswith("sqlite:///")   # a Secret is the cluster's


def test_the_environment_does_not_leak_a_store_into_the_stages(tmp_path, monkeypatch):
    monkeypatch.setenv(launch.ENV_JOBS_STORE, "postgresql://elsewhere/db")
    lp = local(video_doc(), tmp_path)
    assert launch.ENV_JOBS_STORE not in lp.env()


def test_a_sqlite_folder_serve_cannot_make_is_refused_at_start_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    url = f"sqlite:///{blocker}/jobs/jobs.db"
    lp = local(video_doc(), tmp_path, jobs_store=url, jobs_content=tmp_path / "clips")
    with pytest.raises(LaunchError) as e:
        lp._jobs_env()
    assert str(blocker / "jobs") in str(e.value) and "SQLite" in str(e.value)


def test_the_printed_store_url_hides_its_password():
    assert redacted_url("postgresql://omni:secret@127.0.0.1:5432/jobs") == "postgresql://omni:***@127.0.0.1:5432/jobs"
