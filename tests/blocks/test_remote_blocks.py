"""Remote blocks compute what local blocks compute: states, and the adapter's gradient."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from car_fl.adapters.adapter import build_adapter
from car_fl.blocks.compute import BlocksHandler
from car_fl.model.encoder import Encoder, EncoderLoadError, load_encoder
from car_fl.settings.schema import AdapterConfig, AdapterKind
from tests.blocks.conftest import URL, model_cfg

TEXTS = ["free prize call now", "hello", "see you later at home ok", "w1 w2 w3 w4 w5 w6 w7 k3"]


def pair(folder: Path, padding_side: str = "right") -> tuple[Encoder, Encoder]:
    local = load_encoder(model_cfg(folder, padding_side=padding_side), device="cpu")
    remote = load_encoder(
        model_cfg(folder, padding_side=padding_side, blocks="remote", blocks_service=URL),
        device="cpu",
    )
    return local, remote


@pytest.mark.parametrize("side", ["right", "left"])
def test_forward_states_equal_local_blocks(
    normed_llama: Path, service: BlocksHandler, side: str
) -> None:
    local, remote = pair(normed_llama, side)
    assert remote.blocks is not None and len(remote.model.layers) == 0
    ids, mask = local.pad(local.tokenize(TEXTS).input_ids)
    want = local.pool(local.transform(local.embed(ids), mask), mask)
    got = remote.pool(remote.transform(remote.embed(ids), mask), mask)
    assert (got - want).abs().max().item() <= 1e-5
    assert service.served == 1


def test_node_holds_no_block(normed_llama: Path, service: BlocksHandler) -> None:
    local, remote = pair(normed_llama)
    held = {n for n, _ in remote.model.named_parameters()}
    assert held == {"embed_tokens.weight", "norm.weight"}
    assert sum(p.numel() for p in remote.model.parameters()) < sum(
        p.numel() for p in local.model.parameters()
    )


@pytest.mark.parametrize("kind", list(AdapterKind))
def test_adapter_gradient_through_remote_blocks_equals_local(
    normed_llama: Path, service: BlocksHandler, kind: AdapterKind
) -> None:
    """Every adapter kind trains through remote blocks as through local ones."""
    local, remote = pair(normed_llama)
    ids, mask = local.pad(local.tokenize(TEXTS).input_ids)
    grads = []
    for encoder in (local, remote):
        adapter = build_adapter(AdapterConfig(kind=kind, rank=4), encoder.hidden_size, seed=0)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in adapter.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        pooled = encoder.pool(encoder.transform(adapter(encoder.embed(ids)), mask), mask)
        (pooled.square().sum() + pooled[:, 0].sum()).backward()
        assert all(p.grad is not None for p in adapter.parameters())
        grads.append(torch.cat([p.grad.flatten() for p in adapter.parameters()]))  # type: ignore[union-attr]
    want, got = grads
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    assert cosine >= 0.9999
    assert ((got - want).norm() / want.norm()).item() <= 1e-4


def test_a_request_alone_equals_it_batched_with_others(
    normed_llama: Path, service: BlocksHandler
) -> None:
    """Rows never mix: a request's states do not depend on the requests it shares a batch with,
    whatever their widths and padding sides."""
    from car_fl.blocks.wire import Request

    local = load_encoder(model_cfg(normed_llama), device="cpu")
    requests = []
    for texts, side in ((TEXTS[:2], "right"), (TEXTS[2:], "left"), (TEXTS[1:3], "right")):
        local.cfg.padding_side = side
        ids, mask = local.pad(local.tokenize(texts).input_ids)
        requests.append(Request(local.embed(ids), mask, None, ""))
    together = service.runner.forward(requests)
    for request, batched in zip(requests, together, strict=True):
        (alone,) = service.runner.forward([request])
        real = request.mask.bool()
        assert (batched[real] - alone[real]).abs().max().item() <= 1e-5


def test_no_service_named_refuses_before_anything_is_sent(normed_llama: Path) -> None:
    with pytest.raises(EncoderLoadError, match="no blocks service is named"):
        load_encoder(model_cfg(normed_llama, blocks="remote"), device="cpu")


def test_this_machines_environment_names_the_service_where_the_settings_do_not(
    normed_llama: Path, service: BlocksHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server of a simulation (model.blocks=remote in the run, no address in any setting)
    finds the service its owner's environment names, as the simulated nodes do."""
    monkeypatch.setenv("CAR_FL_BLOCKS_SERVICE", URL)
    remote = load_encoder(model_cfg(normed_llama, blocks="remote"), device="cpu")
    assert remote.blocks is not None and remote.blocks.client.url == URL


def test_a_service_holding_another_model_is_refused(
    normed_llama: Path, tiny_llama: Path, service: BlocksHandler
) -> None:
    with pytest.raises(EncoderLoadError, match="not this node's"):
        load_encoder(model_cfg(tiny_llama, blocks="remote", blocks_service=URL), device="cpu")
    assert service.served == 0


def test_an_intermediate_layer_is_refused_with_remote_blocks(normed_llama: Path) -> None:
    with pytest.raises(EncoderLoadError, match=r"model\.layer=1"):
        load_encoder(
            model_cfg(normed_llama, blocks="remote", blocks_service=URL, layer=1), device="cpu"
        )


def test_the_feature_cache_names_the_services_weights(
    normed_llama: Path, service: BlocksHandler
) -> None:
    from car_fl.blocks.client import IN_PROCESS
    from car_fl.blocks.compute import BlocksHandler as Handler
    from car_fl.blocks.compute import BlocksRunner
    from car_fl.model.feature_cache import space_key

    local = model_cfg(normed_llama)
    remote = model_cfg(normed_llama, blocks="remote", blocks_service=URL)
    first = space_key(remote, device="cpu")
    assert first != space_key(local, device="cpu")
    identity = dataclasses.replace(service.runner.identity, weights="another-digest")
    IN_PROCESS[URL] = Handler(BlocksRunner(service.runner.model, identity)).handle
    assert space_key(remote, device="cpu") != first  # other blocks: other features
