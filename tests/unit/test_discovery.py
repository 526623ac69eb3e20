"""EndpointSlices -> ready stage addresses (pure)."""

from omnistage.launch import stage_service_name
from orchestrator_service.discovery import ready_addresses, slice_addresses

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
