"""The data owner's side of car-fl: one :class:`Node`, built from the node's own configuration.

A Node owns everything a node decides or remembers (its config, policy and ledger, settings,
shards, every run's DP state); :meth:`Node.answer` turns a train message into a reply. Its
checks, in order, are the code of :meth:`Node.respond` and :meth:`Node.train`; the list and
why no failure the records could cause is an answer: docs/privacy.md, "Every check a node makes".

This node's settings (:func:`node_settings`) are the run's, with the node's own paths, checked
against the server's, and the server's commit of a Hub model (:func:`server_commit`); they are
cached on the node's disk (:mod:`car_fl.client.node_cache`). The node alone decides where it
writes: a run config's ``cache_dir`` is ignored, and the node's log says so.

Every run's DP state lives in one store the Node owns (:class:`RunStates`). A round works on a
copy (:meth:`RunStates.get`), kept only once it succeeded (:meth:`RunStates.keep`). A worker
keeps them in memory and in ``runs/<run id>.state`` (0600, atomic); without one they live in
Flower's ``context.state`` (:class:`ContextState`). Across runs, only the ledger caps a
record's spend.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import torch
from flwr.app import RecordDict

from car_fl.adapters.adapter import state_refusal
from car_fl.client import node_cache
from car_fl.client.failures import Refusal, failure_of
from car_fl.client.node_privacy import NodePrivacy
from car_fl.client.round import Shard, node_shard, refuse_before_the_ledger, train_shard
from car_fl.common.io import atomic_write
from car_fl.model.sources import names_hub_repo
from car_fl.protocol.failures import Failure
from car_fl.protocol.messages import read_train_message, train_reply
from car_fl.protocol.wire import decode_content, encode_content
from car_fl.settings.compose import (
    BLOCKS_SERVICE,
    CACHE_DIR,
    DATA_PATH,
    DOCUMENTS_PATH,
    GENERATED_QUERIES_PATH,
    MODEL_PATH,
    NODE_CONFIG,
    PRIVACY_POLICY,
    TEST_DATA_PATH,
    TRUST_REMOTE_CODE,
    NodeInfo,
    apply_node_config,
    check_fingerprint,
    fingerprint,
    run_inputs,
    settings_from_run_config,
)
from car_fl.settings.dp_plan import dp_active
from car_fl.settings.schema import Settings
from car_fl.training.train import round_settings

log = logging.getLogger(__name__)

#: Where a node without ``--node-config blocks-service`` finds its blocks service (simulated).
BLOCKS_SERVICE_ENV = "CAR_FL_BLOCKS_SERVICE"

#: Settings a node composed, with their fingerprint, by a digest of the run's inputs.
SettingsMemory = dict[str, tuple[Settings, str]]

#: The node's own files (node config key → dataset setting): with a policy, never the run's.
OWN_FILES: Mapping[str, str] = MappingProxyType(
    {
        key: str(NODE_CONFIG[key].setting).removeprefix("dataset.")
        for key in (TEST_DATA_PATH, DOCUMENTS_PATH, GENERATED_QUERIES_PATH)
    }
)


def own_files(node_config: Mapping[str, Any]) -> dict[str, str | None]:
    """The files this node's config names (``None`` for one it leaves out)."""
    return {field: node_config.get(key) or None for key, field in OWN_FILES.items()}


def run_files(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's own files where this node's config names its own (the node's settings then
    carry the node's), composed again from the run config; empty when it names none."""
    named = [field for key, field in OWN_FILES.items() if node_config.get(key)]
    if not named:
        return {}
    dataset = settings_from_run_config(run_config).dataset
    return {field: getattr(dataset, field) for field in named}


def node_settings(
    run_config: Mapping[str, Any],
    node_config: Mapping[str, Any],
    server_fingerprint: str | None,
    *,
    memory: SettingsMemory | None = None,
) -> Settings:
    """This node's settings (the run's plus its local paths), checked against the server's:
    from ``memory``, the disk cache, or composed (a whole ``settings`` YAML: memory only)."""
    memory = {} if memory is None else memory
    node_config = with_environment(node_config)
    text, overrides = run_inputs(run_config)
    node = sorted((str(k), str(v)) for k, v in node_config.items())
    memo = node_cache.digest({"settings": text, "overrides": overrides, "node_config": node})
    if memo not in memory:
        path = None
        if not text:
            key = node_cache.settings_key(overrides, node_config)
            path = node_cache.settings_path(node_config.get(CACHE_DIR), key)
        stored = node_cache.load_settings_entry(path) if path is not None else None
        if stored is None:
            settings = own_cache(settings_from_run_config(run_config), node_config)
            stored = settings, fingerprint(settings)
            if path is not None:
                node_cache.save_settings_entry(path, *stored)
        memory[memo] = stored
    settings, mine = memory[memo]
    check_fingerprint(mine, server_fingerprint)
    return copy.deepcopy(settings)


def server_commit(
    settings: Settings, node_config: Mapping[str, Any], commit: str | None
) -> Settings:
    """``settings`` loading the Hub model at the ``commit`` the server's revision resolved to,
    so that no node trains another commit of its branch (one its cache holds from before);
    unchanged where the node's config names its own copy (``model-path``) or the name reads
    as no Hub repository (by its text: nothing of the node's is looked at before its policy;
    a local folder of that name ignores the revision). A commit is 40 hex digits
    (``CONFIG_MISMATCH`` otherwise): a revision the run config could set anyway, never a path."""
    if commit is None or node_config.get(MODEL_PATH):
        return settings
    if not COMMIT.fullmatch(commit):
        raise Refusal(
            Failure.CONFIG_MISMATCH,
            f"the train message names model commit {commit[:60]!r}, which is no commit (40 hex "
            "digits); refused before anything was read",
        )
    name = settings.model.name_or_path
    if not names_hub_repo(name):
        return settings
    if settings.model.revision != commit:
        log.info(
            "model %s: loading the server's commit %s (revision %s here); offline, a node "
            "needs it in its Hub cache: huggingface-cli download %s --revision %s",
            name,
            commit,
            settings.model.revision or "main",
            name,
            commit,
        )
    return dataclasses.replace(settings, model=dataclasses.replace(settings.model, revision=commit))


#: A Hub commit: what :func:`server_commit` accepts.
COMMIT = re.compile(r"[0-9a-f]{40}")


def with_environment(node_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``node_config`` with the blocks service of this process's environment where it names
    none (the environment is the node owner's; a run config never reaches it)."""
    service = os.environ.get(BLOCKS_SERVICE_ENV)
    if service and not node_config.get(BLOCKS_SERVICE):
        return {**node_config, BLOCKS_SERVICE: service}
    return node_config


def own_cache(settings: Settings, node_config: Mapping[str, Any]) -> Settings:
    """The run's ``settings`` with the node's paths (:func:`apply_node_config`), writing only
    where the node decides: never the run config's ``cache_dir``, logged when it named one."""
    if settings.model.trust_remote_code and node_config.get(TRUST_REMOTE_CODE) is not True:
        raise Refusal(  # the repository's code would run as this node's owner, beside its data
            Failure.POLICY_REFUSED,
            "the run sets model.trust_remote_code=true: this node runs a model repository's "
            f"own code only when its owner says so (--node-config {TRUST_REMOTE_CODE}=true); "
            "refused before the model was loaded",
        )
    if settings.model.blocks_service is not None:  # the server would choose where texts go
        raise Refusal(
            Failure.POLICY_REFUSED,
            f"the run config sets model.blocks_service={settings.model.blocks_service}: only "
            f"this node's owner chooses where its texts go (--node-config {BLOCKS_SERVICE}=URL "
            f"or {BLOCKS_SERVICE_ENV}); refused before anything was sent",
        )
    mine = node_cache.node_dir(node_config.get(CACHE_DIR))
    asked = settings.cache_dir
    if asked not in (None, "") and Path(str(asked)).expanduser() != mine:
        log.warning(
            "the run config's cache_dir=%s is ignored: this node writes only under %s (its "
            "node config's %s, or car-fl's default under its owner's home)",
            asked,
            mine,
            CACHE_DIR,
        )
    return dataclasses.replace(apply_node_config(settings, node_config), cache_dir=str(mine))


#: The folder of the run states, under a worker's folder.
RUNS_DIR = "runs"


#: Flower's run ids are unsigned 64-bit integers.
MAX_RUN_ID = 2**64 - 1


def run_key(run: str | int) -> str:
    """A run id as its one spelling (an unsigned 64-bit integer in ASCII digits: "07" is run 7);
    ``ValueError`` for anything else (a sign, "7_0", "٧", a path)."""
    text = str(run) if not isinstance(run, bool) else ""
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_RUN_ID:
        raise ValueError(f"run id {run!r} is not an unsigned 64-bit integer in ASCII digits")
    return str(int(text))


def copy_of(state: RecordDict) -> RecordDict:
    """An independent copy of a run's state (through its serialised form)."""
    return decode_content(encode_content(state))


class RunStore(Protocol):
    """Where a node keeps its runs' states: :meth:`get` a copy, :meth:`keep` after success."""

    def get(self, run: str) -> RecordDict: ...

    def keep(self, run: str, state: RecordDict) -> None: ...


class ContextState:
    """Each run's state in Flower's ``context.state``, under ``run-<id>/``: Flower keeps it per
    run series, and a new run must not inherit the last one's accountant."""

    def __init__(self, state: RecordDict) -> None:
        self.state = state

    @staticmethod
    def prefix(run: str) -> str:
        return f"run-{run_key(run)}/"

    def get(self, run: str) -> RecordDict:
        """A copy of the run's state (empty for a run never seen)."""
        prefix = self.prefix(run)
        mine = RecordDict(
            {k[len(prefix) :]: v for k, v in self.state.items() if k.startswith(prefix)}
        )
        return copy_of(mine)

    def keep(self, run: str, state: RecordDict) -> None:
        """Write the run's ``state`` back into ``context.state`` (a round that succeeded);
        other runs' records stay as they were."""
        prefix = self.prefix(run)
        for key in [k for k in self.state if k.startswith(prefix)]:
            del self.state[key]
        for key, record in copy_of(state).items():
            self.state[prefix + key] = record


class RunStates:
    """Each run's state by run id: in memory, and in ``folder`` when there is one."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self._states: dict[str, RecordDict] = {}

    def runs(self) -> list[str]:
        return sorted(self._states, key=lambda run: (len(run), run))

    def _file(self, run: str) -> Path | None:
        return self.folder / f"{run}.state" if self.folder is not None else None

    def get(self, run: str) -> RecordDict:
        """A copy of the run's state (empty for a run never seen)."""
        run = run_key(run)
        if run not in self._states:
            path = self._file(run)
            self._states[run] = (
                decode_content(path.read_bytes())
                if path is not None and path.is_file()
                else RecordDict()
            )
        return copy_of(self._states[run])

    def keep(self, run: str, state: RecordDict) -> None:
        """The run's state after a round that succeeded."""
        run = run_key(run)
        path = self._file(run)
        if path is not None:
            data = encode_content(state)

            def write(tmp: Path) -> None:
                tmp.write_bytes(data)

            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(path, write, mode=0o600)  # the run's DP state
        self._states[run] = state


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
