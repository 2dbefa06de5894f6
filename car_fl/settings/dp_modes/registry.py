"""``dp.mode`` → its :class:`~car_fl.settings.dp_modes.spec.DPModeSpec`: the one place a
new mode is registered (docs/privacy.md, "Adding a DP mode")."""

from __future__ import annotations

from car_fl.settings.choices import DPMode
from car_fl.settings.dp_modes.adaptive import Adaptive
from car_fl.settings.dp_modes.fixed import Fixed
from car_fl.settings.dp_modes.none import NoDP
from car_fl.settings.dp_modes.record import Record
from car_fl.settings.dp_modes.spec import DPModeSpec

#: ``dp.mode`` → its spec: the one place a new mode is registered.
MODES: dict[DPMode, DPModeSpec] = {
    spec.mode: spec for spec in (NoDP(), Fixed(), Adaptive(), Record())
}
assert set(MODES) == set(DPMode), "every dp.mode has its module"
