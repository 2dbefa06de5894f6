"""Record-level DP-SGD through remote blocks: the per-example clipped sum of local blocks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from car_fl.blocks.compute import BlocksHandler
from car_fl.privacy.ghost import ghost_clipped_sum, supports_ghost
from tests.blocks.conftest import URL
from tests.privacy.test_ghost import adapter_model, loop_reference


def test_ghost_clipping_through_remote_blocks_equals_the_local_definition(
    make_settings: Any, normed_llama: Path, service: BlocksHandler
) -> None:
    def make(*overrides: str) -> Any:
        return make_settings(*overrides, model_dir=normed_llama)

    local, params, ids, labels = adapter_model(make, dtype=torch.float32)
    remote, _, _, _ = adapter_model(
        make, "model.blocks=remote", f"model.blocks_service={URL}", dtype=torch.float32
    )
    assert remote.encoder.blocks is not None and supports_ghost(remote, params)
    _, _, _, norms = loop_reference(local, params, ids, labels, math.inf)
    clip = float(norms.median())  # some examples clipped, some not
    want, want_losses, _, _ = loop_reference(local, params, ids, labels, clip)
    got, got_losses, _ = ghost_clipped_sum(remote, params, labels, ids, clip=clip, chunk=4)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-6)
    assert service.served > 0
