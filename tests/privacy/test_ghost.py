"""DP-SGD through the adapter from batched passes: the per-example loop's result, and its bound."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from car_fl.data.splits import load_splits
from car_fl.model.retriever import build_retriever
from car_fl.privacy.dpsgd import clipped_gradient_sum, dpsgd_step, noisy_gradient
from car_fl.privacy.ghost import ghost_clipped_sum, supports_ghost
from car_fl.privacy.mechanism import ADAPTER_WEIGHT, clip_per_example, record_part_bounds
from car_fl.settings.schema import AdapterKind
from tests.reference import token_gradients


def adapter_model(make_settings, *overrides: str, dtype: torch.dtype = torch.float64):
    """An adapter+classifier retriever on the tiny Llama (float64 unless ``dtype``), its
    adapter moved off the identity (so the test covers a trained adapter), and 7 examples of
    different lengths. Loaded in float32 whatever the CPU (``auto`` would load bf16 with eager
    attention on a native-bf16 CPU, whose masks transformers does not build for float64)."""
    s = make_settings("mode=adapter", "model.dtype=float32", *overrides)
    splits = load_splits(s.dataset, seed=s.seed)
    model = build_retriever(s, len(splits.label_map)).to(dtype)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.adapter.parameters():  # every kind: its tensors off their start
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    texts = [t for t in splits.train["text"]][:7]
    ids = [torch.tensor(t) for t in model.encoder.tokenize(texts).input_ids]
    assert len({len(t) for t in ids}) > 1, "the examples must need padding"
    labels = torch.tensor(splits.train["label"][:7])
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}
    return model, params, ids, labels


#: Every registered adapter kind, as overrides (a rank below the tiny models' width).
KINDS = {kind.value: (f"adapter.kind={kind.value}", "adapter.rank=4") for kind in AdapterKind}


def adapter_part(params):
    return [k for k in params if k.startswith("adapter.")]


def loop_reference(model, params, ids, labels, clip, adapter_clip=None):
    """One backward per unpadded example, clipped and summed: the definition."""
    grads, losses, predicted = token_gradients(model, params, labels, ids)
    clipped, norms = clip_per_example(grads, clip, adapter_clip)
    return {k: g.sum(dim=0) for k, g in clipped.items()}, losses, predicted, norms


def every_kind_and(*grid: list[object]) -> list[tuple[object, ...]]:
    """The full adapter at every point of ``grid``; the other kinds at each axis's middle and at
    its ends on the first axis (their formulas differ, the padding and clipping paths do not)."""
    points = [("full", *p) for p in itertools.product(*grid)]
    for kind in KINDS:
        if kind != "full":
            points += [
                (kind, first, *(axis[len(axis) // 2] for axis in grid[1:])) for first in grid[0]
            ]
    return points


@pytest.mark.parametrize(
    ("kind", "side", "clip_scale"),  # clip scale: all clipped, some, none
    every_kind_and(["left", "right"], [0.1, 1.0, 100.0]),
)
def test_batched_ghost_clipping_equals_the_per_example_loop(make_settings, side, clip_scale, kind):
    """Every adapter kind: the batched path's clipped sum is the definition's."""
    model, params, ids, labels = adapter_model(
        make_settings, f"model.padding_side={side}", *KINDS[kind]
    )
    _, _, _, norms = loop_reference(model, params, ids, labels, math.inf)
    middle = norms.sort().values[len(norms) // 2 - 1 : len(norms) // 2 + 1].mean()
    clip = float(middle) * clip_scale  # between two examples' norms: none sits on the bound
    summed, losses, predicted, _ = loop_reference(model, params, ids, labels, clip)
    ghost, ghost_losses, ghost_predicted = ghost_clipped_sum(
        model, params, labels, ids, clip=clip, chunk=3
    )
    assert set(ghost) == set(summed) and adapter_part(ghost)
    for name in summed:
        torch.testing.assert_close(ghost[name], summed[name], rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(ghost_losses, losses, rtol=1e-7, atol=1e-9)
    assert torch.equal(ghost_predicted, predicted)


@pytest.mark.parametrize("side", ["left", "right"])
def test_with_eager_attention_the_batched_path_still_equals_the_loop(
    make_settings, monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    """The kernels a native-bf16 CPU runs (``attention_choice``: eager): a padded batch's
    examples still do not mix (pads get no weight, so each record's share is its own), in
    float32, to float32's precision."""
    monkeypatch.setattr("car_fl.model.loading.attention_choice", lambda *_: "eager")
    model, params, ids, labels = adapter_model(
        make_settings, f"model.padding_side={side}", dtype=torch.float32
    )
    assert model.encoder.model.config._attn_implementation == "eager"
    _, _, _, norms = loop_reference(model, params, ids, labels, math.inf)
    clip = float(norms.median())
    summed, losses, predicted, _ = loop_reference(model, params, ids, labels, clip)
    ghost, ghost_losses, ghost_predicted = ghost_clipped_sum(
        model, params, labels, ids, clip=clip, chunk=3
    )
    for name in summed:
        torch.testing.assert_close(ghost[name], summed[name], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ghost_losses, losses, rtol=1e-4, atol=1e-6)
    assert torch.equal(ghost_predicted, predicted)


@pytest.mark.parametrize(
    ("kind", "side", "share"),  # share: the adapter's bound over C
    every_kind_and(["left", "right"], [0.01, 0.5, 0.99]),
)
def test_per_part_clipping_on_the_batched_path_equals_the_loop(
    make_settings, monkeypatch: pytest.MonkeyPatch, side: str, share: float, kind: str
) -> None:
    """dp.adapter_clip under dp=record: the adapter's and the head's parts clipped apart,
    equal to the definition (per-example gradients) whether one part, both or none clip, on
    the batched path and on the loop that models without it take."""
    model, params, ids, labels = adapter_model(
        make_settings, f"model.padding_side={side}", *KINDS[kind]
    )
    _, _, _, norms = loop_reference(model, params, ids, labels, math.inf)
    clip = float(norms.median())
    summed, _, _, _ = loop_reference(model, params, ids, labels, clip, clip * share)
    joint, _, _, _ = loop_reference(model, params, ids, labels, clip)
    ghost, _, _ = ghost_clipped_sum(
        model, params, labels, ids, clip=clip, adapter_clip=clip * share, chunk=3
    )
    monkeypatch.setattr("car_fl.privacy.dpsgd.supports_ghost", lambda *_: False)
    looped, _, _ = clipped_gradient_sum(
        model, params, labels, clip=clip, adapter_clip=clip * share, input_ids=ids
    )
    for name in summed:
        torch.testing.assert_close(ghost[name], summed[name], rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(looped[name], summed[name], rtol=1e-7, atol=1e-9)
    first = adapter_part(summed)[0]
    assert not torch.allclose(summed[first], joint[first])


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_example_adds_at_most_each_part_bound_and_c(make_settings, kind) -> None:
    """The guarantee with per-part bounds: each example's adapter share ≤ C_a, its head share
    ≤ √(C² − C_a²), so its whole share ≤ C, on the batched path and the loop alike."""
    model, params, ids, labels = adapter_model(make_settings, *KINDS[kind])
    clip, adapter_clip = 1e-3, 2e-4
    for i in range(len(ids)):
        one = (labels[i : i + 1], ids[i : i + 1])
        batched, _, _ = ghost_clipped_sum(model, params, *one, clip=clip, adapter_clip=adapter_clip)
        looped, _, _, _ = loop_reference(model, params, one[1], one[0], clip, adapter_clip)
        for alone in (batched, looped):
            parts = adapter_part(alone)
            adapter = math.sqrt(sum(float(alone[k].double().pow(2).sum()) for k in parts))
            head = math.sqrt(
                sum(float(v.double().pow(2).sum()) for k, v in alone.items() if k not in parts)
            )
            assert adapter == pytest.approx(adapter_clip, rel=1e-6)  # far above 2e-4
            assert adapter <= adapter_clip  # strictly: SHRINK, and the contraction in float64
            assert head <= record_part_bounds(clip, adapter_clip)[1]
            assert math.hypot(adapter, head) <= clip


def test_a_per_part_dpsgd_step_adds_noise_sigma_c(make_settings) -> None:
    """The noise (and so ε) is σ·C whatever the split: the step is the per-part clipped sum
    plus exactly the seeded N(0, σ²C²) draw, over q·n."""
    model, _, ids, labels = adapter_model(make_settings)
    trained = model.trainable_parameters()
    before = {k: p.detach().clone() for k, p in trained.items()}
    clip, adapter_clip, sigma = 0.5, 0.05, 0.7
    summed, _, _, _ = loop_reference(model, before, ids, labels, clip, adapter_clip)
    expected = noisy_gradient(
        summed,
        noise_std=sigma * clip,
        expected_batch_size=7.0,
        generator=torch.Generator().manual_seed(3),
    )
    dpsgd_step(
        model,
        trained,
        torch.optim.SGD(list(trained.values()), lr=1.0),
        labels,
        clip=clip,
        adapter_clip=adapter_clip,
        noise_multiplier=sigma,
        expected_batch_size=7.0,
        input_ids=ids,
        generator=torch.Generator().manual_seed(3),
    )
    for name, param in trained.items():
        torch.testing.assert_close(param.detach(), before[name] - expected[name])


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_identity_anchor_joins_the_noised_gradient_unclipped(make_settings, kind) -> None:
    """adapter.anchor under DP-SGD: the step is the noised clipped sum over q·n plus λ·∇‖ADP −
    I‖², a function of the parameters alone (no record's bound, no ε), for every kind."""
    model, _, ids, labels = adapter_model(make_settings, "adapter.anchor=0.3", *KINDS[kind])
    trained = model.trainable_parameters()
    before = {k: p.detach().clone() for k, p in trained.items()}
    clip, sigma = 0.5, 0.7
    summed, _, _, _ = loop_reference(model, before, ids, labels, clip)
    expected = noisy_gradient(
        summed,
        noise_std=sigma * clip,
        expected_batch_size=7.0,
        generator=torch.Generator().manual_seed(3),
    )
    penalty = model.adapter_penalty()
    assert penalty is not None and float(penalty) > 0
    pulls = dict(
        zip(
            trained,
            torch.autograd.grad(penalty, list(trained.values()), allow_unused=True),
            strict=True,
        )
    )
    dpsgd_step(
        model,
        trained,
        torch.optim.SGD(list(trained.values()), lr=1.0),
        labels,
        clip=clip,
        noise_multiplier=sigma,
        expected_batch_size=7.0,
        input_ids=ids,
        generator=torch.Generator().manual_seed(3),
        penalty=model.adapter_penalty,
    )
    for name, param in trained.items():
        pull = pulls[name] if pulls[name] is not None else 0.0
        torch.testing.assert_close(param.detach(), before[name] - expected[name] - pull)
        assert (pulls[name] is not None) == name.startswith("adapter.")


def test_dropout_masks_under_dpsgd_are_not_the_servers_to_know(make_settings) -> None:
    """The adversary's lever: dropout on the soft embeddings masks a padded batch whose shape
    depends on the other records, so masks drawn from a seed the server knows (the run's seed,
    the round, the epoch) would let one record move another's clipped gradient, and the sum by
    more than C. Under DP-SGD the masks come from OS entropy: the same epoch, seed and batches
    twice give two different steps (noise off, so only the masks differ)."""
    from car_fl.model.features import LocalData
    from car_fl.training.train import train_epoch_dpsgd

    model, _, ids, labels = adapter_model(make_settings, "adapter.dropout=0.5")
    data = LocalData(labels=labels, input_ids=[t.tolist() for t in ids])
    start = {k: p.detach().clone() for k, p in model.trainable_parameters().items()}
    after = []
    for _ in range(2):
        model.load_trainable_state_dict(start)
        params = model.trainable_parameters()
        train_epoch_dpsgd(
            model,
            data,
            torch.optim.SGD(list(params.values()), lr=1.0),
            sample_rate=1.0,
            clip=1.0,
            noise_multiplier=0.0,
            steps=1,
            seed=7,
            epoch=0,
            batches=[torch.arange(len(labels))],
            progress=False,
        )
        after.append({k: p.detach().clone() for k, p in params.items()})
    assert not torch.equal(after[0]["adapter.weight"], after[1]["adapter.weight"])


@pytest.mark.parametrize("kind", list(KINDS))
def test_dpsgd_takes_the_batched_path_for_an_adapter_model(make_settings, kind) -> None:
    model, params, ids, labels = adapter_model(make_settings, *KINDS[kind])
    assert supports_ghost(model, params)
    through_dpsgd, _, _ = clipped_gradient_sum(model, params, labels, clip=0.5, input_ids=ids)
    direct, _, _ = ghost_clipped_sum(model, params, labels, ids, clip=0.5)
    for name in direct:
        assert torch.equal(through_dpsgd[name], direct[name])
    head_only = {k: v for k, v in params.items() if not k.startswith("adapter.")}
    assert not supports_ghost(model, head_only)  # classifier mode: vmap over features instead


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_example_adds_at_most_the_bound(make_settings, kind) -> None:
    """The guarantee itself: whatever the example, its share of the sum has norm ≤ C."""
    model, params, ids, labels = adapter_model(make_settings, *KINDS[kind])
    clip = 1e-3
    for i in range(len(ids)):
        alone, _, _ = ghost_clipped_sum(model, params, labels[i : i + 1], ids[i : i + 1], clip=clip)
        norm = math.sqrt(sum(float(v.pow(2).sum()) for v in alone.values()))
        assert norm <= clip * (1 + 1e-9)
        assert norm == pytest.approx(clip, rel=1e-6)  # these gradients are far above 1e-3


@pytest.mark.mps
def test_the_batched_path_runs_on_mps_within_each_bound(make_settings) -> None:
    """On a Mac's GPU (no float64 there): the ghost path's float64 sums and contraction run on
    the CPU, its result comes back on MPS in the model's dtype, each example within C_a, C."""
    model, _, ids, labels = adapter_model(make_settings)
    model = model.float().to("mps")
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}
    clip, adapter_clip = 1e-3, 2e-4
    for i in range(len(ids)):
        alone, _, _ = ghost_clipped_sum(
            model, params, labels[i : i + 1], ids[i : i + 1], clip=clip, adapter_clip=adapter_clip
        )
        assert all(v.device.type == "mps" and v.dtype == torch.float32 for v in alone.values())
        adapter = float(alone[ADAPTER_WEIGHT].cpu().double().norm())
        whole = math.sqrt(sum(float(v.cpu().double().pow(2).sum()) for v in alone.values()))
        assert adapter <= adapter_clip and whole <= clip


def test_an_example_with_a_non_finite_gradient_adds_nothing(make_settings) -> None:
    """A record that overflows the model neither poisons the step nor fails it (either would
    tell the server about that record): it counts as a zero gradient, as in the loop."""
    model, params, ids, labels = adapter_model(make_settings)
    poisoned = int(ids[0][1])
    with torch.no_grad():
        model.encoder.embed(torch.tensor([[poisoned]]))  # the row exists
        model.encoder.model.get_input_embeddings().weight[poisoned] = float("nan")
    hit = [i for i, t in enumerate(ids) if poisoned in t.tolist()]
    assert 0 < len(hit) < len(ids)
    ghost, _, _ = ghost_clipped_sum(model, params, labels, ids, clip=0.5)
    clean = [i for i in range(len(ids)) if i not in hit]
    reference, _, _ = ghost_clipped_sum(
        model, params, labels[clean], [ids[i] for i in clean], clip=0.5
    )
    for name in ghost:
        assert torch.isfinite(ghost[name]).all()
        torch.testing.assert_close(ghost[name], reference[name], rtol=1e-9, atol=1e-12)


# ------------------------------------------- who may not take the batched path, and why


def rwkv_model(tiny_llama, side: str):
    """An adapter retriever over a tiny random RWKV: a recurrent model that takes no position
    ids and ignores the attention mask, so left pads run through its recurrence."""
    import transformers
    from transformers import AutoTokenizer

    from car_fl.model.encoder import Encoder
    from car_fl.model.retriever import CaRRetriever
    from car_fl.settings.inputs import ModelConfig
    from car_fl.settings.schema import HeadConfig, Mode, Pooling

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    torch.manual_seed(0)
    config = transformers.RwkvConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        attention_hidden_size=32,
        intermediate_size=64,
        context_length=128,
    )
    encoder = Encoder(
        transformers.RwkvModel(config).double(),
        tokenizer,
        ModelConfig(name_or_path="rwkv", padding_side=side, pooling=Pooling.MEAN),
    )
    return CaRRetriever(encoder, 3, head=HeadConfig(), mode=Mode.ADAPTER_CLASSIFIER).double()


def test_a_model_whose_records_mix_in_a_padded_batch_takes_the_per_example_loop(
    tiny_llama,
) -> None:
    """The adversary's model: under left padding, RWKV's gradient for a short record depends
    on how long the other records of its batch are (one record would change another's share
    of the sum: DP's sensitivity argument fails). It takes no position ids, so the batched
    path refuses it, and DP-SGD's sum through it is the same whoever shares the batch."""
    model = rwkv_model(tiny_llama, "left")
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}
    texts = ["w1 w2 w3", " ".join(f"w{i}" for i in range(40))]
    ids = [torch.tensor(t) for t in model.encoder.tokenize(texts).input_ids]
    labels = torch.tensor([0, 1])
    alone, _, _ = ghost_clipped_sum(model, params, labels[:1], ids[:1], clip=1e9)
    pair, _, _ = ghost_clipped_sum(model, params, labels, ids, clip=1e9)
    other, _, _ = ghost_clipped_sum(model, params, labels[1:], ids[1:], clip=1e9)
    share = pair["adapter.weight"] - other["adapter.weight"]
    assert not torch.allclose(share, alone["adapter.weight"], rtol=1e-3)  # the coupling is real
    assert not supports_ghost(model, params)
    total, _, _ = clipped_gradient_sum(model, params, labels, clip=1e9, input_ids=ids)
    first, _, _ = clipped_gradient_sum(model, params, labels[:1], clip=1e9, input_ids=ids[:1])
    second, _, _ = clipped_gradient_sum(model, params, labels[1:], clip=1e9, input_ids=ids[1:])
    for name in total:
        torch.testing.assert_close(total[name], first[name] + second[name])


def test_a_head_that_re_encodes_its_documents_through_the_adapter_takes_the_loop(
    make_settings,
) -> None:
    """MIPS scores against its label documents encoded through the adapter: a second path
    from the loss to the adapter that the batched path does not follow."""
    s = make_settings("approach=adapter_mips")
    splits = load_splits(s.dataset, seed=s.seed)
    model = build_retriever(s, len(splits.label_map))
    params = {k: p.detach() for k, p in model.trainable_parameters().items()}
    assert "adapter.weight" in params and not supports_ghost(model, params)


def test_remote_code_takes_the_loop(make_settings) -> None:
    model, params, _, _ = adapter_model(make_settings)
    assert supports_ghost(model, params)
    model.encoder.cfg = dataclasses.replace(model.encoder.cfg, trust_remote_code=True)
    assert not supports_ghost(model, params)
