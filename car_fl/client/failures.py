"""A node's refusals and errors, turned into data-free replies; the details stay in its log.

Flower sends a raised exception's text to the server, so :func:`data_free` turns whatever the
handler raises into a fixed :class:`~car_fl.protocol.failures.Failure`; :class:`Refusal` says
which.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from flwr.app import Context, Message

from car_fl.protocol.failures import Failure, failure_reply

log = logging.getLogger(__name__)

Handler = Callable[[Message, Context], Message]


class Refusal(RuntimeError):
    """The node refuses this round with ``failure``; ``detail`` is for its own log only."""

    def __init__(self, failure: Failure, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure
        self.detail = detail


class RunTargetReached(Refusal):
    """This run's own budget (``dp.target_epsilon``, local DP or DP-SGD) would be passed by
    the next release: the node stops contributing to the run (``RUN_TARGET_REACHED``)."""

    def __init__(self, detail: str) -> None:
        super().__init__(Failure.RUN_TARGET_REACHED, detail)


class LedgerError(Refusal):
    """The ledger cannot be read or written: every release is refused until it is fixed
    (``BUDGET_EXHAUSTED``: without its ledger a node cannot know a record's spend)."""

    def __init__(self, detail: str) -> None:
        super().__init__(Failure.BUDGET_EXHAUSTED, detail)


class BudgetExhausted(Refusal):
    """The next release would take a record's lifetime ε past the cap (``BUDGET_EXHAUSTED``)."""

    def __init__(self, detail: str) -> None:
        super().__init__(Failure.BUDGET_EXHAUSTED, detail)


def known() -> tuple[tuple[type[BaseException], Failure], ...]:
    """Errors of other modules whose meaning is a fixed reply of its own; anything else:
    ROUND_FAILED. Imported here: a worker's ClientApp must stay free of torch and Hydra."""
    from car_fl.blocks.errors import BlocksUnavailable
    from car_fl.client.policy import PolicyError
    from car_fl.settings.compose import FingerprintMismatch, NodeConfigError

    return (
        (BlocksUnavailable, Failure.BLOCKS_UNAVAILABLE),
        (FingerprintMismatch, Failure.CONFIG_MISMATCH),
        (NodeConfigError, Failure.NODE_CONFIG),
        (PolicyError, Failure.NODE_CONFIG),
    )


def failure_of(err: BaseException) -> Failure:
    """The fixed reply for an exception raised while handling a round."""
    if isinstance(err, Refusal):
        return err.failure
    for kind, failure in known():
        if isinstance(err, kind):
            return failure
    return Failure.ROUND_FAILED


def data_free(handler: Handler) -> Handler:
    """``handler``, except that it never raises: an exception becomes a fixed reply."""

    @functools.wraps(handler)
    def handle(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except Exception as err:  # every failure: the server must learn nothing from it
            failure = failure_of(err)
            log.error("node refused or failed this round (%s): %s", failure.name, err, exc_info=err)
            return failure_reply(msg, failure)

    return handle
