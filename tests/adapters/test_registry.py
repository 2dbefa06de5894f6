"""Every adapter kind: the identity at start, its anchor, its per-example gradients, its wire."""

from __future__ import annotations

import pytest
import torch

from car_fl.adapters.adapter import Adapter, adapter_class, build_adapter
from car_fl.adapters.config import ADAPTERS
from car_fl.settings.schema import AdapterConfig, AdapterKind

KINDS = list(AdapterKind)


def moved(kind: AdapterKind, dim: int = 12, **settings: object) -> Adapter:
    """An adapter of ``kind`` moved off its start (float64), so no test passes at the identity."""
    adapter = build_adapter(AdapterConfig(kind=kind, **settings), dim, seed=3).double()  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return adapter


def test_every_kind_is_registered_once_with_a_class_of_its_kind() -> None:
    assert set(ADAPTERS) == set(AdapterKind)
    classes = [adapter_class(kind) for kind in AdapterKind]
    assert [cls.kind for cls in classes] == KINDS and len(set(classes)) == len(classes)


def test_a_registration_that_names_no_adapter_of_its_kind_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A registration's ``module:Class`` is read when an adapter is built: one naming another
    kind's class, or no adapter at all, is refused there, naming it."""
    for wrong in ("car_fl.adapters.adapter:FullAdapter", "car_fl.adapters.config:AdapterConfig"):
        monkeypatch.setitem(ADAPTERS, AdapterKind.LOWRANK, wrong)
        with pytest.raises(TypeError, match=f"{wrong} is no Adapter of kind lowrank"):
            build_adapter(AdapterConfig(kind=AdapterKind.LOWRANK), 8, seed=0)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_starts_as_the_identity(kind: AdapterKind) -> None:
    adapter = build_adapter(AdapterConfig(kind=kind, rank=4, dropout=0.5), 16, seed=0)
    x = torch.randn(3, 5, 16)
    adapter.train()  # dropout is off the map: train mode would scale it
    adapter.eval()
    assert torch.equal(adapter(x), x)
    assert adapter.is_identity() and adapter.at_start()
    assert float(adapter.deviation()) == 0.0
    assert all(p.dtype is torch.float32 for p in adapter.parameters())
    bf16 = x.to(torch.bfloat16)
    assert adapter(bf16).dtype is torch.bfloat16 and torch.equal(adapter(bf16), bf16)


@pytest.mark.parametrize("kind", KINDS)
def test_a_changed_parameter_is_seen_and_the_identity_answer_is_not_stale(
    kind: AdapterKind,
) -> None:
    adapter = build_adapter(AdapterConfig(kind=kind, rank=2), 8, seed=0)
    assert adapter.is_identity()
    with torch.no_grad():
        next(iter(adapter.parameters())).add_(0.1)
    assert not adapter.is_identity()


def test_the_same_seed_builds_the_same_lowrank_adapter_and_another_seed_another() -> None:
    cfg = AdapterConfig(kind=AdapterKind.LOWRANK, rank=4)
    a, b, c = (build_adapter(cfg, 32, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.down, b.down) and not torch.equal(a.down, c.down)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [AdapterKind.FULL, AdapterKind.LOWRANK])
def test_the_anchor_is_the_maps_distance_from_the_identity(kind: AdapterKind) -> None:
    adapter = moved(kind, rank=3)
    eye = torch.eye(adapter.dim, dtype=torch.float64)
    matrix = adapter.affine(eye)  # row i: e_i through the map, i.e. Wᵀ
    want = (matrix - eye).pow(2).sum()
    torch.testing.assert_close(adapter.deviation(), want)


def test_the_diagonal_anchor_is_the_scales_and_shifts_distance_from_the_start() -> None:
    adapter = moved(AdapterKind.DIAGONAL)
    scale, shift = adapter.get_parameter("scale"), adapter.get_parameter("shift")
    want = (scale - 1).pow(2).sum() + shift.pow(2).sum()
    torch.testing.assert_close(adapter.deviation(), want)


@pytest.mark.parametrize("kind", KINDS)
def test_per_example_norms_and_clipped_sum_equal_autograd(kind: AdapterKind) -> None:
    """From the batch's token embeddings x (zero at pads) and the gradient g at the adapter's
    output, each kind's norms and clipped sum equal one autograd pass per example."""
    adapter = moved(kind, rank=3)
    g = torch.Generator().manual_seed(2)
    lengths = [5, 2, 4]
    x = torch.randn(3, 5, adapter.dim, generator=g, dtype=torch.float64)
    up = torch.randn(3, 5, adapter.dim, generator=g, dtype=torch.float64)
    for i, n in enumerate(lengths):
        x[i, n:] = 0.0
        up[i, n:] = 0.0
    factors = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)
    names = [k for k, _ in adapter.named_parameters()]
    want_squares, want_sum = [], {k: torch.zeros_like(p) for k, p in adapter.named_parameters()}
    for i, n in enumerate(lengths):
        out = adapter.affine(x[i, :n])
        grads = torch.autograd.grad(out, list(adapter.parameters()), grad_outputs=up[i, :n])
        want_squares.append(sum(gr.pow(2).sum() for gr in grads))
        for k, gr in zip(names, grads, strict=True):
            want_sum[k] += factors[i] * gr
    torch.testing.assert_close(adapter.example_squares(x, up), torch.stack(want_squares))  # type: ignore[arg-type]
    got = adapter.clipped_sum(factors, x, up)
    assert set(got) == set(names)
    for k in names:
        torch.testing.assert_close(got[k], want_sum[k])


@pytest.mark.parametrize(
    ("kind", "numbers"), [("full", 64 * 64), ("lowrank", 2 * 64 * 4), ("diagonal", 2 * 64)]
)
def test_a_lowrank_adapter_sends_2dr_numbers(kind: str, numbers: int) -> None:
    adapter = build_adapter(AdapterConfig(kind=AdapterKind(kind), rank=4), 64, seed=0)
    assert adapter.sent_numbers() == numbers


def test_settings_refuse_bad_adapter_values_naming_the_key() -> None:
    with pytest.raises(
        ValueError, match=r"adapter\.kind='square' is not valid; choose one of full"
    ):
        AdapterConfig(kind="square")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"adapter\.rank must be an integer >= 1"):
        AdapterConfig(rank=0)
    with pytest.raises(ValueError, match=r"adapter\.anchor .* >= 0"):
        AdapterConfig(anchor=-1.0)
    with pytest.raises(ValueError, match=r"adapter\.anchor"):
        AdapterConfig(anchor=float("nan"))
    with pytest.raises(ValueError, match=r"adapter\.dropout must be in \[0, 1\)"):
        AdapterConfig(dropout=1.0)
    with pytest.raises(ValueError, match=r"adapter\.rank=65 must be in \[1, d=64\]"):
        build_adapter(AdapterConfig(kind=AdapterKind.LOWRANK, rank=65), 64, seed=0)


def test_dropout_acts_on_the_soft_embeddings_while_training_only() -> None:
    adapter = build_adapter(AdapterConfig(dropout=0.5), 8, seed=0)
    x = torch.ones(4, 16, 8)
    torch.manual_seed(0)
    adapter.train()
    out = adapter(x)
    assert set(out.unique().tolist()) == {0.0, 2.0}
    adapter.eval()
    assert torch.equal(adapter(x), x)
