"""The frozen encoder: loading, freezing, the identity adapter, pooling, EOS handling."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch

from car_fl.model.encoder import (
    EncoderLoadError,
    dtype_choice,
    load_encoder,
    load_pretrained,
    pick_device,
    pick_dtype,
    pool,
)
from car_fl.model.loading import attention_choice
from car_fl.model.retriever import CaRRetriever
from car_fl.settings.schema import (
    AdapterConfig,
    AdapterKind,
    HeadConfig,
    Mode,
    ModelConfig,
    OptimizerKind,
    Pooling,
    TrainConfig,
)
from car_fl.training.train import make_optimizer


def cfg(path: Path, **kw: object) -> ModelConfig:
    return ModelConfig(name="local", name_or_path=str(path), **kw)  # type: ignore[arg-type]


@pytest.fixture(params=["llama", "bert"])
def model_dir(request: pytest.FixtureRequest, tiny_llama: Path, tiny_bert: Path) -> Path:
    return tiny_llama if request.param == "llama" else tiny_bert


def test_encoder_is_frozen_and_in_eval_mode(model_dir: Path) -> None:
    encoder = load_encoder(cfg(model_dir), device="cpu")
    assert not any(p.requires_grad for p in encoder.parameters())
    encoder.train()
    assert not encoder.model.training, "the frozen model must stay in eval mode"


@pytest.mark.parametrize("kind", list(AdapterKind))
def test_identity_adapter_gives_the_plain_models_hidden_states(
    model_dir: Path, kind: AdapterKind
) -> None:
    """Every adapter kind, untrained, changes nothing: the plain model's states, bit for bit."""
    encoder = load_encoder(cfg(model_dir), device="cpu")
    adapter = AdapterConfig(kind=kind, rank=4)
    model = CaRRetriever(
        encoder, 3, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER, adapter=adapter, seed=7
    )
    ids, mask = encoder.pad(encoder.tokenize(["w1 k2 w3 w4", "hello there"]).input_ids)
    with torch.no_grad():
        plain = encoder.model(input_ids=ids, attention_mask=mask).last_hidden_state
        adapted = encoder.transform(model.adapter(encoder.embed(ids)), mask)
    real = mask.bool()
    assert torch.equal(plain[real], adapted[real])


def test_adapter_changes_hidden_states_when_not_identity(tiny_llama: Path) -> None:
    encoder = load_encoder(cfg(tiny_llama), device="cpu")
    model = CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    ids, mask = encoder.pad(encoder.tokenize(["w1 k2 w3"]).input_ids)
    with torch.no_grad():
        before = model.encode(ids, mask)
        model.adapter.get_parameter("weight").mul_(2.0)
        after = model.encode(ids, mask)
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("pooling", ["eos", "mean"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_pooled_vector_does_not_depend_on_the_batch(
    model_dir: Path, pooling: str, side: str
) -> None:
    encoder = load_encoder(cfg(model_dir, pooling=pooling, padding_side=side), device="cpu")
    model = CaRRetriever(encoder, 2, head=HeadConfig(), mode=Mode.CLASSIFIER)
    texts = ["w1", "w2 w3 w4 w5 w6 w7 w8 k1 w9 w10", "k3 w4 w5"]
    tokens = encoder.tokenize(texts).input_ids
    with torch.no_grad():
        batch = model.encode(*encoder.pad(tokens))
        for i, seq in enumerate(tokens):
            alone = model.encode(*encoder.pad([seq]))
            torch.testing.assert_close(alone[0], batch[i], rtol=1e-5, atol=1e-5)


def test_pad_token_equal_to_eos_does_not_move_the_eos_position(tiny_llama: Path) -> None:
    encoder = load_encoder(cfg(tiny_llama, padding_side="right"), device="cpu")
    assert encoder.pad_id == encoder.eos_id  # the Llama tokenizer has no pad token
    eos = encoder.eos_id
    ids, mask = encoder.pad([[1, 5, eos], [1, eos]])
    assert ids[1].tolist() == [1, eos, eos]  # padding is indistinguishable from EOS by id
    hidden = torch.arange(6, dtype=torch.float32).view(2, 3, 1)
    pooled = pool(hidden, mask, Pooling.EOS)
    assert pooled.flatten().tolist() == [2.0, 4.0]  # the real EOS of each row, found by mask


def test_mean_pooling_ignores_nonfinite_values_at_padding() -> None:
    hidden = torch.tensor([[[1.0], [3.0], [float("nan")]]])
    mask = torch.tensor([[1, 1, 0]])
    assert pool(hidden, mask, Pooling.MEAN).item() == 2.0
    assert pool(hidden, mask, Pooling.EOS).item() == 3.0


def test_eos_is_appended_when_the_tokenizer_does_not_add_it(tiny_llama: Path) -> None:
    encoder = load_encoder(cfg(tiny_llama, max_length=5), device="cpu")
    raw = encoder.tokenizer("w1 w2", add_special_tokens=True)["input_ids"]
    assert raw[-1] != encoder.tokenizer.eos_token_id
    assert encoder.append_eos
    ids = encoder.tokenize(["w1 w2", "w1 w2 w3 w4 w5 w6 w7"]).input_ids
    assert ids[0] == [*raw, encoder.tokenizer.eos_token_id]
    assert len(ids[1]) == 5 and ids[1][-1] == encoder.tokenizer.eos_token_id


def test_bert_tokenizer_keeps_its_sep_as_the_final_token(tiny_bert: Path) -> None:
    encoder = load_encoder(cfg(tiny_bert), device="cpu")
    assert not encoder.append_eos
    ids = encoder.tokenize(["w1 w2"]).input_ids[0]
    assert ids[-1] == encoder.tokenizer.sep_token_id


def test_missing_local_folder_error_names_model_and_fix(tmp_path: Path) -> None:
    with pytest.raises(EncoderLoadError, match=r"nowhere.*model.name_or_path|nowhere.*folder"):
        load_encoder(cfg(tmp_path / "nowhere"), device="cpu")


def test_unreachable_hub_model_error_names_both_offline_fixes() -> None:
    bad = ModelConfig(name="x", name_or_path="no-such-org/no-such-model-xyz")
    fixes = r"no-such-org/no-such-model-xyz.*model=minilm.*model=local model.name_or_path=/path"
    with pytest.raises(EncoderLoadError, match=fixes):
        load_encoder(bad, device="cpu")


@pytest.fixture
def native_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU that torch says runs bf16 natively (AVX512-BF16), whatever this one is."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "avx2": True})


@pytest.fixture
def emulated_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2/AVX512 CPU without bf16 instructions."""
    caps = {"avx512_bf16": False, "amx_bf16": False, "avx512_f": True, "avx2": True}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)


def test_auto_takes_bf16_on_a_cpu_with_native_bf16_and_says_why(native_bf16_cpu: None) -> None:
    dtype, why = dtype_choice("auto", torch.device("cpu"))
    assert dtype is torch.bfloat16 and "avx512_bf16" in why


def test_auto_falls_back_to_float32_on_a_cpu_without_native_bf16(emulated_bf16_cpu: None) -> None:
    dtype, why = dtype_choice("auto", torch.device("cpu"))
    assert dtype is torch.float32 and "no native bf16" in why
    assert dtype_choice("bfloat16", torch.device("cpu")) == (
        torch.bfloat16,
        "as set by model.dtype",
    )


def test_auto_on_a_native_bf16_cpu_keeps_every_trained_tensor_float32(
    tiny_llama: Path, native_bf16_cpu: None
) -> None:
    encoder = load_encoder(cfg(tiny_llama, dtype="auto"), device="cpu")
    assert encoder.dtype is torch.bfloat16  # the frozen weights take the fast path
    head = HeadConfig(pre_classifier_dim=8)
    model = CaRRetriever(encoder, 2, head=head, mode=Mode.ADAPTER_CLASSIFIER)
    optimizer = make_optimizer(model, TrainConfig(optimizer=OptimizerKind.ADAM, lr=1e-3))
    ids, mask = encoder.pad(encoder.tokenize(["w1 w2 w3", "k1"]).input_ids)
    features = model.encode(ids, mask)
    assert features.dtype is torch.float32  # pooled in float32, cached and clipped as such
    _, loss = model(ids, mask, labels=torch.tensor([0, 1]))
    assert loss is not None
    loss.backward()
    optimizer.step()
    trained = model.trainable_parameters()
    assert "adapter.weight" in trained and len(trained) >= 3
    for name, param in trained.items():
        assert param.dtype is torch.float32, name
        assert param.grad is not None and param.grad.dtype is torch.float32, name
        assert all(v.dtype is torch.float32 for v in optimizer.state[param].values() if v.dim())
    assert not torch.equal(trained["adapter.weight"], torch.eye(encoder.hidden_size))


def test_bf16_on_a_cpu_loads_eager_attention_and_every_other_choice_sdpa(
    tiny_llama: Path, native_bf16_cpu: None
) -> None:
    cpu = torch.device("cpu")
    assert attention_choice(torch.bfloat16, cpu) == "eager"  # CPU SDPA's bf16 backward is slow
    for dtype, device in (
        (torch.float32, cpu),
        (torch.bfloat16, torch.device("cuda")),
        (torch.float16, torch.device("mps")),
    ):
        assert attention_choice(dtype, device) == "sdpa", (dtype, device)
    bf16 = load_encoder(cfg(tiny_llama, dtype="auto"), device="cpu")
    f32 = load_encoder(cfg(tiny_llama, dtype="float32"), device="cpu")
    assert bf16.model.config._attn_implementation == "eager"
    assert f32.model.config._attn_implementation == "sdpa"
    texts = ["w1 w2 w3 w4", "k1"]
    # the same attention either way: the bf16 features agree with float32's to bf16's precision
    a, b = (
        e.pool(e.transform(e.embed(ids), mask), mask)
        for e in (bf16, f32)
        for ids, mask in [e.pad(e.tokenize(texts).input_ids)]
    )
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.99


class _NoSdpa:
    """An auto class whose model has no SDPA kernels (transformers raises ValueError)."""

    calls: ClassVar[list[dict[str, object]]] = []

    @classmethod
    def from_pretrained(cls, name: str, **kwargs: object) -> str:
        cls.calls.append(kwargs)
        if kwargs.get("attn_implementation") == "sdpa":
            raise ValueError("this model does not support `attn_implementation='sdpa'` yet")
        if kwargs.get("attn_implementation") == "eager":
            raise ValueError("no weights found in " + name)
        return f"{name} {kwargs.get('attn_implementation', 'default')}"


def test_a_model_without_sdpa_falls_back_to_the_default_and_other_errors_propagate() -> None:
    _NoSdpa.calls.clear()
    cpu = torch.device("cpu")
    got = load_pretrained(_NoSdpa, "m", dtype=torch.float32, device=cpu, revision="r")
    assert got == "m default"
    assert _NoSdpa.calls == [
        {"dtype": torch.float32, "attn_implementation": "sdpa", "revision": "r"},
        {"dtype": torch.float32, "revision": "r"},
    ]
    # eager was asked for on purpose (bf16 on a CPU): its failure is the model's, not the kernels'
    with pytest.raises(ValueError, match="no weights found in m"):
        load_pretrained(_NoSdpa, "m", dtype=torch.bfloat16, device=cpu)


def test_device_and_dtype_selection() -> None:
    assert pick_device("cpu").type == "cpu"
    assert pick_dtype("float32", torch.device("cpu")) is torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            pick_device("cuda")


def test_bfloat16_encoder_runs_and_pools(tiny_llama: Path) -> None:
    encoder = load_encoder(cfg(tiny_llama, dtype="bfloat16"), device="cpu")
    assert encoder.dtype is torch.bfloat16
    model = CaRRetriever(encoder, 2, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    ids, mask = encoder.pad(encoder.tokenize(["w1 w2"]).input_ids)
    logits, _ = model(ids, mask)
    assert logits.dtype is torch.float32 and torch.isfinite(logits).all()
    assert model.adapter.weight.dtype is torch.float32


def test_last_pooling_appends_nothing_and_reads_the_texts_own_last_token(tiny_llama: Path) -> None:
    eos = load_encoder(cfg(tiny_llama, pooling="eos"), device="cpu")
    last = load_encoder(cfg(tiny_llama, pooling="last"), device="cpu")
    raw = last.tokenizer("w1 w2", add_special_tokens=True)["input_ids"]
    assert last.tokenize(["w1 w2"]).input_ids == [raw]
    assert eos.tokenize(["w1 w2"]).input_ids == [[*raw, eos.eos_id]]
    hidden = torch.arange(6, dtype=torch.float32).view(1, 3, 2)
    assert pool(hidden, torch.tensor([[1, 1, 0]]), Pooling.LAST).tolist() == [[2.0, 3.0]]


def test_a_text_that_tokenises_to_nothing_is_one_pad_token_and_trains(tiny_llama: Path) -> None:
    """No BOS and ``last`` pooling: an empty text used to be an empty sequence, which crashed
    pooling (and under DP-SGD a crash tells the server the record was sampled)."""
    from tokenizers import processors

    from car_fl.privacy.dpsgd import clipped_gradient_sum

    encoder = load_encoder(cfg(tiny_llama, pooling="last"), device="cpu")
    encoder.tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="$A")
    assert encoder.tokenizer("", add_special_tokens=True)["input_ids"] == []
    ids = encoder.tokenize(["", "w1 w2"]).input_ids
    assert ids[0] == [encoder.pad_id] and ids[1] == encoder.tokenizer("w1 w2")["input_ids"]
    model = CaRRetriever(encoder, 2, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER)
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}
    summed, losses, _ = clipped_gradient_sum(
        model, params, torch.tensor([0, 1]), clip=1.0, input_ids=[torch.tensor(i) for i in ids]
    )
    assert torch.isfinite(losses).all()
    assert all(torch.isfinite(v).all() for v in summed.values())


def test_a_prompt_template_wraps_the_text_and_cuts_the_text_never_the_template(
    tiny_llama: Path,
) -> None:
    prompt = 'This sentence : "{text}" means in one word:"'
    encoder = load_encoder(cfg(tiny_llama, pooling="last", prompt=prompt), device="cpu")
    tok = encoder.tokenizer
    before = tok('This sentence : "', add_special_tokens=False)["input_ids"]
    after = tok('" means in one word:"', add_special_tokens=False)["input_ids"]
    text = tok("w1 w2 w3", add_special_tokens=False)["input_ids"]
    bos = tok("", add_special_tokens=True)["input_ids"]
    assert encoder.tokenize(["w1 w2 w3"]).input_ids == [[*bos, *before, *text, *after]]
    budget = len(bos) + len(before) + len(after) + 2
    (cut,) = encoder.tokenize(["w1 w2 w3 w4 w5"], max_length=budget).input_ids
    assert len(cut) == budget and cut[-len(after) :] == after
    with pytest.raises(ValueError, match="no room for the text"):
        encoder.tokenize(["w1"], max_length=budget - 2)


def test_a_prompt_without_exactly_one_text_slot_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model.prompt=.*\{text\} exactly once"):
        ModelConfig(prompt="no slot here")


def test_a_chosen_layer_is_pooled_and_an_impossible_one_is_named(tiny_llama: Path) -> None:
    first = load_encoder(cfg(tiny_llama, layer=0, pooling="mean"), device="cpu")
    ids, mask = first.pad(first.tokenize(["w1 w2 w3"]).input_ids)
    with torch.no_grad():
        embeddings = first.embed(ids)
        assert torch.equal(first.transform(embeddings, mask), embeddings)  # layer 0: TKN
        final = load_encoder(cfg(tiny_llama, pooling="mean"), device="cpu")
        assert not torch.equal(final.transform(embeddings, mask), embeddings)
    wrong = load_encoder(cfg(tiny_llama, layer=99), device="cpu")
    with pytest.raises(ValueError, match=r"model.layer=99 is out of range.*2 blocks"):
        wrong.transform(embeddings, mask)


def test_l2_normalised_features_have_unit_norm_whatever_the_model_scale(tiny_llama: Path) -> None:
    encoder = load_encoder(cfg(tiny_llama, normalize="l2", pooling="mean"), device="cpu")
    ids, mask = encoder.pad(encoder.tokenize(["w1 w2 w3", "k1", "w4 w5"]).input_ids)
    with torch.no_grad():
        pooled = encoder.pool(encoder.transform(encoder.embed(ids) * 1e3, mask), mask)
    torch.testing.assert_close(pooled.norm(dim=-1), torch.ones(3))


def test_the_adapters_identity_answer_follows_every_change_of_its_weight() -> None:
    """Asked at every scoring step, answered again only after the weight changed."""
    from car_fl.adapters.adapter import FullAdapter

    adapter = FullAdapter(6)
    assert adapter.is_identity() and adapter.is_identity()
    optimizer = torch.optim.SGD(adapter.parameters(), lr=0.1)
    adapter(torch.randn(2, 3, 6)).sum().backward()
    optimizer.step()
    assert not adapter.is_identity()  # an optimiser step
    adapter.load_state_dict({"weight": torch.eye(6)})
    assert adapter.is_identity()  # a load
    with torch.no_grad():
        adapter.weight[0, 1] = 1e-30
    assert not adapter.is_identity()  # an in-place write
    adapter.weight.data = torch.eye(6)
    assert adapter.is_identity()  # a new tensor
    with torch.no_grad():
        adapter.weight[2, 2] = float("nan")
    assert not adapter.is_identity()
