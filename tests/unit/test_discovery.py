"""Endpoints -> ready stage addresses (pure)."""

from orchestrator_service.discovery import ready_addresses, service_name


def test_ready_addresses_only_and_the_grpc_port():
    ep = {"subsets": [
        {"addresses": [{"ip": "127.0.1.2"}, {"ip": "127.0.1.3"}], "notReadyAddresses": [{"ip": "127.0.1.9"}],
         "ports": [{"name": "http", "port": 8080}, {"name": "grpc", "port": 50051}]},
        {"addresses": [{"ip": "127.0.1.4"}], "ports": [{"name": "grpc", "port": 50052}]},
    ]}
    assert ready_addresses(ep) == ["127.0.1.2:50051", "127.0.1.3:50051", "127.0.1.4:50052"]


def test_single_unnamed_port_and_empty_subsets():
    assert ready_addresses({"subsets": [{"addresses": [{"ip": "10.0.0.1"}], "ports": [{"port": 9}]}]}) == \
        ["10.0.0.1:9"]
    assert ready_addresses({"subsets": None}) == []
    assert ready_addresses({}) == []
    assert ready_addresses({"subsets": [{"addresses": [{"ip": "1.1.1.1"}],
                                         "ports": [{"name": "http", "port": 1}, {"name": "x", "port": 2}]}]}) == []


def test_service_name():
    assert service_name("qwen3-omni-tiny", "talker") == "qwen3-omni-tiny-talker"
