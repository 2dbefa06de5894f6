"""The blocks service on a real Ray Serve application, started as ``car-fl serve-blocks``.

One service for the whole module (a start costs ~25 s on 2 cores): equal to local blocks over
HTTP with a token, many nodes' requests at once, bad input answered while it keeps serving, a
stop that leaves no process, and a node that fails while it is down and works once it is back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from car_fl.blocks.client import BlocksClient, BlocksUnavailable, Retry
from car_fl.model.encoder import EncoderLoadError, load_encoder
from tests.blocks.conftest import model_cfg
from tests.serving.processes import ServingProcess

pytestmark = pytest.mark.slow
TOKEN = "a-shared-token"
TEXTS = ["free prize call now", "hello", "see you later at home ok", "w1 w2 w3 k3"]


@pytest.fixture(scope="module")
def running(
    normed_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServingProcess]:
    command = ["serve-blocks", f"model.name_or_path={normed_llama}", "model.dtype=float32"]
    tmp = tmp_path_factory.mktemp("blocks-service")
    service = ServingProcess([*command, "device=cpu"], tmp, token=TOKEN, route="/blocks")
    service.start()
    yield service
    service.end()


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CAR_FL_BLOCKS_TOKEN", TOKEN)


def test_over_http_states_and_gradients_equal_local_blocks(
    running: ServingProcess, normed_llama: Path, token: None
) -> None:
    local = load_encoder(model_cfg(normed_llama), device="cpu")
    remote = load_encoder(
        model_cfg(normed_llama, blocks="remote", blocks_service=running.url), device="cpu"
    )
    ids, mask = local.pad(local.tokenize(TEXTS).input_ids)
    out = []
    for encoder in (local, remote):
        embeds = encoder.embed(ids).detach().requires_grad_(True)
        pooled = encoder.pool(encoder.transform(embeds, mask), mask)
        pooled.square().sum().backward()
        out.append((pooled.detach(), embeds.grad))
    (want, want_grad), (got, got_grad) = out
    assert (got - want).abs().max().item() <= 1e-5
    assert got_grad is not None and want_grad is not None
    assert (
        torch.nn.functional.cosine_similarity(got_grad.flatten(), want_grad.flatten(), 0) > 0.9999
    )


def test_many_nodes_at_once_each_get_their_own_rows(
    running: ServingProcess, normed_llama: Path, token: None
) -> None:
    local = load_encoder(model_cfg(normed_llama), device="cpu")
    remote_cfg = model_cfg(normed_llama, blocks="remote", blocks_service=running.url)
    nodes = [load_encoder(remote_cfg, device="cpu") for _ in range(4)]

    def one(i: int) -> float:
        texts = [TEXTS[(i + j) % len(TEXTS)] for j in range(3)]
        ids, mask = local.pad(local.tokenize(texts).input_ids)
        want = local.transform(local.embed(ids), mask)
        worst = 0.0
        for _ in range(5):
            got = nodes[i].transform(nodes[i].embed(ids), mask)
            worst = max(worst, (got - want)[mask.bool()].abs().max().item())
        return worst

    with ThreadPoolExecutor(4) as pool:
        assert max(pool.map(one, range(4))) <= 1e-5


def test_a_wrong_token_is_refused_and_bad_input_leaves_it_serving(
    running: ServingProcess, normed_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CAR_FL_BLOCKS_TOKEN", "not-the-token")
    cfg = model_cfg(normed_llama, blocks="remote", blocks_service=running.url)
    with pytest.raises(EncoderLoadError, match="401"):
        load_encoder(cfg, device="cpu")
    client = BlocksClient(running.url, token=TOKEN, retry=Retry(attempts=1))
    answer = client.transport("/forward", b"not safetensors at all", client._headers())
    assert answer.status == 400 and b"not safetensors" in answer.body
    health = client.health()  # still serving, and says how fast it computes
    assert health["fingerprint"] and health["forward_s_per_ktoken"] > 0
    assert health["backward_s_per_ktoken"] > 0


def test_stopped_it_leaves_nothing_the_node_fails_then_works_when_it_is_back(
    running: ServingProcess, normed_llama: Path, token: None
) -> None:
    remote = load_encoder(
        model_cfg(normed_llama, blocks="remote", blocks_service=running.url), device="cpu"
    )
    assert remote.blocks is not None
    remote.blocks.client.retry = Retry(timeout_s=5.0, attempts=2, backoff_s=0.1)
    ids, mask = remote.pad(remote.tokenize(TEXTS).input_ids)
    before = remote.transform(remote.embed(ids), mask)
    assert running.stop() == []  # nothing of Ray or Serve outlives the command
    with pytest.raises(BlocksUnavailable, match=f"127.0.0.1:{running.port}"):
        remote.transform(remote.embed(ids), mask)
    running.start()
    after = remote.transform(remote.embed(ids), mask)
    assert (after - before).abs().max().item() <= 1e-6
    assert os.path.exists(running.tmp / "service.log")
