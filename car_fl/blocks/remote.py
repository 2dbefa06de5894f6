"""The remote blocks as one autograd module: a forward over the wire, and its backward too.

The backward sends the states' gradient and gets the soft embeddings' back, row by row, so
per-example clipping uses it unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from car_fl.blocks.client import BlocksClient


class _Blocks(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, embeds: torch.Tensor, mask: torch.Tensor, link: RemoteBlocks
    ) -> torch.Tensor:
        states = link.client.forward(embeds, mask, fingerprint=link.fingerprint)
        ctx.link = link
        ctx.save_for_backward(embeds, mask)
        return states.to(device=embeds.device, dtype=embeds.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        embeds, mask = ctx.saved_tensors
        link: RemoteBlocks = ctx.link
        result = link.client.backward(embeds, mask, grad, fingerprint=link.fingerprint)
        return result.to(device=embeds.device, dtype=embeds.dtype), None, None


class RemoteBlocks(nn.Module):
    """The frozen blocks of the model ``fingerprint`` names, on the service ``client`` reaches."""

    def __init__(self, client: BlocksClient, fingerprint: str) -> None:
        super().__init__()
        self.client = client
        self.fingerprint = fingerprint

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        states: torch.Tensor = _Blocks.apply(embeds, mask, self)
        return states
