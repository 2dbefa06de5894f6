"""What ``flwr run .`` ships to the SuperLink and every node (the FAB), by Flower's own rules."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_files
from flwr.common.constant import FAB_MAX_SIZE

pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")  # Flower's
PROJECT = Path(__file__).resolve().parents[1]


def checkout_files() -> dict[str, Path]:
    """The checkout's files as Flower's ``collect_files`` maps them, without walking the
    environments and caches inside it (60,000 files: seconds)."""
    files = {}
    for folder, dirs, names in os.walk(PROJECT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in names:
            path = Path(folder) / name
            files[path.relative_to(PROJECT).as_posix()] = path
    return files


def test_the_fab_ships_the_apps_the_package_and_its_configs_only() -> None:
    files = checkout_files()
    fab, _ = build_fab_from_files(files)
    shipped = set(zipfile.ZipFile(io.BytesIO(fab)).namelist())
    wanted = {"pyproject.toml", ".info/CONTENT", "server_app.py", "client_app.py"}
    wanted |= {p for p in files if p.startswith("car_fl/") and p.endswith(".py")}
    wanted |= {p for p in files if p.startswith("conf/") and p.endswith(".yaml")}
    assert shipped == wanted, sorted(shipped ^ wanted)[:20]  # no docs/, scripts/ or tests/
    assert len(fab) < FAB_MAX_SIZE // 4, len(fab)  # Flower refuses one over 10 MB
