"""Activation recomputation on one GPU: peak memory and throughput of ``recompute`` none /
selective / full on LLaMA-1B (Llama-3.2-1B shapes), seq 2048, bf16 autocast, full training steps.

    python bench/bench_recompute.py --out recompute.json                    # on a CUDA GPU
    python bench/bench_recompute.py --batch 8 --modes none,full --out r.json
    python bench/bench_recompute.py --smoke                                 # llama-tiny: runs end to end (CPU too)

Each mode builds a fresh model (fp32 master weights, the preset's config, ``kernels`` as given,
default auto = the Triton kernels on CUDA) and takes full steps: forward and backward under bf16
autocast, gradient clipping, fused AdamW. ``--warmup`` steps are untimed, then ``--steps`` steps
are timed as one span (CUDA synchronized at both ends): tokens/s = batch x seq x steps / span.
Peak memory is ``torch.cuda.max_memory_allocated`` over the whole run of the mode (weights,
gradients, AdamW moments and the activations of one step); ``static`` is what is allocated
before the first step plus the moments, so ``peak - static`` is about the activations.

``--batch auto`` (default) picks the largest of 16, 12, 8, 6, 4, 2, 1 whose step fits with
recompute none, and runs every mode at that batch, so the modes differ only in recomputation;
``--max-batch`` also reports the largest batch each mode fits (slower: a search per mode).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Optional

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_plans import git_commit  # noqa: E402
from galaxy.config import GalaxyConfig  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.models import build_model  # noqa: E402

BATCH_CANDIDATES = (16, 12, 8, 6, 4, 2, 1)


def config_for(args, mode: str, batch: int) -> GalaxyConfig:
    model = {"preset": args.preset, "recompute": mode, "kernels": args.kernels, "fused_gate_up": args.fused_gate_up}
    if args.recompute_num_layers and mode != "none":
        model["recompute_num_layers"] = args.recompute_num_layers
    return GalaxyConfig.from_dict({"model": model,
                                   "train": {"global_batch_size": batch, "seq_length": args.seq, "dtype": args.dtype,
                                             "device": args.device, "lr": 1e-4, "warmup_steps": 0}})


class Run:
    """One mode's model, optimizer and random LM batches on the device."""

    def __init__(self, args, mode: str, batch: int, device: torch.device):
        self.cfg = cfg = config_for(args, mode, batch)
        ctx = ParallelContext.serial(device, seed=cfg.train.seed)
        self.model = build_model(cfg, cfg.resolve_plan(1), ctx).train()
        self.device, self.batch, self.seq = device, batch, args.seq
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, fused=fused)
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.model.vocab_size, (batch, args.seq), generator=g)
        self.inputs = {"input_ids": ids.to(device), "labels": ids.to(device)}

    def step(self) -> float:
        amp = torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None)
        with amp:
            loss = self.model(**self.inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def fits(args, mode: str, batch: int, device: torch.device) -> bool:
    """Whether one training step of ``mode`` at ``batch`` runs without running out of memory."""
    run = None
    try:
        run = Run(args, mode, batch, device)
        run.step()
        run.step()  # the second step holds the AdamW moments as well
        sync(device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del run
        release(device)


def largest_batch(args, mode: str, device: torch.device) -> Optional[int]:
    return next((b for b in BATCH_CANDIDATES if fits(args, mode, b, device)), None)


def measure(args, mode: str, batch: int, device: torch.device) -> dict:
    release(device)
    run = Run(args, mode, batch, device)
    losses = [run.step() for _ in range(args.warmup)]
    sync(device)
    static = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    losses += [run.step() for _ in range(args.steps)]
    sync(device)
    span = time.perf_counter() - start
    tokens = batch * args.seq * args.steps
    row = {"recompute": mode, "recompute_num_layers": run.cfg.model.recompute_num_layers, "batch": batch,
           "seq": args.seq, "steps": args.steps, "step_ms": span / args.steps * 1e3, "tokens_per_s": tokens / span,
           "final_loss": float(losses[-1])}
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["static_mem_gib"] = static / 2**30
    del run, losses
    release(device)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", default="auto", help="rows per step, or 'auto' (the largest that fits with none)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--modes", default="none,selective,full")
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--fused-gate-up", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-batch", action="store_true", help="also find the largest batch each mode fits")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="llama-tiny, seq 64, batch 2, 2 steps (CPU works)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.seq, args.warmup, args.steps = "llama-tiny", 64, 1, 2
        args.batch = "2" if args.batch == "auto" else args.batch
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    modes = args.modes.split(",")

    batch = largest_batch(args, "none", device) if args.batch == "auto" else int(args.batch)
    if batch is None:
        raise SystemExit(f"{args.preset} at seq {args.seq} does not fit even at batch 1 without recomputation; "
                         "pass --batch 1 --modes full to measure recomputation alone")
    rows = []
    for mode in modes:
        row = measure(args, mode, batch, device)
        if args.max_batch and device.type == "cuda":
            row["max_batch"] = largest_batch(args, mode, device)
        rows.append(row)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    base = next((r for r in rows if r["recompute"] == "none"), None)
    print(f"\n{args.preset}, seq {args.seq}, batch {batch}, {args.dtype}, kernels {args.kernels}, 1 x {name}")
    print(f"{'recompute':<12}{'step ms':>10}{'tokens/s':>11}{'vs none':>9}{'peak GiB':>10}{'act GiB':>9}"
          f"{'max batch':>11}")
    for r in rows:
        r["throughput_vs_none"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        peak, act = r.get("peak_mem_gib"), r.get("peak_mem_gib", 0) - r.get("static_mem_gib", 0)
        print(f"{r['recompute']:<12}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11.0f}"
              f"{(r['throughput_vs_none'] or 0):>9.2f}{(peak or 0):>10.2f}{act:>9.2f}{str(r.get('max_batch', '-')):>11}")
    report = {"device": name, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "args": vars(args), "batch": batch, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
