"""``car-fl train``: centralised training on this machine (the federation's reference)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

NAME = "train"
HELP = "centralised training on this machine: car-fl train model=minilm dataset.path=data.tsv"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides, e.g. model=minilm dataset.path=data.tsv train.epochs=3 "
        "(every key: docs/configuration.md)",
    )


def run(args: argparse.Namespace) -> int:
    """Compose the settings, check the encoder and data can be had, then train."""
    from car_fl.common.progress import setup_logging
    from car_fl.model.sources import check_sources
    from car_fl.settings.compose import load_settings
    from car_fl.settings.dp_modes.registry import MODES

    settings = load_settings(args.overrides)
    one_node = MODES[settings.dp.mode].one_machine == "one node"
    if settings.resume:  # a mistyped folder fails first; DP-SGD's run is a one-node federation
        from car_fl.results.run import CENTRALIZED, FEDERATED, check_run_dir

        check_run_dir(Path(settings.resume), FEDERATED if one_node else CENTRALIZED)
    check_sources(settings)  # before torch (without resume=) and transformers are imported
    setup_logging()
    logging.getLogger(__name__).info("loading PyTorch and car-fl's model code (seconds)")
    from car_fl.results.run import default_output_dir
    from car_fl.simulation.centralized_dp import train_centrally

    # a resumed run goes on in its own folder
    out = Path(settings.resume or settings.output_dir or default_output_dir(settings))
    summary = train_centrally(settings, out)  # dp=record: DP-SGD; local DP modes: refused
    best = summary["best"]
    private = (
        f" at ε {summary['epsilon']:.3g} (δ {summary['delta']:g})" if "epsilon" in summary else ""
    )
    print(
        f"car-fl train: best on validation after epoch {best['round']}: test top-1 "
        f"{best['test_top1']:.4f}{private}; results: {out}"
    )
    return 0
