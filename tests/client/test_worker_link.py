"""car_fl.client.worker_link: frames, the handshake, what the ClientApp says without a worker."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from car_fl.client import worker_link
from car_fl.client.worker_link import WorkerUnavailable
from car_fl.protocol import wire
from car_fl.settings.compose import NODE_CONFIG, WORKER


def test_headers_and_record_dicts_cross_the_socket_unchanged() -> None:
    weights = np.arange(12, dtype="<f4").reshape(3, 4)
    content = RecordDict(
        {
            "arrays": ArrayRecord({"head.weight": Array(weights)}),
            "config": ConfigRecord({"server-round": 3, "labels": ["ham", "spam"]}),
            "metrics": MetricRecord({"num-examples": 7, "loss": 0.25}),
        }
    )
    left, right = socket.socketpair()
    with left, right:
        worker_link.send_message(left, {"kind": "train", "run-id": 5}, b"payload")
        assert worker_link.recv_message(right) == ({"kind": "train", "run-id": 5}, b"payload")
        back = wire.decode_content(wire.encode_content(content))
    assert np.array_equal(back.array_records["arrays"]["head.weight"].numpy(), weights)
    assert dict(back.config_records["config"]) == {"server-round": 3, "labels": ["ham", "spam"]}
    assert dict(back.metric_records["metrics"]) == {"num-examples": 7, "loss": 0.25}


class HastyPeer:
    """The sending side of a socket pair whose reader takes what arrived after every send and
    closes as soon as it holds a whole message (a header frame and a body frame)."""

    def __init__(self) -> None:
        self.left, self.right = socket.socketpair()
        for side, option in ((self.left, socket.SO_SNDBUF), (self.right, socket.SO_RCVBUF)):
            side.setsockopt(socket.SOL_SOCKET, option, 2**18)  # a large frame fits unread
        self.right.setblocking(False)
        self.got = b""

    def sendall(self, data: bytes) -> None:
        self.left.sendall(data)
        if self.right.fileno() < 0:
            return
        with contextlib.suppress(BlockingIOError):
            while chunk := self.right.recv(2**20):
                self.got += chunk
        frames, rest = 0, self.got
        while len(rest) >= 8 and len(rest) >= 8 + struct.unpack(">Q", rest[:8])[0]:
            rest, frames = rest[8 + struct.unpack(">Q", rest[:8])[0] :], frames + 1
        if frames == 2:
            self.right.close()


@pytest.mark.parametrize("body", [b"", b"x" * (worker_link.SMALL_FRAME + 1)])
def test_a_message_is_sent_whole_before_a_hasty_peer_closes(body: bytes) -> None:
    """Once a message's last byte is out nothing more is sent: a worker answering a status at
    once and closing broke a ClientApp's empty-body request (Broken pipe)."""
    peer = HastyPeer()
    with peer.left:
        worker_link.send_message(peer, {"kind": "status"}, body)  # type: ignore[arg-type]
    assert peer.right.fileno() < 0 and peer.got.endswith(body)


def test_a_frame_over_the_limit_or_cut_short_is_refused() -> None:
    """A header or handshake frame (read before the secret is checked) is at most MAX_HEADER
    bytes, a body MAX_FRAME: a size above is refused before anything is allocated."""
    for limit, read in (
        (worker_link.MAX_FRAME, worker_link.recv_body),
        (worker_link.MAX_FRAME, worker_link.skip_body),
        (worker_link.MAX_HEADER, worker_link.recv_header),
        (worker_link.MAX_HEADER, worker_link.recv_frame),
    ):
        left, right = socket.socketpair()
        with left, right:
            left.sendall(struct.pack(">Q", limit + 1))
            with pytest.raises(ConnectionError, match="larger than"):
                read(right)
    left, right = socket.socketpair()
    with right:
        left.sendall(struct.pack(">Q", 10) + b"abc")
        left.close()
        with pytest.raises(ConnectionError, match="closed"):
            worker_link.recv_frame(right)


@pytest.mark.parametrize("announced", [1000, 3 * 2**20])
@pytest.mark.parametrize("read", [worker_link.recv_body, worker_link.skip_body])
def test_a_body_trickled_a_byte_at_a_time_times_out_as_a_whole(announced: int, read) -> None:
    """Each byte within the socket's timeout is not enough: a peer that trickles a body would
    hold the worker's round (which reads it under its one-round lock) or a connection slot,
    however large a body it announces (found by reviews)."""
    left, right = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        with contextlib.suppress(OSError):
            left.sendall(struct.pack(">Q", announced))
            while not stop.wait(0.05):
                left.sendall(b"x")

    thread = threading.Thread(target=trickle)
    thread.start()
    with left, right:
        right.settimeout(0.3)  # each byte comes well within it
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"of a frame's \d+ bytes came in time"):
            read(right)
        assert time.monotonic() - started < 1.5
        assert right.gettimeout() == 0.3  # the socket's own timeout is left as it was
        stop.set()
        thread.join(5)


def handshake(
    worker_secret: bytes, client_secret: bytes
) -> tuple[BaseException | None, BaseException | None]:
    """Both sides of the handshake over a socket pair; what each side raised."""
    left, right = socket.socketpair()
    raised: dict[str, BaseException | None] = {"worker": None, "client": None}

    def worker_side() -> None:
        try:
            worker_link.check_client(left, worker_secret, worker_link.greet(left))
        except BaseException as err:
            raised["worker"] = err
        finally:
            left.close()

    thread = threading.Thread(target=worker_side)
    thread.start()
    with right:
        right.settimeout(10)
        try:
            worker_link.prove(right, client_secret)
        except BaseException as err:
            raised["client"] = err
    thread.join(10)
    return raised["worker"], raised["client"]


def test_the_handshake_needs_the_secret_on_both_sides() -> None:
    assert handshake(b"s3cret", b"s3cret") == (None, None)
    worker_err, client_err = handshake(b"s3cret", b"guess")
    assert isinstance(worker_err, PermissionError)
    assert isinstance(client_err, WorkerUnavailable) and "refused" in str(client_err)


def test_a_fake_worker_without_the_secret_is_not_believed() -> None:
    left, right = socket.socketpair()

    def impostor() -> None:  # greets correctly, then answers with a MAC it cannot compute
        worker_link.greet(left)
        worker_link.recv_frame(left)
        worker_link.send_frame(left, b"\0" * 32)

    thread = threading.Thread(target=impostor)
    thread.start()
    with left, right, pytest.raises(WorkerUnavailable, match="does not hold its secret"):
        worker_link.prove(right, b"s3cret")
    thread.join(10)


def test_without_a_running_worker_the_round_fails_saying_how_to_start_it(
    short_dir: Path,
) -> None:
    content = RecordDict({"config": ConfigRecord({"server-round": 1})})

    def hand_over() -> None:
        worker_link.hand_over(short_dir, run_id=1, run_config={}, content=content)

    # never started here: no secret
    with pytest.raises(WorkerUnavailable, match=r"never run .*car-fl worker --dir"):
        hand_over()
    # started once, now gone: a secret, and a dead worker's socket file that nobody answers
    (short_dir / "secret").write_bytes(b"old")
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(short_dir / "worker.sock"))
    with pytest.raises(WorkerUnavailable, match=r"not running .*car-fl worker --dir") as err:
        hand_over()
    assert str(short_dir) in str(err.value)
    (short_dir / "worker.sock").unlink()
    with pytest.raises(WorkerUnavailable, match="not running"):
        hand_over()


def test_the_worker_folder_comes_from_the_node_config(tmp_path: Path) -> None:
    assert worker_link.WORKER_KEY == WORKER and WORKER in NODE_CONFIG
    assert worker_link.worker_folder({"partition-id": 0}) is None
    assert worker_link.worker_folder({WORKER: ""}) is None
    assert worker_link.worker_folder({WORKER: "~/w"}) == Path(os.path.expanduser("~/w"))
    with pytest.raises(ValueError, match="shorter worker folder"):
        worker_link.socket_path(tmp_path / ("x" * 120))
