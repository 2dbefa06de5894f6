"""Builders shared by tests: Flower messages outside a run, a client's DP mechanism, a server's
first global state, a script of scripts/ loaded as a module."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from car_fl.client import round as client_module
from car_fl.client.local_dp import ClientPrivacy
from car_fl.model.retriever import build_retriever
from car_fl.protocol.messages import encode
from car_fl.settings.schema import DPConfig, Mode, Settings


def first_global_state(settings: Settings, labels: int) -> dict[str, torch.Tensor]:
    """What a server sends in round 1: a fresh head over ``labels`` and, when the adapter
    trains, the identity adapter (sized by the node's cached encoder; the tiny models' 64
    otherwise)."""
    if settings.train.mode is Mode.CLASSIFIER:
        return build_retriever(settings, labels, hidden_size=64).trainable_state_dict()
    encoder = client_module.cached_encoder(settings)
    return build_retriever(settings, labels, encoder=encoder).trainable_state_dict()


def set_task_identity() -> None:
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 0


def reply(
    node: int,
    arrays: Mapping[str, np.ndarray[Any, Any] | Array],
    num_examples: object,
    **metrics: float,
) -> Message:
    """A train reply from ``node`` carrying ``arrays`` (car-fl's wire format unless already
    ``Array`` s) and ``num-examples``."""
    set_task_identity()
    instruction = Message(content=RecordDict(), dst_node_id=node, message_type="train")
    wire = {k: v if isinstance(v, Array) else encode(v) for k, v in arrays.items()}
    content = RecordDict(
        {
            "arrays": ArrayRecord(array_dict=wire),
            "metrics": MetricRecord({"num-examples": num_examples, **metrics}),  # type: ignore[dict-item]
        }
    )
    return Message(content=content, reply_to=instruction)


def client_privacy(
    mode: str, *, clients: int = 2, generator: torch.Generator | None = None, **kw: object
) -> ClientPrivacy:
    """A client's local DP mechanism with a fresh state (``generator``: test-only noise)."""
    cfg = DPConfig(mode=mode, **kw)  # type: ignore[arg-type]
    return ClientPrivacy(
        cfg,
        num_clients=clients,
        client=0,
        state=ClientPrivacy.initial_state(cfg),
        generator=generator,
    )


def gone(pid: int, timeout: float = 20) -> bool:
    """Whether process ``pid`` has exited within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def load_script(name: str) -> Any:
    """``scripts/<name>.py`` imported as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stop_in_the_end(monkeypatch: Any) -> None:
    """The run is killed while it writes its end (every step's row and checkpoint written):
    :meth:`~car_fl.results.run.Run.end` raises KeyboardInterrupt."""
    from car_fl.results.run import Run

    def stopped(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Run, "end", stopped)


#: The account a confined SuperNode runs as in the tests (Debian's and most systems').
NOBODY, NOGROUP = 65534, 65534


def as_nobody(action: Callable[[], str]) -> str:
    """``action()`` in a forked child of ``nobody`` in ``nogroup`` (the FAB's code, confined);
    what it returned, or its exception as text. Forked, so that it needs none of this
    Python's files (they may be in the owner's home). Root only."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOGROUP)
            os.setuid(NOBODY)
            os.write(write, action().encode())
        except BaseException as err:
            os.write(write, f"{type(err).__name__}: {err}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        text = answer.read().decode()
    os.waitpid(pid, 0)
    return text
