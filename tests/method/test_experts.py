"""The mixture of experts: one expert is the dense head, routing, what a step touches, layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from car_fl.method.document_head import DocumentHead
from car_fl.method.experts import ExpertLayout, MixtureHead, build_layout, experts_in
from car_fl.settings.schema import HeadConfig, MapKind, MoEConfig


def cfg(**changes: object) -> HeadConfig:
    return HeadConfig(kind="moe", query_map=MapKind.LINEAR, **changes)  # type: ignore[arg-type]


def blobs(n_per: int = 10, centres: int = 4, dim: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(centres, dim, generator=g) * 4
    return torch.cat([m + torch.randn(n_per, dim, generator=g) for m in means])


def mixture(docs: torch.Tensor, moe: MoEConfig, **head: object) -> MixtureHead:
    layout = build_layout(docs, moe, seed=0)
    model = MixtureHead(docs.shape[1], len(docs), cfg(**head), moe, layout)
    model.set_document_features(docs)
    return model


def test_a_mixture_with_one_expert_is_the_dense_document_head() -> None:
    docs = blobs()
    g = torch.Generator().manual_seed(3)
    queries, labels = torch.randn(16, 8, generator=g), torch.randint(0, 40, (16,), generator=g)
    dense = DocumentHead(8, 40, cfg())
    dense.set_document_features(docs)
    moe = mixture(docs, MoEConfig(experts=1, route=1))
    with torch.no_grad():  # the same trained-looking state in both
        delta = torch.randn(40, 8, generator=g) * 0.3
        assert dense.rows is not None
        dense.rows.copy_(delta)
        moe.experts[0].copy_(delta)
        weight = torch.randn(8, 8, generator=g) * 0.1
        for head in (dense, moe):
            assert head.query_map is not None
            head.query_map.weight.copy_(weight)
    for training in (False, True):
        dense.train(training)
        moe.train(training)
        ours = moe(queries, labels=labels)
        assert torch.allclose(ours, dense(queries), atol=1e-6)
        if training:  # the gate's loss is zero with one expert: the same loss and gradients
            loss = moe.loss(ours, labels)
            assert torch.allclose(loss, F.cross_entropy(dense(queries), labels), atol=1e-6)
            loss.backward()
            F.cross_entropy(dense(queries), labels).backward()
            assert dense.rows is not None and dense.rows.grad is not None
            grad = moe.experts[0].grad
            assert grad is not None and torch.allclose(grad, dense.rows.grad, atol=1e-6)


def test_routing_every_expert_scores_like_the_dense_head_and_fewer_leave_minus_inf() -> None:
    docs = blobs()
    queries = docs[::5] + 0.1
    full = mixture(docs, MoEConfig(experts=4, route=4)).eval()
    dense = DocumentHead(8, 40, cfg())
    dense.set_document_features(docs)
    assert torch.allclose(full(queries), dense(queries), atol=1e-6)
    one = mixture(docs, MoEConfig(experts=4, route=1)).eval()
    scores = one(queries)
    finite = torch.isfinite(scores)
    assert (finite.sum(dim=1) == 10).all()  # one expert of 10 documents per query
    for row, label in zip(finite, range(0, 40, 5), strict=True):
        assert bool(row[label])  # each blob's query reaches its own blob
    assert one.head_flops_per_query() == (4 + 10) * 8


def test_training_touches_only_routed_and_true_experts_and_available_ones() -> None:
    docs = blobs()
    moe = mixture(docs, MoEConfig(experts=4, route=1)).train()
    labels = torch.tensor([0, 39])  # first and last blob
    queries = docs[labels] + 0.05
    moe.clear_touched()
    loss = moe.loss(moe(queries, labels=labels), labels)
    loss.backward()
    expert_of = moe.layout.expert_of
    assert moe.touched == {int(expert_of[0]), int(expert_of[39])}
    grads = {c for c, p in enumerate(moe.experts) if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == moe.touched
    keep = {int(expert_of[0])}
    moe.set_available(keep)
    assert [p.requires_grad for p in moe.experts] == [c in keep for c in range(4)]
    moe.clear_touched()
    moe(queries, labels=labels)
    assert moe.touched == keep
    with pytest.raises(ValueError, match=r"experts \[7\] are not in this layout of 4"):
        moe.set_available({7})


def test_two_levels_route_within_the_best_groups() -> None:
    docs = blobs(n_per=8, centres=4)
    moe = mixture(docs, MoEConfig(experts=8, groups=4, route=2, route_groups=1)).eval()
    assert moe.layout.groups == 4
    scores = moe(docs[:3])
    assert moe.layout.group_of is not None
    groups = moe.layout.group_of[moe.layout.expert_of]  # each document's group
    for row in torch.isfinite(scores):
        assert len(set(groups[row.numpy()].tolist())) == 1  # one group reached
    assert moe.head_flops_per_query() == (4 + 2 + 2 * 4) * 8


def test_layouts_travel_as_text_and_name_their_experts() -> None:
    layout = ExpertLayout(np.array([1, 0, 1, 2]), np.array([0, 0, 1]))
    again = ExpertLayout.from_text(layout.to_text())
    assert again.expert_of.tolist() == [1, 0, 1, 2] and again.group_of.tolist() == [0, 0, 1]  # type: ignore[union-attr]
    assert again.digest() == layout.digest()
    assert experts_in({"head.gate": torch.zeros(1), "head.experts.3": torch.zeros(1)}) == {3}
    assert experts_in(["head.gate"]) is None
    with pytest.raises(ValueError, match="at least one document in every expert"):
        ExpertLayout(np.array([0, 2]))
