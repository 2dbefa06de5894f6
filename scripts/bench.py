"""Speed and memory of car-fl, as ratios measured side by side in one run.

    python scripts/bench.py                      # ../shared SMS data, offline MiniLM; ~6 min
    python scripts/bench.py --data PATH --json bench.json
    python scripts/bench.py --smoke              # every figure on a tiny random Llama (a test)
    python scripts/bench.py --slm --json bench-slm.json   # figure 8 only: real small LMs

Figures (each printed with what it is compared against, and its target on a 2-core CPU):
 1. feature extraction with length bucketing vs arrival-order batches (same outputs)
 2. a whole classifier-mode FL run (2 clients, 5 rounds x 2 epochs, cold cache) vs one
    extraction pass over the same texts
 3. an adapter+classifier training step vs a forward-only pass on the same batch
 4. per-round overhead in simulation (round time minus the slowest client's training) vs the
    round time of an empty ClientApp that replies at once (Flower's own floor)
 5. peak RSS of a client process (one round, cold cache) vs the encoder's weight bytes
 6. bytes sent per client per round vs the trainable parameters' bytes
 7. accuracy, time and bytes with comm.dtype float32 vs float16
 8. (``--slm``) SmolLM2-135M and Gemma 3 270M (GGUF presets) and a random TinyLlama-shaped
    Llama as the frozen encoder, in float32 and with ``model.dtype=auto`` side by side (which
    dtype auto picked, and why): forward and adapter step on one batch, the product's feature
    extraction (256 SMS) and adapter epoch (64 SMS), wall and CPU seconds, the speed-ups;
    MFU on CUDA (``--device cuda``)
On a CUDA device it also times adapter+classifier training of a randomly initialised
TinyLlama-sized Llama (22 layers, hidden 2048) in bfloat16 on SMS-sized data.

Deployment (SuperLink + SuperNodes) figures are in the companion ``scripts/bench_deploy.py``:
per-round overhead against an empty ClientApp on the same cluster, and the speed-up of N
clients pinned to their own cores against a one-core centralised run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from car_fl.data.splits import load_splits  # noqa: E402
from car_fl.model.features import features_for  # noqa: E402
from car_fl.model.retriever import CaRRetriever, build_retriever  # noqa: E402
from car_fl.protocol.messages import payload_bytes, to_record  # noqa: E402
from car_fl.settings.compose import load_settings  # noqa: E402
from car_fl.settings.schema import Mode, Settings  # noqa: E402
from car_fl.training.train import make_optimizer  # noqa: E402

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "sms_spam" / "SMSSpamCollection.tsv"
TARGETS = {
    "1_bucketing_speedup": (">=", 1.6),
    "2_fl_run_vs_extraction": ("<=", 1.3),
    "3_step_vs_forward": ("<=", 2.6),
    "4_round_overhead_vs_floor": ("<=", 1.2),
    "5_rss_vs_weights_classifier": ("<=", 1.5),
    "6_bytes_vs_trainable": ("<=", 1.02),
}
log = logging.getLogger("bench")
#: The encoder every figure runs on; ``--smoke`` puts a tiny local Llama here.
MODEL = ["model=minilm"]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    tick = time.perf_counter()
    out = fn()
    return time.perf_counter() - tick, out


def timed_cpu(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all its threads) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def rss_bytes() -> int:
    """The current resident set size of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def base_overrides(data: Path, cache: Path, *extra: str) -> list[str]:
    return [
        *MODEL,
        f"dataset.path={data}",
        f"cache_dir={cache}",
        "device=cpu",
        "progress=false",
        *extra,
    ]


# ----------------------------------------------------------------------------- figure 1
def bench_bucketing(settings: Settings, model: CaRRetriever, n: int) -> dict[str, Any]:
    splits = load_splits(settings.dataset, seed=settings.seed)
    texts = random.Random(0).sample(list(splits.train["text"]), n)
    features_for(model, texts[:64], batch_size=32, progress=False)  # warm-up
    t_arrival, arrival = timed(
        lambda: features_for(model, texts, batch_size=32, progress=False, bucket=False)
    )
    t_bucket, bucket = timed(
        lambda: features_for(model, texts, batch_size=32, progress=False, bucket=True)
    )
    same = bool(torch.allclose(arrival, bucket, atol=1e-5, rtol=1e-4))
    lengths = model.encoder.tokenize(texts).lengths()
    return {
        "texts": n,
        "mean_tokens": statistics.mean(lengths),
        "max_tokens": max(lengths),
        "arrival_seconds": t_arrival,
        "bucketed_seconds": t_bucket,
        "speedup": t_arrival / t_bucket,
        "same_features": same,
        "max_abs_diff": float((arrival - bucket).abs().max()),
    }


# ------------------------------------------------------------------------ figures 2, 6
#: ``--smoke`` runs figures 2, 4 and 7's federations in this process
#: (:mod:`car_fl.simulation.in_process`: the same ServerApp and ClientApp handlers, without
#: Ray's start): a smoke run's numbers mean nothing, and Ray's path has its own end-to-end test.
IN_PROCESS = [False]


def federate(overrides: list[str], *, client_train: Any = None) -> dict[str, Any]:
    """One federation's ``metrics.json`` content: on Flower's simulation engine (in this
    process with ``--smoke``)."""
    if IN_PROCESS[0]:
        from car_fl.simulation.in_process import run_local

        return run_local(load_settings(overrides), client_train=client_train)
    from car_fl.simulation.flower import run_simulation

    return run_simulation(overrides, client_train=client_train)


def bench_fl_vs_extraction(
    data: Path, work: Path, model: CaRRetriever, settings: Settings
) -> dict[str, Any]:
    cold = work / "cache-cold"
    overrides = base_overrides(data, cold, "fl.clients=2", "fl.rounds=5", "fl.local_epochs=2")
    t_fl, metrics = timed(lambda: federate([*overrides, f"output_dir={work / 'fl-cold'}"]))
    # the same run again: every feature is now on disk, so no encoder pass at all
    t_warm, warm = timed(lambda: federate([*overrides, f"output_dir={work / 'fl-warm'}"]))
    splits = load_splits(settings.dataset, seed=settings.seed)
    texts = list(splits.train["text"]) + list(splits.test["text"])
    t_pass, _ = timed(lambda: features_for(model, texts, batch_size=32, progress=False))
    history = metrics["history"]
    sent = [row["bytes_sent_per_client"] for row in history]
    clf_state = build_retriever(settings, 2, hidden_size=model.encoder.hidden_size)
    return {
        "fl_seconds": t_fl,
        "fl_warm_cache_seconds": t_warm,
        "warm_top1": warm["summary"]["final"]["test_top1"],
        "warm_bytes_sent_per_client_per_round": max(
            r["bytes_sent_per_client"] for r in warm["history"]
        ),
        "extraction_pass_seconds": t_pass,
        "texts": len(texts),
        "ratio": t_fl / t_pass,
        "cold_minus_warm_vs_pass": (t_fl - t_warm) / t_pass,
        "final_top1": metrics["summary"]["final"]["test_top1"],
        "bytes_sent_per_client_per_round": max(sent),
        "trainable_bytes": trainable_bytes(clf_state),
    }


def trainable_bytes(model: CaRRetriever) -> int:
    return sum(p.numel() * p.element_size() for p in model.trainable_parameters().values())


def bench_bytes(
    settings: Settings, model: CaRRetriever, measured: dict[str, Any]
) -> dict[str, Any]:
    """Payload, and the whole reply as Flower transfers it (its deflated objects), both modes."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from car_fl.protocol.messages import train_reply

    out: dict[str, Any] = {
        "classifier_measured_payload": measured["bytes_sent_per_client_per_round"],
        "classifier_trainable": measured["trainable_bytes"],
        "classifier_ratio": measured["bytes_sent_per_client_per_round"]
        / measured["trainable_bytes"],
    }
    adapter = CaRRetriever(model.encoder, 2, head=settings.head, mode=Mode.ADAPTER_CLASSIFIER)
    for mode, retriever in (("classifier", model), ("adapter", adapter)):
        state = retriever.trainable_state_dict()
        reply = train_reply(state, {"num-examples": 2230, "train-loss": 0.1})
        objects = get_all_nested_objects(reply)
        wire = sum(len(obj.deflate()) for obj in objects.values())
        out[f"{mode}_payload"] = payload_bytes(to_record(state))
        out[f"{mode}_trainable"] = trainable_bytes(retriever)
        out[f"{mode}_message_bytes"] = wire
        out[f"{mode}_message_ratio"] = wire / trainable_bytes(retriever)
    return out


# ----------------------------------------------------------------------------- figure 3
def bench_step_vs_forward(
    model: CaRRetriever, texts: list[str], *, repeats: int, label: str
) -> dict[str, Any]:
    """Median time of a training step and of a forward pass, on the same batch, interleaved."""
    ids, mask = model.encoder.pad(model.encoder.tokenize(texts).input_ids)
    ids, mask = ids.to(model.device), mask.to(model.device)
    labels = torch.zeros(len(texts), dtype=torch.long, device=model.device)
    optimizer = make_optimizer(model, load_settings([]).train)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def forward() -> None:
        with torch.inference_mode():
            model(ids, mask)
        sync()

    def step() -> None:
        _, loss = model(ids, mask, labels=labels)
        assert loss is not None
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sync()

    forward()  # warm-up
    step()
    fwd, stp = [], []
    for _ in range(repeats):
        fwd.append(timed_cpu(forward))
        stp.append(timed_cpu(step))
    frozen_grads = sum(p.grad is not None for p in model.encoder.parameters())
    return {
        "model": label,
        "batch": list(ids.shape),
        "forward_seconds": statistics.median(w for w, _ in fwd),
        "step_seconds": statistics.median(w for w, _ in stp),
        "forward_cpu_seconds": statistics.median(c for _, c in fwd),
        "step_cpu_seconds": statistics.median(c for _, c in stp),
        "ratio": statistics.median(w for w, _ in stp) / statistics.median(w for w, _ in fwd),
        "frozen_weights_with_grad": frozen_grads,
    }


def tiny_llama_retriever(folder: Path, *, hidden: int, layers: int) -> CaRRetriever:
    from car_fl.model.encoder import load_encoder
    from car_fl.settings.schema import HeadConfig, ModelConfig
    from car_fl.testing.tiny import build_llama

    build_llama(folder, hidden=hidden, layers=layers)
    encoder = load_encoder(
        ModelConfig(name="bench-llama", name_or_path=str(folder), pooling="mean"), device="cpu"
    )
    return CaRRetriever(encoder, 2, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)


# ----------------------------------------------------------------------------- figure 4
def empty_client(msg: Any, context: Any) -> Any:
    """A ClientApp handler that replies at once with the global parameters (Flower's floor)."""
    from flwr.app import Message, MetricRecord, RecordDict

    from car_fl.protocol.messages import ARRAYS_KEY, METRICS_KEY

    tick = time.perf_counter()
    arrays = msg.content.array_records[ARRAYS_KEY]
    # the node's partition: the server checks each reply's example count against its shard
    metrics = MetricRecord(
        {
            "num-examples": 1,
            "partition-id": int(context.node_config["partition-id"]),
            "train-seconds": time.perf_counter() - tick,
        }
    )
    return Message(content=RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: metrics}), reply_to=msg)


def bench_round_overhead(data: Path, work: Path, cache: Path, rounds: int) -> dict[str, Any]:
    overrides = base_overrides(
        data, cache, "fl.clients=2", f"fl.rounds={rounds}", "fl.local_epochs=1"
    )
    ours = federate([*overrides, f"output_dir={work / 'overhead-ours'}"])
    empty = federate(
        [*overrides, f"output_dir={work / 'overhead-empty'}"], client_train=empty_client
    )
    later = slice(1, None)  # round 1 includes starting the client processes
    overhead = [r["seconds"] - r["max_client_train_seconds"] for r in ours["history"][later]]
    floor = [r["seconds"] for r in empty["history"][later]]
    train = [r["max_client_train_seconds"] for r in ours["history"][later]]
    import csv

    rows = list(csv.DictReader((work / "overhead-ours" / "clients.csv").open()))
    return {
        "client_torch_threads": sorted({int(float(r["torch_threads"])) for r in rows}),
        "rounds_compared": len(floor),
        "ours_round_seconds": statistics.median(r["seconds"] for r in ours["history"][later]),
        "ours_slowest_client_train_seconds": statistics.median(train),
        "ours_overhead_seconds": statistics.median(overhead),
        "empty_clientapp_round_seconds": statistics.median(floor),
        "ratio": statistics.median(overhead) / statistics.median(floor),
    }


# ----------------------------------------------------------------------------- figure 5
RSS_CHILD = """
import json, os, resource, sys
sys.path.insert(0, @ROOT@)
os.environ["HF_HUB_OFFLINE"] = "1"
import torch, transformers, flwr  # the process's fixed cost, before any model
from flwr.app import RecordDict
from car_fl.client.node import Node
from car_fl.settings.compose import NodeInfo
from car_fl.client.round import cached_encoder
from car_fl.settings.compose import load_settings
from car_fl.model.retriever import CaRRetriever, build_retriever
from car_fl.settings.schema import Mode


def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024


before = rss()
status = dict(l.split(":", 1) for l in open("/proc/self/status"))
anon_before, file_before = (int(status[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))
settings = load_settings(@OVERRIDES@)
node = NodeInfo(partition_id=0, num_partitions=2)
if @MODE@ == "classifier":
    initial = build_retriever(settings, 2, hidden_size=@HIDDEN@).trainable_state_dict()
else:
    encoder = cached_encoder(settings)
    initial = CaRRetriever(
        encoder, 2, head=settings.head, mode=Mode.ADAPTER_CLASSIFIER
    ).trainable_state_dict()
Node(config={}).train(settings, node, initial, 1, RecordDict())
encoder = cached_encoder(settings)
weights = sum(p.numel() * p.element_size() for p in encoder.parameters())
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child started by a big
# parent would report the parent's peak
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
status = dict(l.split(":", 1) for l in open("/proc/self/status"))
kib = {k: int(status[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}
out = {"before": before, "peak": peak, "weights": weights, "dtype": str(encoder.dtype),
       "anon_end": kib["RssAnon"], "file_end": kib["RssFile"], "anon_before": anon_before,
       "file_before": file_before}
print(json.dumps(out))
"""


def client_rss(
    mode: str, data: Path, cache: Path, max_examples: int, hidden: int
) -> dict[str, Any]:
    """In a fresh process: one client round from a cold cache; RSS before and at peak."""
    overrides = base_overrides(
        data, cache, f"mode={mode}", "fl.local_epochs=1", f"dataset.max_examples={max_examples}"
    )
    code = (
        RSS_CHILD.replace("@ROOT@", repr(str(ROOT)))
        .replace("@OVERRIDES@", repr(overrides))
        .replace("@MODE@", repr(mode))
        .replace("@HIDDEN@", str(hidden))
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=1200
    )
    if out.returncode != 0:
        raise RuntimeError(f"the {mode}-mode client process failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    growth = result["peak"] - result["before"]
    return {
        "mode": mode,
        "rss_after_imports": result["before"],
        "peak_rss": result["peak"],
        "growth_above_imports": growth,
        "encoder_weight_bytes": result["weights"],
        "weights_dtype": result["dtype"],
        "ratio_growth": growth / result["weights"],
        "ratio_absolute": result["peak"] / result["weights"],
        # at the end of the round: data (anonymous) vs mapped files (library code paged in)
        "anon_growth_at_end": result["anon_end"] - result["anon_before"],
        "file_growth_at_end": result["file_end"] - result["file_before"],
        "ratio_anon_growth": (result["anon_end"] - result["anon_before"]) / result["weights"],
    }


# ----------------------------------------------------------------------------- figure 7
def bench_comm_dtype(data: Path, work: Path, cache: Path, fp32: dict[str, Any]) -> dict[str, Any]:
    """float16 on the wire against the float32 run of figure 2 (same settings, warm cache)."""
    overrides = base_overrides(
        data, cache, "fl.clients=2", "fl.rounds=5", "fl.local_epochs=2", "comm.dtype=float16"
    )
    seconds, metrics = timed(lambda: federate([*overrides, f"output_dir={work / 'comm-float16'}"]))
    out: dict[str, Any] = {
        "float32": {
            "top1": fp32["warm_top1"],
            "seconds": fp32["fl_warm_cache_seconds"],
            "bytes_sent_per_client_per_round": fp32["warm_bytes_sent_per_client_per_round"],
        },
        "float16": {
            "top1": metrics["summary"]["final"]["test_top1"],
            "seconds": seconds,
            "bytes_sent_per_client_per_round": max(
                r["bytes_sent_per_client"] for r in metrics["history"]
            ),
        },
    }
    out["top1_difference_pp"] = 100 * (out["float16"]["top1"] - out["float32"]["top1"])
    out["bytes_ratio"] = (
        out["float16"]["bytes_sent_per_client_per_round"]
        / out["float32"]["bytes_sent_per_client_per_round"]
    )
    out["time_ratio"] = out["float16"]["seconds"] / out["float32"]["seconds"]
    return out


# ------------------------------------------------------------------------------ GPU only
def bench_gpu(texts: list[str], minilm_dir: str) -> dict[str, Any]:
    """Adapter+classifier on a random TinyLlama-sized Llama in bf16: epoch time, step/forward."""
    from transformers import AutoTokenizer

    from car_fl.model.encoder import Encoder
    from car_fl.model.features import LocalData
    from car_fl.settings.schema import HeadConfig, ModelConfig
    from car_fl.training.train import train_epoch

    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)  # a real subword vocabulary
    llama = tinyllama_shaped(len(tokenizer), torch.device("cuda"), torch.bfloat16)
    cfg = ModelConfig(
        name="tinyllama-shape", name_or_path="random", pooling="mean", dtype="bfloat16"
    )
    encoder = Encoder(llama, tokenizer, cfg)
    model = CaRRetriever(encoder, 2, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    ratio = bench_step_vs_forward(model, texts[:16], repeats=10, label="TinyLlama-shape bf16")
    data = LocalData(
        labels=torch.tensor([i % 2 for i in range(len(texts))]),
        input_ids=encoder.tokenize(texts).input_ids,
    )
    optimizer = make_optimizer(model, load_settings([]).train)
    torch.cuda.synchronize()
    seconds, _ = timed(
        lambda: train_epoch(model, data, optimizer, batch_size=16, seed=0, epoch=0, progress=True)
    )
    torch.cuda.synchronize()
    return {
        "device": torch.cuda.get_device_name(),
        "texts": len(texts),
        "batch_size": 16,
        "epoch_seconds": seconds,
        "step_vs_forward": ratio,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
    }


# ----------------------------------------------------------------------------- figure 8
#: Peak dense bf16 matrix throughput of known GPUs (FLOP/s), for MFU.
GPU_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
SLM_NAMES = ("smollm2", "gemma3", "tinyllama-shape")


def tinyllama_shaped(vocab: int, device: torch.device, dtype: torch.dtype) -> Any:
    """A randomly initialised Llama of TinyLlama-1.1B's shape (22 layers, hidden 2048)."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return LlamaModel(config).to(device=device, dtype=dtype)  # type: ignore[call-arg]


def slm_encoder(name: str, dtype: str, device: str, minilm_dir: str) -> Any:
    """A real small LM preset (``smollm2``, ``gemma3``) in ``dtype`` (``auto``: the product's
    choice), or a random TinyLlama-shaped Llama."""
    from car_fl.model.encoder import Encoder, load_encoder, pick_device, pick_dtype
    from car_fl.settings.schema import ModelConfig

    if name != "tinyllama-shape":
        return load_encoder(
            load_settings([f"model={name}", f"model.dtype={dtype}"]).model, device=device
        )
    from transformers import AutoTokenizer

    target = pick_device(device)
    torch_dtype = pick_dtype(dtype, target)
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir)  # a real subword vocabulary
    llama = tinyllama_shaped(len(tokenizer), target, torch_dtype)
    cfg = ModelConfig(
        name=name, name_or_path="random", dtype=str(torch_dtype).removeprefix("torch.")
    )
    return Encoder(llama, tokenizer, cfg)


def bench_slm_dtype(
    name: str, dtype: str, batch: list[str], pool: list[str], device: str, minilm_dir: str
) -> dict[str, Any]:
    """One dtype of one model: the micro-benchmark (an adapter+classifier step against a
    forward on one batch of 16 SMS) and the product's own paths (feature extraction over
    ``pool``, length-bucketed, and an adapter epoch over its first 64 texts with
    :func:`~car_fl.training.train.train_epoch`), wall and CPU seconds each."""
    from car_fl.model.features import LocalData, extract_features
    from car_fl.training.train import train_epoch

    encoder = slm_encoder(name, dtype, device, minilm_dir)
    model = CaRRetriever(
        encoder, 2, head=load_settings([]).head, mode=Mode.ADAPTER_CLASSIFIER, device=encoder.device
    )
    on_cpu = encoder.device.type == "cpu"
    repeats = 3 if name == "tinyllama-shape" and on_cpu else 6
    row = bench_step_vs_forward(model, batch, repeats=repeats, label=name)
    tokens = sum(encoder.tokenize(batch).lengths())
    params = sum(p.numel() for p in encoder.parameters())
    row.update(
        {
            "device": str(encoder.device),
            "dtype": str(encoder.dtype).removeprefix("torch."),
            "frozen_parameters": params,
            "tokens": tokens,
            "forward_examples_per_second": len(batch) / row["forward_seconds"],
            "step_examples_per_second": len(batch) / row["step_seconds"],
        }
    )
    if not (name == "tinyllama-shape" and on_cpu):  # a 1.1B model's epoch: GPU only
        ids = encoder.tokenize(pool).input_ids

        def extract() -> None:
            extract_features(model.encode, encoder.pad, ids, batch_size=32, progress=False)

        row["extract_texts"] = len(ids)
        row["extract_seconds"], row["extract_cpu_seconds"] = timed_cpu(extract)
        epoch_ids = ids[:64]
        data = LocalData(labels=torch.arange(len(epoch_ids)) % 2, input_ids=epoch_ids)
        optimizer = make_optimizer(model, load_settings([]).train)

        def epoch() -> None:
            train_epoch(model, data, optimizer, batch_size=16, seed=0, epoch=0, progress=False)

        row["epoch_texts"] = len(epoch_ids)
        row["epoch_seconds"], row["epoch_cpu_seconds"] = timed_cpu(epoch)
    if encoder.device.type == "cuda":
        gpu = torch.cuda.get_device_name()
        peak = next((v for k, v in GPU_PEAK.items() if k in gpu), None)
        # forward 2·N·T; backward into the adapter needs activation gradients only: ~2·N·T more
        flops = 4 * params * tokens
        row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        row["gpu"] = gpu
        row["step_mfu"] = flops / row["step_seconds"] / peak if peak else None
    return row


MATMUL_REPEATS = 40


def matmul_ceiling(device: str) -> dict[str, float]:
    """GFLOP/s of one frozen-layer-shaped matmul (816 tokens x 576 -> 1536, SmolLM2's MLP) in
    float32 and in the dtype ``auto`` picks: the most a dtype can speed a matmul-bound pass."""
    from car_fl.model.encoder import pick_device, pick_dtype

    target = pick_device(device)
    out = {}
    for dtype in {torch.float32, pick_dtype("auto", target)}:
        a = torch.randn(816, 576, dtype=dtype, device=target)
        w = torch.randn(1536, 576, dtype=dtype, device=target)
        for _ in range(3):
            a @ w.T
        wall, _ = timed_cpu(lambda a=a, w=w: [a @ w.T for _ in range(MATMUL_REPEATS)])
        flops = 2 * 816 * 576 * 1536 * MATMUL_REPEATS
        out[str(dtype).removeprefix("torch.")] = flops / wall / 1e9
    return out


def bench_slm_one(
    name: str, batch: list[str], pool: list[str], device: str, minilm_dir: str
) -> dict[str, Any]:
    """float32 and ``model.dtype=auto`` side by side in one process, float32 first, each
    model built, timed and freed in turn; which dtype ``auto`` picked and why; the ratios."""
    import gc

    from car_fl.model.encoder import dtype_choice, pick_device

    chosen, why = dtype_choice("auto", pick_device(device))
    rows = {}
    for dtype in ("float32", "auto"):
        rows[dtype] = bench_slm_dtype(name, dtype, batch, pool, device, minilm_dir)
        gc.collect()
    f32, auto = rows["float32"], rows["auto"]
    speedups = {
        key: f32[f"{key}_seconds"] / auto[f"{key}_seconds"]
        for key in ("forward", "step", "extract", "epoch")
        if f"{key}_seconds" in auto
    }
    cpu_speedups = {
        key: f32[f"{key}_cpu_seconds"] / auto[f"{key}_cpu_seconds"]
        for key in ("forward", "step", "extract", "epoch")
        if f"{key}_cpu_seconds" in auto
    }
    return {
        "model": name,
        "auto_dtype": str(chosen).removeprefix("torch."),
        "auto_reason": why,
        "float32": f32,
        "auto": auto,
        "speedup_wall": speedups,
        "speedup_cpu": cpu_speedups,
        "matmul_gflops": matmul_ceiling(device),
        "torch_threads": torch.get_num_threads(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def bench_slm(data: Path, names: list[str], device: str) -> list[dict[str, Any]]:
    """:func:`bench_slm_one` for each model, each in a fresh process (an honest peak memory)."""
    rows = []
    for name in names:
        done = subprocess.run(
            [sys.executable, __file__, "--slm-one", name, "--data", str(data), "--device", device],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"model": name, "error": tail})
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


#: Goals of the dtype choice on a CPU with native bf16 (issue: auto against float32).
SLM_GOALS = {"step": 2.0, "epoch": 2.0, "forward": 3.0, "extract": 3.0}


def print_slm(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if "error" in r:
            print(f"8. {r['model']}: not measured ({r['error']})")
            continue
        f32, auto = r["float32"], r["auto"]
        print(
            f"8. {r['model']} ({f32['frozen_parameters'] / 1e6:.0f}M on {f32['device']}, "
            f"{r['torch_threads']} threads): auto = {r['auto_dtype']} ({r['auto_reason']}); "
            f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB; load after {r['load_after']}"
        )
        print(f"   {'':<34}{'float32':>16}{'auto':>16}{'speed-up':>20}")
        for key, what in (
            ("forward", f"forward, batch {f32['batch'][0]}x{f32['batch'][1]}"),
            ("step", "adapter step, same batch"),
            ("extract", f"feature extraction, {f32.get('extract_texts')} texts"),
            ("epoch", f"adapter epoch, {f32.get('epoch_texts')} texts"),
        ):
            if f"{key}_seconds" not in auto:
                continue
            goal = SLM_GOALS[key]
            wall, cpu = r["speedup_wall"][key], r["speedup_cpu"][key]
            if r["auto_dtype"] == "float32":  # nothing faster here: the goals do not apply
                met = "float32 against float32, no goal"
            else:
                met = f"goal >= {goal}x: " + ("met" if wall >= goal else "MISSED")
            print(
                f"   {what:<34}{f32[f'{key}_seconds']:>7.2f}s/{f32[f'{key}_cpu_seconds']:>5.1f}c"
                f"{auto[f'{key}_seconds']:>8.2f}s/{auto[f'{key}_cpu_seconds']:>5.1f}c"
                f"{wall:>7.2f}x wall {cpu:.2f}x cpu  ({met})"
            )
        gflops = r.get("matmul_gflops", {})
        if len(gflops) == 2:
            f32_rate, auto_rate = gflops["float32"], gflops[r["auto_dtype"]]
            print(
                f"   one layer's matmul: {f32_rate:.0f} GFLOP/s in float32, {auto_rate:.0f} in "
                f"{r['auto_dtype']} = {auto_rate / f32_rate:.2f}x, the ceiling of a "
                "matmul-bound pass"
            )
        mfu = auto.get("step_mfu")
        if mfu:
            print(f"   adapter step MFU ({auto['dtype']}, {auto['gpu']}): {mfu:.1%}")


# --------------------------------------------------------------------------------- main
def smoke_setup(work: Path) -> Path:
    """A tiny random Llama as every figure's encoder, and synthetic data; the data file."""
    from car_fl.testing.tiny import build_llama, synthetic_examples, write_tsv

    MODEL[:] = ["model=local", f"model.name_or_path={build_llama(work / 'smoke-llama')}"]
    return write_tsv(work / "smoke.tsv", synthetic_examples(400, num_labels=2))


def verdict(key: str, value: float) -> str:
    op, target = TARGETS[key]
    ok = value >= target if op == ">=" else value <= target
    return f"target {op} {target}: {'met' if ok else 'MISSED'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="SMSSpamCollection.tsv")
    parser.add_argument("--json", type=Path, default=Path("bench.json"), help="results file")
    parser.add_argument("--texts", type=int, default=2000, help="texts for figure 1")
    parser.add_argument("--rounds", type=int, default=5, help="rounds for figure 4")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every figure on a tiny random Llama and synthetic data (checks that the script "
        "runs to the end; its numbers mean nothing)",
    )
    parser.add_argument(
        "--slm",
        nargs="*",
        choices=SLM_NAMES,
        default=None,
        help="only figure 8: real small LMs (and a random TinyLlama-shaped Llama) as the "
        "encoder, adapter step vs forward, examples/s, peak memory; no name: all",
    )
    parser.add_argument("--slm-one", choices=SLM_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.smoke and not args.data.is_file():
        parser.error(f"{args.data} not found; pass --data path/to/SMSSpamCollection.tsv")
    if args.slm_one or args.slm is not None:
        settings = load_settings(base_overrides(args.data, Path(tempfile.mkdtemp())))
        splits = load_splits(settings.dataset, seed=settings.seed)
        texts = list(splits.train["text"])
        batch = random.Random(1).sample(texts, 16)
        pool = random.Random(2).sample(texts, 256)
        if args.slm_one:
            row = bench_slm_one(args.slm_one, batch, pool, args.device, settings.model.name_or_path)
            print(json.dumps(row))
            return 0
        rows = bench_slm(args.data, args.slm or list(SLM_NAMES), args.device)
        load = [round(x, 2) for x in os.getloadavg()]
        args.json.write_text(json.dumps({"8_slm": rows, "load_after": load}, indent=2))
        print_slm(rows)
        print(f"load average {load}; results: {args.json}")
        return 0
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory(prefix="car-fl-bench-") as tmp:
        work = Path(tmp)
        if args.smoke:
            args.data, args.texts, args.rounds = smoke_setup(work), 64, 2
            IN_PROCESS[0] = True
        settings = load_settings(base_overrides(args.data, work / "cache-main"))
        model = build_retriever(settings, 2)
        results["encoder"] = {
            "name": "tiny random Llama (smoke)" if args.smoke else settings.model.name,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.encoder.parameters()),
            "dtype": str(model.encoder.dtype),
        }

        print("1/7 extraction: length buckets vs arrival order ...", flush=True)
        results["1_bucketing"] = bench_bucketing(settings, model, args.texts)

        print("2/7 classifier FL run (cold cache) vs one extraction pass ...", flush=True)
        results["2_fl_vs_extraction"] = bench_fl_vs_extraction(args.data, work, model, settings)

        print("3/7 adapter step vs forward ...", flush=True)
        splits = load_splits(settings.dataset, seed=settings.seed)
        batch = random.Random(1).sample(list(splits.train["text"]), 16)
        adapter_minilm = CaRRetriever(
            model.encoder, 2, head=settings.head, mode=Mode.ADAPTER_CLASSIFIER
        )
        llama = tiny_llama_retriever(work / "llama", hidden=256, layers=4)
        long_batch = [" ".join(f"w{(i * 7 + j) % 60}" for j in range(48)) for i in range(16)]
        results["3_step_vs_forward"] = [
            bench_step_vs_forward(llama, long_batch, repeats=15, label="Llama 4x256 (random)"),
            bench_step_vs_forward(adapter_minilm, batch, repeats=15, label="MiniLM-L6"),
        ]

        print("4/7 per-round overhead vs an empty ClientApp ...", flush=True)
        warm = work / "cache-cold"  # filled by figure 2
        results["4_round_overhead"] = bench_round_overhead(args.data, work, warm, args.rounds)

        print("5/7 peak RSS of a client process ...", flush=True)
        hidden = model.encoder.hidden_size
        results["5_client_rss"] = [
            client_rss(mode, args.data, work / f"cache-rss-{mode}", 1000, hidden)
            for mode in ("classifier", "adapter")
        ]

        print("6/7 bytes per client per round ...", flush=True)
        results["6_bytes"] = bench_bytes(settings, model, results["2_fl_vs_extraction"])

        print("7/7 comm.dtype float32 vs float16 ...", flush=True)
        results["7_comm_dtype"] = bench_comm_dtype(
            args.data, work, warm, results["2_fl_vs_extraction"]
        )

        if torch.cuda.is_available() and not args.smoke:
            print("GPU: adapter mode on a TinyLlama-sized Llama in bf16 ...", flush=True)
            texts = list(splits.train["text"])
            results["gpu"] = bench_gpu(texts, settings.model.name_or_path)

    results["peak_rss_of_bench"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    args.json.write_text(json.dumps(results, indent=2))
    print_table(results)
    print(f"\nresults: {args.json}")
    return 0


def print_table(r: dict[str, Any]) -> None:
    f1, f2 = r["1_bucketing"], r["2_fl_vs_extraction"]
    f4, f6, f7 = r["4_round_overhead"], r["6_bytes"], r["7_comm_dtype"]
    rss = {x["mode"]: x for x in r["5_client_rss"]}
    lines = [
        f"1. extraction, {f1['texts']} SMS (mean {f1['mean_tokens']:.0f} tokens): bucketed "
        f"{f1['bucketed_seconds']:.2f} s vs arrival order {f1['arrival_seconds']:.2f} s = "
        f"{f1['speedup']:.2f}x faster, same features: {f1['same_features']} "
        f"({verdict('1_bucketing_speedup', f1['speedup'])})",
        f"2. classifier FL run (2 clients, 5 x 2 epochs, cold cache) {f2['fl_seconds']:.1f} s vs "
        f"one extraction pass over the same {f2['texts']} texts {f2['extraction_pass_seconds']:.1f}"
        f" s = {f2['ratio']:.2f}x ({verdict('2_fl_run_vs_extraction', f2['ratio'])}); "
        f"top-1 {f2['final_top1']:.4f}; the same run with every feature cached "
        f"{f2['fl_warm_cache_seconds']:.1f} s, so the encoder work in the cold run was "
        f"{f2['cold_minus_warm_vs_pass']:.2f}x one pass",
    ]
    for f3 in r["3_step_vs_forward"]:
        lines.append(
            f"3. {f3['model']}, batch {f3['batch']}: training step {1e3 * f3['step_seconds']:.1f}"
            f" ms vs forward {1e3 * f3['forward_seconds']:.1f} ms = {f3['ratio']:.2f}x "
            f"({verdict('3_step_vs_forward', f3['ratio'])}); frozen weights with a gradient: "
            f"{f3['frozen_weights_with_grad']}"
        )
    lines += [
        f"4. round overhead (round {f4['ours_round_seconds']:.2f} s - slowest client training "
        f"{f4['ours_slowest_client_train_seconds']:.2f} s) = {f4['ours_overhead_seconds']:.2f} s "
        f"vs empty ClientApp round {f4['empty_clientapp_round_seconds']:.2f} s = "
        f"{f4['ratio']:.2f}x ({verdict('4_round_overhead_vs_floor', f4['ratio'])}); torch threads "
        f"per simulated client: {f4['client_torch_threads']} of {r['machine']['cpus']} CPUs",
    ]
    for mode in ("classifier", "adapter"):
        x = rss[mode]
        line = (
            f"5. client peak RSS, {mode} mode: {x['peak_rss'] / 2**20:.0f} MiB "
            f"({x['rss_after_imports'] / 2**20:.0f} MiB after imports, +"
            f"{x['growth_above_imports'] / 2**20:.0f} MiB) vs encoder weights "
            f"{x['encoder_weight_bytes'] / 2**20:.0f} MiB ({x['weights_dtype']}): growth "
            f"{x['ratio_growth']:.2f}x, absolute {x['ratio_absolute']:.2f}x; at the end, "
            f"+{x['anon_growth_at_end'] / 2**20:.0f} MiB data (anonymous, "
            f"{x['ratio_anon_growth']:.2f}x the weights) and "
            f"+{x['file_growth_at_end'] / 2**20:.0f} MiB mapped files (library code, model files)"
        )
        if mode == "classifier":
            line += f" ({verdict('5_rss_vs_weights_classifier', x['ratio_growth'])} on growth)"
        lines.append(line)
    lines += [
        "6. bytes per client per round (classifier, measured) "
        f"{f6['classifier_measured_payload']:,}"
        f" vs trainable {f6['classifier_trainable']:,} = {f6['classifier_ratio']:.4f}x "
        f"({verdict('6_bytes_vs_trainable', f6['classifier_ratio'])}); whole reply message: "
        f"classifier {f6['classifier_message_bytes']:,} B ({f6['classifier_message_ratio']:.3f}x),"
        f" adapter {f6['adapter_message_bytes']:,} B ({f6['adapter_message_ratio']:.4f}x)",
        f"7. comm.dtype float16 vs float32: top-1 {f7['float16']['top1']:.4f} vs "
        f"{f7['float32']['top1']:.4f} ({f7['top1_difference_pp']:+.2f} pp), bytes "
        f"{f7['bytes_ratio']:.3f}x, time {f7['time_ratio']:.2f}x",
    ]
    if "gpu" in r:
        g = r["gpu"]
        lines.append(
            f"GPU {g['device']}: TinyLlama-shape bf16 adapter+classifier, {g['texts']} texts: "
            f"{g['epoch_seconds']:.1f} s per epoch; "
            f"step/forward {g['step_vs_forward']['ratio']:.2f}x"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
