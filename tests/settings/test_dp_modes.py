"""car_fl.settings.dp_modes: every dp.mode is one registered spec, and what each says is what
the node, the server and the report then do (the mechanisms: tests/privacy, tests/client)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from car_fl.privacy.accountant import ReleaseKind
from car_fl.settings.compose import load_settings
from car_fl.settings.dp_modes.registry import MODES
from car_fl.settings.dp_modes.spec import ClientLevel
from car_fl.settings.dp_plan import round_release
from car_fl.settings.schema import DPMode


def test_every_mode_has_one_spec_with_its_own_report_name() -> None:
    assert set(MODES) == set(DPMode)
    assert all(spec.mode is mode for mode, spec in MODES.items())
    names = [spec.report_name for spec in MODES.values()]
    assert len(set(names)) == len(names)
    # client-level DP is what a policy's protect = "mix" asks for: fixed and adaptive only
    assert {m for m, s in MODES.items() if s.client_level} == {DPMode.FIXED, DPMode.ADAPTIVE}
    assert {m for m, s in MODES.items() if s.record_level} == {DPMode.RECORD}


def test_each_modes_node_round_takes_the_rounds_context() -> None:
    """The node builds every mode's round the same way (car_fl.client.round.round_privacy)."""
    for spec in MODES.values():
        module, _, name = spec.node_round.partition(":")
        round_class = getattr(importlib.import_module(module), name)
        signature = inspect.signature(round_class)
        assert {"settings", "node", "node_state"} <= set(signature.parameters), spec.mode
        takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        assert takes_any or {"server_round", "global_state", "max_clip"} <= set(
            signature.parameters
        ), spec.mode


@pytest.mark.parametrize(
    ("overrides", "kind", "multiplier"),
    [
        ("dp=none", ReleaseKind.NON_PRIVATE, None),
        ("dp=fixed dp.noise_multiplier=1.0", ReleaseKind.GAUSSIAN, 0.5),  # σ₀/2
        ("dp=fixed dp.noise_multiplier=0", ReleaseKind.NON_PRIVATE, None),
        ("dp=fixed dp.noise_multiplier=1.0 dp.warmup_rounds=3", ReleaseKind.NON_PRIVATE, None),
        (
            "dp=adaptive dp.noise_multiplier=0.05 dp.adaptive_rule=linear",
            ReleaseKind.NON_PRIVATE,
            None,
        ),
        ("dp=record dp.noise_multiplier=1.0 dp.target_epsilon=null", ReleaseKind.DPSGD, 1.0),
    ],
)
def test_what_a_round_releases_is_the_modes_figure(
    overrides: str, kind: ReleaseKind, multiplier: float | None
) -> None:
    settings = load_settings(overrides)
    release = round_release(settings, server_round=1, examples=100)
    assert release.kind is kind
    if multiplier is not None:
        assert release.noise_multiplier == pytest.approx(multiplier)
    spec = MODES[settings.dp.mode]
    assert (spec.non_private_reason(settings.dp) is None) == (
        kind is not ReleaseKind.NON_PRIVATE or settings.dp.warmup_rounds > 0
    )


def test_a_warm_up_round_per_step_is_one_un_noised_release_as_the_policy_counts_rounds() -> None:
    """The ledger counted a warm-up round under ``dp.granularity=step`` as its local steps,
    un-noised: a run the policy admitted (``lifetime-unnoised-rounds`` counts rounds) was
    then refused by the ledger; the client itself counts one release (found by a review)."""
    settings = load_settings(
        "dp=fixed dp.noise_multiplier=1.0 dp.granularity=step dp.warmup_rounds=1 "
        "fl.max_examples_per_client=64 train.batch_size=8"
    )
    warm_up = round_release(settings, server_round=1, examples=64)
    assert (warm_up.kind, warm_up.count) == (ReleaseKind.NON_PRIVATE, 1)
    private = round_release(settings, server_round=2, examples=64)
    assert (private.kind, private.count) == (ReleaseKind.GAUSSIAN, 8 * settings.fl.local_epochs)


def test_adaptives_release_composes_the_update_and_the_indicator() -> None:
    settings = load_settings("dp=adaptive dp.noise_multiplier=0.05")
    spec = MODES[DPMode.ADAPTIVE]
    assert isinstance(spec, ClientLevel)
    release = round_release(settings, server_round=1, examples=10)
    # z_Δ/2 and σ_b composed into one Gaussian: z/2 up to rounding
    assert release.noise_multiplier == pytest.approx(0.025, rel=1e-6)


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ("dp=record dp.sample_rate=2", r"dp\.sample_rate \(q"),
        ("dp=adaptive dp.noise_multiplier=0.5", r"z < 2·σ_b"),
        ("dp=adaptive dp.ema_decay=0.5", r"dp\.ema_decay=0\.5 smooths"),
        ("fl.norm_bound=dp dp=adaptive dp.noise_multiplier=0.05", r"fl\.norm_bound=dp"),
        ("dp=record dp.target_epsilon=0.0001", r"target"),
    ],
)
def test_a_modes_rules_refuse_when_the_settings_are_composed(overrides: str, refused: str) -> None:
    with pytest.raises(ValueError, match=refused):
        load_settings(overrides)


def test_one_machine_trains_none_in_epochs_record_as_one_node_and_refuses_local_dp() -> None:
    assert MODES[DPMode.NONE].one_machine == "epochs"
    assert MODES[DPMode.RECORD].one_machine == "one node"
    for mode in (DPMode.FIXED, DPMode.ADAPTIVE):
        assert "protects an update from the server" in MODES[mode].one_machine
