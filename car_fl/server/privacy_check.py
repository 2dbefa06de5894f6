"""Each client's ε as the server computes it, and whether the client's own claim agrees.

A reply's ``dp-epsilon``, ``dp-active`` and ``num-examples`` are claims. The server knows what
each reply released from the settings it sent (:func:`~car_fl.settings.dp_plan.round_release`)
and steps that node's own :class:`~car_fl.privacy.accountant.Accountant` (by Flower node id).
Per-step DP needs n: without ``fl.max_examples_per_client`` the server reports ε = ∞ and says
why. A claim that differs from the server's figure, either way, is flagged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from car_fl.privacy.accountant import Accountant, Release
from car_fl.results.rows import ClientDP, ClientRow, RunSummary, wire_key
from car_fl.server.strategy import RoundStats
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_plan import dp_active, per_step, record_plan, round_release
from car_fl.settings.schema import Settings

log = logging.getLogger(__name__)

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
    #: The server's ε of each node (by node id) after its last reply; their max so far.
    client_epsilon: dict[int, float] = field(default_factory=dict)
    last_epsilon: float = 0.0
    #: This round's verdicts, by node.
    verdicts: dict[int, Verdict] = field(default_factory=dict)
    #: Nodes whose ε claim differed from the server's figure in some round.
    flagged: set[int] = field(default_factory=set)
    #: Record-level DP (dp=record): each client's σ, q, steps and ε, by partition id, as the
    #: server computes them; and which node's row each partition id's key holds (the first).
    client_dp: dict[int, ClientDP] = field(default_factory=dict)
    dp_owner: dict[int, int] = field(default_factory=dict)
    #: After a resume: the releases of the node that had spent the most before it. A node id
    #: first seen after a resume starts from them (the server cannot link ids across a
    #: restart, and Flower's simulation gives new ones): an upper bound, never an under-count.
    prior: tuple[Release, ...] = ()

    def round(self, stats: RoundStats) -> float:
        """Account for a round's replies; the max over nodes of the server's ε. Every reply
        that arrived counts, also one the strategy refused (the server saw what it sent);
        each claim is checked (:attr:`verdicts`) and used nowhere."""
        self.verdicts = {}
        for node, metrics in sorted(stats.released.items()):  # rejected replies too: seen
            verdict = self.receive(stats.round, node, metrics)
            self.verdicts[node] = verdict
            if verdict.mismatch:
                self.flagged.add(node)
                log.warning(
                    "round %d: node %d's privacy claim is flagged: %s (the report uses the "
                    "server's ε %.4g)",
                    stats.round,
                    node,
                    verdict.mismatch,
                    verdict.epsilon,
                )
            claimed = metrics.get(wire_key("partition_id"))
            self.keep(
                node, verdict, place=self.place_of(node, claimed, node in stats.client_metrics)
            )
        self.last_epsilon = max(self.client_epsilon.values(), default=0.0)
        return self.last_epsilon

    def place_of(self, node: int, claimed: float | None, valid: bool) -> int:
        """Where a reply's ε row goes: the partition a *valid* reply claims, else the node's id
        (a rejected reply, or a claim that is no partition id, takes no partition's row); the
        node's id always with ``fl.max_examples_per_client``, where the strategy pins no
        partition and checks no claim (the first would take a row)."""
        if self.settings.fl.max_examples_per_client is not None or not valid:
            return node
        if claimed is not None and math.isfinite(claimed) and claimed == int(claimed):
            return int(claimed)
        return node

    def keep(self, node: int, verdict: Verdict, *, place: int) -> None:
        """``node``'s ε after a reply and, under ``dp=record``, its row at ``place``
        (:meth:`place_of`), or at its node id when another node's row holds ``place``."""
        self.client_epsilon[node] = verdict.epsilon
        if not MODES[self.settings.dp.mode].record_level:
            return
        owner = self.dp_owner.setdefault(place, node)
        plan = record_plan(self.settings)
        accountant = self.accountants.get(node)
        self.client_dp[place if owner == node else node] = ClientDP(
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
            steps=float(len(accountant) if accountant is not None else 0),
            epsilon=verdict.epsilon,
        )

    def resume(self, client_rows: list[ClientRow], *, done: int, epsilon: float) -> None:
        """The releases the server saw before a resume (rounds up to ``done``, read back from
        ``clients.csv``) count in its ε after it too; ``epsilon``: the run's ε so far."""
        self.flagged = {row.node for row in client_rows if row.claim_mismatch}
        for row in client_rows:
            if row.round > done or row.server_epsilon is None or row.num_examples is None:
                continue  # not a release the server saw (or a file from before the check)
            # a per-step run resumes with fl.max_examples_per_client as the bound, or ε = ∞
            seen = {wire_key("num_examples"): float(row.num_examples)}
            verdict = self.receive(row.round, row.node, seen)
            place = self.place_of(row.node, row.partition_id, row.status == "ok")
            self.keep(row.node, verdict, place=place)
        delta = self.settings.dp.delta
        most = max(self.accountants.values(), key=lambda a: a.get_epsilon(delta), default=None)
        self.prior = tuple(most.history) if most is not None else ()
        self.last_epsilon = epsilon

    def summarise(self, summary: RunSummary) -> None:
        """The run summary's privacy figures: the server's ε, the flagged nodes, DP rows."""
        summary.epsilon = self.last_epsilon
        summary.flagged_clients = sorted(self.flagged)
        summary.dp_clients = dict(self.client_dp)

    def epsilon(self, node: int) -> float:
        """The server's ε (at ``dp.delta``) of every release received from ``node`` so far."""
        accountant = self.accountants.get(node)
        return accountant.get_epsilon(self.settings.dp.delta) if accountant is not None else 0.0

    def __post_init__(self) -> None:
        examples, why = self.examples()
        if examples is None:  # said once, before any round is lost to it
            log.warning("%s", why)

    def receive(self, server_round: int, node: int, metrics: Mapping[str, float]) -> Verdict:
        """Account for ``node``'s valid reply in ``server_round``, and judge its claim."""
        active = dp_active(self.settings, server_round)
        examples, basis = self.examples()
        if active:
            release = round_release(
                self.settings, server_round=server_round, examples=examples or 1
            )
            self.accountants.setdefault(node, Accountant(self.prior)).add(release)
        else:
            basis = ""
        # a node with a DP release the server cannot bound (per step, no cap): ε = ∞
        unbounded = examples is None and node in self.accountants
        server = math.inf if unbounded else self.epsilon(node)
        claimed = metrics.get(CLAIMED_EPSILON)
        # without a figure of its own the server judges only dp-active and that ε is claimed
        judged = claimed if not unbounded or claimed is None else server
        why = disagreement(
            server, judged, active=active, claimed_active=metrics.get(CLAIMED_ACTIVE)
        )
        return Verdict(node=node, epsilon=server, claimed=claimed, mismatch=why, basis=basis)

    def examples(self) -> tuple[int | None, str]:
        """The n the server accounts a per-step reply for, and what it rests on; ``None``
        (ε = ∞) without ``fl.max_examples_per_client``."""
        if not per_step(self.settings):
            return 1, ""
        cap = self.settings.fl.max_examples_per_client
        if cap is not None:
            return cap, f"n ≤ fl.max_examples_per_client = {cap}, the server's bound (no claim)"
        return None, (
            "dp.granularity=step without fl.max_examples_per_client: each node takes one "
            "release per step over the records it reads, which the server cannot bound (its "
            "partition sizes are not a bound: a node's owner may set its data), so the "
            "server reports ε = ∞; set fl.max_examples_per_client for a figure"
        )


def client_rows_of(
    stats: RoundStats, verdicts: dict[int, Verdict] | None = None
) -> list[ClientRow]:
    """One row per client the round involved, in node order, with the server's ε verdicts."""
    verdicts = verdicts or {}
    rows = []
    nodes = sorted({*stats.bytes_sent, *stats.client_metrics, *stats.rejected, *stats.failed})
    for node in nodes:
        # a reply the norm bound rejected keeps its metrics: its n is part of the server's ε
        metrics = stats.client_metrics.get(node) or stats.released.get(node, {})
        if node in stats.client_metrics:
            status = "ok"
        else:
            status = "rejected" if node in stats.rejected else "failed"
        rows.append(
            ClientRow(
                round=stats.round,
                node=node,
                status=status,
                reason=stats.rejected.get(node) or stats.failed.get(node) or "",
                bytes_sent=stats.bytes_sent.get(node, 0),
                bytes_received=stats.bytes_received.get(node, 0),
                update_norm=stats.update_norms.get(node),
                **{name: metrics.get(wire_key(name)) for name in ClientRow.FROM_WIRE},
                server_epsilon=verdicts[node].epsilon if node in verdicts else None,
                claim_mismatch=verdicts[node].mismatch if node in verdicts else "",
            )
        )
    return rows
