"""This node's settings: the run's, with the node's own paths, checked against the server's, and
the server's commit of a Hub model (:func:`server_commit`).

Cached on the node's disk (:mod:`car_fl.client.node_cache`). The node alone decides where it
writes: a run config's ``cache_dir`` is ignored, and the node's log says so.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from car_fl.client import node_cache
from car_fl.client.failures import Refusal
from car_fl.model.sources import names_hub_repo
from car_fl.protocol.failures import Failure
from car_fl.settings.flower import (
    BLOCKS_SERVICE,
    CACHE_DIR,
    DOCUMENTS_PATH,
    GENERATED_QUERIES_PATH,
    MODEL_PATH,
    NODE_CONFIG,
    TEST_DATA_PATH,
    TRUST_REMOTE_CODE,
    apply_node_config,
    check_fingerprint,
    fingerprint,
    run_inputs,
    settings_from_run_config,
)
from car_fl.settings.schema import Settings

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
