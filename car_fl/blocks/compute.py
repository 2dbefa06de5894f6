"""The blocks service's arithmetic and its request handling, without any serving engine.

:class:`BlocksRunner` runs many requests as one padded batch: forward (the blocks' states) and
backward (recompute, then the VJP), stateless; rows never mix (docs/blocks.md).
:class:`BlocksHandler` turns HTTP-shaped requests into checked requests or a 4xx answer, so
the Ray Serve deployment and the fast tests run the same code.
"""

from __future__ import annotations

import hmac
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from car_fl.blocks.wire import MEDIA_TYPE, Limits, Request, WireError, read_request, write_reply

log = logging.getLogger(__name__)

FORWARD, BACKWARD, HEALTH = "/forward", "/backward", "/health"


class Speed:
    """Seconds per 1,000 padded tokens of each operation, as this service measured them: the
    median of its last :data:`WINDOW` batches (a node sizes its requests and their deadlines by
    it: docs/blocks.md, "Deadlines")."""

    WINDOW = 32

    def __init__(self) -> None:
        self.recent: dict[str, list[float]] = {FORWARD: [], BACKWARD: []}

    def record(self, path: str, tokens: int, seconds: float) -> None:
        window = self.recent[path]
        window.append(1000 * seconds / max(tokens, 1))
        del window[: -self.WINDOW]

    def per_ktoken(self, path: str) -> float | None:
        window = self.recent[path]
        return statistics.median(window) if window else None

    def as_dict(self) -> dict[str, float | None]:
        return {
            "forward_s_per_ktoken": self.per_ktoken(FORWARD),
            "backward_s_per_ktoken": self.per_ktoken(BACKWARD),
        }


@dataclass(frozen=True)
class Identity:
    """What the service holds, as its health operation reports it."""

    model: str
    fingerprint: str
    weights: str
    dtype: str
    hidden: int
    norm_on_node: bool
    limits: Limits = field(default_factory=Limits)
    replicas: int = 1
    #: Measured seconds per 1,000 padded tokens, by operation (:class:`Speed`).
    speed: Speed = field(default_factory=lambda: Speed())

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.speed.as_dict(),
            "model": self.model,
            "fingerprint": self.fingerprint,
            "weights": self.weights,
            "dtype": self.dtype,
            "hidden": self.hidden,
            "norm_on_node": self.norm_on_node,
            "max_rows": self.limits.max_rows,
            "max_tokens": self.limits.max_tokens,
            "max_seq": self.limits.max_seq,
            "replicas": self.replicas,
        }


def padding_left(mask: torch.Tensor) -> bool:
    """Whether a request pads on the left (its last column is all real tokens, its first not)."""
    return bool(mask[:, -1].all()) and not bool(mask[:, 0].all())


def merge(requests: Sequence[Request], attr: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded batch of every request's ``attr`` (``embeds`` or ``grad``) and the masks,
    each request padded to the widest on the side it pads on."""
    width = max(int(r.mask.shape[1]) for r in requests)
    values, masks = [], []
    for r in requests:
        tensor: torch.Tensor = getattr(r, attr)
        extra = width - int(r.mask.shape[1])
        left = padding_left(r.mask)
        pad = (0, 0, extra, 0) if left else (0, 0, 0, extra)
        values.append(torch.nn.functional.pad(tensor.float(), pad))
        masks.append(torch.nn.functional.pad(r.mask, pad[2:]))
    return torch.cat(values), torch.cat(masks)


def split(batch: torch.Tensor, requests: Sequence[Request]) -> list[torch.Tensor]:
    """``batch``'s rows back into one tensor per request, cut to its own width and side."""
    out, start = [], 0
    width = int(batch.shape[1])
    for r in requests:
        rows, seq = int(r.mask.shape[0]), int(r.mask.shape[1])
        part = batch[start : start + rows]
        part = part[:, width - seq :] if padding_left(r.mask) else part[:, :seq]
        out.append(part.contiguous())
        start += rows
    return out


def batches(requests: Sequence[Request], max_tokens: int) -> list[list[int]]:
    """``requests``' indices in groups whose merged, padded batch holds at most
    ``max_tokens``: a wide request never inflates many narrow ones."""
    order = sorted(range(len(requests)), key=lambda i: int(requests[i].mask.shape[1]))
    groups: list[list[int]] = []
    rows = 0
    for i in order:
        r_rows, width = (int(n) for n in requests[i].mask.shape)
        if groups and (rows + r_rows) * width <= max_tokens:  # sorted: width is the widest
            groups[-1].append(i)
            rows += r_rows
        else:
            groups.append([i])
            rows = r_rows
    return groups


class BlocksRunner:
    """The frozen blocks of a model (stripped for the service), run on many requests at once."""

    def __init__(self, model: Any, identity: Identity) -> None:
        self.model = model
        self.model.eval()
        self.model.requires_grad_(False)
        self.identity = identity
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def _run(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.to(self.device)
        out = self.model(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        )
        states: torch.Tensor = (
            out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        )
        return states

    def forward(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        """The blocks' output states of each request, in the service's dtype."""
        embeds, mask = merge(requests, "embeds")
        with torch.no_grad():
            states = self._run(embeds.to(self.device, self.dtype), mask)
        return split(states.cpu(), requests)

    def backward(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        """∂⟨states, grad⟩/∂embeds for each request: the forward recomputed, then one VJP."""
        embeds, mask = merge(requests, "embeds")
        grad, _ = merge(requests, "grad")
        leaf = embeds.to(self.device, self.dtype).requires_grad_(True)
        with torch.enable_grad():
            states = self._run(leaf, mask)
            (result,) = torch.autograd.grad(states, leaf, grad_outputs=grad.to(states))
        return split(result.detach().cpu(), requests)


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: a status, a body and its media type."""

    status: int
    body: bytes
    media_type: str = MEDIA_TYPE

    @classmethod
    def error(cls, status: int, message: str) -> Answer:
        return cls(status, json.dumps({"error": message}).encode(), "application/json")


class BlocksHandler:
    """Checks each request (token, path, body) before it reaches the runner's batch."""

    def __init__(self, runner: BlocksRunner, *, token: str | None = None) -> None:
        self.runner = runner
        self.token = token
        self.served = 0
        self.refused = 0

    def authorised(self, headers: dict[str, str]) -> bool:
        if not self.token:
            return True
        given = headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    @property
    def max_body(self) -> int:
        """The largest body a request within the limits can have (embeds and grad in float32)."""
        identity = self.runner.identity
        return identity.limits.max_tokens * identity.hidden * 4 * 2 + (1 << 20)

    def admit(self, path: str, headers: dict[str, str]) -> Answer | None:
        """What the headers alone refuse (token, operation, a declared size above
        :attr:`max_body`), before a byte of the body is read; ``None`` to read it."""
        headers = {k.lower(): v for k, v in headers.items()}
        if not self.authorised(headers):
            self.refused += 1
            return Answer.error(401, "missing or wrong token: send 'Authorization: Bearer <token>'")
        if path not in (FORWARD, BACKWARD, HEALTH):
            return Answer.error(404, f"no such operation: use {FORWARD}, {BACKWARD}, {HEALTH}")
        declared = headers.get("content-length", "0")
        if not (declared.isascii() and declared.isdigit()):  # "²".isdigit() is True
            self.refused += 1
            return Answer.error(400, "Content-Length is not a number of bytes")
        if int(declared) > self.max_body:
            self.refused += 1
            return Answer.error(
                413, f"the body is {int(declared):,} bytes, above {self.max_body:,}"
            )
        return None

    def prepare(self, path: str, body: bytes, headers: dict[str, str]) -> Request | Answer:
        """The checked request of a forward or backward, or the answer to give at once."""
        refused = self.admit(path, headers)
        if refused is not None:
            return refused
        if path == HEALTH:
            return Answer(
                200, json.dumps(self.runner.identity.as_dict()).encode(), "application/json"
            )
        identity = self.runner.identity
        if len(body) > self.max_body:
            self.refused += 1
            return Answer.error(413, f"the body is {len(body):,} bytes, above {self.max_body:,}")
        try:
            request, _ = read_request(
                body, hidden=identity.hidden, limits=identity.limits, backward=path == BACKWARD
            )
        except WireError as err:
            self.refused += 1
            return Answer.error(400, str(err))
        if request.fingerprint != identity.fingerprint:
            self.refused += 1
            return Answer.error(
                409,
                "the request is for another model's fingerprint; this service holds "
                f"{identity.model} ({identity.fingerprint}): point the node at its own service",
            )
        return request

    def run(self, path: str, requests: Sequence[Request]) -> list[Answer]:
        """Answers for ``requests`` of one operation, computed in as few batches as keep each
        one's padded size within ``max_tokens`` (:func:`batches`)."""
        compute = self.runner.backward if path == BACKWARD else self.runner.forward
        name = "grad" if path == BACKWARD else "states"
        results: dict[int, torch.Tensor] = {}
        for group in batches(requests, self.runner.identity.limits.max_tokens):
            started = time.perf_counter()
            computed = compute([requests[i] for i in group])
            width = max(int(requests[i].mask.shape[1]) for i in group)
            padded = width * sum(int(requests[i].mask.shape[0]) for i in group)
            self.runner.identity.speed.record(path, padded, time.perf_counter() - started)
            for i, result in zip(group, computed, strict=True):
                results[i] = result
        self.served += len(requests)
        return [Answer(200, write_reply(name, results[i])) for i in range(len(requests))]

    def warm_up(self, tokens: int = 64) -> None:
        """Run each operation twice on one row of ``tokens``, so that :class:`Speed` reports
        a measured speed (the first run not counted) before the first node asks."""
        identity = self.runner.identity
        width = max(1, min(tokens, identity.limits.max_tokens, identity.limits.max_seq))
        row = Request(
            embeds=torch.zeros(1, width, identity.hidden),
            mask=torch.ones(1, width, dtype=torch.long),
            grad=torch.zeros(1, width, identity.hidden),
            fingerprint=identity.fingerprint,
        )
        for path in (FORWARD, BACKWARD):
            self.run(path, [row])
            identity.speed.recent[path].clear()
            self.run(path, [row])
        self.served = 0

    def handle(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        """One request, alone in its batch (the in-process transport and the fast tests)."""
        prepared = self.prepare(path, body, headers)
        if isinstance(prepared, Answer):
            return prepared
        return self.run(path, [prepared])[0]
