"""Hostile media against the orchestrator's decode workers (real processes): a decode that hangs frees its
slot at the bound and other media still decodes; a decoder that crashes, or is killed mid-decode, ends
only its worker; a decoder's memory is bounded by its worker's rlimit; and through a real orchestrator,
refused containers and timestamps are INVALID_ARGUMENT naming them, and the door serves on."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading

import grpc
import numpy as np
import pytest

from omnistage.client import AsyncOmniClient, audio_part, image_part, video_part
from omnistage.contract.params import InvalidRequest
from omnistage.v1 import common_pb2
from orchestrator_service.media_check import MediaCheck, check_in_worker
from orchestrator_service.media_pool import DecoderCrashed, DecodeTimeout, MediaPool
from orchestrator_service.server import OrchestratorServer

from ..harness import example, start_stage
from ..media_builders import audio_file, png, video_file
from ..media_faults import CRASH, HANG, allocate, failing_decoder, hang, hang_marked
from ..polling import wait_until_sync


def pipeline(decode_seconds: float):
    return example("qwen3-omni-tiny", lambda d: d["spec"]["topology"].setdefault("limits", {}).update(
        mediaDecodeSeconds=decode_seconds))


OMNI = example("qwen3-omni-tiny")
GOOD = [image_part(png(np.zeros((8, 8, 3), np.uint8)))]


async def test_a_decode_that_hangs_frees_its_slot_at_the_bound_and_other_media_still_decodes():
    check = MediaCheck(pipeline(4.0), workers=1, decode=failing_decoder)
    try:
        with pytest.raises(InvalidRequest, match=r"^params.parts: decoding took longer than 4 s$"):
            await check.check([image_part(HANG)])
        # the one slot is free again: the next request is decoded, not refused as overload
        assert await check.check(GOOD) >= 0
        with pytest.raises(InvalidRequest, match=r"cannot decode \(not PNG, JPEG or WebP\)"):
            await check.check([image_part(b"junk" * 10)])
    finally:
        check.close()


async def test_a_decoder_crash_ends_only_its_worker_and_the_request_is_refused():
    check = MediaCheck(pipeline(60.0), workers=2, decode=failing_decoder)
    try:
        results = await asyncio.gather(*(check.check([image_part(CRASH)]) for _ in range(3)), check.check(GOOD),
                                       return_exceptions=True)
        for crashed in results[:3]:
            assert isinstance(crashed, InvalidRequest)
            assert str(crashed) == f"params.parts: cannot decode (the decoder failed on it: exit code " \
                                   f"{-signal.SIGSEGV})"
        assert isinstance(results[3], float)
        assert await check.check(GOOD) >= 0  # this process lives on and decodes
    finally:
        check.close()


def test_a_worker_killed_mid_decode_fails_that_call_and_the_pool_starts_another(tmp_path):
    pool = MediaPool(1, preload=("tests.media_faults",))
    marker = tmp_path / "decoding"
    outcome: list[BaseException] = []

    def call():
        try:
            pool.call(600, hang_marked, str(marker))
        except BaseException as e:  # noqa: BLE001 - the outcome is what the test checks
            outcome.append(e)
    caller = threading.Thread(target=call)
    try:
        before = {p.pid for p in multiprocessing.active_children()}
        caller.start()
        wait_until_sync(marker.exists, timeout=120)  # the worker is in the call
        [worker] = [p for p in multiprocessing.active_children() if p.pid not in before]
        os.kill(worker.pid, signal.SIGKILL)
        caller.join(120)
        assert len(outcome) == 1 and isinstance(outcome[0], DecoderCrashed)
        assert outcome[0].exitcode == -signal.SIGKILL
        assert pool.call(120, check_in_worker, [GOOD[0].SerializeToString()], pipeline(10).limits,
                         frozenset({"image"})) is None
    finally:
        pool.close()
        caller.join(120)


def test_a_call_past_its_bound_ends_its_worker():
    pool = MediaPool(1, preload=("tests.media_faults",))
    try:
        with pytest.raises(DecodeTimeout):
            pool.call(1.0, hang)
        assert pool.pids() == []  # ended, its place empty until the next call starts a fresh one
        assert pool.call(120, allocate, 1000) == 1000
    finally:
        pool.close()


def test_a_decoders_memory_is_bounded_by_its_workers_rlimit():
    pool = MediaPool(1, address_space=2 << 30, preload=("tests.media_faults",))
    try:
        with pytest.raises(MemoryError):
            pool.call(120, allocate, 3 << 30)
        assert pool.call(120, allocate, 1 << 20) == 1 << 20  # the same worker decodes on
    finally:
        pool.close()


@pytest.fixture(scope="module")
async def omni(model_dir):
    """The Thinker alone (text output) behind a real orchestrator."""
    thinker = await start_stage(OMNI, "thinker", model_dir)
    orc = OrchestratorServer(OMNI, {"thinker": [f"127.0.0.1:{thinker.port}"]})
    await orc.start(wait_for_stages=30)
    client = AsyncOmniClient(f"127.0.0.1:{orc.port}")
    yield client, thinker
    await client.close()
    await orc.drain()
    await thinker.drain()


FRAME = png(np.zeros((28, 28, 3), np.uint8))


def encoded_video(data: bytes) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(video=common_pb2.VideoPart(data=data))


HOSTILE = [
    ([audio_part(audio_file("AIFF"))], "params.parts[0].audio: cannot decode (not WAV, FLAC, MP3 or OGG: AIFF)"),
    ([audio_part(audio_file("VOC"))], "params.parts[0].audio: cannot decode (not WAV, FLAC, MP3 or OGG: VOC)"),
    ([encoded_video(video_file("avi"))], "params.parts[0].video: cannot decode (not MP4, Matroska or WebM: AVI)"),
    ([encoded_video(b"ffconcat version 1.0\nfile 'clip.mp4'\n")],
     "params.parts[0].video: cannot decode (not MP4, Matroska or WebM: an FFmpeg concat script)"),
    ([video_part([FRAME] * 4, [0, 1, 2, 1e20])],
     "params.parts[0].video.timestamps: span 1e+20 s (from 0 to 1e+20 s); the limit is 3600 s"),
]


@pytest.mark.parametrize("parts,message", HOSTILE, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(HOSTILE)])
async def test_hostile_media_is_invalid_argument_at_the_door_and_it_keeps_serving(omni, parts, message):
    client, thinker = omni
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate("What is this?", parts=parts, outputs=["text"], max_tokens=2, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == message
    r = await client.generate("Look:", parts=[video_part([FRAME] * 2, [0, 0.5])], outputs=["text"], max_tokens=2,
                              timeout=120)
    assert r.final is not None
