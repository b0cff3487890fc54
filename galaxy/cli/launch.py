"""Starting the ranks of a run (what is checked before any starts: ``galaxy.cli.run.prepare``).

Launch modes: under ``torchrun`` the RANK/WORLD_SIZE/LOCAL_RANK variables are used; ``--world N
--rank r`` runs one rank (rendezvous through ``init_method`` or MASTER_ADDR/MASTER_PORT, so ranks
can sit on different machines); ``--world N`` alone starts all N ranks as local processes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from galaxy.cli.args import RunOptions, resume_path
from galaxy.cli.output import LOG_FORMAT, bad_input, setup_logging
from galaxy.cli.rank_processes import Handover, leave_forkserver, rank_process_context
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
    # Local processes (--world N): where each rank sends the one line of its failure or interruption and
    # its warnings, for the launcher to print once (a multiprocessing SimpleQueue); None: a rank prints its own.
    reports: Any = None
    # A rank the local launcher started: that launcher, the process it must not outlive (its parent, or its parent's
    # parent where it was forked from the launcher's forkserver, which ends with the launcher).
    launcher_pid: Optional[int] = None
    save_dir: Optional[str] = None  # the run's checkpoints (--save_dir), locked for the run where rank 0 starts

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



# An interrupted rank's exit code, and the launcher's: 128 + SIGINT, as a shell reports Ctrl-C.
INTERRUPTED = 130
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The longest line a rank sends the launcher: a pipe write up to PIPE_BUF (4096 bytes) is atomic.
_REPORT_CHARS = 1000


def die_with_launcher(launcher_pid: Optional[int]) -> None:
    """Make this rank end when the launcher that started it ends, however it ends (``kill -9`` included), by
    watching its parent: the launcher or the forkserver the launcher started it from (``rank_processes``), which
    ends when the launcher does. On Linux the kernel sends SIGKILL when the parent dies (``PR_SET_PDEATHSIG``);
    everywhere a thread watches the parent and kills this process once it is another (``watch_launcher``). A rank
    left alone would go on training and writing checkpoints that nobody asked for (``Interrupts.check_launcher``
    stops it before a write in the moments before it dies)."""
    if launcher_pid is None:
        return
    from galaxy.train.checkpoint.lock import parent_of

    parent = os.getppid()
    killed_with_parent()  # no effect if it fails: the watch remains
    if os.getppid() != parent or launcher_pid not in (parent, parent_of(parent) or launcher_pid):
        os.kill(os.getpid(), signal.SIGKILL)  # the launcher died before the prctl above
    threading.Thread(target=watch_launcher, args=(parent,), name="galaxy-launcher-watch", daemon=True).start()


def killed_with_parent() -> None:
    """Have the kernel send this process SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere
    nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def watch_launcher(parent: int, interval_s: float = 0.5) -> None:
    """Kill this process (SIGKILL) once its parent is no longer ``parent``: the launcher died and this
    process was handed to another parent."""
    while os.getppid() == parent:
        time.sleep(interval_s)
    os.kill(os.getpid(), signal.SIGKILL)


class WarningsToLauncher(logging.Handler):
    """A local rank's warnings (and errors), sent to the launcher, which prints each once for the run: the
    same warning from every rank (``vocab_size set to ...``) is one line, not one per rank."""

    def __init__(self, reports, rank: int):
        super().__init__(logging.WARNING)
        self.reports, self.rank = reports, rank

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self.reports.put((self.rank, "log", (record.levelno, record.name, text[:_REPORT_CHARS], record.created)))
        except Exception:
            self.handleError(record)


def log_through_launcher(reports, rank: int) -> None:
    """This rank's logging: records below WARNING on its own stderr, warnings and errors (Python's
    ``warnings`` among them) to the launcher (``WarningsToLauncher``). ``setup_logging`` later sets the level."""
    root = logging.getLogger()
    local = logging.StreamHandler()
    local.setFormatter(logging.Formatter(LOG_FORMAT))
    local.addFilter(lambda record: record.levelno < logging.WARNING)
    root.addHandler(local)
    root.addHandler(WarningsToLauncher(reports, rank))
    logging.captureWarnings(True)


def _child(fn, rank: int, launch: Launch, payload, handover: Handover) -> None:
    stale = handover.take()
    leave_forkserver()
    import torch

    torch.set_num_threads(local_rank_threads(launch.world))
    die_with_launcher(launch.launcher_pid)
    log_through_launcher(launch.reports, rank)
    if stale and rank == 0:
        logger.warning("%s changed since this process's first local launch, whose rank forkserver imported torch "
                       "with the earlier values, which stay in force; they take effect in a new process",
                       ", ".join(stale))
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


def local_rank_threads(world: int) -> int:
    """Intra-op threads of a local rank: the launcher's OMP_NUM_THREADS where it sets one (as torchrun keeps
    it), else this host's cores shared among the ranks. Set in the rank itself: a rank forked from the
    forkserver would otherwise keep the thread count the forkserver's OpenMP read when it loaded."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first)
    return max(1, (os.cpu_count() or 1) // world)


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM raises KeyboardInterrupt, as SIGINT does, while a rank runs (the main thread only; the
    training loop takes both over to stop between steps); the stop signals are unblocked, which a local
    launcher blocks while it starts its ranks."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def run_rank(fn, rank: int, launch: Launch, payload) -> int:
    """Run one rank, turning expected failures into one line: bad input (``UserError``, a missing
    file) exits with code 2, another expected failure with 1 (see ``report_failure``), an interrupt
    (Ctrl-C, SIGTERM) with 130 (``report_interrupt``). On an emulated cluster under ``cpu_emulation``
    "dilate" its ops are stretched to the rank's share."""
    try:
        with sigterm_interrupts():
            from galaxy.emulate.slowdown import slowdown_from_env, slowed_compute  # imports torch: ranks only

            with slowed_compute(slowdown_from_env()):
                fn(rank, launch, payload)
        return 0
    except KeyboardInterrupt as e:
        return report_interrupt(rank, launch, e)
    except (UserError, FileNotFoundError) as e:
        return report_failure(rank, launch, e, user=True)
    except (ValueError, RuntimeError, FloatingPointError) as e:
        return report_failure(rank, launch, e, user=False)




def report_failure(rank: int, launch: Launch, error: BaseException, user: bool) -> int:
    """The exit code of a rank that failed with ``error`` (2 for bad input, else 1), after its one
    line: sent to the local launcher that started it, which prints one line for the whole run, or
    printed here (``error: ...`` when this process is the whole run, else naming the rank). A failed
    save fails every rank alike (``CheckpointError``): the run's error, printed without a rank."""
    from galaxy.train.checkpoint.files import CheckpointError

    text = str(error) or type(error).__name__
    if user:  # bad input is one line by contract
        text = " ".join(text.split("\n"))
    whole_run = user or isinstance(error, CheckpointError)
    if launch.reports is not None:
        launch.reports.put((rank, "bad_input" if user else "run_error" if whole_run else "error",
                            text[:_REPORT_CHARS]))
    elif whole_run and launch.rank is None:
        print(f"error: {text}", file=sys.stderr, flush=True)
    else:
        print(f"error (rank {rank}): {text}", file=sys.stderr, flush=True)
    return 2 if user else 1


def interrupted_line(error: KeyboardInterrupt) -> str:
    """The one line of an interrupted run: the step every rank stopped at and its checkpoint."""
    from galaxy.train.interrupts import TrainingInterrupted

    if not isinstance(error, TrainingInterrupted):
        return "interrupted before a training step ended; nothing was saved"
    if error.checkpoint is None:
        return f"interrupted at step {error.step}; no checkpoint was saved ({error.why_not}: pass --save_dir)"
    return f"interrupted at step {error.step}; checkpoint '{error.checkpoint}' saved; resume with --resume"


def interruptible(main: Callable[..., int]) -> Callable[..., int]:
    """A CLI's ``main`` whose Ctrl-C outside the ranks (while it reads its data or config, before the launch) ends
    in one line and exit code 130, as an interrupted run does, not a traceback."""
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt as e:
            print(interrupted_line(e), file=sys.stderr, flush=True)
            return INTERRUPTED

    return run


def report_interrupt(rank: int, launch: Launch, error: KeyboardInterrupt) -> int:
    """Exit code 130 for an interrupted rank, after its line: sent to the local launcher, or printed here
    by rank 0 (every rank stopped at the same step)."""
    line = interrupted_line(error)
    if launch.reports is not None:
        launch.reports.put((rank, "interrupted", line))
    elif rank == 0:
        print(line, file=sys.stderr, flush=True)
    return INTERRUPTED


def launch_ranks(fn: Callable, launch: Launch, payload, cfg: GalaxyConfig) -> int:
    """Start ``fn(rank, launch, payload)`` for the ranks this process is responsible for, holding the
    save directory's lock (``launch.save_dir``) where rank 0 starts: a second run on the same directory
    is refused (one line, exit code 2) before any of its ranks starts."""
    from galaxy.train.checkpoint.lock import SaveDirLock

    try:
        lock = SaveDirLock.acquire(launch.save_dir) if launch.save_dir and launch.starts_rank_0 else None
    except UserError as e:
        return bad_input(e)
    try:
        if launch.emulate is not None:
            return launch_emulated(launch)
        if launch.rank is not None:
            return run_rank(fn, launch.rank, launch, payload)
        if launch.world == 1:
            return run_rank(fn, 0, launch, payload)
        return launch_local(fn, launch, payload, cfg)
    finally:
        if lock is not None:
            lock.release()


class CaughtSignals:
    """SIGINT and SIGTERM sent to the launcher, noted instead of raised while it watches its ranks (the
    main thread only; elsewhere they act as usual)."""

    def __init__(self):
        self.signals: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "CaughtSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, lambda signum, frame: self.signals.append(signum))
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def launch_local(fn: Callable, launch: Launch, payload, cfg: GalaxyConfig) -> int:
    """Every rank as a local process (``--world N``), each dying with this launcher. Ctrl-C or SIGTERM
    asks every rank to stop after the step in flight, saving it (SIGTERM to each: the training loop
    takes it over); a second one kills them."""
    init = cfg.distributed.init_method
    launch.init_method = init if init.startswith("tcp://") else f"tcp://127.0.0.1:{free_port()}"
    processes = rank_process_context()
    launch.reports = processes.SimpleQueue()
    child = replace(launch, launcher_pid=os.getpid())
    with CaughtSignals() as caught:
        # Started with the stop signals blocked (a spawned rank inherits this mask, a forked one the forkserver's,
        # which blocks them too): one that comes while a rank starts up waits for its handler (sigterm_interrupts)
        # instead of printing a traceback from the middle of an import.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            procs = [processes.Process(target=_child, args=(fn, r, child, payload, Handover.from_launcher()),
                                       name=f"rank{r}")
                     for r in range(launch.world)]
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return supervise(procs, launch.reports, caught)


def supervise(procs: list, queue, caught: CaughtSignals) -> int:
    """Wait for the ranks, printing their warnings once as they come; returns the run's exit code after
    its one line: bad input (2), a failure (1: the rank to blame, the others killed), an interrupt (130)."""
    reports = RankReports()
    asked_to_stop = False
    while True:
        reports.take(queue)
        if len(caught.signals) > 1:  # asked again: stop at once
            for p in procs:
                p.kill()
            for p in procs:
                p.join()
            print("interrupted again: the ranks were killed without saving a checkpoint", file=sys.stderr)
            return INTERRUPTED
        interrupted = bool(caught.signals) or any(p.exitcode == INTERRUPTED for p in procs)
        if interrupted and not asked_to_stop:  # the first rank interrupted alone (kill -INT) stops them all
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
            asked_to_stop = True
        failed = first_failure(procs)
        if failed is not None or not any(p.is_alive() for p in procs):
            break
        time.sleep(0.1)
    code = procs[failed].exitcode if failed is not None else 0  # read before the others are stopped
    running = [p for p in procs if p.is_alive()]
    for p in running:  # SIGKILL: a rank ignores SIGTERM while it trains, stopping only between steps
        p.kill()
    for p in procs:
        p.join()
    reports.take(queue)
    return reports.verdict(failed, code, bool(running), interrupted)


class RankReports:
    """What the ranks sent the launcher (``report_failure``, ``report_interrupt``, ``WarningsToLauncher``).
    Log records are printed here as they come, as the ranks format them, each once: the n-th copy of a
    record is printed for the first rank to send its n-th copy."""

    def __init__(self):
        self.lines: list[tuple[int, str, str]] = []  # (rank, kind, line) of failures and interruptions
        self._copies: dict[tuple, dict[int, int]] = {}  # record -> rank -> copies sent
        self._format = logging.Formatter(LOG_FORMAT)

    def take(self, queue) -> None:
        while not queue.empty():
            rank, kind, payload = queue.get()
            if kind == "log":
                self._log(rank, *payload)
            else:
                self.lines.append((rank, kind, payload))

    def _log(self, rank: int, levelno: int, name: str, text: str, created: float) -> None:
        copies = self._copies.setdefault((levelno, name, text), {})
        copies[rank] = copies.get(rank, 0) + 1
        if copies[rank] > max((n for r, n in copies.items() if r != rank), default=0):
            record = logging.makeLogRecord({"name": name, "levelno": levelno, "msg": text, "created": created,
                                            "levelname": logging.getLevelName(levelno)})
            print(self._format.format(record), file=sys.stderr, flush=True)

    def first(self, kind: str) -> Optional[tuple[int, str]]:
        return next(((rank, line) for rank, k, line in self.lines if k == kind), None)

    def verdict(self, failed: Optional[int], code: int, stopped: bool, interrupted: bool) -> int:
        """Print the run's one line and return its exit code."""
        for kind, exit_code in (("bad_input", 2), ("run_error", 1)):  # the same line whichever rank found it
            found = self.first(kind)
            if found is not None:
                print(f"error: {found[1]}", file=sys.stderr)
                return exit_code
        stopped_ranks = [(rank, line) for rank, kind, line in self.lines if kind == "interrupted"]
        if stopped_ranks or (interrupted and failed is not None):  # a failure that follows from the stop is no news
            print(min(stopped_ranks)[1] if stopped_ranks else "interrupted; nothing was saved", file=sys.stderr)
            return INTERRUPTED
        if failed is None:
            return 0
        for rank, kind, line in self.lines:
            if rank == failed and kind == "error":
                print(f"error (rank {rank}): {line}", file=sys.stderr)
        print(f"error: rank {failed} {describe_exit(code)}; "
              f"{'the other ranks were stopped' if stopped else 'the other ranks have ended'}", file=sys.stderr)
        return 1


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
    """The rank to blame among the processes that ended badly (not interrupted): one killed by a signal
    (its peers' errors follow from it), else the lowest; None while none has."""
    ended = [(p.exitcode >= 0, r) for r, p in enumerate(procs) if p.exitcode not in (None, 0, INTERRUPTED)]
    return min(ended)[1] if ended else None



def rank_context(rank: int, launch: Launch, cfg: GalaxyConfig, log_level: str):
    """This rank's ParallelContext (dp/pp/mp groups from the config)."""
    from galaxy.core.context import ParallelContext

    setup_logging(log_level)
    dist_cfg = replace(cfg.distributed, init_method=launch.init_method or cfg.distributed.init_method)
    par = cfg.parallel
    return ParallelContext.initialize(dist_cfg, rank, launch.world, cfg.train.device, seed=cfg.train.seed,
                                      local_rank=launch.local_rank, dp_size=par.dp_size, pp_size=par.pp_size,
                                      stage_layers=cfg.stage_layers())



def train_from_args(model, batch_at, cfg: GalaxyConfig, ctx, args: RunOptions, eval_at=None):
    """The shared loop with the run's options (metrics, profiling, checkpoints, evaluation on the
    held-out batches of ``eval_at``); rank 0 prints the step profile when one was asked for. A
    failure caused by a dead peer rank comes back from ``train`` as a ``RankFailure`` that names it.
    Ctrl-C and SIGTERM stop every rank after the same step, saved with ``--save_dir`` (``TrainingInterrupted``);
    a rank whose launcher died (``RunOptions.launcher_pid``) writes no checkpoint."""
    from galaxy.train.interrupts import Interrupts
    from galaxy.train.loop import train

    def resumed(path: str, step: int) -> None:
        if ctx.rank == 0:
            print(f"resuming from checkpoint '{path}' at step {step} of {cfg.train.max_steps}", flush=True)

    result = train(model, batch_at, cfg, ctx, args.reporting(), args.checkpointing(resume_path(args)), eval_at=eval_at,
                   on_resume=resumed, interrupts=Interrupts(args.launcher_pid))
    if ctx.rank == 0 and result.profile_report is not None:
        print(result.profile_report, flush=True)
    return result
