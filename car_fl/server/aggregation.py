"""Name → Flower Message-API strategy, and the guarded strategy of a run.

Every strategy is Flower's own (``flwr.serverapp.strategy``); car-fl's sampling, reply checks,
update-norm bound and round records wrap whichever is chosen
(:class:`~car_fl.server.strategy.GuardedStrategy`), so none of them is copied per strategy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from flwr.serverapp.strategy import (
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
)

from car_fl.privacy.mechanism import split_adapter
from car_fl.server.expert_plan import ExpertPlan
from car_fl.server.strategy import GuardedStrategy, NormBound, Spec
from car_fl.settings.dp_plan import public_examples
from car_fl.settings.schema import Settings, StrategyConfig, StrategyName

#: ``strategy.name`` → the Flower strategy it builds.
REGISTRY: dict[StrategyName, Callable[[StrategyConfig], FedAvg]] = {
    StrategyName.FEDAVG: lambda cfg: FedAvg(),
    StrategyName.MEDIAN: lambda cfg: FedMedian(),
    StrategyName.TRIMMED_MEAN: lambda cfg: FedTrimmedAvg(beta=cfg.trim_fraction),
    StrategyName.KRUM: lambda cfg: Krum(num_malicious_nodes=cfg.num_malicious),
    StrategyName.MULTIKRUM: lambda cfg: MultiKrum(
        num_malicious_nodes=cfg.num_malicious, num_nodes_to_select=cfg.num_selected
    ),
    StrategyName.FEDADAM: lambda cfg: FedAdam(
        eta=cfg.eta, eta_l=cfg.eta_l, beta_1=cfg.beta_1, beta_2=cfg.beta_2, tau=cfg.tau
    ),
    StrategyName.FEDYOGI: lambda cfg: FedYogi(
        eta=cfg.eta, eta_l=cfg.eta_l, beta_1=cfg.beta_1, beta_2=cfg.beta_2, tau=cfg.tau
    ),
    StrategyName.FEDAVGM: lambda cfg: FedAvgM(
        server_learning_rate=cfg.server_lr, server_momentum=cfg.server_momentum
    ),
    StrategyName.FEDPROX: lambda cfg: FedProx(proximal_mu=cfg.proximal_mu),
}
assert set(REGISTRY) == set(StrategyName), "every strategy name builds a strategy"


def flower_strategy(cfg: StrategyConfig) -> FedAvg:
    """The Flower strategy named by ``strategy.name`` (validated by :class:`StrategyName`)."""
    return REGISTRY[cfg.name](cfg)


def build_strategy(
    settings: Settings,
    *,
    spec: Spec,
    shard_sizes: Mapping[int, int] | None = None,
    layout: str | None = None,
) -> GuardedStrategy:
    """The run's strategy: Flower's chosen one, guarded by car-fl's sampling and checks."""
    fl = settings.fl
    dim = sum(math.prod(shape) for shape, _ in spec.values())
    adapter_dim = sum(math.prod(spec[name][0]) for name in split_adapter(spec)[0])
    return GuardedStrategy(
        flower_strategy(settings.strategy),
        spec=spec,
        min_clients=fl.min_clients,
        sample_size=fl.sample_size,
        seed=settings.seed,
        max_examples=fl.max_examples_per_client,
        shard_sizes=shard_sizes,
        norm_bound=NormBound.from_settings(settings, dim=dim, adapter_dim=adapter_dim),
        min_valid=fl.min_valid_replies,
        min_valid_fraction=fl.min_valid_fraction,
        experts=ExpertPlan.from_settings(settings, spec, layout) if layout is not None else None,
        public_examples=public_examples(settings) if settings.dp.enabled else None,
        private_from=settings.dp.warmup_rounds + 1,
    )
