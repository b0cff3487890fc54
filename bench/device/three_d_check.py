"""3D layouts on GPUs equal the same layouts on CPUs (issue 31, item 8): dp2 x pp2, dp2 x galaxy2 and
pp2 x galaxy on 4 ranks, each trained by ``pretrain_galaxy.py`` twice from the same seed -- once on
4 GPUs (CUDA + NCCL), once on 4 CPU processes (Gloo) -- in float64 with dropout off, and their loss
curves compared step by step (relative difference; float64 on two devices' BLAS agrees to ~1e-12).

    python bench/device/three_d_check.py --json three_d.json            # on a 4-GPU machine
    python bench/device/three_d_check.py --devices cpu,cpu --steps 3    # here: the flow, CPU against CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUTS = {  # name -> config overrides on the embedded small BERT (4 layers so that pp 2 has 2 per stage)
    "dp2xpp2": {"dp_size": 2, "pp_size": 2, "plan": "none"},
    "dp2xgalaxy2": {"dp_size": 2, "pp_size": 1, "plan": "galaxy2"},
    "pp2xgalaxy": {"dp_size": 1, "pp_size": 2, "plan": "galaxy"},
}
COMMON = {"dtype": "float64", "hidden_dropout_prob": 0, "attention_probs_dropout_prob": 0, "num_hidden_layers": 4,
          "num_microbatches": 2, "global_batch_size": 8}


def losses(layout: str, device: str, steps: int, metrics: str) -> list[float]:
    overrides = {**COMMON, **LAYOUTS[layout], "device": device}
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_galaxy.py"), "--world", "4", "--max_steps", str(steps),
           "--no_progress", "--metrics_file", metrics]
    for key, value in overrides.items():
        cmd += ["--override", f"{key}={value}"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"{layout} on {device} exited {run.returncode}: {run.stderr.strip()[-2000:]}")
    with open(metrics) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="cuda,cpu", help="the two devices compared (default cuda,cpu)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--tolerance", type=float, default=1e-9, help="largest relative loss difference accepted")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    first, second = args.devices.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for layout in args.layouts.split(","):
            a = losses(layout, first, args.steps, os.path.join(workdir, f"{layout}_a.jsonl"))
            b = losses(layout, second, args.steps, os.path.join(workdir, f"{layout}_b.jsonl"))
            worst = max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) == args.steps else None
            rows.append(dict(layout=layout, overrides=LAYOUTS[layout], steps=args.steps, **{f"loss_{first}": a},
                             **{f"loss_{second}_ref": b}, max_rel_diff=worst,
                             equal=worst is not None and worst <= args.tolerance))
            print(f"{layout:12s} max relative loss difference {first} vs {second}: {worst}  "
                  f"{'EQUAL' if rows[-1]['equal'] else 'DIFFERENT'}", flush=True)
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT).stdout.strip() or os.environ.get("GALAXY_COMMIT", ""),
                  devices=[first, second], common=COMMON, tolerance=args.tolerance, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
