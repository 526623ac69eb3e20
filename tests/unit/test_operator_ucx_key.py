"""The admission webhook and the UCX data-plane key: only the chart issuer gives stage pods the pipeline's
key (docs/security.md, "The UCX data plane"); under any other issuer an edge that names `transport: ucx`
would crash-loop its stages, so the webhook refuses it, naming the field."""

from __future__ import annotations

import copy

import kopf
import pytest
import yaml

from omnistage_operator.handlers import validate

from ..conftest import EXAMPLES

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())


def _with_transport(transport: str) -> dict:
    doc = copy.deepcopy(BASE)
    doc["spec"]["topology"]["stages"][1]["inputs"][0]["transport"] = transport
    return doc


def test_without_a_data_plane_key_a_ucx_edge_is_refused_naming_the_field():
    with pytest.raises(kopf.AdmissionError) as err:
        validate(body=_with_transport("ucx"), memo=kopf.Memo(ucx_keyed=False))
    assert err.value.code == 422
    assert "spec.topology.stages[1].inputs[0].transport: ucx needs the pipeline's data-plane key" in str(err.value)


@pytest.mark.parametrize("transport, keyed", [("ucx", True), ("auto", False), ("inline", False)])
def test_a_ucx_edge_with_the_key_and_other_edges_without_it_are_admitted(transport, keyed):
    validate(body=_with_transport(transport), memo=kopf.Memo(ucx_keyed=keyed))
