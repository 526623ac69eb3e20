"""Fuzz the OmniPipeline validator and the admission webhook with what a user or the API server could hand
them: arbitrary YAML-like documents (nested mappings, lists and scalars, keys of any type), and the
examples with a part replaced, removed or added. The validator gives a Pipeline or SpecError whose every
error names a field; the webhook allows, or denies with 422 and those errors; nothing else escapes."""

from __future__ import annotations

import copy

import kopf
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnistage.api import Pipeline, SpecError, parse_pipeline, parse_pipeline_yaml, validate
from omnistage_operator.handlers import validate as webhook

from ..conftest import EXAMPLES

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Mutating an example costs more to draw than to validate: fewer of those.
FUZZ_MUTATED = settings(FUZZ, max_examples=80)
EXAMPLE_DOCS = [yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 70000),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["", "auto", "shm", "ar", "vllm", "1Gi", "250m", "-1", "llm", "text"]))
keys = st.text(max_size=10) | st.sampled_from(["name", "stage", "stages", "inputs", "spec", "metadata", "topology",
                                               "deployment", "replicas", "limits", "outputs", "engine", "kind"])
documents = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    keys | st.integers(-2, 2) | st.none() | st.booleans(), inner, max_size=4), max_leaves=25)


@st.composite
def mutated_examples(draw):
    """An example with one part (anywhere in it) replaced, removed, or given an extra key."""
    doc = copy.deepcopy(draw(st.sampled_from(EXAMPLE_DOCS)))
    for _ in range(draw(st.integers(1, 3))):
        parent, at = doc, None
        while True:  # walk down to a random place
            children = list(parent.items()) if isinstance(parent, dict) else list(enumerate(parent)) \
                if isinstance(parent, list) else []
            if not children or draw(st.integers(0, 3)) == 0:
                break
            k, child = draw(st.sampled_from(children))
            if not isinstance(child, (dict, list)):
                at = k
                break
            parent = child
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        if isinstance(parent, dict):
            k = at if at is not None else draw(st.sampled_from(list(parent) or ["x"]))
            if action == "remove":
                parent.pop(k, None)
            elif action == "add":
                parent[draw(keys)] = draw(documents)
            else:
                parent[k] = draw(documents)
        elif isinstance(parent, list):
            if action == "add" or not parent:
                parent.append(draw(documents))
            elif action == "remove":
                parent.pop(draw(st.integers(0, len(parent) - 1)))
            else:
                parent[draw(st.integers(0, len(parent) - 1))] = draw(documents)
    return doc


def _with_first_stage_named(doc: dict, name) -> dict:
    doc = copy.deepcopy(doc)
    doc["spec"]["topology"]["stages"][0]["name"] = name
    return doc


OMNI_STAGE_NAMED_BY_A_LIST = _with_first_stage_named(
    yaml.safe_load((EXAMPLES / "qwen2.5-omni-tiny.yaml").read_text()), [])


def check_validator(doc) -> None:
    errors = validate(doc)
    assert all(e.path and e.message for e in errors), errors
    try:
        pipeline = parse_pipeline(doc)
    except SpecError as e:
        assert errors and e.errors == tuple(errors)
        return
    assert not errors and isinstance(pipeline, Pipeline)


def check_webhook(doc) -> None:
    try:
        assert webhook(body=doc) is None
    except kopf.AdmissionError as e:
        assert e.code == 422 and str(e)


@FUZZ
@given(documents | st.builds(lambda spec: {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
                                            "metadata": {"name": "p"}, "spec": spec}, documents))
def test_any_document_gives_a_pipeline_or_field_errors(doc):
    check_validator(doc)


@FUZZ_MUTATED
@given(mutated_examples())
@example(OMNI_STAGE_NAMED_BY_A_LIST).via("a stage name that is a list: TypeError (unhashable) in the graph check")
def test_a_mutated_example_gives_a_pipeline_or_field_errors(doc):
    check_validator(doc)


@FUZZ_MUTATED
@given(documents | mutated_examples())
def test_the_webhook_allows_or_denies_any_body_with_field_errors(doc):
    if not isinstance(doc, dict):
        doc = {"spec": doc}  # an admission body is always an object
    if not isinstance(doc.get("metadata", {}), dict):
        doc["metadata"] = {"name": doc["metadata"]}  # the API server admits only an object (ObjectMeta) here
    check_webhook(doc)


@pytest.mark.parametrize("metadata", [["x"], "x"])
def test_the_webhook_denies_metadata_that_is_not_a_mapping(metadata):
    with pytest.raises(kopf.AdmissionError) as e:  # denied naming the field, not a 500
        webhook(body={"metadata": metadata, "spec": {}})
    assert e.value.code == 422 and "metadata" in str(e.value)


@FUZZ_MUTATED
@given(st.text(max_size=200) | st.builds(yaml.safe_dump, mutated_examples()))
def test_any_yaml_text_gives_a_pipeline_or_field_errors(text):
    try:
        parse_pipeline_yaml(text, source="fuzz.yaml")
    except SpecError as e:
        assert e.errors and all(x.path for x in e.errors)
