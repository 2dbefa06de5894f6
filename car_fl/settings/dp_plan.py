"""What a configuration's record-level DP implies: its DP-SGD plan, and whether it is reachable.

The schema (:mod:`car_fl.settings.schema`) checks what it can without the accountant; this
module asks :mod:`car_fl.privacy.record_accounting` for σ (calibrated for ``dp.target_epsilon``
over ``fl.rounds`` × ``fl.local_epochs`` × ⌈1/q⌉ steps), so that :func:`check` fails before any
work for a target that cannot be reached.
"""

from __future__ import annotations

from car_fl.privacy.record_accounting import RecordPlan
from car_fl.privacy.record_accounting import record_plan as _plan
from car_fl.settings.schema import DPMode, Settings


def record_plan(settings: Settings) -> RecordPlan:
    """The DP-SGD plan of ``dp=record`` settings (σ calibrated for a target ε, cached)."""
    dp, fl = settings.dp, settings.fl
    return _plan(
        sample_rate=dp.sample_rate,
        noise_multiplier=dp.noise_multiplier,
        clip=dp.clip,
        delta=dp.delta,
        target_epsilon=dp.target_epsilon,
        rounds=fl.rounds,
        local_epochs=fl.local_epochs,
    )


def check(settings: Settings) -> None:
    """Raise ``ValueError`` (naming the key) when the record-level DP plan cannot be made."""
    if settings.dp.mode is DPMode.RECORD:
        record_plan(settings)
