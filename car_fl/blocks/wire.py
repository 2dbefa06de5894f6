"""What travels between a node and the blocks service: safetensors bytes, checked before use.

A request is one safetensors buffer: ``embeds`` ``(rows, seq, hidden)`` in a float dtype, ``mask``
``(rows, seq)`` of 0/1, and for a backward ``grad`` (the gradient of the returned states, the
shape of ``embeds``); its metadata names the model ``fingerprint`` the node expects. A reply is
one buffer holding ``states`` (forward) or ``grad`` (backward). Dtype and shape travel with every
tensor; nothing is ever a JSON list.

:func:`read_request` checks the header (keys, dtypes, shapes, the :class:`Limits`) before it
decodes a byte of tensor data, then the values (a 0/1 mask with a real token in every row,
finite floats), so a malformed or oversized request costs the service almost nothing and is
answered with a :class:`WireError` that names what was wrong.
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
    """A reply body holding one tensor (``states`` or ``grad``)."""
    return bytes(save({name: tensor.detach().contiguous().cpu()}))


def read_reply(body: bytes, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor ``name`` of a reply, refused unless it has ``shape`` and is finite."""
    header = _header(body)
    if set(header) != {name}:
        raise WireError(f"the blocks service replied with {sorted(header)}, expected [{name!r}]")
    tensor = load(body)[name]
    if tuple(tensor.shape) != shape:
        raise WireError(
            f"the blocks service replied with {name} of shape {tuple(tensor.shape)}, "
            f"expected {shape}"
        )
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
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
            f"the request holds tensors {sorted(header)}; a {'backward' if backward else 'forward'}"
            f" takes exactly {sorted(wanted)}"
        )
    embeds, mask = header["embeds"], header["mask"]
    if embeds["dtype"] not in FLOATS:
        raise WireError(f"embeds has dtype {embeds['dtype']}; send one of {sorted(FLOATS)}")
    if mask["dtype"] not in MASKS:
        raise WireError(f"mask has dtype {mask['dtype']}; send one of {sorted(MASKS)}")
    shape = embeds["shape"]
    if len(shape) != 3 or shape[2] != hidden:
        raise WireError(f"embeds has shape {shape}; expected (rows, seq, {hidden})")
    rows, seq = int(shape[0]), int(shape[1])
    if mask["shape"] != [rows, seq]:
        raise WireError(f"mask has shape {mask['shape']}; expected [{rows}, {seq}] as embeds")
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
    try:
        tensors = load(body)
    except Exception as err:  # safetensors' own checks: offsets, lengths, dtypes
        raise WireError(f"the body is not valid safetensors: {err}") from None
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


def _header(body: bytes) -> dict[str, Any]:
    """The safetensors header of ``body`` (tensor name → dtype, shape, offsets), checked."""
    if len(body) < 8:
        raise WireError("the body is not safetensors: shorter than its 8-byte header length")
    (length,) = struct.unpack("<Q", body[:8])
    if length > min(len(body) - 8, 1 << 20):
        raise WireError("the body is not safetensors: its header length runs past the body")
    try:
        header = json.loads(body[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("the body is not safetensors: its header is not JSON") from None
    if not isinstance(header, dict):
        raise WireError("the body is not safetensors: its header is not a JSON object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise WireError(f"the body is not safetensors: tensor {name!r} has no dtype or shape")
    return header
