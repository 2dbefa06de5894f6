"""Deployment on several machines with Flower's own engine: SuperLink + SuperNodes over gRPC.

Builds the exact ``flower-superlink`` / ``flower-supernode`` command lines, makes a private CA
and a server certificate (with the ``cryptography`` package, no openssl needed), writes the
``flwr`` connection for a SuperLink, and runs a whole local cluster whose processes it starts
and stops by PID. The scripts in ``scripts/`` are thin command-line fronts to this module.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

FLEET_PORT = 9092  # gRPC Fleet API: SuperNodes connect here (open it to the clients)
CONTROL_PORT = 9093  # HTTP(S) Control API: `flwr run` connects here (open it to the operator)


def _bin(name: str) -> str:
    """A Flower executable from the running interpreter's environment, else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


@dataclass(frozen=True)
class TLSFiles:
    """CA certificate, server certificate and key (as written by :func:`make_certificates`)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_folder(cls, folder: str | Path) -> TLSFiles:
        folder = Path(folder)
        files = cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")
        for path in (files.ca_cert, files.server_cert, files.server_key):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} is missing; make the certificates first: "
                    f"python scripts/make_certs.py --out {folder} --host <name or IP>"
                )
        return files


def superlink_command(
    *,
    fleet_address: str = f"0.0.0.0:{FLEET_PORT}",
    control_host: str = "0.0.0.0",
    control_port: int = CONTROL_PORT,
    database: str | Path = "superlink-state.db",
    tls: TLSFiles | None = None,
    node_auth: bool = False,
    isolation: str = "subprocess",
) -> list[str]:
    """``flower-superlink`` for a deployment: runtime dependency installation off."""
    cmd = [
        _bin("flower-superlink"),
        "--fleet-api-address",
        fleet_address,
        "--host",
        control_host,
        "--port",
        str(control_port),
        "--database",
        str(database),
        "--isolation",
        isolation,
        "--disable-runtime-dependency-installation",
    ]
    if tls is None:
        if node_auth:
            raise ValueError("SuperNode authentication needs TLS: give the certificates")
        cmd.append("--insecure")
    else:
        cmd += [
            "--ssl-ca-certfile",
            str(tls.ca_cert),
            "--ssl-certfile",
            str(tls.server_cert),
            "--ssl-keyfile",
            str(tls.server_key),
        ]
    if node_auth:
        cmd.append("--enable-supernode-auth")
    return cmd


def superexec_command(*, runtime_address: str, root_cert: Path | None = None) -> list[str]:
    """``flower-superexec`` for a SuperLink started with ``--isolation process``.

    Run separately from the SuperLink, it keeps the ServerApp alive when the SuperLink is
    restarted (the run then resumes from the SuperLink's state database).
    """
    cmd = [_bin("flower-superexec"), "--runtime-api-address", runtime_address]
    cmd += ["--root-certificates", str(root_cert)] if root_cert is not None else ["--insecure"]
    return cmd


def node_config_string(
    *,
    partition_id: int,
    num_partitions: int,
    data_path: str | Path | None = None,
    device: str | None = None,
    model_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    data_is_shard: bool = False,
) -> str:
    """Flower ``--node-config`` value: shard, local data file, device, local model, cache.

    ``data_is_shard``: the data file holds only this node's examples (train on all of it).
    """
    items: list[str] = [f"partition-id={partition_id}", f"num-partitions={num_partitions}"]
    for key, value in (
        ("data-path", data_path),
        ("device", device),
        ("model-path", model_path),
        ("cache-dir", cache_dir),
    ):
        if value is not None:
            items.append(f'{key}="{Path(value).resolve() if key != "device" else value}"')
    if data_is_shard:
        items.append("data-is-shard=true")
    return " ".join(items)


def supernode_command(
    *,
    superlink: str,
    node_config: str,
    runtime_port: int = 9094,
    root_cert: Path | None = None,
    private_key: Path | None = None,
    max_retries: int | None = None,
    max_wait_time: float | None = None,
) -> list[str]:
    """``flower-supernode`` for one client machine (insecure unless a CA is given)."""
    cmd = [
        _bin("flower-supernode"),
        "--superlink",
        superlink,
        "--node-config",
        node_config,
        "--port",
        str(runtime_port),
    ]
    cmd += ["--root-certificates", str(root_cert)] if root_cert is not None else ["--insecure"]
    if private_key is not None:
        cmd += ["--auth-supernode-private-key", str(private_key)]
    if max_retries is not None:
        cmd += ["--max-retries", str(max_retries)]
    if max_wait_time is not None:
        cmd += ["--max-wait-time", str(max_wait_time)]
    return cmd


# ------------------------------------------------------------------------------ certificates


def make_certificates(out: str | Path, hosts: Sequence[str], *, days: int = 365) -> TLSFiles:
    """A private CA and a server certificate whose SAN lists ``hosts`` (names and IPs)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not hosts:
        raise ValueError("give at least one host name or IP address for the certificate")
    # The SuperExec and local tools reach the SuperLink through the loopback interface.
    hosts = list(dict.fromkeys([*hosts, "127.0.0.1", "localhost"]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "car-fl private CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(out / "ca.crt", out / "server.pem", out / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.server_key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(files.server_key, 0o600)
    return files


def make_node_key(path: str | Path) -> tuple[Path, Path]:
    """An ECDSA (P-384) key pair for SuperNode authentication: ``path`` and ``path.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = Path(path)
    private.parent.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
    )
    os.chmod(private, 0o600)
    public = private.with_suffix(private.suffix + ".pub")
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n"
    )
    return private, public


# ------------------------------------------------------------------------- flwr connections


def write_connection(
    flwr_home: str | Path, name: str, address: str, *, root_cert: Path | None = None
) -> Path:
    """Add (or replace) ``[superlink.<name>]`` in ``$FLWR_HOME/config.toml``."""
    config = Path(flwr_home) / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    text = config.read_text(encoding="utf-8") if config.is_file() else ""
    header = f"[superlink.{name}]"
    kept, skipping = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            skipping = line.strip() == header
        if not skipping:
            kept.append(line)
    block = [header, f'address = "{address}"']
    block += [f'root-certificates = "{root_cert.resolve()}"'] if root_cert else ["insecure = true"]
    config.write_text("\n".join([*kept, "", *block]).strip() + "\n", encoding="utf-8")
    return config


def register_node(
    public_key: Path, connection: str, *, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``flwr supernode register KEY.pub CONNECTION`` (SuperLink with node auth on)."""
    return subprocess.run(
        [_bin("flwr"), "supernode", "register", str(public_key), connection],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


# ---------------------------------------------------------------------------- local cluster


@dataclass
class LocalCluster:
    """One SuperLink and N SuperNodes on this machine, started and stopped by PID.

    The PIDs are kept in ``<folder>/cluster.json`` so ``stop`` works from another process.
    """

    folder: Path
    processes: dict[str, int] = field(default_factory=dict)

    @property
    def state_file(self) -> Path:
        return self.folder / "cluster.json"

    def start(self, name: str, cmd: list[str], *, env: dict[str, str] | None = None) -> int:
        """Start ``cmd`` in its own session, logging to ``<folder>/<name>.log``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        log = (self.folder / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.processes[name] = proc.pid
        self.save()
        return proc.pid

    def save(self) -> None:
        self.state_file.write_text(json.dumps(asdict(self), default=str, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> LocalCluster:
        folder = Path(folder)
        state = folder / "cluster.json"
        if not state.is_file():
            raise FileNotFoundError(f"{state} not found: no cluster was started in {folder}")
        data = json.loads(state.read_text())
        return cls(folder=folder, processes={k: int(v) for k, v in data["processes"].items()})

    def alive(self, name: str) -> bool:
        pid = self.processes.get(name)
        if pid is None:
            return False
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (another process started it): probe
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True
        return waited == 0

    def kill(self, name: str, sig: int = signal.SIGTERM, *, timeout: float = 15.0) -> None:
        """Signal the process group we started for ``name`` and wait for it to end."""
        pid = self.processes.get(name)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + timeout
        while self.alive(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive(name):
            os.killpg(pid, signal.SIGKILL)
            while self.alive(name):
                time.sleep(0.1)
        self.processes.pop(name, None)
        self.save()

    def stop(self) -> None:
        """Stop SuperNodes first, then the SuperLink."""
        for name in sorted(self.processes, key=lambda n: n == "superlink"):
            self.kill(name)


# ------------------------------------------------------------------------------ runs and status


def start_run(
    project: str | Path, connection: str, overrides: str, *, env: dict[str, str] | None = None
) -> str:
    """``flwr run PROJECT CONNECTION --run-config overrides=...``; returns the run id."""
    cmd = [
        _bin("flwr"),
        "run",
        str(project),
        connection,
        "--format",
        "json",
        "--run-config",
        f"overrides={json.dumps(overrides)}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    try:
        reply = json.loads(out.stdout[out.stdout.index("{") :])
    except ValueError:
        reply = {}
    if out.returncode != 0 or not reply.get("success"):
        raise RuntimeError(f"flwr run failed ({out.returncode}): {out.stdout}\n{out.stderr}")
    return str(reply["run-id"])


def run_status(
    connection: str, run_id: str, *, env: dict[str, str] | None = None
) -> dict[str, str]:
    """The run's ``status`` and ``status-details`` from ``flwr ls``."""
    cmd = [_bin("flwr"), "ls", connection, "--run-id", run_id, "--format", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    try:
        runs = json.loads(out.stdout[out.stdout.index("{") :])["runs"]
    except (ValueError, KeyError):
        return {"status": "unknown", "status-details": out.stdout + out.stderr}
    return (
        {k: str(runs[0].get(k)) for k in ("status", "status-details")}
        if runs
        else {"status": "unknown", "status-details": "no such run"}
    )


def wait_for_run(
    connection: str,
    run_id: str,
    *,
    timeout: float,
    poll: float = 3.0,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """Poll until the run is finished (``flwr run`` may exit 0 for a run that failed)."""
    deadline = time.monotonic() + timeout
    while True:
        status = run_status(connection, run_id, env=env)
        if status["status"].startswith("finished") or time.monotonic() > deadline:
            return status
        time.sleep(poll)
