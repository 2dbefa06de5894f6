"""The data owner's side of car-fl: one :class:`Node`, built from the node's own configuration.

A Node owns everything a node decides or remembers (its config, policy and ledger, settings,
shards, every run's DP state); :meth:`Node.answer` turns a train message into a reply. Its
checks, in order, are the code of :meth:`Node.respond` and :meth:`Node.train`; the list and
why no failure the records could cause is an answer: docs/privacy.md, "Every check a node makes".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import RecordDict

from car_fl.adapters.registry import state_refusal
from car_fl.client.failures import Refusal, failure_of
from car_fl.client.node_privacy import NodePrivacy
from car_fl.client.node_settings import (
    SettingsMemory,
    node_settings,
    own_files,
    run_files,
    server_commit,
)
from car_fl.client.round import node_shard, refuse_before_the_ledger, train_shard
from car_fl.client.run_states import RunStates, RunStore
from car_fl.client.shard import Shard
from car_fl.protocol.failures import Failure
from car_fl.protocol.messages import read_train_message, train_reply
from car_fl.settings.dp_plan import dp_active
from car_fl.settings.flower import (
    DATA_PATH,
    PRIVACY_POLICY,
    NodeInfo,
)
from car_fl.settings.schema import Settings
from car_fl.training.probe import round_settings

log = logging.getLogger(__name__)


@dataclass
class Node:
    """A data owner's node: its own configuration, privacy, and what it keeps between rounds."""

    #: The node's own configuration (``--node-config``, or the worker's): never the server's.
    config: Mapping[str, Any]
    #: The owner's policy and ledger (``None``: no policy; the node trusts the run's settings).
    privacy: NodePrivacy | None = None
    #: The settings composed for each run (by the run's inputs and this node's config).
    settings_memory: SettingsMemory = field(default_factory=dict, repr=False)
    #: The shards read (by settings, the server's label map and the node's place).
    shards: dict[str, Shard] = field(default_factory=dict, repr=False)
    #: Every run's state when this node keeps them itself (a worker's, on disk); else the
    #: ClientApp hands :meth:`answer` Flower's ``context.state`` as ``store``.
    states: RunStates = field(default_factory=RunStates, repr=False)
    #: The policy and data files' identity when :attr:`privacy` was opened (edited: reopened).
    _opened: tuple[object, ...] = field(default=(), repr=False)

    # --------------------------------------------------------------------------------- answer
    def answer(
        self,
        content: RecordDict,
        *,
        run_config: Mapping[str, Any],
        run: str,
        store: RunStore | None = None,
    ) -> RecordDict:
        """The reply's content to a train message's ``content`` (raises a refusal or error:
        :meth:`failure` gives its fixed code). The run's state comes from ``store`` (default
        :attr:`states`) and is kept only when the round succeeds."""
        store = self.states if store is None else store
        state = store.get(run)
        reply = self.respond(content, run_config=run_config, node_state=state, run=run)
        store.keep(run, state)
        return reply

    def respond(
        self,
        content: RecordDict,
        *,
        run_config: Mapping[str, Any],
        node_state: RecordDict,
        run: str,
    ) -> RecordDict:
        """1-8 on the run's state ``node_state`` (updated in place; :meth:`answer` keeps it)."""
        instruction = read_train_message(content)
        # 1. Without the server's label map the node's own would size the head: whether the
        # round succeeds would then tell the label count. Refused whatever the node holds
        if not instruction.labels:
            raise Refusal(
                Failure.CONFIG_MISMATCH,
                "the train message carries no label map; the node trains only with the server's",
            )
        # 2. The run's settings with this node's paths, checked against the server's
        settings = node_settings(
            run_config, self.config, instruction.fingerprint, memory=self.settings_memory
        )
        settings = server_commit(settings, self.config, instruction.commit)
        node_info = NodeInfo.from_node_config(self.config, settings)
        self._open_privacy()
        state, metrics = self.train(
            settings,
            node_info,
            instruction.global_state,
            instruction.server_round,
            node_state,
            instruction.labels,
            run=run,
            layout=instruction.layout,
            run_files=(  # the run's own, where the node's settings carry the node's files
                None
                if self.privacy is None or node_info.data_is_shard
                else run_files(run_config, self.config)
            ),
        )
        return train_reply(state, metrics, dtype=settings.comm.dtype)

    def train(
        self,
        settings: Settings,
        node_info: NodeInfo,
        global_state: dict[str, torch.Tensor],
        server_round: int,
        node_state: RecordDict,
        labels: Sequence[str] | None = None,
        *,
        run: str = "",
        layout: str | None = None,
        run_files: Mapping[str, str | None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, int | float]]:
        """3-8: the policy, the ledger before any record, the shard, the budget, the release.
        Returns what the node sends and the reply's metrics. ``run_files``: the run's own files
        where ``settings`` carry the node's."""
        # the server's adapter is the run's kind, rank and finite: before anything else
        why = state_refusal(settings.adapter, global_state)
        if why is not None:
            raise ValueError(f"client {node_info.partition_id}: {why}")
        privacy, round_dp = self.privacy, None
        if privacy is not None:
            own = own_files(self.config)
            if not node_info.data_is_shard:  # on a shared file its split must be the server's
                why = privacy.policy.data.refusal(
                    settings, paths=own, run_paths=run_files, source=privacy.policy.source
                )
                if why is not None:
                    raise Refusal(Failure.READING_DIFFERS, why)
            settings = privacy.policy.data.apply(settings, source=privacy.policy.source, paths=own)
            privacy.admit(settings, shared_file=not node_info.data_is_shard)  # 3. before any data
            round_dp = refuse_before_the_ledger(  # 6.'s refusals that read no record: free
                settings,
                node_info,
                node_state,
                server_round=server_round,
                global_state=global_state,
                max_clip=privacy.policy.max_clip,
            )
        # 4. the ledger, before any record (when the release does not follow n)
        spent = privacy is not None and privacy.spend_before_reading(
            settings, run=run, server_round=server_round
        )
        private = spent and dp_active(settings, server_round)
        shard = node_shard(  # 5. (a probe round's: cached features, not token ids)
            round_settings(settings, server_round),
            node_info,
            labels,
            memory=self.shards,
            noise_only=private,
        )
        return train_shard(  # 6-7. the run's budget, the epochs, the release
            settings,
            node_info,
            shard,
            global_state,
            server_round,
            node_state,
            node_privacy=privacy,
            run=run,
            layout=layout,
            spent=spent,
            privacy=round_dp,
        )

    @staticmethod
    def failure(err: BaseException) -> Failure:
        """8. The fixed, data-free code the server receives for ``err``."""
        return failure_of(err)

    # -------------------------------------------------------------------------------- privacy
    def _open_privacy(self) -> NodePrivacy | None:
        """The owner's policy and ledger, opened again when the policy or data file changed."""
        identity = tuple(_identity(self.config.get(key)) for key in (PRIVACY_POLICY, DATA_PATH))
        if identity != self._opened:
            self.privacy = NodePrivacy.from_node_config(self.config)
            self._opened = identity
        return self.privacy


def _identity(path: object) -> tuple[str, int, int] | None:
    """A file's path, size and modification time (``None``: not named or not there)."""
    if path in (None, ""):
        return None
    name = os.path.expanduser(str(path))
    try:
        stat = os.stat(name)
    except OSError:
        return (name, -1, -1)
    return (name, stat.st_size, stat.st_mtime_ns)
