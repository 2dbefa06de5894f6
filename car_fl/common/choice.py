"""Settings with a fixed set of values (:class:`Choice`) and the checks every settings section
shares; below every package that declares a section (:mod:`car_fl.heads.config`,
:mod:`car_fl.settings`)."""

from __future__ import annotations

from enum import EnumType, StrEnum
from typing import Any, Self


class _ByValue(EnumType):
    """OmegaConf looks an enum member up by name (``Mode["..."]``); this accepts its value too,
    so that ``conf/`` and overrides write ``train.mode=adapter+classifier`` as users read it."""

    def __getitem__(cls, name: Any) -> Any:
        try:
            return super().__getitem__(name)
        except KeyError:
            return cls(name)


class Choice(StrEnum, metaclass=_ByValue):
    """A setting with a fixed set of values (a ``str`` enum: it compares equal to its value)."""

    @classmethod
    def parse(cls, key: str, value: object) -> Self:
        """The member named by ``value``; a ``ValueError`` naming ``key`` and the valid values."""
        try:
            return cls(value)  # type: ignore[arg-type]  # a str, or a member
        except ValueError:
            raise ValueError(
                f"{key}={value!r} is not valid; choose one of {', '.join(m.value for m in cls)}"
            ) from None


def one_of(key: str, value: str, valid: tuple[str, ...] | list[str]) -> None:
    """Reject a ``value`` of ``key`` that is not among the ``valid`` names, listing them."""
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not valid; choose one of {', '.join(valid)}")


def positive(key: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")


def at_least(key: str, value: float, low: int) -> None:
    """Refuse ``value`` below ``low``, and NaN (which no comparison lets through)."""
    if not value >= low:
        raise ValueError(f"{key} must be >= {low}, got {value}")
