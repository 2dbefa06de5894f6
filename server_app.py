"""car-fl ServerApp: federated averaging of the CaR adapter and classifier head."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from car_fl.common.progress import setup_logging
from car_fl.settings.compose import settings_from_run_config

app = ServerApp()
log = logging.getLogger("car_fl.server_app")


@app.main()
def main(grid: Grid, context: Context) -> None:
    setup_logging()
    # Configuration: conf/ plus the Hydra overrides given in --run-config
    settings = settings_from_run_config(context.run_config)
    # PyTorch and the model code load now, not at import: the log says so first
    log.info("ServerApp: loading PyTorch and car-fl's model code (seconds on a laptop)")
    from car_fl.server.federation import run_federation

    # Rounds of local training and weighted averaging; results under settings.output_dir
    run_federation(grid, settings)
