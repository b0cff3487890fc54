"""LoRA and QLoRA on several GPUs, which single-GPU PEFT tools do not do: Galaxy's plans beside the one-GPU
runs, in one launch.

    torchrun --nproc_per_node 2 bench/bench_peft_mp.py --scenario llama7b --json peft_7b_2.json
    torchrun --nproc_per_node 4 bench/bench_peft_mp.py --scenario llama70b --json peft_70b_4.json
    python bench/bench_peft_mp.py --cpu --world 2 --scenario smoke --contenders '*'     # CPU + Gloo, tiny shapes

Contenders ``<method>-<plan>[+recompute]``: method ``lora`` (frozen base stored in bf16, ``frozen_dtype:
compute``) or ``qlora`` (frozen linears in NF4, ``quantize_base: nf4``; embeddings and head bf16); plan ``none``
(the one-GPU run: rank 0 alone, the other ranks wait) or ``tp`` | ``galaxy`` | ``galaxy2`` | ``sp`` on every
rank of the launch (mp = world, dp 1); ``+recompute``: each layer recomputed in backward (``recompute: full``,
the gradient checkpointing of the QLoRA recipe, ``peft.prepare_model_for_kbit_training``). Every contender: LoRA r16 alpha 32 on q_proj / v_proj as
``bench/bench_lora.py`` (its ``LORA``), fp32 factors and AdamW state (fused on GPU, lr 1e-4, weight decay
0.01), clip 1.0, bf16 autocast, random tokens; Galaxy's own Trainer (``bench_train.galaxy_steps``: one step
is what ``train()`` runs per step).

Timing and rows are ``bench/bench_train.py``'s (``run_contender``): a timed step is the whole optimizer
step over the global batch (forward, backward, every gradient reduction, clipping, AdamW), CUDA events,
the slowest rank's median over ``--iters`` after ``--warmup``; every rank of a row sees the whole global
batch (mp only), so tokens/s per GPU = global batch tokens / step / GPUs of the row. Memory per GPU, each
the maximum over the row's ranks: ``peak_mib`` (``max_memory_allocated`` from the first training step on,
as bench_lora counts it), ``build_peak_mib`` (the build's own), ``frozen_mib`` (the rank's stored frozen
base: its shard), ``host_peak_mib`` (the process's peak resident host memory, ``ru_maxrss``, since it
started: every earlier row of the launch included). ``qlora_over_lora`` (the table's last column): a QLoRA
row's peak over the LoRA row's of the same plan. MFU counts a LoRA step as 4N + 12 L H S FLOPs per token
(forward and input gradients of every frozen matmul; ``galaxy.train.metrics.model_flops_per_token``).

Every base is built without a full copy anywhere: laid out on the meta device, then each tensor drawn on
the rank's GPU by its generator (``build_base(..., init_on_device=True)``), sliced to the rank's shard and
stored in its format there (bf16, or NF4 quantized on the GPU): the host holds no weight, the GPU one full
fp32 tensor at a time (the largest: the 70B's 32000 x 8192 embedding, 1 GiB) beside the stored shards.
The values are the GPU generator's (the same on every plan), not the host's serial init: the weights are
random either way, and a GPU draws a 70B in seconds where the host needs minutes per rank.

Scenarios: ``llama7b`` (LLaMA-7B shapes: hidden 4096, ffn 11008, 32 layers, 32 heads, vocab 32000; seq 1024,
global batch 2: bench_lora's 7B rows), ``llama70b`` (Llama-2-70B shapes: hidden 8192, ffn 28672, 80 layers, 64
heads, 8 key/value heads, vocab 32000; 138 GB of bf16 weights, which no single GPU holds; seq 1024, global
batch 1), ``smoke`` (tiny, GQA, for CPU checks at world 2 and 4). ``--global_batch`` and ``--seq`` override.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import resource
import sys
from typing import Optional

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from bench.bench_coc import launch, publish, run_facts  # noqa: E402
from bench.bench_lora import LORA  # noqa: E402
from bench.bench_train import Batching, Prepared, galaxy_config, galaxy_steps, rank_context, run_rows  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.loralib.quantized import frozen_bytes  # noqa: E402
from galaxy.peft import apply_tuning, build_base  # noqa: E402
from galaxy.train.metrics import model_flops_per_token, model_matmul_weights, peak_flops_per_device  # noqa: E402

SCENARIOS = {
    "llama7b": dict(hidden=4096, ffn=11008, heads=32, layers=32, seq=1024, global_batch=2, vocab=32000),
    "llama70b": dict(hidden=8192, ffn=28672, heads=64, kv_heads=8, layers=80, seq=1024, global_batch=1, vocab=32000),
    "smoke": dict(hidden=64, ffn=176, heads=8, kv_heads=4, layers=2, seq=32, global_batch=2, vocab=256),
}
METHODS = {"lora": "none", "qlora": "nf4"}  # method -> quantize_base
PLANS = ("none", "tp", "galaxy", "galaxy2", "sp")
# The 7B at 2 GPUs: the one-GPU rows and every plan; the 70B at 4 GPUs: LoRA on the plans whose weights fit
# (galaxy2 and sp keep the 113 GB of MLP weights whole on every rank).
DEFAULT_CONTENDERS = {
    "llama7b": "lora-none,qlora-none,lora-tp,qlora-tp,lora-galaxy,qlora-galaxy,lora-galaxy2,qlora-galaxy2,"
               "lora-none+recompute,qlora-none+recompute",
    "llama70b": "lora-tp,lora-galaxy",
    "smoke": "*",
}


def contender_names() -> list[str]:
    return [f"{method}-{plan}{suffix}" for suffix in ("", "+recompute") for plan in PLANS for method in METHODS]


def select(patterns: str) -> list[str]:
    """The contenders matching ``patterns`` (names or globs), in the order given; ValueError for a name of none."""
    chosen = []
    for pattern in (p for p in patterns.split(",") if p):
        matched = [n for n in contender_names() if fnmatch.fnmatch(n, pattern)]
        if not matched:
            raise ValueError(f"contender '{pattern}' matches none of {', '.join(contender_names())}")
        chosen += [n for n in matched if n not in chosen]
    return chosen


def alone(name: str) -> bool:
    """The one-GPU rows: plan none, on rank 0 by itself."""
    return name.partition("+")[0].endswith("-none")


def peft_config(shape: dict, args, plan: str, method: str, micro_batch: int, recompute: bool = False):
    return galaxy_config(shape, args, plan, micro_batch=micro_batch, model={"recompute": "full" if recompute else "none"},
                         peft=dict(LORA, quantize_base=METHODS[method], frozen_dtype="compute"))


def peft_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """The contender ``name`` on ``ctx`` (mp = its ranks): its base built on the rank's device, shard by shard,
    in its storage format, the LoRA factors on top, Galaxy's Trainer ready to step."""
    base, _, suffix = name.partition("+")
    method, _, plan = base.partition("-")
    batching = Batching.reach(shape["global_batch"], 1, args.micro_batch or shape["global_batch"])
    cfg = peft_config(shape, args, plan, method, batching.micro_batch, recompute=suffix == "recompute")
    model = apply_tuning(build_base(cfg, cfg.resolve_plan(ctx.mp.size), ctx, init_on_device=True), cfg)
    stored, weights = frozen_bytes(model)  # this rank's: its shard of the base

    def per_rank() -> dict:
        return {"frozen_mib": stored / 2**20, "host_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    layout = {"plan": plan, "mp": ctx.mp.size, "method": method, "recompute": cfg.model.recompute,
              "frozen_bytes_per_weight": stored / max(weights, 1)}
    return galaxy_steps(model, cfg, shape, batching, ctx, layout, peak_from_step=True, per_rank=per_rank)


def ratios(rows: list[dict]) -> None:
    """``qlora_over_lora`` on each QLoRA row: its peak per GPU over the LoRA row's of the same plan (and
    recompute)."""
    peaks = {r["name"]: r.get("peak_mib") for r in rows if "error" not in r}
    for r in rows:
        lora = peaks.get(r["name"].replace("qlora-", "lora-", 1))
        if r["name"].startswith("qlora-") and peaks.get(r["name"]) and lora:
            r["qlora_over_lora"] = peaks[r["name"]] / lora


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    ctx = rank_context(rank, world, local_rank, args, init_method)
    shape = dict(SCENARIOS[args.scenario])
    shape.update({k: v for k, v in (("global_batch", args.global_batch), ("seq", args.seq)) if v is not None})
    cfg = peft_config(shape, args, "none", "lora", 1)  # the FLOP count of every row (LoRA's, whatever the format)
    flops_per_token = model_flops_per_token(cfg, shape["seq"])
    peak = peak_flops_per_device(ctx.device, args.dtype, args.peak_tflops)
    rows = run_rows(args.contenders, args, shape, ctx, peak, flops_per_token, peft_contender, alone)
    if rank == 0:
        ratios(rows)
        facts = {
            "global_batch": shape["global_batch"], "seq": shape["seq"],
            "tokens_per_step": shape["global_batch"] * shape["seq"],
            "lora": LORA, "frozen": "lora: bf16 (frozen_dtype compute); qlora: NF4 linears (blocks of 64, fp32 "
                                    "absmax), bf16 embeddings and head",
            "build": "meta device, then each tensor drawn on the rank's device (its generator), sliced to the "
                     "rank's shard and stored in its format there (build_base init_on_device)",
            "timed_step": "forward and backward of the global batch, every gradient reduction, clip 1.0, AdamW "
                          "(Galaxy's Trainer)",
            "memory": "per GPU, max over the row's ranks: peak_mib from the first step on; build_peak_mib the "
                      "build's; frozen_mib the stored base shard; host_peak_mib ru_maxrss of the process so far",
            "model_flops_per_token": flops_per_token, "matmul_weights": model_matmul_weights(cfg).total,
            "mfu_formula": "mfu = (4*N + 12*L*H*S) * tokens_per_step / step_s / gpus / peak_flops (LoRA: no "
                           "weight gradients of the frozen matmuls)",
            "peak_tflops": peak.tflops, "peak_source": peak.source}
        report = {"benchmark": "peft_mp", **run_facts(ctx), "world": world, "scenario": args.scenario,
                  "shape": shape, "dtype": args.dtype, "warmup": args.warmup, "facts": facts,
                  "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                          "NVSHMEM_DISABLE_NVLS")},
                  "rows": rows}
        publish(report, print_table, args.json)
    dist.barrier()
    dist.destroy_process_group()


def print_table(report: dict) -> None:
    s = report["shape"]
    print(f"\n{report['scenario']}: {s['layers']} layers, hidden {s['hidden']}, ffn {s['ffn']}, heads {s['heads']}"
          f"/{s.get('kv_heads', s['heads'])} kv, vocab {s['vocab']}; seq {s['seq']}, global batch "
          f"{s['global_batch']}; LoRA r{LORA['lora_dim']} on {'/'.join(LORA['lora_target_modules'])}, "
          f"{report['dtype']}; whole steps; {report['world']} x {report['device']}, torch {report['torch']}, "
          f"{report['date']}, {report['commit']}")
    head = (f"{'contender':<24}{'gpus':>5}{'median ms':>11}{'steps/s':>9}{'tok/s/GPU':>11}{'MFU':>7}{'peak MiB/GPU':>14}"
            f"{'build peak':>12}{'frozen MiB':>12}{'host MiB':>10}{'build s':>9}{'Q/L peak':>10}")
    print(head + "\n" + "-" * len(head))
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['name']:<24}{r['gpus']:>5}  not run: {r['error']}")
            continue

        def num(key, fmt=".0f"):
            return format(r[key], fmt) if r.get(key) is not None else "-"

        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        print(f"{r['name']:<24}{r['gpus']:>5}{r['median_ms']:>11.1f}{1e3 / r['median_ms']:>9.2f}{r['tokens_per_s_per_gpu']:>11.0f}{mfu:>7}"
              f"{num('peak_mib'):>14}{num('build_peak_mib'):>12}{num('frozen_mib'):>12}{num('host_peak_mib'):>10}"
              f"{num('build_s', '.1f'):>9}{num('qlora_over_lora', '.2f'):>10}")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="llama7b")
    p.add_argument("--contenders", default=None, help="comma-separated names or globs (--list); default: the "
                   "scenario's (" + "; ".join(f"{k}: {v}" for k, v in DEFAULT_CONTENDERS.items()) + ")")
    p.add_argument("--list", action="store_true", help="print the contender names and exit")
    p.add_argument("--global_batch", type=int, default=None, help="sequences per optimizer step (default: the "
                   "scenario's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the scenario's)")
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per micro-batch (default: the global "
                   "batch, no accumulation)")
    p.add_argument("--world", type=int, default=None, help="self-spawn this many ranks (ignored under torchrun)")
    p.add_argument("--cpu", action="store_true", help="CPU + Gloo even where GPUs are present")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--peak_tflops", type=float, default=None, help="dense peak TFLOP/s of one device, for MFU")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(contender_names()))
        return
    try:
        args.contenders = select(args.contenders or DEFAULT_CONTENDERS[args.scenario])
    except ValueError as e:
        p.error(str(e))
    if args.iters < 1 or args.warmup < 0 or min(args.global_batch or 1, args.seq or 1, args.micro_batch or 1) < 1:
        p.error("--iters, --global_batch, --seq and --micro_batch must be at least 1, --warmup at least 0")
    launch(worker, args, p, on_cpu=args.cpu)


if __name__ == "__main__":
    main()
