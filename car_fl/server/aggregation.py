"""Name → Flower Message-API strategy.

Every strategy is Flower's own (``flwr.serverapp.strategy``); car-fl's sampling, reply checks,
update-norm bound and round records wrap whichever is chosen
(:meth:`car_fl.server.strategy.GuardedStrategy.for_run`), so none of them is copied per strategy.
"""

from __future__ import annotations

from collections.abc import Callable

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

from car_fl.settings.schema import StrategyConfig, StrategyName

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
