"""Do a compiled Galaxy layer's gradients equal the eager layer's on this machine, at every micro-batch size?

On 2 x H200 (torch 2.11, 2026-11-27) pretrain_galaxy.py with ``compile: true`` and 16 micro-batches of one
sequence trained a different model from 4 micro-batches of four and from the eager model (step-1 grad norm
1.27 against 4.35; bench/device/microbatch_check.sh). This takes one global batch through the eager model (the
reference: one micro-batch of every row) and through the compiled model at several micro-batch sizes and
attention backends, and prints, per variant, the loss, the relative error of all gradients, the parameters
that differ most and the NCCL kernels that ran. It found the cause on CPU under torch 2.11 (the fault is
torch 2.11's, not the GPU's: a no-op ``.contiguous()`` returned by an autograd.Function compiles to a zero
gradient; galaxy.core.comm._contiguous), where 2.13 had agreed.

    torchrun --nproc_per_node 2 bench/device/compile_grad_check.py --json out.json      # galaxy plan, NCCL
    torchrun --nproc_per_node 1 bench/device/compile_grad_check.py --plan none          # no collectives
    python bench/device/compile_grad_check.py --cpu --world 2 --hidden 128 --seq 64 --vocab 512   # here
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.bench_coc import launch  # noqa: E402
from bench.bench_train import rank_context  # noqa: E402
from galaxy.config import GalaxyConfig  # noqa: E402
from galaxy.models import build_model  # noqa: E402
from galaxy.train.loop import autocast_context  # noqa: E402

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def config(args, compiled: bool) -> GalaxyConfig:
    return GalaxyConfig.from_dict({
        "model": {"preset": "llama-7b", "num_hidden_layers": args.layers, "hidden_size": args.hidden,
                  "intermediate_size": args.hidden * 43 // 16, "num_attention_heads": args.heads,
                  "num_key_value_heads": args.heads, "vocab_size": args.vocab, "max_position_embeddings": args.seq,
                  "compile": compiled, "kernels": args.kernels},
        "parallel": {"plan": args.plan},
        "train": {"global_batch_size": args.rows, "seq_length": args.seq, "dtype": args.dtype}})


def gradients(model, cfg, ctx, ids: torch.Tensor, micro_rows: int, backend: str) -> tuple[float, dict]:
    """The loss and every local gradient of ``ids`` taken ``micro_rows`` rows at a time (accumulated, each
    micro-batch's loss divided by their count, as the Trainer does)."""
    model.zero_grad(set_to_none=True)
    chunks = ids.split(micro_rows)
    total = 0.0
    for chunk in chunks:
        pick = sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] is not None else contextlib.nullcontext()
        with pick, autocast_context(cfg, ctx.device):
            loss = model(input_ids=chunk, labels=chunk).loss / len(chunks)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def collectives_counted(device: torch.device):
    """Yields a dict that, after the block, holds how many times each NCCL kernel ran in it (a graph that drops
    a transition's collective shows it here: the 1-row profile of 2026-11-27 had 3 all-gathers and 3
    reduce-scatters per layer and micro-batch where the 4-row one had 4 and 4). Empty off CUDA."""
    counts: dict = {}
    if device.type != "cuda":
        yield counts
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        yield counts
        torch.cuda.synchronize(device)
    for row in prof.key_averages():  # the kernels themselves (ncclDevKernel_AllGather_RING_LL, ...)
        if row.key.startswith(("ncclDevKernel", "ncclKernel")):
            counts[row.key[:80]] = counts.get(row.key[:80], 0) + row.count


def compare(ref: dict, got: dict, most: int) -> dict:
    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))
    errors = {n: rel(got[n], ref[n]) if n in got else float("inf") for n in ref}
    num = sum(float((got[n] - ref[n]).norm() ** 2) for n in ref if n in got) ** 0.5
    den = sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
    worst = sorted(errors.items(), key=lambda kv: -kv[1])[:most]
    return {"rel_err": num / max(den, 1e-30), "worst": [{"param": n, "rel_err": e} for n, e in worst],
            "missing": sorted(set(ref) - set(got))}


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    ctx = rank_context(rank, world, local_rank, args, init_method)
    eager_cfg, compiled_cfg = config(args, False), config(args, True)
    torch.manual_seed(0)
    eager = build_model(eager_cfg, eager_cfg.resolve_plan(ctx.mp.size), ctx)
    torch.manual_seed(0)
    compiled = build_model(compiled_cfg, compiled_cfg.resolve_plan(ctx.mp.size), ctx)
    compiled.load_state_dict(eager.state_dict())
    eager.train(), compiled.train()
    ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    ref_loss, ref = gradients(eager, eager_cfg, ctx, ids, args.rows, "default")
    report = {"plan": args.plan, "world": world, "device": str(ctx.device), "torch": torch.__version__,
              "rows": args.rows, "shape": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "vocab")},
              "dtype": args.dtype, "kernels": args.kernels, "reference": {"model": "eager", "micro_rows": args.rows,
                                                                          "loss": ref_loss}, "variants": []}
    for spec in args.variants.split(","):
        which, rows, backend = spec.split(":")
        model, cfg = (compiled, compiled_cfg) if which == "compiled" else (eager, eager_cfg)
        torch._dynamo.reset()  # each variant traces afresh (a backend is chosen while tracing)
        try:
            gradients(model, cfg, ctx, ids, int(rows), backend)  # compiles; then the measured pass
            with collectives_counted(ctx.device) as counts:
                loss, got = gradients(model, cfg, ctx, ids, int(rows), backend)
            row = {"variant": spec, "loss": loss, **compare(ref, got, args.most), "collective_kernels": counts}
        except Exception as e:  # noqa: BLE001 (a backend that cannot run these shapes: say so, go on)
            row = {"variant": spec, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        report["variants"].append(row)
        if rank == 0:
            shown = row.get("error") or f"loss {row['loss']:.5f} rel_err {row['rel_err']:.2e} worst " + ", ".join(
                f"{w['param']} {w['rel_err']:.1e}" for w in row["worst"][:3]) + f" nccl {row['collective_kernels']}"
            print(f"{spec:24s} {shown}", flush=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, report)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": everyone}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="galaxy")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", type=int, default=4, help="rows of the global batch")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--variants", default="eager:1:default,compiled:4:default,compiled:1:default,compiled:2:default,"
                   "compiled:1:flash,compiled:1:efficient,compiled:4:cudnn,compiled:1:cudnn",
                   help="MODEL:ROWS_PER_MICRO_BATCH:SDPA_BACKEND, comma-separated")
    p.add_argument("--most", type=int, default=8, help="parameters listed per variant")
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    launch(worker, args, p, args.cpu)


if __name__ == "__main__":
    main()
