"""What a DP mode is to the rest of car-fl: :class:`DPModeSpec`, and :class:`ClientLevel`, the
base of the modes that clip and noise a node's whole update (local DP)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from car_fl.privacy.accountant import Release, ReleaseKind
from car_fl.settings.choices import DPMode, Granularity

if TYPE_CHECKING:
    from car_fl.settings.federation import DPConfig
    from car_fl.settings.schema import Settings


class DPModeSpec:
    """One ``dp.mode``: what it releases and its ε, its settings rules, what it asks of a
    node's policy, how one machine trains under it, and its name in reports."""

    mode: ClassVar[DPMode]
    #: What ``car-fl report`` calls a federation under it.
    report_name: ClassVar[str]
    #: It clips and noises a node's whole update: client-level DP (a policy's
    #: ``protect = "mix"`` asks for it; ``dp.granularity`` and ``dp.adapter_share`` apply).
    client_level: ClassVar[bool] = False
    #: It clips and noises each record's gradient (DP-SGD): one record must move no other,
    #: and the server keeps each node's DP-SGD row.
    record_level: ClassVar[bool] = False
    #: The node's round that makes its releases (``module:Class``, imported on the node).
    node_round: ClassVar[str] = "car_fl.client.local_dp:LocalDPRound"
    #: How one machine trains under it: ``"epochs"`` (the centralised loop), ``"one node"``
    #: (a federation of one node), or what it is and the fix (``dp=<mode> is ...``).
    one_machine: ClassVar[str] = "epochs"

    @property
    def enabled(self) -> bool:
        """Its releases are private after ``dp.warmup_rounds``."""
        return self.mode is not DPMode.NONE

    def check(self, dp: DPConfig) -> None:
        """Its own rules on ``dp`` (``ValueError`` naming the key and the fix)."""

    def check_settings(self, settings: Settings) -> None:
        """Its rules that need the whole settings (``ValueError``), checked by the schema."""

    def check_plan(self, settings: Settings) -> None:
        """Its noise plan can be made (``ValueError``), checked once the settings are composed."""

    def non_private_reason(self, dp: DPConfig) -> str | None:
        """Why its releases under ``dp`` are not differentially private, or None."""
        return None

    def release(self, settings: Settings, *, server_round: int, examples: int) -> Release:
        """What one node's reply in ``server_round`` releases, accounted for ``examples``."""
        raise NotImplementedError

    def noise_floor(self, settings: Settings) -> float:
        """The σ a node's policy floor compares."""
        return settings.dp.noise_multiplier

    def planned_steps(self, settings: Settings) -> int | None:
        """Its DP steps in one round from the settings alone; None when data-dependent."""
        return None

    def per_step(self, dp: DPConfig) -> bool:
        """Whether each optimizer step is a release (``dp.granularity=step``)."""
        return False

    def bounds_replies(self, dp: DPConfig) -> bool:
        """Whether the server may bound each reply's update norm by the mechanism's own clip
        (``fl.norm_bound=dp``)."""
        return False

    def calibrated_to_rounds(self, settings: Settings) -> bool:
        """Whether its noise is calibrated to ``fl.rounds`` (a resume may not change them)."""
        return False


def local_steps(settings: Settings, examples: int) -> int:
    """Optimizer steps of one round of ``fl.local_epochs`` epochs over ``examples`` examples."""
    return settings.fl.local_epochs * math.ceil(examples / settings.train.batch_size)


def accounted_examples(settings: Settings, examples: int) -> int:
    """The n a per-step round is trained and accounted for: ``fl.max_examples_per_client``
    when set (so the number of releases is public), else the node's own n."""
    return settings.fl.max_examples_per_client or examples


class ClientLevel(DPModeSpec):
    """A mode that clips and noises a node's update: once per round, or after every step
    (``dp.granularity=step``), one Gaussian of multiplier :meth:`multiplier` each."""

    client_level = True
    one_machine = (
        "local DP, which protects an update from the server: train it federated "
        "(car-fl run / flwr run .), or use dp=record (DP-SGD) on one machine"
    )
    #: Its clipping bound moves with a private rule (dp=adaptive), else it is ``dp.clip``.
    moves_clip: ClassVar[bool] = False

    def update_multiplier(self, dp: DPConfig, num_clients: int) -> float:
        """The update's noise std over its clipping bound."""
        return dp.noise_multiplier

    def multiplier(self, dp: DPConfig, num_clients: int) -> float:
        """μ of one release when it is private: the update's, on a sensitivity of 2C."""
        return self.update_multiplier(dp, num_clients) / 2.0

    def non_private_reason(self, dp: DPConfig) -> str | None:
        if dp.noise_multiplier == 0:
            return f"dp={dp.mode.value} with dp.noise_multiplier=0 adds no noise"
        return None

    def local_multiplier(self, dp: DPConfig, num_clients: int) -> float:
        """μ of one release; 0 (ε = ∞) when it is not private."""
        return 0.0 if self.non_private_reason(dp) is not None else self.multiplier(dp, num_clients)

    def per_step(self, dp: DPConfig) -> bool:
        return dp.granularity is Granularity.STEP

    def release(self, settings: Settings, *, server_round: int, examples: int) -> Release:
        dp = settings.dp
        active = server_round > dp.warmup_rounds
        stepwise = self.per_step(dp) and active  # a warm-up round is one un-noised release
        count = local_steps(settings, accounted_examples(settings, examples)) if stepwise else 1
        return self.releases(dp, settings.fl.clients, count, active=active)

    def releases(self, dp: DPConfig, num_clients: int, count: int, *, active: bool) -> Release:
        """``count`` releases as every party accounts them (non-private in a warm-up round or
        under a non-private rule)."""
        mu = self.local_multiplier(dp, num_clients) if active else 0.0
        if mu == 0:
            return Release(ReleaseKind.NON_PRIVATE, count)
        return Release(ReleaseKind.GAUSSIAN, count, noise_multiplier=mu)

    def planned_steps(self, settings: Settings) -> int | None:
        cap = settings.fl.max_examples_per_client
        if self.per_step(settings.dp) and cap is not None:
            return local_steps(settings, cap)
        return None
