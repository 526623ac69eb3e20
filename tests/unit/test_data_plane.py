"""Which stores a stage starts and which transport its output takes: pure decisions from the spec;
the memory paths of a request's inputs handed to its next output chunk (the trace)."""

from __future__ import annotations

import pytest
import torch

from omnistage.contract.launch import ENV_TRANSPORTS
from stage_service.data_plane import (
    DataPlane,
    consumers_device,
    out_transport,
    spec_device,
    ucx_available,
    wanted_transports,
)

from ..harness import example


def edges(thinker_talker="auto", talker_code2wav="auto"):
    def edit(doc):
        stages = {s["name"]: s for s in doc["spec"]["topology"]["stages"]}
        stages["talker"]["inputs"][0]["transport"] = thinker_talker
        stages["code2wav"]["inputs"][0]["transport"] = talker_code2wav
    return example("qwen3-omni-tiny", edit)


def stores(p, stage, same_host, env=None):
    return wanted_transports(p, p.stage(stage), same_host, env or {})


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
def test_ucx_starts_only_where_an_edge_may_use_it():
    p = edges("ucx", "shm")
    assert stores(p, "thinker", True) == ("shm", "ucx") and stores(p, "talker", True) == ("shm", "ucx")
    assert stores(p, "code2wav", True) == ("shm",)
    auto = edges()
    assert stores(auto, "talker", True) == ("shm",)           # one host: auto means inline or shared memory
    assert stores(auto, "talker", False) == ("ucx",)          # peers may be elsewhere: auto may pick UCX
    assert stores(edges("inline", "inline"), "talker", False) == ()
    assert stores(edges("shm", "inline"), "talker", False) == ("shm",)  # asked for: pods that share /dev/shm


def test_without_ucx_a_cluster_stage_sends_everything_inline(monkeypatch):
    import stage_service.data_plane as dp

    monkeypatch.setattr(dp, "ucx_available", lambda: False)
    assert stores(edges(), "talker", False) == ()   # no store another pod could read: auto stays inline
    assert stores(edges(), "talker", True) == ("shm",)


def test_environment_overrides_the_stores():
    assert stores(edges(), "talker", False, {ENV_TRANSPORTS: "shm"}) == ("shm",)


def test_output_transport_is_the_consumers_edge_setting_or_auto_when_they_disagree():
    p = edges("ucx", "shm")
    assert out_transport(p, "thinker", ["talker"]) == "ucx"
    assert out_transport(p, "talker", ["code2wav"]) == "shm"
    assert out_transport(p, "thinker", []) == "auto"


def on_gpus(*names, transport="auto"):
    def edit(doc):
        stages = {s["name"]: s for s in doc["spec"]["topology"]["stages"]}
        stages["talker"]["inputs"][0]["transport"] = transport
        deployment = doc["spec"].setdefault("deployment", {}).setdefault("stages", {})
        for name in names:
            deployment.setdefault(name, {})["gpus"] = 1
    return example("qwen3-omni-tiny", edit)


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
def test_one_host_auto_edge_between_gpu_stages_starts_ucx_for_cuda_ipc():
    both = on_gpus("thinker", "talker")
    assert stores(both, "thinker", True) == ("shm", "ucx") and stores(both, "talker", True) == ("shm", "ucx")
    assert stores(both, "code2wav", True) == ("shm",)         # its edge has a CPU end: shared memory
    one = on_gpus("thinker")
    assert stores(one, "thinker", True) == ("shm",) and stores(one, "talker", True) == ("shm",)
    assert stores(on_gpus("thinker", "talker", transport="shm"), "talker", True) == ("shm",)  # asked for shm


def test_consumers_device_by_the_spec():
    p = on_gpus("talker")
    assert spec_device(p, "talker") == "cuda" and spec_device(p, "thinker") == "cpu"
    assert consumers_device(p, ["talker"]) == "cuda"
    assert consumers_device(p, ["code2wav"]) == "cpu"
    assert consumers_device(p, ["talker", "code2wav"]) is None  # they disagree: unknown, auto stays as before


async def test_input_paths_go_to_the_next_output_chunk_and_are_forgotten_at_the_last():
    from omnistage.connector import TensorKey, make_connector
    from omnistage.v1 import stage_pb2

    p = edges()
    plane = DataPlane(p, p.stage("talker"), env={ENV_TRANSPORTS: "shm"})
    await plane.start()
    producer = await make_connector("thinker", ("shm",), host_id=plane.host_id)
    try:
        msg = await producer.put(TensorKey("r1", "thinker", 0, "hidden"), torch.zeros(1 << 16), transport="shm")
        await plane.input_chunk(stage_pb2.Chunk(stage="thinker", chunk_id=0, tensors=[msg]), "r1")
        assert plane.input_paths("r1") == "host"
        assert plane.input_paths("r1") == ""                    # nothing fetched since
        assert plane.input_paths("r1", done=True) == ""
    finally:
        await producer.close()
        await plane.close()
