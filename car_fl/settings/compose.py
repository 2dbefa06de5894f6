"""Composition: ``conf/`` plus Hydra overrides → validated settings.

The :mod:`car_fl.settings.schema` dataclasses are the schema of ``conf/config.yaml`` (their
defaults the only defaults); :func:`load_settings` is the one way entry points read
configuration. Hydra is imported only when something is composed.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import shlex
from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any, get_type_hints

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
