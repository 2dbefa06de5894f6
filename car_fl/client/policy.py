"""A node's privacy policy: what its owner accepts, set on the node and never by the server.

A TOML file named in the node's ``--node-config privacy-policy=...`` (its keys: :data:`KEYS`,
documented in docs/privacy.md, 'What a node's owner controls'). :meth:`NodePolicy.violations`
lists every way a run is weaker. Errors name the file, line and key; unknown keys are errors
(a misspelt ``max-clip`` must not silently mean "no ceiling").
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from car_fl.client.node_reading import NodeReading, ReadingError
from car_fl.privacy.accountant import Accountant
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_plan import (
    noise_floor_multiplier,
    non_private_reason,
    per_step,
    round_release,
)
from car_fl.settings.schema import DPMode, Partitioning, Settings, Split

#: The ledger folder when the policy names none (relative to the policy file).
DEFAULT_LEDGER = "ledger"
DEFAULT_DELTA = 1e-5


class PolicyError(ValueError):
    """The policy file is missing, unreadable or invalid (the message names file, line, key)."""


@dataclass(frozen=True)
class NodePolicy:
    """What a node's owner accepts."""

    modes: frozenset[DPMode]
    min_noise_multiplier: float = 0.0
    max_clip: float = math.inf
    max_delta: float = DEFAULT_DELTA
    allow_warmup: bool = False
    lifetime_epsilon: float | None = None
    #: The most un-noised rounds (warm-up or dp=none) any record is ever released in, all
    #: runs together; ``None``: no bound (each run's own plan only).
    lifetime_unnoised_rounds: int | None = None
    #: Refuse runs whose reply would carry or follow the node's example count n.
    public_example_count: bool = True
    #: The most DP steps one round may plan (bounds the work a server can ask).
    max_steps_per_round: int = 100_000
    #: ``records``: any accepted mode; ``mix``: client-level DP only, which also hides the
    #: shard's label mix.
    protect: str = "records"
    ledger: Path = Path(DEFAULT_LEDGER)
    #: How the node reads its data file (the ``[data]`` table): the run config cannot change it.
    data: NodeReading = field(default_factory=NodeReading)
    #: The blocks services (``car-fl serve-blocks``) that may see this node's soft embeddings.
    blocks_services: tuple[str, ...] = ()
    #: Where the policy was read from (for messages).
    source: Path = field(default=Path("<policy>"), compare=False)

    @classmethod
    def load(cls, path: str | Path) -> NodePolicy:
        """Read and validate a policy file; ``PolicyError`` naming the file, line and key."""
        path = Path(path).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise PolicyError(
                f"privacy policy {path}: cannot be read ({err.strerror}); fix the path in "
                "--node-config privacy-policy=..."
            ) from None
        return cls.parse(text, source=path)

    @classmethod
    def parse(cls, text: str, *, source: Path) -> NodePolicy:
        """A policy from TOML ``text``; relative ledger paths are relative to ``source``."""
        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise PolicyError(f"privacy policy {source}: not valid TOML: {err}") from None
        reader = _Reader(values, text, source)
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise PolicyError(
                reader.where(unknown[0])
                + f"unknown key {unknown[0]!r}; the keys are: {', '.join(KEYS)}"
            )
        modes = reader.modes()
        ledger = Path(reader.text("ledger", DEFAULT_LEDGER)).expanduser()
        try:
            data = NodeReading.parse(values.get("data", {}), where=reader.where)
        except ReadingError as err:
            raise PolicyError(str(err)) from None
        return cls(
            modes=modes,
            min_noise_multiplier=reader.number("min-noise-multiplier", 0.0, low=0.0),
            max_clip=reader.number("max-clip", math.inf, low=0.0, open_low=True),
            max_delta=reader.number(
                "max-delta", DEFAULT_DELTA, low=0.0, open_low=True, high=1.0, open_high=True
            ),
            allow_warmup=reader.flag("allow-warmup", False),
            lifetime_epsilon=reader.optional_number("lifetime-epsilon"),
            lifetime_unnoised_rounds=reader.optional_count("lifetime-unnoised-rounds"),
            public_example_count=reader.flag("public-example-count", True),
            max_steps_per_round=int(reader.number("max-steps-per-round", 100_000, low=1.0)),
            protect=reader.choice("protect", "records", PROTECT),
            ledger=ledger if ledger.is_absolute() else (source.parent / ledger),
            data=data,
            blocks_services=reader.addresses("blocks-services"),
            source=source,
        )

    @property
    def accepts_non_private(self) -> bool:
        """Whether the owner accepts releases without noise at all (``none`` among the modes)."""
        return DPMode.NONE in self.modes

    def violations(self, settings: Settings, *, shared_file: bool = True) -> list[str]:
        """Every way the run's DP settings are weaker than this policy (empty: accepted)."""
        dp = settings.dp
        found: list[str] = []
        placed_by_others = (
            settings.dataset.split is not Split.HASH
            or settings.fl.partitioning is not Partitioning.HASH
        )
        mode = MODES[dp.mode]
        if mode.record_level and shared_file and placed_by_others:
            found.append(  # car_fl.data.placement: one record would move many
                "dp=record on a node that splits and partitions its file needs "
                f'dataset.split=hash (the policy\'s [data] split = "hash"; it reads '
                f"{settings.dataset.split}) and fl.partitioning=hash (the run's: "
                f"{settings.fl.partitioning}): a seeded split or partition moves other records "
                "when one is added, so DP-SGD's unit would not be one record"
            )
        if settings.model.trust_remote_code:  # code from the model's repository: it could
            found.append(  # skip this policy and the ledger, whatever the DP settings say
                "model.trust_remote_code=true would run the model repository's own code on "
                "this node, beside its data and its privacy ledger"
            )
        if settings.model.blocks == "remote":  # car_fl.blocks: the service sees soft embeddings
            service = settings.model.blocks_service
            if service not in self.blocks_services:
                listed = ", ".join(self.blocks_services) or "none"
                found.append(
                    f"model.blocks=remote would send this node's soft embeddings (its texts, "
                    f"docs/blocks.md) to {service or 'no service named'}, not among the "
                    f"policy's blocks-services ({listed})"
                )
        if dp.mode not in self.modes:
            accepted = ", ".join(sorted(m.value for m in self.modes))
            found.append(f"dp={dp.mode.value} is not among the accepted modes ({accepted})")
            return found
        if self.protect == "mix" and not mode.client_level:
            found.append(
                f'dp={dp.mode.value} does not protect the shard as a whole and protect = "mix" '
                "asks client-level DP (dp=fixed or dp=adaptive)"
            )
            return found
        unnoised = dp.warmup_rounds if dp.enabled else settings.fl.rounds
        cap = self.lifetime_unnoised_rounds
        if unnoised and cap is not None and unnoised > cap:
            found.append(
                f"this run plans {unnoised} un-noised rounds, above lifetime-unnoised-rounds {cap}"
            )
        if not dp.enabled:
            if self.public_example_count:
                found.append(
                    "dp=none sends the example count un-noised and public-example-count is true"
                )
            return found
        unbounded = settings.fl.max_examples_per_client is None
        steps = planned_steps(settings)
        if steps is not None and steps > self.max_steps_per_round:  # before any accounting
            found.append(
                f"a round plans {steps:,} DP steps (dp.sample_rate={dp.sample_rate:g}, "
                f"fl.local_epochs={settings.fl.local_epochs}), above max-steps-per-round "
                f"{self.max_steps_per_round:,}"
            )
            return found
        if self.public_example_count and per_step(settings) and unbounded:
            found.append(
                "dp.granularity=step without fl.max_examples_per_client: the number of "
                "noised steps (and the ε a reply carries) would follow the example count, "
                "and public-example-count is true"
            )
        if self.public_example_count and mode.record_level and unbounded:
            found.append(
                "dp=record without fl.max_examples_per_client: each DP-SGD step divides its "
                "noised sum by q·n, so the update's scale would follow the example count, and "
                "public-example-count is true"
            )
        reason = non_private_reason(dp) or infinite_epsilon(settings)
        if reason is not None and not self.accepts_non_private:
            found.append(f"{reason}: not private, and 'none' is not an accepted mode")
        sigma = noise_floor_multiplier(settings)
        if sigma < self.min_noise_multiplier:
            found.append(
                f"noise multiplier {sigma:.4g} is below min-noise-multiplier "
                f"{self.min_noise_multiplier:g}"
            )
        if dp.clip > self.max_clip:
            found.append(f"dp.clip={dp.clip:g} is above max-clip {self.max_clip:g}")
        if dp.adapter_clip is not None and dp.adapter_clip > self.max_clip:
            found.append(f"dp.adapter_clip={dp.adapter_clip:g} is above max-clip {self.max_clip:g}")
        if dp.delta > self.max_delta:
            found.append(f"dp.delta={dp.delta:g} is above max-delta {self.max_delta:g}")
        if dp.warmup_rounds and not self.allow_warmup:
            found.append(
                f"dp.warmup_rounds={dp.warmup_rounds} sends un-noised updates and "
                "allow-warmup is false"
            )
        elif dp.warmup_rounds and self.public_example_count:
            found.append(
                f"dp.warmup_rounds={dp.warmup_rounds} sends the example count un-noised (as "
                "dp=none does) and public-example-count is true"
            )
        return found


def infinite_epsilon(settings: Settings) -> str | None:
    """Why a private round of this run releases with ε = ∞ (a noise multiplier too small for
    any guarantee, e.g. σ = 1e-100 or a calibration to ε = ∞), or None."""
    dp = settings.dp
    examples = settings.fl.max_examples_per_client or 1
    release = round_release(settings, server_round=dp.warmup_rounds + 1, examples=examples)
    if release.private and math.isfinite(Accountant([release]).get_epsilon(dp.delta)):
        return None
    return (
        f"dp={dp.mode} with noise multiplier {noise_floor_multiplier(settings):.3g} releases "
        "with ε = ∞ in each round"
    )


def planned_steps(settings: Settings) -> int | None:
    """The DP steps one round plans, from the settings alone; ``None`` when they are not."""
    return MODES[settings.dp.mode].planned_steps(settings)


#: The policy file's keys, in the order the docs list them.
KEYS = (
    "modes",
    "min-noise-multiplier",
    "max-clip",
    "max-delta",
    "allow-warmup",
    "lifetime-epsilon",
    "lifetime-unnoised-rounds",
    "public-example-count",
    "max-steps-per-round",
    "protect",
    "ledger",
    "blocks-services",
    "data",
)
#: The values of ``protect``.
PROTECT = ("records", "mix")


class _Reader:
    """Typed values of a parsed policy, with errors that name file, line and key."""

    def __init__(self, values: dict[str, Any], text: str, source: Path) -> None:
        self.values, self.text_lines, self.source = values, text.splitlines(), source

    def where(self, key: str) -> str:
        pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
        for number, line in enumerate(self.text_lines, start=1):
            if pattern.match(line):
                return f"privacy policy {self.source}, line {number}, {key!r}: "
        return f"privacy policy {self.source}, {key!r}: "

    def modes(self) -> frozenset[DPMode]:
        if "modes" not in self.values:
            raise PolicyError(
                f"privacy policy {self.source}: 'modes' is missing; list the DP modes this "
                'node accepts, e.g. modes = ["record"] (none, fixed, adaptive, record)'
            )
        raw = self.values["modes"]
        valid = ", ".join(m.value for m in DPMode)
        if not isinstance(raw, list) or not raw or not all(isinstance(m, str) for m in raw):
            raise PolicyError(
                self.where("modes") + f"must be a non-empty list of names ({valid}), got {raw!r}"
            )
        unknown = [m for m in raw if m not in {d.value for d in DPMode}]
        if unknown:
            raise PolicyError(self.where("modes") + f"unknown mode {unknown[0]!r}; valid: {valid}")
        return frozenset(DPMode(m) for m in raw)

    def addresses(self, key: str) -> tuple[str, ...]:
        raw = self.values.get(key, [])
        if not isinstance(raw, list) or not all(
            isinstance(a, str) and a.startswith(("http://", "https://")) for a in raw
        ):
            raise PolicyError(
                self.where(key) + f'must be a list of http(s):// addresses, e.g. ["http://'
                f'127.0.0.1:8200/blocks"], got {raw!r}'
            )
        return tuple(raw)

    def choice(self, key: str, default: str, valid: tuple[str, ...]) -> str:
        value = self.values.get(key, default)
        if value not in valid:
            raise PolicyError(self.where(key) + f"must be one of {', '.join(valid)}, got {value!r}")
        return str(value)

    def number(
        self,
        key: str,
        default: float,
        *,
        low: float,
        high: float = math.inf,
        open_low: bool = False,
        open_high: bool = False,
    ) -> float:
        if key not in self.values:
            return default
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise PolicyError(self.where(key) + f"must be a number, got {value!r}")
        value = float(value)
        below = value <= low if open_low else value < low
        above = value >= high if open_high else value > high
        if below or above:
            left, right = "(" if open_low else "[", ")" if open_high else "]"
            raise PolicyError(
                self.where(key) + f"must be in {left}{low:g}, {high:g}{right}, got {value:g}"
            )
        return value

    def optional_number(self, key: str) -> float | None:
        if key not in self.values:
            return None
        return self.number(key, math.inf, low=0.0, open_low=True)

    def optional_count(self, key: str) -> int | None:
        value = self.values.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise PolicyError(self.where(key) + f"must be a whole number >= 0, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.values.get(key, default)
        if not isinstance(value, bool):
            raise PolicyError(self.where(key) + f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str) -> str:
        value = self.values.get(key, default)
        if not isinstance(value, str) or not value:
            raise PolicyError(self.where(key) + f"must be a non-empty path, got {value!r}")
        return value
