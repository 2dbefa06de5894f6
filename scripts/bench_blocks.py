"""Remote blocks against local blocks, side by side in one run: equality, the wire's cost, a
node's memory, and how much of a text its soft embeddings give back.

    python scripts/bench_blocks.py --out docs/results/blocks            # SmolLM2 + TinyLlama shape
    python scripts/bench_blocks.py --models smollm2 --texts 64 --out /tmp/blocks   # quicker

Starts ``car-fl serve-blocks`` (a real Ray Serve app on 127.0.0.1) per model, measures against
it and stops it. Texts: the first ``--texts`` messages of the SMS spam collection (a subsample,
said in the JSON). Writes ``blocks.json`` and prints one line per figure with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMS = ROOT.parent / "shared" / "data" / "sms_spam" / "SMSSpamCollection.tsv"
PRESETS = {"smollm2": "gguf:smollm2", "gemma3": "gguf:gemma3"}


def sms(n: int) -> list[str]:
    lines = SMS.read_text(encoding="utf-8").splitlines()
    return [line.split("\t", 1)[1] for line in lines if "\t" in line][:n]


def tinyllama_shape(folder: Path) -> str:
    """A TinyLlama-shaped Llama with random weights (22 blocks, hidden 2048), bf16 on disk."""
    from car_fl.testing.tiny import build_llama

    if not (folder / "config.json").exists():
        build_llama(
            folder,
            hidden=2048,
            layers=22,
            intermediate=5632,
            heads=32,
            kv_heads=4,
            dtype="bfloat16",
        )
    return str(folder)


def start_service(model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    ready = log.with_suffix(".ready")
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-m", "car_fl.cli", "serve-blocks", f"model.name_or_path={model}"]
    command += [
        "model.dtype=float32",
        "device=cpu",
        "--port",
        str(port),
        "--ready-file",
        str(ready),
    ]
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    started = time.monotonic()
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"serve-blocks failed: {log.read_text()[-2000:]}")
        if time.monotonic() - started > 600:
            raise RuntimeError("serve-blocks did not start in 600 s")
        time.sleep(0.5)
    print(f"  service for {model} up in {time.monotonic() - started:.0f} s", flush=True)
    return proc


NODE = r"""
import json, sys, time, torch
from car_fl.model.encoder import load_encoder
from car_fl.settings.schema import ModelConfig
model, blocks, url, texts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
cfg = ModelConfig(name="bench", name_or_path=model, dtype="float32", pooling="mean",
                  blocks=blocks, blocks_service=url if blocks == "remote" else None)
enc = load_encoder(cfg, device="cpu")
with torch.no_grad():
    for i in range(0, len(texts), 16):
        ids, mask = enc.pad(enc.tokenize(texts[i:i + 16]).input_ids)
        enc.pool(enc.transform(enc.embed(ids), mask), mask)
# VmHWM, this process's own peak (ru_maxrss keeps the parent's from before exec on Linux)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
peak = int(status["VmHWM"].split()[0]) / 1024
print(json.dumps({"peak_rss_mb": peak,
                  "node_parameters": sum(p.numel() for p in enc.model.parameters())}))
"""


def node_memory(model: str, blocks: str, url: str, texts: list[str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", NODE, model, blocks, url, json.dumps(texts)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(model: str, url: str, texts: list[str], steps: int) -> dict[str, object]:
    """Equality of states and gradients, adapter-step time, and token recovery, in process."""
    import torch

    from car_fl.model.adapter import SoftEmbeddingAdapter
    from car_fl.model.encoder import load_encoder
    from car_fl.settings.schema import ModelConfig

    base = {"name": "bench", "name_or_path": model, "dtype": "float32", "pooling": "mean"}
    local = load_encoder(ModelConfig(**base), device="cpu")  # type: ignore[arg-type]
    remote = load_encoder(
        ModelConfig(**base, blocks="remote", blocks_service=url),  # type: ignore[arg-type]
        device="cpu",
    )
    batches = [
        local.pad(local.tokenize(texts[i : i + 16]).input_ids) for i in range(0, len(texts), 16)
    ]
    worst = 0.0
    with torch.no_grad():
        for ids, mask in batches:
            a = local.pool(local.transform(local.embed(ids), mask), mask)
            b = remote.pool(remote.transform(remote.embed(ids), mask), mask)
            worst = max(worst, (a - b).abs().max().item())
    grads, timing = [], {}
    for name, encoder in (("local", local), ("remote", remote)):
        torch.manual_seed(0)
        adapter = SoftEmbeddingAdapter(encoder.hidden_size)
        with torch.no_grad():
            adapter.weight.add_(0.01 * torch.randn_like(adapter.weight))
        ids, mask = batches[0]
        pooled = encoder.pool(encoder.transform(adapter(encoder.embed(ids)), mask), mask)
        pooled.square().mean().backward()
        assert adapter.weight.grad is not None
        grads.append(adapter.weight.grad.flatten().clone())
        wall, cpu = time.perf_counter(), time.process_time()
        for step in range(steps):  # an adapter step: forward, backward through the blocks
            ids, mask = batches[step % len(batches)]
            adapter.zero_grad()
            pooled = encoder.pool(encoder.transform(adapter(encoder.embed(ids)), mask), mask)
            pooled.square().mean().backward()
        timing[name] = {
            "wall_s": time.perf_counter() - wall,
            "cpu_s_this_process": time.process_time() - cpu,
        }
    cosine = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item()
    relative = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    # what the service sees: soft embeddings; nearest row of the embedding table, per token
    table = local.embed(torch.arange(local.model.get_input_embeddings().weight.shape[0]))
    recovered = {}
    for scale in (0.0, 0.01, 0.05):
        torch.manual_seed(1)
        adapter = SoftEmbeddingAdapter(local.hidden_size)
        with torch.no_grad():
            adapter.weight.add_(scale * torch.randn_like(adapter.weight))
            hits = total = 0
            for ids, mask in batches:
                soft = adapter(local.embed(ids))[mask.bool()]
                nearest = torch.cdist(soft, table).argmin(dim=1)
                hits += int((nearest == ids[mask.bool()]).sum())
                total += int(mask.sum())
        recovered[f"adapter_noise_{scale}"] = hits / total
    return {
        "max_abs_pooled_difference": worst,
        "gradient_cosine": cosine,
        "gradient_relative_error": relative,
        "adapter_steps": steps,
        "batch": 16,
        "timing": timing,
        "remote_over_local_wall": timing["remote"]["wall_s"] / timing["local"]["wall_s"],
        "tokens_recovered_by_nearest_embedding": recovered,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "tinyllama-shape"])
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--port", type=int, default=8231)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = sms(args.texts)
    results: dict[str, object] = {
        "command": " ".join(["python", *sys.argv]),
        "texts": f"the first {len(texts)} SMS messages (a subsample of 5,574)",
        "load_before": os.getloadavg(),
        "cpus": os.cpu_count(),
        "models": {},
    }
    scratch = Path(tempfile.mkdtemp(prefix="bench-blocks-"))
    for name in args.models:
        model = PRESETS.get(name) or tinyllama_shape(scratch / "tinyllama-shape")
        url = f"http://127.0.0.1:{args.port}/blocks"
        proc = start_service(model, args.port, scratch / f"{name}.log")
        try:
            entry = compare(model, url, texts, args.steps)
            entry["node_memory"] = {
                blocks: node_memory(model, blocks, url, texts[:32])
                for blocks in ("local", "remote")
            }
            mem = entry["node_memory"]
            entry["remote_over_local_peak_rss"] = (
                mem["remote"]["peak_rss_mb"] / mem["local"]["peak_rss_mb"]  # type: ignore[index]
            )
            entry["load_after"] = os.getloadavg()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        results["models"][name] = entry  # type: ignore[index]
        print(f"{name}: {json.dumps(entry)}", flush=True)
    (args.out / "blocks.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'blocks.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
