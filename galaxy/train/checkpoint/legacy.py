"""Format 1 checkpoints (before sharded checkpoints): every tensor in FULL shape, gathered on global rank 0.

One directory per step::

    model.safetensors      every parameter in full (unsharded) shape, by name
    optimizer.safetensors  the optimizer's per-parameter state in full shape, ``<name>::<key>``
    state.json, rng.json   as in format 2
    manifest.json          written last: size and sha256 of each file above, step, world, plan

The reader stays so that format 1 checkpoints still load (and export). The writer is kept only as the
reference the memory test compares the sharded writer with (its rank 0 holds the whole model and
optimizer state); ``save_checkpoint`` writes format 2.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
import torch.nn as nn

from galaxy.core.context import ParallelContext
from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import shard_spec
from galaxy.train.checkpoint.files import (RNG_FILE, STATE_FILE, CheckpointError, json_bytes, new_tmp_dir, publish,
                                           read_verified, step_dir_name, write_bytes)
from galaxy.train.checkpoint.state import (check_optimizer, gather_bytes, gather_world_json, install_optimizer_state,
                                           is_zero, layout, local_optimizer, non_tensor_state, param_groups,
                                           parse_dtype, rng_record, run_record, state_record, world_sum)

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
_SEP = "::"


# ----------------------------------------------------------------------------- writer (reference only)


def _gather_stages(ctx: ParallelContext, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The union over pipeline stages of name -> full CPU tensor, through safetensors bytes."""
    if ctx.pp.size == 1:
        return tensors
    from safetensors.torch import load as st_load, save as st_save

    merged: dict[str, torch.Tensor] = {}
    for blob in gather_bytes(ctx.pp, [st_save({k: v.contiguous() for k, v in tensors.items()})], ctx.device):
        merged.update(st_load(blob))
    return merged


def _param_states(model: nn.Module, optimizer: torch.optim.Optimizer,
                  ctx: ParallelContext) -> dict[str, dict[str, torch.Tensor]]:
    """``param name -> {state key: tensor}`` of this rank's (mp shard of the) optimizer state.

    ZeRO-1 keeps each parameter's state on the one dp rank that owns it: the owners announce
    what they hold (names, shapes, dtypes as JSON) and broadcast each tensor over the dp group,
    so every dp rank returns the same complete state, as a ddp rank would (a collective over dp)."""
    local = local_optimizer(optimizer)
    params = list(model.named_parameters())
    mine = {name: local.state[p] for name, p in params if local.state.get(p)}
    problem = next((m for m in (non_tensor_state(n, st) for n, st in mine.items()) if m), None)
    if not is_zero(optimizer) or ctx.dp.size == 1:
        if problem:
            raise CheckpointError(problem)
        return {name: {k: v.detach() for k, v in st.items()} for name, st in mine.items()}
    announced = {"problem": problem, "held": {} if problem else {
        name: {k: [list(v.shape), str(v.dtype)] for k, v in st.items()} for name, st in mine.items()}}
    per_rank = [json.loads(b) for b in gather_bytes(ctx.dp, [json.dumps(announced).encode()], ctx.device)]
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
                value = torch.empty(shape, dtype=parse_dtype(dtype), device=ctx.device)
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


def save_checkpoint_v1(directory: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler, ctx: ParallelContext, cfg, extra: Optional[dict] = None) -> str:
    """Format 1: gather everything on global rank 0, which writes. A collective."""
    check_optimizer(optimizer)
    model_state = _gather_stages(ctx, {k: v.contiguous() for k, v in model.full_state_dict().items()})
    optim_state = _gather_stages(ctx, _full_optimizer_state(model, optimizer, ctx))
    rngs = gather_world_json(ctx, rng_record(ctx))
    groups = param_groups(model, optimizer)
    final = os.path.join(os.path.abspath(directory), step_dir_name(step))
    error = ""
    if ctx.rank == 0:
        tmp = None
        try:
            from safetensors.torch import save as st_save

            state = state_record(FORMAT_VERSION, step, model, groups, scheduler, cfg, extra)
            files = {MODEL_FILE: st_save(model_state, metadata={"format": "pt", "step": str(step)}),
                     OPTIM_FILE: st_save(optim_state, metadata={"format": "pt", "step": str(step)}),
                     STATE_FILE: json_bytes(state),
                     RNG_FILE: json_bytes({"layout": layout(ctx), "ranks": rngs})}
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = new_tmp_dir(final)
            os.makedirs(tmp)
            entries = {name: write_bytes(os.path.join(tmp, name), data) for name, data in files.items()}
            publish(tmp, final, {"format_version": FORMAT_VERSION, "step": step, "files": entries,
                                 **run_record(model, ctx)})
        except Exception as e:  # every rank must learn of it, or the others would go on without a checkpoint
            error = f"{type(e).__name__}: {e}"
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    failed = world_sum(ctx, 1.0 if error else 0.0)
    if failed:
        raise CheckpointError(f"saving checkpoint '{final}' failed on rank 0"
                              + (f": {error}" if error else "; see rank 0's log"))
    return final



# ----------------------------------------------------------------------------- reader


def _load_tensors(path: str, name: str, manifest: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load as st_load

    try:
        return st_load(read_verified(path, name, manifest))
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint file '{os.path.join(path, name)}' is not a valid safetensors file "
                              f"({e})") from None


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
def load_model(path: str, manifest: dict, model: nn.Module) -> None:
    """Copy a checkpoint's full tensors into ``model``, each rank taking its shard (no collective).
    Every parameter of ``model`` must be in the checkpoint; a pipeline stage takes its own."""
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


def load_optimizer(path: str, manifest: dict, state_json: dict, model: nn.Module,
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
    local = local_optimizer(optimizer)
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
    install_optimizer_state(optimizer, local, state, state_json.get("param_groups") or [],
                            os.path.join(path, STATE_FILE))


def full_tensors(path: str, manifest: dict):
    """(names, read) of the model's full tensors: ``read(names)`` -> name -> tensor, one at a time."""
    from safetensors import safe_open

    from galaxy.train.checkpoint.files import verify_file

    verify_file(path, MODEL_FILE, manifest)
    try:
        handle = safe_open(os.path.join(path, MODEL_FILE), framework="pt")
        names = list(handle.keys())
    except Exception as e:
        raise CheckpointError(f"checkpoint file '{os.path.join(path, MODEL_FILE)}' is not a valid safetensors file "
                              f"({e})") from None
    return names, lambda wanted: {n: handle.get_tensor(n) for n in wanted}
