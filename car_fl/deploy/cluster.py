"""One local deployment, assembled one way: a SuperLink and SuperNodes on this machine.

The scripts and ``tests/deploy`` build their clusters here. A cluster lives in one folder
(state database, its own ``FLWR_HOME``, each node's cache and worker, certificates, logs, PIDs
in ``cluster.json``); everything it starts is stopped by PID, never by name.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from car_fl.client import worker_link
from car_fl.common.io import atomic_write_json
from car_fl.deploy.certs import TLSFiles, make_certificates, make_node_key
from car_fl.deploy.commands import (
    check_flower,
    flower_env,
    node_config_string,
    pinned,
    superexec_command,
    superlink_command,
    supernode_command,
    worker_command,
)
from car_fl.deploy.connection import register_node, write_connection
from car_fl.deploy.ports import LOOPBACK, free_port, listening, port_in_use
from car_fl.deploy.processes import Processes
from car_fl.deploy.runs import COMPLETED, follow_run, start_run, wait_for_run

#: Host and ports of the cluster in a folder, written when its SuperLink starts.
NETWORK_FILE = "network.json"


def last_error(log: str) -> str:
    """The last ERROR line of a Flower log (else its last line), for a one-line reason."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line or "rror:" in line]
    return (errors or lines or ["(empty log)"])[-1]


@dataclass(frozen=True)
class RunResult:
    """A finished (or timed-out) run: its id, its ``flwr ls`` status and its wall seconds."""

    run_id: str
    status: dict[str, str]
    seconds: float

    @property
    def completed(self) -> bool:
        return self.status["status"] == COMPLETED


class LocalCluster:
    """A SuperLink and SuperNodes in ``folder``, reached at ``host``; a context manager.

    ``ports``: the Fleet API's, the Control API's + 1, node ``i``'s + 10 + i (None: free ones).
    ``env`` is added to the environment of every process (and of ``flwr``).
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        connection: str = "car-fl-local",
        host: str = LOOPBACK,
        ports: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.connection = connection
        self.host = host
        self.ports = ports
        self.fleet_port = ports if ports is not None else free_port()
        self.control_port = ports + 1 if ports is not None else free_port()
        # Flower's executables start each other by name from PATH: the running Python's
        # folder goes first on it, so a venv that is not activated works too
        self.env = flower_env(
            {
                **os.environ,
                "FLWR_HOME": str(self.flwr_home),
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                **(env or {}),
            }
        )
        self.processes = Processes(self.folder)
        self.tls: TLSFiles | None = None

    @classmethod
    def attach(cls, folder: str | Path, *, connection: str = "car-fl-local") -> LocalCluster:
        """The cluster another program started in ``folder``: its connection and its PIDs."""
        folder = Path(folder)
        network = folder / NETWORK_FILE
        if not network.is_file():
            raise FileNotFoundError(f"{network} not found: no SuperLink was started in {folder}")
        saved = json.loads(network.read_text())
        cluster = cls(folder, connection=connection, host=saved["host"], ports=saved["ports"])
        cluster.fleet_port, cluster.control_port = saved["fleet_port"], saved["control_port"]
        cluster.processes = Processes.load(folder)
        return cluster

    def save_network(self) -> None:
        """Record host and ports in ``<folder>/network.json``, for :meth:`attach`."""
        network = {
            "host": self.host,
            "ports": self.ports,
            "fleet_port": self.fleet_port,
            "control_port": self.control_port,
        }
        atomic_write_json(self.folder / NETWORK_FILE, network)

    @property
    def flwr_home(self) -> Path:
        return self.folder / "flwr"

    @property
    def fleet(self) -> str:
        return f"{self.host}:{self.fleet_port}"

    @property
    def control(self) -> str:
        return f"{self.host}:{self.control_port}"

    # ------------------------------------------------------------------------------ processes
    def start_superlink(
        self,
        *,
        tls: TLSFiles | None = None,
        node_auth: bool = False,
        isolation: str = "subprocess",
        prefix: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> None:
        """Start the SuperLink (after ``prefix``, e.g. ``taskset -c 3``), write the cluster's
        connection, wait until both APIs listen; after :meth:`kill`, it resumes its state."""
        self.tls = tls
        cmd = superlink_command(
            fleet_address=self.fleet,
            control_host=self.host,
            control_port=self.control_port,
            database=self.folder / "state.db",
            tls=tls,
            node_auth=node_auth,
            isolation=isolation,
        )
        self.save_network()
        self.processes.start("superlink", [*prefix, *cmd], env=self.env)
        write_connection(
            self.flwr_home, self.connection, self.control, root_cert=tls.ca_cert if tls else None
        )
        self.wait_listening("superlink", self.fleet, self.control, timeout=timeout)

    def start_superexec(self) -> None:
        """A SuperExec for a SuperLink started with ``isolation="process"``."""
        root_cert = self.tls.ca_cert if self.tls else None
        cmd = superexec_command(runtime_address=self.control, root_cert=root_cert)
        self.processes.start("superexec", cmd, env=self.env)

    def start_node(
        self,
        partition_id: int,
        num_partitions: int,
        *,
        data: Path | None = None,
        device: str | None = None,
        model: Path | None = None,
        cache_dir: Path | None = None,
        root_cert: Path | None = None,
        private_key: Path | None = None,
        max_retries: int | None = None,
        max_wait_time: float | None = None,
        prefix: Sequence[str] = (),
        worker: Path | None = None,
        trusted_entities: Path | None = None,
    ) -> str:
        """Start SuperNode ``partition_id`` of ``num_partitions``; returns its process name.

        Insecure unless ``root_cert`` is given; ``worker``: its worker's folder
        (:meth:`start_worker`); ``trusted_entities``: Flower's ``--trusted-entities``.
        """
        name = f"supernode-{partition_id}"
        if name in self.processes.pids:
            name = f"{name}-{len(self.processes.pids)}"
        runtime_port = self.ports + 10 + partition_id if self.ports is not None else free_port()
        cmd = supernode_command(
            superlink=self.fleet,
            runtime_port=runtime_port,
            root_cert=root_cert,
            private_key=private_key,
            max_retries=max_retries,
            max_wait_time=max_wait_time,
            trusted_entities=trusted_entities,
            node_config=node_config_string(
                partition_id=partition_id,
                num_partitions=num_partitions,
                data_path=data,
                device=device,
                model_path=model,
                cache_dir=cache_dir or self.folder / f"cache-{partition_id}",
                worker=worker,
            ),
        )
        self.processes.start(name, [*prefix, *cmd], env=self.env)
        return name

    def worker_name(self, partition_id: int) -> str:
        return f"worker-{partition_id}"

    def worker_folder(self, partition_id: int) -> Path:
        return self.folder / f"worker-{partition_id}"

    def start_worker(
        self,
        partition_id: int,
        num_partitions: int,
        *,
        data: Path | None = None,
        device: str | None = None,
        model: Path | None = None,
        cache_dir: Path | None = None,
        restart: bool = True,
        prefix: Sequence[str] = (),
        timeout: float = 300.0,
        wait: bool = True,
    ) -> Path:
        """Start node ``partition_id``'s worker (``car-fl worker``) with the node's own config
        and wait until it answers (``wait=False``: :meth:`wait_worker`); returns its folder."""
        folder = self.worker_folder(partition_id)
        node_config = node_config_string(
            partition_id=partition_id,
            num_partitions=num_partitions,
            data_path=data,
            device=device,
            model_path=model,
            cache_dir=cache_dir or self.folder / f"cache-{partition_id}",
        )
        name = self.worker_name(partition_id)
        cmd = worker_command(folder=folder, node_config=node_config, restart=restart)
        self.processes.start(name, [*prefix, *cmd], env=self.env)
        if wait:
            self.wait_worker(name, folder, timeout=timeout)
        return folder

    def wait_worker(self, name: str, folder: Path, *, timeout: float) -> dict[str, object]:
        """The worker's status once it answers; ``RuntimeError`` if process ``name`` dies."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.processes.alive(name):
                raise RuntimeError(f"{name} exited; its log:\n{self.processes.log(name)[-3000:]}")
            try:
                return worker_link.status(folder, timeout=10)
            except worker_link.WorkerUnavailable:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} does not answer after {timeout} s") from None
                time.sleep(0.2)

    def register_new_node_key(self, index: int) -> Path:
        """Make ``certs/node<index>.key`` (+ ``.pub``), register it; the private key's path."""
        private, public = make_node_key(self.folder / "certs" / f"node{index}.key")
        result = register_node(public, self.connection, env=self.env)
        if result.returncode != 0:
            raise RuntimeError(f"registering {public} failed: {result.stdout}{result.stderr}")
        return private

    def start(
        self,
        nodes: int,
        *,
        data: Path,
        device: str | None = None,
        tls: bool = False,
        node_auth: bool = False,
        client_cores: Sequence[int] | None = None,
        server_core: int | None = None,
        settle: float = 0.0,
        workers: bool = False,
    ) -> LocalCluster:
        """The whole cluster: a SuperLink and ``nodes`` SuperNodes sharing the data file.

        ``tls``: a fresh private CA; ``node_auth``: a registered key per node; ``*_core(s)``:
        CPU pinning; ``settle``: seconds for the SuperNodes to connect; ``workers``: one each.
        """
        check_flower()  # before anything starts: one line if Flower is not found
        self.check_ports(nodes)
        files = make_certificates(self.folder / "certs", [self.host, "localhost"]) if tls else None
        try:
            prefixes = [pinned([], client_cores[i] if client_cores else None) for i in range(nodes)]
            # the workers start side by side; each SuperNode once its worker answers
            folders = [
                self.start_worker(i, nodes, data=data, device=device, prefix=p, wait=False)
                for i, p in enumerate(prefixes)
                if workers
            ]
            self.start_superlink(tls=files, node_auth=node_auth, prefix=pinned([], server_core))
            keys = [self.register_new_node_key(i) for i in range(nodes)] if node_auth else []
            for i, folder in enumerate(folders):
                self.wait_worker(self.worker_name(i), folder, timeout=300.0)
            for i, prefix in enumerate(prefixes):
                self.start_node(
                    i,
                    nodes,
                    data=data,
                    device=device,
                    root_cert=files.ca_cert if files else None,
                    private_key=keys[i] if keys else None,
                    prefix=prefix,
                    worker=folders[i] if workers else None,
                )
        except BaseException:  # a half-started cluster is no use: leave nothing running
            self.stop()
            raise
        time.sleep(settle)
        return self

    def check_ports(self, nodes: int) -> None:
        """``RuntimeError`` naming the first port this cluster needs that is already in use."""
        ports = {"Fleet API": self.fleet_port, "Control API": self.control_port}
        if self.ports is not None:
            ports |= {f"SuperNode {i}": self.ports + 10 + i for i in range(nodes)}
        for what, port in ports.items():
            if port_in_use(self.host, port):
                raise RuntimeError(
                    f"port {port} on {self.host} ({what}) is already in use; stop what holds "
                    f"it or start the cluster on other ports (--port)"
                )

    def wait_listening(self, name: str, *addresses: str, timeout: float) -> None:
        """Wait until every address accepts connections; ``RuntimeError`` if ``name`` dies."""
        deadline = time.monotonic() + timeout
        while not all(listening(a) for a in addresses):
            if not self.processes.alive(name):
                raise RuntimeError(f"{name} exited: {last_error(self.processes.log(name))}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} is not listening on {addresses} after {timeout} s")
            time.sleep(0.2)

    def kill(self, name: str, sig: int = signal.SIGTERM) -> None:
        """End one process we started, and its process group (its ClientApps)."""
        self.processes.kill(name, sig)

    def stop(self) -> None:
        """Stop every process this cluster started, SuperNodes first."""
        self.processes.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------------------------- runs
    def submit(self, project: str | Path, overrides: str) -> str:
        """``flwr run`` the project on this cluster with these Hydra overrides; the run id."""
        return start_run(project, self.connection, overrides, env=self.env)

    def wait(self, run_id: str, *, timeout: float, poll: float = 3.0) -> dict[str, str]:
        """The run's status once it is finished, or when ``timeout`` seconds have passed."""
        return wait_for_run(self.connection, run_id, timeout=timeout, poll=poll, env=self.env)

    def follow(self, run_id: str, *, timeout: float) -> dict[str, str]:
        """Stream the run's log to stdout until it is finished; its final status."""
        return follow_run(self.connection, run_id, timeout=timeout, env=self.env)

    def run(
        self, project: str | Path, overrides: str, *, timeout: float, poll: float = 3.0
    ) -> RunResult:
        """Submit a run and wait for it; wall seconds from ``flwr run`` to its end."""
        tick = time.perf_counter()
        run_id = self.submit(project, overrides)
        status = self.wait(run_id, timeout=timeout, poll=poll)
        return RunResult(run_id, status, time.perf_counter() - tick)
