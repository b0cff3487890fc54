"""Async TP on GPUs (config ``tp_overlap: async_tp``): does torch's symm_mem path run here, and does
it equal the unfused path? Runs at any world size (one GPU is a group of one).

    python3 bench/device/asynctp_check.py --world 1 --json out.json   # self-spawned, one GPU each
    torchrun --nproc_per_node 2 bench/device/asynctp_check.py          # the same under torchrun

1. symmetric-memory set-up on the mp group (galaxy.core.overlap.async_tp.symm_mem_ops);
2. the two edges (S -> T + q/k/v-like column linears with biases; row linear + P -> S), forward
   and backward, fp32 and bf16, against ``transition`` + ``F.linear`` and against torch's own
   unfused definition of the ops (``reference_ops``): ||a - b|| / ||b|| of outputs and gradients;
3. a small LLaMA (plan galaxy, with and without fused_gate_up), tp_overlap async_tp vs none on the
   same weights: loss and every parameter gradient, fp32 and bf16;
4. (unless --no-time) the 4-layer LLaMA-7B-shaped stack of bench/bench_coc.py, fwd+bwd, plan
   galaxy, async_tp vs none: at world 1 this prices the machinery, not overlap.
Tolerances (norm-relative): fp32 1e-5, bf16 2e-2 (METHOD.md: bf16 operands land 1e-3..1e-2;
the fused backward sums q/k/v's input gradients in one matmul where autograd adds three).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_key] = _value  # NVLink multicast off on the GPU machines; before any CUDA/NCCL start

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_coc import (GalaxyStack, fwd_bwd_step, galaxy_model, init, inputs, launch, measure,  # noqa: E402
                             publish, release, run_facts)
from galaxy.config import GalaxyConfig  # noqa: E402
from galaxy.core.transitions import Layout, transition  # noqa: E402
from galaxy.core.overlap.async_tp import AsyncTpEdges, reference_ops  # noqa: E402
from galaxy.models.llama import LlamaForCausalLM  # noqa: E402

TOL = {"fp32": 1e-5, "bf16": 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def fwd_bwd(fn, inputs_, grads):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs_]
    ys = fn(*leaves)
    ys = list(ys) if isinstance(ys, (list, tuple)) else [ys]
    torch.autograd.backward(ys, grads)
    return [y.detach() for y in ys] + [t.grad for t in leaves if t is not None]


def edge_checks(ctx, dtype_name: str, seed: int) -> list[dict]:
    comm, world, dev, dtype = ctx.mp, ctx.mp.size, ctx.device, DTYPES[dtype_name]
    gen = torch.Generator(device=dev).manual_seed(seed + comm.rank)
    b, shard, h, out = 1, 512, 1024, 1024
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev).to(dtype)  # noqa: E731
    real, ref = AsyncTpEdges(comm), AsyncTpEdges(comm, reference_ops())
    split = (shard,) * world
    rows = []
    # column edge: q/k/v-like widths, two with bias
    widths = (256, 128, 128)
    x, params = rnd(b, shard, h), [rnd(w, h) for w in widths] + [rnd(widths[0]), None, rnd(widths[2])]
    grads = [rnd(b, shard * world, w) for w in widths]

    def unfused_col(x, *p):
        full = transition(x, Layout.S, Layout.T, comm, split)
        return [F.linear(full, w, bb) for w, bb in zip(p[:3], p[3:])]

    got = fwd_bwd(lambda x, *p: real.enter(x, p[:3], p[3:]), [x, *params], grads)
    for name, fn in (("unfused", unfused_col), ("torch reference ops", lambda x, *p: ref.enter(x, p[:3], p[3:]))):
        want = fwd_bwd(fn, [x, *params], grads)
        rows.append({"check": f"column edge vs {name}", "dtype": dtype_name,
                     "rel": max(rel(a, c) for a, c in zip(got, want))})
    # row edge: the bias added once per token; its gradient is this rank's share (PARTIAL)
    x, w, bias = rnd(b, shard * world, h // max(world, 1)), rnd(out, h // max(world, 1)), rnd(out)
    grad = [rnd(b, shard, out)]
    got = fwd_bwd(real.leave, [x, w, bias], grad)
    want = fwd_bwd(lambda x, w, bb: transition(F.linear(x, w, bb if comm.rank == 0 else None), Layout.P, Layout.S,
                                               comm, split), [x, w, bias], grad)
    for t in (got[-1], want[-1] if want[-1] is not None else None):
        if t is not None and world > 1:
            dist.all_reduce(t, group=comm.process_group)
    if want[-1] is None:
        want[-1] = torch.zeros_like(got[-1])
    rows.append({"check": "row edge vs unfused", "dtype": dtype_name, "rel": max(rel(a, c) for a, c in zip(got, want))})
    ref_got = fwd_bwd(ref.leave, [x, w, bias], grad)
    rows.append({"check": "row edge vs torch reference ops", "dtype": dtype_name,
                 "rel": max(rel(a, c) for a, c in zip(got[:-1], ref_got[:-1]))})
    return rows


def model_checks(ctx, dtype_name: str, fused_gate_up: bool) -> dict:
    seq = 256 * ctx.mp.size
    grads, losses = {}, {}
    for overlap in ("none", "async_tp"):
        raw = {"model": {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 1376,
                         "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": seq,
                         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                         "fused_gate_up": fused_gate_up},
               "train": {"seq_length": seq}, "parallel": {"plan": "galaxy", "tp_overlap": overlap}}
        cfg = GalaxyConfig.from_dict(raw)
        model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).to(ctx.device,
                                                                                           DTYPES[dtype_name])
        ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(5)).to(ctx.device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses[overlap] = loss.detach().float()
        grads[overlap] = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
        del model
        release(ctx.device)
    assert grads["none"].keys() == grads["async_tp"].keys()
    worst = max(grads["none"], key=lambda n: rel(grads["async_tp"][n], grads["none"][n]))
    return {"check": f"llama galaxy fused_gate_up={fused_gate_up}: loss, every grad", "dtype": dtype_name,
            "rel": max(rel(losses["async_tp"], losses["none"]), rel(grads["async_tp"][worst], grads["none"][worst])),
            "worst": worst}


def timing(ctx, args) -> list[dict]:
    shape = dict(hidden=4096, ffn=11008, heads=32, seq=4096, batch=1, layers=4, dtype="bf16")
    rows = []
    for overlap in ("none", "async_tp"):
        model = galaxy_model(shape, "galaxy", ctx, seed=0, overlap=overlap)
        params, stack = list(model.parameters()), GalaxyStack(model)
        x, g = inputs(shape, ctx, model.model.stream.to_stream)
        times, peak = measure(fwd_bwd_step(stack, params, x, g), ctx.device, 3, args.iters)
        # Memory split: what the forward keeps for backward, and each phase's peak over the start.
        for p in params:
            p.grad = None
        x.grad = None
        torch.cuda.synchronize(ctx.device)
        start = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        out = stack(x)
        kept, fwd_peak = torch.cuda.memory_allocated(ctx.device) - start, torch.cuda.max_memory_allocated(ctx.device)
        out.backward(g)
        del out
        bwd_peak = torch.cuda.max_memory_allocated(ctx.device)
        mib = 2 ** 20
        rows.append({"check": f"time galaxy {overlap} (4 x 7B layers, seq 4096, bf16)", "dtype": "bf16",
                     "median_ms": statistics.median(times), "peak_mib": peak, "start_mib": start / mib,
                     "fwd_kept_mib": kept / mib, "fwd_peak_mib": (fwd_peak - start) / mib,
                     "bwd_peak_mib": (bwd_peak - start) / mib})
        if args.profile and ctx.rank == 0:  # where the time goes: kernels, collectives, copies, by GPU time
            step = fwd_bwd_step(stack, params, x, g)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize(ctx.device)
            with open(f"{args.profile}_{overlap}.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
            if args.trace:
                prof.export_chrome_trace(f"{args.profile}_{overlap}.json")
            del prof  # a live profiler skewed the next row's peak memory (7475 vs 4290 MiB, H100, 2026-11-24)
        del model, params, stack, x, g
        release(ctx.device)
    return rows


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    ctx = init(rank, world, local_rank, False, init_method)
    rows = []

    def attempt(what, fn):
        try:
            out = fn()
            rows.extend(out if isinstance(out, list) else [out])
        except Exception as e:  # report the error and go on: each check stands alone
            rows.append({"check": what, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
            if rank == 0:
                traceback.print_exc()

    attempt("symm_mem set-up",
            lambda: (AsyncTpEdges(ctx.mp), {"check": "symm_mem set-up", "dtype": "fp32", "rel": 0.0})[1])
    for dtype_name in ("fp32", "bf16"):
        attempt(f"edges {dtype_name}", lambda: edge_checks(ctx, dtype_name, 11))
        for fused in (False, True):
            attempt(f"model {dtype_name} fused_gate_up={fused}", lambda: model_checks(ctx, dtype_name, fused))
    if not args.no_time:
        attempt("timing", lambda: timing(ctx, args))
    for r in rows:
        if "rel" in r:
            r["ok"] = r["rel"] <= TOL[r["dtype"]]
    if rank == 0:
        report = {"benchmark": "asynctp_check", **run_facts(ctx), "world": world, "rows": rows,
                  "env": {k: os.environ.get(k) for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE")}}
        publish(report, print_table, args.json)
    dist.barrier()
    dist.destroy_process_group()


def print_table(report: dict) -> None:
    print(f"\nasync TP check: {report['device']}, torch {report['torch']}, world {report['world']}, "
          f"commit {report['commit']}")
    for r in report["rows"]:
        if "error" in r:
            print(f"  {r['check']:<58} ERROR {r['error']}")
        elif "median_ms" in r:
            print(f"  {r['check']:<58} {r['median_ms']:9.2f} ms  peak {r['peak_mib']:.0f} MiB (start "
                  f"{r['start_mib']:.0f}, kept by fwd {r['fwd_kept_mib']:.0f}, fwd peak +{r['fwd_peak_mib']:.0f}, "
                  f"bwd peak +{r['bwd_peak_mib']:.0f})")
        else:
            print(f"  {r['check']:<58} {r['dtype']:<5} rel {r['rel']:.2e}  {'ok' if r['ok'] else 'FAIL'}"
                  + (f"  (worst {r['worst']})" if r.get("worst") else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-time", dest="no_time", action="store_true")
    p.add_argument("--profile", default=None, help="rank 0's kernel tables of the timed steps: PREFIX_<overlap>.txt")
    p.add_argument("--trace", action="store_true", help="with --profile: also PREFIX_<overlap>.json chrome traces")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    launch(worker, args, p, on_cpu=False)


if __name__ == "__main__":
    main()
