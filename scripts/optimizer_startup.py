"""A process's first and later optimizer steps: torch.optim against an earlier commit's optimiser.

    python scripts/optimizer_startup.py [--old-from 9d57a49] [--repeats 5]

Each measurement is a fresh Python process (what a Flower ClientApp without a node worker is)
with one torch thread: AdamW over a 576x576 adapter and a 2-row head (SmolLM2-135M's width),
batch 32. ``--old-from`` names a git commit whose ``car_fl/method/optim.py`` (the hand-written
SGD/Adam/AdamW car-fl used before it went back to ``torch.optim``) runs alternately with
``torch.optim``. Prints the median first step, the median later step, whether the process
imported ``torch._dynamo``, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = r"""
import json, statistics, sys, time
import torch
torch.manual_seed(0)
head = torch.nn.Linear(576, 2)
adapter = torch.nn.Parameter(torch.eye(576))
params = [{"params": list(head.parameters()), "lr": 1e-3}, {"params": [adapter], "lr": 1e-4}]
x = torch.randn(32, 576)
def step(opt):
    opt.zero_grad()
    (head(x @ adapter) ** 2).mean().backward()
    opt.step()
if sys.argv[1] == "torch":
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
else:
    sys.path.insert(0, sys.argv[2])
    from old_optim import Optimizer
    opt = Optimizer(params, kind="adamw", weight_decay=0.01)
t = time.perf_counter(); step(opt); first = time.perf_counter() - t
later = []
for _ in range(21):
    t = time.perf_counter(); step(opt); later.append(time.perf_counter() - t)
print(json.dumps({"first": first, "later": statistics.median(later),
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-from", default="9d57a49", help="a commit that has optim.py")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        source = subprocess.run(
            ["git", "show", f"{args.old_from}:car_fl/method/optim.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if source.returncode != 0:
            sys.exit(
                f"optimizer_startup.py: commit {args.old_from} has no car_fl/method/optim.py: "
                "pass --old-from with a commit before car-fl went back to torch.optim"
            )
        (Path(tmp) / "old_optim.py").write_text(source.stdout)
        runs: dict[str, list[dict[str, float]]] = {"hand-written": [], "torch": []}
        for _ in range(args.repeats):
            for kind in runs:
                out = subprocess.run(
                    [sys.executable, "-c", CODE, kind, tmp],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                runs[kind].append(json.loads(out.stdout))
    for kind, rows in runs.items():
        first = statistics.median(r["first"] for r in rows)
        later = statistics.median(r["later"] for r in rows)
        print(
            f"{kind:>12}: first step {first * 1000:.1f} ms, later steps {later * 1000:.2f} ms "
            f"(median of {args.repeats} processes); "
            f"torch._dynamo imported: {bool(rows[0]['dynamo'])}"
        )
    print(f"load average (1 min) {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
