"""Transformers AR stages served with `quantization: int8` (weight-only, stage_service/runtime/quantize.py):
the causal LM in the stage process and in an engine process, the omni Thinkers and Talkers of both
families. Each loads its Linear weights as int8 and still serves; outputs are noise (random tiny weights)."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from omnistage.contract.devices import DevicePlan
from stage_service.engines.omni.talker_core import TalkerCore
from stage_service.engines.qwen2_5_omni.engines import TalkerEngine as Qwen25TalkerEngine
from stage_service.engines.qwen3_omni.engines import TalkerEngine as Qwen3TalkerEngine
from stage_service.engines.registry import create_engine
from stage_service.engines.transformers.lm_core import LmCore
from stage_service.runtime.errors import EngineConfigError

from ..harness import call_stage, example, header, start_stage, token_ids

Int8Tensor = pytest.importorskip("torchao.quantization").Int8Tensor
CPU = DevicePlan("cpu", "float32")
LM = "qwen2-tiny"


def int8(name: str, stage: str, engine_process: bool = False):
    """An example with one stage quantized (and its model in an engine process when asked)."""
    def edit(doc):
        for s in doc["spec"]["topology"]["stages"]:
            if s["name"] == stage:
                s["engine"] = "transformers"
        entry = doc["spec"]["deployment"]["stages"][stage]
        entry["quantization"] = "int8"
        if engine_process:
            entry.setdefault("engineArgs", {})["engine_process"] = True
    return example(name, edit)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The Linear weights of `module`, by module name."""
    return {n: m.weight for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}


def int8_names(module: torch.nn.Module) -> set[str]:
    return {n for n, w in weights(module).items() if isinstance(w, Int8Tensor) and w.qdata.dtype == torch.int8}


def assert_an_int8_lm(model: torch.nn.Module) -> None:
    """Every Linear int8 but the head tied to the embedding, which stays the embedding's float tensor."""
    embed = model.get_input_embeddings().weight
    assert int8_names(model) == set(weights(model)) - {"lm_head"}
    assert model.lm_head.weight is embed and embed.dtype == torch.float32


@pytest.fixture(scope="module")
async def lm_stages(model_dir):
    """The tiny LM quantized, in the stage process and in an engine process."""
    inproc = await start_stage(int8("llm-tiny", "llm"), "llm", model_dir)
    remote = await start_stage(int8("llm-tiny", "llm", engine_process=True), "llm", model_dir)
    yield inproc, remote
    await remote.drain()
    await inproc.drain()


async def test_an_int8_causal_lm_stage_serves_text_from_int8_linear_weights(lm_stages):
    inproc, _ = lm_stages
    assert_an_int8_lm(inproc.engine.lm.model)
    out = await call_stage(inproc.port, header(prompt="Hello there", max_tokens=8, ignore_eos=True))
    assert len(token_ids(out)) == 8 and out[-1].finish_reason == "length"
    assert "".join(c.text for c in out)


async def test_the_engine_process_quantizes_as_the_stage_process(lm_stages, model_dir):
    inproc, remote = lm_stages
    requests = [header(f"g{i}", prompt=f"greedy {i}", max_tokens=12, ignore_eos=True) for i in range(3)]
    want = await asyncio.gather(*(call_stage(inproc.port, h) for h in requests))
    got = await asyncio.gather(*(call_stage(remote.port, h) for h in requests))
    assert [token_ids(c) for c in got] == [token_ids(c) for c in want]
    # What the engine process builds, built here: the same int8 model.
    assert_an_int8_lm(LmCore(str(model_dir / LM), CPU, True, "int8", "llm").lm.model)


async def test_without_torchao_an_int8_stage_refuses_to_start_naming_the_package(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)   # as if torchao were not installed
    p = int8("llm-tiny", "llm")
    engine = create_engine(p, p.stage("llm"), model_dir)
    with pytest.raises(EngineConfigError, match=r"^spec\.deployment\.stages\.llm\.quantization: the package torchao "
                                                r"is not installed here"):
        await engine.start()
    assert not hasattr(engine, "lm")
    await engine.shutdown()


@pytest.mark.parametrize("name", ["qwen3-omni-tiny", "qwen2.5-omni-tiny"])
async def test_an_int8_thinker_quantizes_its_language_model_not_its_encoders(name, model_dir):
    srv = await start_stage(int8(name, "thinker"), "thinker", model_dir)
    try:
        thinker = srv.engine.thinker
        language = {f"{prefix}.{n}" if n else prefix
                    for prefix, part in ((name_of(thinker.model, thinker.decoder), thinker.decoder),
                                         (name_of(thinker.model, thinker.head), thinker.head))
                    for n in weights(part)}
        assert int8_names(thinker.model) == language - tied_heads(thinker.model)
        assert set(weights(thinker.model)) - language   # the encoders' Linear layers, kept in the dtype
        out = await call_stage(srv.port, header(prompt="Hello", max_tokens=4, ignore_eos=True))
        assert len(token_ids(out)) == 4
    finally:
        await srv.drain()


@pytest.mark.parametrize("name, engine", [("qwen3-omni-tiny", Qwen3TalkerEngine),
                                          ("qwen2.5-omni-tiny", Qwen25TalkerEngine)])
async def test_an_int8_talker_quantizes_every_linear_in_either_process(name, engine, model_dir):
    srv = await start_stage(int8(name, "talker"), "talker", model_dir)
    try:
        model = srv.engine.talker.model
        assert int8_names(model) == set(weights(model)) - tied_heads(model) != set()
    finally:
        await srv.drain()
    core = TalkerCore(engine, str(model_dir / name), CPU, True, "int8", "talker")   # what its engine process builds
    assert int8_names(core.talker.model) == int8_names(model)


def name_of(model: torch.nn.Module, part: torch.nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is part)


def tied_heads(model: torch.nn.Module) -> set[str]:
    """Linear layers whose weight is an embedding's (left in the dtype)."""
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {n for n, w in weights(model).items() if id(w) in embeds}
