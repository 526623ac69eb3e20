"""The data plane: tensors move between stages by key, over UCX, shared memory or inline in gRPC.

`make_connector` builds one stage's Connector (put / get / release); `ChunkSender` and
`ChunkReceiver` put whole chunks through it with a byte budget, a TTL and per-edge metrics.
"""

from omnistage.connector.connector import Connector, choose_transport, make_connector
from omnistage.connector.errors import ChunkTooLarge, ConnectorError, PeerUnreachable, TensorNotFound
from omnistage.connector.keys import TensorKey
from omnistage.connector.metrics import TransferMetrics
from omnistage.connector.transfer import ChunkReceiver, ChunkSender, ReceivedChunk

__all__ = ["ChunkReceiver", "ChunkSender", "ChunkTooLarge", "Connector", "ConnectorError", "PeerUnreachable",
           "ReceivedChunk", "TensorKey", "TensorNotFound", "TransferMetrics", "choose_transport", "make_connector"]
