"""The ClientApp's side of the node's worker: hand it a round over a local socket, return its reply.

HMAC-SHA256 handshake both ways, length-prefixed frames (a JSON header, then the RecordDict)
and timeouts over a Unix socket whose folder and secret only the node's owner can read. Imports
only the standard library and Flower, so the ClientApp process imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import RecordDict

from car_fl.client.failures import Refusal
from car_fl.protocol.failures import Failure
from car_fl.protocol.wire import decode_content, encode_content

#: The node-config key of the worker's folder (not imported: settings would load OmegaConf).
WORKER_KEY = "worker"
#: The node-config key of the node owner's privacy policy (``car_fl.settings.compose``'s).
POLICY_KEY = "privacy-policy"
SOCKET_NAME = "worker.sock"
SECRET_NAME = "secret"
PROTOCOL = b"car-fl-worker/1"
NONCE_BYTES = 32
#: Longest frame of the handshake or a JSON header either side accepts.
MAX_HEADER = 2**20
#: Longest body (a serialised RecordDict) either side accepts.
MAX_FRAME = 4 * 2**30
#: Seconds for connecting and the handshake; a round itself may take as long as it takes.
HANDSHAKE_TIMEOUT = 30.0
#: A Unix socket's path must be shorter than this (104 bytes on macOS, 108 on Linux).
MAX_SOCKET_PATH = 100

HOW_TO_START = (
    "start it on this machine with `car-fl worker --dir {folder} --node-config '<this "
    "SuperNode's --node-config>'` (docs/deployment.md, 'The node's worker')"
)


class WorkerUnavailable(RuntimeError):
    """The node's worker cannot be reached, refused this process, or ended mid-round."""


class WorkerFailed(Refusal):
    """The worker ran the round and it failed there; ``failure`` is the fixed code it chose."""


def worker_folder(node_config: Mapping[str, Any]) -> Path | None:
    """The folder of this node's worker, from its node config; ``None``: no worker."""
    value = node_config.get(WORKER_KEY)
    return Path(str(value)).expanduser() if value not in (None, "") else None


def socket_path(folder: Path) -> Path:
    path = folder / SOCKET_NAME
    if len(os.fsencode(path)) >= MAX_SOCKET_PATH:
        raise ValueError(
            f"the worker's socket path {path} is {len(os.fsencode(path))} bytes; a Unix socket "
            f"needs fewer than {MAX_SOCKET_PATH}: choose a shorter worker folder"
        )
    return path


# ------------------------------------------------------------------------------------ frames
#: A payload up to this size goes out with its length in one send; a larger one is not copied.
SMALL_FRAME = 2**16


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """One frame; once its last byte is sent nothing more is (the peer may have read it and
    closed: a second, empty send would then fail with a broken pipe)."""
    size = struct.pack(">Q", len(payload))
    if len(payload) <= SMALL_FRAME:
        sock.sendall(size + payload)
    else:
        sock.sendall(size)
        sock.sendall(payload)


#: Past a socket's timeout, a frame read under it must keep arriving at this many bytes a
#: second on average: a peer sending a byte at a time would hold the worker's round (a local
#: socket carries gigabytes a second).
MIN_BYTES_PER_SECOND = 2**20


def _read_exactly(sock: socket.socket, size: int) -> bytearray:
    """``size`` bytes, received into one buffer (never held twice); under a socket timeout,
    ``TimeoutError`` once the time taken passes it plus a second per
    :data:`MIN_BYTES_PER_SECOND` bytes received (not announced: a peer cannot buy time)."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    timeout, started = sock.gettimeout(), time.monotonic()
    try:
        while got < size:
            if timeout is not None:
                left = started + timeout + got / MIN_BYTES_PER_SECOND - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(min(timeout, left))
            received = sock.recv_into(view[got:], min(size - got, 2**20))
            if not received:
                raise ConnectionError("the other side closed the connection")
            got += received
    except TimeoutError:  # the deadline, or one recv's timeout
        raise TimeoutError(f"{got} of a frame's {size} bytes came in time") from None
    finally:
        sock.settimeout(timeout)
    return buffer


def _frame_size(sock: socket.socket, limit: int) -> int:
    (size,) = struct.unpack(">Q", _read_exactly(sock, 8))
    if size > limit:
        raise ConnectionError(f"a frame of {size} bytes is larger than {limit}")
    return int(size)


def recv_frame(sock: socket.socket, limit: int = MAX_HEADER) -> bytearray:
    """One frame of at most ``limit`` bytes (a header's or the handshake's by default)."""
    return _read_exactly(sock, _frame_size(sock, limit))


def skip_body(sock: socket.socket) -> None:
    """Read a body and keep none of it (a request answered without it), a MiB at a time, each
    under :func:`_read_exactly`'s deadline."""
    left = _frame_size(sock, MAX_FRAME)
    while left:
        left -= len(_read_exactly(sock, min(left, 2**20)))


def send_message(sock: socket.socket, header: Mapping[str, Any], body: bytes = b"") -> None:
    """A JSON header and a body, one frame each."""
    send_frame(sock, json.dumps(dict(header)).encode())
    send_frame(sock, body)


def recv_header(sock: socket.socket) -> dict[str, Any]:
    """A message's JSON header (its body follows: :func:`recv_body`)."""
    header = json.loads(recv_frame(sock))
    if not isinstance(header, dict):
        raise ConnectionError("the header is not a JSON object")
    return header


def recv_body(sock: socket.socket) -> bytearray:
    return recv_frame(sock, MAX_FRAME)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    return recv_header(sock), recv_body(sock)


# --------------------------------------------------------------------------------- handshake
def _mac(secret: bytes, role: bytes, *nonces: bytes | bytearray) -> bytes:
    return hmac.new(secret, PROTOCOL + role + b"".join(nonces), hashlib.sha256).digest()


def read_secret(folder: Path) -> bytes:
    path = folder / SECRET_NAME
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        raise WorkerUnavailable(
            f"this node's car-fl worker has never run in {folder} (no {SECRET_NAME} file); "
            + HOW_TO_START.format(folder=folder)
        ) from None
    except PermissionError:
        raise WorkerUnavailable(
            f"this process may not read the worker's secret {path}: run the SuperNode as the "
            "user who runs the worker"
        ) from None


def greet(sock: socket.socket) -> bytes:
    """Worker side, first step: send the protocol name and a fresh nonce; the nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    send_frame(sock, PROTOCOL + nonce)
    return nonce


def check_client(sock: socket.socket, secret: bytes, nonce: bytes) -> None:
    """Worker side: the client proves it holds the secret, then the worker proves it too."""
    answer = recv_frame(sock)
    theirs, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if len(theirs) != NONCE_BYTES or not hmac.compare_digest(
        mac, _mac(secret, b"client", nonce, theirs)
    ):
        raise PermissionError("a client without the worker's secret was refused")
    send_frame(sock, _mac(secret, b"worker", theirs, nonce))


def prove(sock: socket.socket, secret: bytes) -> None:
    """Client side: answer the worker's nonce, check the worker's answer to ours."""
    hello = recv_frame(sock)
    if not hello.startswith(PROTOCOL) or len(hello) != len(PROTOCOL) + NONCE_BYTES:
        raise WorkerUnavailable(
            f"what answers at the worker's socket does not speak {PROTOCOL.decode()} (a "
            "different car-fl version?); restart the worker with this version"
        )
    theirs = hello[len(PROTOCOL) :]
    mine = secrets.token_bytes(NONCE_BYTES)
    send_frame(sock, mine + _mac(secret, b"client", theirs, mine))
    try:
        answer = recv_frame(sock)
    except ConnectionError:
        raise WorkerUnavailable(
            "the worker refused this process: the secret it read does not match the worker's "
            "(was the worker restarted just now? then the next round works)"
        ) from None
    if not hmac.compare_digest(answer, _mac(secret, b"worker", mine, theirs)):
        raise WorkerUnavailable("what answers at the worker's socket does not hold its secret")


# ----------------------------------------------------------------------------------- client
def connect(folder: Path) -> socket.socket:
    """An authenticated connection to the worker in ``folder``."""
    path = socket_path(folder)
    secret = read_secret(folder)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        sock.connect(str(path))
        prove(sock, secret)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        raise WorkerUnavailable(
            f"this node's car-fl worker is not running (nothing answers at {path}); "
            + HOW_TO_START.format(folder=folder)
        ) from None
    except (OSError, ConnectionError) as err:
        sock.close()
        raise WorkerUnavailable(
            f"this node's car-fl worker did not complete the handshake ({err}); "
            + HOW_TO_START.format(folder=folder)
        ) from None
    except BaseException:
        sock.close()
        raise
    return sock


def request(
    folder: Path, header: Mapping[str, Any], body: bytes = b"", *, timeout: float | None = None
) -> tuple[dict[str, Any], bytearray]:
    """Send one request to the worker, wait for its answer (``timeout``: ``None`` = no limit)."""
    with connect(folder) as sock:
        sock.settimeout(timeout)
        try:
            send_message(sock, header, body)
            answer, payload = recv_message(sock)
        except (ConnectionError, OSError) as err:
            raise WorkerUnavailable(
                f"this node's car-fl worker stopped before it answered ({err}); its log says "
                "why. A worker started with restarts on comes back by itself and the next round "
                "works; otherwise " + HOW_TO_START.format(folder=folder)
            ) from None
    if not answer.get("ok"):
        try:
            failure = Failure(int(answer.get("failure", Failure.ROUND_FAILED)))
        except (TypeError, ValueError):
            failure = Failure.ROUND_FAILED
        raise WorkerFailed(failure, f"the node's worker failed the round: {answer.get('error')}")
    return answer, payload


def hand_over(
    folder: Path,
    *,
    run_id: int,
    run_config: Mapping[str, Any],
    content: RecordDict,
    policy: object = None,
) -> RecordDict:
    """Have the node's worker answer a train message; the reply's content. ``policy``: the
    SuperNode's privacy policy, which the worker's own node config must name too."""
    header = {"kind": "train", "run-id": int(run_id), "run-config": dict(run_config)}
    if policy:
        header["policy"] = str(policy)
    _, payload = request(folder, header, encode_content(content))
    return decode_content(payload)


def status(folder: Path, *, timeout: float = HANDSHAKE_TIMEOUT) -> dict[str, Any]:
    """The worker's PID, rounds served, encoder loads and runs seen (answered between rounds
    and during one)."""
    answer, _ = request(folder, {"kind": "status"}, timeout=timeout)
    return answer
