"""Where a training step's GPU time goes: torch.profiler's top kernels for Galaxy's serial model
and the same architecture from transformers, one forward+backward each.

    python bench/profile_model.py --preset bert-large --seq 512 --batch 8 --out DIR
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.bench_plans import profile_parser, serial_pair  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402


def main():
    args = profile_parser(__doc__, rows=18).parse_args()
    ctx = ParallelContext.serial("cuda", seed=0)
    _, batch_at, ours, theirs = serial_pair(args, ctx, attention_probs_dropout_prob=0.0)
    batch = {k: v.cuda() for k, v in batch_at(0).items()}
    for name, model in (("galaxy", ours), ("hf", theirs)):
        model.train()
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(**batch).loss.backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    model(**batch).loss.backward()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60)
        print(f"\n==== {name} ({args.preset}, seq {args.seq}, batch {args.batch}, 3 fwd+bwd) ====\n{table}")
        with open(os.path.join(args.out, f"profile_{name}.txt"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
