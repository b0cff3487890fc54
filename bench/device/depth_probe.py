"""Does a serial training step's time per layer grow with depth under sustained load (issue 31: the planner
calibrates its pieces on a 2-layer step, and its 32-layer FSDP2 plans ran 8-12% slower than predicted)?
For each depth, the profile's own serial step (``measure_serial``: the Trainer, autocast, compiled layers) in a
burst of 3 steps, then back to back for ``--seconds``; the median of the last fifth is the sustained step.

    PYTHONPATH=. python3 bench/device/depth_probe.py --layers 1 2 4 8 --rows 4 --out depth.json
"""

import argparse
import dataclasses
import json
import math
import statistics

import torch

from galaxy.config import GalaxyConfig
from galaxy.planner.profile import measure_serial


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda", 0)
    cfg = GalaxyConfig.from_dict({"model": {"preset": args.model}}, {"dtype": "bfloat16", "compile": True})
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "rows": args.rows, "seq": args.seq, "depths": []}
    for layers in args.layers:
        m = dataclasses.replace(cfg.model, num_hidden_layers=layers)
        burst, _, _ = measure_serial(m, args.rows, args.seq, "bfloat16", device, 3, forwards=False)
        torch.cuda.empty_cache()
        reps = max(5, math.ceil(args.seconds / min(burst)))
        steps, _, peak = measure_serial(m, args.rows, args.seq, "bfloat16", device, reps, forwards=False)
        torch.cuda.empty_cache()
        late = statistics.median(steps[-max(3, len(steps) // 5):])
        row = {"layers": layers, "burst_s": statistics.median(burst), "sustained_s": late, "steps": len(steps),
               "peak_bytes": peak}
        result["depths"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
