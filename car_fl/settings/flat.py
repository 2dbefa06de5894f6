"""Settings as dotted keys (``train.lr``): which settings two runs differ in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from car_fl.settings.compose import settings_values
from car_fl.settings.schema import Settings


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"section.key": value}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def flat_settings(settings: Settings) -> dict[str, Any]:
    """``settings`` as dotted keys with plain values (choices by their value)."""
    return flatten(settings_values(settings))


def changed_keys(before: Settings, after: Settings, *, ignore: Iterable[str] = ()) -> list[str]:
    """The dotted keys whose values differ, as ``key=before→after``, sorted; keys starting
    with one of ``ignore`` are left out."""
    skip = tuple(ignore)
    a, b = flat_settings(before), flat_settings(after)
    return [
        f"{key}={a.get(key)}→{b.get(key)}"
        for key in sorted(set(a) | set(b))
        if not (skip and key.startswith(skip)) and repr(a.get(key)) != repr(b.get(key))
    ]


def refuse_other_settings(
    run_dir: object, saved: Settings, settings: Settings, *, may_change: Iterable[str], fix: str
) -> None:
    """Refuse (``ValueError``) to resume the run in ``run_dir``, saved with ``saved``, under
    ``settings`` when a key other than those starting with one of ``may_change`` differs: the
    one comparison of a resumed run's settings, centralised or federated; the error names
    each key (``key=saved→now``) and ends with ``fix``."""
    changed = changed_keys(saved, settings, ignore=may_change)
    if changed:
        raise ValueError(
            f"resume={run_dir}: that run was made with other settings ({', '.join(changed)}); {fix}"
        )
