"""What every car-fl Ray Serve application shares: its settings, start, stop and command line.

:class:`ServeConfig` holds where a service listens and what its replicas may use, and refuses
to serve other machines without a token. :func:`start_serve` starts a local Ray instance of its
own (a private temp folder, so Flower's simulation never attaches to it) or joins an existing
cluster, then Serve's HTTP proxy; :func:`stop` ends both. :func:`add_serve_arguments`,
:func:`serve_config_values` and :func:`serve_until_stopped` give ``car-fl serve-blocks`` and
``car-fl serve`` one set of flags and one lifetime: serve until Ctrl-C or SIGTERM, then stop.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

#: The addresses only this machine can reach: no token needed to serve there.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeConfig:
    """How a service runs: where it listens, how many replicas, what each may use."""

    host: str = "127.0.0.1"
    port: int = 8200
    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    #: ``local``: a Ray instance of its own; ``auto`` or ``host:port``: an existing cluster.
    ray_address: str = "local"
    #: Requests a replica takes into one batch at most.
    max_batch_requests: int = 16
    batch_wait_s: float = 0.005
    token: str | None = field(default=None, repr=False)  # never in a log line or a traceback
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    #: Serve other machines over plain HTTP (the token and the data in clear): a trusted
    #: network only, e.g. a VPN; without it another host needs TLS.
    plain_http: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        if self.host not in LOOPBACK and not self.token:
            raise ValueError(
                f"--host {self.host} would serve other machines without a token: give "
                "--token-file (and TLS: --ssl-certfile/--ssl-keyfile), or keep 127.0.0.1"
            )
        if self.host not in LOOPBACK and not self.ssl_certfile and not self.plain_http:
            raise ValueError(
                f"--host {self.host} would send the token and every request in clear text: "
                "give --ssl-certfile and --ssl-keyfile (python scripts/make_certs.py), or "
                "--plain-http on a network you trust (a VPN)"
            )

    #: The application's route prefix (each service's own).
    route: ClassVar[str] = ""

    @property
    def origin(self) -> str:
        """``scheme://host:port``, without the application's route."""
        scheme = "https" if self.ssl_certfile else "http"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Where clients send their requests: :attr:`origin` and :attr:`route`."""
        return self.origin + self.route

    def actor_options(self) -> dict[str, float]:
        """What Ray reserves for each replica."""
        return {"num_cpus": self.cpus_per_replica, "num_gpus": self.gpus_per_replica}


def start_serve(service: ServeConfig, *, namespace: str) -> None:
    """Start Ray (or join ``service.ray_address``) and Serve's HTTP proxy on its address."""
    import tempfile

    import ray
    from ray import serve

    if not ray.is_initialized():
        own: dict[str, Any] = {}
        if service.ray_address == "local":  # its own folder: Flower's ray.init() never joins it
            own["_temp_dir"] = tempfile.mkdtemp(prefix="car-fl-ray-", dir="/tmp")
        ray.init(
            address=service.ray_address,
            include_dashboard=False,
            namespace=namespace,
            log_to_driver=False,
            **own,
        )
    http: dict[str, Any] = {"host": service.host, "port": service.port}
    if service.ssl_certfile:
        http.update(ssl_certfile=service.ssl_certfile, ssl_keyfile=service.ssl_keyfile)
    serve.start(http_options=http)


def stop() -> None:
    """Delete the apps, stop Serve, and end the Ray instance this process started."""
    import ray
    from ray import serve

    if ray.is_initialized():
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def add_serve_arguments(parser: argparse.ArgumentParser, *, port: int, token_env: str) -> None:
    """The flags of a service's command: address, replicas, their CPUs, token, TLS, ready file."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=port, help=f"HTTP port (default {port})")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of the service")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--gpus-per-replica", type=float, default=0.0)
    parser.add_argument(
        "--ray-address",
        default="local",
        help="local (default: a Ray instance of its own), auto or host:port (an existing cluster)",
    )
    parser.add_argument(
        "--token-file", default=None, help=f"a file holding the shared token (or ${token_env})"
    )
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM)")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    parser.add_argument(
        "--plain-http",
        action="store_true",
        help="serve another --host without TLS (a trusted network only: the token is in clear)",
    )
    parser.add_argument(
        "--ready-file", default=None, help="write the service's URL here once it answers"
    )


def read_token(path: str | None, *, env: str) -> str | None:
    """The token from ``path`` or, without one, from ``$env`` (never a flag: argv is public)."""
    if path is None:
        return os.environ.get(env) or None
    try:
        token = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except OSError as err:
        raise FileNotFoundError(f"--token-file {path}: cannot be read ({err.strerror})") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


def serve_config_values(args: argparse.Namespace, *, token_env: str) -> dict[str, Any]:
    """The :class:`ServeConfig` fields that :func:`add_serve_arguments`' flags set."""
    return {
        "host": args.host,
        "port": args.port,
        "replicas": args.replicas,
        "cpus_per_replica": args.cpus_per_replica,
        "gpus_per_replica": args.gpus_per_replica,
        "ray_address": args.ray_address,
        "token": read_token(args.token_file, env=token_env),
        "ssl_certfile": args.ssl_certfile,
        "ssl_keyfile": args.ssl_keyfile,
        "plain_http": args.plain_http,
    }


def serve_until_stopped(
    command: str, start: Callable[[], str], *, what: str, ready_file: str | None
) -> int:
    """Start the service, announce its URL (and write ``ready_file``), serve until Ctrl-C or
    SIGTERM, then stop it (an existing cluster is left running)."""
    stopped = threading.Event()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        url = start()
        signal.signal(signal.SIGTERM, lambda *_: stopped.set())  # after ray.init sets its own
        print(f"car-fl {command}: {what} at {url}", flush=True)
        if ready_file:
            Path(ready_file).write_text(url + "\n", encoding="utf-8")
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop()
    print(f"car-fl {command}: stopped", file=sys.stderr)
    return 0
