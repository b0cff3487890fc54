"""Applying the gradient rules after backward, checking replicated weights, gathering shards."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from galaxy.core.comm import Communicator
from galaxy.core.layers import GradRule, grad_rule, shard_spec


class GradientSync:
    """Sums the PARTIAL gradients over the model-parallel group, in flat buckets.

    Each bucket's all-reduce is launched asynchronously and all are awaited together, so the
    transfers pipeline with one another; SHARDED and REPLICATED gradients are left alone.
    A parameter that took no part in this rank's forward (e.g. a row-parallel bias off rank 0)
    contributes zeros. ``reduce_dtype``: the precision the sums travel in (None: the gradients').
    """

    def __init__(self, params: Iterable[nn.Parameter], comm: Communicator, bucket_mb: float = 25.0,
                 reduce_dtype: Optional[torch.dtype] = None):
        self.comm, self.reduce_dtype = comm, reduce_dtype
        partial = [p for p in params if p.requires_grad and grad_rule(p) == GradRule.PARTIAL]
        self.buckets: list[list[nn.Parameter]] = []
        limit, size = bucket_mb * 2**20, 0.0
        for p in partial:
            if not self.buckets or size + p.numel() * p.element_size() > limit or p.dtype != self.buckets[-1][0].dtype:
                self.buckets.append([])
                size = 0.0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()

    def __call__(self) -> None:
        if self.comm.size == 1:
            return
        pending = []
        for bucket in self.buckets:
            for p in bucket:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            if self.reduce_dtype is not None:
                flat = flat.to(self.reduce_dtype)
            pending.append((bucket, flat, dist.all_reduce(flat, group=self.comm.group, async_op=True)))
        for bucket, flat, work in pending:
            work.wait()
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(g.view_as(p))


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
        p.grad.copy_(comm.all_reduce(p.grad, "bwd"))


def global_grad_norm(params: list[nn.Parameter], comm: Communicator,
                     pp: Optional[Communicator] = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient: each TP shard counted once (summed over the group),
    each replicated gradient counted once (it is identical on every rank after sync). With ``pp``,
    each stage's square sum is added over the pipeline, a tied weight's last-stage copy left out."""
    counted = [p for p in params if p.grad is not None and not is_pipeline_copy(p)]
    sharded = [p.grad for p in counted if grad_rule(p) == GradRule.SHARDED]
    whole = [p.grad for p in counted if grad_rule(p) != GradRule.SHARDED]
    device = params[0].device if params else torch.device("cpu")

    def squared(grads):  # one fused norm kernel per dtype group, accumulated in float64
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        return torch.nn.utils.get_total_norm(grads, 2.0).double() ** 2

    sharded_sq = squared(sharded)
    if comm.size > 1:
        sharded_sq = comm.all_reduce(sharded_sq)
    total_sq = sharded_sq + squared(whole)
    if pp is not None and pp.size > 1:
        total_sq = pp.all_reduce(total_sq)
    return total_sq.sqrt()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, comm: Communicator,
                   pp: Optional[Communicator] = None) -> torch.Tensor:
    """Scale all gradients so the global norm is at most ``max_norm``; returns the norm before clipping."""
    norm = global_grad_norm(params, comm, pp)
    # torch's helper scales the gradients with one fused kernel per dtype group.
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.float())
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
