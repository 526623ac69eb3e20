"""Finished jobs' content files: whole or absent to a reader, removed with their job, names kept inside the root."""

from __future__ import annotations

import os
import threading

import pytest

from orchestrator_service.jobs.content import ContentStore
from tests.polling import wait_until_sync

JOB = "video_" + "ab" * 16


def test_put_bytes_and_files_then_read_and_delete(tmp_path):
    content = ContentStore(tmp_path / "content")
    assert content.put(JOB, "video", b"\x00mp4" * 1000) == 4000
    scratch = tmp_path / "thumb.webp"
    scratch.write_bytes(b"RIFF" + b"\x01" * 96)
    assert content.put(JOB, "thumbnail", scratch) == 100
    assert scratch.exists()  # a file is copied in; its owner removes it
    assert content.path(JOB, "video").read_bytes() == b"\x00mp4" * 1000
    assert content.path(JOB, "thumbnail").read_bytes() == scratch.read_bytes()
    assert content.path(JOB, "spritesheet") is None
    assert content.put(JOB, "video", b"new") == 3  # replaced whole
    assert content.path(JOB, "video").read_bytes() == b"new"
    content.delete(JOB)
    assert content.path(JOB, "video") is None and not (tmp_path / "content" / JOB).exists()
    content.delete(JOB)  # nothing stored is no error


def test_a_reader_never_sees_a_half_written_file(tmp_path):
    content = ContentStore(tmp_path)
    source = tmp_path / "mux.fifo"
    os.mkfifo(source)
    first_half = threading.Event()

    def mux() -> None:  # the muxer hands over its output in two halves
        with source.open("wb") as out:
            out.write(b"a" * 65536)
            out.flush()
            first_half.wait()
            out.write(b"b" * 65536)

    writer = threading.Thread(target=mux)
    writer.start()
    sizes: list[int] = []
    putter = threading.Thread(target=lambda: sizes.append(content.put(JOB, "video", source)))
    putter.start()
    try:
        partial = wait_until_sync(lambda: [p for p in (tmp_path / JOB).glob("*") if p.stat().st_size >= 65536]
                                  if (tmp_path / JOB).exists() else [], what="half the file written")
        assert content.path(JOB, "video") is None  # half written: not there for a reader
        assert [p.name for p in partial][0] != "video"
    finally:
        first_half.set()
        writer.join()
        putter.join()
    assert sizes == [131072]
    assert content.path(JOB, "video").read_bytes() == b"a" * 65536 + b"b" * 65536
    assert [p.name for p in (tmp_path / JOB).iterdir()] == ["video"]  # nothing left behind


def test_a_failed_put_leaves_nothing(tmp_path):
    content = ContentStore(tmp_path)
    with pytest.raises(FileNotFoundError):
        content.put(JOB, "video", tmp_path / "missing.mp4")
    assert content.path(JOB, "video") is None and list((tmp_path / JOB).iterdir()) == []


@pytest.mark.parametrize(("job_id", "variant", "what"), [("../etc", "video", "job id"), (JOB, "../../x", "variant"),
                                                        ("", "video", "job id"), (JOB, ".partial-video", "variant")])
def test_names_that_would_leave_the_root_are_refused(tmp_path, job_id, variant, what):
    content = ContentStore(tmp_path / "root")
    with pytest.raises(ValueError, match=what):
        content.put(job_id, variant, b"x")
    with pytest.raises(ValueError, match=what):
        content.path(job_id, variant)
    assert not (tmp_path / "root").exists()
