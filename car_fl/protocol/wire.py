"""A whole message's bytes: a ``RecordDict`` in Flower's own protobuf serialisation.

What the ClientApp hands the node's worker over its socket, the worker's reply, and a run's
state on the worker's disk. Imports Flower's serialisation only (no torch, no NumPy): a
ClientApp that hands its round to a worker stays light.
"""

from __future__ import annotations

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611


def encode_content(content: RecordDict) -> bytes:
    """``content`` in Flower's protobuf serialisation."""
    return bytes(recorddict_to_proto(content).SerializeToString())


def decode_content(data: bytes) -> RecordDict:
    """The ``RecordDict`` of :func:`encode_content`'s bytes."""
    return recorddict_from_proto(ProtoRecordDict.FromString(data))
