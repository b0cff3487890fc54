"""``infer_galaxy.py``: single-request latency of BERT or LLaMA on any plan.

    infer_galaxy.py --model bert-base --world 2 --plan galaxy --seq_length 128
    infer_galaxy.py --model llama-tiny --world 3 --plan sp --generate 16 --emulate cluster.json

One request is batch 1 of ``--seq_length`` token ids (seeded random ids, or ``--prompt_ids``). The
forward is timed ``--reps`` times after ``--warmup`` untimed runs; each repetition starts behind a
barrier and counts the slowest rank (the request is done when every rank is). LLaMA with
``--generate N`` also times greedy generation of N new tokens with the KV cache (every plan,
SP ones included: ``galaxy.models.generation``): the whole request, the prefill with its first
token, and the mean time of each later token. Rank 0 prints a summary (median and spread) and
writes ``--summary_json``. Ranks are launched as by the training CLIs (``galaxy.cli.launch``):
local processes, ``--rank`` per shell, torchrun, or ``--emulate cluster.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

from galaxy.cli.args import add_config_flags, add_launch_flags, model_flag_config, new_parser
from galaxy.cli.launch import interruptible, launch_ranks
from galaxy.cli.output import bad_input, print_summary, setup_logging
from galaxy.cli.run import Run, prepare, ranks_of
from galaxy.config import MODEL_PRESETS, PLAN_PRESETS, ConfigError, GalaxyConfig
from galaxy.errors import UserError
from galaxy.models import family, model_types

logger = logging.getLogger(__name__)

DESCRIPTION = "single-request latency and greedy generation on any plan"


def parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = new_parser(prog, DESCRIPTION)
    p.add_argument("--model", default=None,
                   help=f"a model preset ({', '.join(MODEL_PRESETS)}) or a JSON config file (--config_file too); "
                        "default: bert-tiny")
    add_config_flags(p)
    p.add_argument("--plan", choices=sorted(PLAN_PRESETS), default=None,
                   help="parallel plan; omitted: the config's, else galaxy on several ranks and none on one")
    p.add_argument("--seq_length", type=int, default=None, help="prompt tokens (default: the config's seq_length)")
    p.add_argument("--prompt_ids", default=None, metavar="ID,ID,...",
                   help="the prompt as comma-separated token ids (default: seeded random ids)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="LLaMA: also time greedy generation of N new tokens (KV cache)")
    p.add_argument("--summary_json", default=None, help="write the summary as JSON here (rank 0)")
    add_launch_flags(p)
    return p


@dataclass(frozen=True)
class Request:
    """The request timed, and how: batch 1 of ``ids``; ``warmup`` untimed runs, then ``reps`` timed ones;
    ``generate`` new tokens greedily after the prompt (0: the forward alone)."""

    ids: list[int]
    warmup: int = 2
    reps: int = 10
    generate: int = 0

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.reps < 1 or self.generate < 0:
            raise ConfigError("--warmup and --generate must be at least 0 and --reps at least 1")


def load(args: argparse.Namespace) -> GalaxyConfig:
    """The config: ``--model`` preset or file (or ``--config_file``), then the flags; one request."""
    return model_flag_config(args, "bert-tiny", fixed={"global_batch_size": 1})


def prompt(args: argparse.Namespace, cfg: GalaxyConfig) -> list[int]:
    """The request's token ids, checked against the vocabulary and the sequence length."""
    if args.prompt_ids is None:
        import torch

        g = torch.Generator().manual_seed(cfg.train.seed)
        return torch.randint(0, cfg.model.vocab_size, (cfg.train.seq_length,), generator=g).tolist()
    try:
        ids = [int(t) for t in args.prompt_ids.split(",")]
    except ValueError:
        raise ConfigError(f"--prompt_ids must be comma-separated integers, got '{args.prompt_ids}'") from None
    if not all(0 <= t < cfg.model.vocab_size for t in ids):
        raise ConfigError(f"--prompt_ids holds ids outside the vocabulary 0..{cfg.model.vocab_size - 1}")
    if len(ids) != cfg.train.seq_length:
        raise ConfigError(f"--prompt_ids has {len(ids)} tokens but seq_length is {cfg.train.seq_length} (the plan's "
                          f"sequence split covers it); pass --seq_length {len(ids)}")
    return ids


def check(args: argparse.Namespace, cfg: GalaxyConfig) -> None:
    """What only a latency run asks of the config, before any rank starts (the rest: ``prepare``)."""
    if cfg.parallel.dp_size != 1 or cfg.parallel.pp_size != 1:
        raise ConfigError("inference latency runs one request on one model-parallel group: set dp_size and pp_size "
                          "to 1")
    if args.generate and not family(cfg.model.model_type).causal:
        raise ConfigError(f"--generate needs a causal LM ({', '.join(model_types(causal=True))}); the model is "
                          f"{cfg.model.model_type}")
    total = cfg.train.seq_length + args.generate
    if total > cfg.model.max_position_embeddings:
        raise ConfigError(f"the prompt ({cfg.train.seq_length}) and --generate ({args.generate}) need {total} "
                          f"positions but max_position_embeddings is {cfg.model.max_position_embeddings}; "
                          "shorten one or raise max_position_embeddings")


def spread(seconds: list[float]) -> dict:
    """Median and spread of timed repetitions, in milliseconds."""
    ms = sorted(t * 1e3 for t in seconds)
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": round(statistics.median(ms), 3), "iqr_ms": round(q[2] - q[0], 3),
            "min_ms": round(ms[0], 3), "max_ms": round(ms[-1], 3), "reps": len(ms),
            "all_ms": [round(t, 3) for t in ms]}


def timed(run: Callable[[], object], ctx, warmup: int, reps: int) -> list[float]:
    """Seconds of ``run`` on the slowest rank, per repetition after ``warmup`` untimed ones; every
    repetition starts behind a barrier, so no rank's earlier work is counted."""
    import torch
    import torch.distributed as dist

    times = []
    for i in range(warmup + reps):
        if ctx.world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        run()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if ctx.world_size > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed))
    return times


def infer_body(ctx, run: Run) -> None:
    import torch

    from galaxy.models import build_model
    from galaxy.train.loop import autocast_context

    cfg, plan, request = run.cfg, run.plan, run.job
    model = build_model(cfg, plan, ctx).eval()
    if cfg.train.dtype == "float64":
        model.double()
    ids = torch.tensor([request.ids], device=ctx.device)
    amp = autocast_context(cfg, ctx.device)

    def forward():
        with torch.no_grad(), amp:
            model(ids)

    fields = {"model": cfg.model.model_type, "layers": cfg.model.num_hidden_layers,
              "hidden": cfg.model.hidden_size, "plan": plan.name,
              "att/con/mlp": "/".join(m.value for m in (plan.att, plan.con, plan.mlp)), "world": ctx.mp.size,
              "heads_split": list(plan.heads_split), "ffn_split": list(plan.ffn_split),
              "seq_split": list(plan.seq_split), "seq_length": cfg.train.seq_length, "dtype": cfg.train.dtype,
              "device": str(ctx.device),
              "forward": spread(timed(forward, ctx, request.warmup, request.reps))}
    if request.generate:
        fields.update(generation_latency(model, ids, request, ctx, amp))
    if ctx.rank == 0:
        print_summary("inference latency (batch 1)", summary_lines(fields), None)
        if run.options.summary_json:
            with open(run.options.summary_json, "w") as f:
                json.dump(fields, f, indent=2)


def generation_latency(model, ids, request: Request, ctx, amp) -> dict:
    """Greedy generation of ``--generate`` tokens: the whole request, the prefill with its first
    token, and the mean of each later token ((whole - prefill) / (N - 1), per repetition)."""
    import torch

    n = request.generate
    tokens = []

    def whole():
        with torch.no_grad(), amp:
            tokens.append(model.generate(ids, max_new_tokens=n)[0, ids.shape[1]:].tolist())

    def first():
        with torch.no_grad(), amp:
            model.generate(ids, max_new_tokens=1)

    total = timed(whole, ctx, request.warmup, request.reps)
    prefill = timed(first, ctx, request.warmup, request.reps)
    out = {"generate_tokens": n, "generate": spread(total), "first_token": spread(prefill),
           "new_tokens": tokens[-1]}
    if n > 1:
        out["per_token"] = spread([(t - p) / (n - 1) for t, p in zip(total, prefill)])
    return out


def summary_lines(fields: dict) -> dict:
    """The summary for people: each timing as 'median (IQR, min..max) ms'."""
    lines = {}
    for key, value in fields.items():
        if isinstance(value, dict) and "median_ms" in value:
            lines[f"{key} latency"] = (f"{value['median_ms']:.2f} ms median (IQR {value['iqr_ms']:.2f}, "
                                       f"{value['min_ms']:.2f}..{value['max_ms']:.2f}, {value['reps']} reps)")
        elif key != "new_tokens":
            lines[key] = value
    return lines


@interruptible
def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    args = parser(prog).parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = load(args)
        check(args, cfg)
        request = Request(prompt(args, cfg), args.warmup, args.reps, args.generate)
        launch, run = prepare(args, cfg, plan=None, job=request)
    except (UserError, FileNotFoundError) as e:
        return bad_input(e)
    return launch_ranks(ranks_of(infer_body), launch, run, cfg)
