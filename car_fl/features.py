"""Pooled hidden states of the frozen encoder: extraction batched by length, and caches.

In ``classifier`` mode the encoder runs once per example, ever: features are computed under
``torch.inference_mode()``, in batches of similar length (sorted, then put back in the original
order, so padding costs little), and kept in memory and on disk under a key derived from the
model, its configuration, the pooling, the max length and the texts themselves. The key is
computed without loading the encoder, so a fully cached client never loads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from car_fl.config import ModelConfig
from car_fl.encoder import pick_device, pick_dtype

log = logging.getLogger(__name__)

CACHE_FORMAT = "car-fl-features-v1"


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first); covers each index once."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def arrival_batches(count: int, batch_size: int) -> list[list[int]]:
    """Indices in their original order, ``batch_size`` at a time (no length sorting)."""
    return [list(range(i, min(i + batch_size, count))) for i in range(0, count, batch_size)]


def extract_features(
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pad: Callable[[list[list[int]]], tuple[torch.Tensor, torch.Tensor]],
    input_ids: Sequence[list[int]],
    *,
    batch_size: int,
    bucket: bool = True,
    progress: bool = True,
    desc: str = "features",
) -> torch.Tensor:
    """Pooled vectors ``(n, d)`` for token id lists, in the order given.

    ``encode(ids, mask)`` returns ``(batch, d)``; ``pad`` pads a batch. With ``bucket`` the
    batches group similar lengths, otherwise they follow arrival order.
    """
    if not input_ids:
        raise ValueError("no texts to extract features from")
    lengths = [len(ids) for ids in input_ids]
    batches = (
        length_batches(lengths, batch_size) if bucket else arrival_batches(len(lengths), batch_size)
    )
    out: torch.Tensor | None = None
    for batch in tqdm(batches, desc=desc, disable=not progress, unit="batch", leave=False):
        with torch.inference_mode():
            ids, mask = pad([input_ids[i] for i in batch])
            pooled = encode(ids, mask)  # (batch, d)
        # ``out`` is an ordinary tensor (not an inference tensor), so it can feed autograd.
        if out is None:
            out = torch.empty((len(input_ids), pooled.shape[-1]), dtype=pooled.dtype)
        out[torch.tensor(batch)] = pooled.detach().to("cpu")
    assert out is not None
    return out


def _model_fingerprint(cfg: ModelConfig) -> dict[str, object]:
    """What identifies the encoder's weights without loading them."""
    info: dict[str, object] = {"name_or_path": cfg.name_or_path, "revision": cfg.revision}
    folder = Path(cfg.name_or_path).expanduser()
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


def feature_key(
    cfg: ModelConfig, texts: Sequence[str], *, device: str, adapter: torch.Tensor | None = None
) -> str:
    """Content key: model identity and files, dtype, pooling, max length, adapter, texts."""
    target = pick_device(device)
    digest = hashlib.sha256()
    header = {
        "format": CACHE_FORMAT,
        "model": _model_fingerprint(cfg),
        "dtype": str(pick_dtype(cfg.dtype, target)),
        "device_type": target.type,
        "pooling": cfg.pooling,
        "max_length": cfg.max_length,
    }
    digest.update(json.dumps(header, sort_keys=True).encode())
    if adapter is not None:
        digest.update(adapter.detach().float().cpu().numpy().tobytes())
    for text in texts:
        encoded = text.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()[:32]


def default_cache_dir() -> Path:
    base = os.environ.get("CAR_FL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "car-fl"
    )
    return Path(base) / "features"


class FeatureCache:
    """Features by content key: a process-wide memory cache in front of a folder on disk.

    Memory entries are keyed by their disk path, so two caches in different folders never
    answer for each other.
    """

    _memory: ClassVar[dict[str, torch.Tensor]] = {}

    def __init__(self, directory: str | Path | None = None, *, disk: bool = True) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.disk = disk
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.safetensors"

    def get(self, key: str) -> torch.Tensor | None:
        path = self.path(key)
        if str(path) in self._memory:
            self.hits += 1
            return self._memory[str(path)]
        if self.disk and path.is_file():
            try:
                tensor = load_file(str(path))["features"]
            except Exception as err:  # a corrupt cache file is recomputed, not fatal
                log.warning("ignoring unreadable feature cache %s: %s", path, err)
            else:
                self._memory[str(path)] = tensor
                self.hits += 1
                return tensor
        self.misses += 1
        return None

    def put(self, key: str, features: torch.Tensor) -> None:
        self._memory[str(self.path(key))] = features
        if not self.disk:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path(key)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        save_file({"features": features.contiguous()}, str(tmp))
        os.replace(tmp, target)

    @classmethod
    def clear_memory(cls) -> None:
        cls._memory.clear()
