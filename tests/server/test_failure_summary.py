"""car_fl.server.failure_summary: a failed run's last line counts the nodes per failure code."""

from __future__ import annotations

from flwr.app import Error, Message, RecordDict

from car_fl.protocol.failures import Failure, failure_reply
from car_fl.server.failure_summary import failure_summary
from car_fl.server.strategy import RoundStats
from tests.helpers import set_task_identity
from tests.reference import CaRFedAvg
from tests.server.test_replies import SPEC


def instruction(node: int) -> Message:
    set_task_identity()
    return Message(content=RecordDict(), dst_node_id=node, message_type="train")


def test_every_round_refused_names_each_code_with_its_node_count_and_meaning() -> None:
    strategy = CaRFedAvg(min_clients=1, spec=SPEC, shard_sizes={0: 50, 1: 70, 2: 60})
    for server_round in (1, 2):  # the same nodes refuse in both rounds: counted once each
        replies = [
            failure_reply(instruction(1), Failure.POLICY_REFUSED),
            failure_reply(instruction(2), Failure.POLICY_REFUSED),
            failure_reply(instruction(3), Failure.BUDGET_EXHAUSTED),
        ]
        assert strategy.aggregate_train(server_round, replies) == (None, None)
    line = failure_summary(strategy.history)
    assert line == (
        "2 nodes refused: their privacy policy is stricter than this run's settings "
        "(POLICY_REFUSED), see docs/privacy.md; 1 node refused: their lifetime privacy "
        "budget allows no more releases (BUDGET_EXHAUSTED), see docs/privacy.md"
    )


def test_flowers_own_codes_lost_nodes_and_imitations_of_car_fl_codes_are_named_apart() -> None:
    crashed = Message(
        Error(code=8, reason="ClientApp stopped responding."), reply_to=instruction(1)
    )
    # a car-fl code with another text is not car-fl's failure: its text is not trusted
    forged = Message(Error(code=1101, reason="car-fl: secret=42"), reply_to=instruction(2))
    stats = RoundStats(round=1, started=0.0)
    for node, message in ((1, crashed), (2, forged)):
        stats.failed[node] = str(message.error.reason)
        stats.failure_codes[node] = message.error.code
    stats.failed[3] = "no reply (the node was lost or the round timed out)"
    stats.rejected[4] = "non-finite values"
    line = failure_summary([stats])
    assert "1 node failed in Flower (CLIENT_APP_CRASHED, code 8)" in line
    assert "1 node sent an error that is neither Flower's nor car-fl's (code 1101)" in line
    assert "1 node sent no reply" in line and "1 node sent replies the server rejected" in line
    assert "secret" not in line and "non-finite" not in line  # counts and fixed texts only
    assert failure_summary([]) == "no node was asked to train"
