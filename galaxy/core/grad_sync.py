"""The gradient reductions of a training step, the global gradient norm, start-up checks.

One engine (``GradReducer``) makes every gradient the serial model's: the mp rules (PARTIAL
gradients summed over the model-parallel group; SHARDED and REPLICATED ones left alone) and the
data-parallel sum, in flat buckets whose collectives overlap backward, as DDP's do.

Why our own hooks and not ``torch.nn.parallel.DistributedDataParallel``:

* **Micro-batches and pipelines.** DDP decides at *forward* time whether the next backward
  reduces (``no_sync``), and expects that backward to follow. Under 1F1B a stage runs the last
  micro-batch's forward before the backward of earlier ones. Here the pipeline schedule says
  which backward is the last one (``arm()``), and only that one launches transfers.
* **Model-parallel gradient rules.** DDP all-reduces every parameter over one group and flags
  parameters that took no part in a forward (a row-parallel bias off mp rank 0) as errors. Here
  each bucket holds one kind of gradient and knows its collective.
* **Exact global-batch loss.** Each micro-batch loss is weighted by its share of the global
  batch's targets, so every reduction is a plain SUM (DDP divides by the group size).

What DDP gives is kept: parameters are bucketed (``bucket_mb``, reverse registration order, close
to the order backward produces gradients); ``register_post_accumulate_grad_hook`` counts a
parameter ready once its gradient is final; a full bucket is flattened and its collective
launched asynchronously while backward goes on. Buckets launch strictly in index order, so every
rank of a group issues the same collectives in the same order (NCCL and Gloo both need that).
``finish()`` launches what is left, waits, and writes the sums back.

The mp group itself carries the layout transitions of backward, whose order relative to a
gradient hook differs between mp ranks (a row-parallel bias is used on rank 0 only). So PARTIAL
buckets reduced *during* backward travel on a second process group over the same ranks
(``ParallelContext.mp_grad``); reduced after backward (``after_backward``) they use the mp group.

``mode`` (config ``mp_grad_reduce``), for the PARTIAL gradients:

* ``after_backward``: all-reduced over mp once backward is done.
* ``overlap``: all-reduced over mp during backward.
* ``sharded``: reduce-scattered over mp during backward (ZeRO-2 over mp): each mp rank keeps one
  piece of each flat bucket as a parameter of its own (``shards()``), which the optimizer steps in
  place of the bucket's weights, so their optimizer state is sharded too (ZeRO-1); after the step
  ``gather_weights()`` all-gathers the updated pieces into the model's weights. The model's
  weights lose their ``.grad`` as soon as it is copied into the bucket (ZeRO-2). Tied pipeline
  weights (summed between the first and last stage after the step's reductions) are all-reduced.

With dp, a PARTIAL bucket's mp result (the whole sum, or this rank's piece) is then all-reduced
over dp in ``finish()``; the other buckets are all-reduced over dp during backward.

FSDP-sharded parameters (``galaxy.core.fsdp``; DTensors whose ``fsdp_axes`` name the groups their
shards lie over) come out of backward with their gradient already summed over those groups, and
only their local shards take part here, in buckets launched by ``finish()`` (FSDP sets the gradient
itself, so no accumulate hook is relied on): a PARTIAL weight sharded over dp only is summed over mp
(``mp_grad_reduce: after_backward`` with ``dp_engine: fsdp2``); one sharded over mp only is summed
over dp (``mp_grad_reduce: fsdp`` with ``dp_engine: ddp``). ``mode`` ``fsdp`` reduces the PARTIAL
weights FSDP left whole (norm scales, a row-parallel bias) as ``after_backward`` does.

A parameter whose gradient is None took no part in this rank's forward. In a PARTIAL bucket it
contributes zeros (its mp peers may have used it). Elsewhere the structure is the same on every
dp rank, so it is None on all of them and keeps None (the optimizer skips it, as in serial).
After the first step such parameters are no longer waited for, so their bucket can launch during
backward (the models' graphs are static: the set of used parameters does not change by step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from galaxy.config import MP_GRAD_REDUCE, ConfigError
from galaxy.core.comm import Communicator, all_gather_single, reduce_scatter_single
from galaxy.core.fsdp import fsdp_axes, local
from galaxy.core.layers import GradRule, grad_rule, set_param_meta, shard_spec

logger = logging.getLogger(__name__)

_DECAY_ATTR = "_galaxy_weight_decay"


def takes_weight_decay(param: torch.Tensor) -> bool:
    """Weight decay on matrices, none on biases and norm scales (as HF and Megatron); a flat shard
    of ``sharded`` weights says which kind it holds."""
    return getattr(param, _DECAY_ATTR, param.dim() >= 2)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    kind: str  # "dp": all-reduce over dp | "mp_sum": all-reduce over mp | "mp_shard": reduce-scatter over mp
    deferred: bool  # launched by finish(), not by the backward hooks
    summed_over_dp: bool = False  # FSDP-sharded over dp: FSDP did the dp sum
    shard: Optional[nn.Parameter] = None  # mp_shard: this rank's piece of the flat weights
    expected: int = 0  # parameters whose gradient backward produces (learned after the first step)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = sum(p.numel() for p in self.params)
        self.expected = len(self.params)


class GradReducer:
    """The step's gradient reductions; ``arm()`` before the step's last backward, ``finish()`` after it.

    ``mp``: the model-parallel group (its PARTIAL rule); ``dp``: the data-parallel group (None or one
    rank: no dp sum). ``reduce_dtype``: the precision the sums travel in (None: the gradients', and
    a ``sharded`` bucket's the precision of its pieces). ``hooks=False``: nothing is launched during
    backward (``finish()`` does everything). ``compute_dtype`` (``sharded``, with autocast): the
    model keeps the sharded weights in this dtype, their fp32 masters living only in the pieces
    (Megatron's distributed optimizer): the all-gather moves compute-dtype weights.
    """

    def __init__(self, params: Iterable[nn.Parameter], mp: Communicator, dp: Optional[Communicator] = None,
                 mode: str = "after_backward", bucket_mb: float = 25.0,
                 reduce_dtype: Optional[torch.dtype] = None, hooks: bool = True,
                 mp_grad: Optional[Communicator] = None, compute_dtype: Optional[torch.dtype] = None):
        if mode not in MP_GRAD_REDUCE:
            raise ValueError(f"mp gradient mode '{mode}' is not one of {', '.join(MP_GRAD_REDUCE)}")
        self.mp, self.mode, self.reduce_dtype = mp, mode, reduce_dtype
        self.dp = dp if dp is not None and dp.size > 1 else None
        params = [p for p in params if p.requires_grad]
        partial = mp.size > 1 and any(grad_rule(p) == GradRule.PARTIAL and "mp" not in fsdp_axes(p) for p in params)
        in_backward = hooks and mode not in ("after_backward", "fsdp")
        # PARTIAL buckets reduced during backward need a group that backward's transitions do not use.
        self.mp_grad = mp
        if partial and in_backward:
            if mp_grad is None or mp_grad.size != mp.size or mp_grad.group is mp.group:
                raise ConfigError(f"config key 'mp_grad_reduce' is '{mode}', which reduces gradients during backward "
                                  "on a second process group of the mp ranks, and this ParallelContext has none "
                                  "(ParallelContext.initialize builds it); use mp_grad_reduce 'after_backward'")
            self.mp_grad = mp_grad

        def kind_of(p: nn.Parameter) -> Optional[str]:
            axes = fsdp_axes(p)
            if mp.size > 1 and grad_rule(p) == GradRule.PARTIAL and "mp" not in axes:
                return "mp_shard" if mode == "sharded" and pipeline_tie(p) is None and not axes else "mp_sum"
            return "dp" if self.dp is not None and "dp" not in axes else None

        self.buckets: list[_Bucket] = []
        open_bucket: dict[tuple, tuple[list[nn.Parameter], list[int]]] = {}  # one filling bucket per key
        limit = bucket_mb * 2**20
        order: list[tuple[tuple, list[nn.Parameter]]] = []
        for p in reversed(params):
            kind = kind_of(p)
            if kind is None:
                continue
            key = (kind, p.dtype, takes_weight_decay(p) if kind == "mp_shard" else None, fsdp_axes(p))
            members, size = open_bucket.get(key, (None, [0]))
            if members is None or size[0] + _nbytes(p) > limit:
                members, size = [], [0]
                open_bucket[key] = (members, size)
                order.append((key, members))
            members.append(p)
            size[0] += _nbytes(p)
        # Launch order (the same on every rank): by the bucket's last member, roughly when it fills.
        position = {id(p): i for i, p in enumerate(reversed(params))}
        order.sort(key=lambda entry: position[id(entry[1][-1])])
        # FSDP reduce-scatters over dp during backward: the dp sums of the weights it left whole wait for the end.
        fsdp_over_dp = any("dp" in fsdp_axes(p) for p in params)
        for (kind, _, decays, axes), members in order:
            deferred = not hooks or (kind != "dp" and mode in ("after_backward", "fsdp")) or bool(axes) or \
                (kind == "dp" and fsdp_over_dp)
            bucket = _Bucket(members, kind, deferred, summed_over_dp="dp" in axes)
            if kind == "mp_shard":
                bucket.shard = self._make_shard(members, decays)
                if compute_dtype is not None:
                    for p in members:
                        p.data = p.data.to(compute_dtype)
            self.buckets.append(bucket)
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self._live = [b for b, bucket in enumerate(self.buckets) if not bucket.deferred]  # launched by hooks
        self._live_position = {b: i for i, b in enumerate(self._live)}
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._next = 0  # index into _live of the next bucket the hooks launch
        self._pending: list[tuple[_Bucket, list[nn.Parameter], torch.Tensor, object]] = []
        self.overlapped = 0  # buckets launched during backward in the last step (the rest in finish())
        hooked = [p for p in params if self._bucket_of.get(id(p)) in self._live_position]
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in hooked]

    # -- sharded weights

    def _piece(self, numel: int) -> int:
        """Elements of one rank's piece of a flat bucket of ``numel`` (the last piece padded with zeros)."""
        return -(-numel // self.mp.size)

    def _piece_of(self, params: list[nn.Parameter]) -> torch.Tensor:
        """This rank's piece of the flat (zero-padded) weights ``params``."""
        piece = self._piece(sum(p.numel() for p in params))
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        flat = torch.nn.functional.pad(flat, (0, piece * self.mp.size - flat.numel()))
        return flat[self.mp.rank * piece:(self.mp.rank + 1) * piece].clone()

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """Copy the model's weights into the pieces (after the weights were loaded from elsewhere)."""
        for b in self.buckets:
            if b.shard is not None:
                b.shard.copy_(self._piece_of(b.params))

    def _make_shard(self, params: list[nn.Parameter], decays: bool) -> nn.Parameter:
        shard = nn.Parameter(self._piece_of(params))
        # Each mp rank holds a different piece: counted once per rank in the global norm, like a TP shard.
        set_param_meta(shard, GradRule.SHARDED)
        setattr(shard, _DECAY_ATTR, decays)
        return shard

    def shards(self) -> list[nn.Parameter]:
        """This rank's pieces of the ``sharded`` buckets (parameters of their own)."""
        return [b.shard for b in self.buckets if b.shard is not None]

    def optimizer_params(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer steps: ``params`` with the ``sharded`` weights replaced by this rank's pieces."""
        sharded = {id(p) for b in self.buckets if b.shard is not None for p in b.params}
        return [p for p in params if id(p) not in sharded] + self.shards()

    def shard_layout(self) -> list[dict]:
        """Where each ``sharded`` weight lives: per shard, its parameters (in flat order, each
        ``numel`` long) and the slice ``[start, stop)`` of the padded flat bucket this rank holds.
        Checkpoints save and load the pieces (masters and optimizer states) as regions of the full
        weights through it (``galaxy.train.checkpoint.regions.sharded_pieces``)."""
        layout = []
        for b in self.buckets:
            if b.shard is not None:
                piece = self._piece(b.numel)
                layout.append({"shard": b.shard, "params": list(b.params), "numel": b.numel,
                               "start": self.mp.rank * piece, "stop": (self.mp.rank + 1) * piece})
        return layout

    @torch.no_grad()
    def gather_weights(self) -> None:
        """After the optimizer stepped the pieces: all-gather them into the model's weights."""
        pending = []
        for b in self.buckets:
            if b.shard is None:
                continue
            piece = b.shard.detach().to(b.params[0].dtype)  # the model's dtype for these weights
            flat = torch.empty(self._piece(b.numel) * self.mp.size, dtype=piece.dtype, device=piece.device)
            self.mp_grad.bytes_sent += b.numel * piece.element_size()
            pending.append((b, flat, all_gather_single(flat, piece, group=self.mp_grad.group, async_op=True)))
        for b, flat, work in pending:
            work.wait()
            for p, w in zip(b.params, flat[:b.numel].split([p.numel() for p in b.params])):
                p.copy_(w.view_as(p))

    # -- reductions

    def comms(self) -> list[Communicator]:
        """The groups whose bytes this reducer counts (its own ``mp_grad`` group included)."""
        return [c for c in (self.mp, self.mp_grad, self.dp) if c is not None]

    def arm(self) -> None:
        """The next backward is the step's last one: each bucket is sent once its gradients are final."""
        self._armed = True
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._pending = []

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        b = self._bucket_of[id(param)]
        if self._live_position[b] < self._next:
            raise RuntimeError("a gradient arrived after its bucket was sent: a parameter accumulated twice in the "
                               "step's last backward (e.g. under reentrant checkpointing), which bucketed reductions "
                               "during backward cannot serve")
        self._ready[b] += 1
        while self._next < len(self._live) and \
                self._ready[self._live[self._next]] >= self.buckets[self._live[self._next]].expected:
            self._launch(self.buckets[self._live[self._next]])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.kind == "dp":
            params = [p for p in bucket.params if p.grad is not None]
            if not params:
                return
        else:  # a PARTIAL weight this rank did not use contributes zeros
            params = bucket.params
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        flat = torch.cat([local(p.grad).reshape(-1) for p in params])
        dtype = self.reduce_dtype or (bucket.shard.dtype if bucket.shard is not None else None)
        if dtype is not None:
            flat = flat.to(dtype)
        if bucket.kind == "dp":
            self.dp.bytes_sent += _nbytes(flat)
            work = dist.all_reduce(flat, group=self.dp.group, async_op=True)
        elif bucket.kind == "mp_sum":
            self.mp_grad.bytes_sent += _nbytes(flat)
            work = dist.all_reduce(flat, group=self.mp_grad.group, async_op=True)
        else:
            for p in params:  # ZeRO-2: the full gradients are dropped as soon as they are in the bucket
                p.grad = None
            piece = self._piece(bucket.numel)
            self.mp_grad.bytes_sent += _nbytes(flat)
            padded = torch.nn.functional.pad(flat, (0, piece * self.mp.size - flat.numel()))
            out = torch.empty(piece, dtype=flat.dtype, device=flat.device)
            work = reduce_scatter_single(out, padded, group=self.mp_grad.group, async_op=True)
            flat = out
        self._pending.append((bucket, params, flat, work))

    def finish(self) -> None:
        """Launch the buckets backward left incomplete, wait for all, write the sums into ``.grad``
        (a ``sharded`` bucket: into its piece's ``.grad``; its weights' ``.grad`` become None)."""
        if not self._armed:
            raise RuntimeError("GradReducer.finish() without arm(): call arm() before the step's last backward")
        self.overlapped = len(self._pending)
        for b in self._live[self._next:]:
            self._launch(self.buckets[b])
        for bucket in self.buckets:
            if bucket.deferred:
                self._launch(bucket)
        # Parameters that got no gradient (unused by this rank's forward) are not waited for next time.
        for b, bucket in enumerate(self.buckets):
            if not bucket.deferred:
                bucket.expected = self._ready[b]
        follow_up = []  # PARTIAL results still to be summed over dp
        for bucket, params, flat, work in self._pending:
            work.wait()
            if bucket.kind != "dp" and self.dp is not None and not bucket.summed_over_dp:
                self.dp.bytes_sent += _nbytes(flat)
                work = dist.all_reduce(flat, group=self.dp.group, async_op=True)
            follow_up.append((bucket, params, flat, work))
        for bucket, params, flat, work in follow_up:
            work.wait()
            if bucket.kind == "mp_shard":
                bucket.shard.grad = flat.to(bucket.shard.dtype)
                continue
            grads = [local(p.grad) for p in params]
            for grad, g in zip(grads, flat.split([grad.numel() for grad in grads])):
                grad.copy_(g.view_as(grad))
        self._pending = []
        self._armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class GradientSync:
    """Sums the PARTIAL gradients over the model-parallel group after backward (a ``GradReducer``
    with nothing launched during backward), for loops that run their own backward."""

    def __init__(self, params: Iterable[nn.Parameter], comm: Communicator, bucket_mb: float = 25.0,
                 reduce_dtype: Optional[torch.dtype] = None):
        self.reducer = GradReducer(params, comm, bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, hooks=False)

    def __call__(self) -> None:
        self.reducer.arm()
        self.reducer.finish()


# ----------------------------------------------------------------------------- pipeline ties

_TIE_ATTR = "_galaxy_pipeline_tie"


def mark_pipeline_tie(param: nn.Parameter, key: str, copy: bool) -> None:
    """``param`` is one of two copies of a weight held by the first and the last pipeline stage
    (tied input/output embeddings): their gradients are summed over ``ctx.pp_ends`` after backward,
    and the last stage's ``copy`` is left out of the global gradient norm so the weight counts once."""
    setattr(param, _TIE_ATTR, (key, copy))


def pipeline_tie(param: torch.Tensor) -> Optional[tuple[str, bool]]:
    return getattr(param, _TIE_ATTR, None)


def is_pipeline_copy(param: torch.Tensor) -> bool:
    tie = pipeline_tie(param)
    return tie is not None and tie[1]


def sync_pipeline_ties(params: Iterable[nn.Parameter], comm: Communicator) -> None:
    """Sum the gradients of tied weights between the first and the last stage (both then hold the
    serial model's gradient, and identical optimizer steps keep the two copies equal)."""
    if comm.size == 1:
        return
    tied = sorted((pipeline_tie(p)[0], i, p) for i, p in enumerate(params) if pipeline_tie(p) is not None)
    for _, _, p in tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = local(p.grad)  # FSDP over dp shards both copies alike
        grad.copy_(comm.all_reduce(grad, "bwd"))


def global_grad_norm(params: list[nn.Parameter], comm: Communicator,
                     pp: Optional[Communicator] = None, dp: Optional[Communicator] = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient: each TP shard counted once (summed over the group),
    each replicated gradient counted once (it is identical on every rank after sync). With ``pp``,
    each stage's square sum is added over the pipeline, a tied weight's last-stage copy left out.
    FSDP shards (``fsdp_axes``) count their local part, summed over the groups the shards lie over:
    mp for those over mp, and ``dp`` (pass it when the model is FSDP-sharded over dp) for those over dp."""
    counted = [p for p in params if p.grad is not None and not is_pipeline_copy(p)]
    over: dict[tuple[bool, bool], list[torch.Tensor]] = {(m, d): [] for m in (False, True) for d in (False, True)}
    for p in counted:  # (summed over mp, summed over dp)
        axes = fsdp_axes(p)
        over[(grad_rule(p) == GradRule.SHARDED or "mp" in axes, "dp" in axes)].append(local(p.grad))
    device = params[0].device if params else torch.device("cpu")

    def squared(grads):  # one fused norm kernel per dtype group, accumulated in float64
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.nn.utils.get_total_norm(grads, 2.0).double() ** 2

    dp = dp if dp is not None and dp.size > 1 else None
    mp_sq, mp_dp_sq = squared(over[(True, False)]), squared(over[(True, True)])
    if comm.size > 1 and dp is not None:
        mp_sq, mp_dp_sq = comm.all_reduce(torch.stack([mp_sq, mp_dp_sq])).unbind()
    elif comm.size > 1:
        mp_sq = comm.all_reduce(mp_sq)
    total_sq = mp_sq + squared(over[(False, False)])
    if dp is not None:
        total_sq = total_sq + dp.all_reduce(squared(over[(False, True)]) + mp_dp_sq)
    if pp is not None and pp.size > 1:
        total_sq = pp.all_reduce(total_sq)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grads_with_norm_(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """``torch.nn.utils.clip_grads_with_norm_`` (the same coefficient, one fused multiply per device and
    dtype) on the local part of each gradient, so FSDP's DTensor gradients are scaled alike."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            grad = local(p.grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device))


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, comm: Communicator,
                   pp: Optional[Communicator] = None, dp: Optional[Communicator] = None) -> torch.Tensor:
    """Scale all gradients so the global norm is at most ``max_norm``; returns the norm before clipping."""
    norm = global_grad_norm(params, comm, pp, dp)
    clip_grads_with_norm_(params, max_norm, norm.float())
    return norm


def check_replicated(model: nn.Module, comm: Communicator) -> None:
    """Every non-sharded parameter must hold the same value on every mp rank at start-up."""
    if comm.size == 1:
        return
    names, sums = [], []
    for name, p in model.named_parameters():
        if grad_rule(p) != GradRule.SHARDED:
            names.append(name)
            data = p.detach().double().reshape(-1)
            weights = torch.arange(1, data.numel() + 1, dtype=torch.float64, device=data.device) % 97
            sums.append(torch.stack([data.sum(), (data * weights).sum()]))
    if not sums:
        return
    local = torch.stack(sums)
    gathered = [torch.empty_like(local) for _ in range(comm.size)]
    dist.all_gather(gathered, local, group=comm.group)
    for r, other in enumerate(gathered):
        bad = (other != local).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(f"replicated parameter '{names[bad[0]]}' differs between mp rank {comm.rank} and "
                               f"rank {r} at start-up ({len(bad)} parameter(s) in all); build every rank from the "
                               "same seed and checkpoint")


def gather_full(tensor: torch.Tensor, param: nn.Parameter, comm: Communicator) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter, or of its gradient, on every rank."""
    spec = shard_spec(param)
    if spec is None or comm.size == 1:
        return tensor
    return comm.all_gather(tensor.contiguous(), spec.dim, spec.sizes)
