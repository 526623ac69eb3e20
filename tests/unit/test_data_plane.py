"""Which stores a stage starts and which transport its output takes: pure decisions from the spec."""

from __future__ import annotations

import pytest

from omnistage.launch import ENV_TRANSPORTS
from stage_service.data_plane import out_transport, ucx_available, wanted_transports

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
