"""The deadline a request runs under: the caller's, bounded by the pipeline's requestTimeoutSeconds."""

from __future__ import annotations

import pytest

from orchestrator_service.servicer import effective_deadline

NOW = 1_000_000.0


@pytest.mark.parametrize("caller, request_timeout_s, expected", [
    (None, 600.0, NOW + 600),          # no deadline from the caller: the pipeline's
    (NOW + 5, 600.0, NOW + 5),         # an earlier one of the caller's stands
    (NOW + 900, 600.0, NOW + 600),     # a later one is cut to the pipeline's
    (None, 0.0, None),                 # 0: no default, and none from the caller
    (NOW + 900, 0.0, NOW + 900),
    (NOW - 1, 600.0, NOW - 1),         # already passed: stays passed
])
def test_the_earlier_deadline_wins(caller, request_timeout_s, expected):
    assert effective_deadline(caller, NOW, request_timeout_s) == expected
