"""`omnistage serve` encrypts and authenticates its internal hops by default (a throwaway CA made at start,
deleted at exit) and says so; `--no-tls` turns it off and says that too. Real processes, as a user runs them."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import yaml

from ..conftest import EXAMPLES, REPO
from .test_cli_serve import Served

OMNISTAGE = [sys.executable, "-m", "omnistage.local.cli"]
TLS_FLAG = "--tls-dir"


def small_lm_file(tmp: Path) -> Path:
    """llm-tiny on the transformers engine (no vLLM needed)."""
    doc = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    path = tmp / "llm-tiny.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def command_lines(s: Served) -> dict[str, list[str]]:
    return {name: psutil.Process(pid).cmdline() for name, pid in s.processes.items()}


def generate(endpoint: str) -> subprocess.CompletedProcess:
    return subprocess.run([*OMNISTAGE, "generate", "--endpoint", endpoint, "--prompt", "Hello", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=180, cwd=REPO)


def flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_serve_runs_the_internal_hops_over_mtls_with_a_throwaway_ca(model_dir, tmp_path):
    s = Served(small_lm_file(tmp_path), model_dir, tmp_path)
    try:
        assert "internal hops (orchestrator -> stages): mTLS" in s.output()
        argvs = command_lines(s)
        assert sorted(argvs) == ["orchestrator", "stage llm[0]"]
        folders = {name: Path(flag_value(argv, TLS_FLAG)) for name, argv in argvs.items()}
        assert all(f is not None for f in folders.values()), argvs
        assert folders["orchestrator"] != folders["stage llm[0]"]
        root = folders["orchestrator"].parent
        assert folders["stage llm[0]"].parent == root
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700  # private: the keys lie there
        assert sorted(p.name for p in folders["orchestrator"].iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
        r = generate(s.endpoint)
        assert r.returncode == 0 and "completion tokens" in r.stdout, r.stderr
        api = s.wait_for(r"OpenAI API: (http://127\.0\.0\.1:\d+/v1)\n", 5)  # client ports: plaintext on loopback
        with urllib.request.urlopen(api + "/models", timeout=10) as resp:
            assert resp.status == 200
    finally:
        assert s.stop() == 0
    assert not root.exists()  # the throwaway CA's leaves and keys go at exit


def test_serve_no_tls_is_plaintext_and_says_so(model_dir, tmp_path):
    s = Served(small_lm_file(tmp_path), model_dir, tmp_path, "--no-tls", "--no-api")
    try:
        assert "internal hops (orchestrator -> stages): PLAINTEXT" in s.output()
        assert all(TLS_FLAG not in argv for argv in command_lines(s).values())
        r = generate(s.endpoint)
        assert r.returncode == 0 and "completion tokens" in r.stdout, r.stderr
    finally:
        assert s.stop() == 0
