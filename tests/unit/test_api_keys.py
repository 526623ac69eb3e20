"""The client API's keys: entries with and without a priority, constant-time matching over every key, and
the priority ceiling they lift."""

from __future__ import annotations

import hmac

import pytest

from omnistage.contract.params import InvalidRequest
from orchestrator_service.api_keys import ApiKey, ApiKeyError, ApiKeys, parse_entry
from orchestrator_service.servicer import checked_label


@pytest.mark.parametrize("entry,key", [
    ("abc", ApiKey(b"abc", None)), ("abc:5", ApiKey(b"abc", 5)), (" abc:0 ", ApiKey(b"abc", 0)),
])
def test_entries(entry, key):
    assert parse_entry(entry, 0) == key


@pytest.mark.parametrize("entry,why", [("", "must not be empty"), (":5", "must not be empty"),
                                       ("a b", "spaces"), ("a\tb:3", "spaces"),
                                       # one reading only: a key holds no ':', so KEY:N is never a key
                                       ("a:b", "must not contain ':'"), ("a:b:7", "must not contain ':'"),
                                       ("abc:", "must not contain ':'"), ("abc:²", "must not contain ':'")])
def test_bad_entries_are_refused_naming_the_entry_not_the_key(entry, why):
    with pytest.raises(ApiKeyError) as e:
        ApiKeys(["good", entry])
    assert str(e.value).startswith("API key 1:") and why in str(e.value)
    assert "good" not in str(e.value)


KEYS = ApiKeys(["first-key", "second-key:9"], max_priority=2)


@pytest.mark.parametrize("header,matched", [
    ("Bearer first-key", b"first-key"), ("bearer second-key", b"second-key"), ("Bearer  first-key ", b"first-key"),
    ("Bearer first-ke", None), ("Bearer first-key2", None), ("Bearer second-key:9", None),
    ("Basic first-key", None), ("first-key", None), ("", None), (None, None),
])
def test_bearer_keys(header, matched):
    key = KEYS.match(header)
    assert (key.secret if key else None) == matched


def test_every_key_is_compared(monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    assert KEYS.match("Bearer first-key") is not None
    assert compared == [b"first-key", b"second-key"]  # no early exit on the first match


@pytest.mark.parametrize("keys,header,priority,refused", [
    (ApiKeys(max_priority=0), None, 0, None),
    (ApiKeys(max_priority=0), None, 1, "priority"),
    (ApiKeys(max_priority=3), None, 3, None),
    (KEYS, None, 0, "unauthenticated"),
    (KEYS, "Bearer nope", 0, "unauthenticated"),
    (KEYS, "Bearer first-key", 2, None),          # no priority of its own: the pipeline's ceiling
    (KEYS, "Bearer first-key", 3, "priority"),
    (KEYS, "Bearer second-key", 9, None),
    (KEYS, "Bearer second-key", 10, "priority"),
    (ApiKeys(["low:1"], max_priority=4), "Bearer low", 4, None),  # a key never lowers the ceiling
])
def test_refusals(keys, header, priority, refused):
    got = keys.refusal(header, priority)
    assert (got[0] if got else None) == refused
    if refused == "priority":
        assert f"priority {priority} is above" in got[1]


@pytest.mark.parametrize("label,ok", [("", True), ("job-42/a:b.c_d", True), ("x" * 128, True), ("x" * 129, False),
                                      ("has space", False), ("tab\t", False), ("é", False), ("nl\n", False)])
def test_client_labels(label, ok):
    if ok:
        assert checked_label(label) == label
    else:
        with pytest.raises(InvalidRequest) as e:
            checked_label(label)
        assert e.value.field == "request_id"
