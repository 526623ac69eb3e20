"""The stage's domain errors; the servicer maps each to one gRPC status code (`servicer.status_for`)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine failed while working on a request (INTERNAL)."""


class EngineDead(EngineError):
    """The engine cannot recover: the replica is going down (UNAVAILABLE, so the caller may retry elsewhere)."""


class RequestFailed(EngineError):
    """The engine failed on this request alone, in the part of a batched step that uses only its own values
    (its sampling settings and generator, its guidance and scheduler): its batch neighbours went on and the
    engine serves on. INVALID_ARGUMENT, not INTERNAL: the same request fails the same way on any replica, so
    a retry elsewhere could only spread it."""


class EngineOverloaded(RuntimeError):
    """The stage's queue is full (RESOURCE_EXHAUSTED)."""


class StageDraining(RuntimeError):
    """The stage is shutting down and takes no new work (UNAVAILABLE)."""


class EngineConfigError(ValueError):
    """The deployment asks the engine for something it cannot do (an unknown engineArgs key, no adapter
    for the model): the stage refuses to start, naming the field."""


class InputError(ValueError):
    """Inputs from upstream that this engine cannot use: missing tensor, wrong shape (INVALID_ARGUMENT)."""


class CallerGone(Exception):
    """The caller cancelled while the stage still read its inputs: the request stops (counted as cancelled)."""
