"""The feature cache: pooled hidden states kept in memory and on disk, per text, per space.

Two texts' features are interchangeable only within one *space* (:func:`space_key`); within
it a text is keyed by its content hash, so only texts never seen are encoded, in any run or
process. Keys are computed without loading the encoder; chunks are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save

from car_fl.common.io import atomic_write_bytes
from car_fl.model.blockless import service_identity
from car_fl.model.encoder import pick_device, pick_dtype
from car_fl.model.loading import attention_choice
from car_fl.model.sources import hub_commit, is_hub_id
from car_fl.settings.schema import ModelConfig

log = logging.getLogger(__name__)

CACHE_FORMAT = "car-fl-features-v2"


def _model_fingerprint(cfg: ModelConfig) -> dict[str, object]:
    """What identifies the encoder's weights without loading them: a Hub model's cached commit
    too (a branch that moved is another space; :meth:`FeatureCache.features` asks again once
    the encoder has loaded)."""
    info: dict[str, object] = {"name_or_path": cfg.name_or_path, "revision": cfg.revision}
    if is_hub_id(cfg.name_or_path):
        info["commit"] = hub_commit(cfg)
    folder = Path(cfg.name_or_path).expanduser()
    if folder.is_file():  # a GGUF file: its size and time stand for its bytes
        stat = folder.stat()
        info["file"] = [stat.st_size, stat.st_mtime_ns]
    if folder.is_dir():
        files = {}
        for path in sorted(folder.iterdir()):
            if path.is_file():
                stat = path.stat()
                files[path.name] = [stat.st_size, stat.st_mtime_ns]
        config = folder / "config.json"
        info["files"] = files
        info["config_sha"] = (
            hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
        )
    return info


def space_key(cfg: ModelConfig, *, device: str) -> str:
    """The features' *space*: model identity and files, dtype, device type, attention kernels,
    pooling and max length, and with remote blocks the service's model, weights and dtype."""
    target = pick_device(device)
    dtype = pick_dtype(cfg.dtype, target)
    attention = attention_choice(dtype, target)
    header = {
        "format": CACHE_FORMAT,
        "model": _model_fingerprint(cfg),
        "dtype": str(dtype),
        "device_type": target.type,
        "pooling": cfg.pooling,
        "max_length": cfg.max_length,
        # new keys only when set, so that the features cached before them stay found
        **({"attention": attention} if attention != "sdpa" else {}),
        **({"layer": cfg.layer} if cfg.layer != -1 else {}),
        **({"prompt": cfg.prompt} if cfg.prompt is not None else {}),
        **({"normalize": cfg.normalize} if cfg.normalize != "none" else {}),
        **({"blocks": service_identity(cfg)} if cfg.blocks == "remote" else {}),
    }
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()[:32]


def text_digest(text: str) -> bytes:
    """A text's content key within a space: the first 16 bytes of its UTF-8 SHA-256."""
    return hashlib.sha256(text.encode("utf-8")).digest()[:DIGEST_BYTES]


DIGEST_BYTES = 16


def default_cache_dir() -> Path:
    """car-fl's cache folder: ``$CAR_FL_CACHE``, else ``$XDG_CACHE_HOME/car-fl``, else
    ``~/.cache/car-fl`` (a node's own default too, :func:`car_fl.client.node_cache.base_dir`)."""
    base = os.environ.get("CAR_FL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "car-fl"
    )
    return Path(base)


@dataclass
class _Space:
    """One space's features in memory: stacked chunks and where each text's row lies."""

    chunks: list[torch.Tensor]
    where: dict[bytes, tuple[int, int]]  # text digest → (chunk, row)
    files: set[str]  # chunk files already read


class FeatureCache:
    """Features **per text**: a process-wide memory cache in front of ``directory`` (default
    :func:`default_cache_dir`), under ``features/<space>/`` in chunk files written once,
    atomically. :meth:`features` encodes only the texts no chunk holds (``hits``, ``misses``).
    """

    _memory: ClassVar[dict[str, _Space]] = {}

    def __init__(self, directory: str | Path | None = None, *, disk: bool = True) -> None:
        base = Path(directory).expanduser() if directory not in (None, "") else None
        self.directory = (base or default_cache_dir()) / "features"
        self.disk = disk
        self.hits = 0
        self.misses = 0

    def _space(self, space: str, *, refresh: bool) -> _Space:
        folder = self.directory / space
        entry = self._memory.setdefault(str(folder), _Space(chunks=[], where={}, files=set()))
        if refresh and self.disk and folder.is_dir():
            for path in sorted(folder.glob("*.safetensors")):
                if path.name not in entry.files:
                    entry.files.add(path.name)
                    self._read_chunk(entry, path)
        return entry

    @staticmethod
    def _read_chunk(entry: _Space, path: Path) -> None:
        try:
            tensors = load_file(str(path))
            digests, features = tensors["digests"], tensors["features"]
            if len(digests) != len(features) or digests.shape[-1] != DIGEST_BYTES:
                raise ValueError(f"{len(digests)} digests for {len(features)} rows")
        except Exception as err:  # a corrupt cache file is recomputed, not fatal
            log.warning("ignoring unreadable feature cache %s: %s", path, err)
            return
        _add_chunk(entry, digests, features)

    def lookup(self, space: str, texts: Sequence[str]) -> tuple[torch.Tensor | None, list[int]]:
        """The cached rows of ``texts`` (``None`` if none is cached) and the positions of those
        missing (their rows in the tensor are undefined)."""
        digests = [text_digest(t) for t in texts]
        entry = self._space(space, refresh=False)
        if any(d not in entry.where for d in digests):  # another process may have added some
            entry = self._space(space, refresh=True)
        missing = [i for i, d in enumerate(digests) if d not in entry.where]
        if len(missing) == len(texts):
            return None, missing
        found = [i for i, d in enumerate(digests) if d in entry.where]
        dim = int(entry.chunks[0].shape[1])
        out = torch.empty((len(texts), dim), dtype=entry.chunks[0].dtype)
        by_chunk: dict[int, tuple[list[int], list[int]]] = {}
        for i in found:
            chunk, row = entry.where[digests[i]]
            positions, rows = by_chunk.setdefault(chunk, ([], []))
            positions.append(i)
            rows.append(row)
        for chunk, (positions, rows) in by_chunk.items():
            out[torch.tensor(positions)] = entry.chunks[chunk][torch.tensor(rows)]
        return out, missing

    def put(self, space: str, texts: Sequence[str], features: torch.Tensor) -> None:
        """Store the features ``(len(texts), d)`` of ``texts`` as one new chunk."""
        if len(texts) != len(features):
            raise ValueError(f"{len(features)} feature rows for {len(texts)} texts")
        if not texts:
            return
        digests = torch.tensor([list(text_digest(t)) for t in texts], dtype=torch.uint8)  # (n, 16)
        features = features.detach().cpu().contiguous()
        entry = self._space(space, refresh=False)
        _add_chunk(entry, digests, features)
        if not self.disk:
            return
        name = hashlib.sha256(digests.numpy().tobytes()).hexdigest()[:32] + ".safetensors"
        entry.files.add(name)
        folder = self.directory / space
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tensors = {"digests": digests, "features": features}
        # bytes, not save_file: safetensors' own temporary file would outlive a killed writer
        # 0600: a text's features can be inverted towards the text (a node's cache is its own)
        atomic_write_bytes(folder / name, save(tensors), mode=0o600)

    def features(
        self,
        space: str | Callable[[], str],
        texts: Sequence[str],
        compute: Callable[[list[str]], torch.Tensor],
        *,
        desc: str = "features",
    ) -> torch.Tensor:
        """The features ``(n, d)`` of ``texts``: cached rows, and ``compute(texts)`` called
        once on the distinct texts no chunk holds (not at all when every text is cached).
        A callable ``space`` is asked again after ``compute``: loading the encoder may change it
        (a Hub branch moved, a model cached for the first time), and then no row of the space
        it named before is mixed with those computed."""
        ask = space if callable(space) else lambda: space
        key = ask()
        cached, missing = self.lookup(key, texts)
        self.hits += len(texts) - len(missing)
        if not missing:
            assert cached is not None
            log.info("%s: all %d feature rows cached", desc, len(texts))
            return cached
        todo = list(dict.fromkeys(texts[i] for i in missing))  # distinct, in order
        log.info(
            "%s: %d of %d feature rows cached, encoding %d texts",
            desc,
            len(texts) - len(missing),
            len(texts),
            len(todo),
        )
        computed = compute(todo)  # (len(todo), d)
        self.misses += len(todo)
        now = ask()
        self.put(now, todo, computed)
        if now != key:
            log.info("%s: the encoder loaded is another space than the one looked up", desc)
            return self.features(now, texts, compute, desc=desc)
        row_of = {text: row for row, text in enumerate(todo)}
        rows = torch.tensor([row_of[texts[i]] for i in missing])
        if cached is None:
            return computed[rows].detach().cpu()
        cached[torch.tensor(missing)] = computed[rows].detach().cpu().to(cached.dtype)
        return cached

    @classmethod
    def clear_memory(cls) -> None:
        cls._memory.clear()


def _add_chunk(entry: _Space, digests: torch.Tensor, features: torch.Tensor) -> None:
    chunk = len(entry.chunks)
    entry.chunks.append(features)
    for row, digest in enumerate(digests.numpy()):
        entry.where.setdefault(digest.tobytes(), (chunk, row))
