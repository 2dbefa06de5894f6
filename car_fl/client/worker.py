"""The node's worker: a process beside the SuperNode that holds the encoder across rounds, runs.

Flower starts a new ClientApp process per message, so without it every round would load the
encoder again. The ClientApp hands each round over a local socket
(:mod:`car_fl.client.worker_link`); the worker keeps one :class:`car_fl.client.node.Node`,
built from its own node config, and answers one round at a time. Run states persist in
``runs/<id>.state``; one worker per folder (a file lock); :func:`supervise` restarts it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from car_fl.client.confinement import FOLDER_MODE, SECRET_MODE, SOCKET_MODE, exposed, share
from car_fl.client.node import RUNS_DIR, Node, RunStates, run_key
from car_fl.client.policy import NodePolicy
from car_fl.client.worker_link import (
    HANDSHAKE_TIMEOUT,
    POLICY_KEY,
    SECRET_NAME,
    WORKER_KEY,
    check_client,
    greet,
    read_secret,
    recv_body,
    recv_header,
    send_message,
    skip_body,
    socket_path,
)
from car_fl.common.io import atomic_write
from car_fl.model import encoder as encoder_module
from car_fl.protocol.failures import Failure
from car_fl.protocol.wire import decode_content, encode_content
from car_fl.settings.compose import (
    CACHE_DIR,
    DATA_PATH,
    NUM_PARTITIONS,
    PARTITION_ID,
    TEST_DATA_PATH,
)

log = logging.getLogger(__name__)

#: Exit codes of a worker process that :func:`supervise` does not restart.
EXIT_CONFIG = 2  # its node configuration is wrong (as argparse's usage errors)
EXIT_BUSY = 3  # another worker serves the folder
LOCK_NAME = "worker.lock"
#: Connections served at once; one more is closed unanswered (each holds a thread, and a
#: header's buffer before its round).
MAX_CONNECTIONS = 8
#: What a confined SuperNode's group must not read, by node-config key.
WATCHED = (
    ("the data file", DATA_PATH),
    ("the test data file", TEST_DATA_PATH),
    ("the feature cache", CACHE_DIR),
)


class WorkerBusy(RuntimeError):
    """Another worker already serves this folder."""


def own_node_config(folder: Path, node_config: Mapping[str, Any]) -> dict[str, Any]:
    """The worker's node configuration: its place in the federation is required; its cache
    defaults to ``<folder>/cache`` so that nothing the server sends chooses where it writes."""
    config = {k: v for k, v in node_config.items() if k != WORKER_KEY}
    for key in (PARTITION_ID, NUM_PARTITIONS):
        if not isinstance(config.get(key), int) or isinstance(config.get(key), bool):
            raise ValueError(
                f"the worker's --node-config needs {key}=<integer> (got {config.get(key)!r}); "
                "give it the SuperNode's --node-config, e.g. 'partition-id=0 num-partitions=2 "
                'data-path="/data/sms.tsv"\''
            )
    if config.get(CACHE_DIR) in (None, ""):
        config[CACHE_DIR] = str(folder / "cache")
    return config


@contextlib.contextmanager
def hold_folder(folder: Path, group: int | None = None) -> Iterator[IO[str]]:
    """An exclusive lock on the worker's folder for as long as this process serves it; the
    folder is the owner's alone, or enterable by name by the SuperNode's ``group``."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle = (folder / LOCK_NAME).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        other = handle.read().strip() or "?"
        handle.close()
        raise WorkerBusy(
            f"another car-fl worker (PID {other}) serves {folder}; stop it first, or give "
            "this one another --dir (one worker per device)"
        ) from None
    if group is None:  # once held: never under a worker that serves the folder
        folder.chmod(0o700)
    else:
        share(folder, group, FOLDER_MODE)
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    try:
        yield handle
    finally:
        handle.close()


def new_secret(folder: Path, group: int | None = None) -> bytes:
    """A fresh secret for this start, readable by the node's owner (and ``group``) only."""
    secret = secrets.token_hex(32).encode()

    def write(tmp: Path) -> None:
        if group is not None:  # before it holds the secret or has its name
            share(tmp, group, SECRET_MODE)
        tmp.write_bytes(secret)

    atomic_write(folder / SECRET_NAME, write, mode=0o600 if group is None else SECRET_MODE)
    return secret


@contextlib.contextmanager
def listening(folder: Path, group: int | None = None) -> Iterator[tuple[socket.socket, bytes]]:
    """The folder's lock, a fresh secret and the listening socket, removed again at the end;
    :class:`WorkerBusy` when another worker holds the folder. ``group``: the SuperNode's
    (:mod:`car_fl.client.confinement`), which may then read the secret and use the socket."""
    path = socket_path(folder)
    with hold_folder(folder, group), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        path.unlink(missing_ok=True)  # a dead worker's: we hold the folder's lock
        secret = new_secret(folder, group)
        umask = os.umask(0o177)  # the socket is the owner's only from the start
        try:
            sock.bind(str(path))
        finally:
            os.umask(umask)
        if group is not None:
            share(path, group, SOCKET_MODE)
        sock.listen(64)
        try:
            yield sock, secret
        finally:
            path.unlink(missing_ok=True)


class NodeWorker:
    """Serves rounds over ``<folder>/worker.sock`` with the node's own configuration."""

    def __init__(
        self, folder: Path, node_config: Mapping[str, Any], *, group: int | None = None
    ) -> None:
        self.folder = Path(folder).expanduser().resolve()
        self.node_config = own_node_config(self.folder, node_config)
        #: The node this worker keeps alive: its policy, ledger, settings and shards.
        self.node = Node(self.node_config, states=RunStates(self.folder / RUNS_DIR))
        #: The SuperNode's own group (None: it runs as the owner): see ``confinement``.
        self.group = group
        if group is not None:
            self.refuse_exposed(group)
        self.rounds = 0
        self.failed = 0
        self.busy_run: int | None = None
        self._round = threading.Lock()
        #: Connections served at once (a status beside a round, a round's waiting rivals).
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self.ready = threading.Event()

    def refuse_exposed(self, group: int) -> None:
        """``ValueError`` without a privacy policy (the run would choose what is released and
        read), or while the SuperNode's ``group`` could read or replace what the node keeps."""
        config = self.node_config
        if not config.get(POLICY_KEY):
            raise ValueError(
                f"--supernode-group needs a privacy policy in the worker's --node-config "
                f"({POLICY_KEY}=/path/policy.toml, docs/privacy.md): without one the run "
                "chooses what this node releases (dp=none too) and which of its files it reads"
            )
        paths = [("the run states", self.folder / RUNS_DIR)]
        paths += [(what, Path(str(config[key]))) for what, key in WATCHED if config.get(key)]
        if config.get(POLICY_KEY):
            paths.append(("the privacy ledger", NodePolicy.load(config[POLICY_KEY]).ledger))
            paths.append(("the privacy policy", Path(str(config[POLICY_KEY]))))
        found = exposed(paths, group)
        if found:
            raise ValueError("; ".join(found))

    def stop(self) -> None:
        """End :meth:`serve` (within half a second); a round in progress is abandoned."""
        self._stop.set()

    def serve(self, listener: socket.socket, secret: bytes) -> None:
        """Answer connections on ``listener`` until :meth:`stop` (see :func:`listening`)."""
        listener.settimeout(0.5)
        log.info(
            "car-fl worker PID %d: partition %s of %s, device %s, cache %s; listening on %s",
            os.getpid(),
            self.node_config[PARTITION_ID],
            self.node_config[NUM_PARTITIONS],
            self.node_config.get("device", "auto"),
            self.node_config[CACHE_DIR],
            socket_path(self.folder),
        )
        self.ready.set()
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                if not self._connections.acquire(blocking=False):
                    log.warning("%d connections at once: one more was closed", MAX_CONNECTIONS)
                    conn.close()
                    continue
                threading.Thread(
                    target=self._serve_connection, args=(conn, secret), daemon=True
                ).start()
        finally:
            self.ready.clear()

    def status(self) -> dict[str, Any]:
        """What the worker has done; under a SuperNode group only its PID: the server's code
        may ask, and the encoder's loads say whether the node's records changed between runs."""
        if self.group is not None:
            return {"pid": os.getpid()}
        return {
            "pid": os.getpid(),
            "rounds": self.rounds,
            "failed": self.failed,
            "encoder-loads": encoder_module.LOAD_COUNT,
            "runs": [int(run) for run in self.node.states.runs()],
            "busy-run": self.busy_run,
        }

    # ------------------------------------------------------------------------------- requests
    def _serve_connection(self, conn: socket.socket, secret: bytes) -> None:
        try:
            with conn:
                self._answer(conn, secret)
        finally:
            self._connections.release()

    def _answer(self, conn: socket.socket, secret: bytes) -> None:
        conn.settimeout(HANDSHAKE_TIMEOUT)  # a frame: within it plus a second per MiB received
        try:
            check_client(conn, secret, greet(conn))
            header = recv_header(conn)
            kind = header.get("kind")
            if kind == "train":  # its body is read once the round is its own: one at a time
                answer = self._train(header, conn)
            else:
                skip_body(conn)
                answer = {"ok": False, "error": f"unknown request {kind!r}"}, b""
                if kind == "status":
                    answer = {"ok": True, **self.status()}, b""
        except PermissionError as err:
            log.warning("%s", err)
            return
        except (OSError, ConnectionError, ValueError) as err:
            log.warning("a connection ended before its request: %s", err)
            return
        try:
            send_message(conn, *answer)
        except OSError as err:
            log.warning("the ClientApp left before the answer: %s", err)

    def _train(
        self, header: Mapping[str, Any], conn: socket.socket
    ) -> tuple[dict[str, Any], bytes]:
        """The answer to a train request whose body ``conn`` carries next."""
        try:
            run_id = int(run_key(header["run-id"]))
            run_config = dict(header["run-config"])
        except (KeyError, TypeError, ValueError):
            skip_body(conn)
            return {"ok": False, "error": "a train request needs 'run-id' and 'run-config'"}, b""
        refused = self._policy_mismatch(header.get("policy"))
        if refused:
            skip_body(conn)
            self.failed += 1
            log.error("run %d: round refused: %s", run_id, refused)
            if self.group is not None:  # the text names the owner's files
                refused = f"{Failure.NODE_CONFIG.name} (the worker's log says why)"
            return {"ok": False, "failure": int(Failure.NODE_CONFIG), "error": refused}, b""
        with self._round:  # one round at a time on this node's device, whatever the run
            body = recv_body(conn)  # one body in memory at a time, whatever the connections
            conn.settimeout(None)  # the round takes as long as it takes
            self.busy_run = run_id
            tick = time.perf_counter()
            log.info("run %d: a round starts", run_id)
            try:  # the run's state: a copy, kept only if the round succeeds (Node.answer)
                reply = self.node.answer(
                    decode_content(body), run_config=run_config, run=str(run_id)
                )
                payload = encode_content(reply)
            except Exception as err:
                self.failed += 1
                log.exception("run %d: the round failed", run_id)
                failure = Node.failure(err)  # the fixed reply the ClientApp gives the server
                error = f"{type(err).__name__}: {err}"
                if self.group is not None:  # a ClientApp of another account reads no text
                    error = f"{failure.name} (the worker's log says why)"
                return {"ok": False, "failure": int(failure), "error": error}, b""
            finally:
                self.busy_run = None
            self.rounds += 1
            log.info("run %d: round answered in %.2f s", run_id, time.perf_counter() - tick)
            return {"ok": True}, payload

    def _policy_mismatch(self, named: object) -> str | None:
        """Why a round must be refused: the SuperNode names a privacy policy that this worker's
        node config does not (it would silently not hold); ``None``: nothing to refuse."""
        if not named:
            return None
        mine = self.node_config.get(POLICY_KEY)

        def where(path: object) -> Path:
            return Path(str(path)).expanduser().resolve()

        if mine and where(mine) == where(named):
            return None
        return (
            f"the SuperNode's node config names the privacy policy {named}, but this worker's "
            f"--node-config has {POLICY_KEY}={mine or '(none)'}; start the worker with "
            f"{POLICY_KEY}={named} in its --node-config"
        )


def serve(
    folder: Path,
    node_config: Mapping[str, Any],
    *,
    listen_fd: int | None = None,
    group: int | None = None,
) -> int:
    """Run a worker in this process until SIGTERM or SIGINT; the process's exit code.
    ``listen_fd``: a listening socket inherited from :func:`supervise`."""
    try:
        worker = NodeWorker(folder, node_config, group=group)
    except ValueError as err:
        log.error("%s", err)
        return EXIT_CONFIG
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: worker.stop())
    if listen_fd is not None:
        with socket.socket(fileno=listen_fd) as sock:
            worker.serve(sock, read_secret(worker.folder))
    else:
        try:
            with listening(worker.folder, group) as (sock, secret):
                worker.serve(sock, secret)
        except WorkerBusy as err:
            log.error("%s", err)
            return EXIT_BUSY
    log.info("car-fl worker PID %d stopped", os.getpid())
    return 0


def supervise(
    folder: Path,
    command: Sequence[str],
    *,
    quick: float = 10.0,
    max_wait: float = 60.0,
    group: int | None = None,
) -> int:
    """Hold the worker's folder and socket; run ``command`` (given ``--listen-fd N``) and start
    it again whenever it dies, until SIGTERM or SIGINT, except after exit 0 or
    :data:`EXIT_CONFIG`. The wait doubles, up to ``max_wait``, while it dies within ``quick``."""
    stopping = threading.Event()
    child: list[subprocess.Popen[bytes]] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        for proc in child:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    try:
        with listening(Path(folder), group) as (sock, _):
            fd = sock.fileno()
            log.info("car-fl worker supervisor PID %d holds %s", os.getpid(), folder)
            wait = 1.0
            while not stopping.is_set():
                started = time.monotonic()
                proc = subprocess.Popen([*command, "--listen-fd", str(fd)], pass_fds=(fd,))
                child[:] = [proc]
                code = proc.wait()
                if stopping.is_set():
                    break
                if code in (0, EXIT_CONFIG):
                    return code
                lived = time.monotonic() - started
                wait = 1.0 if lived >= quick else min(2 * wait, max_wait)
                log.warning(
                    "the worker (PID %d) ended with %s after %.0f s; starting it again in %.0f s",
                    proc.pid,
                    f"signal {-code}" if code < 0 else f"exit code {code}",
                    lived,
                    wait,
                )
                stopping.wait(wait)
            for proc in child:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    except WorkerBusy as err:
        log.error("%s", err)
        return EXIT_BUSY
    return 0
