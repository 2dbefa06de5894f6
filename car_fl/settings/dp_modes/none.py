"""``dp=none``: nothing is clipped or noised; every release is non-private."""

from __future__ import annotations

from typing import TYPE_CHECKING

from car_fl.privacy.accountant import Release, ReleaseKind
from car_fl.settings.choices import DPMode
from car_fl.settings.dp_modes.spec import DPModeSpec

if TYPE_CHECKING:
    from car_fl.settings.federation import DPConfig
    from car_fl.settings.schema import Settings


class NoDP(DPModeSpec):
    mode = DPMode.NONE
    report_name = "FL"

    def non_private_reason(self, dp: DPConfig) -> str | None:
        return "dp=none adds no noise"

    def release(self, settings: Settings, *, server_round: int, examples: int) -> Release:
        return Release(ReleaseKind.NON_PRIVATE, 1)
