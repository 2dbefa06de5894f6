"""Command lines of Flower's deployment executables, and a SuperNode's ``--node-config``.

Pure functions: they build argument lists and strings, and start nothing.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from car_fl.deploy.certs import TLSFiles
from car_fl.settings.compose import (
    DATA_IS_SHARD,
    DEVICE,
    NODE_CONFIG,
    NUM_PARTITIONS,
    PARTITION_ID,
    PRIVACY_POLICY,
    WORKER,
)

FLEET_PORT = 9092  # gRPC Fleet API: SuperNodes connect here (open it to the clients)
CONTROL_PORT = 9093  # HTTP(S) Control API: `flwr run` connects here (open it to the operator)
RUNTIME_PORT = 9094  # a SuperNode's local runtime API (its ClientApp processes connect here)
LOOPBACK = "127.0.0.1"  # where a service listens unless told otherwise


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name) can only be reached from this machine."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def exposure_warning(host: str, *, tls: bool, insecure: bool) -> str | None:
    """A warning for a service listening on ``host``; ``ValueError`` if it would be reachable
    from the network without TLS and ``insecure`` was not asked for explicitly."""
    if tls or is_loopback(host):
        return None
    if not insecure:
        raise ValueError(
            f"--bind {host} without --certs would serve the SuperLink unencrypted to the "
            "network: give --certs (scripts/make_certs.py), or add --insecure on a trusted "
            "network, or keep the default --bind 127.0.0.1 (this machine only)"
        )
    return (
        f"warning: the SuperLink listens on {host} without TLS (--insecure): anyone who "
        "can reach this machine can join as a SuperNode or start runs"
    )


class FlowerNotFound(RuntimeError):
    """A Flower executable is neither beside the running Python nor on ``PATH``."""


def python_bin() -> Path:
    """The folder of the running Python (a venv's ``bin``, not resolved), where pip put Flower's
    executables."""
    return Path(sys.executable).absolute().parent


def flwr_bin(name: str) -> str:
    """A Flower executable (``flwr``, ``flower-superlink``, ...) beside the running Python,
    else from ``PATH``; :class:`FlowerNotFound`, in one line, if it is in neither."""
    beside = python_bin() / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FlowerNotFound(
            f"Flower's {name!r} is neither beside the running Python ({python_bin()}) nor on "
            f"PATH: install car-fl with its Flower (pip install -e .) into the environment of "
            f"{sys.executable}, or run with the Python of the environment that has it"
        )
    return found


#: Flower's executables a local deployment starts (or that those start by name).
FLOWER_EXECUTABLES = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr")


def check_flower() -> None:
    """:class:`FlowerNotFound` unless every one of :data:`FLOWER_EXECUTABLES` is found."""
    for name in FLOWER_EXECUTABLES:
        flwr_bin(name)


def flower_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the running Python's folder first on ``PATH``:
    Flower's processes start each other by name, from a venv that may not be activated."""
    env = dict(os.environ if env is None else env)
    here = str(python_bin())
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != here]
    env["PATH"] = os.pathsep.join([here, *rest])
    return env


def pinned(cmd: list[str], core: int | None) -> list[str]:
    """``cmd`` run on one CPU core (its children inherit the affinity), or as it is."""
    return cmd if core is None else ["taskset", "-c", str(core), *cmd]


def superlink_command(
    *,
    fleet_address: str = f"{LOOPBACK}:{FLEET_PORT}",
    control_host: str = LOOPBACK,
    control_port: int = CONTROL_PORT,
    database: str | Path = "superlink-state.db",
    tls: TLSFiles | None = None,
    node_auth: bool = False,
    isolation: str = "subprocess",
) -> list[str]:
    """``flower-superlink`` for a deployment: runtime dependency installation off; on loopback
    unless given other addresses (check those with :func:`exposure_warning`)."""
    cmd = [
        flwr_bin("flower-superlink"),
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
    """``flower-superexec`` for a SuperLink started with ``--isolation process`` (apart from it,
    so the ServerApp lives on when the SuperLink is restarted)."""
    cmd = [flwr_bin("flower-superexec"), "--runtime-api-address", runtime_address]
    cmd += ["--root-certificates", str(root_cert)] if root_cert is not None else ["--insecure"]
    return cmd


#: ``node_config_string`` argument -> node-config key, one per key the client applies.
LOCAL_ARGUMENTS = {
    key.replace("-", "_"): key for key, spec in NODE_CONFIG.items() if spec.setting is not None
}


def node_config_string(
    *,
    partition_id: int,
    num_partitions: int,
    data_is_shard: bool = False,
    worker: str | Path | None = None,
    privacy_policy: str | Path | None = None,
    **local: str | Path | None,
) -> str:
    """Flower ``--node-config`` value: the node's shard and its local values.

    ``local``: a keyword per ``NODE_CONFIG`` key that sets a value, with underscores
    (``data_path``, ``cache_dir``, ...); ``None`` leaves it out, paths are made absolute.
    ``data_is_shard``: the file holds only this node's examples. ``worker``: the node's worker
    folder. ``privacy_policy``: the owner's policy file (give it to the worker's config too).
    """
    unknown = sorted(set(local) - set(LOCAL_ARGUMENTS))
    if unknown:
        raise ValueError(f"unknown node-config values {unknown}; valid: {sorted(LOCAL_ARGUMENTS)}")
    items = [f"{PARTITION_ID}={partition_id}", f"{NUM_PARTITIONS}={num_partitions}"]
    extra = {WORKER: worker, PRIVACY_POLICY: privacy_policy}
    keys = [*LOCAL_ARGUMENTS.items(), ("worker", WORKER), ("privacy_policy", PRIVACY_POLICY)]
    for argument, key in keys:
        value = extra[key] if key in extra else local.get(argument)
        if value is None:
            continue
        text = str(value) if key == DEVICE else str(Path(value).expanduser().resolve())
        if '"' in text:
            raise ValueError(f"{argument}={text!r}: a node-config value cannot hold a '\"'")
        items.append(f'{key}="{text}"')
    if data_is_shard:
        items.append(f"{DATA_IS_SHARD}=true")
    return " ".join(items)


def supernode_command(
    *,
    superlink: str,
    node_config: str,
    runtime_port: int = RUNTIME_PORT,
    root_cert: Path | None = None,
    private_key: Path | None = None,
    max_retries: int | None = None,
    max_wait_time: float | None = None,
    trusted_entities: Path | None = None,
) -> list[str]:
    """``flower-supernode`` for one client machine (insecure unless a CA is given);
    ``trusted_entities``: the keys a FAB must be signed by (docs/deployment.md, 5c)."""
    cmd = [
        flwr_bin("flower-supernode"),
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
    if trusted_entities is not None:
        cmd += ["--trusted-entities", str(trusted_entities)]
    return cmd


def worker_command(*, folder: Path, node_config: str, restart: bool = True) -> list[str]:
    """``car-fl worker`` for one node: its folder and the node's own ``--node-config``."""
    cmd = [sys.executable, "-m", "car_fl.cli", "worker", "--dir", str(Path(folder).resolve())]
    cmd += ["--node-config", node_config]
    return cmd if restart else [*cmd, "--no-restart"]
