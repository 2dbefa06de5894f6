"""Sweeps: every combination of a Hydra multirun as a complete run, then one report.

    python -m car_fl.sweep -m clients=1,2,3 dp=none,fixed,adaptive mode=classifier,adapter
    python -m car_fl.sweep -m experiment=sms_mips model=minilm

``clients=1`` is a centralised run (``sweep.centralized_epochs``, by default the federation's
passes over the data), ``clients>=2`` a Flower simulation. Each job leaves its run files and
``job.json`` (ok / failed / skipped, with the reason); a failing job does not stop the sweep,
combinations that make no sense are skipped. Then ``report/`` is written; the exit code is 1
if any job failed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from car_fl.common.io import atomic_write_json
from car_fl.results.report import JOB_JSON, write_report
from car_fl.settings.compose import conf_dir, register_configs, to_settings
from car_fl.settings.schema import (
    HeadKind,
    Settings,
    centralised_only,
    federated_part,
    has_head_to_probe,
    nothing_to_train,
)

log = logging.getLogger(__name__)

#: Keys of ``conf/sweep.yaml`` that are not run settings.
SWEEP_KEYS = ("clients", "sweep", "experiment")
_FAILED: list[str] = []


def job_settings(cfg: DictConfig) -> tuple[Settings, int]:
    """The run's settings and client count from a sweep job's composed configuration."""
    clients = int(cfg.clients)
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    if cfg.get("resume"):
        raise ValueError(
            f"resume={cfg.resume} continues one run in its own folder, and a sweep's jobs each "
            "write their own: resume a stopped job with car-fl train (clients=1) or car-fl run "
            "and its overrides (its job.json), resume=<its folder>"
        )
    keep = [str(k) for k in cfg if str(k) not in (*SWEEP_KEYS, "hydra")]
    conf = OmegaConf.masked_copy(cfg, keep)
    if int(cfg.fl.probe_rounds) and not has_head_to_probe(HeadKind(str(cfg.head.kind))):
        # MIPS has no head to probe: its jobs train the adapter from the start
        log.info(
            "fl.probe_rounds=%s: head.kind=%s has no head to probe; this job trains the "
            "adapter from the start",
            cfg.fl.probe_rounds,
            cfg.head.kind,
        )
        OmegaConf.update(conf, "fl.probe_rounds", 0)
    if clients == 1:
        epochs = cfg.sweep.centralized_epochs
        if epochs is None:
            epochs = int(cfg.fl.rounds) * int(cfg.fl.local_epochs)
        OmegaConf.update(conf, "train.epochs", int(epochs))
        probe = int(conf.fl.probe_rounds) * int(cfg.fl.local_epochs)
        if probe and not int(cfg.train.probe_epochs):  # the federated probe's passes, here
            OmegaConf.update(conf, "train.probe_epochs", probe)
    else:
        OmegaConf.update(conf, "fl.clients", clients)
        if int(cfg.fl.min_clients) > clients:
            OmegaConf.update(conf, "fl.min_clients", clients)
        settings = to_settings(conf)
        dropped = centralised_only(settings)
        if dropped:
            log.info(
                "%s: not for a federated job (only car-fl train reads it)", " and ".join(dropped)
            )
        return federated_part(settings), clients
    return to_settings(conf), clients


def skip_reason(settings: Settings, clients: int) -> str:
    """Why this combination is not run ('' when it is)."""
    if clients == 1 and settings.dp.enabled:
        return (
            f"dp={settings.dp.mode} with clients=1: local DP privatises client updates in a "
            "federation; a centralised run has none"
        )
    if clients > 1 and nothing_to_train(settings):
        return (
            f"head.kind={settings.head.kind} in mode={settings.train.mode} trains nothing, so "
            "there is nothing to federate (its centralised run is the result)"
        )
    return ""


def run_job(cfg: DictConfig, output_dir: str | Path, overrides: list[str]) -> dict[str, Any]:
    """Run one sweep job, never raising for a failed run; returns what ``job.json`` holds."""
    from car_fl.results.run import write_config
    from car_fl.simulation.flower import run_simulation
    from car_fl.standalone.centralized import run_centralized

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Flower logs through its own console handler; Hydra's root handler would print it twice
    logging.getLogger("flwr").propagate = False
    tick = time.perf_counter()
    record: dict[str, Any] = {"overrides": overrides, "status": "failed", "reason": ""}
    try:
        settings, clients = job_settings(cfg)
        record["clients"] = clients
        settings.output_dir = str(out.resolve())
        write_config(settings, out)  # a skipped or failed job's folder says what it was
        reason = skip_reason(settings, clients)
        if reason:
            record.update(status="skipped", reason=reason)
            log.warning("skipped %s: %s", " ".join(overrides), reason)
        else:
            if clients == 1:
                run_centralized(settings, out)
            else:
                run_simulation(settings=settings)
            record["status"] = "ok"
    except (Exception, SystemExit) as err:  # a failed job must not stop the sweep
        record["reason"] = f"{type(err).__name__}: {err}"
        record["traceback"] = traceback.format_exc()
        log.error("job %s failed: %s", " ".join(overrides), record["reason"])
    record["seconds"] = time.perf_counter() - tick
    atomic_write_json(out / JOB_JSON, record)
    return record


class ReportCallback(Callback):
    """Writes the sweep's report when a multirun ends, and remembers failed jobs."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        record = getattr(job_return, "_return_value", None)
        if isinstance(record, dict) and record.get("status") == "failed":
            _FAILED.append(str(config.hydra.runtime.output_dir))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            report = write_report([sweep_dir], sweep_dir / "report")
        except Exception:  # the jobs' own results are still there
            log.exception("could not write the sweep report for %s", sweep_dir)
            _FAILED.append("report")
            return
        counts = ", ".join(f"{n} {status}" for status, n in sorted(report.counts.items()))
        print(f"sweep {sweep_dir}: {len(report.rows)} jobs ({counts}); report: {report.markdown}")


register_configs()  # the schema and generated groups, before Hydra composes conf/


@hydra.main(config_path=str(conf_dir()), config_name="sweep", version_base=None)
def main(cfg: DictConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    record = run_job(cfg, hydra_cfg.runtime.output_dir, list(hydra_cfg.overrides.task))
    print(json.dumps({k: v for k, v in record.items() if k != "traceback"}), flush=True)
    return record


if __name__ == "__main__":
    main()
    # Hydra instantiated ReportCallback from the importable module car_fl.sweep, not from this
    # __main__ module: read the failures it recorded there
    from car_fl import sweep as registered

    sys.exit(1 if registered._FAILED else 0)
