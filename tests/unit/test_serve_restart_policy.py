"""How `omnistage serve` restarts a process that died (crash-loop backoff, as the kubelet's) and bounds each
process's log file."""

from __future__ import annotations

import pytest

from omnistage.local.restarts import (
    LOG_TAIL_BYTES,
    RESTART_BACKOFF_MAX_S,
    RESTART_RESET_AFTER_S,
    failures_after_death,
    log_tail,
    restart_delay,
    rotate_log,
)


@pytest.mark.parametrize("failures, delay", [(1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (50, 60.0)])
def test_the_backoff_doubles_up_to_its_cap(failures, delay):
    assert restart_delay(failures) == delay <= RESTART_BACKOFF_MAX_S


@pytest.mark.parametrize("failures, up_s, after", [
    (0, 3.0, 1),                             # the first death
    (3, 3.0, 4),                             # a crash loop goes on
    (3, RESTART_RESET_AFTER_S, 1),           # up long enough: starts over
    (9, RESTART_RESET_AFTER_S + 1, 1),
])
def test_a_long_run_resets_the_backoff(failures, up_s, after):
    assert failures_after_death(failures, up_s) == after


def test_a_log_past_its_bound_is_kept_once_and_emptied_in_place(tmp_path):
    log = tmp_path / "talker-0.log"
    with open(log, "ab") as writer:   # as serve opens a process's log: append mode, held open
        writer.write(b"x" * 100 + b"\n")
        writer.flush()
        assert not rotate_log(log, max_bytes=1000)
        writer.write(b"y" * 1000 + b"\n")
        writer.flush()
        assert rotate_log(log, max_bytes=1000)
        assert log.stat().st_size == 0 and (tmp_path / "talker-0.log.1").stat().st_size == 1102
        writer.write(b"after\n")   # the process goes on writing at the new end: no hole before it
        writer.flush()
    assert log.read_bytes() == b"after\n"
    for _ in range(3):   # however often it passes the bound, one old copy: at most twice the bound on disk
        log.write_bytes(b"z" * 2000)
        assert rotate_log(log, max_bytes=1000, backups=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["talker-0.log", "talker-0.log.1"]


def test_the_tail_reads_only_the_end_of_a_big_log(tmp_path):
    log = tmp_path / "stage.log"
    log.write_bytes(b"early line\n" * (LOG_TAIL_BYTES // 4) + b"last words\n")
    assert log_tail(log, 2) == "early line\nlast words"
    assert log_tail(tmp_path / "missing.log", 5) == ""
