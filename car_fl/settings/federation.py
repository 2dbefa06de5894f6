"""The federation: rounds and clients, aggregation, what crosses the wire, and the DP mode."""

from __future__ import annotations

import math
from dataclasses import dataclass

from car_fl.privacy.accountant import check_delta, check_sample_rate
from car_fl.settings.choices import (
    WIRE_DTYPES,
    AdaptiveRule,
    DPMode,
    Granularity,
    NoiseRule,
    NormBoundAction,
    NormBoundMode,
    Partitioning,
    StrategyName,
    at_least,
    one_of,
    positive,
)


@dataclass
class FLConfig:
    """The federation (Flower): clients, rounds, local epochs, partitioning, timeouts.

    Update-norm bound (server side, on ‖θᵢ − θ‖): ``norm_bound`` is ``off``, ``fixed``
    (``max_update_norm``), ``adaptive`` (``norm_bound_factor`` × the round's median), ``dp``
    (C plus the 1 − ``norm_bound_tail`` quantile of the fixed-DP noise norm) or ``auto`` (``dp``
    under fixed DP per round, else ``fixed`` when ``max_update_norm`` is set, else ``off``).
    """

    clients: int = 2
    #: Once all fl.clients joined, a round goes ahead with at least this many.
    min_clients: int = 1
    #: A round is aggregated only with this many valid replies and this fraction of those
    #: asked; otherwise the global model stays as it was.
    min_valid_replies: int = 1
    min_valid_fraction: float = 0.0
    #: Cap on the example count a reply may claim; null: the size of the partition the node is
    #: pinned to (data-is-shard nodes need this cap). Under DP it is public:
    #: dp.granularity=step trains and accounts for exactly this many.
    max_examples_per_client: int | None = None
    #: Each round asks clients_per_round nodes (null: fraction_train of those connected), at
    #: least min_clients; seeded by the run's seed and the round.
    fraction_train: float = 1.0
    clients_per_round: int | None = None
    #: Bound on a reply's update norm (the class docstring); above it: norm_bound_action.
    norm_bound: NormBoundMode = NormBoundMode.AUTO
    max_update_norm: float | None = None
    norm_bound_factor: float = 3.0
    norm_bound_action: NormBoundAction = NormBoundAction.REJECT
    norm_bound_tail: float = 1e-6
    rounds: int = 5
    local_epochs: int = 2
    #: Linear probing, federated (adapter + CaR): the first ``probe_rounds`` rounds train the
    #: head alone on cached features, the adapter trains from the round after (0: none).
    probe_rounds: int = 0
    #: iid, dirichlet (non-IID over labels, concentration fl.alpha), topic or hash (keyed).
    partitioning: Partitioning = Partitioning.IID
    alpha: float = 1.0
    #: Seconds the server waits for a round's replies.
    round_timeout: float = 3600.0
    #: Seconds the server waits for all clients to connect.
    wait_for_nodes: float = 120.0

    def __post_init__(self) -> None:
        for key in ("clients", "rounds", "local_epochs"):
            at_least(f"fl.{key}", getattr(self, key), 1)
        if not 0 <= self.probe_rounds < self.rounds:
            raise ValueError(
                f"fl.probe_rounds must be in [0, fl.rounds={self.rounds}) so that a round is left "
                f"for the adapter, got {self.probe_rounds}; lower it or raise fl.rounds"
            )
        if not 1 <= self.min_clients <= self.clients:
            raise ValueError(
                f"fl.min_clients must be in [1, fl.clients={self.clients}], got {self.min_clients}"
            )
        at_least("fl.min_valid_replies", self.min_valid_replies, 1)
        if not 0.0 <= self.min_valid_fraction <= 1.0:
            raise ValueError(
                f"fl.min_valid_fraction must be in [0, 1], got {self.min_valid_fraction}"
            )
        if self.max_examples_per_client is not None and self.max_examples_per_client < 1:
            raise ValueError(
                f"fl.max_examples_per_client must be >= 1 or null, "
                f"got {self.max_examples_per_client}"
            )
        self.partitioning = Partitioning.parse("fl.partitioning", self.partitioning)
        if not 0.0 < self.fraction_train <= 1.0:
            raise ValueError(f"fl.fraction_train must be in (0, 1], got {self.fraction_train}")
        if self.clients_per_round is not None and not (
            self.min_clients <= self.clients_per_round <= self.clients
        ):
            raise ValueError(
                f"fl.clients_per_round must be null or in [fl.min_clients={self.min_clients}, "
                f"fl.clients={self.clients}], got {self.clients_per_round}"
            )
        self.norm_bound = NormBoundMode.parse("fl.norm_bound", self.norm_bound)
        self.norm_bound_action = NormBoundAction.parse(
            "fl.norm_bound_action", self.norm_bound_action
        )
        if self.max_update_norm is not None:
            positive("fl.max_update_norm", self.max_update_norm)
        if self.norm_bound is NormBoundMode.FIXED and self.max_update_norm is None:
            raise ValueError(
                "fl.norm_bound=fixed needs fl.max_update_norm (e.g. fl.max_update_norm=10.0), "
                "or use fl.norm_bound=adaptive"
            )
        if not self.norm_bound_factor >= 1.0:
            raise ValueError(f"fl.norm_bound_factor must be >= 1, got {self.norm_bound_factor}")
        if not 0.0 < self.norm_bound_tail < 1.0:
            raise ValueError(f"fl.norm_bound_tail must be in (0, 1), got {self.norm_bound_tail}")
        positive("fl.alpha", self.alpha)
        positive("fl.round_timeout", self.round_timeout)
        at_least("fl.wait_for_nodes", self.wait_for_nodes, 0)

    def sample_size(self, connected: int) -> int:
        """How many of ``connected`` nodes one round asks (at least ``min_clients``)."""
        wanted = self.clients_per_round or math.floor(self.fraction_train * connected + 1e-9)
        return min(connected, max(self.min_clients, wanted))


@dataclass
class StrategyConfig:
    """How the server combines valid replies (:mod:`car_fl.server.aggregation`).

    ``trim_fraction``: the trimmed mean's β; ``num_malicious``: Krum's f; ``num_selected``:
    Multi-Krum's m; ``eta`` to ``tau``: FedAdam/FedYogi; ``server_*``: FedAvgM; ``proximal_mu``:
    FedProx's μ (the clients' local loss).
    """

    name: StrategyName = StrategyName.FEDAVG
    trim_fraction: float = 0.2
    num_malicious: int = 0
    num_selected: int = 1
    eta: float = 0.01
    eta_l: float = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3
    server_lr: float = 1.0
    server_momentum: float = 0.9
    proximal_mu: float = 0.0

    def __post_init__(self) -> None:
        self.name = StrategyName.parse("strategy", self.name)
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(
                f"strategy.trim_fraction must be in [0, 0.5), got {self.trim_fraction}"
            )
        at_least("strategy.num_malicious", self.num_malicious, 0)
        at_least("strategy.num_selected", self.num_selected, 1)
        for key in ("eta", "eta_l", "tau", "server_lr"):
            positive(f"strategy.{key}", getattr(self, key))
        for key in ("beta_1", "beta_2", "server_momentum"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"strategy.{key} must be in [0, 1), got {getattr(self, key)}")
        at_least("strategy.proximal_mu", self.proximal_mu, 0)

    @property
    def prox_mu(self) -> float:
        """μ of the clients' proximal term: ``proximal_mu`` under FedProx, else 0."""
        return self.proximal_mu if self.name is StrategyName.FEDPROX else 0.0


@dataclass
class CommConfig:
    """What crosses the wire between server and clients (only the trainable tensors ever do)."""

    #: float32, or float16 (half the bytes; aggregation is still computed in float64).
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype == "bfloat16":
            raise ValueError(
                "comm.dtype=bfloat16 is not supported: Flower arrays are NumPy arrays, which have "
                "no bfloat16; use float16 (same size) or float32"
            )
        one_of("comm.dtype", self.dtype, WIRE_DTYPES)


#: Local DP's split of the noise budget (dp.adapter_share): dp=record refuses any other value.
ADAPTER_SHARE_DEFAULT = 0.5


@dataclass
class DPConfig:
    """Local differential privacy on each client (:mod:`car_fl.privacy`, conf/dp/<mode>.yaml)."""

    #: none, fixed, adaptive or record (:class:`DPMode`).
    mode: DPMode = DPMode.NONE
    #: C. fixed: bound on the L2 norm of the whole round's update (all sent tensors
    #: together); adaptive: the initial C_i; record: bound on each example's gradient norm.
    clip: float = 1.0
    #: fixed: σ₀ (noise std σ₀·C); adaptive: z (needs z < 2σ_b); record: σ, used when
    #: target_epsilon is null.
    noise_multiplier: float = 0.0
    #: round: clip and noise once per round; step: after every optimizer step (Algorithm 1;
    #: the server's ε needs fl.max_examples_per_client, else it reports ε = ∞).
    granularity: Granularity = Granularity.ROUND
    #: The first rounds train without DP.
    warmup_rounds: int = 0
    #: δ (record: must be below 1/n for a client's n examples).
    delta: float = 1e-5
    #: Stop contributing before a release would push ε past this (null: never). record: σ is
    #: calibrated so that the run's planned steps spend at most this ε.
    target_epsilon: float | None = None
    #: β, the linear adaptive rule only.
    update_rate: float = 0.05
    #: γ: target fraction of releases left unclipped (the CaR paper's 0.9).
    target_quantile: float = 0.9
    #: EMA of ‖Δ‖ for the linear rule (0: the raw norm); must be 0 with the geometric rule.
    ema_decay: float = 0.0
    #: mechanism: std z_Δ·C_i; bound: Algorithm 1's sqrt(2 z_Δ² ((1−β)² C_i² + β² γ² ‖Δ‖²)),
    #: which depends on the raw norm: NOT private (ε is reported as inf).
    noise_rule: NoiseRule = NoiseRule.MECHANISM
    #: geometric: private (Andrew et al. 2021); linear: the CaR paper's
    #: C_i ← (1 − β)·C_i + β·γ·‖Δ‖ on the raw norm, NOT private (ε is reported as inf).
    adaptive_rule: AdaptiveRule = AdaptiveRule.GEOMETRIC
    #: η_C, the geometric rule's step on log C_i per release (Andrew et al. use 0.2).
    clip_lr: float = 0.2
    #: σ_b, noise std of the clipped-indicator b (sensitivity 1); null: the paper's m/20
    #: (m = fl.clients). It takes the share z²/(2σ_b)² of each release's privacy budget.
    count_noise: float | None = None
    #: The adapter's own clipping bound (null: dp.clip for every sent tensor together).
    #: fixed, adaptive: the adapter and head are clipped and noised separately, each with its
    #: share of one release's budget (dp.adapter_share). record: per example, the adapter to
    #: it and the head to √(dp.clip² − adapter_clip²), so σ·dp.clip and ε do not change.
    adapter_clip: float | None = None
    #: w, the adapter's share of the budget: noise multipliers z/√w and z/√(1 − w), which
    #: compose to z. Local DP's only: dp=record refuses any other value than the default.
    adapter_share: float = ADAPTER_SHARE_DEFAULT

    #: record: q, the probability each step samples each local example with (Poisson).
    sample_rate: float = 0.05

    @property
    def enabled(self) -> bool:
        """A DP mode is set (its releases are private after ``warmup_rounds``)."""
        return self.mode is not DPMode.NONE

    def __post_init__(self) -> None:
        self.mode = DPMode.parse("dp.mode", self.mode)
        self.granularity = Granularity.parse("dp.granularity", self.granularity)
        self.noise_rule = NoiseRule.parse("dp.noise_rule", self.noise_rule)
        self.adaptive_rule = AdaptiveRule.parse("dp.adaptive_rule", self.adaptive_rule)
        positive("dp.clip_lr (η_C)", self.clip_lr)
        if self.count_noise is not None:
            positive("dp.count_noise (σ_b)", self.count_noise)
        if self.adapter_clip is not None and not self.adapter_clip > 0:
            raise ValueError(
                f"dp.adapter_clip (the adapter's own clipping bound) must be > 0 or null, got "
                f"{self.adapter_clip}; e.g. dp.adapter_clip=0.01"
            )
        if not 0 < self.adapter_share < 1:
            raise ValueError(
                f"dp.adapter_share (the adapter's share of the noise budget) must be in (0, 1), "
                f"got {self.adapter_share}; e.g. dp.adapter_share=0.5"
            )
        if not self.clip > 0:
            raise ValueError(f"dp.clip (the clipping bound C) must be > 0, got {self.clip}")
        at_least("dp.noise_multiplier", self.noise_multiplier, 0)
        if not 0 <= self.update_rate < 1:
            raise ValueError(f"dp.update_rate (β) must be in [0, 1), got {self.update_rate}")
        if not self.target_quantile > 0:
            raise ValueError(f"dp.target_quantile (γ) must be > 0, got {self.target_quantile}")
        check_delta(self.delta)
        check_sample_rate(self.sample_rate)
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"dp.ema_decay must be in [0, 1), got {self.ema_decay}")
        at_least("dp.warmup_rounds", self.warmup_rounds, 0)
        if self.target_epsilon is not None and not 0 < self.target_epsilon < math.inf:
            raise ValueError(
                f"dp.target_epsilon must be > 0 and finite, or null, got {self.target_epsilon}"
            )
