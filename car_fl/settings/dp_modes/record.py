"""``dp=record``: DP-SGD on each node, each record's gradient clipped to C and the sum noised
with σ·C, σ calibrated for ``dp.target_epsilon`` over the run's planned steps
(:mod:`car_fl.privacy.record_accounting`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from car_fl.privacy.accountant import Release, ReleaseKind
from car_fl.privacy.record_accounting import RecordPlan, steps_per_epoch
from car_fl.privacy.record_accounting import record_plan as _plan
from car_fl.settings.choices import DPMode
from car_fl.settings.dp_modes.spec import DPModeSpec
from car_fl.settings.federation import ADAPTER_SHARE_DEFAULT

if TYPE_CHECKING:
    from car_fl.settings.federation import DPConfig
    from car_fl.settings.schema import Settings


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


class Record(DPModeSpec):
    mode = DPMode.RECORD
    report_name = "FL + DP-SGD (record)"
    record_level = True
    node_round = "car_fl.client.record_dp:RecordDPRound"
    one_machine = "one node"

    def check(self, dp: DPConfig) -> None:
        """dp=record: σ > 0 unless a target ε calibrates it, no warm-up, an adapter bound below
        C, local DP's noise split left alone (q and δ are checked in every mode)."""
        if dp.target_epsilon is None and not dp.noise_multiplier > 0:
            raise ValueError(
                f"dp=record needs dp.noise_multiplier (σ) > 0, got {dp.noise_multiplier}; "
                "set e.g. dp.noise_multiplier=1.0, or dp.target_epsilon=3 to calibrate σ"
            )
        if dp.warmup_rounds:
            raise ValueError(
                f"dp=record trains every round with DP-SGD; dp.warmup_rounds must be 0, "
                f"got {dp.warmup_rounds}"
            )
        if dp.adapter_clip is not None and not dp.adapter_clip < dp.clip:
            raise ValueError(
                f"dp.adapter_clip={dp.adapter_clip:g} under dp=record must be below "
                f"dp.clip={dp.clip:g}: each example's adapter and head gradients share the "
                f"bound dp.clip (the head gets the rest); e.g. dp.adapter_clip={dp.clip / 10:g}"
            )
        if dp.adapter_share != ADAPTER_SHARE_DEFAULT:  # set by hand, it would do nothing
            raise ValueError(
                f"dp.adapter_share={dp.adapter_share:g} splits local DP's noise (dp=fixed or "
                "adaptive); dp=record adds one noise σ·dp.clip to the whole gradient, and the "
                "adapter's share of each example's bound is set by dp.adapter_clip instead: "
                "remove dp.adapter_share"
            )

    def check_plan(self, settings: Settings) -> None:
        record_plan(settings)  # a target ε that cannot be reached fails here, before any work

    def release(self, settings: Settings, *, server_round: int, examples: int) -> Release:
        plan = record_plan(settings)
        return Release(
            ReleaseKind.DPSGD,
            plan.steps_per_round,
            noise_multiplier=plan.noise_multiplier,
            sample_rate=plan.sample_rate,
        )

    def noise_floor(self, settings: Settings) -> float:
        return record_plan(settings).noise_multiplier  # the calibrated σ

    def planned_steps(self, settings: Settings) -> int | None:
        return settings.fl.local_epochs * steps_per_epoch(settings.dp.sample_rate)

    def calibrated_to_rounds(self, settings: Settings) -> bool:
        return settings.dp.target_epsilon is not None
