"""Each client's ε as the server computes it, and whether the client's own claim agrees.

A reply's ``dp-epsilon`` and ``dp-active`` are claims: a hostile client can claim ε 0.5
without any DP, or ε = ∞ or NaN. The server needs none of them: every client runs the
settings the server sent (the fingerprint checks it), so the server knows what each reply it
received released (:func:`~car_fl.settings.dp_plan.round_release`, with the reply's
``num-examples`` for ``dp.granularity=step``) and composes a node's releases with the same
accounting the client uses (:func:`~car_fl.settings.dp_plan.run_epsilon`: Rényi DP for local
DP, the PLD accountant under replace-one for DP-SGD, since n travels un-noised). Warm-up
rounds release before DP starts and, as on the client, are not in the figure.

:class:`PrivacyCheck` keeps each node's releases (by Flower node id, never the claimed
partition id) and gives a :class:`Verdict` per reply: the server's ε, which the report uses,
and why the claim differs from it, if it does. A claim above the server's figure is flagged
too: it counts releases the server never received (a lost reply) or is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from car_fl.privacy.composition import Release
from car_fl.protocol.messages import NUM_EXAMPLES
from car_fl.settings.dp_plan import dp_active, round_release, run_epsilon
from car_fl.settings.schema import Settings

#: A claim agrees when |claimed − server| ≤ RELATIVE · server + ABSOLUTE.
RELATIVE = 1e-3
ABSOLUTE = 1e-9
CLAIMED_EPSILON = "dp-epsilon"
CLAIMED_ACTIVE = "dp-active"


@dataclass(frozen=True)
class Verdict:
    """The server's ε of one node after a reply, and why the node's claim differs ("" if not)."""

    node: int
    epsilon: float
    claimed: float | None
    mismatch: str = ""


def disagreement(
    server: float, claimed: float | None, *, active: bool, claimed_active: float | None
) -> str:
    """Why a claim differs from the server's figure; "" when it agrees (within tolerance)."""
    if claimed_active is not None and claimed_active != float(active):
        return (
            f"claims dp-active={claimed_active:g} where the settings the server sent give "
            f"dp-active={int(active)}"
        )
    if claimed is None:
        return "" if server == 0 else f"claims no ε; the server computes ε {server:.4g}"
    if claimed == server:  # also ∞ = ∞: an honest client of a non-private rule
        return ""
    finite = math.isfinite(claimed) and math.isfinite(server)
    if finite and abs(claimed - server) <= RELATIVE * server + ABSOLUTE:
        return ""
    side = "less than" if claimed < server else "more than" if claimed > server else "unlike"
    return f"claims ε {claimed:.4g}, {side} the server's ε {server:.4g}"


@dataclass
class PrivacyCheck:
    """The releases the server received from each node, and the ε they add up to."""

    settings: Settings
    releases: dict[int, list[Release]] = field(default_factory=dict)

    def epsilon(self, node: int) -> float:
        """The server's ε (at ``dp.delta``) of every release received from ``node`` so far."""
        return run_epsilon(self.settings, self.releases.get(node, []))

    def receive(self, server_round: int, node: int, metrics: Mapping[str, float]) -> Verdict:
        """Account for ``node``'s valid reply in ``server_round``, and judge its claim.

        ``metrics`` passed the strategy's reply checks, so ``num-examples`` is a positive int.
        """
        active = dp_active(self.settings, server_round)
        if active:
            release = round_release(
                self.settings, server_round=server_round, examples=int(metrics[NUM_EXAMPLES])
            )
            self.releases.setdefault(node, []).append(release)
        server = self.epsilon(node)
        claimed = metrics.get(CLAIMED_EPSILON)
        why = disagreement(
            server, claimed, active=active, claimed_active=metrics.get(CLAIMED_ACTIVE)
        )
        return Verdict(node=node, epsilon=server, claimed=claimed, mismatch=why)
