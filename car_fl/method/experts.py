"""The method's mixture of experts: documents in balanced clusters, a gate, one expert per cluster.

:class:`ExpertLayout` says which expert (cluster, :mod:`car_fl.method.clustering`) holds each
document, and in two-level mode which group holds each expert. :class:`MixtureHead` is the
document head (:mod:`car_fl.method.document_head`) with its Δ rows split into one tensor per
expert (``experts.<c>``) and a gate (``gate``: one vector per expert, starting at its documents'
mean; ``group_gate`` per group in two-level mode):

- a query goes to its ``route`` best experts by s_g·cos(f(q̂), gate) (within its
  ``route_groups`` best groups); its documents in those experts get the document head's score
  s·cos(f(q̂), rowᵢ), the others -inf. Cost per query: (experts [or groups + route_groups ·
  experts/groups] + route · documents/experts)·d multiply-adds instead of documents·d.
- training adds the true document's expert to the routed ones (teacher forcing) and a gate
  loss (cross-entropy of the gate over experts, target the true document's expert), so the
  gate learns to route; with one expert the head is exactly the dense document head.
- only *available* experts are scored and trained (:meth:`MixtureHead.set_available`): a
  client holds the experts the server sent it; the others are neither used nor sent.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from car_fl.method.document_head import DocumentHead
from car_fl.settings.schema import HeadConfig, MoEConfig

#: Name prefix of the expert tensors in the trainable state (``head.experts.<c>``).
EXPERT_PREFIX = "head.experts."


@dataclass(frozen=True)
class ExpertLayout:
    """Each document's expert ``(documents,)`` and, with two levels, each expert's group."""

    expert_of: np.ndarray
    group_of: np.ndarray | None = None

    def __post_init__(self) -> None:
        experts = int(self.expert_of.max()) + 1 if len(self.expert_of) else 0
        counts = np.bincount(self.expert_of, minlength=experts)
        if experts == 0 or (counts == 0).any():
            raise ValueError("an expert layout needs at least one document in every expert")
        if self.group_of is not None and len(self.group_of) != experts:
            raise ValueError(f"{len(self.group_of)} expert groups for {experts} experts")

    @property
    def experts(self) -> int:
        return int(self.expert_of.max()) + 1

    @property
    def groups(self) -> int | None:
        return None if self.group_of is None else int(self.group_of.max()) + 1

    def members(self, expert: int) -> np.ndarray:
        """The documents of ``expert``, in label order."""
        return np.flatnonzero(self.expert_of == expert)

    def sizes(self) -> np.ndarray:
        return np.bincount(self.expert_of, minlength=self.experts)

    def to_text(self) -> str:
        """A compact text (base64 of int32s) for checkpoints and messages."""
        parts = [self.expert_of.astype("<i4").tobytes()]
        if self.group_of is not None:
            parts.append(self.group_of.astype("<i4").tobytes())
        return ".".join(base64.b64encode(p).decode("ascii") for p in parts)

    @classmethod
    def from_text(cls, text: str) -> ExpertLayout:
        parts = [np.frombuffer(base64.b64decode(p), dtype="<i4") for p in text.split(".")]
        if not 1 <= len(parts) <= 2:
            raise ValueError("an expert layout text has one or two parts")
        groups = parts[1].astype(np.int64) if len(parts) == 2 else None
        return cls(expert_of=parts[0].astype(np.int64), group_of=groups)

    def digest(self) -> str:
        return hashlib.sha256(self.to_text().encode()).hexdigest()[:16]


def experts_in(state: dict[str, torch.Tensor] | set[str] | list[str]) -> set[int] | None:
    """The experts whose tensors ``state`` holds (None when it holds no expert: all)."""
    found = {int(name[len(EXPERT_PREFIX) :]) for name in state if name.startswith(EXPERT_PREFIX)}
    return found or None


def build_layout(features: torch.Tensor, moe: MoEConfig, *, seed: int) -> ExpertLayout:
    """Balanced clusters of the document embeddings ``(documents, d)``."""
    from car_fl.method.clustering import balanced_tree

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
        self.route_groups = moe.route_groups
        members = [torch.from_numpy(layout.members(c)) for c in range(layout.experts)]
        self.member_index = members  # label indices of each expert's rows
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
        """Each query's ``route`` best available experts ``(batch, route)`` (two levels: within
        its ``route_groups`` best groups)."""
        with torch.no_grad():
            logits = gate.detach().masked_fill(~self.available, float("-inf"))
            if self.group_gate is not None:
                groups = q.detach() @ F.normalize(self.group_gate.detach(), dim=-1).T
                top = groups.topk(min(self.route_groups, groups.shape[1]), dim=1).indices
                reached = (self.group_of[None, :, None] == top[:, None, :]).any(dim=2)
                logits = logits.masked_fill(~reached, float("-inf"))
            k = min(self.route, int(self.available.sum()))
            return logits.topk(k, dim=1).indices

    def forward(
        self,
        features: torch.Tensor,
        index: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(batch, d)`` → ``(batch, documents)``: -inf outside the routed experts. While
        training, ``labels`` add each query's true expert (teacher forcing)."""
        labels = labels if self.training else None
        q = self.queries(features)
        gate = self.gate_scores(q)
        self.last_gate = gate
        chosen = self.route_experts(q, gate)  # (batch, route)
        if labels is not None:  # teacher forcing: the true document's expert
            chosen = torch.cat([chosen, self.expert_of[labels][:, None]], dim=1)
        scores = torch.full(
            (len(q), self.num_labels), float("-inf"), dtype=q.dtype, device=q.device
        )
        scale = self.scale
        at_query, at_document, values = [], [], []  # one index_put for all experts
        for expert in torch.unique(chosen).tolist():
            if not bool(self.available[expert]):
                continue
            rows_of = (chosen == expert).any(dim=1).nonzero().flatten()
            index = self.member_index[expert].to(q.device)
            delta = self.experts[expert] if len(self.experts) else None
            rows = self.document_rows(index, delta)
            block = scale * q[rows_of] @ rows.T  # (queries routed here, its documents)
            at_query.append(rows_of[:, None].expand(-1, len(index)).reshape(-1))
            at_document.append(index[None, :].expand(len(rows_of), -1).reshape(-1))
            values.append(block.reshape(-1))
            if self.training:
                self.touched.add(expert)
        if values:
            scores = scores.index_put(
                (torch.cat(at_query), torch.cat(at_document)), torch.cat(values)
            )
        if self.training:
            scores = scores.masked_fill(~self.trained, float("-inf"))
        return scores

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

    def head_flops_per_query(self) -> int:
        """Multiply-adds of one query's scores (gate and routed experts; maps excluded)."""
        sizes = self.layout.sizes()
        largest = np.sort(sizes)[::-1][: self.route].sum()
        if self.group_gate is None:
            gate = self.layout.experts
        else:
            groups = len(self.group_gate)
            gate = groups + min(self.route_groups, groups) * self.layout.experts // groups
        return int((gate + largest) * self.dim)
