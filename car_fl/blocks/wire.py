"""What travels between a node and the blocks service: safetensors bytes, checked before use.

A request holds ``embeds`` ``(rows, seq, hidden)``, a 0/1 ``mask`` and for a backward ``grad``,
with the model ``fingerprint`` in its metadata; a reply holds ``states`` or ``grad``.
:func:`read_request` checks the header against the :class:`Limits` before decoding any data,
then the values, and names what was wrong (:class:`WireError`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load, save

#: The media type of every request and reply body.
MEDIA_TYPE = "application/vnd.car-fl.safetensors"
#: Float dtypes a request may carry (safetensors' names).
FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MASKS = {"I64", "I32", "U8", "BOOL"}


class WireError(ValueError):
    """A request or reply is malformed or too large; the message names the field."""


@dataclass(frozen=True)
class Limits:
    """Bounds on one request, so that one node cannot starve the others."""

    #: Sequences per request.
    max_rows: int = 64
    #: Tokens per request (rows × padded length), and per batch the service runs at once.
    max_tokens: int = 16_384
    #: Padded length of a request.
    max_seq: int = 4_096

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_tokens", "max_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"blocks limit {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Request:
    """A checked request: soft embeddings, their mask, and for a backward the states' grad."""

    embeds: torch.Tensor
    mask: torch.Tensor
    grad: torch.Tensor | None
    fingerprint: str

    @property
    def tokens(self) -> int:
        return int(self.mask.shape[0] * self.mask.shape[1])


def write_request(
    embeds: torch.Tensor,
    mask: torch.Tensor,
    *,
    fingerprint: str,
    grad: torch.Tensor | None = None,
) -> bytes:
    """The request body for ``embeds`` and ``mask`` (and ``grad`` for a backward)."""
    tensors = {"embeds": embeds.detach().contiguous().cpu(), "mask": mask.to(torch.uint8).cpu()}
    if grad is not None:
        tensors["grad"] = grad.detach().to(embeds.dtype).contiguous().cpu()
    return bytes(save(tensors, metadata={"fingerprint": fingerprint}))


def write_reply(name: str, tensor: torch.Tensor) -> bytes:
    return bytes(save({name: tensor.detach().contiguous().cpu()}))


def read_reply(body: bytes, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor ``name`` of a reply, refused unless it is one float tensor of ``shape``
    (checked in the header, before a byte is decoded) and finite."""
    header = _header(body)
    header.pop("__metadata__", None)
    if set(header) != {name}:
        raise WireError(f"the blocks service's reply does not hold exactly one tensor {name!r}")
    entry = header[name]
    if entry["dtype"] not in FLOATS:
        raise WireError(f"the blocks service replied with {name} not in a float dtype")
    if tuple(entry["shape"]) != shape:
        raise WireError(
            f"the blocks service replied with {name} of shape {tuple(entry['shape'])}, "
            f"expected {shape}"
        )
    tensor = _load(body)[name]
    if tuple(tensor.shape) != shape:  # safetensors read what the header said; never else
        raise WireError(f"the blocks service replied with {name} of another shape")
    if not bool(torch.isfinite(tensor).all()):
        raise WireError(f"the blocks service replied with non-finite {name}")
    return tensor


def read_request(
    body: bytes, *, hidden: int, limits: Limits, backward: bool
) -> tuple[Request, dict[str, str]]:
    """A checked :class:`Request` and the body's metadata; :class:`WireError` naming the field.

    ``hidden``: the service's hidden size; ``backward``: ``grad`` is required (else refused)."""
    header = _header(body)
    meta = header.pop("__metadata__", None) or {}
    wanted = {"embeds", "mask", "grad"} if backward else {"embeds", "mask"}
    if set(header) != wanted:
        raise WireError(
            f"the request holds {len(header)} tensors; a {'backward' if backward else 'forward'}"
            f" takes exactly {sorted(wanted)}"
        )
    embeds, mask = header["embeds"], header["mask"]
    if embeds["dtype"] not in FLOATS:
        raise WireError(f"embeds' dtype is not one of {sorted(FLOATS)}")
    if mask["dtype"] not in MASKS:
        raise WireError(f"mask's dtype is not one of {sorted(MASKS)}")
    shape = embeds["shape"]
    if len(shape) != 3 or shape[2] != hidden:
        raise WireError(f"embeds must have shape (rows, seq, {hidden}), 3 dimensions")
    rows, seq = int(shape[0]), int(shape[1])
    if mask["shape"] != [rows, seq]:
        raise WireError(f"mask must have shape [{rows}, {seq}], embeds' rows and tokens")
    if backward and (header["grad"]["shape"] != shape or header["grad"]["dtype"] not in FLOATS):
        raise WireError(f"grad must be a float tensor of embeds' shape {shape}")
    if rows < 1 or seq < 1:
        raise WireError(f"embeds has shape {shape}: no rows or no tokens")
    if rows > limits.max_rows or seq > limits.max_seq or rows * seq > limits.max_tokens:
        raise WireError(
            f"a request of {rows} rows × {seq} tokens is above this service's limits "
            f"({limits.max_rows} rows, {limits.max_seq} tokens per row, {limits.max_tokens} "
            "tokens in all): send smaller batches"
        )
    tensors = _load(body)
    mask_values = tensors["mask"].to(torch.int64)
    if bool(((mask_values != 0) & (mask_values != 1)).any()):
        raise WireError("mask holds values other than 0 and 1")
    if bool((mask_values.sum(dim=1) == 0).any()):
        raise WireError("a row of mask has no real token (all zeros)")
    floats = [tensors["embeds"], *([tensors["grad"]] if backward else [])]
    if not all(bool(torch.isfinite(t).all()) for t in floats):
        raise WireError("embeds or grad holds NaN or infinite values")
    request = Request(
        embeds=tensors["embeds"],
        mask=mask_values,
        grad=tensors["grad"] if backward else None,
        fingerprint=str(meta.get("fingerprint", "")),
    )
    return request, {str(k): str(v) for k, v in meta.items()}


#: The most dimensions a tensor's shape may list (ours have 2 or 3).
MAX_DIMS = 8


def _load(body: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a body whose header :func:`_header` passed (safetensors checks the rest)."""
    try:
        return load(body)
    except Exception:  # SafetensorError, and whatever a forged buffer provokes
        raise WireError("the body is not valid safetensors: its offsets or lengths") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _header(body: bytes) -> dict[str, Any]:
    """The safetensors header of ``body`` (tensor name → dtype, shape, offsets), checked to be
    exactly safetensors' form, so no later step meets another type."""

    def refuse(what: str) -> WireError:
        return WireError(f"the body is not safetensors: {what}")

    if len(body) < 8:
        raise refuse("shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", body[:8])
    if length > min(len(body) - 8, 1 << 20):
        raise refuse("its header length runs past the body")
    try:
        header = json.loads(body[8 : 8 + length])
    except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
        raise refuse("its header is not JSON") from None
    if not isinstance(header, dict):
        raise refuse("its header is not a JSON object")
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise refuse("its metadata is not an object of strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise refuse("a tensor's entry is not exactly dtype, shape and data_offsets")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(entry["dtype"], str):
            raise refuse("a tensor's dtype is not a string")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(map(_is_int, shape)):
            raise refuse(f"a tensor's shape is not a list of at most {MAX_DIMS} sizes")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets)):
            raise refuse("a tensor's data_offsets are not two offsets")
    return header
