"""A whole message's bytes: a ``RecordDict`` in Flower's own protobuf serialisation.

For the worker's socket and its run states; imports no torch or NumPy.
"""

from __future__ import annotations

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611


def encode_content(content: RecordDict) -> bytes:
    return bytes(recorddict_to_proto(content).SerializeToString())


def decode_content(data: bytes | bytearray) -> RecordDict:
    return recorddict_from_proto(ProtoRecordDict.FromString(data))
