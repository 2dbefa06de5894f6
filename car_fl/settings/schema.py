"""The configuration schema: :class:`Settings`, typed and validated, the single source of defaults.

The sections are in :mod:`~car_fl.settings.inputs`, :mod:`~car_fl.settings.retriever`,
:mod:`~car_fl.settings.federation`, :mod:`~car_fl.settings.choices` and, with each kind's
registration, the adapter's and the head's: :mod:`car_fl.adapters.config`,
:mod:`car_fl.heads.config`. This module holds the whole, the checks that span sections, and
every part's name (the one import a caller needs). Checks that need the accountant are in
:mod:`car_fl.settings.dp_plan`. Imports no Hydra, OmegaConf or torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from car_fl.adapters.config import AdapterConfig, AdapterKind
from car_fl.heads.config import (
    APPROACHES,
    ApproachSpec,
    ExpertSending,
    HeadConfig,
    HeadKind,
    HeadTraits,
    Lexical,
    MapKind,
    MoEConfig,
    Similarity,
    approach_of,
    formed_approach,
)
from car_fl.settings.choices import (
    DEVICES,
    DTYPES,
    PADDING_SIDES,
    WIRE_DTYPES,
    AdaptiveRule,
    Choice,
    DPMode,
    FeatureNorm,
    Granularity,
    Mode,
    NoiseRule,
    NormBoundAction,
    NormBoundMode,
    OptimizerKind,
    Partitioning,
    Pooling,
    Reader,
    Split,
    Standardize,
    StrategyName,
    one_of,
    positive,
)
from car_fl.settings.federation import CommConfig, DPConfig, FLConfig, StrategyConfig
from car_fl.settings.inputs import DatasetConfig, ModelConfig
from car_fl.settings.retriever import EvalConfig, TrainConfig

__all__ = [
    "APPROACHES",
    "DEVICES",
    "DTYPES",
    "PADDING_SIDES",
    "WIRE_DTYPES",
    "AdapterConfig",
    "AdapterKind",
    "AdaptiveRule",
    "ApproachSpec",
    "Choice",
    "CommConfig",
    "DPConfig",
    "DPMode",
    "DatasetConfig",
    "EvalConfig",
    "ExpertSending",
    "FLConfig",
    "FeatureNorm",
    "Granularity",
    "HeadConfig",
    "HeadKind",
    "HeadTraits",
    "Lexical",
    "MapKind",
    "MoEConfig",
    "Mode",
    "ModelConfig",
    "NoiseRule",
    "NormBoundAction",
    "NormBoundMode",
    "OptimizerKind",
    "Partitioning",
    "Pooling",
    "Reader",
    "Settings",
    "Similarity",
    "Split",
    "Standardize",
    "StrategyConfig",
    "StrategyName",
    "TrainConfig",
    "approach_of",
    "nothing_to_train",
    "one_of",
    "positive",
]


@dataclass
class Settings:
    """The whole resolved configuration of a run, typed and validated."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    fl: FLConfig = field(default_factory=FLConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    seed: int = 42
    #: auto: CUDA, then Apple MPS, then CPU.
    device: str = "auto"
    #: car-fl's cache folder (features per text under features/, classifier mode). null:
    #: $CAR_FL_CACHE, else ~/.cache/car-fl. Ignored on a federated node, which writes only
    #: under its own node config's cache-dir (the same default).
    cache_dir: str | None = None
    #: Where results go. null: the Hydra run directory (centralised) or runs/<timestamp> (Flower).
    output_dir: str | None = None
    progress: bool = True
    #: Continue a stopped run: resume=<its run directory> (same overrides; fl.rounds, or
    #: train.epochs for car-fl train, may be raised), from its newest step's checkpoint and
    #: optimiser state (car_fl.results.run).
    resume: str | None = None

    def __post_init__(self) -> None:
        one_of("device", self.device, DEVICES)
        if self.fl.partitioning is Partitioning.HASH and self.dataset.split is not Split.HASH:
            raise ValueError(
                "fl.partitioning=hash places each record by its own text, but "
                f"dataset.split={self.dataset.split} places the split by the others; set "
                "dataset.split=hash too (the server's validation and test are then the nodes')"
            )
        if not self.head.kind.traits.adapts and self.train.mode is Mode.ADAPTER_CLASSIFIER:
            raise ValueError(
                f"head.kind={self.head.kind} trains nothing, so mode=adapter does not apply; use "
                "mode=classifier (it scores with the frozen encoder's embeddings)"
            )
        if self.fl.probe_rounds and not has_head_to_probe(self.head.kind):
            raise ValueError(
                f"fl.probe_rounds trains a classifier head alone before the adapter (approach="
                f"adapter_car); head.kind={self.head.kind} has none to probe: set "
                "fl.probe_rounds=0"
            )
        self._check_aggregation()
        self._check_documents()

    def _check_documents(self) -> None:
        """Document heads need documents; the experts a client sends under DP must not depend
        on its data; stateful server optimisers need every tensor every round."""
        kind = self.head.kind
        documents = self.dataset.reader is Reader.CORPUS or self.dataset.label_texts
        if kind.traits.from_documents and not documents:
            raise ValueError(
                f"head.kind={kind} starts its rows from the documents' embeddings: use a "
                "corpus (dataset=corpus) or give dataset.label_texts"
            )
        corpus = self.dataset.reader is Reader.CORPUS
        if self.model.standardize is Standardize.DOCUMENTS and not corpus:
            raise ValueError(
                "model.standardize=documents scales features with the statistics of a corpus's "
                f"documents; dataset.reader={self.dataset.reader} has only its labels' texts. Use "
                "a corpus (dataset=corpus) or model.standardize=none"
            )
        if self.head.lexical is not Lexical.NONE:  # only where an approach registers it
            adapter = self.train.mode is Mode.ADAPTER_CLASSIFIER
            if not corpus or formed_approach(kind, adapter, self.head.lexical) is None:
                named = [n for n, (_, a) in APPROACHES.items() if a.lexical is self.head.lexical]
                raise ValueError(
                    f"head.lexical={self.head.lexical} indexes a corpus's documents beside the "
                    f"head of an approach that registers it: use approach={' or '.join(named)} "
                    "on a corpus (dataset=corpus), or head.lexical=none"
                )
        if not kind.traits.experts:
            return
        if self.dp.enabled and self.moe.send is ExpertSending.ROUTED:
            raise ValueError(
                f"moe.send=routed sends the experts a client's queries reach, which depends on "
                f"its data; under dp={self.dp.mode} use moe.send=schedule (a fixed rotation) or "
                "moe.send=all (every expert, noised)"
            )
        stateful = (StrategyName.FEDADAM, StrategyName.FEDYOGI, StrategyName.FEDAVGM)
        if self.strategy.name in stateful and self.moe.send is not ExpertSending.ALL:
            raise ValueError(
                f"strategy={self.strategy.name} keeps server state for every tensor and needs "
                f"all of them each round; use moe.send=all, or strategy=fedavg (moe.send="
                f"{self.moe.send} sends only some experts)"
            )

    @property
    def approach(self) -> str:
        """The name of the retrieval approach these settings run (:data:`APPROACHES`)."""
        adapter = self.train.mode is Mode.ADAPTER_CLASSIFIER
        return approach_of(self.head.kind, adapter, self.head.lexical)

    @property
    def approach_label(self) -> str:
        """What reports call this run's approach: its :attr:`approach`'s label, or, for a head
        and mode that form no approach (mixture of experts with the adapter), the head kind
        and the mode."""
        adapter = self.train.mode is Mode.ADAPTER_CLASSIFIER
        name = formed_approach(self.head.kind, adapter, self.head.lexical)
        return APPROACHES[name][1].label if name else f"{self.head.kind} head, {self.train.mode}"

    def _check_aggregation(self) -> None:
        """Strategy and norm-bound settings that only make sense with the federation's size."""
        asked = self.fl.sample_size(self.fl.clients)
        if (
            self.strategy.name is StrategyName.TRIMMED_MEAN
            and int(self.strategy.trim_fraction * asked) < 1
        ):
            fix = (
                f"set strategy.trim_fraction >= {1 / asked:.3g} (and < 0.5)"
                if asked >= 3
                else "it needs at least 3 clients per round (fl.clients=3)"
            )
            raise ValueError(
                f"strategy.trim_fraction={self.strategy.trim_fraction} cuts nothing from "
                f"{asked} replies per round (⌊β·n⌋ = 0); {fix}"
            )
        if (
            self.strategy.name in (StrategyName.KRUM, StrategyName.MULTIKRUM)
            and self.strategy.num_selected > asked
        ):
            raise ValueError(
                f"strategy.num_selected={self.strategy.num_selected} exceeds the {asked} "
                f"clients asked per round; set strategy.num_selected <= {asked}"
            )


def nothing_to_train(settings: Settings) -> bool:
    """A head without weights of its own (MIPS, kNN) and no adapter training through it has no
    trainable parameter: one evaluation, no epochs."""
    traits = settings.head.kind.traits
    return not traits.weights and (not traits.adapts or settings.train.mode is Mode.CLASSIFIER)


def has_head_to_probe(kind: HeadKind) -> bool:
    """Whether linear probing (``fl.probe_rounds``) has a head to train alone before the
    adapter: a classifier; MIPS scores with the encoder's own states."""
    return kind.traits.probe


#: The train settings only a centralised run's epoch loop reads (the linear probe), with the
#: values that leave them off. ``train.patience`` is read by both: epochs there, rounds here.
CENTRALISED_ONLY: dict[str, int | None] = {"probe_epochs": 0}


def centralised_only(settings: Settings) -> list[str]:
    """The :data:`CENTRALISED_ONLY` settings this run sets, as ``train.key=value``."""
    return [
        f"train.{key}={getattr(settings.train, key)}"
        for key, off in CENTRALISED_ONLY.items()
        if getattr(settings.train, key) != off
    ]


def federated_part(settings: Settings) -> Settings:
    """``settings`` without what only a centralised run reads: a sweep's federated jobs, which
    share their overrides with its centralised ones (a plain federated run refuses them)."""
    train = replace(settings.train, **CENTRALISED_ONLY)  # type: ignore[arg-type]
    return replace(settings, train=train)


def federation_refusal(settings: Settings) -> str:
    """Why ``settings`` cannot run federated ('' when they can), with the fix: nothing to
    train, or a setting a federated run would otherwise silently ignore."""
    if nothing_to_train(settings):
        return (
            f"head.kind={settings.head.kind} with train.mode={settings.train.mode} has nothing "
            "to train, so there is nothing to federate; evaluate it centrally "
            "(car-fl train ...) or train the adapter with mode=adapter (MIPS)"
        )
    keys = centralised_only(settings)
    if keys:
        return (
            f"{' and '.join(keys)} only steer a centralised run's epochs (car-fl train); a "
            "federated run trains fl.rounds rounds (train.patience may end it earlier) and "
            "keeps the round validation selects: remove "
            f"{' and '.join(k.split('=')[0] for k in keys)} from the run's configuration "
            "(fl.probe_rounds=N probes the head for N federated rounds before the adapter)"
        )
    return ""
