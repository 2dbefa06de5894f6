"""Optimisers for the few trainable tensors, without ``torch.optim`` 's start-up cost.

``torch.optim`` guards its methods against ``torch.compile``: the first call in a process
imports ``torch._dynamo``, 2.5 to 3.5 seconds on the machines here. A Flower deployment starts
a new ClientApp process for every message, so every round of every client paid it. These
classes implement the same updates as ``torch.optim.SGD`` (momentum, weight decay, no
dampening or Nesterov), ``Adam`` and ``AdamW`` (no AMSGrad) for dense tensors, following
PyTorch's single-tensor code; ``tests/method/test_optim.py`` checks them against
``torch.optim`` step by step.

``torch`` is imported where a step runs, not at the top: a classifier round on cached features
stays quick to import. The names are :class:`~car_fl.settings.schema.OptimizerKind`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from car_fl.settings.schema import OptimizerKind

if TYPE_CHECKING:
    import torch


class Optimizer:
    """``param_groups`` (each ``{"params": [...], "lr": float}``), ``zero_grad`` and ``step``."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        kind: OptimizerKind | str,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if not groups or not any(g["params"] for g in groups):
            raise ValueError("optimizer got an empty parameter list")
        self.kind = OptimizerKind.parse("train.optimizer", kind)
        self.param_groups: list[dict[str, Any]] = [
            {"params": list(g["params"]), "lr": float(g["lr"])} for g in groups
        ]
        self.weight_decay = weight_decay
        self.momentum = momentum
        self.betas = betas
        self.eps = eps
        self.state: dict[int, dict[str, Any]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if self.kind is OptimizerKind.SGD:
                        self._sgd(p, p.grad, group["lr"])
                    else:
                        self._adam(p, p.grad, group["lr"])

    def _sgd(self, p: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        if self.weight_decay:
            grad = grad.add(p, alpha=self.weight_decay)
        if self.momentum:
            state = self.state.setdefault(id(p), {})
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = grad.clone().detach()
            else:
                buf.mul_(self.momentum).add_(grad)
            grad = buf
        p.add_(grad, alpha=-lr)

    def _adam(self, p: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        import torch

        beta1, beta2 = self.betas
        state = self.state.setdefault(id(p), {})
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"]
        if self.weight_decay:
            if self.kind is OptimizerKind.ADAMW:
                p.mul_(1 - lr * self.weight_decay)
            else:
                grad = grad.add(p, alpha=self.weight_decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(self.eps)
        p.addcdiv_(exp_avg, denom, value=-step_size)
