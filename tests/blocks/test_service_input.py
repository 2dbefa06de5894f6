"""The service refuses what is malformed, oversized, unauthorised or for another model, with a
status and a message naming the field, and keeps serving the others."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

from car_fl.blocks.compute import BACKWARD, FORWARD, HEALTH, BlocksHandler, BlocksRunner
from car_fl.blocks.wire import Limits, write_request


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


def test_wrong_shapes_values_and_sizes_are_refused(service: BlocksHandler) -> None:
    hidden = service.runner.identity.hidden
    fp = service.runner.identity.fingerprint
    cases = {
        "expected (rows, seq,": write_request(
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


def test_another_models_request_gets_409(service: BlocksHandler) -> None:
    hidden = service.runner.identity.hidden
    body = write_request(torch.zeros(1, 2, hidden), torch.ones(1, 2), fingerprint="0" * 16)
    answer = service.handle(FORWARD, body, {})
    assert answer.status == 409 and "this service holds" in error(answer)


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
