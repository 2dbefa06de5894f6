"""The real GGUF presets (SmolLM2-135M-Instruct, Gemma 3 270M): loaded offline through the
product's own path, encoding, answering and sharing one copy of the weights. Skipped, with the
install command, where the preset's package is neither installed nor cached."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from car_fl.model import gguf
from car_fl.model.encoder import load_encoder
from car_fl.serving.rag import load_generator
from car_fl.settings.compose import load_settings

pytestmark = pytest.mark.slow
pytest.importorskip("gguf", reason='reading GGUF files needs `pip install -e ".[slm]"`')
SMS = Path(__file__).resolve().parents[3] / "shared" / "data" / "sms_spam" / "SMSSpamCollection.tsv"


def needs(name: str) -> None:
    spec = gguf.PRESETS[name]
    if not gguf.available(spec):
        pytest.skip(f"gguf:{name} is not installed: {spec.install}")


@pytest.mark.parametrize(("name", "hidden"), [("smollm2", 576), ("gemma3", 640)])
def test_a_real_preset_encodes_through_the_same_path_as_any_model(name: str, hidden: int) -> None:
    needs(name)
    encoder = load_encoder(load_settings([f"model={name}"]).model, device="cpu")
    assert encoder.hidden_size == hidden
    texts = ["WINNER!! claim your free prize now", "are we still on for lunch?"]
    ids, mask = encoder.pad(encoder.tokenize(texts).input_ids)
    with torch.inference_mode():
        pooled = encoder.pool(encoder.transform(encoder.embed(ids), mask), mask)
    assert pooled.shape == (2, hidden) and torch.isfinite(pooled).all()
    assert not torch.allclose(pooled[0], pooled[1])


def test_smollm2_answers_a_question_from_its_document_and_shares_its_weights() -> None:
    needs("smollm2")
    from car_fl.heads.scorer import Hit

    generator = load_generator("gguf:smollm2", device="cpu")
    hits = [Hit("d1", "The capital of France is Paris, on the Seine.", 1.0)]
    from car_fl.serving.rag import PLAIN_INSTRUCTION

    question = "What is the capital of France?"
    answer = generator.answer(question, hits, max_new_tokens=12, instruction=PLAIN_INSTRUCTION)
    assert "paris" in answer.text.lower()
    cfg = load_settings(["model=smollm2"]).model
    shared = generator.as_encoder(cfg)
    separate = load_encoder(cfg, device="cpu")
    texts = ["are we still on for lunch?"]
    out = []
    for encoder in (shared, separate):
        ids, mask = encoder.pad(encoder.tokenize(texts).input_ids)
        with torch.inference_mode():
            out.append(encoder.pool(encoder.transform(encoder.embed(ids), mask), mask))
    assert torch.equal(out[0], out[1])  # one copy of the weights, the same features


@pytest.mark.skipif(not SMS.is_file(), reason="needs ../shared/data/sms_spam beside the clone")
def test_car_fl_train_on_smollm2_works_offline(tmp_path: Path) -> None:
    needs("smollm2")
    command = [sys.executable, "-m", "car_fl.cli", "train", "model=smollm2"]
    command += [f"dataset.path={SMS}", "dataset.max_examples=120", "train.epochs=1"]
    command += [f"output_dir={tmp_path / 'run'}", "progress=false", "device=cpu"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoints" / "best").is_dir()
