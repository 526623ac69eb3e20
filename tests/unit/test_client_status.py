"""What a client is told when a stage fails: the stage and why, never a replica's address or a shared-memory
path (those go to the orchestrator's log)."""

from __future__ import annotations

import grpc

from orchestrator_service.stage_call import client_status


def test_replica_addresses_and_shm_paths_are_not_in_the_clients_message():
    details = ("fetching thinker/r1/3 from 10.244.1.17:7001 failed: /dev/shm/omnistage-4026531836-77-ab12 is gone; "
               "peer [fd00::12]:7001 closed")
    code, message = client_status("talker", grpc.StatusCode.INTERNAL, details)
    assert code == grpc.StatusCode.UNAVAILABLE and message.startswith("stage talker failed: fetching thinker/r1/3")
    assert "10.244" not in message and "/dev/shm" not in message and "fd00" not in message
    assert message.count("<internal>") == 3


def test_the_requests_own_statuses_pass_as_the_stage_gave_them():
    assert client_status("talker", grpc.StatusCode.INVALID_ARGUMENT, "params.audio.speaker: unknown") == (
        grpc.StatusCode.INVALID_ARGUMENT, "params.audio.speaker: unknown")
