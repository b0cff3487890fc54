"""What a checkpoint holds besides tensors, as JSON (step, LR schedule, optimizer hyper-parameters, RNG
states, config), and the few collectives a save or load needs over a ParallelContext's world.

A ParallelContext's world is the union of its mp, pp and dp groups (in the test pool it is not the
default process group), so world-wide operations run group by group: mp, then pp, then dp. Records
travel as JSON in byte tensors: nothing is pickled."""

from __future__ import annotations

import base64
import json
import logging
import os
import random
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from galaxy.core.context import ParallelContext
from galaxy.train.checkpoint.files import RNG_FILE, CheckpointError, read_json

logger = logging.getLogger(__name__)

# Optimizer hyper-parameters restored from the checkpoint; implementation flags (fused, foreach,
# capturable, ...) stay those of the optimizer being loaded into, which may run on another device.
RESTORED_GROUP_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad")


# ----------------------------------------------------------------------------- collectives over the ctx world


def _comms(ctx: ParallelContext):
    return [c for c in (ctx.mp, ctx.pp, ctx.dp) if c.size > 1]


def world_sum(ctx: ParallelContext, value: float) -> float:
    """The sum of ``value`` over every rank of the context (also a barrier)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    for comm in _comms(ctx):
        t = comm.all_reduce(t)
    return float(t.item())


def gather_bytes(comm, payloads: list[bytes], device: torch.device) -> list[bytes]:
    """All-gather over ``comm`` of this rank's list of byte strings (flattened in rank order)."""
    if comm.size == 1:
        return payloads
    blob = json.dumps([base64.b64encode(p).decode() for p in payloads]).encode()
    n = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    sizes = [int(s) for s in comm.all_gather(n, 0, [1] * comm.size).tolist()]
    local = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
    gathered = comm.all_gather(local, 0, sizes).cpu().numpy().tobytes()
    out, offset = [], 0
    for s in sizes:
        out.extend(base64.b64decode(p) for p in json.loads(gathered[offset:offset + s]))
        offset += s
    return out


def gather_world_json(ctx: ParallelContext, record: Any) -> list:
    """Every rank's ``record`` in global rank order ``(dp * pp_size + pp) * mp_size + mp``, on every rank."""
    payloads = [json.dumps(record).encode()]
    for comm in (ctx.mp, ctx.pp, ctx.dp):  # innermost first, so the flattened order is the global one
        payloads = gather_bytes(comm, payloads, ctx.device)
    return [json.loads(p) for p in payloads]


def layout(ctx: ParallelContext) -> dict:
    return {"world_size": ctx.world_size, "dp": ctx.dp.size, "pp": ctx.pp.size, "mp": ctx.mp.size}


def run_record(model: nn.Module, ctx: ParallelContext) -> dict:
    """The manifest's description of the run that saved: world layout, plan and splits."""
    plan = getattr(model, "plan", None)
    return {**layout(ctx), "plan": getattr(plan, "name", None),
            "splits": None if plan is None else {"heads": list(plan.heads_split), "ffn": list(plan.ffn_split),
                                                "seq": list(plan.seq_split)}}


def state_record(version: int, step: int, model: nn.Module, groups: list[dict], scheduler, cfg, extra) -> dict:
    """``state.json``: everything but tensors and RNG states. Batches are a pure function of the step,
    so the data position is the step."""
    return {"format_version": version, "step": step, "data_position": step,
            "scheduler": jsonable(scheduler.state_dict()) if scheduler is not None else None,
            "param_groups": groups, "model_class": type(model).__name__,
            "config": jsonable(cfg.to_dict()) if cfg is not None else None, "extra": jsonable(extra or {})}


# ----------------------------------------------------------------------------- optimizers


def is_zero(optimizer) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states: ZeroRedundancyOptimizer (``dp_engine: zero1``)
    keeps the states of the parameters its dp rank owns in its local optimizer ``optim``."""
    return optimizer.optim if is_zero(optimizer) else optimizer


def check_optimizer(optimizer) -> None:
    if callable(getattr(optimizer, "checkpoint_state_regions", None)):
        return  # an optimizer that says where its states lie (galaxy.train.checkpoint.regions)
    if not isinstance(optimizer, torch.optim.Optimizer) or (
            is_zero(optimizer) and not isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer)):
        raise CheckpointError(f"checkpoints support a torch optimizer (AdamW, or ZeroRedundancyOptimizer over one), "
                              f"not {type(optimizer).__name__}; use dp_engine 'ddp' or 'zero1' for runs that save "
                              "checkpoints")


def non_tensor_state(name: str, state: dict):
    """The problem with a parameter's optimizer state that holds something other than tensors, or None."""
    for key, value in state.items():
        if not torch.is_tensor(value):
            return (f"optimizer state '{name}' key '{key}' is a {type(value).__name__}, not a tensor; only tensor "
                    "optimizer states can be saved")
    return None


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"checkpoint names an unknown dtype '{name}'")
    return dtype


def jsonable(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    names = {p: n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        saved = {k: jsonable(group[k]) for k in RESTORED_GROUP_KEYS if k in group}
        saved["params"] = [names.get(p, "?") for p in group["params"]]
        groups.append(saved)
    return groups


def install_optimizer_state(optimizer: torch.optim.Optimizer, local: torch.optim.Optimizer,
                            state: dict[int, dict[str, torch.Tensor]], saved_groups: list[dict], where: str) -> None:
    """Load ``state`` (index in ``local``'s parameter order -> state tensors in this rank's shape) and
    the saved hyper-parameters into ``local`` (``optimizer`` itself, or ZeRO's local optimizer)."""
    current = local.state_dict()["param_groups"]
    if len(optimizer.param_groups) != len(current):  # ZeRO-1's local optimizer: one group per outer group
        raise CheckpointError(f"checkpoint file '{where}': the optimizer's {len(optimizer.param_groups)} parameter "
                              f"groups do not match its local optimizer's {len(current)}")
    if len(saved_groups) != len(current):
        # Engines group the same parameters differently (FSDP's DTensor shards in groups of their own): each
        # group takes the hyper-parameters of the saved group with its weight decay.
        by_decay = {saved.get("weight_decay"): saved for saved in saved_groups}
        missing = [g.get("weight_decay") for g in current if g.get("weight_decay") not in by_decay]
        if missing:
            raise CheckpointError(f"checkpoint file '{where}' has {len(saved_groups)} optimizer parameter groups, "
                                  f"none with weight_decay {missing[0]}; the optimizer has {len(current)}")
        saved_groups = [by_decay[g.get("weight_decay")] for g in current]
    groups = []
    for cur, outer, saved in zip(current, optimizer.param_groups, saved_groups):
        g = dict(cur)
        for k in RESTORED_GROUP_KEYS:
            if k in saved and k in g:
                g[k] = tuple(saved[k]) if isinstance(g[k], tuple) else saved[k]
            if local is not optimizer and k in saved and k in outer:
                # ZeRO's own groups are the ones the LR schedule drives (copied to ``optim`` each step)
                outer[k] = tuple(saved[k]) if isinstance(outer[k], tuple) else saved[k]
        groups.append(g)
    local.load_state_dict({"state": state, "param_groups": groups})


def restore_scheduler(scheduler, saved: dict, where: str) -> None:
    """Load a saved LR schedule; one saved with another number of optimizer groups (another engine's
    grouping, ``install_optimizer_state``) carries over when its groups shared one schedule, as Galaxy's do."""
    groups = len(scheduler.optimizer.param_groups)
    saved = dict(saved)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        values = saved.get(key)
        if isinstance(values, list) and values and len(values) != groups:
            if any(v != values[0] for v in values):
                raise CheckpointError(f"checkpoint file '{where}' holds an LR schedule of {len(values)} groups that "
                                      f"differ ({key} {values}); the optimizer has {groups} groups")
            saved[key] = [values[0]] * groups
    scheduler.load_state_dict(saved)


# ----------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_record(ctx: ParallelContext) -> dict:
    """This rank's RNG states, JSON-ready (byte states as base64)."""
    version, internal, gauss = random.getstate()
    rec = {"rank": ctx.rank, "coords": list(ctx.coords), "torch_cpu": _b64(torch.get_rng_state()),
           "cuda": None, "python_random": [version, list(internal), gauss],
           "generators": {key: _b64(g.get_state()) for key, g in sorted(ctx.generators.items())}}
    if ctx.device.type == "cuda":
        rec["cuda"] = _b64(torch.cuda.get_rng_state(ctx.device))
    return rec


def restore_rng(path: str, manifest: dict, ctx: ParallelContext, step: int) -> None:
    rng = read_json(path, RNG_FILE, manifest)
    ranks = rng.get("ranks") or []
    try:
        if rng.get("layout") == layout(ctx) and len(ranks) == ctx.world_size:
            mine = ranks[ctx.rank]
            torch.set_rng_state(_unb64(mine["torch_cpu"]))
            if ctx.device.type == "cuda" and mine.get("cuda"):
                torch.cuda.set_rng_state(_unb64(mine["cuda"]), ctx.device)
            version, internal, gauss = mine["python_random"]
            random.setstate((version, tuple(internal), gauss))
            for key, state in mine["generators"].items():
                ctx.generator(sharded=(key == "sharded")).set_state(_unb64(state))
            return
        # Another world or layout: restore what every rank shares, re-seed the per-rank streams.
        first = ranks[0]
        torch.set_rng_state(_unb64(first["torch_cpu"]))
        if ctx.device.type == "cuda" and first.get("cuda"):
            torch.cuda.set_rng_state(_unb64(first["cuda"]), ctx.device)
        if "replicated" in first["generators"]:
            ctx.generator(sharded=False).set_state(_unb64(first["generators"]["replicated"]))
        if "sharded" in ctx.generators or "sharded" in first["generators"]:
            ctx.generator(sharded=True).manual_seed((ctx.seed * 1_000_003 + ctx.mp.rank + 1 + step * 7_919) % 2**63)
        if ctx.rank == 0:
            logger.warning("checkpoint '%s' was saved with layout %s, this run is %s: the replicated RNG streams "
                           "were restored, the per-rank dropout streams re-seeded", path, rng.get("layout"),
                           layout(ctx))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file '{os.path.join(path, RNG_FILE)}' holds unusable RNG states "
                              f"({type(e).__name__}: {e})") from None
