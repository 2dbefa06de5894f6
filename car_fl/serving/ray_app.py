"""What every car-fl Ray Serve application shares: its settings, start, stop and command line.

:class:`ServeConfig` refuses to serve other machines without a token (and TLS).
:func:`start_serve` starts a private Ray (or joins a cluster) and Serve's proxy with
:mod:`.admission`, refusing a held port first; :func:`stop` drains, then ends both. The
``*serve*`` helpers give ``car-fl serve-blocks`` and ``car-fl serve`` one set of flags and one
lifetime: serve until Ctrl-C or SIGTERM, then stop.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from car_fl.serving.admission import AdmissionConfig, drain, environment, token_digest

log = logging.getLogger(__name__)

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
    #: Seconds a request's body may take to arrive after its headers (408 after).
    body_timeout_s: float = 10.0
    #: Seconds a request's headers may take (the connection is closed after).
    header_timeout_s: float = 10.0
    #: Requests one client (IP address) may have open at once (503 with Retry-After above).
    max_per_client: int = 128
    #: Seconds a stop waits for the requests in flight to be answered.
    drain_s: float = 30.0

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
        if self.drain_s < 0:
            raise ValueError(f"--drain-s must be >= 0, got {self.drain_s}")

    #: The application's route prefix (each service's own).
    route: ClassVar[str] = ""
    #: Paths of the application that answer without the token.
    open_paths: ClassVar[tuple[str, ...]] = ()

    @property
    def max_body(self) -> int:
        """The largest body a request may declare (each service's own)."""
        return 1 << 20

    def admission(self, drain_file: str | None) -> AdmissionConfig:
        """What Serve's proxy admits (:mod:`.admission`): its limits, and the token's digest."""
        return AdmissionConfig(
            max_body=self.max_body,
            body_timeout_s=self.body_timeout_s,
            header_timeout_s=self.header_timeout_s,
            per_client=self.max_per_client,
            max_buffered=max(512 << 20, 2 * self.max_body),
            open_paths=(*self.open_paths, "/-/routes", "/-/healthz"),
            token_sha256=token_digest(self.token),
            drain_file=drain_file,
        )

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


class PortInUse(OSError):
    """The service's port is held by another process."""


def check_port(host: str, port: int) -> None:
    """Refuse, in one line naming the holder, a ``host:port`` this process cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # past connections in TIME_WAIT do not count; a listener does, even one that set
        # SO_REUSEPORT (as Serve's proxy may: two services would then share the port)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise PortInUse(
                f"{host}:{port} is in use{holder(port)} ({err.strerror}): choose another --port"
            ) from None


def holder(port: int) -> str:
    """`` by <name> (pid N)``: the process listening on ``port``, where this user may see it."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                if conn.pid is None:
                    return " by another user's process"
                return f" by {psutil.Process(conn.pid).name()} (pid {conn.pid})"
    except (psutil.Error, OSError):
        pass
    return ""


@dataclass
class _Running:
    """What :func:`start_serve` made that :func:`stop` must end: the proxy's drain, the folder."""

    service: ServeConfig
    app: str
    admission: AdmissionConfig | None = None
    folder: str | None = None


_running: _Running | None = None


def _quiet(record: logging.LogRecord) -> bool:
    """Drop Serve's note that ``serve.run`` ignores ``serve.start``'s HTTP options: it does not."""
    message = record.getMessage()
    return not (
        message.startswith("The new client HTTP config differs")
        or message.startswith("Connecting to existing Serve app")
    )


def start_serve(service: ServeConfig, *, namespace: str) -> None:
    """Start Ray (or join ``service.ray_address``) and Serve's HTTP proxy on its address."""
    import tempfile

    import ray
    from ray import serve

    global _running
    running = _Running(service, namespace)
    logging.getLogger("ray.serve").addFilter(_quiet)
    if not ray.is_initialized():
        own: dict[str, Any] = {}
        if service.ray_address == "local":  # its own folder: Flower's ray.init() never joins it
            check_port(service.host, service.port)  # before Ray: one line, not a hung proxy
            running.folder = own["_temp_dir"] = tempfile.mkdtemp(prefix="car-fl-ray-", dir="/tmp")
            running.admission = service.admission(os.path.join(running.folder, "drain"))
            os.environ.update(environment(running.admission))  # the proxy's process reads them
            # Ray starts its workers at nice 15 (a batch job's place); a service answers at the
            # priority of the command that started it, unless the user says otherwise
            os.environ.setdefault("RAY_worker_niceness", "0")
        else:
            log.warning(
                "--ray-address %s: the cluster's own HTTP proxy serves, without car-fl's "
                "admission limits (docs/retrieval.md, 'Hostile clients')",
                service.ray_address,
            )
        _running = running
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
    """Drain the proxy, then end the Ray this process started and remove its temp folder; on a
    cluster it joined, delete only this service's app."""
    import ray
    from ray import serve

    global _running
    running, _running = _running, None
    if ray.is_initialized():
        try:
            if running is not None and running.admission is not None:
                started = time.monotonic()
                drained = drain(
                    running.admission,
                    timeout_s=running.service.drain_s,
                    poke=lambda: poke(running.service),
                )
                if not drained:
                    log.warning(
                        "stop: requests still open after --drain-s %g s", running.service.drain_s
                    )
                log.info("stop: drained in %.1f s", time.monotonic() - started)
            elif running is not None:  # someone else's cluster: only our app goes
                serve.delete(running.app)
        finally:
            ray.shutdown()  # our own instance: its proxy, replicas and controller end with it
            # without serve.shutdown (noisy), Serve's cached client would name a dead controller
            from ray.serve import context

            context._set_global_client(None)
    if running is not None and running.folder is not None:
        shutil.rmtree(running.folder, ignore_errors=True)


def poke(service: ServeConfig) -> None:
    """One request to the proxy (Serve's own health path), so that it notices a drain."""
    import ssl

    host = "127.0.0.1" if service.host in ("0.0.0.0", "localhost") else service.host
    host = "::1" if host == "::" else host
    try:
        with socket.create_connection((host, service.port), timeout=2) as raw:
            sock: socket.socket = raw
            if service.ssl_certfile:  # our own proxy: its certificate need not name the host
                context = ssl.create_default_context()
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                sock = context.wrap_socket(raw)
            sock.sendall(b"GET /-/healthz HTTP/1.1\r\nHost: car-fl\r\nConnection: close\r\n\r\n")
            while sock.recv(4096):
                pass
    except OSError:
        pass


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
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=10.0,
        help="seconds a request's body may take to arrive (408 after; default 10)",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="seconds a request's headers may take to arrive (closed after; default 10)",
    )
    parser.add_argument(
        "--max-per-client",
        type=int,
        default=128,
        help="requests one client address may have open (503 + Retry-After above; default 128)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to answer the requests in flight before stopping (default 30)",
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


#: The :class:`ServeConfig` fields a flag of :func:`add_serve_arguments` sets as it is.
FLAG_FIELDS = (
    "host", "port", "replicas", "cpus_per_replica", "gpus_per_replica", "ray_address",
    "ssl_certfile", "ssl_keyfile", "plain_http", "body_timeout_s", "header_timeout_s",
    "max_per_client", "drain_s",
)  # fmt: skip


def serve_config_values(args: argparse.Namespace, *, token_env: str) -> dict[str, Any]:
    """The :class:`ServeConfig` fields that :func:`add_serve_arguments`' flags set."""
    values = {name: getattr(args, name) for name in FLAG_FIELDS}
    return {**values, "token": read_token(args.token_file, env=token_env)}


def serve_until_stopped(
    command: str, start: Callable[[], str], *, what: str, ready_file: str | None
) -> int:
    """Start the service, announce its URL (and ``ready_file``), serve until Ctrl-C or SIGTERM,
    then stop it."""
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
