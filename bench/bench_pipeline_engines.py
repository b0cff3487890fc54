"""Step time of one pipeline on torch's schedules (``pipeline_engine: torch``, torch.distributed.pipelining)
against Galaxy's own (``pipeline_engine: galaxy``, galaxy/core/pipeline.py), in one launch.

    torchrun --nproc_per_node 2 bench/bench_pipeline_engines.py --device cpu                  # pp2 on Gloo
    torchrun --nproc_per_node 4 bench/bench_pipeline_engines.py --pp 2 --plan galaxy \\
        --preset bert-large --seq 512 --batch 32 --microbatches 8 --dtype bfloat16 --json pp_engines.json  # GPUs

World = dp x pp x mp (mp = world / (dp x pp), running ``--plan`` inside each stage). Every run is whole
training steps through ``galaxy.train.loop.train`` (forward, backward, gradient sync, clipping, AdamW) on
the synthetic corpus, the first ``--warmup`` steps untimed; the engines alternate over ``--rounds`` rounds
(so drift of the machine hits both alike) and each row is the median step over all its timed steps.
Both engines start from the same weights and data, so their losses must agree: the largest relative
difference per schedule is printed as a check. A benchmark, not a test: nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_coc import git_commit  # noqa: E402
from bench.bench_plans import StepTimer, causal_lm_data  # noqa: E402
from galaxy.config import DistributedConfig, GalaxyConfig, parse_override  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.data.pretraining import mlm_data  # noqa: E402
from galaxy.models import build_model  # noqa: E402
from galaxy.train.loop import train  # noqa: E402


def config_for(args, engine: str, schedule: str) -> GalaxyConfig:
    raw = {"model": {"preset": args.preset, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
           "parallel": {"plan": args.plan, "dp_size": args.dp, "pp_size": args.pp,
                        "num_microbatches": args.microbatches, "pipeline_schedule": schedule,
                        "pipeline_engine": engine},
           "train": {"global_batch_size": args.batch, "seq_length": args.seq, "max_steps": args.warmup + args.steps,
                     "dtype": args.dtype, "lr": 1e-4, "warmup_steps": 0, "grad_clip": 1.0, "device": args.device,
                     "log_every": 10**6}}
    return GalaxyConfig.from_dict(raw, dict(parse_override(o) for o in args.override))


def run(args, ctx: ParallelContext, engine: str, schedule: str) -> dict:
    """``--warmup + --steps`` training steps of a fresh model (same seed for every run)."""
    cfg = config_for(args, engine, schedule)
    batch_at = causal_lm_data(cfg) if cfg.model.model_type == "llama" else mlm_data(cfg)[0]
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    timer = StepTimer(args.warmup)
    result = train(model, batch_at, cfg, ctx, on_step=timer)
    del model
    return {"times": timer.times, "losses": result.losses, "bubble": result.bubble_measured,
            "bubble_analytic": result.bubble_analytic}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bert-tiny")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per dp shard")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--plan", default="none", help="the mp plan inside each stage (none when mp is 1)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--engines", default="torch,galaxy")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    first = config_for(args, "torch", "gpipe")
    ctx = ParallelContext.initialize(DistributedConfig(init_method="env://", timeout_s=600), rank, world, args.device,
                                     seed=first.train.seed, local_rank=local_rank, dp_size=args.dp, pp_size=args.pp,
                                     stage_layers=first.stage_layers())
    engines, schedules = args.engines.split(","), args.schedules.split(",")
    runs = {(s, e): [] for s in schedules for e in engines}
    for r in range(args.rounds):
        for s in schedules:
            for e in (engines if r % 2 == 0 else engines[::-1]):
                runs[(s, e)].append(run(args, ctx, e, s))
    ctx.shutdown()
    if rank != 0:
        return
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    print(f"\n{args.preset}, seq {args.seq}, global batch {args.batch}, {args.microbatches} micro-batches, "
          f"{args.dtype}; dp {args.dp} x pp {args.pp} x mp {world // (args.dp * args.pp)} ({args.plan}) on {world} x "
          f"{device}, torch {torch.__version__}")
    print(f"{'schedule':<10}{'engine':<8}{'step ms':>10}{'min ms':>9}{'tokens/s':>11}  bubble measured (per stage) "
          "/ analytic")
    rows = []
    for (s, e), done in runs.items():
        times = [t for one in done for t in one["times"]]
        median = statistics.median(times)
        bubbles = [statistics.mean(stage) for stage in zip(*(one["bubble"] for one in done))]
        row = {"schedule": s, "engine": e, "step_time_ms": median * 1e3, "min_step_time_ms": min(times) * 1e3,
               "tokens_per_s": args.batch * args.seq / median, "bubble_measured_per_stage": bubbles,
               "bubble_analytic": done[0]["bubble_analytic"], "losses": done[0]["losses"]}
        rows.append(row)
        print(f"{s:<10}{e:<8}{row['step_time_ms']:>10.1f}{row['min_step_time_ms']:>9.1f}{row['tokens_per_s']:>11.0f}  "
              f"{' '.join(f'{b:.3f}' for b in bubbles)} / {row['bubble_analytic']:.3f}")
    for s in schedules:
        losses = [runs[(s, e)][0]["losses"] for e in engines]
        worst = max(abs(a - b) / abs(b) for other in losses[1:] for a, b in zip(other, losses[0]))
        print(f"{s}: largest relative loss difference between the engines over {len(losses[0])} steps: {worst:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "world": world, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                       "torch": torch.__version__, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
