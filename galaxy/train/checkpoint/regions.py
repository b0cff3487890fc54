"""Where this rank's model and optimizer tensors lie in the full tensors of a checkpoint.

A parameter's shard is the region its ``ShardSpec`` gives (the whole tensor when it has none). An
optimizer's states cover the regions of the tensors it steps. How an optimizer spreads its states is
its own business; the checkpoint only needs, for each tensor the local optimizer steps, the region of
which full parameter it covers (:class:`StateRegion`):

- a plain optimizer steps every parameter of the rank: the parameter's region;
- ZeRO-1 (``ZeroRedundancyOptimizer``) keeps in ``optimizer.optim`` the parameters its dp rank owns;
- an optimizer that shards its states another way (e.g. ZeRO over the model-parallel group, stepping
  slices of parameters) defines ``checkpoint_state_regions(model) -> (local optimizer, {stepped
  tensor: StateRegion})``, where each stepped tensor's states have its shape (or are 0-dim, like a step
  count) and the local optimizer's ``state``/``load_state_dict`` hold them. Saving writes those regions,
  loading reads them back in whatever regions the loading run's optimizer covers.

Full tensors are keyed ``model/<parameter name>`` and ``optim/<parameter name>/<state key>``, in the
model's own layout. A model built with another layout of the same architecture (LLaMA's
``fused_gate_up``) loads through the model's ``state_from_hf``: for a parameter missing from the
checkpoint, the tensors of its module that the model does not have are read whole, one module at a
time, converted and sliced.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

import torch
import torch.nn as nn

from galaxy.core.layers import shard_spec
from galaxy.train.checkpoint.files import CheckpointError
from galaxy.train.checkpoint.shards import Chunk, ShardReader, narrow
from galaxy.train.checkpoint.state import local_optimizer, non_tensor_state

MODEL = "model"
OPTIM = "optim"


@dataclasses.dataclass(frozen=True)
class StateRegion:
    """A tensor (a parameter's shard, or a piece an optimizer steps) starts at ``offsets`` in full
    parameter ``name`` of shape ``shape``; its sizes are the tensor's own shape."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def param_region(name: str, param: torch.Tensor) -> StateRegion:
    spec = shard_spec(param)
    if spec is None:
        return StateRegion(name, tuple(param.shape), (0,) * param.dim())
    offsets = [0] * param.dim()
    offsets[spec.dim] = spec.offset
    return StateRegion(name, tuple(spec.full_shape(param.shape)), tuple(offsets))


def model_key(name: str) -> str:
    return f"{MODEL}/{name}"


def optim_key(name: str, state_key: str) -> str:
    return f"{OPTIM}/{name}/{state_key}"


def optimizer_regions(model: nn.Module, optimizer) -> tuple[torch.optim.Optimizer, dict[torch.Tensor, StateRegion]]:
    """The optimizer holding this rank's states and the region each tensor it steps covers."""
    own = getattr(optimizer, "checkpoint_state_regions", None)
    if callable(own):
        return own(model)
    local = local_optimizer(optimizer)
    names = {p: n for n, p in model.named_parameters()}
    regions = {}
    for group in local.param_groups:
        for p in group["params"]:
            if p not in names:
                raise CheckpointError("the optimizer holds a parameter that is not in the model; build the "
                                      "optimizer from the model being saved or loaded")
            regions[p] = param_region(names[p], p)
    return local, regions


# ----------------------------------------------------------------------------- save


def model_chunks(model: nn.Module) -> list[Chunk]:
    out = []
    for name, p in model.named_parameters():
        region = param_region(name, p)
        out.append(Chunk(model_key(name), region.shape, region.offsets, p.detach()))
    return out


def optimizer_chunks(model: nn.Module, optimizer) -> tuple[list[Chunk], Optional[str]]:
    """The chunks of this rank's optimizer states, and the reason they cannot be saved (or None). A state
    of its tensor's shape covers the tensor's region; any other (a step count) is taken whole."""
    local, regions = optimizer_regions(model, optimizer)
    out = []
    for p, region in regions.items():
        state = local.state.get(p)
        if not state:
            continue  # no state yet (never stepped, or frozen)
        problem = non_tensor_state(region.name, state)
        if problem:
            return [], problem
        for key, value in sorted(state.items()):
            value = value.detach()
            if value.dim() > 0 and value.shape == p.shape:
                out.append(Chunk(optim_key(region.name, key), region.shape, region.offsets, value))
            else:
                out.append(Chunk(optim_key(region.name, key), tuple(value.shape), (0,) * value.dim(), value))
    return out, None


# ----------------------------------------------------------------------------- load


def module_of(name: str) -> str:
    """The module a layout conversion works within: ``a.mlp.gate_proj.weight`` -> ``a.mlp``."""
    return name.rsplit(".", 2)[0]


@dataclasses.dataclass
class Wanted:
    """A piece of full tensor ``name`` (of one namespace) this rank needs: the region ``region`` covers,
    of this rank's shape ``shape``, read into ``target`` (or a new tensor when None)."""

    name: str
    region: StateRegion
    shape: tuple[int, ...]
    target: Optional[torch.Tensor] = None


def _read_named(reader: ShardReader, model: nn.Module, namespace: str, wanted: list[Wanted]) \
        -> tuple[list[Optional[torch.Tensor]], set[str]]:
    """Read the pieces ``wanted`` of the parameters (namespace ``model``) or of one optimizer state
    key (namespace: that key). Returns, in ``wanted``'s order, each piece (its target filled, or a new
    tensor; None where the checkpoint has no such tensor, directly or through the model's layout
    conversion), and the saved names that conversions consumed."""
    key_of = model_key if namespace == MODEL else (lambda n: optim_key(n, namespace))
    out: list[Optional[torch.Tensor]] = [None] * len(wanted)
    direct, missing = [], defaultdict(list)
    for i, want in enumerate(wanted):
        key = key_of(want.name)
        if key not in reader.tensors:
            missing[module_of(want.name)].append(i)
            continue
        full_shape = reader.shape(key)
        if full_shape == want.region.shape and len(full_shape) > 0:
            tensor = want.target if want.target is not None else torch.empty(want.shape, dtype=reader.dtype(key))
            direct.append(Chunk(key, full_shape, want.region.offsets, tensor))
        elif namespace != MODEL:  # a state not shaped like its parameter (a step count): whole
            tensor = torch.empty(full_shape, dtype=reader.dtype(key))
            direct.append(Chunk(key, full_shape, (0,) * len(full_shape), tensor))
        else:
            raise CheckpointError(f"checkpoint '{reader.path}': '{want.name}' has shape {full_shape} but the model "
                                  f"needs {want.region.shape}; the checkpoint is for another model size")
        out[i] = tensor
    reader.read(direct)
    consumed: set[str] = set()
    convert = getattr(model, "state_from_hf", None)
    if not missing or not callable(convert):
        return out, consumed
    wanted_names = {w.name for w in wanted}
    saved = {}  # saved name -> key, in this namespace
    for key in reader.tensors:
        head, _, rest = key.partition("/")
        if namespace == MODEL and head == MODEL:
            saved[rest] = key
        elif namespace != MODEL and head == OPTIM and rest.endswith(f"/{namespace}"):
            saved[rest[: -len(namespace) - 1]] = key
    for module, indices in missing.items():  # one module's full tensors at a time
        sources = [n for n in saved if module_of(n) == module and n not in wanted_names]
        if not sources:
            continue
        full = reader.read_full([saved[n] for n in sources])
        converted = convert({n: full[saved[n]] for n in sources})
        consumed.update(sources)
        for i in indices:
            want = wanted[i]
            value = converted.get(want.name)
            if value is None:
                continue
            if value.dim() > 0 and tuple(value.shape) == want.region.shape:
                value = narrow(value, want.region.offsets, want.shape)
            elif namespace == MODEL:
                raise CheckpointError(f"checkpoint '{reader.path}': '{want.name}' has shape {tuple(value.shape)} but "
                                      f"the model needs {want.region.shape}; the checkpoint is for another model size")
            out[i] = want.target.copy_(value) if want.target is not None else value.clone()
        del full, converted
    return out, consumed


@torch.no_grad()
def load_model(reader: ShardReader, model: nn.Module) -> None:
    """Read each parameter's region into it (a pipeline stage takes its own parameters)."""
    params = dict(model.named_parameters())
    wanted = [Wanted(name, param_region(name, p), tuple(p.shape), p.detach()) for name, p in params.items()]
    got, consumed = _read_named(reader, model, MODEL, wanted)
    missing = sorted(w.name for w, value in zip(wanted, got) if value is None)
    if missing:
        raise CheckpointError(f"checkpoint '{reader.path}' lacks {len(missing)} parameter(s) of the model, e.g. "
                              f"{missing[:3]}; the checkpoint is for another model")
    if getattr(getattr(model, "stage", None), "is_whole", True):
        unexpected = sorted(k for k in reader.tensors if k.startswith(f"{MODEL}/")
                            and k[len(MODEL) + 1:] not in params and k[len(MODEL) + 1:] not in consumed)
        if unexpected:
            raise CheckpointError(f"checkpoint '{reader.path}' holds {len(unexpected)} tensor(s) the model does not "
                                  f"have, e.g. {unexpected[:3]}; the checkpoint is for another model")


@torch.no_grad()
def read_optimizer_state(reader: ShardReader, model: nn.Module, optimizer) \
        -> tuple[torch.optim.Optimizer, dict[int, dict[str, torch.Tensor]]]:
    """The local optimizer and its state (index in its parameter order -> state key -> tensor in the
    stepped tensor's shape) read from the regions it covers."""
    local, regions = optimizer_regions(model, optimizer)
    index = {p: i for i, p in enumerate(p for group in local.param_groups for p in group["params"])}
    stepped = list(regions.items())
    state_keys = sorted({k.rsplit("/", 1)[1] for k in reader.tensors if k.startswith(f"{OPTIM}/")})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for state_key in state_keys:
        wanted = [Wanted(region.name, region, tuple(p.shape)) for p, region in stepped]
        got, _ = _read_named(reader, model, state_key, wanted)
        for (p, _), value in zip(stepped, got):
            if value is not None:
                state.setdefault(index[p], {})[state_key] = value
    return local, state
