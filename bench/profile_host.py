"""Where a training step's host (CPU) time goes: cProfile of Galaxy's training loop and of the
textbook loop over the same architecture from transformers, on one GPU.

    python bench/profile_host.py --preset bert-large --seq 512 --batch 8 --steps 10 --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_plans import causal_lm_data, hf_model, plain_train  # noqa: E402
from galaxy.config import GalaxyConfig  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.models import build_model  # noqa: E402
from galaxy.peft import apply_tuning  # noqa: E402
from galaxy.train.loop import train  # noqa: E402
from galaxy.train.pretrain import mlm_data  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bert-large")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--override", action="append", default=[], help="key=value config overrides")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    overrides = dict(kv.split("=", 1) for kv in args.override)
    overrides = {k: (float(v) if v.replace(".", "", 1).isdigit() else v) for k, v in overrides.items()}
    cfg = GalaxyConfig.from_dict({"preset": args.preset, "seq_length": args.seq, "global_batch_size": args.batch,
                                  "max_steps": args.steps, "dtype": "bfloat16", **overrides})
    ctx = ParallelContext.serial("cuda" if torch.cuda.is_available() else "cpu", seed=0)
    batch_at = causal_lm_data(cfg) if cfg.model.model_type == "llama" else mlm_data(cfg)[0]
    ours = apply_tuning(build_model(cfg, None, ctx), cfg)
    theirs = hf_model(cfg.model.model_type, ours.config_to_hf(), ctx.device, cfg)
    runs = {"galaxy": lambda on_step: train(ours, batch_at, cfg, ctx, progress=False, on_step=on_step),
            "hf": lambda on_step: plain_train(theirs, batch_at, cfg, ctx.device, on_step)}
    for name, run in runs.items():
        times, last = [], [time.perf_counter()]

        def on_step(step, loss):
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now

        run(on_step)  # warm-up (allocator, autotuning)
        times.clear()
        prof = cProfile.Profile()
        last[0] = time.perf_counter()
        prof.enable()
        run(on_step)
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(args.rows)
        stats.sort_stats("cumulative").print_stats(args.rows)
        median = sorted(times)[len(times) // 2]
        text = f"==== {name}: median step {median * 1e3:.1f} ms (under cProfile) ====\n{out.getvalue()}"
        print(text)
        with open(os.path.join(args.out, f"host_{name}.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
