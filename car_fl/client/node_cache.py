"""What a node keeps on disk between ClientApp processes: resolved settings and its shard.

Flower starts a new ClientApp process per message, so a round whose features are cached reads
these instead of composing Hydra settings or reading the dataset. Settings are keyed by the
overrides, the node config and :data:`SETTINGS_SOURCES`; a shard (texts, label ids, the node's
own label map) by the dataset settings, the data files' identity, the partition and the source
of :mod:`car_fl.data`. Only local data files are cached, in the node's own folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import car_fl
from car_fl.common.io import atomic_write_json
from car_fl.data.labels import LabelMap
from car_fl.settings.compose import conf_dir
from car_fl.settings.schema import Settings

log = logging.getLogger(__name__)

CACHE_FORMAT = "car-fl-node-v2"
#: The ``car_fl`` package folder.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
#: The code that turns overrides and a node config into settings, its defaults included (part
#: of the cache key): a folder stands for every module in it.
SETTINGS_SOURCES = (
    "settings",
    "privacy",
    "adapters/config.py",
    "heads/config.py",
    "common/choice.py",
    "client/node.py",
)


def base_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The node's cache folder: ``cache-dir`` of its node config, else car-fl's default
    (``$CAR_FL_CACHE``, else ``$XDG_CACHE_HOME/car-fl``, else ``~/.cache/car-fl``: all the
    node owner's own environment, never the run config)."""
    if cache_dir not in (None, ""):
        return Path(str(cache_dir)).expanduser()
    env = os.environ.get("CAR_FL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "car-fl"
    )
    return Path(env)


def node_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """:func:`base_dir`, created readable by the node's owner only (0700, also if it was not),
    so nobody else can read what the node writes under it."""
    folder = base_dir(cache_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if folder.stat().st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def digest(header: Any, files: Mapping[str, Path] | None = None) -> str:
    """A content key: SHA-256 of ``header`` as canonical JSON, then of the files' bytes."""
    hasher = hashlib.sha256(json.dumps(header, sort_keys=True, default=str).encode())
    for name, path in sorted((files or {}).items()):
        hasher.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return hasher.hexdigest()[:32]


def _source_files(folder: Path, pattern: str) -> dict[str, Path]:
    """Files by their path relative to ``folder`` (the same wherever the project is installed)."""
    return {str(p.relative_to(folder)): p for p in folder.rglob(pattern) if p.is_file()}


def settings_code() -> dict[str, Path]:
    """The modules :data:`SETTINGS_SOURCES` names, by their path within the package."""
    code: dict[str, Path] = {}
    for name in SETTINGS_SOURCES:
        path = PACKAGE_DIR / name
        found = _source_files(path, "*.py") if path.is_dir() else {"": path}
        code.update({f"car_fl/{Path(name, rel)}": file for rel, file in found.items()})
    return code


def settings_key(overrides: str, node_config: Mapping[str, Any]) -> str:
    """Cache key of a node's settings: overrides, node config, conf files and settings code."""
    files = {**_source_files(conf_dir(), "*.yaml"), **settings_code()}
    header = {
        "format": CACHE_FORMAT,
        "version": car_fl.__version__,
        "overrides": overrides,
        "node_config": sorted((str(k), str(v)) for k, v in node_config.items()),
    }
    return digest(header, files)


def settings_path(cache_dir: str | os.PathLike[str] | None, key: str) -> Path:
    return base_dir(cache_dir) / "settings" / f"{key}.json"


def load_settings_entry(path: Path) -> tuple[Settings, str] | None:
    """Settings and fingerprint stored at ``path``; ``None`` when absent or unreadable."""
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        return settings_from_dict(stored["settings"]), str(stored["fingerprint"])
    except (ValueError, KeyError, TypeError) as err:  # composed again and replaced
        log.warning("ignoring unreadable settings cache %s: %s", path, err)
        return None


def save_settings_entry(path: Path, settings: Settings, fingerprint: str) -> None:
    atomic_write_json(path, {"settings": asdict(settings), "fingerprint": fingerprint}, mode=0o600)


def settings_from_dict(values: Mapping[str, Any]) -> Settings:
    """:class:`Settings` from ``dataclasses.asdict`` output, without OmegaConf (slow); every
    section validates itself. Unknown keys raise ``TypeError``, missing ones ``KeyError``."""
    hints = get_type_hints(Settings)
    kwargs: dict[str, Any] = {}
    for item in fields(Settings):
        value, kind = values[item.name], hints[item.name]
        kwargs[item.name] = (
            kind(**value) if isinstance(kind, type) and is_dataclass(kind) else value
        )
    if set(values) - set(kwargs):
        raise TypeError(f"unknown settings {sorted(set(values) - set(kwargs))}")
    return Settings(**kwargs)


def _file_identity(path: str | None) -> list[Any] | None:
    if path is None:
        return None
    target = Path(path).expanduser().resolve()
    stat = target.stat()
    return [str(target), stat.st_size, stat.st_mtime_ns]


def shard_key(
    settings: Settings,
    *,
    partition_id: int,
    num_partitions: int,
    data_is_shard: bool,
) -> str | None:
    """Cache key of a node's shard, or ``None`` when the data is not a local file."""
    if settings.dataset.path is None or not Path(settings.dataset.path).expanduser().exists():
        return None
    header = {
        "format": CACHE_FORMAT,
        "dataset": asdict(settings.dataset),
        "files": [
            _file_identity(d)
            for d in (
                settings.dataset.path,
                settings.dataset.test_path,
                settings.dataset.documents_path,
                settings.dataset.generated_queries_path,
            )
        ],
        "seed": settings.seed,
        "partitioning": [settings.fl.partitioning, settings.fl.alpha],
        "node": [partition_id, num_partitions, data_is_shard],
    }
    return digest(header, _source_files(PACKAGE_DIR / "data", "*.py"))


def shard_path(settings: Settings, key: str) -> Path:
    return base_dir(settings.cache_dir) / "shards" / f"{key}.json"


def load_shard(settings: Settings, key: str) -> tuple[list[str], list[int], LabelMap] | None:
    """Texts, label ids and label map stored under ``key``; ``None`` when absent or unreadable."""
    path = shard_path(settings, key)
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        texts, ids = [str(t) for t in stored["texts"]], [int(i) for i in stored["labels"]]
        label_map = LabelMap(tuple(str(n) for n in stored["label_names"]))
    except (ValueError, KeyError, TypeError) as err:
        log.warning("ignoring unreadable shard cache %s: %s", path, err)
        return None
    if len(texts) != len(ids):
        log.warning("ignoring shard cache %s: %d texts, %d labels", path, len(texts), len(ids))
        return None
    log.info("shard of %d examples from the node cache (%s)", len(texts), path.name)
    return texts, ids, label_map


def save_shard(
    settings: Settings, key: str, texts: Sequence[str], ids: Sequence[int], label_map: LabelMap
) -> None:
    stored = {"texts": list(texts), "labels": list(ids), "label_names": label_map.to_list()}
    atomic_write_json(shard_path(settings, key), stored, mode=0o600)
