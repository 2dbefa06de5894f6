"""Why a run got no valid update: the nodes counted per failure code, in one line for its end."""

from __future__ import annotations

from collections.abc import Sequence

from flwr.common.constant import ErrorCode

from car_fl.protocol.failures import read_failure
from car_fl.server.strategy import RoundStats

LOST = "sent no reply (the node was lost, or the round passed fl.round_timeout)"
REJECTED = "sent replies the server rejected (the reasons are in the server's log)"


def flower_meaning(code: int) -> str:
    """Flower's own error code, by name, or a code that neither Flower nor car-fl gives."""
    names = {v: k for k, v in vars(ErrorCode).items() if isinstance(v, int) and k.isupper()}
    if code not in names:
        return f"sent an error that is neither Flower's nor car-fl's (code {code})"
    return f"failed in Flower ({names[code]}, code {code}), see the SuperNodes' logs"


def nodes_by_reason(history: Sequence[RoundStats]) -> dict[str, set[int]]:
    """Each reason (a car-fl failure's meaning, Flower's code, lost, rejected) -> its nodes."""
    nodes: dict[str, set[int]] = {}
    for stats in history:
        for node, reason in stats.failed.items():
            code = stats.failure_codes.get(node)
            if code is None:
                key = LOST
            else:
                failure = read_failure(code, reason)
                key = failure.meaning if failure is not None else flower_meaning(code)
            nodes.setdefault(key, set()).add(node)
        for node in stats.rejected:
            nodes.setdefault(REJECTED, set()).add(node)
    return nodes


def failure_summary(history: Sequence[RoundStats]) -> str:
    """``"2 nodes refused: ... (POLICY_REFUSED), see docs/privacy.md; 1 node ..."``, most
    nodes first; ``"no node was asked to train"`` if there was nothing to count."""
    counted = sorted(nodes_by_reason(history).items(), key=lambda item: -len(item[1]))
    parts = [f"{len(ids)} node{'s' if len(ids) > 1 else ''} {why}" for why, ids in counted]
    return "; ".join(parts) or "no node was asked to train"
