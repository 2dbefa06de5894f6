"""A deadline on a request's headers in the uvicorn server that Serve's proxy runs.

uvicorn (0.49) reads headers before any middleware (:mod:`.admission`) and has no deadline for
them. :func:`with_header_deadline`'s protocol closes a connection whose request headers are not
complete ``timeout_s`` after it opened or the request's first byte (idle keep-alive is
uvicorn's); :func:`install` sets it for every later ``http="auto"`` server. It relies on
uvicorn's protocols keeping the request being answered in ``self.cycle``.
"""

from __future__ import annotations

import asyncio
from typing import Any


def with_header_deadline(base: type[asyncio.Protocol], timeout_s: float) -> type[Any]:
    """``base`` (uvicorn's HTTP protocol) with a deadline of ``timeout_s`` on headers."""

    class HeaderDeadline(base):  # type: ignore[valid-type,misc]
        deadline: asyncio.TimerHandle | None = None
        armed_at: Any = None  # the request being answered when the deadline was armed

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.arm()

        def data_received(self, data: bytes) -> None:
            cycle = getattr(self, "cycle", None)
            if self.deadline is None and (cycle is None or cycle.response_complete):
                self.arm()  # the first bytes of the next request
            super().data_received(data)
            if self.deadline is not None and getattr(self, "cycle", None) is not self.armed_at:
                self.deadline.cancel()  # its headers are complete: a new request began
                self.deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None
            super().connection_lost(exc)

        def arm(self) -> None:
            self.armed_at = getattr(self, "cycle", None)
            self.deadline = self.loop.call_later(timeout_s, self.expire)

        def expire(self) -> None:
            self.deadline = None
            if getattr(self, "cycle", None) is self.armed_at and not self.transport.is_closing():
                self.transport.close()

    HeaderDeadline.__name__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline


def install(timeout_s: float) -> None:
    """Every uvicorn server configured with ``http="auto"`` from now on in this process uses
    its automatic protocol with a header deadline of ``timeout_s``."""
    from uvicorn import config
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    config.HTTP_PROTOCOLS["auto"] = with_header_deadline(AutoHTTPProtocol, timeout_s)  # type: ignore[assignment]
