"""Fuzz the orchestrator's checks of a GenerateRequest (and the stage's, which run the same `resolve`): any
field values, sizes, enums and content parts, against the limits of every example pipeline. Each check
accepts, with values inside the limits, or raises InvalidRequest naming the field; nothing else."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnistage.api import load_pipeline
from omnistage.contract.params import InvalidRequest, RequestParams, fill_resolved, resolve
from omnistage.v1 import common_pb2, orchestrator_pb2
from orchestrator_service import servicer as orchestrator

from ..conftest import EXAMPLES

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PIPELINES = [load_pipeline(p) for p in sorted(EXAMPLES.glob("*.yaml"))]

u32 = st.integers(0, 8) | st.sampled_from([2**31 - 1, 2**32 - 1]) | st.integers(0, 2**32 - 1)
i32 = st.integers(-2**31, 2**31 - 1)
floats = st.floats(width=32) | st.sampled_from([0.0, 1e-45, -0.0, 1e-5, 100.0, 100.1, math.nan, math.inf])
text = st.text(max_size=40) | st.sampled_from(["", " ", "\0", "x" * 70])


def optional(name: str, values) -> st.SearchStrategy[dict]:
    return st.one_of(st.just({}), values.map(lambda v: {name: v}))


parts = st.one_of(
    st.just(common_pb2.ContentPart()),
    text.map(lambda t: common_pb2.ContentPart(text=t)),
    st.builds(lambda d, w, h: common_pb2.ContentPart(image=common_pb2.ImagePart(data=d, width=w, height=h)),
              st.binary(max_size=64), u32, u32),
    st.builds(lambda d, r, c: common_pb2.ContentPart(audio=common_pb2.AudioPart(data=d, sample_rate=r, channels=c)),
              st.binary(max_size=64), u32, u32))


@st.composite
def generation_params(draw) -> common_pb2.GenerationParams:
    t = common_pb2.TextParams(max_tokens=draw(u32), ignore_eos=draw(st.booleans()),
                              **draw(optional("temperature", floats)), **draw(optional("top_p", floats)),
                              **draw(optional("top_k", u32)))
    img = common_pb2.ImageParams(width=draw(u32), height=draw(u32), num_inference_steps=draw(u32),
                                 negative_prompt=draw(text), **draw(optional("guidance_scale", floats)))
    return common_pb2.GenerationParams(
        prompt=draw(text), prompt_token_ids=draw(st.lists(i32, max_size=6)), text=t, image=img,
        audio=common_pb2.AudioParams(max_codec_frames=draw(u32), speaker=draw(text)),
        system_prompt=draw(text), raw_prompt=draw(st.booleans()), parts=draw(st.lists(parts, max_size=3)),
        **draw(optional("seed", st.integers(0, 2**64 - 1))))


@FUZZ
@given(generation_params(), st.sampled_from(PIPELINES))
@example(common_pb2.GenerationParams(prompt="x", text=common_pb2.TextParams(temperature=1e-45)),
         next(p for p in PIPELINES if p.name == "llm-tiny"))
def test_params_resolve_within_the_limits_or_name_the_field(p, pipeline):
    limits = pipeline.limits
    try:
        r = resolve(p, limits)
    except InvalidRequest as e:
        assert e.field.startswith("params.") and str(e).startswith(f"{e.field}: ")
        return
    assert isinstance(r, RequestParams)
    assert 1 <= r.max_tokens <= (limits.max_tokens or r.max_tokens)  # 0: the model's context, unknown here
    assert r.temperature is None or 0 < r.temperature <= 100  # vanishing temperatures decode greedily
    assert r.top_p is None or 0 < r.top_p <= 1
    assert 8 <= r.width <= limits.max_image_side and 8 <= r.height <= limits.max_image_side
    assert 1 <= r.num_inference_steps <= limits.max_inference_steps
    assert 0 <= r.guidance_scale <= 100 and math.isfinite(r.guidance_scale)
    assert sum(x.WhichOneof("part") != "text" for x in r.parts) <= limits.max_parts
    assert all(x.WhichOneof("part") for x in r.parts)


@FUZZ
@given(generation_params(), st.sampled_from(PIPELINES))
def test_resolved_params_as_the_stages_are_sent_them_resolve_to_themselves(p, pipeline):
    """The orchestrator sends every stage the values it resolved; the stage's resolve of them (its check)
    gives back the very same parameters: no second set of defaults, nothing refused that was admitted."""
    try:
        r = resolve(p, pipeline.limits)
    except InvalidRequest:
        return
    sent = common_pb2.GenerationParams()
    sent.CopyFrom(p)
    assert resolve(fill_resolved(sent, r), pipeline.limits) == r


@FUZZ
@given(st.lists(st.integers(0, 10) | i32, max_size=5), st.sampled_from(PIPELINES))
def test_requested_outputs_are_the_pipelines_or_name_the_entry(outputs, pipeline):
    request = orchestrator_pb2.GenerateRequest(outputs=outputs)
    try:
        chosen = orchestrator.requested_outputs(pipeline, request)
    except InvalidRequest as e:
        assert e.field.startswith("outputs[")
        return
    assert chosen and set(chosen.items()) <= {(o.stage, o.modality) for o in pipeline.outputs}


@FUZZ
@given(st.text(max_size=200) | st.sampled_from(["", "a" * 128, "a" * 129, "ok-1", "tab\there", "é"]))
def test_a_client_request_label_is_bounded_visible_ascii_or_refused(label):
    checked_label = getattr(orchestrator, "checked_label", None)
    if checked_label is None:
        pytest.skip("this orchestrator takes no client label")
    try:
        assert checked_label(label) == label
    except InvalidRequest as e:
        assert e.field == "request_id"
        return
    assert len(label) <= orchestrator.MAX_REQUEST_ID and all("!" <= c <= "~" for c in label)
