"""make_optimizer: torch.optim's SGD, Adam and AdamW over the trainable parameters, per group."""

from __future__ import annotations

import pytest
import torch

from car_fl.model.retriever import build_retriever
from car_fl.training.train import make_optimizer


@pytest.mark.parametrize(
    ("kind", "cls"),
    [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)],
)
def test_each_kind_is_torch_optim_with_the_run_s_hyperparameters(
    make_settings, kind: str, cls: type
) -> None:
    settings = make_settings(
        "mode=adapter",
        f"train.optimizer={kind}",
        "train.lr=0.02",
        "train.adapter_lr=0.005",
        "train.weight_decay=0.1",
        "train.momentum=0.5",
    )
    model = build_retriever(settings, 3)
    opt = make_optimizer(model, settings.train)
    assert type(opt) is cls
    lrs = sorted(g["lr"] for g in opt.param_groups)
    assert lrs == [0.005, 0.02]
    assert {g["weight_decay"] for g in opt.param_groups} == {0.1}
    if kind == "sgd":
        assert {g["momentum"] for g in opt.param_groups} == {0.5}
    trained = {id(p) for g in opt.param_groups for p in g["params"]}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and not any(id(p) in trained for p in frozen)
    assert trained == {id(p) for p in model.trainable_parameters().values()}
