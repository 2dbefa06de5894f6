"""Pooled hidden states of the frozen encoder: extraction batched by length, and caches.

In ``classifier`` mode the encoder runs once per example, ever: features are computed under
``torch.inference_mode()``, in batches of similar length (sorted, then put back in the original
order, so padding costs little), and kept in memory and on disk under a key derived from the
model, its configuration, the pooling, the max length and the texts themselves. The key is
computed without loading the encoder, so a fully cached client never loads it.

:func:`prepare_data` / :func:`prepare_for` turn texts and labels into :class:`LocalData`:
features (classifier mode, through the cache) or token ids (adapter mode).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from car_fl.common.io import atomic_write
from car_fl.method.encoder import Encoder, pick_device, pick_dtype
from car_fl.settings.schema import Mode, ModelConfig, Settings

log = logging.getLogger(__name__)


class QueryEncoder(Protocol):
    """What feature extraction needs of a retriever (:class:`~car_fl.method.model.CaRRetriever`):
    its frozen encoder (tokenizer, padding) and its pooled encoding through the adapter."""

    @property
    def encoder(self) -> Encoder: ...

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


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
        tensors = {"features": features.contiguous()}
        # bytes, not save_file: safetensors' own temporary file would outlive a killed writer
        # 0600: a text's features can be inverted towards the text (a node's cache is its own)
        atomic_write(self.path(key), lambda tmp: _write_bytes(tmp, save(tensors)), mode=0o600)

    @classmethod
    def clear_memory(cls) -> None:
        cls._memory.clear()


@dataclass
class LocalData:
    """Examples ready for training: labels, and cached features or token ids by mode."""

    labels: torch.Tensor  # (n,) int64
    features: torch.Tensor | None = None  # (n, d), classifier mode
    input_ids: list[list[int]] | None = None  # adapter mode

    def __post_init__(self) -> None:
        if self.features is None and self.input_ids is None:
            raise ValueError("LocalData needs features or input_ids")
        n = len(self.labels)
        if self.features is not None and len(self.features) != n:
            raise ValueError(f"{len(self.features)} feature rows for {n} labels")
        if self.input_ids is not None and len(self.input_ids) != n:
            raise ValueError(f"{len(self.input_ids)} token sequences for {n} labels")

    def __len__(self) -> int:
        return len(self.labels)

    def select(self, positions: Sequence[int]) -> LocalData:
        """The examples at ``positions``, in that order."""
        index = torch.as_tensor(list(positions), dtype=torch.long)
        return LocalData(
            labels=self.labels[index],
            features=self.features[index] if self.features is not None else None,
            input_ids=[self.input_ids[i] for i in positions]
            if self.input_ids is not None
            else None,
        )


def prepare_data(
    texts: Sequence[str],
    labels: Sequence[int],
    *,
    mode: Mode,
    model_cfg: ModelConfig,
    device: str,
    get_model: Callable[[], QueryEncoder],
    cache: FeatureCache | None,
    batch_size: int,
    progress: bool = True,
    desc: str = "features",
) -> LocalData:
    """Features (classifier mode, from the cache when possible) or token ids (adapter mode).

    ``get_model`` is only called when the encoder is really needed: a fully cached
    classifier-mode dataset never loads it.
    """
    label_tensor = torch.tensor(list(labels), dtype=torch.long)
    if not texts:  # no examples (a node none of whose labels the server's map has): no error,
        # since whether a round fails must not depend on the data
        if mode is Mode.ADAPTER_CLASSIFIER:
            return LocalData(labels=label_tensor, input_ids=[])
        hidden = get_model().encoder.hidden_size
        return LocalData(labels=label_tensor, features=torch.zeros(0, hidden))
    if mode is Mode.ADAPTER_CLASSIFIER:
        tokens = get_model().encoder.tokenize(list(texts))
        return LocalData(labels=label_tensor, input_ids=tokens.input_ids)
    key = feature_key(model_cfg, texts, device=device)
    cached = cache.get(key) if cache is not None else None
    if cached is not None:
        log.info("%s: %d cached feature rows (key %s)", desc, len(cached), key)
        return LocalData(labels=label_tensor, features=cached)
    model = get_model()
    features = features_for(model, texts, batch_size=batch_size, progress=progress, desc=desc)
    if cache is not None:
        cache.put(key, features)
    return LocalData(labels=label_tensor, features=features)


def prepare_for(
    settings: Settings,
    texts: Sequence[str],
    labels: Sequence[int],
    *,
    get_model: Callable[[], QueryEncoder],
    desc: str,
) -> LocalData:
    """:func:`prepare_data` with everything taken from the run's settings (disk cache on)."""
    return prepare_data(
        texts,
        labels,
        mode=settings.train.mode,
        model_cfg=settings.model,
        device=settings.device,
        get_model=get_model,
        cache=FeatureCache(settings.cache_dir),
        batch_size=settings.train.feature_batch_size,
        progress=settings.progress,
        desc=desc,
    )


def features_for(
    model: QueryEncoder,
    texts: Sequence[str],
    *,
    batch_size: int,
    progress: bool = True,
    desc: str = "features",
    bucket: bool = True,
) -> torch.Tensor:
    """Pooled vectors ``(n, d)`` through the current adapter, batched by length."""
    tokens = model.encoder.tokenize(list(texts))
    return extract_features(
        model.encode,
        model.encoder.pad,
        tokens.input_ids,
        batch_size=batch_size,
        bucket=bucket,
        progress=progress,
        desc=desc,
    )


def _write_bytes(path: Path, data: bytes) -> None:
    path.write_bytes(data)
