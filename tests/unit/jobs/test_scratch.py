"""A replica's scratch folder (where MP4s grow before they are whole): a replica killed with -9 never removes its
own, so the next one to start on the host sweeps the folders of processes that are gone, and no other."""

from __future__ import annotations

import os
import subprocess
import sys

from orchestrator_service.jobs.replica import SCRATCH_PREFIX, new_scratch


def test_a_new_scratch_sweeps_the_folders_of_dead_replicas_and_keeps_the_living_ones(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = tmp_path / f"{SCRATCH_PREFIX}{gone.stdout.strip()}-abc"
    (dead / "video_1.0.mp4").parent.mkdir()
    (dead / "video_1.0.mp4").write_bytes(b"partial")
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = tmp_path / f"{SCRATCH_PREFIX}{living.pid}-def"
        alive.mkdir()
        own = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-ghi"
        own.mkdir()
        other = tmp_path / "something-else"
        other.mkdir()
        made = new_scratch(tmp_path)
        assert made.is_dir() and made.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
        assert not dead.exists()
        assert alive.is_dir() and own.is_dir() and other.is_dir()
    finally:
        living.kill()
        living.wait()
