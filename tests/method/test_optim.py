"""car-fl's optimisers make the same updates as torch.optim, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from car_fl.method.optim import Optimizer

CASES = [
    ("sgd", dict(), dict()),
    ("sgd", dict(momentum=0.9, weight_decay=0.01), dict(momentum=0.9, weight_decay=0.01)),
    ("adam", dict(), dict()),
    ("adam", dict(weight_decay=0.1), dict(weight_decay=0.1)),
    ("adamw", dict(), dict(weight_decay=0.0)),
    ("adamw", dict(weight_decay=0.05), dict(weight_decay=0.05)),
]
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@pytest.mark.parametrize(("kind", "ours_kw", "torch_kw"), CASES)
def test_updates_match_torch_optim_step_by_step(kind: str, ours_kw: dict, torch_kw: dict) -> None:
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(3)]
    a = [torch.nn.Parameter(t.clone()) for t in start]
    b = [torch.nn.Parameter(t.clone()) for t in start]
    groups_a = [{"params": a[:1], "lr": 0.01}, {"params": a[1:], "lr": 0.05}]
    groups_b = [{"params": b[:1], "lr": 0.01}, {"params": b[1:], "lr": 0.05}]
    ours = Optimizer(groups_a, kind=kind, **ours_kw)
    reference = TORCH[kind](groups_b, lr=0.01, **torch_kw)
    x = torch.randn(8, 5)
    for _ in range(25):
        for params, opt in ((a, ours), (b, reference)):
            opt.zero_grad(set_to_none=True)
            loss = ((x @ params[0] + params[1]).tanh() ** 2).sum()
            loss.backward()
            opt.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        assert not torch.equal(p, torch.zeros_like(p))


def test_parameters_without_gradient_are_left_alone() -> None:
    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = Optimizer([{"params": [p, q], "lr": 0.1}], kind="adamw")
    p.sum().backward()
    opt.step()
    assert torch.equal(q, torch.ones(2)) and not torch.equal(p, torch.ones(2))


def test_bad_optimizer_and_empty_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="not valid; choose one of sgd, adam, adamw"):
        Optimizer([{"params": [torch.nn.Parameter(torch.ones(1))], "lr": 0.1}], kind="lbfgs")
    with pytest.raises(ValueError, match="empty parameter list"):
        Optimizer([{"params": [], "lr": 0.1}], kind="sgd")


@pytest.mark.slow
def test_a_training_step_does_not_import_torch_dynamo() -> None:
    code = (
        "import sys, torch\n"
        "from car_fl.method.optim import Optimizer\n"
        "p = torch.nn.Parameter(torch.ones(3))\n"
        "opt = Optimizer([{'params': [p], 'lr': 0.1}], kind='adamw')\n"
        "(p * 2).sum().backward(); opt.step(); opt.zero_grad()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
