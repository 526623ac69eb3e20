"""EndpointSlices -> ready stage addresses (pure); the endpoints file `omnistage serve` writes."""

import json
import os

import pytest

from omnistage.api import load_pipeline
from omnistage.contract.launch import stage_service_name
from orchestrator_service.discovery import FileDiscovery, read_endpoints_file, ready_addresses, slice_addresses

from ..conftest import EXAMPLES

SLICE = {"metadata": {"name": "p-talker-abc", "labels": {"kubernetes.io/service-name": "p-talker"}},
         "ports": [{"name": "http", "port": 8080}, {"name": "grpc", "port": 50051}],
         "endpoints": [{"addresses": ["127.0.1.2"], "conditions": {"ready": True}},
                       {"addresses": ["127.0.1.3"]},                               # no conditions: ready
                       {"addresses": ["127.0.1.9"], "conditions": {"ready": False}}]}


def test_ready_endpoints_only_on_the_grpc_port():
    assert slice_addresses(SLICE) == ["127.0.1.2:50051", "127.0.1.3:50051"]


def test_a_service_is_the_union_of_its_slices():
    other = {"metadata": {"name": "p-talker-def"}, "ports": [{"name": "grpc", "port": 50051}],
             "endpoints": [{"addresses": ["127.0.1.4"], "conditions": {"ready": True}},
                           {"addresses": ["127.0.1.2"]}]}
    assert ready_addresses([SLICE, other]) == ["127.0.1.2:50051", "127.0.1.3:50051", "127.0.1.4:50051"]


def test_single_unnamed_port_no_port_and_empty():
    assert slice_addresses({"ports": [{"port": 9}], "endpoints": [{"addresses": ["10.0.0.1"]}]}) == ["10.0.0.1:9"]
    assert slice_addresses({"ports": [{"name": "http", "port": 1}, {"name": "x", "port": 2}],
                            "endpoints": [{"addresses": ["1.1.1.1"]}]}) == []
    assert slice_addresses({"ports": None, "endpoints": None}) == []
    assert ready_addresses([]) == []


def test_service_name():
    assert stage_service_name("qwen3-omni-tiny", "talker") == "qwen3-omni-tiny-talker"


# ------------------------------------------------------------------ the endpoints file (omnistage serve)

def _pipeline():
    return load_pipeline(EXAMPLES / "qwen3-omni-tiny.yaml")


def test_endpoints_file_is_read_and_checked(tmp_path):
    p, path = _pipeline(), tmp_path / "endpoints.json"
    good = {"thinker": ["127.0.0.1:2", "127.0.0.1:1"], "talker": ["127.0.0.1:3"], "code2wav": []}
    path.write_text(json.dumps(good))
    assert read_endpoints_file(path, p) == {"thinker": ["127.0.0.1:1", "127.0.0.1:2"], "talker": ["127.0.0.1:3"],
                                            "code2wav": []}
    for doc, message in [([], "expected a JSON object"),
                         ({**good, "talkr": []}, "unknown stage(s) talkr"),
                         ({"thinker": [], "talker": []}, "no entry for code2wav"),
                         ({**good, "talker": "127.0.0.1:3"}, "talker: expected a list of host:port")]:
        path.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_endpoints_file(path, p)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="endpoints.json"):
        read_endpoints_file(path, p)


def test_file_discovery_applies_changes_and_keeps_the_last_good_file(tmp_path):
    p, path = _pipeline(), tmp_path / "endpoints.json"
    applied = []
    d = FileDiscovery(p, path, lambda stage, addrs: applied.append((stage, addrs)))
    d.poll()  # no file yet: nothing, not synced
    assert applied == [] and not d.synced.is_set()
    doc = {"thinker": ["127.0.0.1:1"], "talker": ["127.0.0.1:2"], "code2wav": ["127.0.0.1:3"]}
    path.write_text(json.dumps(doc))
    d.poll()
    assert sorted(applied) == [("code2wav", ["127.0.0.1:3"]), ("talker", ["127.0.0.1:2"]), ("thinker", ["127.0.0.1:1"])]
    assert d.synced.is_set()
    applied.clear()
    doc["talker"] = ["127.0.0.1:2", "127.0.0.1:4"]
    path.write_text(json.dumps(doc))
    os.utime(path, ns=(1, 2))  # a change the poll sees even within one mtime tick
    d.poll()
    assert applied == [("talker", ["127.0.0.1:2", "127.0.0.1:4"])]  # only what changed
    applied.clear()
    path.write_text('{"thinker": 1}')
    d.poll()
    assert applied == []  # a bad file is logged; the replicas stay as they were
