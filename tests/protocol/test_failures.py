"""car_fl.protocol.failures: a refusal carries a fixed code and fixed text, nothing else."""

from __future__ import annotations

from flwr.app import Message, RecordDict

from car_fl.protocol.failures import FAILURE_TEXT, Failure, failure_reply, read_failure
from tests.helpers import set_task_identity


def train_message() -> Message:
    set_task_identity()
    return Message(RecordDict(), dst_node_id=7, message_type="train")


def test_every_failure_has_its_own_fixed_text() -> None:
    assert set(FAILURE_TEXT) == set(Failure)
    assert len(set(FAILURE_TEXT.values())) == len(Failure)


def test_a_reply_is_the_code_and_the_text_and_reads_back() -> None:
    for failure in Failure:
        reply = failure_reply(train_message(), failure)
        assert reply.has_error() and not reply.has_content()
        assert (reply.error.code, reply.error.reason) == (int(failure), failure.text)
        assert read_failure(reply.error.code, reply.error.reason) is failure


def test_anything_else_is_not_read_as_ours() -> None:
    assert read_failure(0, "ClientApp stopped responding.") is None  # Flower's own
    assert read_failure(int(Failure.ROUND_FAILED), "label 'x' unknown") is None  # extra text
