"""Each client's ε as the server computes it, and whether the client's own claim agrees.

A reply's ``dp-epsilon``, ``dp-active`` and ``num-examples`` are claims: a hostile client can
claim ε 0.5 without any DP, ε = ∞ or NaN, or n = 10⁶. The server needs none of them: every
client runs the settings the server sent (the fingerprint checks it), so the server knows
what each reply it received released (:func:`~car_fl.settings.dp_plan.round_release`) and
steps that node's own :class:`~car_fl.privacy.accountant.Accountant` with it, the class the
client's run and the node's ledger step too (PLD under replace-one). Warm-up
rounds release before DP starts and, as on the client, are not in the figure.

Only ``dp.granularity=step`` needs a node's n (one release per optimizer step). The server
then uses its own bound (:data:`~car_fl.server.round_stats.EXAMPLES_BOUND`: the partition size
it has on record, or ``fl.max_examples_per_client``), never the claim; the largest n it allows
is the value least favourable to privacy, and a node trains and accounts for at most that
many (:func:`~car_fl.settings.dp_plan.accounted_examples`). Without any bound the figure would
rest on the claim: the server reports ε = ∞ and says why (:attr:`Verdict.basis`).

:class:`PrivacyCheck` keeps each node's releases (by Flower node id, never the claimed
partition id) and gives a :class:`Verdict` per reply: the server's ε, which the report uses,
and why the claim differs from it, if it does. A claim above the server's figure is flagged
too: it counts releases the server never received (a lost reply) or is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from car_fl.privacy.accountant import Accountant
from car_fl.server.round_stats import EXAMPLES_BOUND
from car_fl.settings.dp_plan import (
    accounted_examples,
    dp_active,
    per_step,
    round_release,
)
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
    #: What the figure rests on besides the settings the server sent ("" when nothing else).
    basis: str = ""


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
    #: Each node's accountant, stepped once per reply the server received from it.
    accountants: dict[int, Accountant] = field(default_factory=dict)
    #: Nodes with a per-step release the server could not bound: their ε is ∞.
    unbounded: set[int] = field(default_factory=set)

    def epsilon(self, node: int) -> float:
        """The server's ε (at ``dp.delta``) of every release received from ``node`` so far."""
        accountant = self.accountants.get(node)
        return accountant.get_epsilon(self.settings.dp.delta) if accountant is not None else 0.0

    def receive(self, server_round: int, node: int, metrics: Mapping[str, float]) -> Verdict:
        """Account for ``node``'s valid reply in ``server_round``, and judge its claim.

        ``metrics`` passed the strategy's reply checks; the strategy put its own bound on the
        node's n beside them (:data:`EXAMPLES_BOUND`), where it has one.
        """
        active = dp_active(self.settings, server_round)
        basis = ""
        if active:
            examples, basis = self.examples(metrics)
            if examples is None:
                self.unbounded.add(node)
            release = round_release(
                self.settings, server_round=server_round, examples=examples or 1
            )
            self.accountants.setdefault(node, Accountant()).add(release)
        server = math.inf if node in self.unbounded else self.epsilon(node)
        claimed = metrics.get(CLAIMED_EPSILON)
        why = disagreement(
            server, claimed, active=active, claimed_active=metrics.get(CLAIMED_ACTIVE)
        )
        return Verdict(node=node, epsilon=server, claimed=claimed, mismatch=why, basis=basis)

    def examples(self, metrics: Mapping[str, float]) -> tuple[int | None, str]:
        """The n the server accounts a per-step reply for, and what it rests on; ``None``
        (ε = ∞) when the server has no bound of its own. Other modes do not depend on n."""
        if not per_step(self.settings):
            return 1, ""
        bound = metrics.get(EXAMPLES_BOUND)
        cap = self.settings.fl.max_examples_per_client
        if bound is not None and math.isfinite(bound) and bound >= 1:
            n = accounted_examples(self.settings, int(bound))
            return n, f"n ≤ {n}, the server's bound (not the node's claim)"
        if cap is not None:
            return cap, f"n ≤ fl.max_examples_per_client = {cap} (not the node's claim)"
        return None, (
            "dp.granularity=step and the server has no bound on this node's n (set "
            "fl.max_examples_per_client): ε = ∞, the figure would rest on the node's claim"
        )
