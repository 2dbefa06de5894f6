"""car_fl.client.failures: whatever a handler raises, the server gets a fixed, data-free reply."""

from __future__ import annotations

import logging

import pytest
from flwr.app import Context, Message, RecordDict

from car_fl.client.failures import BudgetExhausted, Refusal, data_free
from car_fl.protocol.failures import Failure
from tests.helpers import set_task_identity

SECRET = "patient-4711 /home/alice/records.tsv"


def call(err: BaseException) -> Message:
    @data_free
    def handler(msg: Message, context: Context) -> Message:
        raise err

    set_task_identity()
    msg = Message(RecordDict(), dst_node_id=7, message_type="train")
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    return handler(msg, context)


@pytest.mark.parametrize(
    "err",
    [
        FileNotFoundError(2, "No such file", SECRET),  # an unreadable data file
        KeyError(f"label {SECRET!r} is not in the server's label map"),  # a crafted label map
        ValueError(f"unknown label {SECRET}"),
        RuntimeError(f"the loss diverged on {SECRET}"),
    ],
)
def test_errors_give_the_server_one_data_free_reply(
    err: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="car_fl.client.failures"):
        reply = call(err)
    assert (reply.error.code, reply.error.reason) == (
        int(Failure.ROUND_FAILED),
        Failure.ROUND_FAILED.text,
    )
    assert "patient-4711" not in str(reply.error.reason)
    assert "patient-4711" in caplog.text  # the details stay in the node's own log


def test_refusals_give_their_own_fixed_reply() -> None:
    reply = call(Refusal(Failure.POLICY_REFUSED, f"σ too low for {SECRET}"))
    assert (reply.error.code, reply.error.reason) == (
        int(Failure.POLICY_REFUSED),
        Failure.POLICY_REFUSED.text,
    )
    reply = call(BudgetExhausted(f"lifetime ε of {SECRET}"))
    assert reply.error.reason == Failure.BUDGET_EXHAUSTED.text
