"""The method's mixture of experts: documents in balanced clusters, a gate, one expert per cluster.

:class:`MixtureHead` is the document head (:mod:`car_fl.heads.document_head`) with its Δ rows
split per expert (``experts.<c>``, the :class:`~car_fl.heads.clustering.ExpertLayout`) and a
gate (``gate``, and ``group_gate`` in two-level mode). A query's documents in its ``route``
best experts get the document head's score, the others -inf; training adds the true document's
expert (teacher forcing) and a gate loss. Only *available* experts (those the server sent) are
scored and trained. See docs/retrieval.md, "Mixture of experts".
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from car_fl.heads.clustering import ExpertLayout
from car_fl.heads.config import HeadConfig, HeadKind, MoEConfig
from car_fl.heads.document_head import DocumentHead
from car_fl.heads.scorer import Scorer, ScorerSpec

#: Name prefix of the expert tensors in the trainable state (``head.experts.<c>``).
EXPERT_PREFIX = "head.experts."


def experts_in(state: dict[str, torch.Tensor] | set[str] | list[str]) -> set[int] | None:
    """The experts whose tensors ``state`` holds (None when it holds no expert: all)."""
    found = {int(name[len(EXPERT_PREFIX) :]) for name in state if name.startswith(EXPERT_PREFIX)}
    return found or None


def build_layout(features: torch.Tensor, moe: MoEConfig, *, seed: int) -> ExpertLayout:
    """Balanced clusters of the document embeddings ``(documents, d)``."""
    from car_fl.heads.clustering import balanced_tree

    expert_of, group_of = balanced_tree(
        F.normalize(features.float(), dim=-1).numpy(),
        experts=moe.experts,
        groups=moe.groups,
        seed=seed,
        iterations=moe.iterations,
    )
    return ExpertLayout(expert_of=expert_of, group_of=group_of)


class MixtureHead(DocumentHead):
    """The document head with one Δ tensor per expert and a gate (see the module)."""

    expert_of: torch.Tensor  # (documents,) buffers
    group_of: torch.Tensor  # (experts,)
    available: torch.Tensor  # (experts,) bool
    order: torch.Tensor  # (documents,) label ids, expert by expert
    slots: torch.Tensor  # (experts + 1, width) positions in ``order``; padding: documents
    slot_labels: torch.Tensor  # (experts + 1, width) label ids; padding: documents

    def __init__(
        self,
        dim: int,
        num_labels: int,
        cfg: HeadConfig,
        moe: MoEConfig,
        layout: ExpertLayout,
    ) -> None:
        super().__init__(dim, num_labels, cfg, rows=False)
        if len(layout.expert_of) != num_labels:
            raise ValueError(
                f"an expert layout of {len(layout.expert_of)} documents for {num_labels}"
            )
        self.layout = layout
        self.route = min(moe.route, layout.experts)
        #: Experts a query reaches outside training.
        self.eval_route = min(moe.eval_route or moe.route, layout.experts)
        self.route_groups = moe.route_groups
        members = [torch.from_numpy(layout.members(c)) for c in range(layout.experts)]
        self.member_index = members  # label indices of each expert's rows
        # Slot tables for scoring every routed expert at once (no loop over experts): expert
        # c's documents padded to the largest expert's size; row ``experts`` is an empty
        # expert (all padding), which stands for "no expert" (unavailable, or routed twice).
        width = max(len(m) for m in members)
        order = torch.cat(members)  # label ids, expert by expert
        slots = torch.full((layout.experts + 1, width), len(order), dtype=torch.long)
        slot_labels = torch.full((layout.experts + 1, width), num_labels, dtype=torch.long)
        start = 0
        for c, m in enumerate(members):  # built once, at construction
            slots[c, : len(m)] = torch.arange(start, start + len(m))
            slot_labels[c, : len(m)] = m
            start += len(m)
        self.register_buffer("order", order, persistent=False)  # (documents,)
        self.register_buffer("slots", slots, persistent=False)  # (experts + 1, width)
        self.register_buffer("slot_labels", slot_labels, persistent=False)  # same; pad: N
        self.experts = nn.ParameterList(
            [nn.Parameter(torch.zeros(len(m), dim)) for m in members] if cfg.train_rows else []
        )
        self.register_buffer("expert_of", torch.from_numpy(layout.expert_of), persistent=False)
        self.gate = nn.Parameter(torch.zeros(layout.experts, dim))
        self.group_gate = (
            nn.Parameter(torch.zeros(int(layout.groups or 0), dim))
            if layout.group_of is not None
            else None
        )
        if layout.group_of is not None:
            self.register_buffer("group_of", torch.from_numpy(layout.group_of), persistent=False)
        self.log_gate_scale = nn.Parameter(self.log_scale.detach().clone())
        self.register_buffer(
            "available", torch.ones(layout.experts, dtype=torch.bool), persistent=False
        )
        self.last_gate: torch.Tensor | None = None
        self.last_queries: torch.Tensor | None = None
        #: Experts that took part in a training step since :meth:`clear_touched`.
        self.touched: set[int] = set()

    # ------------------------------------------------------------------------------ documents
    def set_document_features(self, features: torch.Tensor) -> None:
        """The documents' embeddings; each gate vector starts at its documents' mean."""
        super().set_document_features(features)
        with torch.no_grad():
            docs = self.documents
            centers = torch.stack([docs[m].mean(0) for m in self.member_index])
            self.gate.copy_(F.normalize(centers, dim=-1))
            if self.group_gate is not None:
                group_of = self.group_of
                groups = [
                    docs[(group_of[self.expert_of] == g)].mean(0)
                    for g in range(len(self.group_gate))
                ]
                self.group_gate.copy_(F.normalize(torch.stack(groups), dim=-1))

    def add_documents(self, features: torch.Tensor) -> range:
        raise NotImplementedError(
            "new documents join a mixture of experts by re-clustering; train a document head "
            "(head.kind=document) to add rows to"
        )

    def set_available(self, experts: set[int] | None) -> None:
        """Score and train only these experts (None: all); the others do not require a gradient."""
        chosen = set(range(self.layout.experts)) if experts is None else set(experts)
        unknown = sorted(e for e in chosen if not 0 <= e < self.layout.experts)
        if unknown:
            raise ValueError(f"experts {unknown} are not in this layout of {self.layout.experts}")
        mask = torch.zeros(self.layout.experts, dtype=torch.bool)
        mask[sorted(chosen)] = True
        self.available.copy_(mask)
        for c, rows in enumerate(self.experts):
            rows.requires_grad_(c in chosen)

    def clear_touched(self) -> None:
        self.touched = set()

    # -------------------------------------------------------------------------------- routing
    def gate_scores(self, q: torch.Tensor) -> torch.Tensor:
        """The gate's logits over the experts ``(batch, experts)``."""
        return self.log_gate_scale.exp() * q @ F.normalize(self.gate, dim=-1).T

    def route_experts(self, q: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Each query's best available experts ``(batch, route)`` (``eval_route`` outside
        training; two levels: within its ``route_groups`` best groups)."""
        with torch.no_grad():
            logits = gate.detach().masked_fill(~self.available, float("-inf"))
            if self.group_gate is not None:
                groups = q.detach() @ F.normalize(self.group_gate.detach(), dim=-1).T
                top = groups.topk(min(self.route_groups, groups.shape[1]), dim=1).indices
                reached = (self.group_of[None, :, None] == top[:, None, :]).any(dim=2)
                logits = logits.masked_fill(~reached, float("-inf"))
            route = self.route if self.training else self.eval_route
            k = min(route, int(self.available.sum()))
            best = logits.topk(k, dim=1)
            # an expert out of reach (another group, or unavailable) is "no expert"
            return best.indices.masked_fill(~torch.isfinite(best.values), self.layout.experts)

    def all_rows(self) -> torch.Tensor:
        """Every document's row ``(g(d̂ᵢ) + Δᵢ)^`` in expert order ``(documents + 1, d)``, with a
        zero row last (the padding slots')."""
        delta = torch.cat(list(self.experts)) if len(self.experts) else None
        rows = self.document_rows(self.order, delta)
        return torch.cat([rows, rows.new_zeros(1, self.dim)])

    def forward(
        self,
        features: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(batch, d)`` → ``(batch, documents)``: -inf outside the routed experts, scored at
        once (:func:`score_by_expert`). While training, ``labels`` add each query's true expert
        (teacher forcing)."""
        labels = labels if self.training else None
        q = self.queries(features)  # (batch, d)
        gate = self.gate_scores(q)
        self.last_gate, self.last_queries = gate, q
        chosen = self.route_experts(q, gate)  # (batch, route)
        none = self.layout.experts
        if labels is not None:  # teacher forcing: the true document's expert, if not routed
            true = self.expert_of[labels][:, None]
            true = true.masked_fill((chosen == true).any(dim=1, keepdim=True), none)
            chosen = torch.cat([chosen, true], dim=1)
        chosen = chosen.masked_fill(~self.available_or_none[chosen], none)
        # the scale goes in before the -inf fill: its gradient would be 0 · -inf = NaN after it
        scores = score_by_expert(
            self.scale * q,
            chosen,
            self.all_rows(),
            self.slots[:none],
            self.slot_labels[:none],
            self.num_labels,
        )
        if self.training:
            self.touched.update(int(c) for c in torch.unique(chosen).tolist() if c != none)
            scores = scores.masked_fill(~self.trained, float("-inf"))
        return scores

    @property
    def available_or_none(self) -> torch.Tensor:
        """:attr:`available` with the empty expert ("no expert") appended as available."""
        return torch.cat([self.available, self.available.new_ones(1)])

    def true_scores(self, labels: torch.Tensor) -> torch.Tensor:
        """The last queries' exact score of their true documents ``(batch,)``, routed or not."""
        assert self.last_queries is not None, "forward first"
        rows = self.all_rows()
        position = self.slots[self.expert_of[labels], self.rank_in_expert[labels]]
        return self.scale * (self.last_queries * rows[position]).sum(-1)

    @property
    def rank_in_expert(self) -> torch.Tensor:
        """Each document's slot within its expert ``(documents,)``."""
        rank = torch.empty(self.num_labels, dtype=torch.long, device=self.slots.device)
        width = self.slots.shape[1]
        filled = self.slot_labels[:-1] < self.num_labels  # (experts, width)
        columns = torch.arange(width, device=rank.device).expand_as(filled)
        rank[self.slot_labels[:-1][filled]] = columns[filled]
        return rank

    def loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the documents (queries whose expert is available) plus the gate's."""
        assert self.last_gate is not None, "forward first"
        target = self.expert_of[labels]
        gate_loss = F.cross_entropy(self.last_gate, target, reduction="none")
        held = self.available[target]
        doc_loss = F.cross_entropy(
            torch.where(held[:, None], scores, torch.zeros_like(scores)),
            labels,
            reduction="none",
        )
        return (gate_loss + torch.where(held, doc_loss, torch.zeros_like(doc_loss))).mean()

    def evaluation_loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the documents, finite when a query's true document was not
        routed: its exact score (d multiply-adds) stands in for the -inf it was given."""
        true = self.true_scores(labels).to(scores.dtype)
        filled = scores.scatter(1, labels[:, None], true[:, None])
        return F.cross_entropy(filled, labels, reduction="sum")

    def head_flops_per_query(self) -> int:
        """Multiply-adds of one query's scores (gate and routed experts; maps excluded)."""
        sizes = self.layout.sizes()
        largest = np.sort(sizes)[::-1][: self.eval_route].sum()
        if self.group_gate is None:
            gate = self.layout.experts
        else:
            groups = len(self.group_gate)
            gate = groups + min(self.route_groups, groups) * self.layout.experts // groups
        return int((gate + largest) * self.dim)


class MixtureScorer(MixtureHead, Scorer):
    """The mixture of experts (:class:`~car_fl.heads.experts.MixtureHead`)."""

    kind = HeadKind.MOE
    per_example_loop = True

    @classmethod
    def build(cls, spec: ScorerSpec) -> Scorer:
        if spec.moe is None or spec.layout is None:
            raise ValueError("a mixture of experts needs its settings (moe) and expert layout")
        return cls(spec.dim, spec.num_labels, spec.head, spec.moe, spec.layout).to(spec.device)

    def evaluation_loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return MixtureHead.evaluation_loss(self, scores, labels)


def score_by_expert(
    q: torch.Tensor,
    chosen: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    slot_labels: torch.Tensor,
    num_labels: int,
) -> torch.Tensor:
    """``(batch, num_labels)`` dot products of each query with the documents of its chosen
    experts, -inf elsewhere. ``chosen`` ``(batch, route)`` holds expert ids (``len(slots)``: no
    expert); ``rows`` ``(documents + 1, d)`` every document's row and a zero row last;
    ``slots`` ``(experts, width)`` each expert's rows in ``rows`` (padding: the zero row) and
    ``slot_labels`` their label ids (padding: ``num_labels``).

    torch has no grouped matmul on CPU: the (query, expert) pairs are grouped by expert, the
    experts bucketed by load (up to 2^k queries), one ``bmm`` per bucket, so each reached
    expert is read once per batch and its gradient written once.
    """
    experts, width = slots.shape
    batch, dim = q.shape
    pair_query = torch.arange(batch, device=q.device).repeat_interleave(chosen.shape[1])
    pair_expert = chosen.reshape(-1)
    keep = pair_expert < experts
    pair_query, pair_expert = pair_query[keep], pair_expert[keep]
    scores = q.new_full((batch, num_labels + 1), float("-inf"))
    if len(pair_expert) == 0:
        return scores[:, :num_labels]
    counts = torch.bincount(pair_expert, minlength=experts)
    used = torch.nonzero(counts).flatten()
    level = torch.ceil(torch.log2(counts[used].to(torch.float64))).long()
    used = used[torch.argsort(level, stable=True)]  # reached experts, bucket by bucket
    level = torch.ceil(torch.log2(counts[used].to(torch.float64))).long()
    rank = torch.empty(experts, dtype=torch.long, device=q.device)
    rank[used] = torch.arange(len(used), device=q.device)
    order = torch.argsort(rank[pair_expert], stable=True)  # pairs, bucket by bucket
    pair_query, pair_expert = pair_query[order], pair_expert[order]
    group = rank[pair_expert]  # the pair's expert's place among the reached ones
    starts = torch.cumsum(counts[used], 0) - counts[used]
    position = torch.arange(len(group), device=q.device) - starts[group]
    levels, experts_per_level = torch.unique_consecutive(level, return_counts=True)
    pairs_per_level = torch.zeros_like(levels).index_add_(
        0, torch.searchsorted(levels, level), counts[used]
    )
    reached = rows[slots[used]]  # (reached experts, width, d): one gather
    pieces = torch.split(reached, experts_per_level.tolist())
    first_expert, first_pair, products = 0, 0, []
    for piece, n_experts, n_pairs in zip(
        pieces, experts_per_level.tolist(), pairs_per_level.tolist(), strict=True
    ):
        span = slice(first_pair, first_pair + n_pairs)
        slot, place = group[span] - first_expert, position[span]
        most = int(counts[used[first_expert : first_expert + n_experts]].max())
        block = q.new_zeros(n_experts, most, dim).index_put((slot, place), q[pair_query[span]])
        products.append(torch.bmm(block, piece.transpose(1, 2))[slot, place])
        first_expert, first_pair = first_expert + n_experts, first_pair + n_pairs
    pair_scores = torch.cat(products)  # (pairs, width), bucket by bucket
    labels = slot_labels[pair_expert]  # (pairs, width); padding: num_labels
    query_index = pair_query[:, None].expand(-1, width)
    scores = scores.index_put((query_index, labels), pair_scores)
    return scores[:, :num_labels]
