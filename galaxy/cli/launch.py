"""Starting the ranks of a run (what is checked before any starts: ``galaxy.cli.run.prepare``).

Launch modes: under ``torchrun`` the RANK/WORLD_SIZE/LOCAL_RANK variables are used; ``--world N
--rank r`` runs one rank (rendezvous through ``init_method`` or MASTER_ADDR/MASTER_PORT, so ranks
can sit on different machines); ``--world N`` alone starts all N ranks as local processes.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.util
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from galaxy.cli.args import RunOptions, resume_path
from galaxy.cli.output import setup_logging
from galaxy.config import ConfigError, GalaxyConfig
from galaxy.emulate import Cluster, cgroups, run_emulated
from galaxy.emulate.launch import describe_exit
from galaxy.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class Launch:
    world: int
    rank: Optional[int]  # None: start every rank here
    local_rank: Optional[int]
    init_method: Optional[str]  # set when the launch mode decides it (torchrun, local processes)
    emulate: Optional[Cluster] = None  # start every rank inside this emulated cluster (--emulate)
    # Local processes (--world N): where each rank sends the one line of its failure, for the launcher
    # to print once (a multiprocessing SimpleQueue); None: a rank prints its own.
    failures: Any = None

    @property
    def starts_rank_0(self) -> bool:
        """Whether rank 0, which alone writes the metrics, summaries and profiles, starts here."""
        return self.rank in (None, 0)


def decide_launch(args: argparse.Namespace) -> Launch:
    env = os.environ
    if getattr(args, "emulate", None):
        if args.rank is not None:
            raise ConfigError("--emulate starts every rank of the emulated cluster here; drop --rank")
        cluster = Cluster.from_file(args.emulate)
        try:
            cgroups.placement(cluster, cgroups.host_cpus())  # fits this machine: say so now, in one line
        except ConfigError as e:
            raise ConfigError(f"cluster file '{args.emulate}': {e}") from None
        if args.world is not None and args.world != cluster.world_size:
            raise ConfigError(f"--world {args.world} disagrees with the {cluster.world_size} ranks of the cluster file "
                              f"'{args.emulate}'; drop --world or list {args.world} ranks")
        return Launch(cluster.world_size, None, None, None, emulate=cluster)
    if args.rank is None and "RANK" in env and "WORLD_SIZE" in env:  # torchrun / SLURM-style launchers
        world = int(env["WORLD_SIZE"])
        if args.world is not None and args.world != world:
            raise ConfigError(f"--world {args.world} disagrees with WORLD_SIZE={world} from the launcher; drop --world")
        return Launch(world, int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])), "env://")
    world = args.world if args.world is not None else 1
    if world < 1:
        raise ConfigError(f"--world must be at least 1, got {world}")
    if args.rank is not None:
        if not 0 <= args.rank < world:
            raise ConfigError(f"--rank {args.rank} is outside --world {world}; use 0..{world - 1}")
        return Launch(world, args.rank, None, None)
    return Launch(world, None, None, None)



def on_devices(launch: Launch, devices: Optional[list[int]]) -> Launch:
    """A plan placed on some devices of a cluster (config key 'devices', written by the planner):
    on an emulated cluster its ranks start on those devices only; elsewhere the launch must hold
    one rank per device."""
    if devices is None:
        return launch
    if launch.emulate is not None:
        return replace(launch, world=len(devices), emulate=launch.emulate.subset(devices, "emulated cluster"))
    if launch.world != len(devices):
        raise ConfigError(f"the plan runs on the {len(devices)} devices {devices} (config key 'devices'), but this "
                          f"launch has {launch.world} ranks; start {len(devices)} ranks, one on each of those devices")
    return launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def _child(fn, rank: int, launch: Launch, payload) -> None:
    code = run_rank(fn, rank, launch, payload)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not change the exit code
            pass
    # The end-of-process cleanup multiprocessing runs after a target returns (its finalizers unlink the
    # semaphores this rank created, e.g. tqdm's lock), which os._exit would skip.
    multiprocessing.util._exit_function()
    # Skips finalization, where a Gloo worker thread can abort ("terminate called without an active exception")
    os._exit(code)



def run_rank(fn, rank: int, launch: Launch, payload) -> int:
    """Run one rank, turning expected failures into one line: bad input (``UserError``, a missing
    file) exits with code 2, another expected failure with 1 (see ``report_failure``). On an
    emulated cluster under ``cpu_emulation`` "dilate" its ops are stretched to the rank's share."""
    try:
        from galaxy.emulate.slowdown import slowdown_from_env, slowed_compute  # imports torch: ranks only

        with slowed_compute(slowdown_from_env()):
            fn(rank, launch, payload)
        return 0
    except (UserError, FileNotFoundError) as e:
        return report_failure(rank, launch, e, user=True)
    except (ValueError, RuntimeError, FloatingPointError) as e:
        return report_failure(rank, launch, e, user=False)



# The longest failure line sent to the launcher: a pipe write up to PIPE_BUF (4096 bytes) is atomic.
_REPORT_CHARS = 1000


def report_failure(rank: int, launch: Launch, error: BaseException, user: bool) -> int:
    """The exit code of a rank that failed with ``error`` (2 for bad input, else 1), after its one
    line: sent to the local launcher that started it, which prints one line for the whole run, or
    printed here (``error: ...`` when this process is the whole run, else naming the rank)."""
    text = str(error) or type(error).__name__
    if user:  # bad input is one line by contract
        text = " ".join(text.split("\n"))
    if launch.failures is not None:
        launch.failures.put((rank, user, text[:_REPORT_CHARS]))
    elif user and launch.rank is None:
        print(f"error: {text}", file=sys.stderr, flush=True)
    else:
        print(f"error (rank {rank}): {text}", file=sys.stderr, flush=True)
    return 2 if user else 1



def launch_ranks(fn: Callable, launch: Launch, payload, cfg: GalaxyConfig) -> int:
    """Start ``fn(rank, launch, payload)`` for the ranks this process is responsible for."""
    if launch.emulate is not None:
        return launch_emulated(launch)
    if launch.rank is not None:
        return run_rank(fn, launch.rank, launch, payload)
    if launch.world == 1:
        return run_rank(fn, 0, launch, payload)
    init = cfg.distributed.init_method
    launch.init_method = init if init.startswith("tcp://") else f"tcp://127.0.0.1:{free_port()}"
    spawn = multiprocessing.get_context("spawn")
    launch.failures = spawn.SimpleQueue()
    procs = [spawn.Process(target=_child, args=(fn, r, launch, payload), name=f"rank{r}")
             for r in range(launch.world)]
    for p in procs:
        p.start()
    failed = first_failure(procs)
    while failed is None and any(p.is_alive() for p in procs):
        time.sleep(0.1)
        failed = first_failure(procs)
    if failed is not None:
        code = procs[failed].exitcode  # read before the others are stopped, for the report
        running = [p for p in procs if p.is_alive()]
        for p in running:
            p.terminate()
        for p in procs:
            p.join()
        reports = []  # (rank, bad input?, line), in the order the ranks sent them
        while not launch.failures.empty():
            reports.append(launch.failures.get())
        bad = [text for _, user, text in reports if user]
        if bad:  # bad input: the same line whichever rank found it, once, as before any rank starts
            print(f"error: {bad[0]}", file=sys.stderr)
            return 2
        for rank, _, text in reports:
            if rank == failed:
                print(f"error (rank {rank}): {text}", file=sys.stderr)
        print(f"error: rank {failed} {describe_exit(code)}; "
              f"{'the other ranks were stopped' if running else 'the other ranks have ended'}", file=sys.stderr)
        return 1
    for p in procs:
        p.join()
    return 0



def launch_emulated(launch: Launch) -> int:
    """This command once per rank of the emulated cluster, each in its namespace and cgroup; the ranks
    read RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment the emulator gives them."""
    argv, own = [], sys.argv[1:]
    skip = False
    for arg in own:  # every flag of this command but --emulate
        if skip:
            skip = False
        elif arg == "--emulate":
            skip = True
        elif not arg.startswith("--emulate="):
            argv.append(arg)
    code = run_emulated(launch.emulate, lambda rank: [sys.executable, sys.argv[0], *argv])
    if code:
        print(f"error: the emulated run failed (exit code {code}); the rank that failed is named above",
              file=sys.stderr)
    return 1 if code else 0


def first_failure(procs) -> Optional[int]:
    """The rank to blame among the processes that ended badly: one killed by a signal (its peers'
    errors follow from it), else the lowest; None while none has."""
    ended = [(p.exitcode >= 0, r) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    return min(ended)[1] if ended else None



def rank_context(rank: int, launch: Launch, cfg: GalaxyConfig, log_level: str):
    """This rank's ParallelContext (dp/pp/mp groups from the config); local processes share the cores."""
    import torch

    from galaxy.core.context import ParallelContext

    if launch.rank is None and launch.world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world))
    setup_logging(log_level)
    dist_cfg = replace(cfg.distributed, init_method=launch.init_method or cfg.distributed.init_method)
    par = cfg.parallel
    return ParallelContext.initialize(dist_cfg, rank, launch.world, cfg.train.device, seed=cfg.train.seed,
                                      local_rank=launch.local_rank, dp_size=par.dp_size, pp_size=par.pp_size,
                                      stage_layers=cfg.stage_layers())



def train_from_args(model, batch_at, cfg: GalaxyConfig, ctx, args: RunOptions, eval_at=None):
    """The shared loop with the run's options (metrics, profiling, checkpoints, evaluation on the
    held-out batches of ``eval_at``); rank 0 prints the step profile when one was asked for. A
    failure caused by a dead peer rank comes back from ``train`` as a ``RankFailure`` that names it."""
    from galaxy.train.loop import train

    def resumed(path: str, step: int) -> None:
        if ctx.rank == 0:
            print(f"resuming from checkpoint '{path}' at step {step} of {cfg.train.max_steps}", flush=True)

    result = train(model, batch_at, cfg, ctx, metrics_file=args.metrics_file, progress=not args.no_progress,
                   profile_step=args.profile_step, profile_json=args.profile_json, save_dir=args.save_dir,
                   save_every=args.save_every, resume=resume_path(args), keep_last=args.keep_last, eval_at=eval_at,
                   tensorboard_dir=args.tensorboard, peak_tflops=args.peak_tflops, on_resume=resumed)
    if ctx.rank == 0 and result.profile_report is not None:
        print(result.profile_report, flush=True)
    return result
