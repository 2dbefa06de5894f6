"""``dp=fixed``: a node's update clipped to C and noised with σ₀·C (the method's local DP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from car_fl.settings.choices import DPMode, Granularity
from car_fl.settings.dp_modes.spec import ClientLevel

if TYPE_CHECKING:
    from car_fl.settings.federation import DPConfig


class Fixed(ClientLevel):
    mode = DPMode.FIXED
    report_name = "FL + DP (fixed)"

    def bounds_replies(self, dp: DPConfig) -> bool:
        return dp.granularity is Granularity.ROUND  # a round's whole update is within C
