"""Deadlines that scale with the work, requests cut to them, and retries that never compute
twice: the node's client and the service's :class:`Deduplicator`, as a slow service meets them."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from car_fl.blocks.client import SLACK, BlocksClient, Retry
from car_fl.blocks.compute import BACKWARD, FORWARD, Answer, BlocksHandler
from car_fl.blocks.dedupe import Deduplicator
from car_fl.testing.tiny import tiny_overrides

RETRY = Retry(timeout_s=8.0, attempts=3, backoff_s=0.0)


class Recording:
    """A transport that times out the first ``failures`` forwards, keeping every header sent."""

    def __init__(self, handler: BlocksHandler, failures: int = 0) -> None:
        self.handler, self.failures = handler, failures
        self.sent: list[dict[str, str]] = []

    def __call__(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        if path != "/health":
            self.sent.append(dict(headers))
            if len(self.sent) <= self.failures:
                raise TimeoutError("the reply took longer than its deadline")
        return self.handler.handle(path, body, headers)


def forward(client: BlocksClient, handler: BlocksHandler, rows: int, seq: int) -> torch.Tensor:
    hidden = handler.runner.identity.hidden
    return client.forward(
        torch.randn(rows, seq, hidden),
        torch.ones(rows, seq),
        fingerprint=handler.runner.identity.fingerprint,
    )


def test_the_service_reports_the_speed_it_measured(service: BlocksHandler) -> None:
    assert service.runner.identity.as_dict()["forward_s_per_ktoken"] is None  # nothing run yet
    service.warm_up()
    health = service.runner.identity.as_dict()
    assert health["forward_s_per_ktoken"] > 0 and health["backward_s_per_ktoken"] > 0
    assert service.served == 0


def test_a_request_is_cut_to_what_the_service_computes_in_a_quarter_of_the_timeout(
    service: BlocksHandler,
) -> None:
    service.runner.identity.speed.recent[FORWARD][:] = [10.0]  # 10 s per 1,000 tokens
    transport = Recording(service)
    client = BlocksClient("http://x", retry=RETRY, transport=transport)
    states = forward(client, service, rows=5, seq=100)
    assert states.shape[0] == 5
    # 8 s / 4 at 10 s per 1,000 tokens: 200 tokens, 2 rows of 100 a request
    assert len(transport.sent) == 3
    assert client.deadlines == pytest.approx([8 + SLACK * 2.0, 8 + SLACK * 2.0, 8 + SLACK * 1.0])


def test_without_a_believable_speed_the_deadline_is_the_timeout(service: BlocksHandler) -> None:
    for lie in (float("nan"), -1.0, 0.0, 1e9, True, "fast"):
        service.runner.identity.speed.recent[FORWARD][:] = []
        client = BlocksClient("http://x", retry=RETRY, transport=Recording(service))
        client.health()
        assert client.health_info is not None
        client.health_info["forward_s_per_ktoken"] = lie
        forward(client, service, rows=64, seq=4)
        assert client.deadlines == [8.0], lie


def test_every_attempt_of_a_request_carries_its_one_key_and_requests_differ(
    service: BlocksHandler,
) -> None:
    transport = Recording(service, failures=2)
    client = BlocksClient("http://x", retry=RETRY, transport=transport)
    forward(client, service, rows=2, seq=3)
    forward(client, service, rows=2, seq=3)
    keys = [headers["idempotency-key"] for headers in transport.sent]
    assert len(keys) == 4 and len(set(keys[:3])) == 1 and keys[3] != keys[0]
    assert len(keys[0]) == 32 and int(keys[0], 16) >= 0


def test_a_service_down_names_the_time_spent_and_the_setting_to_fix() -> None:
    def refused(path: str, body: bytes, headers: dict[str, str]) -> Answer:
        raise ConnectionRefusedError(111, "Connection refused")

    client = BlocksClient("http://10.9.8.7:8200/blocks", retry=RETRY, transport=refused)
    with pytest.raises(Exception, match=r"3 attempts over 0\.\d s \(each allowed 8 s\)") as err:
        client.health()
    assert "model.blocks_service" in str(err.value) and "120 s" not in str(err.value)


class Slow:
    """A computation that takes until it is released, counting its runs."""

    def __init__(self) -> None:
        self.runs = 0
        self.release = asyncio.Event()

    async def __call__(self) -> Answer:
        self.runs += 1
        await self.release.wait()
        return Answer(200, b"states-%d" % self.runs)


def test_a_retry_while_the_first_run_computes_waits_for_it_and_is_never_computed_again() -> None:
    async def scenario() -> None:
        dedupe, slow = Deduplicator(), Slow()
        first = asyncio.create_task(dedupe.answer("k1", b"body", slow))
        await asyncio.sleep(0.01)
        first.cancel()  # the node gave up waiting: its connection is gone
        retry = asyncio.create_task(dedupe.answer("k1", b"body", slow))
        await asyncio.sleep(0.01)
        slow.release.set()
        assert (await retry).body == b"states-1"
        assert (await dedupe.answer("k1", b"body", slow)).body == b"states-1"  # kept
        assert slow.runs == 1

    asyncio.run(scenario())


def test_a_key_with_another_body_or_no_key_computes_its_own() -> None:
    async def scenario() -> None:
        dedupe, slow = Deduplicator(), Slow()
        slow.release.set()
        assert (await dedupe.answer("k1", b"a", slow)).body == b"states-1"
        assert (await dedupe.answer("k1", b"b", slow)).body == b"states-2"  # not a's answer
        assert (await dedupe.answer(None, b"a", slow)).body == b"states-3"
        assert (await dedupe.answer("x" * 65, b"a", slow)).body == b"states-4"
        assert slow.runs == 4

    asyncio.run(scenario())


def test_what_it_keeps_is_bounded_in_answers_and_bytes() -> None:
    async def scenario() -> None:
        dedupe = Deduplicator(keep=3, keep_bytes=20)

        async def big() -> Answer:
            return Answer(200, b"x" * 8)

        for i in range(6):
            await dedupe.answer(f"k{i}", b"a", big)
        assert len(dedupe.done) == 2 and dedupe._kept() <= 20

        async def refused() -> Answer:
            return Answer.error(409, "another model")

        await dedupe.answer("k9", b"a", refused)
        assert all(key != "k9" for key, _ in dedupe.done) and len(dedupe.done) == 2

    asyncio.run(scenario())


def test_backward_requests_are_cut_by_the_backward_speed(service: BlocksHandler) -> None:
    speed = service.runner.identity.speed.recent
    speed[FORWARD][:], speed[BACKWARD][:] = [0.001], [20.0]
    transport = Recording(service)
    client = BlocksClient("http://x", retry=RETRY, transport=transport)
    hidden = service.runner.identity.hidden
    grad = client.backward(
        torch.randn(4, 50, hidden),
        torch.ones(4, 50),
        torch.randn(4, 50, hidden),
        fingerprint=service.runner.identity.fingerprint,
    )
    assert grad.shape[0] == 4 and len(transport.sent) == 2  # 100 tokens a request


@pytest.mark.slow
def test_car_fl_train_with_no_service_says_why_within_a_few_lines(
    normed_llama: Path, synthetic_tsv: Path, tmp_path: Path
) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    overrides = [
        *tiny_overrides(normed_llama, synthetic_tsv, cache_dir=tmp_path / "cache"),
        "model.blocks=remote",
        f"model.blocks_service=http://127.0.0.1:{port}/blocks",
        f"output_dir={tmp_path / 'run'}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "car_fl.cli", "train", *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1 and len(lines) <= 10, "\n".join(lines)
    assert lines[-1].startswith("car-fl train: the blocks service at http://127.0.0.1:")
    assert "model.blocks_service" in lines[-1] and "120 s each" not in lines[-1]
