"""Async TP: the TP edges of a sequence-sharded stream on symmetric memory (config ``tp_overlap: async_tp``).

torch's fused ops pipeline the collective with the matmul over the ranks' shards (each rank's
shard is copied peer-to-peer into a symmetric buffer by a side stream while the matmul of the
shard already there runs), as torchtitan's async TP (inductor's micro-pipeline TP) does:

    S -> T + column-parallel linears   torch.ops.symm_mem.fused_all_gather_matmul
    row-parallel linear + P -> S       torch.ops.symm_mem.fused_matmul_reduce_scatter

Each direction's backward is the other op (the adjoint of all-gather-then-matmul is
matmul-then-reduce-scatter and vice versa); the weight gradients reuse the gathered input (saved
by the forward, as the unfused ``F.linear`` saves it) or the gathered output gradient (returned by
the backward's own fused all-gather). The row-parallel bias is added after the reduce-scatter on
every rank's own tokens, so its gradient is that rank's share: the PARTIAL rule sums it.

Limits, each refused with one ConfigError line (galaxy.config checks what the config alone shows):
CUDA tensors on an NCCL group (the ops have no CPU/Gloo kernels); equal sequence shards (the
ops split evenly); torch builds that register the ops; not with CCLoRA (``lora_fusion``). LoRA
without fusion works: a LoRA-wrapped linear keeps its edge unfused, as under CoC.

NVLink multicast: these calls never take the ops' multimem path (it needs ``return_A=False``), but
symmetric memory's rendezvous can create multicast objects where the hardware offers them, which
some shared machines forbid. So unless the user chose otherwise, ``TORCH_SYMM_MEM_DISABLE_MULTICAST``
is set to 1 before the first symmetric allocation (the only process state this module touches).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from galaxy.config import ConfigError
from galaxy.core.comm import Communicator
from galaxy.core.overlap.common import apply_as_autocast

logger = logging.getLogger(__name__)

MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"

__all__ = ["AsyncTpEdges", "FusedOps", "all_gather_matmul", "edges_for", "matmul_reduce_scatter", "reference_ops",
           "symm_mem_ops"]

SEQ = 1  # activations are [batch, seq, features]; the shards are along the sequence


@dataclass(frozen=True)
class FusedOps:
    """The two fused collectives, with torch.ops.symm_mem's signatures:
    ``all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=True) -> (A, [A @ B])`` and
    ``matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name) -> reduce_scatter(A @ B)``."""

    all_gather_matmul: Callable
    matmul_reduce_scatter: Callable


def _symm_mem_module():
    try:
        import torch.distributed._symmetric_memory as symm_mem  # registers torch.ops.symm_mem
    except ImportError as e:
        raise ConfigError(f"config key 'tp_overlap' async_tp needs torch's symmetric memory, which this torch "
                          f"{torch.__version__} cannot import ({e}); use tp_overlap coc") from None
    for name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        if not hasattr(torch.ops.symm_mem, name):
            raise ConfigError(f"config key 'tp_overlap' async_tp needs torch.ops.symm_mem.{name}, missing in "
                              f"torch {torch.__version__}; use tp_overlap coc")
    return symm_mem


def symm_mem_ops(comm: Communicator) -> FusedOps:
    """torch's fused ops for ``comm``'s group, after checking that they can run there."""
    if not dist.is_initialized():
        raise ConfigError("config key 'tp_overlap' async_tp needs an NCCL process group, but this run has none "
                          "(one process); launch with torch distributed or set tp_overlap none")
    group = comm.process_group
    if group.size() != comm.size:
        raise ValueError(f"communicator {comm.name} has {comm.size} ranks but its process group {group.size()}")
    backend = str(dist.get_backend(group)).lower()
    if backend != "nccl" or not torch.cuda.is_available():
        raise ConfigError(f"config key 'tp_overlap' async_tp runs on CUDA GPUs over NCCL (symmetric memory), but "
                          f"the model-parallel group uses {backend}; use tp_overlap coc or none")
    symm_mem = _symm_mem_module()
    if os.environ.setdefault(MULTICAST_ENV, "1") != "1":
        logger.warning("%s=%s: symmetric memory may create NVLink multicast objects", MULTICAST_ENV,
                       os.environ[MULTICAST_ENV])
    name = group.group_name
    if not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():  # deprecated (and unneeded) on newer torch, required on older
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    logger.info("async TP on group %s (%d ranks): torch.ops.symm_mem fused all-gather/reduce-scatter matmuls",
                comm.name, comm.size)
    return FusedOps(torch.ops.symm_mem.fused_all_gather_matmul, torch.ops.symm_mem.fused_matmul_reduce_scatter)


def reference_ops() -> FusedOps:
    """torch's own unfused definitions of the two ops (functional collectives + matmul; the Meta
    kernels of torch.ops.symm_mem): any backend, no overlap. For CPU tests of this module's
    autograd and layouts on Gloo."""
    symm_mem = _symm_mem_module()
    return FusedOps(symm_mem._fused_all_gather_matmul_fallback, symm_mem._fused_matmul_reduce_scatter_fallback)


def _group_name(comm: Communicator) -> str:
    return comm.process_group.group_name


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _nbytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


class _AllGatherMatmul(torch.autograd.Function):
    """S -> T fused with column-parallel linears sharing the input; backward: one fused
    matmul-reduce-scatter of ``sum_i dY_i W_i`` (the linears' weights stacked), dW_i from the
    gathered input."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, ops: FusedOps, n: int, *params):
        weights, biases = params[:n], params[n:]
        name = _group_name(comm)
        gathered, outs = comm.timed(
            "all_gather", _nbytes(x) * comm.size, "fwd",
            lambda: ops.all_gather_matmul(x, [w.t() for w in weights], SEQ, name, return_A=True), x.device)
        for out, b in zip(outs, biases):
            if b is not None:
                out.add_(b)
        ctx.comm, ctx.ops, ctx.n, ctx.has_bias = comm, ops, n, [b is not None for b in biases]
        ctx.save_for_backward(gathered, *weights)
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        gathered, *weights = ctx.saved_tensors
        comm, n, need = ctx.comm, ctx.n, ctx.needs_input_grad
        grad_x = None
        if need[0]:
            dy = grads[0] if n == 1 else torch.cat(grads, dim=-1)
            w = weights[0] if n == 1 else torch.cat(weights, dim=0)
            grad_x = comm.timed(
                "reduce_scatter", _nbytes(gathered), "bwd",
                lambda: ctx.ops.matmul_reduce_scatter(dy, w, "sum", SEQ, _group_name(comm)), dy.device)
        x2 = _flat(gathered)
        grad_w = [torch.mm(_flat(g).t(), x2) if need[4 + i] else None for i, g in enumerate(grads)]
        grad_b = [_flat(g).sum(0) if ctx.has_bias[i] and need[4 + n + i] else None for i, g in enumerate(grads)]
        return (grad_x, None, None, None, *grad_w, *grad_b)


class _MatmulReduceScatter(torch.autograd.Function):
    """Row-parallel linear fused with P -> S; backward: one fused all-gather-matmul of dY (dX),
    dW from the gathered dY it returns."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm: Communicator, ops: FusedOps):
        name = _group_name(comm)
        y = comm.timed("reduce_scatter", math.prod(x.shape[:-1]) * weight.shape[0] * x.element_size(), "fwd",
                        lambda: ops.matmul_reduce_scatter(x, weight.t(), "sum", SEQ, name), x.device)
        if bias is not None:
            y.add_(bias)  # on each rank's own tokens: once per token
        ctx.comm, ctx.ops, ctx.has_bias = comm, ops, bias is not None
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        comm, (need_x, need_w, need_b) = ctx.comm, ctx.needs_input_grad[:3]
        grad_x = grad_w = None
        if need_x or need_w:
            dy_full, (grad_x,) = comm.timed(
                "all_gather", _nbytes(grad) * comm.size, "bwd",
                lambda: ctx.ops.all_gather_matmul(grad, [weight], SEQ, _group_name(comm), return_A=True),
                grad.device)
            grad_w = torch.mm(_flat(dy_full).t(), _flat(x)) if need_w else None
        grad_b = _flat(grad).sum(0) if need_b and ctx.has_bias else None
        return (grad_x if need_x else None), grad_w, grad_b, None, None


def _check_even(tokens: int, comm: Communicator, what: str) -> None:
    if tokens % comm.size:
        raise ConfigError(f"config key 'tp_overlap' async_tp needs equal sequence shards, but {what} has {tokens} "
                          f"tokens for {comm.size} ranks; make seq_length divisible by the model-parallel size "
                          f"or use tp_overlap coc")


def all_gather_matmul(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Sequence[Optional[torch.Tensor]], comm: Communicator,
                      ops: FusedOps) -> list[torch.Tensor]:
    """S -> T, then the column-parallel ``F.linear(x_full, W_i, b_i)``: ``x_local`` is
    ``[b, s / N, h]``, each result ``[b, s, out_i]``; the input gradient comes back reduce-scattered."""
    weights, biases = list(weights), list(biases)
    return list(apply_as_autocast(_AllGatherMatmul, x_local, comm, ops, len(weights), *weights, *biases))


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], comm: Communicator,
                          ops: FusedOps) -> torch.Tensor:
    """Row-parallel ``F.linear`` then P -> S: ``[b, s, in / N]`` -> ``[b, s / N, out]``; the bias is
    added once per token (after the reduce-scatter)."""
    _check_even(x.shape[SEQ], comm, "the row-parallel input")
    return apply_as_autocast(_MatmulReduceScatter, x, weight, bias, comm, ops)


def edges_for(comm: Communicator) -> Optional["AsyncTpEdges"]:
    """The async-TP edges of ``comm``, or None for a model-parallel group of one inside a larger run
    or a single process: nothing to overlap, so the edges stay unfused (as CoC leaves them). A run
    of one process in a process group of one (one GPU) does take the ops, which is how one GPU
    checks the path."""
    if comm.size == 1 and (not dist.is_initialized() or comm.process_group.size() != 1):
        logger.info("tp_overlap async_tp: the model-parallel group has one rank; its edges run unfused")
        return None
    return AsyncTpEdges(comm)


class AsyncTpEdges:
    """The two fused ops on ``comm``, on weights: ``ops`` defaults to torch's symm_mem ops (checked to
    run here); ``reference_ops()`` runs the same autograd anywhere."""

    def __init__(self, comm: Communicator, ops: Optional[FusedOps] = None):
        self.comm, self.ops = comm, ops if ops is not None else symm_mem_ops(comm)

    def enter(self, x: torch.Tensor, weights: Sequence[torch.Tensor],
              biases: Sequence[Optional[torch.Tensor]]) -> list[torch.Tensor]:
        return all_gather_matmul(x, weights, biases, self.comm, self.ops)

    def leave(self, y: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return matmul_reduce_scatter(y, weight, bias, self.comm, self.ops)
