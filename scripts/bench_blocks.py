"""Remote blocks against local blocks, side by side in one run: equality, the wire's cost and
where it goes, a node's memory, many nodes on one service, and how much of a text its soft
embeddings give back.

    python scripts/bench_blocks.py --out docs/results/blocks            # every part, 3 models
    python scripts/bench_blocks.py --models smollm2 --parts compare --out /tmp/blocks

Starts ``car-fl serve-blocks`` (a real Ray Serve app on 127.0.0.1, one replica with the
machine's CPUs) per model, measures against it and stops it. Parts: ``compare`` (states,
gradients, adapter-step time, tokens recovered, one node's memory), ``profile`` (the step's
time split: local, the service's arithmetic in process, the wire), ``many`` (4 nodes through
one service against 4 nodes with their own encoder), ``train`` (``car-fl train`` on SMS,
classifier and adapter, local against remote) and ``federated`` (a 2-node adapter run).
Texts: SMS spam messages (each part's subsample is said in the JSON). Writes
``blocks.json`` (merged with an earlier run's other models and parts) and prints one line per
figure with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMS = ROOT.parent / "shared" / "data" / "sms_spam" / "SMSSpamCollection.tsv"
PRESETS = {"smollm2": "gguf:smollm2", "gemma3": "gguf:gemma3"}


def sms(n: int) -> list[str]:
    lines = SMS.read_text(encoding="utf-8").splitlines()
    return [line.split("\t", 1)[1] for line in lines if "\t" in line][:n]


def tinyllama_shape(folder: Path) -> str:
    """A TinyLlama-shaped Llama with random weights (22 blocks, hidden 2048, TinyLlama's
    32,000-row embedding table), bf16 on disk."""
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
            vocab_size=32_000,
        )
    return str(folder)


def start_service(
    model: str, port: int, log: Path, dtype: str = "float32"
) -> subprocess.Popen[bytes]:
    ready = log.with_suffix(".ready")
    ready.unlink(missing_ok=True)
    command = [sys.executable, "-m", "car_fl.cli", "serve-blocks", f"model.name_or_path={model}"]
    command += [
        f"model.dtype={dtype}",
        "device=cpu",
        "--cpus-per-replica",
        str(os.cpu_count() or 1),
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

    from car_fl.adapters.adapter import FullAdapter
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
        adapter = FullAdapter(encoder.hidden_size)
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
        adapter = FullAdapter(local.hidden_size)
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


def profile(model: str, url: str, texts: list[str], steps: int) -> dict[str, object]:
    """An adapter step's time split: local blocks; the service's own arithmetic called in this
    process (a stateless backward recomputes the forward; the wire format, no HTTP); over HTTP
    to the Serve app (adds HTTP, Serve's proxy and batching, the hop between processes)."""

    from car_fl.adapters.adapter import FullAdapter
    from car_fl.blocks import wire
    from car_fl.blocks.client import IN_PROCESS
    from car_fl.blocks.compute import BlocksHandler
    from car_fl.model.encoder import load_encoder
    from car_fl.serving.blocks_service import load_runner
    from car_fl.settings.schema import ModelConfig

    base = {"name": "bench", "name_or_path": model, "dtype": "float32", "pooling": "mean"}
    IN_PROCESS["inprocess://bench"] = BlocksHandler(
        load_runner(ModelConfig(**base), device="cpu")  # type: ignore[arg-type]
    ).handle
    encoders = {
        "local": load_encoder(ModelConfig(**base), device="cpu"),  # type: ignore[arg-type]
        "in_process": load_encoder(
            ModelConfig(**base, blocks="remote", blocks_service="inprocess://bench"),  # type: ignore[arg-type]
            device="cpu",
        ),
        "http": load_encoder(
            ModelConfig(**base, blocks="remote", blocks_service=url),  # type: ignore[arg-type]
            device="cpu",
        ),
    }
    local = encoders["local"]
    batches = [
        local.pad(local.tokenize(texts[i : i + 16]).input_ids) for i in range(0, len(texts), 16)
    ]
    seconds: dict[str, dict[str, float]] = {}
    for name, encoder in encoders.items():
        adapter = FullAdapter(encoder.hidden_size)
        split = {"forward_s": 0.0, "backward_s": 0.0}
        for step in range(steps + 1):  # the first step warms up and is not counted
            ids, mask = batches[step % len(batches)]
            adapter.zero_grad()
            t0 = time.perf_counter()
            pooled = encoder.pool(encoder.transform(adapter(encoder.embed(ids)), mask), mask)
            loss = pooled.square().mean()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if step:
                split["forward_s"] += (t1 - t0) / steps
                split["backward_s"] += (t2 - t1) / steps
        split["step_s"] = split["forward_s"] + split["backward_s"]
        seconds[name] = split
    # the wire format alone: one backward request and its reply, encoded and decoded
    ids, mask = batches[0]
    soft = local.embed(ids)
    t0 = time.perf_counter()
    for _ in range(20):
        body = wire.write_request(soft, mask, fingerprint="bench", grad=soft.clone())
        wire.read_request(body, hidden=soft.shape[-1], limits=wire.Limits(), backward=True)
        wire.read_reply(wire.write_reply("grad", soft), "grad", tuple(soft.shape))
    codec = (time.perf_counter() - t0) / 20
    IN_PROCESS.pop("inprocess://bench", None)
    per = {name: split["step_s"] for name, split in seconds.items()}
    return {
        "steps": steps,
        "batch": 16,
        "seconds_per_step": seconds,
        "in_process_over_local": per["in_process"] / per["local"],
        "http_over_local": per["http"] / per["local"],
        "wire_format_s_per_backward": codec,
        "share_of_the_extra": {
            "arithmetic (recomputed forward, padding)": (per["in_process"] - per["local"])
            / (per["http"] - per["local"]),
            "HTTP, Serve and the process hop": (per["http"] - per["in_process"])
            / (per["http"] - per["local"]),
        },
    }


MANY_NODE = r"""
import json, os, sys, time, torch
torch.set_num_threads(int(os.environ["NODE_THREADS"]))
from car_fl.model.encoder import load_encoder
from car_fl.settings.schema import ModelConfig
model, blocks, url, dtype, go, texts = sys.argv[1:6] + [json.loads(sys.argv[6])]
cfg = ModelConfig(name="bench", name_or_path=model, dtype=dtype, pooling="mean",
                  blocks=blocks, blocks_service=url if blocks == "remote" else None)
enc = load_encoder(cfg, device="cpu")
batches = [enc.pad(enc.tokenize(texts[i:i + 16]).input_ids) for i in range(0, len(texts), 16)]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
latencies = []
with torch.no_grad():
    for ids, mask in batches:
        t0 = time.perf_counter()
        enc.pool(enc.transform(enc.embed(ids), mask), mask)
        latencies.append(time.perf_counter() - t0)
end = time.time()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"end": end, "latencies_s": latencies, "cpu_s": time.process_time(),
                  "peak_rss_mb": int(status["VmHWM"].split()[0]) / 1024}))
"""


class MemorySampler:
    """The sum of the resident memory of some processes and their descendants, sampled every
    0.2 s; ``peak_mb`` is the largest sum seen."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.peak_mb, self._stop = pids, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _total(self) -> float:
        import psutil

        seen, total = set(), 0
        for pid in self.pids:
            try:
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    if proc.pid not in seen:
                        seen.add(proc.pid)
                        total += proc.memory_info().rss
            except psutil.Error:
                continue
        return total / 2**20

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self._total())
            self._stop.wait(0.2)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def many(
    model: str, url: str, texts: list[str], service_pid: int | None, dtype: str, nodes: int = 4
) -> dict[str, object]:
    """``nodes`` processes extracting features of ``texts`` (each a quarter), all at once: each
    with its own encoder (one torch thread each: the machine's cores shared out), against each
    with remote blocks on the one service. Throughput from the moment all are loaded."""
    import numpy as np

    scratch = Path(tempfile.mkdtemp(prefix="bench-many-"))
    runs: dict[str, dict[str, object]] = {}
    for blocks in ("local", "remote"):
        go = scratch / f"go-{blocks}"
        threads = max(1, (os.cpu_count() or 1) // nodes) if blocks == "local" else 1
        env = {**os.environ, "NODE_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        node = [sys.executable, "-c", MANY_NODE, model, blocks, url, dtype, str(go)]
        procs = [
            subprocess.Popen(
                [*node, json.dumps(texts[i::nodes])],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(nodes)
        ]
        pids = [p.pid for p in procs]
        if blocks == "remote" and service_pid:
            pids.append(service_pid)
        with MemorySampler(pids) as memory:
            for proc in procs:
                assert proc.stdout is not None
                assert proc.stdout.readline().strip() == "ready", "a node failed to load"
            started = time.time()
            go.touch()
            results = []
            for proc in procs:
                out, _ = proc.communicate(timeout=3600)
                assert proc.returncode == 0, f"a {blocks} node failed"
                results.append(json.loads(out.strip().splitlines()[-1]))
        latencies = np.array([x for r in results for x in r["latencies_s"]])
        wall = max(r["end"] for r in results) - started
        runs[blocks] = {
            "torch_threads_per_node": threads,
            "texts_per_s": len(texts) / wall,
            "wall_s": wall,
            "request_latency_p50_s": float(np.percentile(latencies, 50)),
            "request_latency_p99_s": float(np.percentile(latencies, 99)),
            "nodes_cpu_s": sum(r["cpu_s"] for r in results),
            "node_peak_rss_mb": [r["peak_rss_mb"] for r in results],
            "all_processes_peak_rss_mb": memory.peak_mb,
        }
    local, remote = runs["local"], runs["remote"]
    return {
        "nodes": nodes,
        "texts": len(texts),
        "batch": 16,
        "dtype": dtype,
        **runs,
        "throughput_remote_over_local": remote["texts_per_s"] / local["texts_per_s"],  # type: ignore[operator]
        "memory_remote_over_local": remote["all_processes_peak_rss_mb"]  # type: ignore[operator]
        / local["all_processes_peak_rss_mb"],
        "load_after": os.getloadavg(),
    }


def car_fl_train(
    model: str, url: str, examples: int, adapter_examples: int, scratch: Path
) -> dict[str, object]:
    """``car-fl train`` on the first SMS messages, local against remote blocks: classifier on
    ``examples`` (3 epochs) and adapter on ``adapter_examples`` (1 epoch), float32, same seed."""
    runs: dict[str, object] = {}
    for mode, epochs, n in (("classifier", 3, examples), ("adapter", 1, adapter_examples)):
        summary = {}
        for blocks in ("local", "remote"):
            out = scratch / f"train-{mode}-{blocks}"
            command = [sys.executable, "-m", "car_fl.cli", "train", f"model.name_or_path={model}"]
            command += [f"mode={mode}", "model.dtype=float32", "device=cpu", "progress=false"]
            command += [f"dataset.path={SMS}", f"dataset.max_examples={n}"]
            command += [f"train.epochs={epochs}", f"output_dir={out}"]
            command += [f"cache_dir={scratch / f'cache-{blocks}'}"]
            if blocks == "remote":
                command += ["model.blocks=remote", f"model.blocks_service={url}"]
            wall = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            metrics = json.loads((out / "metrics.json").read_text())["summary"]
            best = metrics["best"]
            summary[blocks] = {
                "selected_epoch": best["round"],
                "val_top1": best["val_top1"],
                "test_top1": best["test_top1"],
                "test_examples": metrics["test_examples"],
                "wall_s": time.perf_counter() - wall,
            }
        runs[mode] = {
            "examples": f"the first {n} SMS messages",
            "epochs": epochs,
            **summary,
            "same_selection_and_top1": all(
                summary["local"][k] == summary["remote"][k]
                for k in ("selected_epoch", "val_top1", "test_top1")
            ),
        }
    return runs


def federated(model: str, url: str, examples: int, scratch: Path) -> dict[str, object]:
    """A 2-node adapter + CaR federation in process (the real server loop and ClientApp
    handler), local against remote blocks, same seed."""
    from car_fl.settings.compose import load_settings
    from car_fl.simulation.in_process import run_local

    summary = {}
    for blocks in ("local", "remote"):
        settings = load_settings(
            [
                f"model.name_or_path={model}",
                "mode=adapter",
                "model.dtype=float32",
                "device=cpu",
                "progress=false",
                "fl.clients=2",
                "fl.rounds=2",
                "train.batch_size=16",
                f"dataset.path={SMS}",
                f"dataset.max_examples={examples}",
                f"output_dir={scratch / f'federated-{blocks}'}",
            ]
        )
        node = {"blocks": "remote", "blocks-service": url} if blocks == "remote" else {}
        wall = time.perf_counter()
        best = run_local(settings, node_config=node)["summary"]["best"]
        summary[blocks] = {
            "selected_round": best["round"],
            "val_top1": best["val_top1"],
            "test_top1": best["test_top1"],
            "wall_s": time.perf_counter() - wall,
        }
    return {
        "examples": f"the first {examples} SMS messages, 2 nodes, 2 rounds, adapter + CaR",
        **summary,
        "same_selection_and_top1": all(
            summary["local"][k] == summary["remote"][k]
            for k in ("selected_round", "val_top1", "test_top1")
        ),
    }


PARTS = ("compare", "memory", "profile", "many", "train", "federated")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3", "tinyllama-shape"])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--many-texts", type=int, default=2000)
    parser.add_argument("--train-examples", type=int, default=1200)
    parser.add_argument("--adapter-examples", type=int, default=300)
    parser.add_argument("--port", type=int, default=8231)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "blocks.json"
    texts = sms(args.texts)
    earlier = json.loads(path.read_text()) if path.exists() else {}
    results: dict[str, object] = {
        "commands": [*earlier.get("commands", []), " ".join(["python", *sys.argv])],
        "cpus": os.cpu_count(),
        "models": earlier.get("models", {}),
    }
    scratch = Path(tempfile.mkdtemp(prefix="bench-blocks-"))
    for name in args.models:
        model = PRESETS.get(name) or tinyllama_shape(scratch / "tinyllama-shape")
        url = f"http://127.0.0.1:{args.port}/blocks"
        big = name == "tinyllama-shape"
        entry: dict[str, object] = dict(results["models"].get(name, {}))  # type: ignore[attr-defined]
        entry["load_before"] = os.getloadavg()
        proc = start_service(model, args.port, scratch / f"{name}.log")
        try:
            if "compare" in args.parts:
                entry["texts"] = f"the first {len(texts)} SMS messages (a subsample of 5,574)"
                entry |= compare(model, url, texts, args.steps)
                entry["node_memory"] = {
                    blocks: node_memory(model, blocks, url, texts[:32])
                    for blocks in ("local", "remote")
                }
                mem = entry["node_memory"]
                entry["remote_over_local_peak_rss"] = (
                    mem["remote"]["peak_rss_mb"] / mem["local"]["peak_rss_mb"]  # type: ignore[index]
                )
            if "memory" in args.parts and "compare" not in args.parts:
                entry["node_memory"] = {
                    blocks: node_memory(model, blocks, url, texts[:32])
                    for blocks in ("local", "remote")
                }
                mem = entry["node_memory"]
                entry["remote_over_local_peak_rss"] = (
                    mem["remote"]["peak_rss_mb"] / mem["local"]["peak_rss_mb"]  # type: ignore[index]
                )
                entry["memory_measured"] = time.strftime("%Y-%m-%d %H:%M")
                entry["memory_load"] = os.getloadavg()
            if "profile" in args.parts and not big:
                entry["profile"] = profile(model, url, texts, args.steps)
            if "train" in args.parts and name == "smollm2":
                entry["train"] = car_fl_train(
                    model, url, args.train_examples, args.adapter_examples, scratch
                )
            if "federated" in args.parts and name == "smollm2":
                entry["federated"] = federated(model, url, args.adapter_examples, scratch)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        if "many" in args.parts and name != "gemma3":
            # the random TinyLlama shape in bf16 (4 float32 copies would not fit beside the
            # rest) on a few texts: its figure is memory
            dtype = "bfloat16" if big else "float32"
            proc = start_service(model, args.port, scratch / f"{name}-many.log", dtype=dtype)
            try:
                subset = sms(64 if big else args.many_texts)
                entry["many"] = many(model, url, subset, proc.pid, dtype)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
        entry["load_after"] = os.getloadavg()
        results["models"][name] = entry  # type: ignore[index]
        print(f"{name}: {json.dumps(entry)}", flush=True)
        path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
