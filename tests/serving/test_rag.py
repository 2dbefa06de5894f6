"""car_fl.serving.rag: the prompt holds the documents in rank order; a tiny Llama answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from car_fl.heads.scorer import Hit
from car_fl.serving.rag import (
    INSTRUCTION,
    Generator,
    GeneratorLoadError,
    build_prompt,
    load_generator,
)

HITS = [Hit("d7", "k7 w7 w27", 0.6), Hit("d2", "k2 w2 w22", 0.3), Hit("d9", "k1 w9 w29", 0.1)]


def test_the_prompt_holds_the_documents_in_rank_order_then_the_question() -> None:
    prompt = build_prompt("w7 w44", HITS)
    places = [prompt.index(h.text) for h in HITS]
    assert places == sorted(places) and prompt.index(INSTRUCTION) < places[0]
    assert prompt.index("Question: w7 w44") > places[-1]
    assert [prompt.index(f"({h.id})") for h in HITS] == sorted(
        prompt.index(f"({h.id})") for h in HITS
    )


def test_a_tokenizer_with_a_chat_template_gets_the_prompt_as_a_user_turn(
    tiny_generator: Path,
) -> None:
    generator = load_generator(str(tiny_generator), device="cpu")
    tokenizer = generator.tokenizer
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    prompt = build_prompt("w7 w44", HITS, tokenizer)
    assert prompt.startswith("<|user|>" + INSTRUCTION) and prompt.endswith("<|assistant|>")
    assert "Question: w7 w44" in prompt and all(h.text in prompt for h in HITS)


def test_the_tiny_llama_answers_end_to_end_from_the_documents(tiny_generator: Path) -> None:
    generator = load_generator(str(tiny_generator), device="cpu")
    answer = generator.answer("w7 w44", HITS, max_new_tokens=6)
    assert answer.sources == ("d7", "d2", "d9")
    assert answer.text.strip() and len(generator.tokenizer(answer.text)["input_ids"]) <= 6 + 1
    assert all(h.text in answer.prompt for h in HITS)
    again = generator.answer("w7 w44", HITS, max_new_tokens=6)
    assert again.text == answer.text  # greedy: the same answer twice


def test_long_documents_are_cut_so_prompt_and_answer_fit_the_context(
    tiny_generator: Path,
) -> None:
    generator = load_generator(str(tiny_generator), device="cpu")
    assert generator.context == 256  # the tiny Llama's max_position_embeddings
    long = [Hit(f"d{i}", " ".join(f"w{(i + j) % 60}" for j in range(300)), 0.3) for i in range(3)]
    prompt = generator.prompt("w7 w44", long, max_new_tokens=32)
    tokens = len(generator.tokenizer(prompt)["input_ids"])
    assert tokens + 32 <= 256
    for hit in long:  # each keeps its beginning, in rank order
        assert f"({hit.id}) {hit.text[:20]}" in prompt and hit.text not in prompt
    answer = generator.answer("w7 w44", long, max_new_tokens=32)
    assert answer.text


def test_no_room_for_the_documents_is_a_clear_error(tiny_generator: Path) -> None:
    generator = load_generator(str(tiny_generator), device="cpu")
    with pytest.raises(ValueError, match="leaving no room"):
        generator.prompt("w1 " * 200, HITS, max_new_tokens=64)


def test_a_missing_generator_names_the_path_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(GeneratorLoadError, match=r"could not load the generator .*config\.json"):
        load_generator(str(tmp_path / "nowhere"), device="cpu")


def test_the_generator_refuses_zero_new_tokens(tiny_generator: Path) -> None:
    generator = load_generator(str(tiny_generator), device="cpu")
    assert isinstance(generator, Generator)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generator.answer("w1", HITS, max_new_tokens=0)


def test_the_generator_loads_the_encoders_attention_kernels(
    tiny_generator: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --same-model retrieves with the generator's weights: they must compute what the encoder
    # loaded on its own computes, so both take attention_choice's kernels (eager for bf16 on a
    # CPU, whatever this CPU is)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True})
    bf16 = load_generator(str(tiny_generator), device="cpu")
    assert bf16.model.dtype is torch.bfloat16
    assert bf16.model.config._attn_implementation == "eager"
    f32 = load_generator(str(tiny_generator), device="cpu", dtype="float32")
    assert f32.model.config._attn_implementation == "sdpa"
