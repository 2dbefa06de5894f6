"""Configuration: Hydra composition from ``conf/`` plus typed, validated settings.

One function, :func:`compose_config`, turns ``conf/`` and a list of Hydra overrides into a
resolved :class:`omegaconf.DictConfig`; :func:`to_settings` turns that into typed dataclasses
(:class:`Settings`) whose ``__post_init__`` rejects impossible values with a message naming the
key and the fix. Every entry point (centralised run, Flower apps, sweeps) goes through both.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class Mode(StrEnum):
    """What is trained: the head alone on cached features, or the adapter and the head."""

    CLASSIFIER = "classifier"
    ADAPTER_CLASSIFIER = "adapter+classifier"


class Pooling(StrEnum):
    """How a sequence's final hidden states become one vector."""

    EOS = "eos"
    MEAN = "mean"


class DPMode(StrEnum):
    """Local differential privacy: off, fixed clipping bound, adaptive clipping, or DP-SGD.

    ``record``: record-level DP-SGD on each client (:mod:`car_fl.privacy.dpsgd`).
    """

    NONE = "none"
    FIXED = "fixed"
    ADAPTIVE = "adaptive"
    RECORD = "record"


class HeadKind(StrEnum):
    """How labels are scored: CaR's classifier, MIPS against label documents, or kNN."""

    CLASSIFIER = "classifier"
    MIPS = "mips"
    KNN = "knn"


class Similarity(StrEnum):
    """Inner product of the raw vectors, or of unit vectors (cosine)."""

    DOT = "dot"
    COSINE = "cosine"


class Reader(StrEnum):
    """File formats understood by :mod:`car_fl.data.readers`."""

    SMS_SPAM = "sms_spam"
    AG_NEWS = "ag_news"
    ARXIV = "arxiv"
    TABLE = "table"


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")
OPTIMIZERS = ("adamw", "adam", "sgd")
PADDING_SIDES = ("auto", "left", "right")


def _one_of(key: str, value: str, valid: tuple[str, ...] | list[str]) -> None:
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not valid; choose one of {', '.join(valid)}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")


@dataclass
class DatasetConfig:
    """Where the examples come from and how they are split.

    ``path`` (a local file or folder) takes precedence over ``hub_id``. ``text_column`` and
    ``label_column`` name the fields of the hub dataset or of a ``table`` file. Duplicates are
    removed before splitting (``dedupe``); ``val_fraction`` of train becomes the validation
    split used for model selection.
    """

    name: str = "sms_spam"
    reader: str = "sms_spam"
    hub_id: str | None = "ucirvine/sms_spam"
    hub_config: str | None = None
    path: str | None = None
    test_path: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    test_fraction: float = 0.2
    #: Share of the training examples held out for model selection (0: none; best = final).
    val_fraction: float = 0.1
    #: Collapse duplicate texts (after Unicode and whitespace normalisation) before splitting.
    dedupe: bool = True
    stratify: bool = True
    min_examples_per_label: int = 1
    max_examples: int | None = None
    label_texts: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _one_of("dataset.reader", self.reader, [r.value for r in Reader])
        if self.path is None and self.hub_id is None:
            raise ValueError(
                f"dataset {self.name!r} has neither dataset.path (a local file) nor "
                "dataset.hub_id (a Hugging Face dataset); set one of them"
            )
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"dataset.test_fraction must be in (0, 1), got {self.test_fraction!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(
                f"dataset.val_fraction must be in [0, 1) (e.g. 0.1), got {self.val_fraction!r}"
            )
        if self.min_examples_per_label < 1:
            raise ValueError(
                f"dataset.min_examples_per_label must be >= 1, got {self.min_examples_per_label}"
            )
        if self.max_examples is not None and self.max_examples < 2:
            raise ValueError(f"dataset.max_examples must be >= 2 or null, got {self.max_examples}")


@dataclass
class ModelConfig:
    """The frozen encoder: which model, where it runs, how its output is pooled."""

    name: str = "tinyllama"
    name_or_path: str = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    revision: str | None = None
    dtype: str = "auto"
    pooling: str = "eos"
    max_length: int = 128
    padding_side: str = "auto"
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        _one_of("model.dtype", self.dtype, DTYPES)
        _one_of("model.pooling", self.pooling, [p.value for p in Pooling])
        _one_of("model.padding_side", self.padding_side, PADDING_SIDES)
        if self.max_length < 2:
            raise ValueError(f"model.max_length must be >= 2, got {self.max_length}")


@dataclass
class HeadConfig:
    """How labels are scored (:class:`HeadKind`).

    ``classifier`` (CaR): optional linear pre-classifier with dropout, then a linear layer.
    ``mips``: query·document scores against each label's text, divided by ``temperature``
    (trains the adapter alone in ``adapter+classifier`` mode, nothing in ``classifier`` mode).
    ``knn``: votes of the ``knn_k`` most similar training examples (nothing is trained).
    """

    kind: str = "classifier"
    pre_classifier_dim: int | None = None
    dropout: float = 0.0
    similarity: str = "dot"
    temperature: float = 1.0
    knn_k: int = 10

    def __post_init__(self) -> None:
        _one_of("head.kind", self.kind, [k.value for k in HeadKind])
        _one_of("head.similarity", self.similarity, [s.value for s in Similarity])
        _positive("head.temperature", self.temperature)
        if self.knn_k < 1:
            raise ValueError(f"head.knn_k must be >= 1, got {self.knn_k}")
        if self.pre_classifier_dim is not None and self.pre_classifier_dim < 1:
            raise ValueError(
                f"head.pre_classifier_dim must be a positive size or null, "
                f"got {self.pre_classifier_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"head.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class TrainConfig:
    """Local optimisation: mode, epochs, batch size, optimiser."""

    mode: str = "classifier"
    epochs: int = 10
    batch_size: int = 4
    lr: float = 1e-3
    adapter_lr: float | None = None
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.0
    eval_batch_size: int = 64
    feature_batch_size: int = 32

    def __post_init__(self) -> None:
        _one_of("train.mode", self.mode, [m.value for m in Mode])
        _one_of("train.optimizer", self.optimizer, OPTIMIZERS)
        for key in ("epochs", "batch_size", "eval_batch_size", "feature_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        _positive("train.lr", self.lr)
        if self.adapter_lr is not None:
            _positive("train.adapter_lr", self.adapter_lr)
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay must be >= 0, got {self.weight_decay}")

    @property
    def mode_enum(self) -> Mode:
        return Mode(self.mode)


@dataclass
class EvalConfig:
    """Which top-K accuracies are reported; the largest K is the retrieval K by default."""

    top_k: list[int] = field(default_factory=lambda: [1, 3, 5, 10])

    def __post_init__(self) -> None:
        if not self.top_k or any(k < 1 for k in self.top_k):
            raise ValueError(f"eval.top_k must be a non-empty list of K >= 1, got {self.top_k}")
        self.top_k = sorted(set(self.top_k))


NORM_BOUNDS = ("auto", "off", "fixed", "adaptive", "dp")
NORM_BOUND_ACTIONS = ("reject", "clip")


@dataclass
class FLConfig:
    """The federation: clients, rounds, local epochs, partitioning, timeouts.

    Sampling: each round asks ``clients_per_round`` nodes (or ``fraction_train`` of those
    connected), never fewer than ``min_clients``. Update-norm bound (server side, on
    ‖θᵢ − θ‖): ``norm_bound`` is ``off``, ``fixed`` (``max_update_norm``), ``adaptive``
    (``norm_bound_factor`` × the round's median update norm), ``dp`` (C plus the
    1 − ``norm_bound_tail`` quantile of the fixed-DP noise norm) or ``auto`` (``dp`` under
    fixed DP per round, else ``fixed`` when ``max_update_norm`` is set, else ``off``).
    """

    clients: int = 2
    min_clients: int = 1
    min_valid_replies: int = 1
    min_valid_fraction: float = 0.0
    max_examples_per_client: int | None = None
    fraction_train: float = 1.0
    clients_per_round: int | None = None
    norm_bound: str = "auto"
    max_update_norm: float | None = None
    norm_bound_factor: float = 3.0
    norm_bound_action: str = "reject"
    norm_bound_tail: float = 1e-6
    rounds: int = 5
    local_epochs: int = 2
    partitioning: str = "iid"
    alpha: float = 1.0
    round_timeout: float = 3600.0
    wait_for_nodes: float = 120.0

    def __post_init__(self) -> None:
        for key in ("clients", "rounds", "local_epochs"):
            if getattr(self, key) < 1:
                raise ValueError(f"fl.{key} must be >= 1, got {getattr(self, key)}")
        if not 1 <= self.min_clients <= self.clients:
            raise ValueError(
                f"fl.min_clients must be in [1, fl.clients={self.clients}], got {self.min_clients}"
            )
        if self.min_valid_replies < 1:
            raise ValueError(f"fl.min_valid_replies must be >= 1, got {self.min_valid_replies}")
        if not 0.0 <= self.min_valid_fraction <= 1.0:
            raise ValueError(
                f"fl.min_valid_fraction must be in [0, 1], got {self.min_valid_fraction}"
            )
        if self.max_examples_per_client is not None and self.max_examples_per_client < 1:
            raise ValueError(
                f"fl.max_examples_per_client must be >= 1 or null, "
                f"got {self.max_examples_per_client}"
            )
        _one_of("fl.partitioning", self.partitioning, ("iid", "dirichlet"))
        if not 0.0 < self.fraction_train <= 1.0:
            raise ValueError(f"fl.fraction_train must be in (0, 1], got {self.fraction_train}")
        if self.clients_per_round is not None and not (
            self.min_clients <= self.clients_per_round <= self.clients
        ):
            raise ValueError(
                f"fl.clients_per_round must be null or in [fl.min_clients={self.min_clients}, "
                f"fl.clients={self.clients}], got {self.clients_per_round}"
            )
        _one_of("fl.norm_bound", self.norm_bound, NORM_BOUNDS)
        _one_of("fl.norm_bound_action", self.norm_bound_action, NORM_BOUND_ACTIONS)
        if self.max_update_norm is not None:
            _positive("fl.max_update_norm", self.max_update_norm)
        if self.norm_bound == "fixed" and self.max_update_norm is None:
            raise ValueError(
                "fl.norm_bound=fixed needs fl.max_update_norm (e.g. fl.max_update_norm=10.0), "
                "or use fl.norm_bound=adaptive"
            )
        if not self.norm_bound_factor >= 1.0:
            raise ValueError(f"fl.norm_bound_factor must be >= 1, got {self.norm_bound_factor}")
        if not 0.0 < self.norm_bound_tail < 1.0:
            raise ValueError(f"fl.norm_bound_tail must be in (0, 1), got {self.norm_bound_tail}")

    def sample_size(self, connected: int) -> int:
        """How many of ``connected`` nodes one round asks (at least ``min_clients``)."""
        wanted = self.clients_per_round or math.floor(self.fraction_train * connected + 1e-9)
        return min(connected, max(self.min_clients, wanted))
        _positive("fl.alpha", self.alpha)
        _positive("fl.round_timeout", self.round_timeout)
        if self.wait_for_nodes < 0:
            raise ValueError(f"fl.wait_for_nodes must be >= 0, got {self.wait_for_nodes}")


@dataclass
class DPConfig:
    """Local differential privacy on each client (see :mod:`car_fl.privacy`)."""

    mode: str = "none"
    clip: float = 1.0
    noise_multiplier: float = 0.0
    granularity: str = "round"
    warmup_rounds: int = 0
    delta: float = 1e-5
    target_epsilon: float | None = None
    update_rate: float = 0.05
    target_quantile: float = 0.9
    ema_decay: float = 0.0
    noise_rule: str = "mechanism"
    #: geometric: private (Andrew et al. 2021); linear: the paper's rule, not private (ε = ∞).
    adaptive_rule: str = "geometric"
    #: η_C, the geometric rule's step on log Cᵢ.
    clip_lr: float = 0.2
    #: σ_b, noise std of the clipped-indicator; null: the paper's m/20 (m = fl.clients).
    count_noise: float | None = None

    # --- record-level DP-SGD (dp=record): clip = per-example C, noise_multiplier = σ (unless
    # target_epsilon calibrates it), delta = δ; see car_fl.privacy.record_accounting
    #: q: each step samples every local example independently with this probability
    sample_rate: float = 0.05

    def __post_init__(self) -> None:
        _one_of("dp.mode", self.mode, [m.value for m in DPMode])
        _one_of("dp.granularity", self.granularity, ("round", "step"))
        _one_of("dp.noise_rule", self.noise_rule, ("mechanism", "bound"))
        _one_of("dp.adaptive_rule", self.adaptive_rule, ("geometric", "linear"))
        _positive("dp.clip_lr (η_C)", self.clip_lr)
        if self.count_noise is not None:
            _positive("dp.count_noise (σ_b)", self.count_noise)
        if self.mode == DPMode.ADAPTIVE and self.adaptive_rule == "geometric" and self.ema_decay:
            raise ValueError(
                f"dp.ema_decay={self.ema_decay} smooths the raw norms of the non-private linear "
                "rule only; set dp.ema_decay=0 (or dp.adaptive_rule=linear)"
            )
        if not self.clip > 0:
            raise ValueError(f"dp.clip (the clipping bound C) must be > 0, got {self.clip}")
        if self.noise_multiplier < 0:
            raise ValueError(f"dp.noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0 <= self.update_rate < 1:
            raise ValueError(f"dp.update_rate (β) must be in [0, 1), got {self.update_rate}")
        if not self.target_quantile > 0:
            raise ValueError(f"dp.target_quantile (γ) must be > 0, got {self.target_quantile}")
        if not 0 < self.delta < 1:
            raise ValueError(f"dp.delta must be in (0, 1), got {self.delta}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"dp.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.warmup_rounds < 0:
            raise ValueError(f"dp.warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise ValueError(f"dp.target_epsilon must be > 0 or null, got {self.target_epsilon}")
        if self.mode == DPMode.RECORD:
            self._check_record()

    def _check_record(self) -> None:
        """dp=record: q in (0, 1], σ > 0 unless a target ε calibrates it, no warm-up."""
        if not 0 < self.sample_rate <= 1:
            raise ValueError(
                f"dp.sample_rate (q, the Poisson sampling rate of DP-SGD) must be in (0, 1], "
                f"got {self.sample_rate}; e.g. dp.sample_rate=0.05"
            )
        if self.target_epsilon is None and not self.noise_multiplier > 0:
            raise ValueError(
                f"dp=record needs dp.noise_multiplier (σ) > 0, got {self.noise_multiplier}; "
                "set e.g. dp.noise_multiplier=1.0, or dp.target_epsilon=3 to calibrate σ"
            )
        if self.warmup_rounds:
            raise ValueError(
                f"dp=record trains every round with DP-SGD; dp.warmup_rounds must be 0, "
                f"got {self.warmup_rounds}"
            )


STRATEGIES = (
    "fedavg",
    "median",
    "trimmed_mean",
    "krum",
    "multikrum",
    "fedadam",
    "fedyogi",
    "fedavgm",
    "fedprox",
)


@dataclass
class StrategyConfig:
    """How the server combines valid replies (:mod:`car_fl.aggregation`).

    ``trim_fraction``: trimmed mean cuts ⌊β·n⌋ replies from each end of every coordinate.
    ``num_malicious``: Krum's f. ``num_selected``: Multi-Krum's m. ``eta``, ``eta_l``,
    ``beta_1``, ``beta_2``, ``tau``: FedAdam/FedYogi. ``server_lr``, ``server_momentum``:
    FedAvgM. ``proximal_mu``: FedProx's μ, used by the clients' local loss.
    """

    name: str = "fedavg"
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
        _one_of("strategy", self.name, STRATEGIES)
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(
                f"strategy.trim_fraction must be in [0, 0.5), got {self.trim_fraction}"
            )
        if self.num_malicious < 0:
            raise ValueError(f"strategy.num_malicious must be >= 0, got {self.num_malicious}")
        if self.num_selected < 1:
            raise ValueError(f"strategy.num_selected must be >= 1, got {self.num_selected}")
        for key in ("eta", "eta_l", "tau", "server_lr"):
            _positive(f"strategy.{key}", getattr(self, key))
        for key in ("beta_1", "beta_2", "server_momentum"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"strategy.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.proximal_mu < 0:
            raise ValueError(f"strategy.proximal_mu must be >= 0, got {self.proximal_mu}")

    @property
    def prox_mu(self) -> float:
        """μ of the clients' proximal term: ``proximal_mu`` under FedProx, else 0."""
        return self.proximal_mu if self.name == "fedprox" else 0.0


@dataclass
class CommConfig:
    """What crosses the wire: trainable tensors in ``dtype`` (``float16`` halves the bytes)."""

    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype == "bfloat16":
            raise ValueError(
                "comm.dtype=bfloat16 is not supported: Flower arrays are NumPy arrays, which have "
                "no bfloat16; use float16 (same size) or float32"
            )
        _one_of("comm.dtype", self.dtype, ("float32", "float16"))


@dataclass
class Settings:
    """The whole resolved configuration of a run, typed and validated."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    fl: FLConfig = field(default_factory=FLConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    seed: int = 42
    device: str = "auto"
    cache_dir: str | None = None
    output_dir: str | None = None
    progress: bool = True
    #: A run directory to continue from its last complete round checkpoint.
    resume: str | None = None

    def __post_init__(self) -> None:
        _one_of("device", self.device, DEVICES)
        if self.head.kind == HeadKind.KNN and self.train.mode == Mode.ADAPTER_CLASSIFIER:
            raise ValueError(
                "head.kind=knn trains nothing, so mode=adapter does not apply; use "
                "mode=classifier (kNN over the frozen encoder's embeddings)"
            )
        if self.dp.mode == DPMode.ADAPTIVE:
            z, m = self.dp.noise_multiplier, self.fl.clients
            sigma_b = self.dp.count_noise if self.dp.count_noise is not None else m / 20
            if not z < 2 * sigma_b:
                where = (
                    f"dp.count_noise = {sigma_b:g}"
                    if self.dp.count_noise is not None
                    else f"m/20 with m = fl.clients = {m}"
                )
                raise ValueError(
                    f"adaptive DP needs dp.noise_multiplier z < 2·σ_b = {2 * sigma_b:g} "
                    f"(σ_b = {where}), got z = {z:g}; lower dp.noise_multiplier or raise "
                    f"dp.count_noise above {z / 2:g}"
                )
        if self.dp.mode == DPMode.RECORD:  # calibrates σ (cached): an unreachable ε fails here
            from car_fl.privacy.record_accounting import record_plan

            record_plan(self.dp, self.fl)
        self._check_aggregation()

    def _check_aggregation(self) -> None:
        """Strategy and norm-bound settings that only make sense with the federation's size."""
        if self.fl.norm_bound == "dp" and not (
            self.dp.mode == DPMode.FIXED and self.dp.granularity == "round"
        ):
            raise ValueError(
                "fl.norm_bound=dp derives the bound from fixed DP clipped once per round; it "
                f"needs dp=fixed and dp.granularity=round (got dp.mode={self.dp.mode}, "
                f"dp.granularity={self.dp.granularity}); use fl.norm_bound=adaptive or fixed"
            )
        asked = self.fl.sample_size(self.fl.clients)
        if self.strategy.name == "trimmed_mean" and int(self.strategy.trim_fraction * asked) < 1:
            fix = (
                f"set strategy.trim_fraction >= {1 / asked:.3g} (and < 0.5)"
                if asked >= 3
                else "it needs at least 3 clients per round (fl.clients=3)"
            )
            raise ValueError(
                f"strategy.trim_fraction={self.strategy.trim_fraction} cuts nothing from "
                f"{asked} replies per round (⌊β·n⌋ = 0); {fix}"
            )
        if self.strategy.name in ("krum", "multikrum") and self.strategy.num_selected > asked:
            raise ValueError(
                f"strategy.num_selected={self.strategy.num_selected} exceeds the {asked} "
                f"clients asked per round; set strategy.num_selected <= {asked}"
            )


def trains_nothing(settings: Settings) -> bool:
    """MIPS on the frozen encoder and kNN have no trainable parameter: one evaluation, no epochs."""
    kind = HeadKind(settings.head.kind)
    return kind is HeadKind.KNN or (
        kind is HeadKind.MIPS and Mode(settings.train.mode) is Mode.CLASSIFIER
    )


# --------------------------------------------------------------------------------------------
# Hydra composition
# --------------------------------------------------------------------------------------------


def conf_dir() -> Path:
    """The ``conf/`` folder: inside the installed package, or beside it in a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"car-fl's Hydra configuration was not found in {here / 'conf'} or "
        f"{here.parent / 'conf'}; reinstall the package (pip install -e .) from a full checkout"
    )


def _package_model_dir(package: str) -> str:
    """OmegaConf resolver: the model folder shipped inside a Python package (offline models)."""
    try:
        module = importlib.import_module(package)
    except ImportError as err:
        raise ValueError(
            f"model folder package {package!r} is not installed; "
            f"pip install {package.replace('_', '-')}"
        ) from err
    getter = getattr(module, "get_model_path", None)
    path = Path(getter()) if callable(getter) else Path(module.__file__ or "").parent / "model"
    return str(path)


if not OmegaConf.has_resolver("package_model_dir"):
    OmegaConf.register_new_resolver("package_model_dir", _package_model_dir)


def parse_overrides(overrides: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Turn ``"dataset=ag_news model=llama32_3b"`` (shell-quoted) into a list of overrides."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return shlex.split(overrides)
    return list(overrides)


def compose_config(overrides: str | list[str] | tuple[str, ...] | None = None) -> DictConfig:
    """Compose ``conf/config.yaml`` with Hydra overrides, without resolving interpolations."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    items = parse_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            return compose(config_name="config", overrides=items)
    except HydraException as err:
        raise ValueError(f"bad configuration override in {items}: {err}") from err


def to_settings(cfg: DictConfig | dict[str, Any]) -> Settings:
    """Validate a composed config against :class:`Settings` and return typed dataclasses.

    Unknown keys and values of the wrong type raise ``ValueError`` naming the key.
    """
    container = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    container = OmegaConf.masked_copy(container, [str(k) for k in container if k != "hydra"])
    schema = OmegaConf.structured(Settings)
    try:
        merged = OmegaConf.merge(schema, container)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(f"invalid configuration: {err}") from err
    assert isinstance(obj, Settings)
    return obj


def settings_to_yaml(settings: Settings) -> str:
    """The resolved configuration as YAML, for logs and for saving beside results."""
    return OmegaConf.to_yaml(OmegaConf.structured(settings))


def settings_from_yaml(text: str) -> Settings:
    """Inverse of :func:`settings_to_yaml`."""
    loaded = OmegaConf.create(text)
    assert isinstance(loaded, DictConfig)
    return to_settings(loaded)


#: Settings that may legitimately differ between the machines of one federation.
NODE_LOCAL_KEYS = (
    "device",
    "cache_dir",
    "output_dir",
    "progress",
    "dataset.path",
    "dataset.test_path",
    "model.name_or_path",
    "resume",
)


def fingerprint(settings: Settings) -> str:
    """A short hash of everything that server and clients must agree on.

    Node-local values (:data:`NODE_LOCAL_KEYS`: data and model locations, device, cache) are
    left out, so that each machine can point at its own copies.
    """
    conf = OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(settings)))
    for key in NODE_LOCAL_KEYS:
        OmegaConf.update(conf, key, None)
    text = OmegaConf.to_yaml(conf, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: Flower ``--node-config`` keys a SuperNode may set, and the settings they override.
NODE_CONFIG_KEYS = {
    "data-path": "dataset.path",
    "test-data-path": "dataset.test_path",
    "model-path": "model.name_or_path",
    "device": "device",
    "cache-dir": "cache_dir",
}


def apply_node_config(settings: Settings, node_config: Mapping[str, Any]) -> Settings:
    """Return a copy of ``settings`` with this node's local paths and device applied."""
    conf = OmegaConf.structured(settings)
    for key, target in NODE_CONFIG_KEYS.items():
        value = node_config.get(key)
        if value not in (None, ""):
            OmegaConf.update(conf, target, str(value))
    return to_settings(conf)


def settings_from_run_config(run_config: Mapping[str, Any]) -> Settings:
    """Settings from Flower's run config: its ``overrides`` value holds Hydra overrides.

    ``flwr run . --run-config 'overrides="dataset=ag_news mode=adapter fl.rounds=10"'``

    A non-empty ``settings`` value (a whole resolved configuration as YAML, what
    :func:`settings_to_yaml` writes) takes precedence: in-process simulations of a sweep pass
    configurations composed elsewhere this way.
    """
    text = run_config.get("settings", "")
    overrides = run_config.get("overrides", "")
    if text and not isinstance(text, str):
        raise ValueError(f"run config 'settings' must be YAML text, got {type(text).__name__}")
    if not isinstance(overrides, str):
        raise ValueError(
            f"run config 'overrides' must be a string of Hydra overrides, got {overrides!r}"
        )
    # A simulated client sees the same run config in every round: compose it once (~0.1 s)
    key = (text, overrides)
    if key not in _RUN_SETTINGS:
        _RUN_SETTINGS[key] = settings_from_yaml(text) if text else load_settings(overrides)
    return copy.deepcopy(_RUN_SETTINGS[key])


_RUN_SETTINGS: dict[tuple[str, str], Settings] = {}


def load_settings(overrides: str | list[str] | tuple[str, ...] | None = None) -> Settings:
    """Compose and validate in one step: the single way entry points read configuration."""
    return to_settings(compose_config(overrides))
