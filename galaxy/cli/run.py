"""The one path of every command that starts ranks: flags parsed and the config loaded (``galaxy.cli.args``),
then ``prepare``: the launch decided and everything about it checked before any rank starts (one line,
exit 2), the plan resolved once; then ``launch_ranks`` runs ``rank_main`` on each rank, which joins the
process group, runs the command's body on a ``Run`` (the config, the plan, the typed options: never the
parsed flags) and leaves the group.

    args -> cfg -> prepare(args, cfg, ...) -> (Launch, Run) -> launch_ranks(rank_main(body), ...) -> body(ctx, run)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Optional

from galaxy.cli.args import RunOptions, check_input_files, check_profile_step, check_resume
from galaxy.cli.launch import Launch, decide_launch, on_devices, rank_context
from galaxy.cli.output import check_output_flags, setup_logging
from galaxy.config import PLAN_PRESETS, ConfigError, GalaxyConfig, Plan


@dataclass(frozen=True)
class Run:
    """What each rank of a run is given: the checked config, its plan (resolved once, before any rank starts),
    the options common to the commands, and the command's own typed job (its options and inputs)."""

    cfg: GalaxyConfig
    plan: Plan
    options: RunOptions
    job: Any = None


Body = Callable[[Any, Run], None]  # (this rank's ParallelContext, the run)


def prepare(args: argparse.Namespace, cfg: GalaxyConfig, plan: Optional[str], strict: bool = False,
            fill: Optional[str] = None, rank0_files: Optional[dict[str, Optional[str]]] = None,
            job: Any = None) -> tuple[Launch, Run]:
    """Decide the launch and check everything about it before any process starts: the plan for this command
    (``plan``: the one a config that names none gets; None: galaxy on several ranks, none on one; ``strict``:
    the config may name no other), the world split into dp x pp x mp (``fill``: see ``fill_world``), every
    split, the profile and checkpoint flags (what --resume names), the output paths (writable; ``rank0_files``:
    the command's own, flag -> path), the files the config names, and the settings the device decides
    (dp_engine, tp_overlap)."""
    options = RunOptions.from_args(args)
    launch = on_devices(decide_launch(args), cfg.distributed.devices)
    check_plan_for_cli(cfg, plan or ("galaxy" if launch.world > 1 else "none"), launch.world, strict)
    fill_world(cfg, launch.world, fill)
    resolved = cfg.resolve_plan(cfg.mp_size(launch.world))
    check_profile_step(options, cfg)
    check_resume(options)
    check_output_flags(options, rank0_here=launch.starts_rank_0, rank0_files=rank0_files)
    check_input_files(cfg)
    check_engine(cfg)
    check_tp_overlap(cfg, launch.world)
    launch.save_dir = options.save_dir  # locked for the run where rank 0 starts
    return launch, Run(cfg, resolved, options, job)


def ranks_of(body: Body) -> Callable[[int, Launch, Run], None]:
    """The function ``launch_ranks`` starts on each rank for ``body`` (picklable: spawned processes get it)."""
    return partial(rank_main, body)


def rank_main(body: Body, rank: int, launch: Launch, run: Run) -> None:
    """One rank of a run: join the process group (rank 0 also shows the stages of long work), run ``body``,
    leave the group (at once on a failure, after every rank is done otherwise)."""
    run = replace(run, options=replace(run.options, launcher_pid=launch.launcher_pid))
    with rank_context(rank, launch, run.cfg, run.options.log_level) as ctx:
        if rank == 0:
            setup_logging(run.options.log_level, stages=True)
        body(ctx, run)


# ----------------------------------------------------------------------------- checks of the plan and the devices


def check_plan_for_cli(cfg: GalaxyConfig, cli_plan: str, world: int, strict: bool) -> None:
    """A config that names no plan gets the command's; a plan-specific command (``strict``, e.g.
    pretrain_tp_bert.py) refuses a config that names another plan."""
    p = cfg.parallel
    explicit = p.plan or any(getattr(p, k) for k in ("att_parallel_method", "con_parallel_method",
                                                    "mlp_parallel_method"))
    if not explicit:
        p.plan = cli_plan
    elif strict and cfg.methods() != PLAN_PRESETS[cli_plan]:
        raise ConfigError(f"this CLI runs the '{cli_plan}' plan but the config asks for "
                          f"{'/'.join(m.value for m in cfg.methods())} (att/con/mlp); use pretrain_galaxy.py "
                          "or drop the plan keys from the config")
    if strict and cli_plan == "none" and world != 1:
        raise ConfigError(f"the serial CLI runs on one rank, got --world {world}; use pretrain_galaxy.py for more")


def fill_world(cfg: GalaxyConfig, world: int, fill: Optional[str]) -> None:
    """``fill`` ('dp' or 'pp', from pretrain_dp_bert.py / pretrain_pp_bert.py): a config that leaves
    that size at 1 and runs no mp plan gets every rank the other dimension leaves, so
    ``pretrain_pp_bert.py --world 4`` is a 4-stage pipeline."""
    p = cfg.parallel
    if fill is None or any(m.value != "None" for m in cfg.methods()):
        return
    if fill == "dp" and p.dp_size == 1 and world % p.pp_size == 0:
        p.dp_size = world // p.pp_size
    elif fill == "pp" and p.pp_size == 1 and world % p.dp_size == 0 and p.stage_num_hidden_layers_list is None:
        p.pp_size = world // p.dp_size
    cfg.validate()


def check_engine(cfg: GalaxyConfig) -> None:
    """``dp_engine: deepspeed`` needs CUDA: refuse it before any process starts where none is visible."""
    if cfg.parallel.dp_engine != "deepspeed" or cfg.parallel.dp_size == 1:
        return
    device = cfg.train.device
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        raise ConfigError(f"config key 'dp_engine' is 'deepspeed' but the device is "
                          f"{'cpu' if device == 'cpu' else 'cpu (no CUDA GPU is visible)'}: DeepSpeed ZeRO needs "
                          "CUDA GPUs; use dp_engine 'zero1' (torch ZeroRedundancyOptimizer) or 'ddp' here")


def check_tp_overlap(cfg: GalaxyConfig, world: int) -> None:
    """``tp_overlap: async_tp`` runs torch's symmetric-memory ops, CUDA + NCCL only: refuse it before any
    process starts where the model-parallel group would use another device (a group of one rank has
    nothing to overlap and runs unfused anywhere)."""
    if cfg.parallel.tp_overlap != "async_tp" or cfg.mp_size(world) == 1:
        return
    device, backend = cfg.train.device, cfg.distributed.distributed_backend
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu (no CUDA GPU is visible)"
    if device != "cuda" or backend not in ("auto", "nccl"):
        where = f"backend {backend}" if device == "cuda" else f"device {device}"
        raise ConfigError(f"config key 'tp_overlap' is 'async_tp', which runs on CUDA GPUs over NCCL (symmetric "
                          f"memory), but this run uses {where}; use tp_overlap coc or none")

