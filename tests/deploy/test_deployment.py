"""Deployment over gRPC: a real SuperLink and SuperNodes on 127.0.0.1, started and stopped by PID.

Slow (a new ClientApp process per message costs seconds each): several minutes in all.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from car_fl.client import worker_link
from car_fl.deploy.certs import make_certificates, make_node_key
from car_fl.deploy.cluster import LocalCluster
from car_fl.deploy.connection import register_node
from car_fl.deploy.ports import free_port
from car_fl.protocol.failures import Failure
from car_fl.testing.tiny import tiny_overrides
from tests.helpers import gone

pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[2]
CONNECTION = "test-cluster"


class Deployment:
    """The shared local cluster, with this suite's tiny model and data and its run settings."""

    def __init__(self, cluster: LocalCluster, data: Path, model: Path) -> None:
        self.cluster = cluster
        self.folder = cluster.folder
        self.data = data
        self.model = model
        self.out = self.folder / "run"

    def start_node(self, i: int, num: int, *, retries: int | None = None, **kw: Any) -> str:
        """SuperNode ``i`` of ``num`` on the shared data file; ``retries``: give up soon."""
        return self.cluster.start_node(
            i,
            num,
            data=self.data,
            max_retries=retries,
            max_wait_time=30 if retries else None,
            **kw,
        )

    def overrides(self, *extra: str) -> str:
        return (
            " ".join(tiny_overrides(self.model, self.data))
            + f" output_dir={self.out} "
            + " ".join(extra)
        )

    def run(self, *extra: str, timeout: float = 600) -> tuple[dict[str, str], Path]:
        """Run to the end with the tiny model; its status and its output folder."""
        result = self.cluster.run(
            PROJECT, self.overrides("fl.wait_for_nodes=120", *extra), timeout=timeout
        )
        return result.status, self.out


MakeDeployment = Callable[..., Deployment]


@pytest.fixture
def make_deployment(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path
) -> Iterator[MakeDeployment]:
    """Deployments in ``tmp_path`` (``LocalCluster`` options as keywords), stopped by PID."""
    made: list[Deployment] = []

    def make(**cluster_options: Any) -> Deployment:
        cluster = LocalCluster(tmp_path, connection=CONNECTION, **cluster_options)
        made.append(Deployment(cluster, synthetic_tsv, tiny_llama))
        return made[-1]

    try:
        yield make
    finally:
        for dep in made:
            dep.cluster.stop()
            assert not dep.cluster.processes.pids


@pytest.fixture
def deployment(make_deployment: MakeDeployment) -> Deployment:
    return make_deployment()


def client_rows(out: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((out / "clients.csv").open()))


def write_trusted_entities(path: Path) -> Path:
    """A ``--trusted-entities`` file naming one fresh Ed25519 key, as Flower expects it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    public = ed25519.Ed25519PrivateKey.generate().public_key()
    line = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    path.write_text(f"fpk_car_fl_reviewer: '{line.decode()} reviewer'\n", encoding="utf-8")
    return path


def test_three_nodes_train_over_tls_and_reuse_their_cache_while_every_node_to_refuse_is_refused(
    make_deployment: MakeDeployment,
) -> None:
    """One TLS SuperLink with node authentication. It refuses an insecure node, a node that
    trusts another CA and an unregistered key (the first two hold a registered key, so TLS
    alone refuses them). A fourth registered node, started with ``--trusted-entities``,
    refuses every FAB that ``flwr run .`` sends (Flower 1.39 signs FABs only through Flower
    Hub, so it carries no signature) before any ClientApp runs; its rounds fail with Flower's
    reason. The three others train two rounds, reuse their feature cache, and the run
    completes."""
    deployment = make_deployment(env={"OMP_NUM_THREADS": "1"})
    folder = deployment.folder
    tls = make_certificates(folder / "certs", ["127.0.0.1", "localhost"])
    other_ca = make_certificates(folder / "other", ["127.0.0.1"]).ca_cert
    deployment.cluster.start_superlink(tls=tls, node_auth=True)
    keys = [make_node_key(folder / "certs" / f"node{i}.key") for i in range(5)]
    for _, public in keys[:4]:  # the fifth stays unregistered
        result = register_node(public, CONNECTION, env=deployment.cluster.env)
        assert result.returncode == 0, result.stdout + result.stderr
    refused_nodes = {
        "insecure": deployment.start_node(0, 4, private_key=keys[0][0], retries=2),
        "another CA": deployment.start_node(
            1, 4, root_cert=other_ca, private_key=keys[1][0], retries=2
        ),
        "unregistered": deployment.start_node(
            2, 4, root_cert=tls.ca_cert, private_key=keys[4][0], retries=2
        ),
    }
    for i in range(3):
        deployment.start_node(i, 4, root_cert=tls.ca_cert, private_key=keys[i][0])
    trusted = write_trusted_entities(folder / "trusted-entities.yaml")
    pinned = deployment.start_node(
        3, 4, root_cert=tls.ca_cert, private_key=keys[3][0], trusted_entities=trusted
    )
    for what, name in refused_nodes.items():
        code = deployment.cluster.processes.exit_code(name, timeout=120)
        assert code is not None and code != 0, f"the {what} SuperNode was let in"
    status, out = deployment.run("fl.clients=4", "fl.rounds=2", "train.lr=0.01")
    assert status["status"] == "finished:completed", status
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["summary"]["complete"] and len(metrics["history"]) == 2
    assert metrics["history"][-1]["test_top1"] > 0.25  # 4 labels: chance is 0.25
    assert (out / "checkpoints" / "final" / "weights.safetensors").is_file()
    rows = client_rows(out)
    refused = [r for r in rows if r["status"] == "failed"]
    trained = [r for r in rows if r["status"] == "ok"]
    assert len(rows) == 8 and len(trained) == 6, rows
    assert len(refused) == 2 and len({r["node"] for r in refused}) == 1, refused
    assert {r["reason"] for r in refused} == {"The FAB could not be verified."}, refused
    assert "App verification is not supported by the connected SuperLink" in (
        deployment.cluster.processes.log(pinned)
    )
    assert not (folder / "cache-3").exists()  # its ClientApp never ran
    # Every message runs in a new ClientApp process: round 1 computes the shard's features
    # (loading the encoder once), round 2 finds them on disk and never loads the encoder.
    assert {float(r["encoder_loads"]) for r in trained if r["round"] == "1"} == {1.0}
    assert {float(r["encoder_loads"]) for r in trained if r["round"] == "2"} == {0.0}
    for i in range(3):
        cache = folder / f"cache-{i}"
        assert list((cache / "features").rglob("*.safetensors"))  # its per-text features
        # and the node kept its composed settings and its shard for later ClientApp processes
        assert len(list((cache / "settings").glob("*.json"))) == 1
        assert len(list((cache / "shards").glob("*.json"))) == 1


def test_a_killed_supernode_and_a_killed_worker_fail_their_rounds_and_the_run_goes_on(
    make_deployment: MakeDeployment,
) -> None:
    """Three nodes, node 0 with its worker. In round 1, node 2's SuperNode is SIGKILLed (and its
    ClientApp): Flower notices after its heartbeat times out (~60 s); and node 0's worker (not
    its supervisor) is SIGKILLed: node 0 fails the round with the fixed failure text. The
    round completes with node 1. Round 2: the restarted worker is whole."""
    deployment = make_deployment(env={"OMP_NUM_THREADS": "1"})
    cluster = deployment.cluster
    cluster.start_superlink()
    worker = cluster.start_worker(0, 3, data=deployment.data)
    names = [deployment.start_node(0, 3, worker=worker)]
    names += [deployment.start_node(i, 3) for i in (1, 2)]
    run_id = cluster.submit(
        PROJECT,
        deployment.overrides("mode=adapter fl.clients=3 fl.rounds=2 fl.local_epochs=4"),
    )
    deadline = time.monotonic() + 300
    while "a round starts" not in cluster.processes.log("worker-0"):  # round 1 reached it
        assert time.monotonic() < deadline, cluster.processes.log("worker-0")[-3000:]
        time.sleep(0.05)
    cluster.kill(names[2], signal.SIGKILL)
    killed = int(worker_link.status(worker)["pid"])
    os.kill(killed, signal.SIGKILL)
    status = cluster.wait(run_id, timeout=600)
    assert status["status"] == "finished:completed", status

    rows = client_rows(deployment.out)
    by_partition = {r["node"]: r["partition_id"] for r in rows if r["partition_id"]}
    node0 = next(n for n, p in by_partition.items() if float(p) == 0)
    node1 = next(n for n, p in by_partition.items() if float(p) == 1)
    outcome = {(r["round"], r["node"]): r for r in rows}
    # the lost node: its rows failed, named, with the reason (also logged)
    lost = [r for r in rows if r["node"] not in (node0, node1)]
    assert lost and {r["status"] for r in lost} == {"failed"}, rows
    # the killed worker: round 1 failed for node 0 with the fixed, data-free failure text;
    # the clear message is in the node's own log; node 1's reply made the round
    assert outcome[("1", node0)]["status"] == "failed", rows
    assert outcome[("1", node0)]["reason"] == Failure.ROUND_FAILED.text
    assert "worker stopped before it answered" in cluster.processes.log("supernode-0")
    for round_ in ("1", "2"):
        assert outcome[(round_, node1)]["status"] == "ok"
    # the supervisor started the worker again: round 2 is whole
    assert outcome[("2", node0)]["status"] == "ok"
    restarted = worker_link.status(worker)
    assert restarted["pid"] != killed and restarted["rounds"] == 1
    history = json.loads((deployment.out / "metrics.json").read_text())["history"]
    assert history[0]["clients_failed"] == 2 and history[1]["clients_failed"] == 0
    assert all(row["skipped"] == 0 for row in history)
    weights = load_file(str(deployment.out / "checkpoints" / "final" / "weights.safetensors"))
    assert all(math.isfinite(float(v.abs().sum())) for v in weights.values())
    # nothing is left running once the cluster stops: worker, supervisor, nodes, link
    pids = [*cluster.processes.pids.values(), killed, int(restarted["pid"])]
    cluster.stop()
    assert all(gone(pid) for pid in pids), [pid for pid in pids if not gone(pid, 0)]
    assert not (worker / "worker.sock").exists()


# ----------------------------------------------------------------------- separate network hosts


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"carfl-probe-{os.getpid()}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if result.returncode != 0:
        return f"`ip netns add` failed here: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Three network namespaces on a bridge: 'link' (10.213.0.1) and 'n0', 'n1' (.11, .12).
    Where namespaces cannot be made, one host: the loopback address, no namespace (a warning
    says why)."""
    reason = _netns_unavailable()
    if reason is not None:
        warnings.warn(f"one host instead of three: {reason}", stacklevel=1)
        yield {"link": "127.0.0.1", "link_ns": "", "n0_ns": "", "n1_ns": ""}
        return
    tag = str(os.getpid() % 100000)
    bridge = f"cfbr{tag}"
    addresses = {"link": "10.213.0.1", "n0": "10.213.0.11", "n1": "10.213.0.12"}
    names = {role: f"carfl-{tag}-{role}" for role in addresses}
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", "10.213.0.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (role, address) in enumerate(addresses.items()):
            ns, outside, inside = names[role], f"cfh{tag}{i}", f"cfn{tag}{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", ns, "link", "set", inside, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {**{f"{role}_ns": names[role] for role in names}, **addresses}
    finally:
        for role in addresses:
            subprocess.run(["ip", "netns", "del", names[role]], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def test_a_superlink_on_its_own_host_restarted_mid_run_resumes_from_its_database(
    hosts: dict[str, str], make_deployment: MakeDeployment
) -> None:
    """The SuperLink's Fleet API on 10.213.0.1:9092 (Control API :9093) in a network namespace
    of its own, each SuperNode in another, reached over a bridge. Process isolation with a
    separate SuperExec: the ServerApp outlives the SuperLink, which is stopped once round 1 is
    done and started again on the same database; the nodes reconnect and round 2 completes."""
    separate = bool(hosts["link_ns"])
    deployment = make_deployment(host=hosts["link"], ports=9092 if separate else None)

    def in_ns(role: str) -> list[str]:
        return ["ip", "netns", "exec", hosts[f"{role}_ns"]] if separate else []

    deployment.cluster.start_superlink(isolation="process", prefix=in_ns("link"))
    deployment.cluster.start_superexec()
    for i in range(2):
        deployment.start_node(i, 2, prefix=in_ns(f"n{i}"))
    overrides = deployment.overrides("fl.rounds=2", "fl.wait_for_nodes=120")
    run_id = deployment.cluster.submit(PROJECT, overrides)
    metrics = deployment.out / "metrics.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (
        metrics.is_file() and json.loads(metrics.read_text())["history"]
    ):
        time.sleep(0.5)
    # Round 1 is done: stop the SuperLink, start it again on the same database.
    deployment.cluster.kill("superlink", signal.SIGTERM)
    time.sleep(3)
    deployment.cluster.start_superlink(isolation="process", prefix=in_ns("link"))
    status = deployment.cluster.wait(run_id, timeout=900)
    assert status["status"] == "finished:completed", status
    history = json.loads(metrics.read_text())["history"]
    assert [row["round"] for row in history] == [1, 2]
    assert history[-1]["clients_ok"] == 2
    assert {r["status"] for r in client_rows(deployment.out)} == {"ok"}


def test_the_local_cluster_script_starts_and_runs_from_a_venv_that_is_not_activated(
    tmp_path: Path, tiny_llama: Path, synthetic_tsv: Path
) -> None:
    """``scripts/local_cluster.py`` run with the venv's Python and a PATH without the venv's
    ``bin``: the SuperLink, the SuperNode and the flower-superexec each starts by name from
    PATH find Flower beside that Python (before, the SuperLink died: "Application startup
    failed"), and a round runs to the end."""
    path = os.pathsep.join(["/usr/bin", "/bin"])
    for name in ("flwr", "flower-superlink", "flower-supernode", "flower-superexec"):
        assert shutil.which(name, path=path) is None, f"{name} on {path}: the test shows nothing"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": path}
    script = [sys.executable, str(PROJECT / "scripts" / "local_cluster.py")]
    folder = tmp_path / "cluster"

    def call(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*script, *args, "--dir", str(folder)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    port = free_port()
    started = call("start", "--nodes", "1", "--data", str(synthetic_tsv), "--port", str(port),
                   "--no-workers")  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        out = tmp_path / "run"
        overrides = " ".join(tiny_overrides(tiny_llama, synthetic_tsv))
        overrides += f" fl.clients=1 fl.rounds=1 fl.wait_for_nodes=120 output_dir={out}"
        ran = call("run", "--overrides", overrides, "--timeout", "300", timeout=400)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["summary"]["complete"] and len(metrics["history"]) == 1
        # the wait says what it is doing: the run's log, one line per round, then the outcome
        assert re.search(r"round +1 \| train loss", ran.stdout), ran.stdout[-3000:]
        last = ran.stdout.strip().splitlines()[-1]
        top1 = metrics["summary"]["final"]["test_top1"]
        assert f"finished:completed; final test top1 {top1:.4f}, best on validation" in last
        assert last.endswith(f"results: {out}"), last
    finally:
        state = folder / "cluster.json"
        pids = json.loads(state.read_text())["processes"] if state.is_file() else {}
        stopped = call("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert all(gone(pid) for pid in pids.values())
