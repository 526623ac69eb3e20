"""The client's gRPC target for one or several orchestrator endpoints (omnistage.client.channel_target)."""

from __future__ import annotations

import json

import pytest

from omnistage.client import BALANCED, channel_target


@pytest.mark.parametrize("endpoints,target,options", [
    ("127.0.0.1:50051", "127.0.0.1:50051", []),
    ("orchestrator:50051", "orchestrator:50051", []),  # one address: any gRPC target, as it is
    # a target URI as it is, balanced (it may resolve to several replicas)
    ("dns:///omni-orchestrator-headless:50051", "dns:///omni-orchestrator-headless:50051", BALANCED),
    ("ipv4:10.0.0.5:50051,10.0.0.6:50051", "ipv4:10.0.0.5:50051,10.0.0.6:50051", BALANCED),
    (["10.0.0.5:50051"], "10.0.0.5:50051", []),
    (["10.0.0.5:50051", "10.0.0.6:50051"], "ipv4:10.0.0.5:50051,10.0.0.6:50051",
     [*BALANCED, ("grpc.default_authority", "10.0.0.5")]),
    ("10.0.0.5:50051, 10.0.0.6:50052", "ipv4:10.0.0.5:50051,10.0.0.6:50052",
     [*BALANCED, ("grpc.default_authority", "10.0.0.5")]),
    (("[::1]:1", "[fe80::2]:2"), "ipv6:[::1]:1,[fe80::2]:2", [*BALANCED, ("grpc.default_authority", "[::1]")]),
])
def test_targets(endpoints, target, options):
    assert channel_target(endpoints) == (target, options)


@pytest.mark.parametrize("endpoints,message", [
    ("", "no orchestrator endpoint"),
    ([], "no orchestrator endpoint"),
    (["orc-a:50051", "orc-b:50051"], "'orc-a:50051': several endpoints must each be IP:PORT"),
    (["10.0.0.5:50051", "10.0.0.6"], "'10.0.0.6': several endpoints must each be IP:PORT"),
    (["10.0.0.5:50051", "[::1]:1"], "mix IPv4 and IPv6"),
])
def test_refused(endpoints, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        channel_target(endpoints)


def test_several_replicas_balance_round_robin_and_health_check_the_orchestrator_service():
    config = json.loads(dict(BALANCED)["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "omnistage.v1.Orchestrator"}
