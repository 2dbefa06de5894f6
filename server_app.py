"""car-fl ServerApp: federated averaging of the CaR adapter and classifier head."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from car_fl.common.logs import setup_logging
from car_fl.server.federation import run_federation
from car_fl.settings.flower import settings_from_run_config

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    setup_logging()
    # Configuration: conf/ plus the Hydra overrides given in --run-config
    settings = settings_from_run_config(context.run_config)
    # Rounds of local training and weighted averaging; results under settings.output_dir
    run_federation(grid, settings)
