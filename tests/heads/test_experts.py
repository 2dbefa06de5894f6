"""The mixture of experts: one expert is the dense head, routing, what a step touches, layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.document_head import DocumentHead
from car_fl.heads.experts import MixtureHead, build_layout, experts_in
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


def dense_with_the_same_state(moe: MixtureHead, docs: torch.Tensor) -> DocumentHead:
    """The dense document head holding the mixture's Δ rows (in label order) and query map."""
    dense = DocumentHead(docs.shape[1], len(docs), cfg())
    dense.set_document_features(docs)
    with torch.no_grad():
        assert dense.rows is not None and dense.query_map is not None
        assert moe.query_map is not None
        for c, members in enumerate(moe.member_index):
            dense.rows[members] = moe.experts[c]
        dense.query_map.weight.copy_(moe.query_map.weight)
    return dense


def test_routed_documents_score_exactly_as_the_dense_head_and_the_rest_are_minus_inf() -> None:
    docs = blobs(n_per=9, centres=5)  # 45 documents in 6 experts of unequal size: padding
    g = torch.Generator().manual_seed(5)
    moe = mixture(docs, MoEConfig(experts=6, route=2, eval_route=3))
    with torch.no_grad():
        for rows in moe.experts:
            rows.copy_(torch.randn(rows.shape, generator=g) * 0.3)
        assert moe.query_map is not None
        moe.query_map.weight.copy_(torch.randn(8, 8, generator=g) * 0.1)
    dense = dense_with_the_same_state(moe, docs).eval()
    queries = torch.randn(12, 8, generator=g)
    labels = torch.randint(0, 45, (12,), generator=g)
    for training, reach in ((False, 3), (True, 2)):
        moe.train(training)
        scores = moe(queries, labels=labels if training else None)
        gate = moe.gate_scores(moe.queries(queries))
        routed = gate.topk(reach, dim=1).indices
        if training:  # and each query's true expert
            routed = torch.cat([routed, moe.expert_of[labels][:, None]], dim=1)
        reached = (moe.expert_of[None, :, None] == routed[:, None, :]).any(dim=2)
        expected = dense(queries).masked_fill(~reached, float("-inf"))
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert moe.head_flops_per_query() == (6 + 3 * 8) * 8  # 3 experts of at most ⌈45/6⌉ = 8


def test_evaluation_loss_is_finite_when_the_true_document_was_not_routed() -> None:
    docs = blobs()
    moe = mixture(docs, MoEConfig(experts=4, route=1)).eval()
    queries = docs[:1] + 0.01  # the first document's own query...
    far = (moe.expert_of[0] + 1) % 4
    members = moe.member_index[int(far)]
    scores = moe(queries)
    labels = members[:1]  # ...labelled with a document of an expert it was not routed to
    assert torch.isinf(scores[0, labels[0]])
    loss = moe.evaluation_loss(scores, labels)
    assert torch.isfinite(loss)
    dense = dense_with_the_same_state(moe, docs).eval()
    exact = dense(queries)[0, labels[0]]
    filled = scores.clone()
    filled[0, labels[0]] = exact
    torch.testing.assert_close(loss, F.cross_entropy(filled, labels, reduction="sum"))
    routed_label = moe.member_index[int(moe.expert_of[0])][:1]
    same = moe.evaluation_loss(scores, routed_label)  # routed: the ordinary cross-entropy
    torch.testing.assert_close(same, F.cross_entropy(scores, routed_label, reduction="sum"))


def test_eval_route_below_route_or_above_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match=r"moe.eval_route must be in \[moe.route=4, moe.experts"):
        MoEConfig(experts=8, route=4, eval_route=2)
    with pytest.raises(ValueError, match=r"moe.eval_route must be in"):
        MoEConfig(experts=8, route=4, eval_route=9)
