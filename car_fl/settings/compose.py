"""Composition: ``conf/`` plus Hydra overrides, or what Flower hands car-fl → validated settings.

The :mod:`car_fl.settings.schema` dataclasses are the schema of ``conf/config.yaml`` (their
defaults the only defaults); :func:`load_settings` is the one way entry points read
configuration. Hydra is imported only when something is composed.

From Flower: the ServerApp calls :func:`settings_from_run_config`; a node adds its
``--node-config`` (:data:`NODE_CONFIG`) with :func:`apply_node_config` and checks the result
against the server's :func:`fingerprint`.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import hashlib
import importlib
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from car_fl.settings import dp_plan
from car_fl.settings.schema import APPROACHES, Choice, Mode, Settings

#: The :class:`Settings` schema's name in the ConfigStore (first in conf/config.yaml's defaults).
SCHEMA = "settings_schema"


def conf_dir() -> Path:
    """The ``conf/`` folder: inside the installed package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parents[1]  # the car_fl package
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"car-fl's Hydra configuration was not found in {here / 'conf'} or "
        f"{here.parent / 'conf'}; reinstall the package (pip install -e .) from a full checkout"
    )


def _package_model_dir(package: str) -> str:
    """OmegaConf resolver: the model folder shipped inside a Python package (offline models)."""
    try:
        module = importlib.import_module(package)
    except ImportError as err:
        raise ValueError(
            f"model folder package {package!r} is not installed; "
            f"pip install {package.replace('_', '-')}"
        ) from err
    getter = getattr(module, "get_model_path", None)
    path = Path(getter()) if callable(getter) else Path(module.__file__ or "").parent / "model"
    return str(path)


if not OmegaConf.has_resolver("package_model_dir"):
    OmegaConf.register_new_resolver("package_model_dir", _package_model_dir)


def register_configs() -> None:
    """Register the schema and the approach group in Hydra's ConfigStore (idempotent).

    Group files merge into the typed sections, so they hold only what they change; the root
    stays open for ``conf/sweep.yaml``'s own keys. Called before anything composes ``conf/``.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    if f"{SCHEMA}.yaml" in store.repo and "approach" in store.repo:
        return  # registered already in this process (storing again costs a tenth of a second)
    defaults = Settings()
    store.store(name=SCHEMA, node={f.name: getattr(defaults, f.name) for f in fields(Settings)})
    for name, (kind, spec) in APPROACHES.items():
        mode = Mode.ADAPTER_CLASSIFIER if spec.adapter else Mode.CLASSIFIER
        store.store(
            group="approach",
            name=name,
            package="_global_",
            node={
                "head": {"kind": kind.value, "lexical": spec.lexical.value},
                "train": {"mode": mode.value},
            },
        )


def parse_overrides(overrides: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Turn ``"dataset=ag_news model=llama32_3b"`` (shell-quoted) into a list of overrides."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return shlex.split(overrides)
    return list(overrides)


def compose_config(overrides: str | list[str] | tuple[str, ...] | None = None) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides, without resolving interpolations."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    register_configs()
    items = parse_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            return compose(config_name="config", overrides=items)
    except HydraException as err:
        if isinstance(err.__cause__, ValidationError):
            _raise_choice_error(err.__cause__)
        unknown = unknown_override(items)
        if unknown is not None:
            raise ValueError(unknown) from err
        cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
        raise ValueError(one_line(f"bad configuration override in {items}: {err}{cause}")) from err


def to_settings(cfg: DictConfig | dict[str, Any]) -> Settings:
    """Validate a composed config against :class:`Settings` and return typed dataclasses.

    ``ValueError`` naming the key for an unknown key, a wrong type, or what the DP mode refuses
    (:func:`car_fl.settings.dp_plan.check_mode`)."""
    container = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    container = OmegaConf.masked_copy(container, [str(k) for k in container if k != "hydra"])
    for key in _leaf_keys(OmegaConf.to_container(container, resolve=False)):
        if not is_setting(key):  # e.g. ``+fl.round=2``, which the merge below would drop
            raise ValueError(f"{key} is not a setting;{did_you_mean(key)}")
    schema = _schema()
    try:
        merged = OmegaConf.merge(schema, container)
        obj = OmegaConf.to_object(merged)
    except ValidationError as err:
        _raise_choice_error(err)
        raise ValueError(one_line(f"invalid configuration: {err}")) from err
    except OmegaConfBaseException as err:
        key = str(getattr(err, "full_key", "") or "")
        if key and not is_setting(key):
            raise ValueError(f"{key} is not a setting;{did_you_mean(key)}") from err
        raise ValueError(one_line(f"invalid configuration: {err}")) from err
    assert isinstance(obj, Settings)
    if not obj.model.name_or_path.strip():  # conf/model/local.yaml leaves it to the user
        raise ValueError(
            "model.name_or_path must be given: model=local reads a model folder on disk "
            "(model.name_or_path=/path/to/model)"
        )
    if obj.head.similarity is None:  # MIPS and kNN score as the encoder was trained
        obj.head.similarity = obj.model.similarity
    dp_plan.check_mode(obj)
    return obj


@functools.cache
def _schema() -> DictConfig:
    """:class:`Settings` as a structured config, built once (a merge never changes it)."""
    schema = OmegaConf.structured(Settings)
    OmegaConf.set_readonly(schema, True)
    return schema


def _leaf_keys(values: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a nested mapping's leaves (an empty mapping counts as a leaf)."""
    if not isinstance(values, dict) or not values:
        return [prefix.rstrip(".")] if prefix else []
    keys: list[str] = []
    for key, value in values.items():
        keys += _leaf_keys(value, f"{prefix}{key}.")
    return keys


def one_line(text: str) -> str:
    """``text`` on one line (OmegaConf's messages add ``full_key:`` and ``object_type=`` lines)."""
    return " ".join(text.split())


@functools.cache
def schema_keys(kind: type = Settings, prefix: str = "") -> Mapping[str, bool]:
    """Every setting's dotted key, ``True`` for a mapping whose own keys are free
    (``dataset.label_texts.<label>``); computed once."""
    keys: dict[str, bool] = {}
    for name, hint in get_type_hints(kind).items():
        key = f"{prefix}{name}"
        if isinstance(hint, type) and is_dataclass(hint):
            keys.update(schema_keys(hint, f"{key}."))
        else:
            keys[key] = getattr(hint, "__origin__", None) is dict
    return MappingProxyType(keys)


def group_options() -> dict[str, list[str]]:
    """The config groups (``dp``, ``model``, ...) and their options: ``conf/`` and the
    generated ones."""
    options = {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(conf_dir().iterdir())
        if group.is_dir()
    }
    options["approach"] = list(APPROACHES)
    return options


def is_setting(key: str) -> bool:
    """Whether ``key`` names a setting of the schema (or a key inside an open mapping)."""
    keys = schema_keys()
    if key in keys:
        return True
    return any(key.startswith(f"{k}.") for k, open_ in keys.items() if open_)


def did_you_mean(key: str) -> str:
    """`` did you mean X?`` for the closest setting or group, else where the settings are."""
    names = [*schema_keys(), *group_options()]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    section = key.split(".")[0]
    siblings = [k.split(".", 1)[1] for k in schema_keys() if k.startswith(f"{section}.")]
    listing = (
        f" ({section}'s keys: {', '.join(siblings)})"
        if siblings
        else " (every setting and its default: car_fl/settings/schema.py)"
    )
    return (f" did you mean {close[0]}?" if close else "") + listing


def unknown_override(items: list[str]) -> str | None:
    """A one-line message for the first override that names no setting, group or option: the
    setting meant (Hydra's own suggests ``+fl.round=2``, which the schema refuses)."""
    groups = group_options()
    for item in items:
        key, _, value = item.lstrip("~+").partition("=")
        if key == "hydra" or key.startswith("hydra."):
            continue
        if key in groups:
            if value and value != "null" and value not in groups[key]:
                close = difflib.get_close_matches(value, groups[key], n=1, cutoff=0.5)
                hint = f" did you mean {key}={close[0]}?" if close else ""
                return (
                    f"{key}={value} is not an option of {key};{hint} choose one of "
                    f"{', '.join(groups[key])}"
                )
            continue
        if not is_setting(key):
            return f"{key} is not a setting;{did_you_mean(key)}"
    return None


def _raise_choice_error(err: ValidationError) -> None:
    """A bad value of a :class:`Choice` key gets the schema's message (valid values, not names)."""
    kind: Any = Settings
    for part in str(err.full_key or "").split("."):
        hints = get_type_hints(kind) if isinstance(kind, type) and is_dataclass(kind) else {}
        if part not in hints:
            return
        kind = hints[part]
    if isinstance(kind, type) and issubclass(kind, Choice):
        kind.parse(str(err.full_key), err.value)
    examples = {int: "3", float: "0.01", bool: "true"}
    base = _optional_of(kind)
    if base in examples:  # a number or a flag given as something else
        raise ValueError(
            f"{err.full_key}={err.value!r} is not {TYPE_NAMES[base]}; write e.g. "
            f"{err.full_key}={examples[base]}"
        )


#: How a type is called in car-fl's messages.
TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false"}


def _optional_of(kind: Any) -> Any:
    """``int`` for ``int`` and ``int | None``; other types as they are."""
    args = [a for a in getattr(kind, "__args__", ()) if a is not type(None)]
    return args[0] if len(args) == 1 else kind


def load_settings(overrides: str | list[str] | tuple[str, ...] | None = None) -> Settings:
    """Compose and validate in one step: the single way entry points read configuration.
    The same overrides are composed once per process; later calls get a copy."""
    key = (str(conf_dir()), *parse_overrides(overrides))
    if key not in _LOADED:
        _LOADED[key] = to_settings(compose_config(overrides))
    return copy.deepcopy(_LOADED[key])


_LOADED: dict[tuple[str, ...], Settings] = {}


def settings_to_yaml(settings: Settings) -> str:
    """The resolved configuration as YAML, for logs and for saving beside results."""
    return OmegaConf.to_yaml(OmegaConf.create(settings_values(settings)))


def settings_values(settings: Settings) -> dict[str, Any]:
    """``settings`` as plain values: choices by their value (``none``), not their enum name."""
    values: dict[str, Any] = _plain(asdict(settings))
    return values


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def settings_from_yaml(text: str) -> Settings:
    """Inverse of :func:`settings_to_yaml`."""
    loaded = OmegaConf.create(text)
    assert isinstance(loaded, DictConfig)
    return to_settings(loaded)


PARTITION_ID = "partition-id"
NUM_PARTITIONS = "num-partitions"
DATA_IS_SHARD = "data-is-shard"
DATA_PATH = "data-path"
TEST_DATA_PATH = "test-data-path"
DOCUMENTS_PATH = "documents-path"
GENERATED_QUERIES_PATH = "generated-queries-path"
MODEL_PATH = "model-path"
DEVICE = "device"
CACHE_DIR = "cache-dir"
PRIVACY_POLICY = "privacy-policy"
WORKER = "worker"
BLOCKS = "blocks"
BLOCKS_SERVICE = "blocks-service"
TRUST_REMOTE_CODE = "trust-remote-code"


class NodeKey(NamedTuple):
    """A ``--node-config`` key: the setting it overrides on this node (if any) and its use."""

    setting: str | None
    help: str


#: Every ``--node-config`` key car-fl reads: a setting's overrides it on this node only, the
#: others place the node in the federation (:class:`NodeInfo`).
NODE_CONFIG: dict[str, NodeKey] = {
    PARTITION_ID: NodeKey(None, "this node's partition, 0 to num-partitions - 1"),
    NUM_PARTITIONS: NodeKey(None, "how many partitions the training split has (= fl.clients)"),
    DATA_IS_SHARD: NodeKey(None, "true: the data file is this node's own shard (all of it)"),
    DATA_PATH: NodeKey("dataset.path", "this node's local data file"),
    TEST_DATA_PATH: NodeKey("dataset.test_path", "this node's local test file"),
    DOCUMENTS_PATH: NodeKey("dataset.documents_path", "this node's copy of the corpus's documents"),
    GENERATED_QUERIES_PATH: NodeKey(
        "dataset.generated_queries_path",
        "queries this node's model wrote for the documents (car-fl generate-queries)",
    ),
    MODEL_PATH: NodeKey("model.name_or_path", "this node's local copy of the encoder"),
    DEVICE: NodeKey("device", "where this node runs the encoder (auto, cpu, cuda, mps)"),
    CACHE_DIR: NodeKey("cache_dir", "this node's cache folder (features, settings, shard)"),
    BLOCKS: NodeKey("model.blocks", "local (default) or remote: the blocks on a blocks service"),
    BLOCKS_SERVICE: NodeKey(
        "model.blocks_service",
        "this node's blocks service (car-fl serve-blocks), which its policy's blocks-services "
        "must list; the run config can never set it",
    ),
    PRIVACY_POLICY: NodeKey(
        None, "this node's privacy policy (a TOML file its owner writes; see docs/privacy.md)"
    ),
    WORKER: NodeKey(
        None, "this node's worker folder (car-fl worker): the ClientApp hands it rounds"
    ),
    TRUST_REMOTE_CODE: NodeKey(
        None,
        "true: this node runs the model repository's own code when a run asks for it "
        "(model.trust_remote_code); otherwise such a run is refused",
    ),
}

#: Settings that may legitimately differ between the machines of one federation: those a node
#: config sets, and where results go, progress bars, the run to resume.
NODE_LOCAL_KEYS = (
    *(key.setting for key in NODE_CONFIG.values() if key.setting is not None),
    "output_dir",
    "progress",
    "resume",
)


class NodeConfigError(ValueError):
    """This node's own ``--node-config`` is incomplete or disagrees with the run."""


class FingerprintMismatch(ValueError):
    """This node resolved another configuration than the server's."""


@dataclass(frozen=True)
class NodeInfo:
    """Where this node sits in the federation, from Flower's node config."""

    partition_id: int
    num_partitions: int
    #: The node's data file is already its own shard: train on all of it, do not partition.
    data_is_shard: bool = False

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any], settings: Settings) -> NodeInfo:
        try:
            pid, num = int(node_config[PARTITION_ID]), int(node_config[NUM_PARTITIONS])
        except KeyError as err:
            raise NodeConfigError(
                f"this SuperNode's --node-config has no {err.args[0]!r}; start it with "
                f"--node-config '{PARTITION_ID}=<i> {NUM_PARTITIONS}=<n>'"
            ) from None
        if num != settings.fl.clients:
            raise NodeConfigError(
                f"this node says {NUM_PARTITIONS}={num} but the run is configured for "
                f"fl.clients={settings.fl.clients}; set fl.clients={num} in the run's overrides "
                f"or start {settings.fl.clients} SuperNodes (simulation: --federation-config "
                f"'num-supernodes={settings.fl.clients}')"
            )
        if not 0 <= pid < num:
            raise NodeConfigError(f"{PARTITION_ID}={pid} is outside [0, {num})")
        is_shard = str(node_config.get(DATA_IS_SHARD, "false")).lower() in ("1", "true", "yes")
        return cls(partition_id=pid, num_partitions=num, data_is_shard=is_shard)


def fingerprint(settings: Settings) -> str:
    """A short hash of everything that server and clients must agree on (not the
    :data:`NODE_LOCAL_KEYS`: each machine points at its own copies)."""
    conf = OmegaConf.create(settings_values(settings))
    for key in NODE_LOCAL_KEYS:
        OmegaConf.update(conf, key, None)
    text = OmegaConf.to_yaml(conf, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_fingerprint(mine: str, server: str | None) -> None:
    """Refuse to train on a configuration other than the server's, or one it did not state."""
    if server is None:
        raise FingerprintMismatch(
            "the train message states no configuration fingerprint: a car-fl server always "
            "sends the fingerprint of its settings; a node trains only on settings it can match"
        )
    if server != mine:
        raise FingerprintMismatch(
            f"this client resolved a different configuration (fingerprint {mine}) from the "
            f"server's ({server}); install the same car-fl version and conf/ on "
            "every machine and pass the same --run-config overrides"
        )


def apply_node_config(settings: Settings, node_config: Mapping[str, Any]) -> Settings:
    """Return a copy of ``settings`` with this node's local paths and device applied."""
    conf = OmegaConf.structured(settings)
    for key, spec in NODE_CONFIG.items():
        value = node_config.get(key)
        if spec.setting is not None and value not in (None, ""):
            OmegaConf.update(conf, spec.setting, str(value))
    return to_settings(conf)


#: Run-config keys that are not settings: Hydra overrides for everything else, and a whole
#: resolved configuration (in-process simulations of a sweep pass configurations this way).
OVERRIDES = "overrides"
SETTINGS_YAML = "settings"


class RunKey(NamedTuple):
    """A ``--run-config`` key of ``[tool.flwr.app.config]``: the Hydra override it becomes."""

    #: The setting (``fl.rounds``) or config group (``dp``) it sets.
    target: str
    help: str


#: The settings people change most, as run-config keys (exactly ``pyproject.toml``'s
#: ``[tool.flwr.app.config]`` plus ``overrides``); ``""`` leaves conf/'s value. ``epsilon``,
#: because TOML cannot hold a value ``dp`` and a table ``dp`` in one ``--run-config`` string.
RUN_CONFIG: dict[str, RunKey] = {
    "fl.rounds": RunKey("fl.rounds", "rounds of federated training"),
    "fl.local_epochs": RunKey("fl.local_epochs", "local epochs per round"),
    "fl.clients": RunKey("fl.clients", "clients (simulation: the SuperNodes car-fl run starts)"),
    "mode": RunKey("mode", "classifier or adapter (conf/mode/)"),
    "dp": RunKey("dp", "none, fixed, adaptive or record (conf/dp/)"),
    "epsilon": RunKey("dp.target_epsilon", "the target ε of dp (dp.target_epsilon)"),
    "model": RunKey("model", "tinyllama, llama32_3b, minilm or local (conf/model/)"),
    "dataset.path": RunKey("dataset.path", "a local data file (offline)"),
    "strategy": RunKey("strategy", "fedavg, median, trimmed_mean, krum, ... (conf/strategy/)"),
}
#: Every key car-fl reads from a run config.
RUN_CONFIG_KEYS = (*RUN_CONFIG, OVERRIDES)


def run_config_from_args(project: str | Path, items: Sequence[str]) -> dict[str, Any]:
    """The run config a SuperLink builds from ``--run-config`` strings (Flower's parser), but a
    key the project lacks is refused naming the valid keys."""
    import click
    from flwr.common.config import flatten_dict, get_project_config, parse_config_args

    try:
        given = parse_config_args(list(items))
    except click.ClickException as err:
        both = " ".join(items)
        hint = (
            "; TOML cannot hold dp and dp.<key> in one string: give dp.target_epsilon as "
            "epsilon=... and other dp keys in overrides"
            if re.search(r"(^|\s)dp=", both) and re.search(r"(^|\s)dp\.", both)
            else ""
        )
        raise ValueError(
            f"--run-config {both!r} is not Flower's key=value TOML: strings need double quotes, "
            f'e.g. dp="record" model="minilm"{hint}'
        ) from err
    defaults = flatten_dict(get_project_config(project)["tool"]["flwr"]["app"].get("config", {}))
    for key in given:
        if key not in defaults:
            raise ValueError(unknown_run_key(key))
    return {**defaults, **given}


def settings_from_run_config(run_config: Mapping[str, Any]) -> Settings:
    """Settings from Flower's run config: :data:`RUN_CONFIG`'s keys, then ``overrides``; a
    non-empty ``settings`` (a whole resolved configuration as YAML) takes precedence."""
    text, overrides = run_inputs(run_config)
    return settings_from_yaml(text) if text else load_settings(overrides)


#: How OmegaConf interpolations start (``${oc.env:HOME}``, ``${package_model_dir:name}``).
INTERPOLATION = "${"


def run_inputs(run_config: Mapping[str, Any]) -> tuple[str, str]:
    """The run config's whole settings YAML (or ``""``) and all its Hydra overrides, as one
    shell-quoted string (a node's settings cache is keyed by it)."""
    text = run_config.get(SETTINGS_YAML, "")
    if text and not isinstance(text, str):
        raise ValueError(f"run config 'settings' must be YAML text, got {type(text).__name__}")
    overrides = run_overrides(run_config)
    if any(
        INTERPOLATION in item for item in [str(text or ""), *overrides, *parsed(text, overrides)]
    ):
        # values only: an interpolation would be resolved on each node (its env, its modules);
        # also one written with escapes (Hydra's $\{...\}, YAML's \u0024{...}), parsed
        raise ValueError(
            f"a run config may not hold an interpolation ({INTERPOLATION}...}}): write the value "
            "itself; interpolations are resolved on every node"
        )
    return str(text or ""), shlex.join(overrides)


def parsed(text: str, overrides: list[str]) -> Iterator[str]:
    """Every string of the settings YAML ``text`` and of the ``overrides``' values as Hydra and
    YAML read them (escapes undone); what does not parse is refused later, by the compose."""
    values: list[Any] = []
    with contextlib.suppress(Exception):
        values.append(yaml.safe_load(text) if "\\" in text else None)  # only escapes hide one
    dollars = [item for item in overrides if "$" in item]  # Hydra's parser only where one hides
    if dollars:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        for item in dollars:
            with contextlib.suppress(Exception):
                values.append(parser.parse_override(item).value())
    while values:
        value = values.pop()
        if isinstance(value, dict):
            values += [*value.keys(), *value.values()]
        elif isinstance(value, list | tuple):
            values += value
        elif value is not None:
            yield str(value)


def run_overrides(run_config: Mapping[str, Any]) -> list[str]:
    """The Hydra overrides a run config stands for; ``ValueError`` naming a key car-fl lacks,
    or one of Hydra's own (``hydra.searchpath`` would compose a node's files of its choice)."""
    for key in run_config:
        if key not in RUN_CONFIG_KEYS and key != SETTINGS_YAML:
            raise ValueError(unknown_run_key(key))
    overrides = run_config.get(OVERRIDES, "")
    if not isinstance(overrides, str):
        raise ValueError(
            f"run config 'overrides' must be a string of Hydra overrides, got {overrides!r}"
        )
    items = [
        f"{spec.target}={hydra_value(run_config[key])}"
        for key, spec in RUN_CONFIG.items()
        if run_config.get(key, "") != ""
    ]
    extra = parse_overrides(overrides)
    for item in extra:
        if _override_key(item).split(".")[0] == "hydra":
            raise ValueError(
                f"a run config may not set Hydra's own options ({item}): they choose which "
                "configuration files every node composes; set car-fl's settings only"
            )
    refuse_config_paths([*items, *extra])
    given = {_override_key(item): item for item in items}
    for item in extra:
        if _override_key(item) in given:
            raise ValueError(
                f"{_override_key(item)} is set twice: {given[_override_key(item)]} by its "
                f"run-config key and {item} in overrides; keep one"
            )
    return [*items, *extra]


def refuse_config_paths(overrides: list[str]) -> None:
    """``ValueError`` unless a run config names each config group's option by its name: a path
    (``model=../../x``, ``+experiment=/tmp/x``) composes a YAML file of the run's choice on every
    node, and its interpolations in the node's environment. Checked on the text, without
    Hydra's parser (a cached round imports no Hydra): a name, or ``[name,name]``."""
    groups = group_options()
    for item in overrides:
        key, _, value = item.partition("=")
        group = _override_key(key).split("@")[0]
        if group not in groups and "/" not in group:
            continue
        options = groups.get(group, [])
        names = value[1:-1].split(",") if value.startswith("[") and value.endswith("]") else [value]
        if key.startswith("~") or not all(name in options for name in names):
            listing = ", ".join(options) or "none"
            raise ValueError(
                f"run config: {item} is not one of {group}'s configs ({listing}); a run config "
                "names a config, never a file"
            )


def unknown_run_key(key: str) -> str:
    """The message for a run-config key car-fl does not read: the valid ones, a close match."""
    close = difflib.get_close_matches(key, RUN_CONFIG_KEYS, n=1, cutoff=0.75)
    hint = f"did you mean {close[0]}? " if close else ""
    if not close and is_setting(key):
        hint = (
            f"{key} is a setting: give it in overrides (--run-config 'overrides=\"{key}=...\"'); "
        )
    keys = ", ".join(RUN_CONFIG_KEYS)
    return f"run config key {key!r} is not one of car-fl's; {hint}the keys: {keys}"


def _override_key(item: str) -> str:
    return item.lstrip("+~").split("=", 1)[0]


#: Hydra values that need no quotes: paths, numbers, names, ``adapter+classifier``.
_BARE = re.compile(r"[\w./:@+-]+")


def hydra_value(value: Any) -> str:
    """A run-config value (TOML: bool, int, float, str) as a Hydra override's value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if _BARE.fullmatch(text):
        return text
    escaped = text.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"
