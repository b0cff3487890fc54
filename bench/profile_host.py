"""Where a training step's host (CPU) time goes: cProfile of Galaxy's training loop and of the
textbook loop over the same architecture from transformers, on one GPU.

    python bench/profile_host.py --preset bert-large --seq 512 --batch 8 --steps 10 --out DIR
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_plans import StepTimer, plain_train, profile_parser, serial_pair  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.train.loop import train  # noqa: E402


def main():
    p = profile_parser(__doc__, rows=30)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    ctx = ParallelContext.serial("cuda" if torch.cuda.is_available() else "cpu", seed=0)
    cfg, batch_at, ours, theirs = serial_pair(args, ctx, max_steps=args.steps, dtype="bfloat16")
    runs = {"galaxy": lambda on_step: train(ours, batch_at, cfg, ctx, on_step=on_step),
            "hf": lambda on_step: plain_train(theirs, batch_at, cfg, ctx.device, on_step)}
    for name, run in runs.items():
        run(StepTimer())  # warm-up (allocator, autotuning)
        timer = StepTimer()
        prof = cProfile.Profile()
        timer.start()
        prof.enable()
        run(timer)
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.rows)
        stats.sort_stats("cumulative").print_stats(args.rows)
        median = sorted(timer.times)[len(timer.times) // 2]
        text = f"==== {name}: median step {median * 1e3:.1f} ms (under cProfile) ====\n{out.getvalue()}"
        print(text)
        with open(os.path.join(args.out, f"host_{name}.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
