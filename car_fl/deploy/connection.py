"""The operator's side of a SuperLink: its connection in ``flwr``'s ``config.toml``, node keys.

``flwr`` reads ``$FLWR_HOME/config.toml`` (``~/.flwr`` by default); a connection is one
``[superlink.<name>]`` table holding the Control API address and the CA (or ``insecure``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from car_fl.deploy.commands import flower_env, flwr_bin


def connection_block(name: str, address: str, *, root_cert: Path | None = None) -> list[str]:
    """The lines of ``[superlink.<name>]``: the address, and the CA or ``insecure = true``."""
    block = [f"[superlink.{name}]", f'address = "{address}"']
    block += [f'root-certificates = "{root_cert.resolve()}"'] if root_cert else ["insecure = true"]
    return block


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
    block = connection_block(name, address, root_cert=root_cert)
    config.write_text("\n".join([*kept, "", *block]).strip() + "\n", encoding="utf-8")
    return config


def register_node(
    public_key: Path, connection: str, *, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``flwr supernode register KEY.pub CONNECTION`` (SuperLink with node auth on)."""
    return subprocess.run(
        [flwr_bin("flwr"), "supernode", "register", str(public_key), connection],
        capture_output=True,
        text=True,
        env=flower_env(env),
        check=False,
    )
