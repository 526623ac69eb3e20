"""A request's parameters are resolved once, by the orchestrator: the cost ShortestFirst admission orders
by counts the numbers the stages will make, and every stage is sent those same numbers (its own resolve
adds no second set of defaults)."""

from __future__ import annotations

import dataclasses

import pytest

from omnistage.api import Limits
from omnistage.contract.params import fill_resolved, resolve
from omnistage.contract.request import build_request
from orchestrator_service import servicer as orchestrator
from orchestrator_service.admission import Overloaded
from orchestrator_service.media_check import MediaCheck
from orchestrator_service.metrics import OrchestratorMetrics
from orchestrator_service.request_run import RequestRun
from orchestrator_service.routing import Router
from stage_service.servicer import request_from_proto

from ..harness import example

LIMITS = Limits(default_max_tokens=40, default_codec_frames=60, default_inference_steps=5)


@pytest.mark.parametrize("asked, outputs, cost", [
    ({}, ["text"], 40),                                         # no max_tokens: the pipeline's default
    ({"max_tokens": 7}, ["text"], 7),
    ({"max_tokens": 7}, ["text", "audio"], 7 + 60),             # no max_codec_frames: the default
    ({"max_tokens": 7, "max_codec_frames": 9}, ["text", "audio"], 16),
    ({"max_tokens": 7, "max_codec_frames": 9}, ["text"], 7),    # frames count only when audio is made
    ({}, ["image"], 40 + 4 * 5),                                # denoise steps: the default, weighted 4
    ({"num_inference_steps": 2}, ["image"], 40 + 4 * 2),
])
def test_the_cost_counts_the_resolved_numbers_of_what_is_asked_for(asked, outputs, cost):
    params = resolve(build_request("Hello", **asked).params, LIMITS)
    assert orchestrator.estimated_cost(params, outputs) == cost


def llm(default_max_tokens: int):
    def edit(doc):
        doc["spec"]["topology"]["limits"]["defaultMaxTokens"] = default_max_tokens
    return example("llm-tiny", edit)


async def test_admission_orders_a_request_without_max_tokens_by_the_pipelines_default_max_tokens(monkeypatch):
    pipeline = llm(default_max_tokens=48)
    svc = orchestrator.OrchestratorServicer(pipeline, Router(pipeline), OrchestratorMetrics(), MediaCheck(pipeline))
    monkeypatch.setattr(orchestrator, "unready_stage", lambda router, stages: None)  # no replicas needed
    costs = []

    async def admit(stages, priority=0, cost=0.0):
        costs.append(cost)
        raise Overloaded("recorded", retry_after_s=1.0)

    svc.admission.admit = admit
    for asked in ({}, {"max_tokens": 5}):
        with pytest.raises(orchestrator.Refused):
            async for _ in svc.generate(build_request("Hello", **asked)):
                pass
    assert costs == [48.0, 5.0]


def test_every_stage_is_sent_the_values_the_orchestrator_resolved():
    pipeline = example("qwen3-omni-tiny")
    request = build_request("Say it.", temperature=1e-9)  # every defaulted field left out; greedy
    resolved = resolve(request.params, pipeline.limits)
    run = RequestRun(pipeline, Router(pipeline), "r1", fill_resolved(request.params, resolved),
                     {"thinker": "text", "code2wav": "audio"})
    # Under other defaults a stage still reads the orchestrator's numbers: it applies none of its own.
    other = dataclasses.replace(pipeline.limits, default_max_tokens=3, default_codec_frames=7,
                                default_image_side=16, default_inference_steps=2)
    for stage, call in run._calls.items():
        assert call.header.params.text.max_tokens == resolved.max_tokens > 0, stage
        assert request_from_proto(call.header, pipeline.limits).params == resolved
        assert request_from_proto(call.header, other).params == resolved
