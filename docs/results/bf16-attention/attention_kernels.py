"""Attention kernels against dtype on this CPU: a forward and an adapter + classifier step of a
preset (one batch of 16 SMS), float32 and bfloat16 weights, SDPA and eager attention, each
built, timed (median of 5, wall and CPU seconds) and freed in turn in one process.

Why `car_fl.model.loading.attention_choice` picks eager attention for bf16 on a CPU. Run from
the repository root: ``python docs/results/bf16-attention/attention_kernels.py smollm2``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModel

from car_fl.model.encoder import load_encoder
from car_fl.model.retriever import CaRRetriever
from car_fl.settings.compose import load_settings
from car_fl.settings.schema import Mode
from car_fl.training.train import make_optimizer

SMS = "../shared/data/sms_spam/SMSSpamCollection.tsv"


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    runs = []
    for _ in range(5):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)


def measure(name: str, dtype: str, attention: str, texts: list[str]) -> dict[str, Any]:
    load = AutoModel.from_pretrained

    def with_kernels(*args: Any, **kwargs: Any) -> Any:
        return load(*args, **{**kwargs, "attn_implementation": attention})

    AutoModel.from_pretrained = with_kernels  # type: ignore[method-assign]
    try:
        encoder = load_encoder(load_settings([f"model={name}", f"model.dtype={dtype}"]).model)
    finally:
        AutoModel.from_pretrained = load  # type: ignore[method-assign]
    assert encoder.model.config._attn_implementation == attention
    model = CaRRetriever(encoder, 2, head=load_settings([]).head, mode=Mode.ADAPTER_CLASSIFIER)
    ids, mask = encoder.pad(encoder.tokenize(texts).input_ids)
    labels = torch.zeros(len(texts), dtype=torch.long)
    optimizer = make_optimizer(model, load_settings([]).train)

    def forward() -> None:
        with torch.inference_mode():
            model(ids, mask)

    def step() -> None:
        _, loss = model(ids, mask, labels=labels)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    forward()  # warm-up
    step()
    return {"dtype": dtype, "attention": attention, "forward": timed(forward), "step": timed(step)}


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    lines = Path(SMS).read_text(encoding="utf-8").splitlines()[:16]
    texts = [line.split("\t", 1)[1].strip() for line in lines]
    load_before = os.getloadavg()
    rows = []
    for dtype, attention in (
        ("float32", "sdpa"),
        ("bfloat16", "sdpa"),
        ("bfloat16", "eager"),
        ("float32", "eager"),
    ):
        rows.append(measure(name, dtype, attention, texts))
        gc.collect()
    base = rows[0]
    for row in rows:
        row["speedup_wall"] = {k: base[k][0] / row[k][0] for k in ("forward", "step")}
        print(
            f"{name} {row['dtype']:>8} {row['attention']:>5}: forward {row['forward'][0]:.3f} s"
            f" ({row['forward'][1]:.2f} CPU s), step {row['step'][0]:.3f} s"
            f" ({row['step'][1]:.2f} CPU s); against float32 SDPA: forward"
            f" {row['speedup_wall']['forward']:.2f}x, step {row['speedup_wall']['step']:.2f}x"
        )
    load_after = os.getloadavg()
    print(f"torch threads {torch.get_num_threads()}; load before {load_before}, after {load_after}")
    print(json.dumps({"model": name, "rows": rows, "load": [load_before, load_after]}))


if __name__ == "__main__":
    main()
