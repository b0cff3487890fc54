"""Training throughput and peak memory of one model under several plans, in one launch.

    python bench/bench_plans.py --world 2 --preset bert-large --seq 512 --batch 8 --dtype bfloat16 \
        --plans none,tp,sp,galaxy,galaxy2 --json out.json

Every rank process is started here (one GPU each, NCCL; CPU + Gloo without GPUs). The plan
``none`` is the serial baseline and ``hf`` the same model from ``transformers``: both run on rank 0
alone while the other ranks wait. Each plan runs
full training steps (forward, backward, gradient sync, AdamW) through ``galaxy.train.loop.train``
on the synthetic corpus; the first ``--warmup`` steps are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.bench_coc import git_commit  # noqa: E402,F401 -- also bench_checkpoint's and bench_recompute's
from galaxy.config import DistributedConfig, GalaxyConfig, parse_override  # noqa: E402
from galaxy.core.context import ParallelContext, build_groups  # noqa: E402
from galaxy.models import build_model  # noqa: E402
from galaxy.peft import apply_tuning  # noqa: E402
from galaxy.cli.launch import free_port  # noqa: E402
from galaxy.train.loop import TrainResult, autocast_context, build_optimizer, peak_memory_mb, train  # noqa: E402
from galaxy.data.pretraining import mlm_data  # noqa: E402


def config_for(args, plan: str, extra: dict) -> GalaxyConfig:
    raw = {"model": {"preset": args.preset, "hidden_dropout_prob": args.dropout,
                     "attention_probs_dropout_prob": 0.0},
           "parallel": {"plan": plan},
           "train": {"global_batch_size": args.batch, "seq_length": args.seq, "max_steps": args.warmup + args.steps,
                     "dtype": args.dtype, "lr": 1e-4, "warmup_steps": 0, "grad_clip": 1.0, "log_every": 1000}}
    overrides = dict(parse_override(o) for o in args.override)
    overrides.update(extra)
    return GalaxyConfig.from_dict(raw, overrides)


def causal_lm_data(cfg: GalaxyConfig):
    """Random token rows with labels = inputs (the model shifts): a fixed-cost LM batch."""
    def batch_at(step: int) -> dict:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_length), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    return batch_at


def hf_model(model_type: str, hf_config: dict, device: torch.device, cfg: Optional[GalaxyConfig] = None):
    """The same architecture from transformers, for a side-by-side baseline; with
    ``cfg.peft.tuning == 'lora'`` wrapped by HF peft with the same rank, alpha and targets."""
    import transformers

    hf_config = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    if model_type == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config, attn_implementation="sdpa"))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(**hf_config, attn_implementation="sdpa"))
    if cfg is not None and cfg.peft.tuning == "lora":
        import peft

        targets = cfg.peft.lora_target_modules or (["q_proj", "v_proj"] if model_type == "llama" else ["query", "value"])
        model = peft.get_peft_model(model, peft.LoraConfig(r=cfg.peft.lora_dim, lora_alpha=cfg.peft.lora_alpha,
                                                           lora_dropout=cfg.peft.lora_dropout, target_modules=targets))
    elif cfg is not None and cfg.peft.tuning != "full":
        raise ValueError(f"the transformers baseline has no '{cfg.peft.tuning}' method")
    return model.to(device)


def profile_parser(doc: str, rows: int) -> argparse.ArgumentParser:
    """The flags the one-GPU profilers (profile_host.py, profile_model.py) share."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bert-large")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rows", type=int, default=rows, help="rows of each profile table")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    p.add_argument("--out", default=".")
    return p


def serial_pair(args, ctx: ParallelContext, **keys):
    """The profilers' config, batches and two models on one device: Galaxy's (with its tuning
    method) and the same architecture from transformers (+ peft for LoRA)."""
    raw = {"preset": args.preset, "seq_length": args.seq, "global_batch_size": args.batch, **keys}
    cfg = GalaxyConfig.from_dict(raw, dict(parse_override(o) for o in args.override))
    batch_at = causal_lm_data(cfg) if cfg.model.model_type == "llama" else mlm_data(cfg)[0]
    ours = apply_tuning(build_model(cfg, None, ctx), cfg)
    theirs = hf_model(cfg.model.model_type, ours.config_to_hf(), ctx.device, cfg)
    return cfg, batch_at, ours, theirs


class StepTimer:
    """An ``on_step`` callback of ``train``: each step's wall time after the first ``warmup`` steps, counted
    from the step before (the first from ``start``, called on making), and every step's loss; ``after()``,
    when given, runs after each step outside the timed span (a profiler's ``step``, a memory reading).
    ``drain`` (``torch.cuda.synchronize``), when given, waits for the queued GPU work before ``after()``: the
    loop reports a step while the next one is queued, and the GPU would run that work inside ``after()``'s
    excluded time (a profiler's step takes host milliseconds), a span shorter than the work it holds."""

    def __init__(self, warmup: int = 0, after: Optional[Callable[[], None]] = None,
                 drain: Optional[Callable[[], None]] = None):
        self.warmup, self.after, self.drain, self.times, self.losses = warmup, after, drain, [], []
        self.start()

    def start(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, step: int, loss: float) -> None:
        if self.drain is not None:
            self.drain()
        now = time.perf_counter()
        if step > self.warmup:
            self.times.append(now - self.last)
        self.losses.append(loss)
        if self.after is not None:
            self.after()
        self.last = time.perf_counter()


def run_plan(args, item: str, ctx: ParallelContext) -> dict:
    plan, extra = parse_item(item)
    cfg = config_for(args, "none" if plan == "hf" else plan, extra)
    batch_at = causal_lm_data(cfg) if cfg.model.model_type == "llama" else mlm_data(cfg)[0]
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    model = apply_tuning(build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx), cfg)
    if plan == "hf":
        model = hf_model(cfg.model.model_type, model.config_to_hf(), ctx.device, cfg)
    timer = StepTimer(args.warmup)
    if plan == "hf":
        result = plain_train(model, batch_at, cfg, ctx.device, timer)
    else:
        result = train(model, batch_at, cfg, ctx, on_step=timer)
    times = sorted(timer.times)
    median = times[len(times) // 2]
    tokens = args.batch * args.seq
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if ctx.device.type == "cuda" else result.peak_mem_mb
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model
    row = {"plan": item, "ranks": 1 if serial_only(plan, extra) else ctx.world_size,
           "trainable_params": trainable,
           "step_time_ms": median * 1e3, "tokens_per_s": tokens / median, "peak_mem_mb": peak,
           "comm_mb_per_step": result.comm_bytes_per_step / 2**20, "final_loss": result.losses[-1]}
    if result.bubble_measured is not None:
        row["bubble_measured"] = sum(result.bubble_measured) / len(result.bubble_measured)
        row["bubble_analytic"] = result.bubble_analytic
    return row


def plain_train(model, batch_at, cfg: GalaxyConfig, device: torch.device, on_step) -> TrainResult:
    """The textbook loop for the transformers baseline: autocast forward, backward, clip, fused AdamW."""
    t = cfg.train
    optimizer = build_optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    result = TrainResult()
    model.train()
    for step in range(t.max_steps):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch_at(step).items()}
        with autocast_context(cfg, device):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(loss.item())
        on_step(step + 1, result.losses[-1])
    result.peak_mem_mb = peak_memory_mb(device)
    return result


def serial_only(plan: str, extra: dict) -> bool:
    """The serial baselines run on rank 0 alone unless dp/pp spread them."""
    return plan in ("none", "hf") and not ({"dp_size", "pp_size"} & set(extra))


def parse_item(item: str) -> tuple[str, dict]:
    """``plan`` or ``plan@key=value@key=value`` (e.g. ``none@dp_size=2``, ``none@pp_size=2@pipeline_schedule=gpipe``)."""
    plan, *settings = item.split("@")
    return plan, dict(parse_override(kv) for kv in settings)


def worker(rank: int, args, port: int, queue) -> None:
    torch.manual_seed(0)
    dist_cfg = DistributedConfig(init_method=f"tcp://127.0.0.1:{port}", timeout_s=600)
    base = ParallelContext.initialize(dist_cfg, rank, args.world, "auto", seed=1234)
    rows = []
    for item in args.plans.split(","):
        plan, extra = parse_item(item)
        if serial_only(plan, extra):
            if rank == 0:
                serial = ParallelContext.serial(base.device, seed=1234)
                rows.append(run_plan(args, item, serial))
            if dist.is_initialized():  # --world 1 has no process group
                dist.barrier()
            continue
        cfg = config_for(args, plan, extra)
        groups = build_groups(rank, args.world, cfg.parallel.dp_size, cfg.parallel.pp_size)
        ctx = ParallelContext(rank=rank, world_size=args.world, device=base.device, seed=1234, backend=base.backend,
                              stage_layers=cfg.stage_layers(), **groups)
        row = run_plan(args, item, ctx)
        peaks = [None] * args.world
        if dist.is_initialized():
            dist.all_gather_object(peaks, row["peak_mem_mb"])
        else:
            peaks = [row["peak_mem_mb"]]
        row["peak_mem_mb"] = max(peaks)
        rows.append(row)
    if rank == 0:
        queue.put(rows)
    base.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--preset", default="bert-large")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--plans", default="none,tp,sp,galaxy,galaxy2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    rows = queue.get()
    for proc in procs:
        proc.join()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    serial = next((r for r in rows if r["plan"] == "none"), None)
    print(f"\n{args.preset}, seq {args.seq}, global batch {args.batch}, {args.dtype}, {args.world} x {device}")
    width = max(len(r["plan"]) for r in rows) + 2
    print(f"{'plan':<{width}}{'ranks':>6}{'step ms':>10}{'tokens/s':>11}{'speedup':>9}{'peak MiB':>10}"
          f"{'comm MiB':>10}  bubble (measured / analytic)")
    for r in rows:
        r["speedup_vs_serial"] = serial["step_time_ms"] / r["step_time_ms"] if serial else None
        bubble = f"  {r['bubble_measured']:.3f} / {r['bubble_analytic']:.3f}" if "bubble_measured" in r else ""
        print(f"{r['plan']:<{width}}{r['ranks']:>6}{r['step_time_ms']:>10.1f}{r['tokens_per_s']:>11.0f}"
              f"{(r['speedup_vs_serial'] or 0):>9.2f}{r['peak_mem_mb']:>10.0f}{r['comm_mb_per_step']:>10.1f}{bubble}")
    report = {"device": device, "world": args.world, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
              "torch": torch.__version__, "args": vars(args), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
