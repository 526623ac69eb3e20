"""The errors the data plane raises. Each message names the tensor, the peer or the limit at fault."""

from __future__ import annotations


class ConnectorError(RuntimeError):
    """A tensor could not be stored or fetched."""


class TensorNotFound(ConnectorError):
    """The producer no longer holds the tensor: consumed, released on cancel, or expired by the TTL."""


class BadReference(ConnectorError):
    """A reference no producer's store made (a foreign segment name or host, bytes that are not a tensor
    header, sizes that disagree): the caller's input is at fault, not the data plane."""


class PeerUnreachable(ConnectorError):
    """The producer's connector cannot be reached or failed mid-transfer."""


class ChunkTooLarge(ConnectorError):
    """A chunk bigger than the stage's whole buffer budget: it could never be admitted."""
