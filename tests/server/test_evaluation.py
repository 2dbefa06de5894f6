"""car_fl.server.federation: what the server evaluates when, and a federated adapter-mode run
whose test set waits for the end while each round's validation runs in the background."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from car_fl.model.features import LocalData
from car_fl.results.run import load_checkpoint, select_best
from car_fl.server.federation import EvalPlan, ServerEvaluator
from car_fl.simulation.in_process import run_local
from car_fl.training.train import HeldOut


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("mode=classifier",), EvalPlan(test_every_round=True, val_sample=0, background=False)),
        (("mode=adapter",), EvalPlan(test_every_round=False, val_sample=0, background=True)),
        (
            ("mode=adapter", "eval.test_every_round=true", "eval.background=false"),
            EvalPlan(test_every_round=True, val_sample=0, background=False),
        ),
        (
            ("mode=classifier", "eval.val_sample=10", "eval.background=true"),
            EvalPlan(test_every_round=True, val_sample=10, background=True),
        ),
    ],
)
def test_the_evaluation_plan_is_exact_in_classifier_mode_and_off_the_rounds_in_adapter_mode(
    make_settings, overrides: tuple[str, ...], expected: EvalPlan
) -> None:
    assert EvalPlan.of(make_settings(*overrides)) == expected


def test_a_negative_validation_sample_is_refused(make_settings) -> None:
    with pytest.raises(ValueError, match=r"eval\.val_sample must be >= 0"):
        make_settings("eval.val_sample=-1")


def test_the_validation_sample_is_seeded_a_subset_in_order_and_leaves_test_alone() -> None:
    labels = torch.arange(50) % 3
    held = HeldOut(
        test=LocalData(labels=labels[:7], features=torch.randn(7, 4)),
        validation=LocalData(labels=labels, features=torch.arange(50.0)[:, None].repeat(1, 4)),
    )
    one, again = held.sample_validation(20, seed=3), held.sample_validation(20, seed=3)
    other = held.sample_validation(20, seed=4)
    assert one.validation is not None and again.validation is not None
    assert other.validation is not None and len(one.validation) == 20
    features = [one.validation.features, again.validation.features, other.validation.features]
    first, second, third = (f for f in features if f is not None)
    picked = first[:, 0].tolist()  # features hold the example's position
    assert picked == sorted(picked) and len(set(picked)) == 20
    assert torch.equal(first, second) and not torch.equal(first, third)
    assert torch.equal(one.validation.labels, labels[[int(p) for p in picked]])
    assert one.test is held.test
    assert held.sample_validation(0, seed=3) is held and held.sample_validation(50, seed=3) is held


def rounds_of(metrics: dict) -> list[dict]:
    return metrics["history"]


@pytest.mark.slow
def test_a_federated_adapter_run_selects_on_validation_and_reports_test_for_the_selected_state(
    make_settings, tmp_path: Path
) -> None:
    """Adapter mode's defaults (validation each round in the background, test once at the end)
    against the exact evaluation of every round between the rounds, on the same run."""
    common = ("mode=adapter", "fl.clients=2", "fl.rounds=3", "fl.local_epochs=1", "train.lr=0.01")
    torch.manual_seed(0)
    new = make_settings(*common, f"output_dir={tmp_path / 'new'}")
    assert EvalPlan.of(new) == EvalPlan(test_every_round=False, val_sample=0, background=True)
    fast = run_local(new)
    torch.manual_seed(0)
    exact_settings = make_settings(
        *common,
        "eval.test_every_round=true",
        "eval.background=false",
        f"output_dir={tmp_path / 'exact'}",
    )
    exact = run_local(exact_settings)

    rows, reference = rounds_of(fast), rounds_of(exact)
    assert [r["round"] for r in rows] == [1, 2, 3] and fast["summary"]["complete"]
    # Validation each round, the same figures as the exact evaluation of the same states
    for row, ref in zip(rows, reference, strict=True):
        assert row["val_top1"] == ref["val_top1"] and row["val_loss"] == pytest.approx(
            ref["val_loss"], rel=1e-6
        )
    # Selection on validation: the same round as the exact run, chosen by validation alone
    best = fast["summary"]["best"]
    chosen = select_best(rows)
    assert chosen is not None and best["round"] == chosen["round"]
    assert best["round"] == exact["summary"]["best"]["round"]
    # Test figures for the selected state and the final one, those of the exact run...
    tested = {best["round"], rows[-1]["round"]}
    for row in rows:
        if row["round"] in tested:
            ref = reference[row["round"] - 1]
            assert row["test_top1"] == ref["test_top1"]
            assert row["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-6)
        else:  # ...and no other round paid for a test pass
            assert math.isnan(row["test_top1"])
    assert best["test_top1"] == reference[best["round"] - 1]["test_top1"]
    assert fast["summary"]["final"]["test_top1"] == reference[-1]["test_top1"]
    assert math.isnan(fast["summary"]["initial"]["test_top1"])
    # ...and of the very state in the best checkpoint, which carries them
    saved = load_checkpoint(tmp_path / "new" / "checkpoints" / "best")
    assert saved.round == best["round"] and saved.metrics["test_top1"] == best["test_top1"]
    evaluator = ServerEvaluator.build(new)
    assert evaluator.test(saved.state)["test_top1"] == best["test_top1"]
    final = load_checkpoint(tmp_path / "new" / "checkpoints" / "final")
    assert final.metrics["test_top1"] == rows[-1]["test_top1"]


@pytest.mark.slow
def test_a_validation_sample_selects_on_that_sample_and_says_so(
    make_settings, tmp_path: Path
) -> None:
    settings = make_settings(
        "mode=adapter",
        "fl.clients=2",
        "fl.rounds=2",
        "fl.local_epochs=1",
        "eval.val_sample=10",
        f"output_dir={tmp_path / 'run'}",
    )
    metrics = run_local(settings)
    assert metrics["summary"]["selection"] == "validation sample (10 of 32)"
    chosen = select_best(rounds_of(metrics))
    assert chosen is not None and metrics["summary"]["best"]["round"] == chosen["round"]
    assert math.isfinite(metrics["summary"]["best"]["test_top1"])
    # 10 examples: every validation top-1 is a multiple of 1/10
    for row in rounds_of(metrics):
        assert row["val_top1"] * 10 == pytest.approx(round(row["val_top1"] * 10))
