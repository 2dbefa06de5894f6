"""The fast test suite's wall and CPU time with one torch thread and with torch's default,
alternating, side by side, quiet or beside busy processes.

    python scripts/bench_suite.py --json docs/results/threads/suite.json
    python scripts/bench_suite.py --busy 1 --paths tests/server tests/client

Each run is ``python -m pytest -m "not slow" -q -p no:cacheprovider PATHS`` with
``OMP_NUM_THREADS`` set (1) or unset (torch's default: one per core); the load average is
written before and after each run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def busy() -> None:
    while True:
        pass


def suite(paths: list[str], threads: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    command = [sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider"]
    load_before, before, tick = os.getloadavg()[0], os.times(), time.perf_counter()
    done = subprocess.run(
        [*command, *paths], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    wall, after = time.perf_counter() - tick, os.times()
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    return {
        "omp_num_threads": threads or "default",
        "wall_seconds": wall,
        "cpu_seconds": after.children_user
        + after.children_system
        - before.children_user
        - before.children_system,
        "passed": int(m.group(1)) if (m := re.search(r"(\d+) passed", summary)) else 0,
        "failed": int(m.group(1)) if (m := re.search(r"(\d+) failed", summary)) else 0,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", nargs="*", default=["tests"], help="test paths (tests)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the suite")
    parser.add_argument("--json", type=Path, help="write the runs here")
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.busy)]
    for hog in hogs:
        hog.start()
    runs = []
    try:
        for _ in range(args.repeats):
            for threads in ("1", None):
                runs.append(suite(args.paths, threads))
                run = runs[-1]
                print(
                    f"OMP_NUM_THREADS={run['omp_num_threads']:7s} {run['wall_seconds']:6.1f} s "
                    f"wall, {run['cpu_seconds']:6.1f} s CPU, {run['passed']} passed, "
                    f"{run['failed']} failed, load {run['load_before']:.2f} -> "
                    f"{run['load_after']:.2f}",
                    flush=True,
                )
    finally:
        for hog in hogs:
            hog.terminate()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(["python", *sys.argv]), "cpu_count": os.cpu_count()}
        args.json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
