"""Training checkpoints: atomic, checksummed, plan-independent, pickle-free.

One directory per step, ``<save_dir>/step_000005/``::

    model.safetensors      every parameter in FULL (unsharded) shape, by name
    optimizer.safetensors  the optimizer's per-parameter state in full shape, ``<name>::<key>``
    state.json             step, data position, LR schedule, optimizer hyper-parameters, config, extra
    rng.json               every rank's RNG states (torch CPU, CUDA, ParallelContext dropout streams)
    manifest.json          written last: size and sha256 of each file above, step, world, plan

Because tensors are stored whole and by name, a checkpoint saved under one plan and world size
(Galaxy on 2 ranks) loads under any other (TP on 3 ranks with uneven splits, serial, a pipeline):
each rank slices what it holds with its parameter's ``shard_spec``. Batches are a pure function of
the step, so the data position is the step.

Atomicity: global rank 0 writes the files into ``step_000005.tmp-<nonce>/``, fsyncs them and the
directory, renames it to ``step_000005/`` and then writes ``manifest.json`` through a temporary
file + fsync + rename. A checkpoint is valid only with a manifest whose sizes and checksums
match, so a crash (or ``kill -9``) at any point of a save leaves the previous checkpoint the newest
valid one. Every rank takes part in the save (the tensors are gathered over the model-parallel and
pipeline groups; ZeRO-1's optimizer states, each held by one dp rank, over the data-parallel group
first) and learns whether rank 0's write succeeded. So a ``dp_engine: zero1`` checkpoint is the
same as a ``ddp`` one and either loads under the other.

Nothing is ever unpickled: tensors are read with safetensors, the rest is JSON. Loading assumes
every rank sees the checkpoint directory (a shared file system or a copy on each node).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from galaxy.core.context import ParallelContext
from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import shard_spec

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
RNG_FILE = "rng.json"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = (MODEL_FILE, OPTIM_FILE, STATE_FILE, RNG_FILE)
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_DIR = re.compile(r"^step_\d+\.(tmp|old)-[0-9a-f]+$")
# Optimizer hyper-parameters restored from the checkpoint; implementation flags (fused, foreach,
# capturable, ...) stay those of the optimizer being loaded into, which may run on another device.
RESTORED_GROUP_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad")
_SEP = "::"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the fix."""


@dataclass
class CheckpointState:
    """What ``load_checkpoint`` returns: the step the checkpoint was taken after (the next step to
    run is ``step``, 0-based, so ``train`` continues with ``range(step, max_steps)``) and ``extra``."""

    step: int
    path: str
    extra: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ----------------------------------------------------------------------------- collectives over the ctx world
#
# A ParallelContext's world is the union of its mp, pp and dp groups (in the test pool it is not the
# default process group), so world-wide operations run group by group: mp, then pp, then dp.


def _comms(ctx: ParallelContext):
    return [c for c in (ctx.mp, ctx.pp, ctx.dp) if c.size > 1]


def _world_sum(ctx: ParallelContext, value: float) -> float:
    """The sum of ``value`` over every rank of the context (also a barrier)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    for comm in _comms(ctx):
        t = comm.all_reduce(t)
    return float(t.item())


def _gather_bytes(comm, payloads: list[bytes], device: torch.device) -> list[bytes]:
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


def _gather_world_json(ctx: ParallelContext, record: dict) -> list[dict]:
    """Every rank's ``record`` in global rank order ``(dp * pp_size + pp) * mp_size + mp``
    (JSON over byte tensors: no pickle). Complete on global rank 0."""
    payloads = [json.dumps(record).encode()]
    for comm in (ctx.mp, ctx.pp, ctx.dp):  # innermost first, so the flattened order is the global one
        payloads = _gather_bytes(comm, payloads, ctx.device)
    return [json.loads(p) for p in payloads]


def _gather_stages(ctx: ParallelContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union over pipeline stages of name -> full CPU tensor, through safetensors bytes."""
    if ctx.pp.size == 1:
        return tensors
    from safetensors.torch import load as st_load, save as st_save

    merged: dict[str, torch.Tensor] = {}
    for blob in _gather_bytes(ctx.pp, [st_save({k: v.contiguous() for k, v in tensors.items()})], ctx.device):
        merged.update(st_load(blob))
    return merged


# ----------------------------------------------------------------------------- what goes in


def _is_zero(optimizer) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states: ZeroRedundancyOptimizer (``dp_engine: zero1``)
    keeps the states of the parameters its dp rank owns in its local optimizer ``optim``."""
    return optimizer.optim if _is_zero(optimizer) else optimizer


def _check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer) or (
            _is_zero(optimizer) and not isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer)):
        raise CheckpointError(f"checkpoints support a torch optimizer (AdamW, or ZeroRedundancyOptimizer over one), "
                              f"not {type(optimizer).__name__}; use dp_engine 'ddp' or 'zero1' for runs that save "
                              "checkpoints")


def _non_tensor_state(name: str, state: dict) -> Optional[str]:
    for key, value in state.items():
        if not torch.is_tensor(value):
            return (f"optimizer state '{name}' key '{key}' is a {type(value).__name__}, not a tensor; only tensor "
                    "optimizer states can be saved")
    return None


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"optimizer state has an unknown dtype '{name}'")
    return dtype


def _param_states(model: nn.Module, optimizer: torch.optim.Optimizer,
                  ctx: ParallelContext) -> dict[str, dict[str, torch.Tensor]]:
    """``param name -> {state key: tensor}`` of this rank's (mp shard of the) optimizer state.

    ZeRO-1 keeps each parameter's state on the one dp rank that owns it: the owners announce
    what they hold (names, shapes, dtypes as JSON) and broadcast each tensor over the dp group,
    so every dp rank returns the same complete state, as a ddp rank would (a collective over dp)."""
    local = _local_optimizer(optimizer)
    params = list(model.named_parameters())
    mine = {name: local.state[p] for name, p in params if local.state.get(p)}
    problem = next((m for m in (_non_tensor_state(n, st) for n, st in mine.items()) if m), None)
    if not _is_zero(optimizer) or ctx.dp.size == 1:
        if problem:
            raise CheckpointError(problem)
        return {name: {k: v.detach() for k, v in st.items()} for name, st in mine.items()}
    announced = {"problem": problem, "held": {} if problem else {
        name: {k: [list(v.shape), str(v.dtype)] for k, v in st.items()} for name, st in mine.items()}}
    per_rank = [json.loads(b) for b in _gather_bytes(ctx.dp, [json.dumps(announced).encode()], ctx.device)]
    problems = [a["problem"] for a in per_rank if a["problem"]]
    if problems:  # raised on every dp rank alike, none left waiting in a broadcast
        raise CheckpointError(problems[0])
    per_rank = [a["held"] for a in per_rank]
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, _ in params:  # the same order on every dp rank
        owners = [r for r, held in enumerate(per_rank) if name in held]
        if not owners:
            continue  # no state yet (never stepped, or frozen)
        if len(owners) > 1:
            raise CheckpointError(f"optimizer state of '{name}' is held by dp ranks {owners}; ZeRO-1 gives each "
                                  "parameter one owner, so the dp ranks' optimizers disagree")
        owner = owners[0]
        out[name] = {}
        for key, (shape, dtype) in sorted(per_rank[owner][name].items()):
            if owner == ctx.dp.rank:
                value = mine[name][key].detach().to(ctx.device)  # e.g. AdamW's CPU 'step' on a GPU rank
            else:
                value = torch.empty(shape, dtype=_dtype(dtype), device=ctx.device)
            out[name][key] = ctx.dp.broadcast(value, src=owner)
    return out


def _full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                          ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """``<param name>::<state key>`` -> full-shape CPU tensor (a collective over dp for ZeRO-1, then
    over mp). A tensor of the parameter's shape is gathered like the parameter; scalars (``step``)
    are taken as they are."""
    params = list(model.named_parameters())
    states = _param_states(model, optimizer, ctx)
    has = torch.tensor([1.0 if states.get(name) else 0.0 for name, _ in params], dtype=torch.float64,
                       device=ctx.device)
    if ctx.mp.size > 1:
        has = ctx.mp.all_reduce(has)
    out: dict[str, torch.Tensor] = {}
    for (name, p), count in zip(params, has.tolist()):
        if count == 0:
            continue  # no state yet (never stepped, or frozen)
        if count != ctx.mp.size:
            raise CheckpointError(f"optimizer state of '{name}' exists on only some model-parallel ranks; "
                                  "save after a complete optimizer step")
        for key, value in sorted(states[name].items()):
            if value.shape == p.shape and value.dim() > 0:
                value = gather_full(value, p, ctx.mp)
            out[f"{name}{_SEP}{key}"] = value.cpu().contiguous()
    return out


def _jsonable(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def _param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    names = {p: n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        saved = {k: _jsonable(group[k]) for k in RESTORED_GROUP_KEYS if k in group}
        saved["params"] = [names.get(p, "?") for p in group["params"]]
        groups.append(saved)
    return groups


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_record(ctx: ParallelContext) -> dict:
    """This rank's RNG states, JSON-ready (byte states as base64)."""
    version, internal, gauss = random.getstate()
    rec = {"rank": ctx.rank, "coords": list(ctx.coords), "torch_cpu": _b64(torch.get_rng_state()),
           "cuda": None, "python_random": [version, list(internal), gauss],
           "generators": {key: _b64(g.get_state()) for key, g in sorted(ctx._generators.items())}}
    if ctx.device.type == "cuda":
        rec["cuda"] = _b64(torch.cuda.get_rng_state(ctx.device))
    return rec


def _layout(ctx: ParallelContext) -> dict:
    return {"world_size": ctx.world_size, "dp": ctx.dp.size, "pp": ctx.pp.size, "mp": ctx.mp.size}


# ----------------------------------------------------------------------------- file system helpers


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: str, data: bytes) -> dict:
    """Write, flush and fsync ``data``; returns its manifest entry."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _write_checkpoint_files(tmp: str, files: dict[str, bytes]) -> dict[str, dict]:
    entries = {}
    for name, data in files.items():
        entries[name] = _write_bytes(os.path.join(tmp, name), data)
    return entries


def _publish(tmp: str, final: str, manifest: dict) -> None:
    """Rename the finished temporary directory to its final name, then write the manifest."""
    parent = os.path.dirname(final)
    _fsync_dir(tmp)
    aside = None
    if os.path.exists(final):  # re-saving a step (e.g. after resuming from an older one)
        aside = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(parent)
    part = os.path.join(final, f"{MANIFEST_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    _write_bytes(part, _json_bytes(manifest))
    os.rename(part, os.path.join(final, MANIFEST_FILE))
    _fsync_dir(final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# ----------------------------------------------------------------------------- save


def save_checkpoint(directory: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, ctx: ParallelContext, cfg, extra: Optional[dict] = None,
                    keep_last: Optional[int] = None) -> str:
    """Save the state after ``step`` optimizer steps to ``directory/step_<step>/``; returns its path.

    A collective: every rank of ``ctx`` must call it. Global rank 0 writes; every rank returns
    only after the checkpoint is complete (or raises ``CheckpointError`` on every rank if the
    write failed). ``keep_last``: then keep only the newest K complete checkpoints."""
    _check_optimizer(optimizer)
    model_state = _gather_stages(ctx, {k: v.contiguous() for k, v in model.full_state_dict().items()})
    optim_state = _gather_stages(ctx, _full_optimizer_state(model, optimizer, ctx))
    rngs = _gather_world_json(ctx, rng_record(ctx))
    groups = _param_groups(model, optimizer)
    final = os.path.join(os.path.abspath(directory), step_dir_name(step))
    error = ""
    if ctx.rank == 0:
        tmp = None
        try:
            from safetensors.torch import save as st_save

            plan = getattr(model, "plan", None)
            state = {"format_version": FORMAT_VERSION, "step": step, "data_position": step,
                     "scheduler": _jsonable(scheduler.state_dict()) if scheduler is not None else None,
                     "param_groups": groups, "model_class": type(model).__name__,
                     "config": _jsonable(cfg.to_dict()) if cfg is not None else None,
                     "extra": _jsonable(extra or {})}
            files = {MODEL_FILE: st_save(model_state, metadata={"format": "pt", "step": str(step)}),
                     OPTIM_FILE: st_save(optim_state, metadata={"format": "pt", "step": str(step)}),
                     STATE_FILE: _json_bytes(state),
                     RNG_FILE: _json_bytes({"layout": _layout(ctx), "ranks": rngs})}
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
            os.makedirs(tmp)
            entries = _write_checkpoint_files(tmp, files)
            manifest = {"format_version": FORMAT_VERSION, "step": step, "files": entries, **_layout(ctx),
                        "plan": getattr(plan, "name", None),
                        "splits": None if plan is None else {"heads": list(plan.heads_split),
                                                            "ffn": list(plan.ffn_split),
                                                            "seq": list(plan.seq_split)}}
            _publish(tmp, final, manifest)
            logger.info("saved checkpoint %s (step %d, %d tensors)", final, step, len(model_state))
        except Exception as e:  # every rank must learn of it, or the others would go on without a checkpoint
            error = f"{type(e).__name__}: {e}"
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    failed = _world_sum(ctx, 1.0 if error else 0.0)
    if failed:
        raise CheckpointError(f"saving checkpoint '{final}' failed on rank 0"
                              + (f": {error}" if error else "; see rank 0's log"))
    if keep_last is not None and ctx.rank == 0:
        prune(directory, keep_last)
    return final


# ----------------------------------------------------------------------------- validation


def _read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"checkpoint '{path}' has no {MANIFEST_FILE}: the save did not complete; "
                              "resume from an older checkpoint")
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read())
        files = manifest["files"]
        int(manifest["step"])
        for name in REQUIRED_FILES:
            entry = files[name]
            int(entry["size"]), str(entry["sha256"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint manifest '{mpath}' is corrupt ({type(e).__name__}: {e}); "
                              "resume from an older checkpoint") from None
    return manifest


def _read_verified(path: str, name: str, manifest: dict) -> bytes:
    """The bytes of ``path/name`` after checking size and sha256 against the manifest."""
    fpath = os.path.join(path, name)
    entry = manifest["files"][name]
    try:
        with open(fpath, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"checkpoint file '{fpath}' cannot be read ({e})") from None
    if len(data) != int(entry["size"]):
        raise CheckpointError(f"checkpoint file '{fpath}' is truncated or altered: {len(data)} bytes, "
                              f"the manifest says {entry['size']}")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file '{fpath}' fails its sha256 checksum: the file is corrupt")
    return data


def verify_checkpoint(path: str) -> dict:
    """Check a checkpoint directory (manifest, sizes, checksums); returns its manifest or raises
    ``CheckpointError`` naming the offending file."""
    manifest = _read_manifest(path)
    for name in manifest["files"]:
        _read_verified(path, name, manifest)
    return manifest


def _step_dirs(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every ``step_N`` directory, newest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for entry in os.listdir(directory):
        m = STEP_DIR.match(entry)
        if m and os.path.isdir(os.path.join(directory, entry)):
            found.append((int(m.group(1)), os.path.join(directory, entry)))
    return sorted(found, reverse=True)


def latest_valid_checkpoint(directory: str) -> Optional[str]:
    """The newest checkpoint under ``directory`` that verifies; invalid newer ones are skipped
    with a warning. None when there is none."""
    for _, path in _step_dirs(directory):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            logger.warning("skipping invalid checkpoint: %s", e)
    return None


def prune(directory: str, keep_last: int) -> list[str]:
    """Remove all but the newest ``keep_last`` complete checkpoints (a manifest whose file sizes
    match; incomplete ones newer than those are kept for inspection) and leftover temporary
    directories of interrupted saves. Returns the removed paths. Call it from one rank."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    removed, kept = [], 0
    for _, path in _step_dirs(directory):
        if kept >= keep_last:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        try:
            manifest = _read_manifest(path)
            if all(os.path.getsize(os.path.join(path, n)) == int(e["size"]) for n, e in manifest["files"].items()):
                kept += 1
        except (CheckpointError, OSError):
            pass
    for entry in os.listdir(directory) if os.path.isdir(directory) else []:
        if TMP_DIR.match(entry):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
            removed.append(os.path.join(directory, entry))
    if removed:
        logger.info("pruned %d old checkpoint(s) under %s", len(removed), directory)
    return removed


# ----------------------------------------------------------------------------- load


def resolve_checkpoint(path_or_dir: str) -> str:
    """A step directory as it is, or the newest valid checkpoint under a save directory."""
    if os.path.isfile(os.path.join(path_or_dir, MANIFEST_FILE)) or STEP_DIR.match(os.path.basename(
            os.path.normpath(path_or_dir))):
        return path_or_dir
    found = latest_valid_checkpoint(path_or_dir)
    if found is None:
        raise CheckpointError(f"no valid checkpoint under '{path_or_dir}' (looked for step_N/ directories "
                              "with a matching manifest)")
    return found


def _load_tensors(path: str, name: str, manifest: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load as st_load

    try:
        return st_load(_read_verified(path, name, manifest))
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint file '{os.path.join(path, name)}' is not a valid safetensors file "
                              f"({e})") from None


def _load_json(path: str, name: str, manifest: dict) -> dict:
    try:
        return json.loads(_read_verified(path, name, manifest))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"checkpoint file '{os.path.join(path, name)}' is not valid JSON ({e})") from None


def _local_slice(full: torch.Tensor, param: torch.Tensor, what: str, fpath: str) -> torch.Tensor:
    spec = shard_spec(param)
    expected = spec.full_shape(param.shape) if spec else tuple(param.shape)
    if tuple(full.shape) != tuple(expected):
        raise CheckpointError(f"checkpoint file '{fpath}': '{what}' has shape {tuple(full.shape)} but the model "
                              f"needs {tuple(expected)}; the checkpoint is for another model size")
    return spec.slice(full) if spec else full


def _in_model_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors saved by a model of another layout of the same architecture (e.g. LLaMA with the
    other ``fused_gate_up`` setting) under ``model``'s names and shapes."""
    convert = getattr(model, "state_from_hf", None)
    return convert(state) if callable(convert) else state


@torch.no_grad()
def load_model_weights(path: str, model: nn.Module, manifest: Optional[dict] = None) -> None:
    """Copy a checkpoint's full tensors into ``model``, each rank taking its shard (no collective).
    Every parameter of ``model`` must be in the checkpoint; a pipeline stage takes its own."""
    manifest = manifest or _read_manifest(path)
    fpath = os.path.join(path, MODEL_FILE)
    state = _in_model_layout(model, _load_tensors(path, MODEL_FILE, manifest))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint file '{fpath}' lacks {len(missing)} parameter(s) of the model, e.g. "
                              f"{missing[:3]}; the checkpoint is for another model")
    if getattr(getattr(model, "stage", None), "is_whole", True):
        unexpected = sorted(set(state) - set(params))
        if unexpected:
            raise CheckpointError(f"checkpoint file '{fpath}' holds {len(unexpected)} tensor(s) the model does not "
                                  f"have, e.g. {unexpected[:3]}; the checkpoint is for another model")
    for name, param in params.items():
        param.copy_(_local_slice(state[name], param, name, fpath))


def _load_optimizer(path: str, manifest: dict, state_json: dict, model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> None:
    """Each rank takes the states of the parameters its optimizer steps (for ZeRO-1 those its dp
    rank owns, loaded into the local optimizer) in its shard, and the saved hyper-parameters."""
    fpath = os.path.join(path, OPTIM_FILE)
    flat = _load_tensors(path, OPTIM_FILE, manifest)
    names = {p: n for n, p in model.named_parameters()}
    per_key: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        name, _, skey = key.rpartition(_SEP)
        per_key.setdefault(skey, {})[name] = value
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for skey, by_name in per_key.items():
        for name, value in _in_model_layout(model, by_name).items():
            per_param.setdefault(name, {})[skey] = value
    local = _local_optimizer(optimizer)
    index, state = 0, {}
    for group in local.param_groups:
        for p in group["params"]:
            name = names.get(p)
            if name is None:
                raise CheckpointError("the optimizer holds a parameter that is not in the model; build the "
                                      "optimizer from the model being loaded")
            saved = per_param.get(name)
            if saved:
                state[index] = {k: (_local_slice(v, p, f"{name}{_SEP}{k}", fpath) if v.dim() > 0 else v).clone()
                                for k, v in saved.items()}
            index += 1
    saved_groups = state_json.get("param_groups") or []
    current = local.state_dict()["param_groups"]
    # ZeRO-1's local optimizer has one group (maybe empty) per group of the optimizer around it.
    if not len(saved_groups) == len(optimizer.param_groups) == len(current):
        raise CheckpointError(f"checkpoint file '{os.path.join(path, STATE_FILE)}' has {len(saved_groups)} "
                              f"optimizer parameter groups but the optimizer has {len(optimizer.param_groups)}")
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


def _restore_rng(path: str, manifest: dict, ctx: ParallelContext, step: int) -> None:
    rng = _load_json(path, RNG_FILE, manifest)
    ranks = rng.get("ranks") or []
    try:
        if rng.get("layout") == _layout(ctx) and len(ranks) == ctx.world_size:
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
        if "sharded" in ctx._generators or "sharded" in first["generators"]:
            ctx.generator(sharded=True).manual_seed((ctx.seed * 1_000_003 + ctx.mp.rank + 1 + step * 7_919) % 2**63)
        if ctx.rank == 0:
            logger.warning("checkpoint '%s' was saved with layout %s, this run is %s: the replicated RNG streams "
                           "were restored, the per-rank dropout streams re-seeded", path, rng.get("layout"),
                           _layout(ctx))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file '{os.path.join(path, RNG_FILE)}' holds unusable RNG states "
                              f"({type(e).__name__}: {e})") from None


def load_checkpoint(path_or_dir: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                    scheduler, ctx: ParallelContext, cfg=None) -> CheckpointState:
    """Restore model, optimizer, LR schedule and RNG states from a step directory, or from the
    newest valid checkpoint under a save directory. Works across plans and world sizes. Every rank
    calls it (it ends with a check that all ranks loaded the same step). ``cfg`` is only compared:
    a different model section is logged."""
    path = resolve_checkpoint(path_or_dir)
    manifest = verify_checkpoint(path)
    state_json = _load_json(path, STATE_FILE, manifest)
    step = int(state_json["step"])
    load_model_weights(path, model, manifest)
    if optimizer is not None:
        _check_optimizer(optimizer)
        _load_optimizer(path, manifest, state_json, model, optimizer)
    if scheduler is not None and state_json.get("scheduler") is not None:
        scheduler.load_state_dict(state_json["scheduler"])
    _restore_rng(path, manifest, ctx, step)
    saved_cfg = state_json.get("config") or {}
    if cfg is not None and saved_cfg.get("model") and saved_cfg["model"] != _jsonable(cfg.to_dict()["model"]) \
            and ctx.rank == 0:
        logger.warning("checkpoint '%s' was saved with another model config section; the weights fit, going on",
                       path)
    if _world_sum(ctx, step) != step * ctx.world_size:
        raise CheckpointError(f"ranks loaded different checkpoints (this rank: '{path}'); pass --resume PATH "
                              "or make the save directory the same on every rank")
    logger.info("loaded checkpoint %s (step %d, saved by %s)", path, step,
                {k: manifest.get(k) for k in ("world_size", "dp", "pp", "mp", "plan")})
    return CheckpointState(step=step, path=path, extra=state_json.get("extra") or {}, config=saved_cfg)


# ----------------------------------------------------------------------------- HF export


def export_hf(checkpoint: str, out_dir: str) -> str:
    """Write a checkpoint's model as a HF directory (config.json + model.safetensors), built serially."""
    from galaxy.config import GalaxyConfig
    from galaxy.models.bert import BertForMaskedLM, BertForSequenceClassification
    from galaxy.models.llama import LlamaForCausalLM

    path = resolve_checkpoint(checkpoint)
    manifest = verify_checkpoint(path)
    state_json = _load_json(path, STATE_FILE, manifest)
    classes = {c.__name__: c for c in (BertForMaskedLM, BertForSequenceClassification, LlamaForCausalLM)}
    cls = classes.get(state_json.get("model_class"))
    if cls is None or not state_json.get("config"):
        raise CheckpointError(f"checkpoint file '{os.path.join(path, STATE_FILE)}' names model class "
                              f"'{state_json.get('model_class')}', which cannot be exported to HF; use one of "
                              f"{', '.join(classes)}")
    cfg = GalaxyConfig.from_dict(state_json["config"])
    model = cls(cfg.model, None, ParallelContext.serial(), seed=0)
    load_model_weights(path, model, manifest)
    model.save_pretrained(out_dir)
    return out_dir
