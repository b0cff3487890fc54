"""CoC benchmark: four LLaMA-7B-shaped layers, forward+backward, every contender in one launch.

    torchrun --nproc_per_node 2 bench/bench_coc.py --json out.json     # one process per GPU
    python bench/bench_coc.py --world 2 --json out.json                 # the same, self-spawned
    python bench/bench_coc.py --smoke                                   # CPU + Gloo, 2 ranks, tiny shapes

Shapes (default): hidden 4096, ffn 11008, 32 heads, seq 4096, batch 1, bf16, 4 layers. Only the
layer stack is timed (no embedding, head or loss): the input is a random hidden state that
requires grad, the backward a random output gradient. Contenders:

    serial-pytorch       plain PyTorch LLaMA layers on one GPU (rank 0 alone; the others wait)
    galaxy-none          Galaxy's LlamaForCausalLM layers, plan none, one GPU (rank 0 alone)
    galaxy-<plan>        Galaxy's LlamaForCausalLM layers on N GPUs: tp, sp, galaxy, galaxy2
    galaxy-<plan>+coc<k> CoC at k chunks (tp, galaxy, galaxy2): the same model's layers computed with
                         CoC's edges (galaxy.core.overlap.coc, CocEdge) in place of their own. k=1 is
                         the model's own path and should time like galaxy-<plan>. Outputs and input
                         gradients are checked against the model's own forward/backward ("check"
                         column).
    galaxy-<plan>@coc<k> the model's own CoC (config coc_parallel_num=k), once this tree's models have it
    galaxy-<plan>@async_tp the model's own async TP (config tp_overlap=async_tp: torch.ops.symm_mem fused
                         all-gather/reduce-scatter matmuls; galaxy, galaxy2; CUDA + NCCL, even seq splits)
    pytorch-tp-sp        the plain layers under torch.distributed.tensor.parallel.parallelize_module:
                         ColwiseParallel / RowwiseParallel + SequenceParallel (torchtitan's plan)

Timing: CUDA events around each fwd+bwd after warmup; median of --iters (>= 10) iterations; the
slowest rank's median counts. Peak memory: max over ranks of torch.cuda.max_memory_allocated
during the timed iterations (weights, grads and activations of the stack). Scaling efficiency
is serial-pytorch / (N x time). A short probe also reports the bf16 matmul rate and the bus
bandwidth of 32 MiB collectives, the two numbers that bound what overlap can reach.

This times the layers' forward + backward only, to study overlap; whole training steps against the
same contenders (gradient reductions and optimizer included) are bench/bench_train.py's.

On CPU (--smoke) times are wall-clock and mean nothing; the run shows the script works end to end
and the checks run in float64.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from multiprocessing import connection as mp_connection
from typing import Callable, Optional

# NVLink multicast (NVLS / symmetric memory) is off on the GPU machines; set before any init.
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_key] = _value

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from galaxy.config import ConfigError, GalaxyConfig, ParallelConfig  # noqa: E402
from galaxy.core.comm import Communicator  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.core.parallelize import EdgeChoice, layer_edges  # noqa: E402
from galaxy.models.llama import LlamaForCausalLM, RopeAt  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
FULL = dict(hidden=4096, ffn=11008, heads=32, seq=4096, batch=1, layers=4, dtype="bf16")
SMOKE = dict(hidden=64, ffn=176, heads=4, seq=48, batch=1, layers=2, dtype="fp64")
COC_PLANS = ("tp", "galaxy", "galaxy2")  # plans with TP blocks; SP has no TP linear to fuse
ASYNC_TP_PLANS = ("galaxy", "galaxy2")  # async TP fuses S <-> T edges: plan tp's stream is replicated
REPORTED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "COC_PARALLEL_NUM",
                "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_MAX_NCHANNELS")


# ----------------------------------------------------------------------------- plain PyTorch LLaMA layers


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm (fp32 statistics), written with ops DTensor shards (for SequenceParallel)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        # -1 heads: under PyTorch TP the column-parallel projections hold this rank's heads only.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.attention, self.feed_forward = Attention(hidden, heads), FeedForward(hidden, ffn)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class PlainStack(nn.Module):
    def __init__(self, shape: dict):
        super().__init__()
        self.layers = nn.ModuleList(Block(shape["hidden"], shape["ffn"], shape["heads"])
                                    for _ in range(shape["layers"]))
        head_dim = shape["hidden"] // shape["heads"]
        inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.arange(shape["seq"]).float()[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def init_plain(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen))
    return module


def pytorch_tp_sp(stack: PlainStack, world: int, device: torch.device, mesh=None) -> PlainStack:
    """torchtitan's LLaMA TP plan: SP norms, colwise q/k/v/w1/w3, rowwise wo/w2 to Shard(1); on ``mesh``
    (a 1-D mesh, e.g. the tp dim of a 2-D one) or a new mesh over ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if mesh is None:
        mesh = init_device_mesh(torch.device(device).type, (world,))
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for layer in stack.layers:
        parallelize_module(layer, mesh, plan)
    return stack


# ----------------------------------------------------------------------------- Galaxy layer stacks


def model_has_coc() -> bool:
    """Whether this tree's config has the CoC key, i.e. the models can run CoC themselves."""
    return "coc_parallel_num" in {f.name for f in dataclasses.fields(ParallelConfig)}


def galaxy_model(shape: dict, plan_name: str, ctx: ParallelContext, seed: int,
                 coc: Optional[int] = None, overlap: Optional[str] = None) -> LlamaForCausalLM:
    """Galaxy's LLaMA at these shapes; ``coc``: the model's own ``coc_parallel_num`` (where the tree
    has it, pinned to 1 by default so COC_PARALLEL_NUM in the environment cannot change a row);
    ``overlap``: the config key ``tp_overlap``."""
    parallel = {"plan": plan_name}
    if model_has_coc():
        parallel["coc_parallel_num"] = coc or 1
    if overlap is not None:
        parallel["tp_overlap"] = overlap
    raw = {"model": {"preset": "llama-7b", "num_hidden_layers": shape["layers"], "hidden_size": shape["hidden"],
                     "intermediate_size": shape["ffn"], "num_attention_heads": shape["heads"],
                     "num_key_value_heads": shape["heads"], "vocab_size": 128,  # the head is not timed
                     "max_position_embeddings": max(4096, shape["seq"])},
           "train": {"seq_length": shape["seq"]}, "parallel": parallel}
    cfg = GalaxyConfig.from_dict(raw)
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=seed)
    return model.to(DTYPES[shape["dtype"]])


class GalaxyStack:
    """The decoder layers of a Galaxy model; with ``chunks`` set, computed with CoC's edges at ``chunks``
    at their TP blocks (``galaxy.core.edges.layer_edges``) in place of the model's own edges."""

    def __init__(self, model: LlamaForCausalLM, chunks: Optional[int] = None):
        self.model, self.lm, self.chunks = model, model.model, chunks
        self.edges = layer_edges(model.ctx.mp, model.plan, EdgeChoice(chunks=chunks)) if chunks else None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        seq = sum(self.model.plan.seq_split) if self.lm.uses_seq else h.shape[1]
        rope = RopeAt(*self.lm.rotary_emb(torch.arange(seq, device=h.device)[None], h.dtype))
        for layer in self.lm.layers:
            h = layer(h, None, rope) if self.edges is None else layer.compute(h, None, rope, None, self.edges)
        return h


# ----------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step: Callable[[], None], device: torch.device, warmup: int,
            iters: int) -> tuple[list[float], Optional[float]]:
    """Per-iteration milliseconds (CUDA events on GPU, wall clock on CPU) and peak MiB."""
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        sync(device)
        return [s.elapsed_time(e) for s, e in events], torch.cuda.max_memory_allocated(device) / 2**20
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times, None


def fwd_bwd_step(fn: Callable, params: list, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step():
        for p in params:
            p.grad = None
        x.grad = None
        fn(x).backward(grad)
    return step


def inputs(shape: dict, ctx: ParallelContext, split: Optional[Callable] = None, seed: int = 7):
    """A hidden state and an output gradient, full and identical on every rank, then this rank's part."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[shape["dtype"]]
    full = torch.randn(shape["batch"], shape["seq"], shape["hidden"], generator=gen).to(ctx.device, dtype)
    grad = torch.randn(shape["batch"], shape["seq"], shape["hidden"], generator=gen).to(ctx.device, dtype)
    if split is not None:
        full, grad = split(full), split(grad)
    return full.contiguous().requires_grad_(True), grad.contiguous()


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------- contenders


def row(name: str, plan: str, source: str, ranks: int, times: list, peak, chunks=None, check=None, note="") -> dict:
    return {"name": name, "plan": plan, "source": source, "ranks": ranks, "chunks": chunks,
            "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": len(times),
            "peak_mib": peak, "check_rel_diff": check, "note": note}


def reduce_over_ranks(r: dict, ctx: ParallelContext) -> dict:
    """The slowest rank's median and the largest peak count."""
    if ctx.mp.size == 1:
        return r
    gathered = [None] * ctx.mp.size
    dist.all_gather_object(gathered, (r["median_ms"], r["min_ms"], r["max_ms"], r["peak_mib"]))
    r["median_ms"] = max(g[0] for g in gathered)
    r["min_ms"] = max(g[1] for g in gathered)
    r["max_ms"] = max(g[2] for g in gathered)
    peaks = [g[3] for g in gathered if g[3] is not None]
    r["peak_mib"] = max(peaks) if peaks else None
    r["per_rank_median_ms"] = [g[0] for g in gathered]
    return r


def run_serial(args, shape, ctx: ParallelContext, log) -> list[dict]:
    rows = []
    if ctx.rank == 0:
        serial = ParallelContext.serial(ctx.device, seed=0)
        stack = init_plain(PlainStack(shape), 0).to(ctx.device, DTYPES[shape["dtype"]])
        x, g = inputs(shape, serial)
        times, peak = measure(fwd_bwd_step(stack, list(stack.parameters()), x, g), ctx.device, args.warmup, args.iters)
        rows.append(row("serial-pytorch", "serial", "plain PyTorch, 1 device", 1, times, peak))
        log(rows[-1])
        del stack, x, g
        release(ctx.device)
        if not args.skip_galaxy_serial:
            model = galaxy_model(shape, "none", serial, seed=0)
            x, g = inputs(shape, serial)
            stack = GalaxyStack(model)
            times, peak = measure(fwd_bwd_step(stack, list(model.parameters()), x, g), ctx.device, args.warmup,
                                  args.iters)
            rows.append(row("galaxy-none", "none", "Galaxy model, plan none, 1 device", 1, times, peak))
            log(rows[-1])
            del model, stack, x, g
            release(ctx.device)
    if ctx.mp.size > 1:
        dist.barrier()
    return rows


def time_overlap_variant(model, name, plan_name, label, world, x, g, ref, ctx, args, **extra) -> dict:
    """One Galaxy model with an overlap setting: its output and input gradient checked against the
    plain run's (``ref``), then timed as the plain row is."""
    params, stack = list(model.parameters()), GalaxyStack(model)
    x.grad = None
    out = stack(x)
    out.backward(g)
    check = max(rel_diff(out.detach(), ref[0]), rel_diff(x.grad, ref[1]))
    times, peak = measure(fwd_bwd_step(stack, params, x, g), ctx.device, args.warmup, args.iters)
    return reduce_over_ranks({**row(name, plan_name, label, world, times, peak, check=check), **extra}, ctx)


def run_galaxy(args, shape, ctx: ParallelContext, plan_name: str, log) -> list[dict]:
    rows, world = [], ctx.mp.size
    model = galaxy_model(shape, plan_name, ctx, seed=0)
    params = list(model.parameters())
    x, g = inputs(shape, ctx, model.model.stream.to_stream)
    base = GalaxyStack(model)
    times, peak = measure(fwd_bwd_step(base, params, x, g), ctx.device, args.warmup, args.iters)
    rows.append(reduce_over_ranks(row(f"galaxy-{plan_name}", plan_name, "Galaxy model", world, times, peak), ctx))
    log(rows[-1])
    if plan_name in COC_PLANS and world > 1:
        # The model's own output and input gradient, to check each CoC variant against.
        x.grad = None
        ref_out = base(x)
        ref_out.backward(g)
        ref = (ref_out.detach(), x.grad.detach().clone())
        for p in params:
            p.grad = None
        for k in (args.coc if args.coc_source in ("auto", "standalone") else []):
            stack = GalaxyStack(model, chunks=k)
            x.grad = None
            out = stack(x)
            out.backward(g)
            check = max(rel_diff(out.detach(), ref[0]), rel_diff(x.grad, ref[1]))
            times, peak = measure(fwd_bwd_step(stack, params, x, g), ctx.device, args.warmup, args.iters)
            r = row(f"galaxy-{plan_name}+coc{k}", plan_name,
                    "the model's layers on CoC's edges at k chunks",
                    world, times, peak, chunks=k, check=check)
            rows.append(reduce_over_ranks(r, ctx))
            log(rows[-1])
            del stack  # in the loop: with --coc-source model it never runs, and nothing is bound
    del model, base, params
    release(ctx.device)
    if plan_name in COC_PLANS and world > 1 and model_has_coc() and args.coc_source in ("auto", "model"):
        for k in (k for k in args.coc if k > 1):  # k = 1 is the galaxy-<plan> row
            model = galaxy_model(shape, plan_name, ctx, seed=0, coc=k)  # same seed: the same weights
            rows.append(time_overlap_variant(model, f"galaxy-{plan_name}@coc{k}", plan_name,
                                             f"Galaxy model, coc_parallel_num={k}", world, x, g, ref, ctx, args,
                                             chunks=k))
            log(rows[-1])
            del model
            release(ctx.device)
    if plan_name in ASYNC_TP_PLANS and world > 1 and args.async_tp:
        try:
            model = galaxy_model(shape, plan_name, ctx, seed=0, overlap="async_tp")  # same seed: same weights
        except ConfigError as e:  # CPU/Gloo, uneven splits, a torch without the ops: say why
            rows.append({"name": f"galaxy-{plan_name}@async_tp", "skipped": str(e)})
        else:
            rows.append(time_overlap_variant(model, f"galaxy-{plan_name}@async_tp", plan_name,
                                             "Galaxy model, tp_overlap=async_tp", world, x, g, ref, ctx, args,
                                             overlap="async_tp"))
            log(rows[-1])
            del model
            release(ctx.device)
    del x, g
    release(ctx.device)
    return rows


def run_pytorch_tp(args, shape, ctx: ParallelContext, log) -> list[dict]:
    world = ctx.mp.size
    if shape["seq"] % world or shape["heads"] % world or shape["ffn"] % world:
        return [{"name": "pytorch-tp-sp", "skipped": "needs seq, heads and ffn divisible by the world size"}]
    stack = init_plain(PlainStack(shape), 0).to(ctx.device, DTYPES[shape["dtype"]])
    stack = pytorch_tp_sp(stack, world, ctx.device)
    x, g = inputs(shape, ctx, lambda t: t.chunk(world, dim=1)[ctx.rank])
    times, peak = measure(fwd_bwd_step(stack, list(stack.parameters()), x, g), ctx.device, args.warmup, args.iters)
    r = reduce_over_ranks(row("pytorch-tp-sp", "pytorch", "parallelize_module Colwise/Rowwise + SequenceParallel",
                              world, times, peak), ctx)
    log(r)
    del stack, x, g
    release(ctx.device)
    return [r]


def probe(args, shape, ctx: ParallelContext) -> dict:
    """bf16 matmul rate and the bus bandwidth of 32 MiB collectives on this machine."""
    dev, dtype = ctx.device, DTYPES[shape["dtype"]]
    n = min(shape["hidden"], 8192)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    times, _ = measure(lambda: torch.mm(a, b), dev, 3, 10)
    out = {"matmul_n": n, "matmul_tflops": 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12}
    world = ctx.mp.size
    if world > 1:
        mib = 1 if dev.type == "cpu" else 32
        numel = mib * 2**20 // torch.empty((), dtype=dtype).element_size() // world * world
        buf = torch.randn(numel, device=dev, dtype=dtype)
        shard = torch.empty(numel // world, device=dev, dtype=dtype)
        ops = {"all_reduce": (lambda: dist.all_reduce(buf), 2 * (world - 1) / world),
               "all_gather": (lambda: dist.all_gather_into_tensor(buf, shard), (world - 1) / world),
               "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, buf), (world - 1) / world)}
        for name, (fn, factor) in ops.items():
            times, _ = measure(fn, dev, 3, 10)
            out[f"{name}_busbw_gbps"] = numel * buf.element_size() * factor / (statistics.median(times) * 1e-3) / 1e9
    return out


# ----------------------------------------------------------------------------- report


def finish(rows: list[dict], world: int) -> None:
    serial = next((r for r in rows if r.get("name") == "serial-pytorch"), None)
    native = next((r for r in rows if r.get("name") == "pytorch-tp-sp" and "median_ms" in r), None)
    model_rows = {r["plan"]: r for r in rows if r.get("chunks") is None and not r.get("overlap") and "median_ms" in r}
    coc1 = {r["plan"]: r for r in rows if r.get("chunks") == 1}
    for r in rows:
        if "median_ms" not in r:
            continue
        r["efficiency"] = serial["median_ms"] / (r["ranks"] * r["median_ms"]) if serial else None
        r["speedup_vs_pytorch_tp_sp"] = native["median_ms"] / r["median_ms"] if native and r["ranks"] > 1 else None
        if r.get("chunks") or r.get("overlap"):
            model_row = model_rows.get(r["plan"])
            base = model_row if "@" in r["name"] else coc1.get(r["plan"])  # the k = 1 of the same source
            r["speedup_vs_coc1"] = base["median_ms"] / r["median_ms"] if base else None
            r["speedup_vs_model_plan"] = model_row["median_ms"] / r["median_ms"] if model_row else None


def print_table(report: dict) -> None:
    s = report["shape"]
    print(f"\nLLaMA layers x{s['layers']}: hidden {s['hidden']}, ffn {s['ffn']}, {s['heads']} heads, seq {s['seq']}, "
          f"batch {s['batch']}, {s['dtype']}, fwd+bwd; {report['world']} x {report['device']}")
    if report.get("probe"):
        print("probe: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in report["probe"].items()))
    head = f"{'contender':<22}{'ranks':>6}{'median ms':>11}{'min ms':>9}{'peak MiB':>10}{'eff':>7}{'vs PyT':>8}" \
           f"{'vs k1':>7}{'check':>10}"
    print(head)
    print("-" * len(head))
    fmt = lambda v, f: (f"{v:{f}}" if v is not None else "-")  # noqa: E731
    for r in report["rows"]:
        if "median_ms" not in r:
            print(f"{r['name']:<22}  skipped: {r.get('skipped')}")
            continue
        print(f"{r['name']:<22}{r['ranks']:>6}{r['median_ms']:>11.2f}{r['min_ms']:>9.2f}"
              f"{fmt(r['peak_mib'], '.0f'):>10}{fmt(r['efficiency'], '.3f'):>7}"
              f"{fmt(r['speedup_vs_pytorch_tp_sp'], '.2f'):>8}{fmt(r.get('speedup_vs_coc1'), '.3f'):>7}"
              f"{fmt(r['check_rel_diff'], '.1e'):>10}")
    if report["world"] > 1 and report["rows"] and report["rows"][0].get("name") == "serial-pytorch":
        print(f"limit (serial / {report['world']}, all communication hidden): "
              f"{report['rows'][0]['median_ms'] / report['world']:.2f} ms")
    print("+coc<k> rows: the Galaxy model's layers on CoC's edges (galaxy.core.overlap.coc)"
          + ("; @coc<k> rows: the model's own coc_parallel_num" if model_has_coc() else " (the model has no CoC hook)")
          + "; @async_tp rows: the model's tp_overlap=async_tp ('vs k1': vs the model's plan without overlap)"
          + ". 'check' = max relative difference of output and input gradient vs the model's own forward/backward "
          "without CoC.")


def git_commit() -> str:
    if os.environ.get("GALAXY_COMMIT"):
        return os.environ["GALAXY_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=here,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ----------------------------------------------------------------------------- processes


def shape_from(args) -> dict:
    shape = dict(SMOKE if args.smoke else FULL)
    for key in ("hidden", "ffn", "heads", "seq", "batch", "layers", "dtype"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return shape


def init(rank: int, world: int, local_rank: int, on_cpu: bool, init_method: str) -> ParallelContext:
    """This rank's process group (NCCL on its GPU, or Gloo) and a context whose mp group is the world."""
    use_cuda = torch.cuda.is_available() and not on_cpu
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if use_cuda else "gloo"
    kwargs = {"device_id": device} if use_cuda else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, **kwargs)
    return ParallelContext(rank=rank, world_size=world, device=device, seed=0,
                           mp=Communicator("mp", rank, world, dist.group.WORLD), backend=backend)


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    torch.manual_seed(0)
    if args.smoke:
        torch.set_num_threads(1)
    ctx = init(rank, world, local_rank, args.smoke or args.cpu, init_method)
    shape = shape_from(args)

    def log(r):
        if rank == 0:
            print(f"  {r['name']:<22} {r['median_ms']:9.2f} ms  peak {r['peak_mib'] or 0:8.0f} MiB"
                  + (f"  check {r['check_rel_diff']:.1e}" if r.get("check_rel_diff") is not None else ""), flush=True)

    rows = []
    report_probe = probe(args, shape, ctx) if not args.no_probe else None
    rows += run_serial(args, shape, ctx, log)
    for plan_name in args.plans:
        rows += run_galaxy(args, shape, ctx, plan_name, log)
    if not args.skip_pytorch:
        rows += run_pytorch_tp(args, shape, ctx, log)
    if rank == 0:
        finish(rows, world)
        report = {"benchmark": "coc", **run_facts(ctx), "world": world, "shape": shape, "smoke": args.smoke,
                  "env": {k: os.environ.get(k) for k in REPORTED_ENV + tuple(e.partition("=")[0] for e in args.env)},
                  "args": {k: v for k, v in vars(args).items()}, "probe": report_probe, "rows": rows}
        publish(report, print_table, args.json)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=None, help="self-spawn this many ranks (ignored under torchrun)")
    p.add_argument("--smoke", action="store_true", help="CPU + Gloo, 2 ranks, tiny shapes, float64")
    p.add_argument("--cpu", action="store_true", help="run on CPU + Gloo even if GPUs are present")
    p.add_argument("--plans", default="tp,sp,galaxy,galaxy2")
    p.add_argument("--coc", default="1,2,4", help="CoC chunk counts")
    p.add_argument("--coc-source", dest="coc_source", choices=("auto", "standalone", "model"), default="auto",
                   help="CoC rows from the model's layers given CoC's edges, from the model's own coc_parallel_num "
                        "(when this tree has it), or both (auto)")
    p.add_argument("--no-async-tp", dest="async_tp", action="store_false",
                   help="skip the galaxy-<plan>@async_tp rows (tp_overlap=async_tp)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-probe", dest="no_probe", action="store_true")
    p.add_argument("--skip-pytorch", dest="skip_pytorch", action="store_true")
    p.add_argument("--skip-galaxy-serial", dest="skip_galaxy_serial", action="store_true")
    for key, kind in (("hidden", int), ("ffn", int), ("heads", int), ("seq", int), ("batch", int),
                      ("layers", int), ("dtype", str)):
        p.add_argument(f"--{key}", type=kind, default=None)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set before CUDA/NCCL start, for every contender alike (e.g. CUDA_DEVICE_MAX_CONNECTIONS=1, "
                        "NCCL_MAX_NCHANNELS=8 to leave the matmuls more SMs)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    for item in args.env:
        key, _, value = item.partition("=")
        if not key or not _:
            p.error(f"--env wants KEY=VALUE, got {item!r}")
        os.environ[key] = value
    args.plans = [s for s in args.plans.split(",") if s]
    args.coc = [int(k) for k in args.coc.split(",") if k]
    if args.iters < 10 and not args.smoke:
        p.error("--iters must be at least 10 (the median of >= 10 iterations is reported)")
    if args.smoke:
        args.iters, args.warmup = min(args.iters, 10), min(args.warmup, 2)

    launch(worker, args, p, on_cpu=args.smoke or args.cpu)


def run_facts(ctx: ParallelContext) -> dict:
    """When, on what and how a benchmark was timed, for its JSON report."""
    cuda = ctx.device.type == "cuda"
    device = torch.cuda.get_device_name(ctx.device) if cuda else platform.processor() or "cpu"
    return {"device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": git_commit(),
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "timer": "cuda events" if cuda else "wall clock"}


def publish(report: dict, print_table, path: Optional[str]) -> None:
    """Rank 0's end of a benchmark: the table for people, the JSON report for machines."""
    print_table(report)
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {path}")


def launch(worker, args, parser, on_cpu: bool) -> None:
    """``worker(rank, world, local_rank, args, init_method)`` on every rank: under torchrun this
    process is one rank; otherwise ``--world`` ranks are started here (one GPU each unless ``on_cpu``)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)),
               args, "env://")
        return
    world = args.world or 2
    if torch.cuda.is_available() and not on_cpu and torch.cuda.device_count() < world:
        parser.error(f"--world {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Without a GPU the ranks are forked: each starts with this process's imports (torch's and Galaxy's, seconds
    # of CPU a rank) instead of redoing them. CUDA does not survive a fork: with a GPU they are spawned.
    start = mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    procs = [start.Process(target=worker, args=(r, world, r, args, f"tcp://127.0.0.1:{port}"))
             for r in range(world)]
    for proc in procs:
        proc.start()
    running = list(procs)
    while running:  # as torchrun does: a rank that fails ends the others (which may wait for it in a collective)
        mp_connection.wait([proc.sentinel for proc in running])
        running = [proc for proc in running if proc.is_alive()]
        if any(proc.exitcode not in (None, 0) for proc in procs):
            for proc in running:
                proc.terminate()
            for proc in running:
                proc.join()
            running = []
    failed = [i for i, proc in enumerate(procs) if proc.exitcode != 0]
    if failed:
        sys.exit(f"rank(s) {failed} failed")


if __name__ == "__main__":
    main()
