"""DP-SGD's clipped gradient sum through the adapter: one backward per example against batched
passes with ghost norms (car_fl.privacy.ghost), same batch, same model, side by side.

    python scripts/dpsgd_speed.py --model smollm2 --batch 16     # ../shared SMS, one thread

Prints wall and CPU seconds of each, the largest difference between their sums, and each
example's gradient norm for the adapter and for the head apart (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from car_fl.data.splits import load_splits  # noqa: E402
from car_fl.model.retriever import build_retriever  # noqa: E402
from car_fl.privacy.ghost import ghost_clipped_sum  # noqa: E402
from car_fl.privacy.mechanism import clip_per_example  # noqa: E402
from car_fl.settings.compose import load_settings  # noqa: E402
from tests.reference import token_gradients  # noqa: E402  (the definition: one backward each)

SMS = ROOT.parent / "shared" / "data" / "sms_spam" / "SMSSpamCollection.tsv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", type=Path, default=SMS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--set", action="append", default=[], help="a settings override")
    parser.add_argument(
        "--weights", type=Path, help="a checkpoint's weights.safetensors to start from"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    s = load_settings(
        [
            f"model={args.model}",
            "mode=adapter",
            f"dataset.path={args.data}",
            "device=cpu",
            *args.set,
        ]
    )
    splits = load_splits(s.dataset, seed=s.seed)
    model = build_retriever(s, len(splits.label_map))
    if args.weights:
        from safetensors.torch import load_file

        model.load_trainable_state_dict(load_file(args.weights))
    rows = random.Random(0).sample(range(len(splits.train)), args.batch)
    texts = [splits.train["text"][i] for i in rows]
    labels = torch.tensor([splits.train["label"][i] for i in rows])
    ids = [torch.tensor(t) for t in model.encoder.tokenize(texts).input_ids]
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}

    parts: dict[str, list[float]] = {}

    def loop() -> dict[str, torch.Tensor]:
        grads, _, _ = token_gradients(model, params, labels, ids)
        for part, names in (
            ("adapter", ["adapter.weight"]),
            ("head", [k for k in grads if k != "adapter.weight"]),
        ):
            norms = torch.stack([grads[k].flatten(1).double().pow(2).sum(1) for k in names]).sum(0)
            parts[part] = sorted(norms.sqrt().tolist())
        clipped, _ = clip_per_example(grads, args.clip)
        return {k: g.sum(dim=0) for k, g in clipped.items()}

    def ghost() -> dict[str, torch.Tensor]:
        return ghost_clipped_sum(model, params, labels, ids, clip=args.clip)[0]

    out = {}
    results = {}
    for name, fn in (("loop", loop), ("ghost", ghost)):
        fn() if name == "ghost" else None  # warm the batched shapes once (the loop warms itself)
        wall, cpu = time.perf_counter(), time.process_time()
        results[name] = fn()
        out[name] = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
    diff = max(float((results["loop"][k] - results["ghost"][k]).abs().max()) for k in params)
    scale = max(float(results["loop"][k].abs().max()) for k in params)
    report = {
        "model": args.model,
        "dtype": str(model.encoder.dtype),
        "batch": args.batch,
        "tokens": sum(len(t) for t in ids),
        **out,
        "speedup_wall": out["loop"]["wall_s"] / out["ghost"]["wall_s"],
        "max_abs_difference": diff,
        # each example's gradient norm, adapter and head apart (median over the batch): which
        # part a joint bound dp.clip spends itself on
        "median_norm": {k: statistics.median(v) for k, v in parts.items()},
        "max_norm": {k: max(v) for k, v in parts.items()},
        "head_weight_norm": float(
            sum(p.pow(2).sum() for k, p in params.items() if k != "adapter.weight") ** 0.5
        ),
        "max_abs_value": scale,
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
