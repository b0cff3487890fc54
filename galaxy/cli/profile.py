"""Profile one step of a Galaxy BERT or LLaMA: FLOPs (forward and backward measured), parameters,
replicated compute and communication, per rank and summed over the model-parallel group.

    python profile_flops.py --model bert --config train_config/bert/full.json
    python profile_flops.py --model bert --world 2 --plan galaxy --json out.json
    python profile_flops.py --preset llama-7b --meta --batch 1 --seq_len 128 --forward_only
    python profile_flops.py --preset llama-7b --meta

``--preset`` names a model preset (bert-tiny, bert-base, llama-7b, ...: the configs' ``preset`` key);
``--config`` takes a JSON file (or, as before, a preset name); omitted, the model's tiny preset is
used. ``--world N`` starts N local CPU/Gloo (or GPU/NCCL) processes, or runs one rank with ``--rank`` / under torchrun; rank 0 prints the report (its own
module tree, then the per-rank table, the sums, the replicated compute and the bytes per
transition and per layer) and writes ``--json``. ``--meta`` builds and runs the model on meta-backed fake tensors
(shapes only: fake tensors, no memory, no compute; one rank), so a LLaMA-7B-shaped model
profiles anywhere.

A step is a training step: the forward with labels (the loss included), the backward and the
gradient sync; ``--optimizer`` adds the clipping and the AdamW step, ``--forward_only`` profiles the
forward alone. Forward-only steps run in eval mode without autograd; steps with a backward run in
train mode (dropout on, as configured).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch

from galaxy.cli.args import add_config_flags, add_launch_flags, build_config, flag_overrides, new_parser
from galaxy.cli.launch import interruptible, launch_ranks
from galaxy.cli.output import bad_input, setup_logging
from galaxy.cli.run import Run, prepare, ranks_of
from galaxy.config import MODEL_PRESETS, PLAN_PRESETS, ConfigError, GalaxyConfig, Plan
from galaxy.core.context import ParallelContext
from galaxy.errors import UserError
from galaxy.models import build_model, family, model_types
from galaxy.profiler import FlopsProfiler, ParallelProfiler

logger = logging.getLogger(__name__)

DESCRIPTION = "FLOPs, parameters and communication of one step of a model on a plan"
DEFAULT_MODEL = "bert"  # the family profiled when neither --model nor a config names one


def parser(prog: Optional[str] = None):
    p = new_parser(prog, DESCRIPTION)
    p.add_argument("--model", choices=model_types(), default=None,
                   help=f"model family; omitted: the config's model_type ({DEFAULT_MODEL} without a config)")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help=f"model preset (the configs' 'preset' key): {', '.join(MODEL_PRESETS)}")
    add_config_flags(p)
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the config's global_batch_size)")
    p.add_argument("--seq_len", type=int, default=None, help="sequence length (default: the config's seq_length)")
    p.add_argument("--plan", choices=sorted(PLAN_PRESETS), default=None,
                   help="parallel plan; omitted: the config's, else galaxy on several ranks and none on one")
    p.add_argument("--forward_only", action="store_true",
                   help="profile the forward alone (default: a training step, forward + backward + gradient sync)")
    p.add_argument("--backward", action="store_true", help="forward + backward + gradient sync: the default")
    p.add_argument("--optimizer", action="store_true", help="also clip and step AdamW")
    p.add_argument("--meta", action="store_true",
                   help="shapes only: build and run on meta-backed fake tensors, no memory or compute (one rank)")
    p.add_argument("--json", default=None, help="write every number as JSON here (rank 0)")
    p.add_argument("--warm_up", type=int, default=None, help="unprofiled steps first (default 1; 0 with --meta)")
    p.add_argument("--module_depth", type=int, default=-1, help="deepest module level in the report (-1: all)")
    p.add_argument("--top_modules", type=int, default=1, help="modules per depth in the aggregated view")
    p.add_argument("--no_detailed", action="store_true", help="leave the module tree out of the report")
    p.add_argument("--causal_halving", action="store_true",
                   help="count half of fused causal attention kernels (they skip the masked half)")
    p.add_argument("--check_serial", action="store_true",
                   help="rank 0 also profiles the serial model and checks sum over ranks == serial + redundant")
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="peak dense TFLOP/s of one device, for the report's MFU (default: looked up for known GPUs)")
    add_launch_flags(p)
    return p


@dataclass(frozen=True)
class ProfiledStep:
    """The step profiled and the report: a forward, with ``backward`` (and the gradient sync) and the
    ``optimizer`` step; ``meta``: shapes only; ``warm_up`` unprofiled steps first."""

    backward: bool = True
    optimizer: bool = False
    meta: bool = False
    warm_up: int = 1
    json: Optional[str] = None
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    causal_halving: bool = False
    check_serial: bool = False

    def __post_init__(self) -> None:
        if self.warm_up < 0 or self.top_modules < 1:
            raise ConfigError(f"--warm_up must be at least 0 and --top_modules at least 1, got {self.warm_up} and "
                              f"{self.top_modules}")

    @classmethod
    def from_args(cls, args) -> "ProfiledStep":
        return cls(not args.forward_only, args.optimizer, args.meta,
                   args.warm_up if args.warm_up is not None else (0 if args.meta else 1), args.json,
                   args.module_depth, args.top_modules, not args.no_detailed, args.causal_halving, args.check_serial)


# ----------------------------------------------------------------------------- config


def resolve_config(args) -> GalaxyConfig:
    if args.forward_only and (args.backward or args.optimizer):
        other = "--backward" if args.backward else "--optimizer"
        raise ConfigError(f"--forward_only profiles no backward but {other} asks for one; drop one of the two")
    default, given = {"model": dict(family(args.model or DEFAULT_MODEL).tiny_config)}, None
    config_file, first = args.config_file, {}
    if config_file and not os.path.isfile(config_file) and config_file in MODEL_PRESETS:
        if args.preset is not None:
            raise ConfigError(f"--config {config_file} and --preset {args.preset} both name a preset; "
                              "keep --preset")
        default, given, config_file = {"model": {"preset": config_file}}, f"--config {config_file}", None
    if args.preset is not None:
        if args.preset not in MODEL_PRESETS:
            close = difflib.get_close_matches(args.preset, MODEL_PRESETS, n=1)
            raise ConfigError(f"--preset '{args.preset}' is not a model preset"
                              + (f" (did you mean '{close[0]}'?)" if close else "")
                              + f"; use one of {', '.join(MODEL_PRESETS)}")
        if config_file is None:
            default, given = {"model": {"preset": args.preset}}, f"--preset {args.preset}"
        else:  # the file's own size keys still win over the preset, as in a config
            first = {"preset": args.preset}
    last = {key: getattr(args, flag) for flag, key in (("seq_len", "seq_length"), ("batch", "global_batch_size"))
            if getattr(args, flag) is not None}
    if args.meta:
        last["device"] = "cpu"  # fake tensors report the CPU
    cfg = build_config(config_file, default, {**first, **flag_overrides(args), **last}, given)
    if args.model is not None and cfg.model.model_type != args.model:
        raise ConfigError(f"--model {args.model} but the config describes a {cfg.model.model_type} model; "
                          f"drop --model or pick a {args.model} config or preset")
    if args.meta and cfg.data.model_path:
        raise ConfigError("--meta builds a model of random shapes; it cannot load model_path, drop one of the two")
    if cfg.parallel.dp_size != 1 or cfg.parallel.pp_size != 1:
        raise ConfigError("profile_flops.py profiles one model-parallel group: set dp_size and pp_size to 1 "
                          "(use --profile_step K of the training CLIs to profile a dp/pp run)")
    return cfg


# ----------------------------------------------------------------------------- building


def shapes_only():
    """The context ``--meta`` runs in: every tensor created inside (parameters, batch, activations,
    gradients) is a fake tensor, i.e. a meta tensor that reports the CPU device. Nothing is
    allocated or computed, yet the model runs exactly the code it runs on a CPU (init, RNG
    streams, autocast checks, the attention kernel the CPU would pick), so every op is seen with
    its real shapes. (A bare ``device="meta"`` context breaks on device queries such as
    ``torch.is_autocast_enabled("meta")`` and meta generators.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def build(cfg: GalaxyConfig, ctx: ParallelContext, serial: bool = False, plan: Optional[Plan] = None
          ) -> torch.nn.Module:
    """The model to profile: laid out by ``plan`` (default: the config's for ``ctx``), or ``serial``."""
    model = build_model(cfg, None if serial else plan or cfg.resolve_plan(ctx.mp.size), ctx)
    if cfg.train.dtype == "float64":
        model.double()
    return model


def random_batch(cfg: GalaxyConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """Token ids and labels, the same on every rank. A masked LM: MLM labels on ``mlm_probability``
    of the tokens (at least one); a causal LM: the ids themselves (the model shifts them)."""
    b, s = cfg.train.global_batch_size, cfg.train.seq_length
    g = torch.Generator().manual_seed(cfg.train.seed)
    ids = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    if not family(cfg.model.model_type).causal:
        chosen = torch.rand(b, s, generator=g) < cfg.train.mlm_probability
        chosen[:, 0] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    else:
        labels = ids.clone()
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def make_step(model, batch, cfg: GalaxyConfig, ctx: ParallelContext, backward: bool, optimizer: bool):
    """The step to profile, and whether it syncs gradients."""
    from galaxy.core.grad_sync import GradientSync, clip_grad_norm
    from galaxy.train.loop import autocast_context, build_optimizer

    amp = autocast_context(cfg, ctx.device)
    if not backward:
        model.eval()

        def forward_step():
            with torch.no_grad(), amp:
                model(**batch)

        return forward_step
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    sync = GradientSync(params, ctx.mp)
    opt = build_optimizer(model, cfg) if optimizer else None

    def train_step():
        with amp:
            out = model(**batch)
        out.loss.backward()
        sync()
        if opt is not None:
            if cfg.train.grad_clip > 0:
                clip_grad_norm(params, cfg.train.grad_clip, ctx.mp)
            opt.step()
        model.zero_grad(set_to_none=True)

    return train_step


# ----------------------------------------------------------------------------- profiling


def profile(run: Run, ctx: ParallelContext) -> tuple[dict[str, Any], str]:
    """Profile one step on this rank (a collective over ``ctx.mp``): (JSON dict, report text)."""
    cfg, step = run.cfg, run.job
    model = build(cfg, ctx, plan=run.plan)
    batch = random_batch(cfg, ctx.device)
    prof = ParallelProfiler(model, ctx, batch=cfg.train.global_batch_size, seq_len=cfg.train.seq_length,
                            grad_sync=step.backward, timed=not step.meta, peak_tflops=run.options.peak_tflops,
                            causal_halving=step.causal_halving)
    data = prof.profile(make_step(model, batch, cfg, ctx, step.backward, step.optimizer), warm_up=step.warm_up)
    data["config"] = cfg.to_dict()
    data["step"] = {"backward": step.backward, "optimizer": step.optimizer, "warm_up": step.warm_up,
                    "meta": step.meta}
    text = prof.format_profile(profile_step=step.warm_up + 1, module_depth=step.module_depth,
                               top_modules=step.top_modules, detailed=step.detailed)
    return data, text


def serial_check(cfg: GalaxyConfig, step: ProfiledStep, device: torch.device, data: dict[str, Any]) -> dict[str, Any]:
    """Profile the serial model on the same batch: the sum over ranks must be serial + redundant."""
    ctx = ParallelContext.serial(device, cfg.train.seed)
    model = build(cfg, ctx, serial=True)
    run_step = make_step(model, random_batch(cfg, ctx.device), cfg, ctx, step.backward, step.optimizer)
    prof = FlopsProfiler(model, causal_halving=step.causal_halving)
    prof.start_profile()
    run_step()
    prof.stop_profile()
    serial = {ph: prof.get_total_flops(phase=ph) for ph in ("fwd", "bwd")}
    serial["total"] = serial["fwd"] + serial["bwd"]
    summed, redundant = data["sum"]["flops"], data["sum"]["redundant"]
    excess = {ph: summed[ph] - serial[ph] for ph in serial}
    return {"serial_flops": serial, "sum_minus_serial": excess, "reported_redundant": redundant,
            "match": excess == {ph: redundant[ph] for ph in serial}}


def profile_body(ctx: ParallelContext, run: Run) -> None:
    step = run.job
    with shapes_only() if step.meta else nullcontext():
        data, text = profile(run, ctx)
        if ctx.rank != 0:
            return
        if step.check_serial:
            check = data["serial_check"] = serial_check(run.cfg, step, ctx.device, data)
            text += (f"\nserial check: serial model {check['serial_flops']['total']} FLOPs, sum over ranks - "
                     f"serial = {check['sum_minus_serial']['total']}, reported redundant = "
                     f"{check['reported_redundant']['total']}: {'match' if check['match'] else 'MISMATCH'}")
    print(text, flush=True)
    if step.json:
        with open(step.json, "w") as f:
            json.dump(data, f, indent=2)
        print(f"profile written to {step.json}", flush=True)


@interruptible
def main(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> int:
    args = parser(prog).parse_args(argv)
    setup_logging(args.log_level)
    try:
        cfg = resolve_config(args)
        step = ProfiledStep.from_args(args)
        launch, run = prepare(args, cfg, plan=None, rank0_files={"json": step.json}, job=step)
        if step.meta and launch.world != 1:
            raise ConfigError(f"--meta runs on one rank (shapes only, no communication), got --world {launch.world}")
    except (UserError, FileNotFoundError) as e:
        return bad_input(e)
    return launch_ranks(ranks_of(profile_body), launch, run, cfg)
