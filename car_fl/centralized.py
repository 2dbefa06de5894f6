"""Centralised training from Hydra's command line (the training:
:mod:`car_fl.standalone.centralized`; ``dp=record``: :mod:`car_fl.simulation.centralized_dp`).

    car-fl train dataset=sms_spam model=tinyllama mode=classifier
    python -m car_fl.centralized dataset=sms_spam model=tinyllama mode=classifier   # Hydra's CLI
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from car_fl.settings.compose import conf_dir, register_configs, to_settings
from car_fl.simulation.centralized_dp import train_centrally
from car_fl.standalone.centralized import run_centralized

__all__ = ["main", "run_centralized", "train_centrally"]

register_configs()  # the schema and generated groups, before Hydra composes conf/


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    settings = to_settings(cfg)
    where = settings.resume or settings.output_dir  # a resumed run goes on in its own folder
    train_centrally(settings, where or HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
