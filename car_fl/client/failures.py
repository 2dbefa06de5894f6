"""A node's refusals and errors, turned into data-free replies; the details stay in its log.

Flower 1.39 sends ``str(type(ex)) + ":<'" + str(ex) + "'>"`` to the server when a ClientApp
handler raises (see :mod:`car_fl.protocol.failures`), so car-fl's train handler is wrapped in
:func:`data_free`: whatever it raises becomes one of the fixed
:class:`~car_fl.protocol.failures.Failure` replies, and the exception with its traceback goes to
the node's own log. :class:`Refusal` is how node code says which fixed reply to give.
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


def known() -> tuple[tuple[type[BaseException], Failure], ...]:
    """Exception classes whose meaning is a fixed reply of its own; anything else: ROUND_FAILED.

    Imported here, not at the top: the ClientApp of a node with a worker imports this module
    and must stay free of torch (the DP modules import it).
    """
    from car_fl.client.ledger import BudgetExhausted, LedgerError
    from car_fl.client.local_dp import PrivacyBudgetExhausted
    from car_fl.client.policy import PolicyError
    from car_fl.client.record_dp import RecordBudgetExhausted
    from car_fl.settings.flower import FingerprintMismatch, NodeConfigError

    return (
        (BudgetExhausted, Failure.BUDGET_EXHAUSTED),
        (LedgerError, Failure.BUDGET_EXHAUSTED),
        (PrivacyBudgetExhausted, Failure.RUN_TARGET_REACHED),
        (RecordBudgetExhausted, Failure.RUN_TARGET_REACHED),
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
    """``handler``, except that it never raises: an exception becomes a fixed reply.

    The exception and its traceback are logged on the node (``car_fl.client.failures``); the
    server receives only the failure's code and fixed text.
    """

    @functools.wraps(handler)
    def handle(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except Exception as err:  # every failure: the server must learn nothing from it
            failure = failure_of(err)
            log.error("node refused or failed this round (%s): %s", failure.name, err, exc_info=err)
            return failure_reply(msg, failure)

    return handle
