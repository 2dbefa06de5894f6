"""A node's own privacy in its round: the owner's policy and the lifetime ledger, together.

:meth:`NodePrivacy.admit` refuses a run weaker than the policy before any data is read;
:meth:`NodePrivacy.spend` records every release in the ledger before it is made, or refuses
it. The policy and data file come from the node's ``--node-config``, never the run config.
The checks in order: :mod:`car_fl.client.node`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from car_fl.client.failures import Refusal
from car_fl.client.ledger import Entry, Ledger, data_key, record_keys
from car_fl.client.ledger_registry import claim
from car_fl.client.policy import NodePolicy
from car_fl.protocol.failures import Failure
from car_fl.settings.compose import DATA_PATH, PRIVACY_POLICY, NodeConfigError
from car_fl.settings.dp_plan import per_step, round_release
from car_fl.settings.schema import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodePrivacy:
    """The owner's policy, the node's ledger and the records of its data file."""

    policy: NodePolicy
    ledger: Ledger
    #: The keys of the data file's records: every release is charged to all of them (the
    #: partition a run trains on is the server's choice).
    records: frozenset[str] = field(default=frozenset(), repr=False)

    @classmethod
    def open(cls, policy: str | Path, data: str | Path) -> NodePrivacy:
        """The policy file ``policy``, its ledger and the records of the data file ``data``;
        ``NodeConfigError`` when another ledger of the owner covers any of the records."""
        loaded = NodePolicy.load(policy)
        if not Path(data).expanduser().is_file():
            raise NodeConfigError(f"data file {data} (the ledger's records) is not a file")
        records = record_keys(data)
        claim(loaded.ledger, records, data=data)  # one ledger per record, whatever the policy
        ledger = Ledger.open(loaded.ledger)
        if ledger.migrate(data_key(data), records):
            log.warning("privacy ledger: migrated the per-file ledger of %s to records", data)
        return cls(loaded, ledger, records)

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodePrivacy | None:
        """From ``--node-config privacy-policy=... data-path=...``; ``None`` without a policy.
        The data file must be the node's own: the server must not choose what is charged."""
        policy = node_config.get(PRIVACY_POLICY)
        if policy in (None, ""):
            return None
        data = node_config.get(DATA_PATH)
        if data in (None, ""):
            raise NodeConfigError(
                f"this node has a privacy policy ({policy}) but no {DATA_PATH} in its "
                f"--node-config; add {DATA_PATH}=/path/to/its/data (the ledger is keyed by "
                "that file's content)"
            )
        return cls.open(str(policy), str(data))

    def admit(self, settings: Settings, *, shared_file: bool = True) -> None:
        """Refuse a run whose DP settings are weaker than the policy (before any data is read)."""
        found = self.policy.violations(settings, shared_file=shared_file)
        if found:
            raise Refusal(
                Failure.POLICY_REFUSED,
                f"privacy policy {self.policy.source} refuses this run: " + "; ".join(found),
            )

    def spend_before_reading(self, settings: Settings, *, run: str, server_round: int) -> bool:
        """:meth:`spend` before any record is read, when the release does not follow n: then
        any failure that reading the records could cause comes after the charge. Returns
        whether it spent (False: spend after reading)."""
        if per_step(settings) and settings.fl.max_examples_per_client is None:
            return False
        self.spend(settings, run=run, server_round=server_round, examples=0)
        return True

    def spend(self, settings: Settings, *, run: str, server_round: int, examples: int) -> Entry:
        """Record this round's release in the ledger, or refuse it (a round outside
        ``1..fl.rounds`` or not after this run's last, or one past ``lifetime-epsilon`` or
        ``lifetime-unnoised-rounds``)."""
        release = round_release(settings, server_round=server_round, examples=examples)

        def check(entries: list[Entry]) -> None:
            if not 1 <= server_round <= settings.fl.rounds:
                raise Refusal(
                    Failure.POLICY_REFUSED,
                    f"round {server_round} is outside the run's plan of fl.rounds="
                    f"{settings.fl.rounds}",
                )
            done = [e.round for e in entries if e.run == run]
            if done and server_round <= max(done):
                raise Refusal(
                    Failure.POLICY_REFUSED,
                    f"round {server_round} of run {run} comes after round {max(done)} was "
                    "released; each round of a run is released once, in order",
                )

        entry = self.ledger.spend(  # raises BudgetExhausted past the cap (nothing recorded)
            release,
            records=self.records,
            run=run,
            server_round=server_round,
            mode=settings.dp.mode.value,
            delta=self.policy.max_delta,
            cap=self.policy.lifetime_epsilon,
            unnoised_cap=self.policy.lifetime_unnoised_rounds,
            check=check,
        )
        log.info(
            "privacy ledger: run %s round %d (%s, %d %s) recorded; lifetime ε %.4g at δ %g%s",
            run,
            server_round,
            entry.mode,
            release.count,
            release.kind.value,
            entry.epsilon,
            entry.delta,
            f" (cap {self.policy.lifetime_epsilon:g})" if self.policy.lifetime_epsilon else "",
        )
        return entry
