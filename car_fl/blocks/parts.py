"""Which parts of a model a node keeps when its blocks are remote, and the model's fingerprint.

The node keeps the token embeddings and the final norm (loaded with ``num_hidden_layers=0``);
the service keeps everything between them. :func:`identity_fingerprint` hashes what both sides
read from the same files, so a node can refuse a service holding another model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from torch import nn

#: Where transformers' base models keep their final norm, in the order tried.
FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "decoder.final_layer_norm")
#: Config keys that say nothing of the weights (how the file was written or loaded).
VOLATILE_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype", "_name_or_path")


def final_norm_name(model: nn.Module) -> str | None:
    """The attribute path of ``model``'s final norm (``norm`` for Llama), ``None`` without one."""
    for name in FINAL_NORMS:
        module: Any = model
        for part in name.split("."):
            module = getattr(module, part, None)
        if isinstance(module, nn.Module) and not isinstance(module, nn.Identity):
            return name
    return None


def get_module(model: nn.Module, name: str) -> nn.Module:
    module: Any = model
    for part in name.split("."):
        module = getattr(module, part)
    assert isinstance(module, nn.Module)
    return module


def set_module(model: nn.Module, name: str, value: nn.Module) -> None:
    *parents, last = name.split(".")
    owner: Any = model
    for part in parents:
        owner = getattr(owner, part)
    setattr(owner, last, value)


def blockless_kwargs(config: Any) -> dict[str, Any]:
    """``from_pretrained`` keywords that build ``config``'s model with zero blocks."""
    kwargs: dict[str, Any] = {"num_hidden_layers": 0}
    if isinstance(getattr(config, "layer_types", None), list):  # Gemma 3, Qwen 3: one per block
        kwargs["layer_types"] = []
    return kwargs


def strip_for_service(model: nn.Module) -> bool:
    """Drop from ``model`` what the node keeps: the token embeddings (replaced by a 1-row
    table, never read when ``inputs_embeds`` is given) and the final norm (an identity).
    Returns whether there was a norm to leave to the node."""
    embeddings: Any = model.get_input_embeddings()  # type: ignore[operator]
    width = int(embeddings.weight.shape[1])
    empty = nn.Embedding(1, width, dtype=embeddings.weight.dtype, device=embeddings.weight.device)
    empty.requires_grad_(False)
    model.set_input_embeddings(empty)  # type: ignore[operator]
    norm = final_norm_name(model)
    if norm is not None:
        set_module(model, norm, nn.Identity())
    return norm is not None


def model_folder(name: str, revision: str | None = None) -> Path:
    """The local folder of a model: ``name`` itself, or its Hub snapshot in the local cache."""
    if Path(name).is_dir():
        return Path(name)
    from transformers.utils import cached_file

    config = cached_file(name, "config.json", revision=revision)
    if config is None:
        raise FileNotFoundError(f"model {name!r} has no config.json in the local cache")
    return Path(config).parent


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no .safetensors weights; remote blocks need safetensors checkpoints "
            "(convert with save_pretrained(..., safe_serialization=True))"
        )
    return files


def _config_text(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for key in VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    return json.dumps(config, sort_keys=True)


#: safetensors' dtype names as torch prints them (what the fingerprint hashes beside the bytes).
_TORCH_DTYPES = {
    "F64": "torch.float64",
    "F32": "torch.float32",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
    "F8_E4M3": "torch.float8_e4m3fn",
    "F8_E5M2": "torch.float8_e5m2",
    "I64": "torch.int64",
    "I32": "torch.int32",
    "I16": "torch.int16",
    "I8": "torch.int8",
    "U8": "torch.uint8",
    "BOOL": "torch.bool",
}
#: Bytes hashed at a time: the table is never held twice (216 MB on SmolLM2).
_CHUNK = 8 << 20


def _spans(folder: Path, suffixes: list[str]) -> dict[str, tuple[Path, str, int, int]]:
    """Where the checkpoint stores tensors ending in ``suffixes``, from the header alone."""
    found: dict[str, tuple[str, Path, str, int, int]] = {}
    for path in _weight_files(folder):
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            for suffix in suffixes:
                matches = key == suffix or key.endswith("." + suffix)
                if matches and (suffix not in found or len(key) < len(found[suffix][0])):
                    found[suffix] = (key, path, entry["dtype"], 8 + size + begin, 8 + size + end)
    return {s: (path, dtype, b, e) for s, (_, path, dtype, b, e) in found.items()}


def identity_fingerprint(folder: Path, node_tensors: list[str]) -> str:
    """A hash of the config and the node's tensors (``embed_tokens.weight``, ``norm.weight``)
    as stored, whatever dtype they load in (hashed from the file, never loaded)."""
    digest = hashlib.sha256(_config_text(folder).encode())
    spans = _spans(folder, node_tensors)
    for name in node_tensors:
        digest.update(name.encode())
        if name not in spans:
            continue
        path, dtype, begin, end = spans[name]
        digest.update(_TORCH_DTYPES.get(dtype, dtype).encode())
        buffer = memoryview(bytearray(min(_CHUNK, end - begin)))
        with path.open("rb", buffering=0) as handle:
            handle.seek(begin)
            left = end - begin
            while left > 0:
                got = handle.readinto(buffer[: min(len(buffer), left)])
                if not got:
                    raise ValueError(f"{path}: {name} runs past the end of the file")
                digest.update(buffer[:got])
                left -= got
    return digest.hexdigest()[:16]


def weights_digest(folder: Path) -> str:
    """A hash of every weight file of ``folder`` (the service's blocks among them)."""
    digest = hashlib.sha256()
    for path in _weight_files(folder):
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def node_tensor_names(model: nn.Module) -> list[str]:
    """The names, in ``model``'s own state dict, of the tensors the node keeps."""
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    names = [n for n, m in model.named_modules() if m is embeddings]
    keep = [f"{names[0]}.weight"] if names else []
    norm = final_norm_name(model)
    if norm is not None:
        keep += [f"{norm}.{p}" for p, _ in get_module(model, norm).named_parameters()]
    return keep
