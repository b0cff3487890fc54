"""Sharded checkpoints: time and peak host memory per rank to save and to resume a model sharded by TP.

    python bench/bench_checkpoint.py --preset llama-7b --world 2 --dir /tmp/ckpt --out ckpt.json
    python bench/bench_checkpoint.py --smoke                      # llama-tiny, 2 ranks, seconds

Every rank builds its shard of the model (fp32, the preset's config, plan ``--plan`` over ``--world``
ranks, CPU + Gloo: the checkpoint's work is on the host), keeps a copy of its parameters, then
``save_checkpoint`` (timed: every rank writes its shards, rank 0 commits), zeroes its parameters and
``load_checkpoint`` (timed: checks the files it reads, reads its regions), and checks every parameter
equals its copy bit for bit. With ``--optimizer`` AdamW takes one step first, so its moments are
saved and resumed too (three times the bytes). Peak memory is the growth of the process's resident
high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) over its resident size before
the save or load: what the checkpoint itself needs beyond the model the rank already holds.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import sys
import time

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.bench_coc import launch  # noqa: E402
from bench.bench_plans import git_commit  # noqa: E402
from galaxy.config import DistributedConfig, GalaxyConfig  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.models import build_model  # noqa: E402
from galaxy.train.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from galaxy.train.checkpoint.state import gather_world_json  # noqa: E402

GIB = 2**30


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measured(fn):
    """(seconds, peak resident growth in bytes) of ``fn()``."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, (_status_kib("VmHWM") - before) * 1024


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    ctx = ParallelContext.initialize(DistributedConfig(init_method=init_method, timeout_s=1800), rank, world, "cpu")
    cfg = GalaxyConfig.from_dict({"model": {"preset": args.preset}}, {"plan": args.plan})
    start = time.perf_counter()
    model = build_model(cfg, cfg.resolve_plan(world), ctx)
    build_s = time.perf_counter() - start
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if args.optimizer:
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    local_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    save_s, save_peak = measured(lambda: save_checkpoint(args.dir, 1, model, optimizer, None, ctx, cfg))
    path = os.path.join(args.dir, "step_000001")
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-4)
    load_s, load_peak = measured(lambda: load_checkpoint(path, model, fresh, None, ctx, cfg))
    exact = all(torch.equal(p, reference[name]) for name, p in model.named_parameters())
    rows = gather_world_json(ctx, {"rank": rank, "build_s": build_s, "local_param_gib": local_bytes / GIB,
                                   "save_s": save_s, "save_peak_gib": save_peak / GIB, "load_s": load_s,
                                   "load_peak_gib": load_peak / GIB, "exact": exact})
    if rank == 0:
        params = sum(p.numel() for p in reference.values())  # this rank's; the full count is in the manifest
        with open(os.path.join(path, "manifest.json")) as f:
            full = sum(torch.Size(t["shape"]).numel() for k, t in json.load(f)["tensors"].items()
                       if k.startswith("model/"))
        print(f"\n{args.preset} ({full / 1e9:.2f} B parameters), plan {args.plan} over {world} CPU ranks, "
              f"{'model + AdamW moments' if args.optimizer else 'model'}: {on_disk / GIB:.1f} GiB on disk")
        print(f"{'rank':>4}{'params GiB':>12}{'save s':>9}{'save peak GiB':>15}{'load s':>9}{'load peak GiB':>15}"
              f"{'exact':>7}")
        for r in rows:
            print(f"{r['rank']:>4}{r['local_param_gib']:>12.2f}{r['save_s']:>9.1f}{r['save_peak_gib']:>15.3f}"
                  f"{r['load_s']:>9.1f}{r['load_peak_gib']:>15.3f}{str(r['exact']):>7}")
        report = {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "torch": torch.__version__,
                  "host_cpus": os.cpu_count(), "preset": args.preset, "parameters": full, "plan": args.plan,
                  "world": world, "optimizer_states": args.optimizer, "bytes_on_disk": on_disk,
                  "local_parameters_rank0": params, "ranks": rows}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
        if not all(r["exact"] for r in rows):
            raise SystemExit("a resumed parameter differs from the saved one")
        shutil.rmtree(args.dir, ignore_errors=True)
    ctx.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-7b")
    p.add_argument("--plan", default="tp")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--optimizer", action="store_true", help="also save and resume AdamW moments")
    p.add_argument("--dir", default="/tmp/galaxy-ckpt-bench")
    p.add_argument("--smoke", action="store_true", help="llama-tiny: runs end to end in seconds")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = "llama-tiny"
    shutil.rmtree(args.dir, ignore_errors=True)
    launch(worker, args, p, on_cpu=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
