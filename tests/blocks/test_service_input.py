"""The service refuses what is malformed, oversized, unauthorised or for another model, with a
status and a message naming the field, and keeps serving the others."""

from __future__ import annotations

import json
import struct
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save

from car_fl.blocks.compute import (
    BACKWARD,
    FORWARD,
    HEALTH,
    BlocksHandler,
    BlocksRunner,
    batches,
)
from car_fl.blocks.wire import (
    Limits,
    Request,
    WireError,
    read_reply,
    read_request,
    write_reply,
    write_request,
)


def good(handler: BlocksHandler, rows: int = 2, seq: int = 5, **kw: object) -> bytes:
    hidden = handler.runner.identity.hidden
    return write_request(
        torch.randn(rows, seq, hidden),
        torch.ones(rows, seq, dtype=torch.long),
        fingerprint=handler.runner.identity.fingerprint,
        **kw,  # type: ignore[arg-type]
    )


def error(answer: object) -> str:
    return str(json.loads(answer.body)["error"])  # type: ignore[attr-defined]


def test_health_reports_model_fingerprint_dtype_and_limits(service: BlocksHandler) -> None:
    info = json.loads(service.handle(HEALTH, b"", {}).body)
    assert info["fingerprint"] == service.runner.identity.fingerprint
    assert info["dtype"] == "float32" and info["norm_on_node"] is True
    assert info["max_tokens"] == Limits().max_tokens and info["replicas"] == 1


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"", 400, "shorter than its 8-byte header"),
        (b"\xff" * 64, 400, "header length runs past"),
        (b"\x04\x00\x00\x00\x00\x00\x00\x00nope", 400, "not JSON"),
        (save({"embeds": torch.zeros(1, 2, 3)}), 400, "takes exactly"),
    ],
)
def test_malformed_bodies_get_400_naming_what(
    service: BlocksHandler, body: bytes, status: int, says: str
) -> None:
    answer = service.handle(FORWARD, bytes(body), {})
    assert answer.status == status and says in error(answer)


def raw(header: object, data: bytes = b"") -> bytes:
    """A body with this header (any JSON text or value) and these data bytes."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype: object = "F32", shape: object = (1, 2, 64), offsets: object = (0, 512)) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def mask_entry(offset: int = 512) -> dict:
    return entry("U8", [1, 2], [offset, offset + 2])


FORGED = {
    "dtype is a list": {"embeds": entry(dtype=["F32"]), "mask": mask_entry()},
    "shape is an int": {"embeds": entry(shape=3), "mask": mask_entry()},
    "shape holds NaN": {"embeds": entry(shape=[1, float("nan"), 64]), "mask": mask_entry()},
    "shape holds a bool": {"embeds": entry(shape=[True, 2, 64]), "mask": mask_entry()},
    "shape is negative": {"embeds": entry(shape=[-1, 2, 64]), "mask": mask_entry()},
    "shape has 1,000 dims": {"embeds": entry(shape=[1] * 1000), "mask": mask_entry()},
    "offsets are strings": {"embeds": entry(offsets=["0", "64"]), "mask": mask_entry()},
    "entry has more keys": {"embeds": {**entry(), "extra": 1}, "mask": mask_entry()},
    "metadata is a list": {"__metadata__": ["x"], "embeds": entry(), "mask": mask_entry()},
    "metadata holds a number": {"__metadata__": {"fingerprint": 5}, "embeds": entry()},
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "offsets past the data": {"embeds": entry(offsets=[0, 10**9]), "mask": mask_entry()},
}


@pytest.mark.parametrize("header", FORGED.values(), ids=FORGED.keys())
def test_a_forged_header_is_a_400_never_a_500(service: BlocksHandler, header: object) -> None:
    body = raw(header, b"\x00" * 514)  # the tiny Llama: hidden 64
    answer = service.handle(FORWARD, body, {})
    assert answer.status == 400, error(answer)
    assert "not safetensors" in error(answer) or "not valid safetensors" in error(answer)
    assert len(answer.body) < 300  # names what, never echoes it


def test_a_forged_reply_is_refused_by_the_node() -> None:
    good_reply = write_reply("states", torch.zeros(1, 2, 8))
    assert read_reply(good_reply, "states", (1, 2, 8)).shape == (1, 2, 8)
    forged = {
        "another shape": raw({"states": entry(shape=[1, 2, 9], offsets=[0, 72])}, b"\0" * 72),
        "an integer tensor": write_reply("states", torch.zeros(1, 2, 8, dtype=torch.int32)),
        "another name": write_reply("grad", torch.zeros(1, 2, 8)),
        "a header past its data": raw(
            {"states": entry(shape=[1, 2, 8], offsets=[0, 64])}, b"\0" * 8
        ),
        "non-finite": write_reply("states", torch.full((1, 2, 8), float("inf"))),
    }
    for what, body in forged.items():
        with pytest.raises(WireError):
            read_reply(body, "states", (1, 2, 8))
        assert what


def test_wrong_shapes_values_and_sizes_are_refused(service: BlocksHandler) -> None:
    hidden = service.runner.identity.hidden
    fp = service.runner.identity.fingerprint
    cases = {
        "must have shape (rows, seq,": write_request(
            torch.zeros(1, 3, hidden + 1), torch.ones(1, 3), fingerprint=fp
        ),
        "values other than 0 and 1": write_request(
            torch.zeros(1, 3, hidden), torch.full((1, 3), 2), fingerprint=fp
        ),
        "no real token": write_request(
            torch.zeros(2, 3, hidden), torch.tensor([[1, 1, 1], [0, 0, 0]]), fingerprint=fp
        ),
        "NaN or infinite": write_request(
            torch.full((1, 3, hidden), float("nan")), torch.ones(1, 3), fingerprint=fp
        ),
        "above this service's limits": write_request(
            torch.zeros(65, 2, hidden), torch.ones(65, 2), fingerprint=fp
        ),
    }
    for says, body in cases.items():
        answer = service.handle(FORWARD, body, {})
        assert answer.status == 400, says
        assert says in error(answer)
    assert service.handle(FORWARD, good(service), {}).status == 200  # still serving


def test_a_backward_needs_its_gradient_of_the_right_shape(service: BlocksHandler) -> None:
    answer = service.handle(BACKWARD, good(service), {})
    assert answer.status == 400 and "takes exactly" in error(answer)
    hidden = service.runner.identity.hidden
    ok = good(service, grad=torch.randn(2, 5, hidden))
    assert service.handle(BACKWARD, ok, {}).status == 200


def test_another_models_request_gets_409_without_its_fingerprint_echoed(
    service: BlocksHandler,
) -> None:
    hidden = service.runner.identity.hidden
    body = write_request(torch.zeros(1, 2, hidden), torch.ones(1, 2), fingerprint="<script>x")
    answer = service.handle(FORWARD, body, {})
    assert answer.status == 409 and "this service holds" in error(answer)
    assert "script" not in error(answer)


def test_a_token_is_required_when_set(service: BlocksHandler) -> None:
    guarded = BlocksHandler(service.runner, token="s3cret")
    assert guarded.handle(FORWARD, good(service), {}).status == 401
    assert guarded.handle(HEALTH, b"", {"Authorization": "Bearer wrong"}).status == 401
    answer = guarded.handle(FORWARD, good(service), {"Authorization": "Bearer s3cret"})
    assert answer.status == 200


def test_an_unknown_operation_gets_404(service: BlocksHandler) -> None:
    assert service.handle("/shutdown", b"", {}).status == 404


def test_an_oversized_body_is_refused_before_it_is_read(service: BlocksHandler) -> None:
    small = BlocksHandler(
        BlocksRunner(
            service.runner.model,
            type(service.runner.identity)(
                **{**service.runner.identity.__dict__, "limits": Limits(max_tokens=4)}
            ),
        )
    )
    answer = small.handle(FORWARD, b"\x00" * 10_000_000, {})
    assert answer.status == 413


def test_the_headers_alone_refuse_a_wrong_token_or_a_declared_oversize(
    service: BlocksHandler,
) -> None:
    guarded = BlocksHandler(service.runner, token="s3cret")
    assert guarded.admit(FORWARD, {"Content-Length": "10"}).status == 401  # type: ignore[union-attr]
    big = str(guarded.max_body + 1)
    auth = {"Authorization": "Bearer s3cret"}
    assert guarded.admit(FORWARD, {**auth, "Content-Length": big}).status == 413  # type: ignore[union-attr]
    assert guarded.admit(FORWARD, {**auth, "Content-Length": "-5"}).status == 400  # type: ignore[union-attr]
    assert guarded.admit("/other", auth).status == 404  # type: ignore[union-attr]
    assert guarded.admit(FORWARD, {**auth, "Content-Length": "1000"}) is None


def request_of(rows: int, seq: int, hidden: int) -> Request:
    body = write_request(torch.randn(rows, seq, hidden), torch.ones(rows, seq), fingerprint="f")
    return read_request(body, hidden=hidden, limits=Limits(), backward=False)[0]


def test_a_wide_request_never_inflates_narrow_ones_past_max_tokens(
    service: BlocksHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = service.runner.identity
    small = BlocksHandler(
        BlocksRunner(service.runner.model, replace(identity, limits=Limits(max_tokens=64)))
    )
    hidden = identity.hidden
    narrow = [request_of(8, 8, hidden) for _ in range(7)]
    requests = [narrow[0], request_of(1, 64, hidden), *narrow[1:]]  # merged: 57 rows × 64
    groups = batches(requests, max_tokens=64)
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert len(batches(narrow, max_tokens=448)) == 1  # narrow ones still share a batch
    seen: list[int] = []
    forward = small.runner.forward

    def recording(batch: list[Request]) -> list[torch.Tensor]:
        seen.append(sum(int(r.mask.shape[0]) for r in batch) * max(r.mask.shape[1] for r in batch))
        return forward(batch)

    monkeypatch.setattr(small.runner, "forward", recording)
    together = small.run(FORWARD, requests)
    assert seen and max(seen) <= 64  # rows × the widest, as merge pads
    for answer, request in zip(together, requests, strict=True):
        [alone] = small.run(FORWARD, [request])
        shape = tuple(request.embeds.shape)
        got, want = (
            read_reply(answer.body, "states", shape),
            read_reply(alone.body, "states", shape),
        )
        assert torch.allclose(got, want, atol=1e-5)  # in its own order, as if alone
