"""Where this rank's model and optimizer tensors lie in the full tensors of a checkpoint.

A parameter's shard is the region its ``ShardSpec`` gives (the whole tensor when it has none). An
optimizer's states cover the regions of the tensors it steps. How an optimizer spreads its states is
its own business; the checkpoint only needs, for each tensor the local optimizer steps, the region of
which full parameter it covers (:class:`StateRegion`):

- a plain optimizer steps every parameter of the rank: the parameter's region;
- ZeRO-1 (``ZeroRedundancyOptimizer``) keeps in ``optimizer.optim`` the parameters its dp rank owns;
- FSDP (``dp_engine: fsdp2``, ``mp_grad_reduce: fsdp``; ``galaxy.core.fsdp``): a parameter and its states
  are DTensors; this rank holds a dim-0 block of them (of its TP shard, or of the whole weight), whose
  region is the TP shard's offsets plus the block's. Their local parts are saved, and loaded into, so a
  checkpoint moves between FSDP and the other engines, plans and layouts like any other;
- ``mp_grad_reduce: sharded`` (``GradReducer.shard_layout()``, passed as ``layout``): the optimizer steps
  flat pieces of buckets of weights; a piece's elements are cut into blocks (:func:`flat_blocks`), each a
  region of one full parameter (:class:`StatePiece`). Its states, and the weights themselves (the fp32
  masters live in the pieces), are saved as those regions, so they reshard to any plan or mode;
- an optimizer that shards its states another way defines ``checkpoint_state_regions(model) ->
  (local optimizer, {stepped tensor: StateRegion or [StatePiece]})``, where each stepped tensor's states
  have its shape (or are 0-dim, like a step count) and the local optimizer's ``state``/``load_state_dict``
  hold them. Saving writes those regions, loading reads them back in whatever regions the loading run's
  optimizer covers.

Full tensors are keyed ``model/<parameter name>`` and ``optim/<parameter name>/<state key>``, in the
model's own layout. A model built with another layout of the same architecture (LLaMA's
``fused_gate_up``) loads through the model's ``state_from_hf``: for a parameter missing from the
checkpoint, the tensors of its module that the model does not have are read whole, one module at a
time, converted and sliced.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Optional

import torch
import torch.nn as nn

from galaxy.core.fsdp import is_dtensor, local as local_part, local_region
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
    """Where this rank's part of ``param`` (its ``local()`` tensor) lies in the full parameter."""
    spec = shard_spec(param)
    offsets = [0] * param.dim()
    full = tuple(param.shape)
    if spec is not None:
        offsets[spec.dim] = spec.offset
        full = tuple(spec.full_shape(param.shape))
    if is_dtensor(param):  # FSDP: a block of the TP shard (whose shape is the DTensor's)
        offsets = [a + b for a, b in zip(offsets, local_region(param)[1])]
    return StateRegion(name, full, tuple(offsets))


@dataclasses.dataclass(frozen=True)
class StatePiece:
    """Elements ``[start, stop)`` of a stepped tensor (flattened, row-major) are the block of sizes
    ``sizes`` of full parameter ``region.name`` that starts at ``region.offsets``."""

    region: StateRegion
    sizes: tuple[int, ...]
    start: int
    stop: int

    @classmethod
    def whole(cls, region: StateRegion, tensor: torch.Tensor) -> "StatePiece":
        tensor = local_part(tensor)
        return cls(region, tuple(tensor.shape), 0, tensor.numel())

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of ``tensor`` (the stepped tensor or one of its states), a view when it can be."""
        if (self.start, self.stop) == (0, tensor.numel()) and tuple(tensor.shape) == self.sizes:
            return tensor
        return tensor.reshape(-1)[self.start:self.stop].view(self.sizes)


def flat_blocks(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements ``[start, stop)`` of a row-major tensor of ``shape`` as rectangular blocks
    (offsets, sizes), in order: a partial first row, whole rows, a partial last row, recursively."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last, head, tail = start // inner, stop // inner, start % inner, stop % inner

    def in_row(row, lo, hi):
        return [((row,) + offsets, (1,) + sizes) for offsets, sizes in flat_blocks(shape[1:], lo, hi)]

    if first == last:
        return in_row(first, head, tail)
    out = []
    if head:
        out += in_row(first, head, inner)
        first += 1
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])))
    if tail:
        out += in_row(last, 0, tail)
    return out


def sharded_pieces(model: nn.Module, layout: list[dict]) -> dict[torch.Tensor, list[StatePiece]]:
    """Per flat piece of ``mp_grad_reduce: sharded`` weights (``GradReducer.shard_layout()``): the
    regions of full parameters its elements hold (the zero padding of the last piece holds none)."""
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for entry in layout:
        pieces, offset = [], 0
        for p in entry["params"]:
            lo, hi = max(entry["start"], offset), min(entry["stop"], offset + p.numel())
            if p not in names:
                raise CheckpointError("the sharded weights' layout names a parameter that is not in the model; pass "
                                      "the GradReducer built for the model being saved or loaded")
            region, at = param_region(names[p], p), lo - entry["start"]
            for offsets, sizes in flat_blocks(tuple(p.shape), lo - offset, hi - offset):
                full = tuple(a + b for a, b in zip(region.offsets, offsets))
                stop = at + math.prod(sizes)
                pieces.append(StatePiece(StateRegion(region.name, region.shape, full), sizes, at, stop))
                at = stop
            offset += p.numel()
        out[entry["shard"]] = pieces
    return out


def model_key(name: str) -> str:
    return f"{MODEL}/{name}"


def optim_key(name: str, state_key: str) -> str:
    return f"{OPTIM}/{name}/{state_key}"


def optimizer_regions(model: nn.Module, optimizer, layout: Optional[list[dict]] = None) \
        -> tuple[torch.optim.Optimizer, dict[torch.Tensor, list[StatePiece]]]:
    """The optimizer holding this rank's states and the pieces of full parameters each tensor it steps
    covers (``layout``: the ``sharded`` weights' pieces, :func:`sharded_pieces`)."""
    own = getattr(optimizer, "checkpoint_state_regions", None)
    if callable(own):
        local, regions = own(model)
        return local, {t: [StatePiece.whole(r, t)] if isinstance(r, StateRegion) else list(r)
                       for t, r in regions.items()}
    local = local_optimizer(optimizer)
    names = {p: n for n, p in model.named_parameters()}
    shards = sharded_pieces(model, layout or [])
    regions = {}
    for group in local.param_groups:
        for p in group["params"]:
            if p in shards:
                regions[p] = shards[p]
            elif p in names:
                regions[p] = [StatePiece.whole(param_region(names[p], p), p)]
            else:
                raise CheckpointError("the optimizer steps a tensor that is not a parameter of the model" + (
                    "; with mp_grad_reduce 'sharded' pass the trainer's GradReducer (grad_reducer=trainer.grad_sync)"
                    if not layout else "; build the optimizer from the model being saved or loaded"))
    return local, regions


# ----------------------------------------------------------------------------- save


def model_chunks(model: nn.Module, layout: Optional[list[dict]] = None) -> list[Chunk]:
    """Every parameter's region; the ``sharded`` weights (``layout``) from this rank's pieces, which hold
    their masters (fp32 under autocast, where the model keeps them in the compute dtype)."""
    sharded = {p for entry in layout or [] for p in entry["params"]}
    out = []
    for name, p in model.named_parameters():
        if p not in sharded and local_part(p).numel():  # an FSDP block may be empty (more ranks than rows)
            region = param_region(name, p)
            out.append(Chunk(model_key(name), region.shape, region.offsets, local_part(p.detach())))
    for shard, pieces in sharded_pieces(model, layout or []).items():
        out += [Chunk(model_key(piece.region.name), piece.region.shape, piece.region.offsets, piece.of(shard.detach()))
                for piece in pieces]
    return out


def optimizer_chunks(model: nn.Module, optimizer, layout: Optional[list[dict]] = None) \
        -> tuple[list[Chunk], Optional[str]]:
    """The chunks of this rank's optimizer states, and the reason they cannot be saved (or None). A state
    of its tensor's shape covers the tensor's pieces; any other (a step count) is taken whole, once for
    every parameter the tensor holds a piece of."""
    local, regions = optimizer_regions(model, optimizer, layout)
    out = []
    for t, pieces in regions.items():
        state = local.state.get(t)
        if not state:
            continue  # no state yet (never stepped, or frozen)
        problem = non_tensor_state(pieces[0].region.name, state)
        if problem:
            return [], problem
        for key, value in sorted(state.items()):
            value = local_part(value.detach())
            if value.dim() > 0 and value.shape == local_part(t).shape:
                out += [Chunk(optim_key(piece.region.name, key), piece.region.shape, piece.region.offsets,
                              piece.of(value)) for piece in pieces if piece.stop > piece.start]
            else:
                out += [Chunk(optim_key(name, key), tuple(value.shape), (0,) * value.dim(), value)
                        for name in dict.fromkeys(piece.region.name for piece in pieces)]
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
                out[i] = want.target.copy_(value) if want.target is not None else value.clone()
            elif namespace == MODEL:
                raise CheckpointError(f"checkpoint '{reader.path}': '{want.name}' has shape {tuple(value.shape)} but "
                                      f"the model needs {want.region.shape}; the checkpoint is for another model size")
            else:  # a state not shaped like its parameter (a step count): whole
                out[i] = value.clone()
        del full, converted
    return out, consumed


@torch.no_grad()
def load_model(reader: ShardReader, model: nn.Module, layout: Optional[list[dict]] = None) -> None:
    """Read each parameter's region into it (a pipeline stage takes its own parameters), and the
    ``sharded`` weights' masters into this rank's pieces (``layout``)."""
    params = dict(model.named_parameters())
    wanted = [Wanted(name, param_region(name, p), tuple(local_part(p).shape), local_part(p.detach()))
              for name, p in params.items() if local_part(p).numel()]
    for shard, pieces in sharded_pieces(model, layout or []).items():
        shard.detach().zero_()  # the padding of the last piece stays zero, as when it was built
        wanted += [Wanted(piece.region.name, piece.region, piece.sizes, piece.of(shard.detach())) for piece in pieces]
    got, consumed = _read_named(reader, model, MODEL, wanted)
    missing = sorted({w.name for w, value in zip(wanted, got) if value is None})
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
def read_optimizer_state(reader: ShardReader, model: nn.Module, optimizer, layout: Optional[list[dict]] = None) \
        -> tuple[torch.optim.Optimizer, dict[int, dict[str, torch.Tensor]]]:
    """The local optimizer and its state (index in its parameter order -> state key -> tensor in the
    stepped tensor's shape) read from the regions it covers. A state of the parameter's shape is read
    piece by piece into one tensor (a ``sharded`` piece's padding zero); any other (a step count) is read
    whole and must be the same for every parameter a stepped tensor holds a piece of."""
    local, regions = optimizer_regions(model, optimizer, layout)
    index = {p: i for i, p in enumerate(p for group in local.param_groups for p in group["params"])}
    state_keys = sorted({k.rsplit("/", 1)[1] for k in reader.tensors if k.startswith(f"{OPTIM}/")})
    state: dict[int, dict[str, torch.Tensor]] = {}
    for state_key in state_keys:
        wanted, owners = [], []
        for t, pieces in regions.items():
            saved = [reader.tensors.get(optim_key(piece.region.name, state_key)) for piece in pieces]
            shaped = t.dim() > 0 and all(entry is None or tuple(entry["shape"]) == piece.region.shape
                                         for entry, piece in zip(saved, pieces))
            covered = sum(piece.stop - piece.start for piece in pieces)
            part = local_part(t)  # an FSDP DTensor's states are read as its local part
            buffer = (torch.empty if covered == part.numel() else torch.zeros)(part.shape, dtype=t.dtype) \
                if shaped else None
            if buffer is not None and not covered:  # an empty FSDP block: nothing to read
                state.setdefault(index[t], {})[state_key] = buffer
                continue
            for piece in pieces:
                wanted.append(Wanted(piece.region.name, piece.region, piece.sizes,
                                     piece.of(buffer) if buffer is not None else None))
                owners.append((t, buffer))
        got, _ = _read_named(reader, model, state_key, wanted)
        found: dict[torch.Tensor, list] = defaultdict(list)
        for (t, buffer), want, value in zip(owners, wanted, got):
            found[t].append((want, buffer, value))
        for t, reads in found.items():
            values = [value for _, _, value in reads if value is not None]
            if not values:
                continue
            names = sorted({want.name for want, _, value in reads if value is None})
            if names:
                has = next(want.name for want, _, value in reads if value is not None)
                raise CheckpointError(f"checkpoint '{reader.path}' lacks optimizer state '{state_key}' of {names[:3]}, "
                                      f"which one stepped tensor holds together with {has!r} that has it; the "
                                      "checkpoint is incomplete or for another model")
            if all(value is want.target for want, _, value in reads):
                state.setdefault(index[t], {})[state_key] = reads[0][1]
            elif any(not torch.equal(value, values[0]) or value is want.target for want, _, value in reads):
                raise CheckpointError(f"checkpoint '{reader.path}': optimizer state '{state_key}' differs between "
                                      f"parameters {sorted({w.name for w, _, _ in reads})[:3]}, which one stepped "
                                      "tensor holds together; resume with mp_grad_reduce 'after_backward'")
            else:
                state.setdefault(index[t], {})[state_key] = values[0]
    for t in regions:  # FSDP: a state shaped like its DTensor parameter is a DTensor placed alike
        if is_dtensor(t):
            from torch.distributed.tensor import DTensor

            for key, value in state.get(index[t], {}).items():
                if value.dim() > 0 and value.shape == local_part(t).shape:
                    state[index[t]][key] = DTensor.from_local(value.to(t.device), t.device_mesh, t.placements,
                                                              run_check=False, shape=t.shape, stride=t.stride())
    keys = {index[t]: set(state.get(index[t], {})) for t in regions}
    every = set().union(*keys.values()) if keys else set()
    incomplete = [i for i, k in keys.items() if k and k != every]
    if incomplete:
        raise CheckpointError(f"checkpoint '{reader.path}' holds optimizer states {sorted(keys[incomplete[0]])} for "
                              f"one parameter and {sorted(every)} for others; the checkpoint is incomplete")
    return local, state
