"""CCLoRA benchmark: LLaMA-7B-shaped layers with LoRA, forward+backward, plain LoRA against CCLoRA
(``lora_fusion``) under each plan, every contender in one launch.

    torchrun --nproc_per_node 2 bench/bench_cclora.py --out cclora.json   # one process per GPU
    python bench/bench_cclora.py --world 2 --out cclora.json               # the same, self-spawned (NCCL)
    python bench/bench_cclora.py --tiny                                    # CPU + Gloo, 2 ranks, tiny fp64 shapes

Shapes (default): hidden 4096, ffn 11008, 32 heads, seq 4096, batch 1, bf16, 4 layers; LoRA rank 16,
alpha 32 on q,k,v,o,gate,up,down (``--targets``), B drawn N(0, 0.02) so the branch is not zero.
Only Galaxy's ``LlamaForCausalLM`` decoder layers are timed (no embedding, head or loss): the input
is a random hidden state (no gradient, as under a frozen embedding), the backward a random output
gradient; the base weights are frozen and only the LoRA factors get gradients. Contenders, per plan
(``--plans``, default tp,galaxy,galaxy2), on the same model and weights:

    <plan>-lora      LoRA as galaxy.loralib injects it (base + branch, the model's own transitions)
    <plan>-cclora    the same model after set_lora_fusion(model, True): scale folded into A, W + B(sA)
                     merged where rows >= in_features, the branch overlapped with the TP collectives

Which path each target takes (merged / unmerged, from this rank's rows and input width) is listed
under "paths". Timing: CUDA events around each fwd+bwd after --warmup; median of --iters; the
slowest rank's median counts. Peak memory: max over ranks of torch.cuda.max_memory_allocated during
the timed iterations. "check": max relative difference (max |a - b| / max |b|) of the output and of
every LoRA gradient, CCLoRA against LoRA, on the timed model (--tiny runs fp64 and fails above 1e-9).
In bf16 the two differ by rounding, so "vs fp32" gives each contender's own distance from the same
step in fp32 (the same bf16 weights, plain LoRA): CCLoRA should be as close as LoRA.
``--dropout P`` sets ``lora_dropout``: every LoRA linear then takes the unmerged path with the masks
plain LoRA draws (the dropout streams are put back before each compared step, so "check" still
compares like with like; "vs fp32" is left out, as fp32 and bf16 draw different masks on GPU).
On CPU (--tiny) times are wall-clock and mean nothing: the run shows the script works end to end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from functools import partial

# NVLink multicast (NVLS / symmetric memory) is off on the GPU machines; set before any init.
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_key] = _value

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.bench_coc import (DTYPES, GalaxyStack, galaxy_model, init, launch, measure, publish,  # noqa: E402
                             reduce_over_ranks, rel_diff, release, run_facts)
from galaxy.config import Method  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.core.overlap.cclora import merges  # noqa: E402
from galaxy.loralib import inject_lora, lora_modules, mark_only_lora_as_trainable, set_lora_fusion  # noqa: E402

FULL = dict(hidden=4096, ffn=11008, heads=32, seq=4096, batch=1, layers=4, dtype="bf16", rank=16, alpha=32.0)
# seq 80: q/k/v/gate/up (in 64) and o (in 32 per rank) merge, down (in 88 per rank) does not.
TINY = dict(hidden=64, ffn=176, heads=4, seq=80, batch=1, layers=2, dtype="fp64", rank=4, alpha=8.0)
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
REPORTED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "COC_PARALLEL_NUM",
                "CUDA_DEVICE_MAX_CONNECTIONS")


def lora_model(shape: dict, plan: str, ctx: ParallelContext, targets: list[str], dropout: float = 0.0):
    model = galaxy_model(shape, plan, ctx, seed=0)  # coc_parallel_num pinned to 1
    inject_lora(model, targets, r=shape["rank"], lora_alpha=shape["alpha"], lora_dropout=dropout, seed=0,
                init_b_std=0.02)
    mark_only_lora_as_trainable(model)
    return model


def paths(model, shape: dict) -> dict:
    """merged / unmerged per target, on this rank (layer 0)."""
    plan, world = model.plan, model.ctx.mp.size
    out = {}
    for name, layer in lora_modules(model).items():
        if ".0." not in f".{name}.":
            continue
        block = model.plan.att if ".self_attn." in name else model.plan.mlp
        seq = shape["seq"] if block == Method.TP or world == 1 else plan.seq_split[model.ctx.mp.rank]
        in_local = layer.weight.shape[1]
        if layer.active_dropout is not None:
            out[name.rsplit(".", 1)[-1]] = "unmerged (dropout)"
        else:
            out[name.rsplit(".", 1)[-1]] = "merged" if merges(seq * shape["batch"], in_local) else "unmerged"
    return out


def fp32_reference(shape: dict, plan: str, ctx: ParallelContext, model, targets: list[str], x, g):
    """The plain-LoRA step in fp32 on the bf16 model's own (exactly representable) weights."""
    ref = lora_model(dict(shape, dtype="fp32"), plan, ctx, targets)
    with torch.no_grad():
        for (name, p), (name_low, q) in zip(ref.named_parameters(), model.named_parameters()):
            assert name == name_low, (name, name_low)
            p.copy_(q)
    out = one_step(GalaxyStack(ref), x.float(), g.float(), [p for p in ref.parameters() if p.requires_grad])
    del ref
    release(ctx.device)
    return out


def distance(result, ref) -> float:
    (y, grads), (y_ref, grads_ref) = result, ref
    return max([rel_diff(y, y_ref)] + [rel_diff(a, b) for a, b in zip(grads, grads_ref)])


def one_step(stack, x, g, lora_params):
    for p in lora_params:
        p.grad = None
    out = stack(x)
    out.backward(g)
    return out.detach(), [p.grad.detach().clone() for p in lora_params]


def run_plan(args, shape: dict, ctx: ParallelContext, plan: str, log) -> list[dict]:
    model = lora_model(shape, plan, ctx, args.targets, args.dropout)
    lora_params = [p for p in model.parameters() if p.requires_grad]
    stack = GalaxyStack(model)
    gen = torch.Generator().manual_seed(7)
    dtype = DTYPES[shape["dtype"]]
    full = torch.randn(shape["batch"], shape["seq"], shape["hidden"], generator=gen)
    grad = torch.randn(shape["batch"], shape["seq"], shape["hidden"], generator=gen)
    x = model.model.stream.to_stream(full).to(ctx.device, dtype).contiguous()
    g = model.model.stream.to_stream(grad).to(ctx.device, dtype).contiguous()
    low = dtype not in (torch.float32, torch.float64)
    ref = fp32_reference(shape, plan, ctx, model, args.targets, x, g) if low and not args.dropout else None
    streams = {key: gen.get_state() for key, gen in ctx.generators.items()}  # LoRA dropout's masks
    rows, results = [], {}
    for fusion in (False, True):
        set_lora_fusion(model, fusion)
        for key, state in streams.items():
            ctx.generators[key].set_state(state)
        results[fusion] = one_step(stack, x, g, lora_params)
        before = ctx.mp.bytes_sent
        one_step(stack, x, g, lora_params)
        comm_mib = (ctx.mp.bytes_sent - before) / 2**20
        times, peak = measure(partial(one_step, stack, x, g, lora_params), ctx.device, args.warmup, args.iters)
        name = f"{plan}-{'cclora' if fusion else 'lora'}"
        if args.profile:  # every rank steps (the steps hold collectives); each writes its own table
            profile_steps(partial(one_step, stack, x, g, lora_params),
                          os.path.join(args.profile, f"{name}.rank{ctx.rank}.txt"))
        r = {"name": name, "plan": plan, "fusion": fusion, "ranks": ctx.mp.size, "median_ms": statistics.median(times),
             "min_ms": min(times), "max_ms": max(times), "iters": len(times), "peak_mib": peak,
             "comm_mib_per_step": comm_mib, "paths": paths(model, shape) if fusion else None,
             "err_vs_fp32": distance(results[fusion], ref) if ref is not None else None}
        if fusion:
            (y0, g0), (y1, g1) = results[False], results[True]
            r["check_rel_diff"] = max([rel_diff(y1, y0)] + [rel_diff(a, b) for a, b in zip(g1, g0)])
        rows.append(reduce_over_ranks(r, ctx))
        log(rows[-1])
    del model, stack, lora_params, x, g, results, ref
    release(ctx.device)
    return rows


def profile_steps(step, path: str, steps: int = 3) -> None:
    """torch.profiler's table of ``steps`` steps on this rank (GPU kernels and the host ops), to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))


def finish(rows: list[dict]) -> None:
    plain = {r["plan"]: r for r in rows if not r["fusion"]}
    for r in rows:
        base = plain.get(r["plan"])
        r["speedup_vs_lora"] = base["median_ms"] / r["median_ms"] if r["fusion"] and base else None
        r["peak_vs_lora"] = (r["peak_mib"] / base["peak_mib"]) if r["fusion"] and base and base["peak_mib"] else None


def print_table(report: dict) -> None:
    s = report["shape"]
    print(f"\nLLaMA layers x{s['layers']}: hidden {s['hidden']}, ffn {s['ffn']}, {s['heads']} heads, seq {s['seq']}, "
          f"batch {s['batch']}, {s['dtype']}; LoRA r={s['rank']} alpha={s['alpha']} on {','.join(report['targets'])}; "
          f"fwd+bwd; {report['world']} x {report['device']}")
    head = f"{'contender':<18}{'ranks':>6}{'median ms':>11}{'min ms':>9}{'peak MiB':>10}{'comm MiB':>10}" \
           f"{'vs lora':>9}{'check':>10}{'vs fp32':>10}"
    print(head)
    print("-" * len(head))
    fmt = lambda v, f: (f"{v:{f}}" if v is not None else "-")  # noqa: E731
    for r in report["rows"]:
        print(f"{r['name']:<18}{r['ranks']:>6}{r['median_ms']:>11.2f}{r['min_ms']:>9.2f}{fmt(r['peak_mib'], '.0f'):>10}"
              f"{r['comm_mib_per_step']:>10.1f}{fmt(r.get('speedup_vs_lora'), '.3f'):>9}"
              f"{fmt(r.get('check_rel_diff'), '.1e'):>10}{fmt(r.get('err_vs_fp32'), '.1e'):>10}")
    for r in report["rows"]:
        if r.get("paths"):
            print(f"paths {r['plan']} (rank 0): " + ", ".join(f"{k} {v}" for k, v in r["paths"].items()))


# ----------------------------------------------------------------------------- processes


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    torch.manual_seed(0)
    if args.tiny:
        torch.set_num_threads(1)
    ctx = init(rank, world, local_rank, args.tiny or args.cpu, init_method)
    shape = dict(TINY if args.tiny else FULL)
    for key in shape:
        if getattr(args, key, None) is not None:
            shape[key] = getattr(args, key)

    def log(r):
        if rank == 0:
            check = f"  check {r['check_rel_diff']:.1e}" if r.get("check_rel_diff") is not None else ""
            print(f"  {r['name']:<18} {r['median_ms']:9.2f} ms  peak {r['peak_mib'] or 0:8.0f} MiB{check}", flush=True)

    rows = []
    for plan in args.plans:
        rows += run_plan(args, shape, ctx, plan, log)
    failed = [r["name"] for r in rows if shape["dtype"] == "fp64" and (r.get("check_rel_diff") or 0) > 1e-9]
    if rank == 0:
        finish(rows)
        report = {"benchmark": "cclora", **run_facts(ctx), "world": world, "shape": shape, "targets": args.targets,
                  "tiny": args.tiny, "env": {k: os.environ.get(k) for k in REPORTED_ENV}, "args": vars(args),
                  "rows": rows}
        publish(report, print_table, args.out)
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        raise SystemExit(f"CCLoRA differs from LoRA beyond 1e-9 in fp64: {failed}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=None, help="self-spawn this many ranks (ignored under torchrun)")
    p.add_argument("--tiny", action="store_true", help="CPU + Gloo, 2 ranks, tiny shapes, float64")
    p.add_argument("--cpu", action="store_true", help="run on CPU + Gloo even if GPUs are present")
    p.add_argument("--plans", default="tp,galaxy,galaxy2")
    p.add_argument("--targets", default=TARGETS, help="LoRA target modules, comma-separated")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.0, help="lora_dropout (the branch input's dropout)")
    for key, kind in (("hidden", int), ("ffn", int), ("heads", int), ("seq", int), ("batch", int), ("layers", int),
                      ("dtype", str), ("rank", int), ("alpha", float)):
        p.add_argument(f"--{key}", type=kind, default=None)
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also write a torch.profiler table of 3 steps per contender and rank into DIR")
    args = p.parse_args()
    args.plans = [s for s in args.plans.split(",") if s]
    args.targets = [s for s in args.targets.split(",") if s]
    if args.dtype is not None and args.dtype not in DTYPES:
        p.error(f"--dtype must be one of {', '.join(DTYPES)}")
    if args.iters < 10 and not args.tiny:
        p.error("--iters must be at least 10 (the median of >= 10 iterations is reported)")
    if args.tiny:
        args.iters, args.warmup = min(args.iters, 5), min(args.warmup, 1)

    launch(worker, args, p, on_cpu=args.tiny or args.cpu)


if __name__ == "__main__":
    main()
