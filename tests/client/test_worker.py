"""car_fl.client.worker: the node's worker, its rounds, its per-run state and its restarts.

The fast tests serve a worker in a thread of this process with a stand-in for the round (what
matters there is what reaches it and what is kept); the slow ones start ``car-fl worker``
processes and send them real rounds of a tiny Llama from fresh ClientApp processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from car_fl.client import worker_link
from car_fl.client.failures import Refusal, failure_of
from car_fl.client.node import Node
from car_fl.client.worker import (
    MAX_CONNECTIONS,
    NodeWorker,
    WorkerBusy,
    listening,
    own_node_config,
)
from car_fl.client.worker_link import (
    HANDSHAKE_TIMEOUT,
    MAX_FRAME,
    MAX_HEADER,
    MIN_BYTES_PER_SECOND,
    WorkerFailed,
    WorkerUnavailable,
)
from car_fl.data.splits import load_splits
from car_fl.model.retriever import build_retriever
from car_fl.protocol import wire
from car_fl.protocol.failures import Failure
from car_fl.protocol.messages import from_record, to_record
from car_fl.settings.compose import fingerprint, load_settings
from car_fl.testing.tiny import tiny_overrides
from tests.helpers import NOGROUP, as_nobody, gone

PROJECT = Path(__file__).resolve().parents[2]
NODE = {"partition-id": 1, "num-partitions": 2, "device": "cpu"}


class Recorder:
    """A stand-in for the round: records what reached it, counts rounds in the run's state."""

    def __init__(self, *, delay: float = 0.0, fail_first: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.delay, self.fail_first = delay, fail_first
        self.inside = 0
        self.most_inside = 0
        self.lock = threading.Lock()

    def __call__(
        self,
        content: RecordDict,
        *,
        run_config: Mapping[str, Any],
        node_state: RecordDict,
        run: str,
    ) -> RecordDict:
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            time.sleep(self.delay)
            self.calls.append({"run_config": dict(run_config), "run": run})
            count = int(cast(int, node_state.metric_records["count"]["n"])) + 1 if node_state else 1
            node_state["count"] = MetricRecord({"n": count})
            if self.fail_first and len(self.calls) == 1:
                raise ValueError("the data file has a label outside the server's map")
            return RecordDict({"metrics": MetricRecord({"count": count})})
        finally:
            with self.lock:
                self.inside -= 1


@contextlib.contextmanager
def serving(
    folder: Path, answer: Any, node_config: Mapping[str, Any] = NODE, group: int | None = None
) -> Iterator[NodeWorker]:
    """A worker for ``folder`` in a thread of this process (``group``: the SuperNode's;
    ``answer``: a stand-in for the round, ``None`` for the real :meth:`Node.respond`)."""
    worker = NodeWorker(folder, node_config, group=group)
    if answer is not None:
        worker.node.respond = answer  # type: ignore[method-assign]  # the protocol, not the method
    with listening(worker.folder, group) as (sock, secret):
        thread = threading.Thread(target=worker.serve, args=(sock, secret), daemon=True)
        thread.start()
        assert worker.ready.wait(10)
        try:
            yield worker
        finally:
            worker.stop()
            thread.join(10)


def train(folder: Path, run_id: int, **run_config: Any) -> int:
    content = RecordDict({"config": ConfigRecord({"server-round": 1})})
    reply = worker_link.hand_over(folder, run_id=run_id, run_config=run_config, content=content)
    return int(cast(int, reply.metric_records["metrics"]["count"]))


def test_rounds_reach_the_worker_with_its_own_node_config_and_each_runs_state(
    short_dir: Path,
) -> None:
    answer = Recorder()
    with serving(short_dir, answer) as worker:
        assert [train(short_dir, 1, overrides="a"), train(short_dir, 1)] == [1, 2]
        assert train(short_dir, 2, overrides="b") == 1  # another run: its own state
        assert train(short_dir, 1) == 3
        assert worker_link.status(short_dir)["runs"] == [1, 2]
    # the worker's node is built from its own node config, its cache in its folder
    assert dict(worker.node.config) == {**NODE, "cache-dir": str(short_dir.resolve() / "cache")}
    # the run's config as sent
    assert answer.calls[0]["run_config"] == {"overrides": "a"}
    # a new worker in the same folder (a restart) goes on with each run's state
    with serving(short_dir, Recorder()):
        assert train(short_dir, 1) == 4
        assert train(short_dir, 2) == 2
    assert not (short_dir / "worker.sock").exists()


def test_a_failed_round_says_why_and_keeps_nothing_of_its_state(short_dir: Path) -> None:
    with serving(short_dir, Recorder(fail_first=True)) as worker:
        failed = "ValueError: the data file has a label outside"
        with pytest.raises(WorkerFailed, match=failed) as err:
            train(short_dir, 1)
        assert err.value.failure is Failure.ROUND_FAILED  # all the ClientApp tells the server
        assert train(short_dir, 1) == 1  # the failed round's count was not kept
        assert (worker.rounds, worker.failed) == (1, 1)


class Refuser(Recorder):
    """A round the node's policy refuses (as :class:`car_fl.client.node_privacy` does)."""

    def __call__(self, content: RecordDict, **kwargs: Any) -> RecordDict:
        raise Refusal(Failure.POLICY_REFUSED, "policy /home/owner/policy.toml: sigma too low")


def test_a_refusal_in_the_worker_reaches_the_clientapp_as_its_fixed_code_only(
    short_dir: Path,
) -> None:
    with serving(short_dir, Refuser()), pytest.raises(WorkerFailed) as err:
        train(short_dir, 1)
    # the ClientApp's data_free wrapper sends failure_of(err): the policy's code, not its text
    assert failure_of(err.value) is Failure.POLICY_REFUSED


def test_a_policy_set_on_the_supernode_only_is_refused_not_silently_dropped(
    short_dir: Path, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.toml"
    content = RecordDict({"config": ConfigRecord({"server-round": 1})})

    def hand(named: Path) -> int:
        reply = worker_link.hand_over(
            short_dir, run_id=1, run_config={}, content=content, policy=str(named)
        )
        return int(cast(int, reply.metric_records["metrics"]["count"]))

    answer = Recorder()
    with serving(short_dir, answer):  # the worker's node config has no policy
        with pytest.raises(WorkerFailed, match="names the privacy policy") as err:
            hand(policy)
        assert err.value.failure is Failure.NODE_CONFIG and answer.calls == []
    with serving(short_dir, Recorder(), {**NODE, "privacy-policy": str(policy)}):
        assert hand(policy) == 1  # the same policy on both: the round runs
        with pytest.raises(WorkerFailed, match="names the privacy policy"):
            hand(tmp_path / "another.toml")


def test_rounds_of_several_runs_are_served_one_at_a_time(short_dir: Path) -> None:
    answer = Recorder(delay=0.3)
    counts: dict[int, list[int]] = {1: [], 2: []}
    with serving(short_dir, answer):
        threads = [
            threading.Thread(target=lambda r=run: counts[r].append(train(short_dir, r)))
            for run in (1, 2, 1, 2)
        ]
        for thread in threads:
            thread.start()
        time.sleep(0.1)
        busy = worker_link.status(short_dir)  # answered while a round runs
        for thread in threads:
            thread.join(30)
    assert answer.most_inside == 1
    assert busy["busy-run"] in (1, 2)
    assert sorted(counts[1]) == sorted(counts[2]) == [1, 2]


def test_a_body_is_read_when_its_round_starts_and_connections_are_capped(short_dir: Path) -> None:
    """The server's ClientApp holds the secret under a SuperNode group: it must not make the
    worker hold many bodies (up to MAX_FRAME each) or threads at once. A train request's body
    is read only once its round has the worker; beyond MAX_CONNECTIONS a connection is closed
    unanswered, and the worker serves again when they end."""
    with serving(short_dir, Recorder()) as worker:
        with worker._round, worker_link.connect(short_dir) as sock:  # a round in progress
            header = {"kind": "train", "run-id": 1, "run-config": {}}
            worker_link.send_frame(sock, json.dumps(header).encode())
            sock.settimeout(1.0)
            with pytest.raises(TimeoutError):  # the socket's buffer fills: nothing reads it
                worker_link.send_frame(sock, bytes(16 << 20))
        assert train(short_dir, 1) == 1
        idle = [socket.socket(socket.AF_UNIX) for _ in range(MAX_CONNECTIONS)]
        try:
            for conn in idle:  # connected, never answering the greeting
                conn.connect(str(short_dir / "worker.sock"))
            with pytest.raises(WorkerUnavailable, match="did not complete the handshake"):
                worker_link.status(short_dir)
        finally:
            for conn in idle:
                conn.close()
        deadline = time.monotonic() + 10
        while worker._connections._value < MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert train(short_dir, 1) == 2


def test_one_worker_per_folder_and_a_dead_workers_socket_is_replaced(short_dir: Path) -> None:
    with (
        listening(short_dir),
        pytest.raises(WorkerBusy, match="another car-fl worker"),
        listening(short_dir),
    ):
        pass
    # a worker killed with SIGKILL leaves its socket file: the next one replaces it
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(short_dir / "worker.sock"))
    with serving(short_dir, Recorder()):
        assert train(short_dir, 1) == 1
        assert (short_dir / "worker.sock").stat().st_mode & 0o777 == 0o600
        assert (short_dir / "secret").stat().st_mode & 0o777 == 0o600


def test_a_client_without_the_secret_is_refused_and_the_worker_goes_on(short_dir: Path) -> None:
    with serving(short_dir, Recorder()):
        secret = (short_dir / "secret").read_bytes()
        (short_dir / "secret").write_bytes(b"a guess")
        with pytest.raises(WorkerUnavailable, match="refused"):
            train(short_dir, 1)
        (short_dir / "secret").write_bytes(secret)
        assert train(short_dir, 1) == 1


def test_the_worker_needs_its_place_in_the_federation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"partition-id=<integer>.*SuperNode's --node-config"):
        own_node_config(tmp_path, {"num-partitions": 2})
    with pytest.raises(ValueError, match="num-partitions=<integer>"):
        own_node_config(tmp_path, {"partition-id": 0, "num-partitions": "2"})
    mine = own_node_config(tmp_path, {**NODE, "worker": "/elsewhere", "cache-dir": "/c"})
    assert mine == {**NODE, "cache-dir": "/c"}


# ------------------------------------------------------------- a SuperNode of another account
def as_supernode(folder: Path, data: Path) -> str:
    """As ``nobody`` in ``nogroup`` (as the FAB's code would run): whether it reaches the
    worker, and whether it can read the data file."""

    def probe() -> str:
        said = [f"worker {worker_link.status(folder)['ok']}"]
        try:
            data.read_bytes()
            said.append("read the data")
        except PermissionError:
            said.append("no data")
        return ", ".join(said)

    return as_nobody(probe)


def test_a_confined_worker_shares_only_its_socket_and_secret_and_no_error_text(
    short_dir: Path, owner_policy: Path
) -> None:
    group, node = os.getgid(), {**NODE, "privacy-policy": str(owner_policy)}
    with serving(short_dir, Recorder(fail_first=True), node, group=group):
        modes = {n: (short_dir / n).stat() for n in ("", "secret", "worker.sock")}
        assert {n: m.st_mode & 0o777 for n, m in modes.items()} == {
            "": 0o710,  # entered by name, never listed
            "secret": 0o640,
            "worker.sock": 0o660,
        }
        assert {m.st_gid for m in modes.values()} == {group}
        with pytest.raises(WorkerFailed) as err:  # a ClientApp of another account reads no
            train(short_dir, 1)  # exception text: it could carry a record
        assert "label outside" not in str(err.value) and "ROUND_FAILED" in str(err.value)
        assert train(short_dir, 1) == 1
        assert (short_dir / "runs").stat().st_mode & 0o077 == 0  # run states: the owner's
        # what the worker has done (rounds, runs, encoder loads) is not the server code's
        assert worker_link.status(short_dir) == {"ok": True, "pid": os.getpid()}
    with serving(short_dir, Recorder()):  # the same folder, unconfined: the owner's again
        assert short_dir.stat().st_mode & 0o777 == 0o700
        assert (short_dir / "secret").stat().st_mode & 0o777 == 0o600


def test_a_confined_worker_refuses_to_start_while_its_data_is_readable(
    short_dir: Path, owner_policy: Path
) -> None:
    with pytest.raises(ValueError, match="--supernode-group needs a privacy policy"):
        NodeWorker(short_dir, NODE, group=os.getgid())  # the run would choose what is read
    shared = Path(tempfile.mkdtemp(prefix="cf-data-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        data = shared / "data.tsv"
        data.write_text("ham\thello\n")
        data.chmod(0o644)
        node = {**NODE, "data-path": str(data), "cache-dir": str(shared)}
        node["privacy-policy"] = str(owner_policy)
        with pytest.raises(ValueError) as err:
            NodeWorker(short_dir, node, group=os.getgid())
        assert f"the data file {data} can be read" in str(err.value)
        assert f"the feature cache {shared} can be read" in str(err.value)
        data.chmod(0o600)
        shared.chmod(0o700)
        assert NodeWorker(short_dir, node, group=os.getgid()).group == os.getgid()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another account (root only)")
def test_a_supernode_of_another_account_reaches_the_worker_but_not_the_data(
    short_dir: Path, tmp_path: Path, owner_policy: Path
) -> None:
    """The SuperNode's account (nobody, in nogroup): the worker answers it, and the owner's
    data file stays out of its reach; without the group, the worker is out of reach too."""
    data = tmp_path / "data.tsv"  # in pytest's folder: the owner's alone
    data.write_text("ham\thello\n")
    node = {**NODE, "data-path": str(data), "privacy-policy": str(owner_policy)}
    with serving(short_dir, Recorder(), node, group=NOGROUP):
        assert as_supernode(short_dir, data) == "worker True, no data"
    with serving(short_dir, Recorder(), node):
        assert as_supernode(short_dir, data).startswith("WorkerUnavailable: this process may not")


# ----------------------------------------------------------------------- worker processes
def start_worker(folder: Path, node_config: str, *, restart: bool) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "car_fl.cli", "worker", "--dir", str(folder)]
    cmd += ["--node-config", node_config, *([] if restart else ["--no-restart"])]
    log = (folder.parent / f"{folder.name}.log").open("ab")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_status(
    folder: Path, proc: subprocess.Popen[bytes], timeout: float = 120
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, (folder.parent / f"{folder.name}.log").read_text()
        try:
            return worker_link.status(folder, timeout=10)
        except WorkerUnavailable:
            assert time.monotonic() < deadline, "the worker does not answer"
            time.sleep(0.2)


@pytest.mark.slow
def test_the_supervisor_restarts_a_killed_worker_and_stops_cleanly(
    short_dir: Path, synthetic_tsv: Path
) -> None:
    folder = short_dir / "w"
    node_config = f'partition-id=0 num-partitions=2 data-path="{synthetic_tsv}"'
    supervisor = start_worker(folder, node_config, restart=True)
    try:
        first = wait_status(folder, supervisor)["pid"]
        assert first != supervisor.pid
        os.kill(first, signal.SIGKILL)
        # a ClientApp that connects while the worker restarts waits for the new one
        second = worker_link.status(folder, timeout=120)["pid"]
        assert second not in (first, supervisor.pid)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == 0
        assert gone(first) and gone(second)
        assert not (folder / "worker.sock").exists()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()


# ---------------------------------------------------------------- the acceptance test
# One train message handled by the project's ClientApp in a fresh process, as Flower's ClientApp
# process does it; its node config names the worker and, to show they are not used, other paths.
SHIM = """
import json, sys
sys.path.insert(0, sys.argv[1])
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as Proto
from flwr.supercore.task_identity import TaskIdentity
import client_app

args = json.loads(sys.argv[2])
TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, args["run_id"], 0
content = recorddict_from_proto(Proto.FromString(open(args["message"], "rb").read()))
msg = Message(content=content, dst_node_id=0, message_type="train")
context = Context(run_id=args["run_id"], node_id=0, node_config=args["node_config"],
                  state=RecordDict(), run_config={"overrides": args["overrides"]})
reply = client_app.train(msg, context)
open(args["reply"], "wb").write(recorddict_to_proto(reply.content).SerializeToString())
print(json.dumps(sorted(sys.modules)))
"""


def shim_round(args: dict[str, Any]) -> set[str]:
    """One train message through ``client_app.py`` in a fresh process; its top-level modules."""
    result = subprocess.run(
        [sys.executable, "-c", SHIM, str(PROJECT), json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {m.split(".")[0] for m in json.loads(result.stdout.strip().splitlines()[-1])}


def train_content(
    state: dict[str, torch.Tensor], server_round: int, fingerprint_: str, labels: list[str]
) -> RecordDict:
    config = ConfigRecord(
        {"server-round": server_round, "fingerprint": fingerprint_, "labels": list(labels)}
    )
    return RecordDict({"arrays": to_record(state), "config": config})


@pytest.mark.slow
def test_a_second_round_with_a_worker_loads_no_encoder_and_the_clientapp_imports_no_torch(
    short_dir: Path, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    overrides = " ".join(
        [*tiny_overrides(tiny_llama, synthetic_tsv), "mode=adapter", "fl.clients=2"]
    )
    settings = load_settings(overrides)
    labels = load_splits(settings.dataset, seed=settings.seed).label_map.to_list()
    initial = build_retriever(settings, len(labels)).trainable_state_dict()
    mine = f'partition-id=1 num-partitions=2 data-path="{synthetic_tsv}" device="cpu"'
    node_config = {"partition-id": 1, "num-partitions": 2, "data-path": str(synthetic_tsv)}
    node_config |= {"device": "cpu", "cache-dir": str(short_dir / "cache")}
    folder = short_dir / "w"
    worker = start_worker(folder, mine, restart=False)
    try:
        pid = wait_status(folder, worker)["pid"]
        state, replies = initial, []
        for server_round in (1, 2):
            message = short_dir / f"message-{server_round}.bin"
            content = train_content(state, server_round, fingerprint(settings), labels)
            message.write_bytes(wire.encode_content(content))
            reply_file = short_dir / f"reply-{server_round}.bin"
            args = {
                "message": str(message),
                "reply": str(reply_file),
                "run_id": 11,
                "overrides": overrides,
                # the ClientApp's node config: the worker, and values the worker must not use
                "node_config": {"worker": str(folder), "data-path": "/nonexistent.tsv"},
            }
            modules = shim_round(args)
            # The ClientApp process imported Flower and car-fl's link, not torch or transformers
            assert "flwr" in modules and "car_fl" in modules
            assert not {"torch", "transformers", "omegaconf"} & modules
            reply = wire.decode_content(reply_file.read_bytes())
            replies.append(reply)
            state = from_record(reply.array_records["arrays"])
            status = wait_status(folder, worker)
            # one worker process, which loaded the encoder once: in round 1, not in round 2
            assert status["pid"] == pid and status["rounds"] == server_round
            assert status["encoder-loads"] == 1
        metrics = [dict(r.metric_records["metrics"]) for r in replies]
        assert [m["encoder-loads"] for m in metrics] == [1, 1]  # the worker's process, both
        examples = [cast(int, m["num-examples"]) for m in metrics]
        assert examples[0] == examples[1] > 0
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
    # The worker trained on its own data, as the in-process round with its node config does
    expected = Node(node_config).answer(
        train_content(initial, 1, fingerprint(settings), labels),
        run_config={"overrides": overrides},
        run="1",
    )
    ours, theirs = (
        from_record(expected.array_records["arrays"]),
        from_record(replies[0].array_records["arrays"]),
    )
    assert ours.keys() == theirs.keys() == initial.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], atol=1e-5), name
        assert not torch.equal(theirs[name], initial[name]), f"{name} was not trained"


def test_the_deployment_docs_state_the_workers_limits_as_the_code_sets_them() -> None:
    """docs/deployment.md gives the worker's limits as numbers: a change to the constants
    must change them there too."""
    text = " ".join((PROJECT / "docs" / "deployment.md").read_text(encoding="utf-8").split())
    assert f"at most {MAX_CONNECTIONS} connections at once" in text
    assert f"headers up to {MAX_HEADER // 2**20} MiB" in text and MAX_HEADER % 2**20 == 0
    assert f"messages up to {MAX_FRAME // 2**30} GiB" in text and MAX_FRAME % 2**30 == 0
    assert f"within {HANDSHAKE_TIMEOUT:.0f} s plus a second per MiB received" in text
    assert MIN_BYTES_PER_SECOND == 2**20
