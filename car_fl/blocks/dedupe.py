"""One computation per request however often a node sends it: the service side of retries.

A retry with the same ``Idempotency-Key`` and body (SHA-256) waits for the first run (shielded
from its client's cancellation) or gets its kept answer; another body computes anew. Replicas
do not share keys (docs/blocks.md, "Deadlines").
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from car_fl.blocks.compute import Answer

#: The header that names one request across its attempts.
HEADER = "idempotency-key"
#: Characters a key may have (a client's UUID has 32).
MAX_KEY = 64


class Deduplicator:
    """Runs each ``(key, body)`` once; answers its retries from that run."""

    def __init__(self, *, keep: int = 16, keep_bytes: int = 256 << 20) -> None:
        self.keep, self.keep_bytes = keep, keep_bytes
        self.running: dict[tuple[str, str], asyncio.Future[Answer]] = {}
        self.done: OrderedDict[tuple[str, str], Answer] = OrderedDict()
        self.computed = 0

    async def answer(
        self, key: str | None, body: bytes, compute: Callable[[], Awaitable[Answer]]
    ) -> Answer:
        """``compute()``'s answer, computed at most once for this key and body."""
        if not key or len(key) > MAX_KEY or not key.isascii():
            self.computed += 1
            return await compute()
        name = (key, hashlib.sha256(body).hexdigest())
        if name in self.done:
            self.done.move_to_end(name)
            return self.done[name]
        running = self.running.get(name)
        if running is None:
            self.computed += 1
            running = asyncio.ensure_future(compute())
            self.running[name] = running
            running.add_done_callback(lambda task: self._finish(name, task))
        return await asyncio.shield(running)

    def _finish(self, name: tuple[str, str], task: asyncio.Future[Answer]) -> None:
        del self.running[name]
        if task.cancelled() or task.exception() is not None:
            return
        answer = task.result()
        if answer.status != 200 or len(answer.body) > self.keep_bytes:
            return
        self.done[name] = answer
        while len(self.done) > self.keep or self._kept() > self.keep_bytes:
            self.done.popitem(last=False)

    def _kept(self) -> int:
        return sum(len(answer.body) for answer in self.done.values())
