"""The model's fingerprint, hashed from the file without holding the embedding table twice."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from car_fl.blocks.parts import _config_text, identity_fingerprint

NAMES = ["embed_tokens.weight", "norm.weight"]


def by_definition(folder: Path, tensors: dict[str, torch.Tensor]) -> str:
    """The fingerprint as defined: the config, then each name, dtype and bytes as stored."""
    digest = hashlib.sha256(_config_text(folder).encode())
    for name in NAMES:
        digest.update(name.encode())
        tensor = tensors[f"model.{name}"]
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def checkpoint(folder: Path, rows: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 256, "dtype": "x"}))
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(rows, 256, generator=generator).to(dtype),
        "model.norm.weight": torch.randn(256, generator=generator).to(dtype),
        "model.layers.0.mlp.weight": torch.randn(8, 256, generator=generator).to(dtype),
        "lm_head.weight": torch.randn(4, 256, generator=generator).to(dtype),
    }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_it_equals_the_definition_for_every_stored_dtype(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    tensors = checkpoint(tmp_path / "m", 1000, dtype)
    assert identity_fingerprint(tmp_path / "m", NAMES) == by_definition(tmp_path / "m", tensors)


def test_a_64_mb_table_is_hashed_in_chunks_never_copied_whole(tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "m", 65_536, torch.float32)  # 64 MiB of embeddings
    want = by_definition(tmp_path / "m", tensors)
    del tensors
    tracemalloc.start()
    try:
        got = identity_fingerprint(tmp_path / "m", NAMES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == want
    assert peak < 10 << 20  # one 8 MiB chunk, not the 64 MiB table (the old .tobytes())
