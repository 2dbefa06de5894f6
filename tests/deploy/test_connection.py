"""car_fl.deploy.connection: the flwr connection in ``$FLWR_HOME/config.toml``."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from car_fl.deploy.connection import write_connection


def read(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def test_write_connection_adds_and_replaces_its_own_table_only(tmp_path: Path) -> None:
    home = tmp_path / "flwr"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "lab"\n\n[superlink.lab]\naddress = "10.0.0.1:9093"\n'
        "insecure = true\n"
    )
    config = write_connection(home, "local", "127.0.0.1:7002")
    assert read(config)["superlink"] == {
        "default": "lab",
        "lab": {"address": "10.0.0.1:9093", "insecure": True},
        "local": {"address": "127.0.0.1:7002", "insecure": True},
    }
    ca = tmp_path / "certs" / "ca.crt"
    write_connection(home, "local", "127.0.0.1:7003", root_cert=ca)
    assert read(config)["superlink"]["local"] == {
        "address": "127.0.0.1:7003",
        "root-certificates": str(ca.resolve()),
    }
    assert read(config)["superlink"]["lab"] == {"address": "10.0.0.1:9093", "insecure": True}


def test_write_connection_creates_the_flwr_home(tmp_path: Path) -> None:
    config = write_connection(tmp_path / "new" / "flwr", "x", "h:1")
    assert read(config) == {"superlink": {"x": {"address": "h:1", "insecure": True}}}
