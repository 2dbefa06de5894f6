"""The soft-embedding adapter ADP: a trainable d×d matrix between TKN and TRF.

``TRF(ADP(TKN(x)))``: token embeddings ``(batch, seq, d)`` are multiplied by ``W`` (d×d,
initialised to the identity, no bias), so that an untrained adapter leaves the frozen model's
hidden states exactly unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


class SoftEmbeddingAdapter(nn.Module):
    """``x ↦ x Wᵀ`` on the last dimension; ``W`` starts as the d×d identity.

    The weight is kept in float32 (it is trained); inputs of another dtype are computed in
    float32 and cast back, so a bf16/fp16 encoder sees its own dtype.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"adapter dimension must be >= 1, got {dim}")
        self.weight = nn.Parameter(torch.eye(dim, dtype=torch.float32))
        self._identity: tuple[tuple[int, int], bool] | None = None

    @property
    def dim(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, d)`` → ``(batch, seq, d)``."""
        out = embeddings.to(self.weight.dtype) @ self.weight.T
        return out.to(embeddings.dtype)

    def is_identity(self) -> bool:
        """Whether ``W`` is exactly the identity. Asked at every scoring step; answered again
        only after ``W`` changed (an optimiser step or a load bumps its version), since a
        d×d comparison costs milliseconds at TinyLlama's d = 2048."""
        weight = self.weight.detach()
        try:
            key = (self.weight._version, weight.data_ptr())
        except RuntimeError:  # a torch.func transform's tensor: no storage to key an answer on
            eye = torch.eye(self.dim, dtype=weight.dtype, device=weight.device)
            return bool(torch.equal(weight, eye))
        if self._identity is None or self._identity[0] != key:
            exact = bool(weight.diagonal().eq(1).all()) and int(weight.count_nonzero()) == self.dim
            self._identity = (key, exact)
        return self._identity[1]
