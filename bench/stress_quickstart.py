"""The README quickstart (``python pretrain_galaxy.py --world 2``) run many times: counts the failures and
keeps the log and core dumps of each failed run.

Each run works in its own directory under ``--out`` (a rank that dies of a signal leaves its core there:
core dumps are enabled for the runs, ``kernel.core_pattern`` permitting), with ``PYTHONFAULTHANDLER=1`` so a
rank killed by SIGABRT or SIGSEGV prints every thread's Python stack into the log. A passed run's directory
is removed; a failed one's is kept. ``--max_steps`` raises the chance per run of a rare fault (the same
config otherwise); ``--env KEY=VALUE`` pass through to the ranks (``MALLOC_CHECK_=3`` takes effect on glibc
2.34+ only with ``LD_PRELOAD=libc_malloc_debug.so.0``; ``LD_PRELOAD=<libasan.so>`` gives ASan's allocator, whose
checks see writes through intercepted calls). Exit code: 1 if any run failed.

    nice -n 19 python bench/stress_quickstart.py --runs 50 --stop_on_failure
    nice -n 19 python bench/stress_quickstart.py --runs 20 --jobs 2 --max_steps 2000 --env MALLOC_PERTURB_=165
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(index: int, args: argparse.Namespace) -> tuple[int, Optional[int], float, str]:
    """(index, exit code (None: killed at the timeout), seconds, why it failed) of one quickstart run in
    ``out/run_<index>``."""
    where = os.path.join(args.out, f"run_{index:04d}")
    os.makedirs(where, exist_ok=True)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_galaxy.py"), "--world", "2"]
    if args.max_steps is not None:
        cmd += ["--max_steps", str(args.max_steps)]
    env = dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONPATH=ROOT)
    env.update(kv.split("=", 1) for kv in args.env)

    def cores_on() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    start = time.monotonic()
    with open(os.path.join(where, "log.txt"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        # a session of its own: a run past the timeout is killed with its ranks
        run = subprocess.Popen(cmd, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=cores_on,
                               start_new_session=True)
        try:
            code = run.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
            code = None
    seconds = time.monotonic() - start
    with open(os.path.join(where, "log.txt"), errors="replace") as log:
        text = log.read()
    if code == 0 and "pretraining summary" in text:
        shutil.rmtree(where)
        return index, 0, seconds, ""
    if code is None:
        return index, None, seconds, f"timed out after {args.timeout_s:g} s (a busy host, or a hang: see its log)"
    errors = [line for line in text.splitlines() if "error" in line.lower() or "malloc" in line or "Fatal" in line]
    return index, code or 1, seconds, errors[-1] if errors else f"exit code {code}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--max_steps", type=int, default=None, help="default: the quickstart's 600")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for the ranks (repeatable)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "stress_quickstart"))
    parser.add_argument("--timeout_s", type=float, default=3600.0, help="a run longer than this is killed and counted apart")
    parser.add_argument("--stop_on_failure", action="store_true", help="start no run after the first that fails")
    args = parser.parse_args()
    bad = [kv for kv in args.env if "=" not in kv]
    if bad:
        parser.error(f"--env {bad[0]}: expected KEY=VALUE")
    os.makedirs(args.out, exist_ok=True)
    failures, timeouts, done = [], [], 0
    stop = threading.Event()

    def run_unless_stopped(index: int):
        return None if stop.is_set() else run_once(index, args)

    with ThreadPoolExecutor(args.jobs) as pool:
        for outcome in pool.map(run_unless_stopped, range(args.runs)):
            if outcome is None:
                continue
            index, code, seconds, why = outcome
            done += 1
            verdict = "ok" if code == 0 else f"TIMED OUT: {why}" if code is None else f"FAILED (exit {code}): {why}"
            print(f"run {index + 1}/{args.runs}: {seconds:.0f} s, {verdict}", flush=True)
            if code is None:
                timeouts.append(index)
            elif code:
                failures.append(index)
            if code != 0 and args.stop_on_failure:
                stop.set()
    kept = failures + timeouts
    print(f"{done - len(kept)} of {done} runs passed ({args.runs} asked); {len(failures)} failed, {len(timeouts)} "
          "timed out" + (f": logs and cores kept in {args.out}/run_<n> for n in {sorted(kept)}" if kept else ""),
          flush=True)
    return 1 if kept else 0


if __name__ == "__main__":
    sys.exit(main())
