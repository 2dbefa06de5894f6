"""What a node tells the server when it does not send an update: a fixed code, fixed text.

A failure is a release too: Flower sends a raised exception's text to the server, so car-fl's
handler never raises but returns one of these (docs/privacy.md, "Failures carry no data").
"""

from __future__ import annotations

from enum import IntEnum

from flwr.app import Error, Message


class Failure(IntEnum):
    """Every reason a car-fl node gives for not sending an update (codes above Flower's own)."""

    #: Anything else: unreadable data, a diverged round, a bug. Never says which.
    ROUND_FAILED = 1100
    #: The run's privacy settings are weaker than the node owner's policy.
    POLICY_REFUSED = 1101
    #: The node's lifetime privacy budget (its ledger) does not allow this release.
    BUDGET_EXHAUSTED = 1102
    #: The run's own ``dp.target_epsilon`` would be passed by this release.
    RUN_TARGET_REACHED = 1103
    #: The node resolved a configuration other than the server's (fingerprint).
    CONFIG_MISMATCH = 1104
    #: The node's own configuration (``--node-config``, its policy file) is incomplete or wrong.
    NODE_CONFIG = 1105
    #: The node's owner reads the shared data file otherwise than the run (its policy's
    #: ``[data]``): its split would not be the server's.
    READING_DIFFERS = 1106
    #: The node's blocks service (``model.blocks=remote``) did not answer within its retries.
    BLOCKS_UNAVAILABLE = 1107

    @property
    def text(self) -> str:
        return FAILURE_TEXT[self]

    @property
    def meaning(self) -> str:
        """What it means to the person who started the run: what happened (CODE), what to do."""
        what, advice = FAILURE_MEANING[self]
        return f"{what} ({self.name}), {advice}"


FAILURE_TEXT: dict[Failure, str] = {
    Failure.ROUND_FAILED: "car-fl: the round failed on this node; details are in the node's log",
    Failure.POLICY_REFUSED: "car-fl: the run's privacy settings are weaker than this node's policy",
    Failure.BUDGET_EXHAUSTED: "car-fl: this node's lifetime privacy budget allows no more releases",
    Failure.RUN_TARGET_REACHED: "car-fl: this release would pass the run's dp.target_epsilon",
    Failure.CONFIG_MISMATCH: "car-fl: this node resolved another configuration than the server's",
    Failure.NODE_CONFIG: "car-fl: this node's own configuration is incomplete or invalid",
    Failure.READING_DIFFERS: "car-fl: this node's owner reads the data file otherwise than the run",
    Failure.BLOCKS_UNAVAILABLE: "car-fl: this node's blocks service did not answer",
}


#: Said to the operator after "N nodes": what happened, and what to do or read.
FAILURE_MEANING: dict[Failure, tuple[str, str]] = {
    Failure.ROUND_FAILED: (
        "failed the round (unreadable data, a diverged round, a bug)",
        "their owners have the details in the nodes' logs",
    ),
    Failure.POLICY_REFUSED: (
        "refused: their privacy policy is stricter than this run's settings",
        "see docs/privacy.md",
    ),
    Failure.BUDGET_EXHAUSTED: (
        "refused: their lifetime privacy budget allows no more releases",
        "see docs/privacy.md",
    ),
    Failure.RUN_TARGET_REACHED: (
        "stopped: a release would pass this run's dp.target_epsilon",
        "raise it or run fewer rounds",
    ),
    Failure.CONFIG_MISMATCH: (
        "refused: they resolved another configuration than the server's",
        "run the same car-fl version and conf/ on every machine",
    ),
    Failure.NODE_CONFIG: (
        "refused: their own configuration (--node-config, policy file) is incomplete or invalid",
        "their owners have the details in the nodes' logs",
    ),
    Failure.READING_DIFFERS: (
        "refused: their owners' privacy policies read the shared data file otherwise than this "
        "run ([data]), so their splits would not be the server's",
        "set the run's dataset keys and seed to their [data] (each node's log names the keys), "
        "or start them with data-is-shard",
    ),
    Failure.BLOCKS_UNAVAILABLE: (
        "failed the round: their blocks service (model.blocks=remote) was down or too slow",
        "start it again (car-fl serve-blocks); the next round works once it answers",
    ),
}


def failure_reply(msg: Message, failure: Failure) -> Message:
    """The error reply to ``msg`` for ``failure``: its code and its fixed text, nothing else."""
    return Message(Error(code=int(failure), reason=failure.text), reply_to=msg)


def read_failure(code: int, reason: str | None) -> Failure | None:
    """The car-fl failure an error reply carries, or ``None`` if it is not exactly one of ours."""
    try:
        failure = Failure(code)
    except ValueError:
        return None
    return failure if reason == failure.text else None
