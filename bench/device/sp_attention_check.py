"""The SP attention flavours on GPUs (config ``sp_attention``; galaxy.core.sp_attention): does the CUDA path run,
does it equal the reference, and what does each flavour cost at long sequences?

    python3 bench/device/sp_attention_check.py --world 2 --json out.json    # self-spawned, one GPU each
    torchrun --nproc_per_node 4 bench/device/sp_attention_check.py --seq 65536
    python3 bench/device/sp_attention_check.py --cpu --world 2 --seq 64 --heads 4 --kv_heads 2 --head_dim 8  # smoke

1. the ring's block kernel (``attend_block`` / ``attend_block_backward``): torch's flash op on CUDA in bf16 and fp16
   (causal squares and full blocks, GQA) against the exact reference on the same inputs in float64: output,
   log-sum-exp and the three gradients, norm-relative;
2. each flavour (ring, ulysses) against allgather on the same sequence-sharded q/k/v, forward and backward,
   causal (the ring in the zigzag order) and not, with and without a key padding mask, fp32 and bf16 (float64
   on CPU): the output and dq/dk/dv, gathered in the natural order;
3. unless ``--no-time``: forward + backward of the attention core alone at ``--seq`` (Llama-3.1-8B's heads by
   default: 32 query / 8 kv heads of 128), per flavour: the slowest rank's median ms and its peak MiB.
Tolerances (norm-relative): fp32 1e-5, bf16/fp16 2e-2, float64 1e-10.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import traceback

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ[_key] = _value  # NVLink multicast off on the GPU machines; before any CUDA/NCCL start

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.bench_coc import init, launch, measure, publish, release, run_facts  # noqa: E402
from galaxy.config import Method, Plan, balanced_split  # noqa: E402
from galaxy.core.sp_attention import (attend_block, attend_block_backward, sequence_parallel_attention,  # noqa: E402
                                      stream_order)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float64: 1e-10}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def block_checks(device: torch.device, args) -> list[dict]:
    """The flash path of the ring's block kernel against the float64 reference (CUDA only)."""
    if device.type != "cuda":
        return []
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    b, h, kv, d = 1, args.heads, args.kv_heads, args.head_dim
    for dtype in (torch.bfloat16, torch.float16):
        for causal, sq, sk in ((True, 512, 512), (False, 512, 1024)):
            q = torch.randn(b, h, sq, d, generator=gen, device=device).to(dtype)
            k, v = (torch.randn(b, kv, sk, d, generator=gen, device=device).to(dtype) for _ in range(2))
            dout = torch.randn(b, h, sq, d, generator=gen, device=device).to(dtype)
            scale = 1 / math.sqrt(d)
            out, lse = attend_block(q, k, v, causal=causal, scale=scale)
            ref_out, ref_lse = attend_block(q.double(), k.double(), v.double(), causal=causal, scale=scale)
            grads = attend_block_backward(dout, q, k, v, out.to(dtype), lse, causal=causal, scale=scale)
            ref = attend_block_backward(dout.double(), q.double(), k.double(), v.double(), ref_out, ref_lse,
                                        causal=causal, scale=scale)
            errors = {"out": rel(out, ref_out), "lse": rel(lse, ref_lse),
                      **{n: rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref)}}
            rows.append({"check": "block kernel", "dtype": str(dtype), "causal": causal, **errors,
                         "ok": max(errors.values()) < TOL[dtype]})
    return rows


def plan(world: int, seq: int, heads: int, flavour: str) -> Plan:
    return Plan(Method.SP, Method.SP, Method.SP, tuple(balanced_split(heads, world)), (1,) * world,
                tuple(balanced_split(seq, world)), sp_attention=flavour)


def shard(full: torch.Tensor, order, rank: int) -> torch.Tensor:
    """This rank's tokens of a full ``[b, h, seq, d]`` tensor, in the stream order."""
    return order.to_stream_order(full, dim=2).narrow(2, sum(order.split[:rank]), order.split[rank]).contiguous()


def gather(local: torch.Tensor, order, comm) -> torch.Tensor:
    """Every rank's tokens, back in the natural order (a test helper: uneven pieces padded by hand)."""
    width = max(order.split)
    padded = torch.zeros(local.shape[:2] + (width,) + local.shape[3:], dtype=local.dtype, device=local.device)
    padded[:, :, :local.shape[2]] = local
    pieces = [torch.empty_like(padded) for _ in range(comm.size)]
    dist.all_gather(pieces, padded, group=comm.group)
    return order.to_natural_order(torch.cat([p[:, :, :n] for p, n in zip(pieces, order.split)], dim=2), dim=2)


def run_flavour(ctx, flavour: str, q, k, v, dout, mask, causal: bool):
    """Output and dq/dk/dv (full, natural order) of ``flavour`` on the full tensors' shards."""
    comm, world = ctx.mp, ctx.mp.size
    p = plan(world, q.shape[2], q.shape[1], flavour)
    order = stream_order(p, causal)
    leaves = [shard(t, order, comm.rank).requires_grad_() for t in (q, k, v)]
    out = sequence_parallel_attention(*leaves, comm, p, key_padding_mask=mask, causal=causal,
                                      q_offset=sum(p.seq_split[:comm.rank]))
    out.backward(shard(dout, order, comm.rank))
    return [gather(t, order, comm) for t in [out.detach()] + [leaf.grad for leaf in leaves]]


def flavour_checks(ctx, args) -> list[dict]:
    rows = []
    dev = ctx.device
    dtypes = (torch.float32, torch.bfloat16) if dev.type == "cuda" else (torch.float64,)
    seq = args.check_seq
    gen = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        for causal in (True, False):
            for masked in (False, True):
                b, h, kv, d = 2, args.heads, args.kv_heads, args.head_dim
                q = torch.randn(b, h, seq, d, generator=gen).to(dev, dtype)
                k, v = (torch.randn(b, kv, seq, d, generator=gen).to(dev, dtype) for _ in range(2))
                dout = torch.randn(b, h, seq, d, generator=gen).to(dev, dtype)
                mask = None
                if masked:
                    mask = torch.ones(b, seq, dtype=torch.long, device=dev)
                    mask[1, : seq // 3] = 0
                want = run_flavour(ctx, "allgather", q, k, v, dout, mask, causal)
                for flavour in ("ring", "ulysses"):
                    got = run_flavour(ctx, flavour, q, k, v, dout, mask, causal)
                    errors = {n: rel(g, w) for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
                    rows.append({"check": f"{flavour} vs allgather", "dtype": str(dtype), "causal": causal,
                                 "masked": masked, **errors, "ok": max(errors.values()) < TOL[dtype]})
    return rows


def timings(ctx, args) -> list[dict]:
    comm, dev, world = ctx.mp, ctx.device, ctx.mp.size
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for flavour in ("allgather", "ring", "ulysses"):
        p = plan(world, args.seq, args.heads, flavour)
        order = stream_order(p, True)
        n = p.seq_split[comm.rank]
        gen = torch.Generator(device=dev).manual_seed(2 + comm.rank)
        q = torch.randn(1, args.heads, n, args.head_dim, generator=gen, device=dev).to(dtype).requires_grad_()
        k, v = (torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen, device=dev).to(dtype).requires_grad_()
                for _ in range(2))
        dout = torch.randn_like(q)

        def step():
            for t in (q, k, v):
                t.grad = None
            sequence_parallel_attention(q, k, v, comm, p, causal=True, q_offset=sum(p.seq_split[:comm.rank])
                                        ).backward(dout)
        try:
            times, peak = measure(step, dev, args.warmup, args.iters)
            slowest = torch.tensor([statistics.median(times), peak or 0.0], dtype=torch.float64, device=dev)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=comm.group)
            rows.append({"flavour": flavour, "seq": args.seq, "zigzag": order.zigzag,
                         "median_ms": slowest[0].item(), "peak_mib": slowest[1].item() or None})
        except torch.OutOfMemoryError:
            rows.append({"flavour": flavour, "seq": args.seq, "error": "out of memory"})
        release(dev)
    return rows


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    ctx = init(rank, world, local_rank, args.cpu, init_method)
    report = {"benchmark": "sp_attention_check", **run_facts(ctx), "world": world, "args": vars(args)}
    try:
        report["block"] = [] if args.no_check else block_checks(ctx.device, args)
        report["flavours"] = [] if args.no_check else flavour_checks(ctx, args)
        report["timing"] = [] if args.no_time else timings(ctx, args)
    except Exception:
        report["error"] = traceback.format_exc()
        print(f"rank {rank}: {report['error']}", flush=True)
    if rank == 0:
        publish(report, print_report, args.json)
    dist.barrier()
    dist.destroy_process_group()
    if "error" in report or not all(r["ok"] for r in report.get("block", []) + report.get("flavours", [])):
        sys.exit(1)


def print_report(report: dict) -> None:
    print(f"{report['device']}  torch {report['torch']}  world {report['world']}  {report['date']}")
    for r in report.get("block", []) + report.get("flavours", []):
        errors = "  ".join(f"{k} {v:.1e}" for k, v in r.items() if isinstance(v, float))
        tags = "  ".join(f"{k}={r[k]}" for k in ("dtype", "causal", "masked") if k in r)
        print(f"  {'ok ' if r['ok'] else 'BAD'} {r['check']:<20} {tags:<45} {errors}")
    for r in report.get("timing", []):
        print(f"  {r['flavour']:<10} seq {r['seq']}: " + (r.get("error") or
              f"{r['median_ms']:9.2f} ms fwd+bwd  peak {r['peak_mib'] or 0:8.0f} MiB"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=None, help="self-spawn this many ranks (ignored under torchrun)")
    p.add_argument("--cpu", action="store_true", help="CPU + Gloo (a smoke run of the script)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--check_seq", type=int, default=1000, help="sequence of the equality checks (uneven shards)")
    p.add_argument("--seq", type=int, default=32768, help="sequence of the timings")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-time", dest="no_time", action="store_true")
    p.add_argument("--no-check", dest="no_check", action="store_true", help="the timings alone")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    launch(worker, args, p, on_cpu=args.cpu)


if __name__ == "__main__":
    main()
