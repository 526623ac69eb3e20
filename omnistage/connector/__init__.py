"""The data plane: tensors move between stages by key, over UCX, shared memory or inline in gRPC.

`make_connector` builds one stage's Connector (put / get / release); `ChunkSender` and
`ChunkReceiver` put whole chunks through it with a byte budget, a TTL and per-edge metrics.
"""

from .connector import Connector, choose_transport, make_connector
from .errors import ChunkTooLarge, ConnectorError, PeerUnreachable, TensorNotFound
from .keys import TensorKey
from .metrics import TransferMetrics
from .transfer import ChunkReceiver, ChunkSender, ReceivedChunk

__all__ = ["ChunkReceiver", "ChunkSender", "ChunkTooLarge", "Connector", "ConnectorError", "PeerUnreachable",
           "ReceivedChunk", "TensorKey", "TensorNotFound", "TransferMetrics", "choose_transport", "make_connector"]
