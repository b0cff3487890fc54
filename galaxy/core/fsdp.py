"""FSDP2 (torch's ``fully_shard``) under Galaxy's plans: data parallelism, and the replicated weights
of SP blocks sharded over the model-parallel group.

Two uses, which compose (``shard_model``):

* **dp** (``dp_engine: fsdp2``): every transformer layer of the stage, then the rest of the model
  (embeddings, final norm, head) as the root, is ``fully_shard``-ed over the dp ranks: each dp rank
  keeps a dim-0 shard of every weight (an mp rank's TP shard, or a whole weight), its gradient and
  its optimizer state; the weights are all-gathered before a layer runs and its gradients
  reduce-scattered after its backward. The root's stay gathered from forward into backward (its head
  runs first there; ``reshard_after_forward`` applies to the layers).
* **mp** (``mp_grad_reduce: fsdp``): the replicated weights of SP blocks (MLP.sp, ATT.sp's
  projections, a whole SP layer) are used by each mp rank on its own tokens: data parallelism over
  the mp group, so they are ``fully_shard``-ed over it (over dp x mp with fsdp2), before the layers.
  The reduce-scatter SUMs them, which is their PARTIAL rule: the serial model's gradient.

Which modules become units (``replicated_units``): in each layer, the largest modules whose weights
are all PARTIAL, that hold a matrix and define ``forward`` (FSDP gathers in a module's forward
hooks, so a container without a forward, such as LLaMA's attention, whose projections the layer
calls one by one, gives its children instead). Norm scales and a row-parallel bias (PARTIAL, but
added on mp rank 0 only, so its gradient exists on one rank) stay whole, summed over mp after
backward by the ``GradReducer``.

Gradients: every reduction is a plain SUM (``set_gradient_divide_factor(1)``; the loop weights the
micro-batch losses so a sum is the global batch's gradient), forced to ``ReduceOp.SUM`` where torch
offers it (Gloo has no PREMUL_SUM). Each sharded parameter says over which groups its shards lie
(``fsdp_axes``: ``("dp",)``, ``("mp",)`` or ``("dp", "mp")``), which the ``GradReducer`` (the mp rule
of a dp-sharded PARTIAL weight, the dp sum of an mp-sharded one under ddp) and the global gradient
norm read. The FSDP collectives over mp run on ``ctx.mp_grad`` (over dp x mp on ``ctx.dp_mp``),
never on ``ctx.mp``, whose order of backward transitions differs between mp ranks.

Mixed precision as torchtitan: with a bf16/fp16 run the layers' weights are gathered in that dtype
(``MixedPrecisionPolicy(param_dtype)``), gradients reduced in ``reduce_dtype`` (fp32 unless
``grad_reduce_dtype`` says otherwise), the fp32 masters being the sharded parameters. Inputs are not
cast (``cast_forward_inputs=False``) and the root keeps fp32 weights, so the residual stream stays
fp32 under autocast, as Galaxy's other engines keep it; for the same reason FSDP shards matrices
only: vectors (norm scales, biases; a fraction of a percent of the weights) stay whole parameters
(``ignored_params``), fp32 under bf16 as autocast expects of a norm's weight on the fp32 stream (a
norm with a bf16 weight there is an error where CPU autocast leaves it alone), their gradients
summed over mp and dp by the ``GradReducer`` after backward, in every dtype alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from galaxy.config import ConfigError
from galaxy.core.comm import Communicator
from galaxy.core.layers import GradRule, grad_rule, shard_spec
from galaxy.core.pipeline import layer_stacks

logger = logging.getLogger(__name__)

_AXES_ATTR = "_galaxy_fsdp_axes"
_META_PREFIX = "_galaxy_"


def fsdp_axes(param: torch.Tensor) -> tuple[str, ...]:
    """The groups a parameter's FSDP shards lie over: () when it is not FSDP-sharded."""
    return getattr(param, _AXES_ATTR, ())


def is_dtensor(t: Optional[torch.Tensor]) -> bool:
    if t is None:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (sharing its storage), or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def local_region(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offsets) of this rank's part of DTensor ``t`` within its logical shape (``t.shape``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offsets)


def device_mesh(comm: Communicator, device: torch.device):
    """A 1-D DeviceMesh over an existing group (no new process group is made)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(comm.group, device.type, mesh_dim_names=(comm.name,))


def defines_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def replicated_units(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` whose weights FSDP shards over mp (see the module docstring)."""
    params = list(module.parameters())
    if params and all(grad_rule(p) == GradRule.PARTIAL and shard_spec(p) is None for p in params) \
            and any(p.dim() >= 2 for p in params) and defines_forward(module):
        return [module]
    return [unit for child in module.children() for unit in replicated_units(child)]


@dataclass
class Sharding:
    """What ``shard_model`` did: the FSDP modules (mp units first, the dp root last)."""

    modules: list[nn.Module] = field(default_factory=list)
    over_dp: bool = False  # every parameter is sharded over dp: the dp sums are FSDP's
    # Per FSDP module: its group, and the bytes one micro-batch's forward and backward gather on it
    # (the whole weights, again in backward when resharded after forward) and the bytes of one
    # reduce-scatter of their gradients, counted on the group as Galaxy's own collectives are.
    traffic: list[tuple[Communicator, int, int]] = field(default_factory=list)

    def reshard(self) -> None:
        """Free gathered weights a forward without backward left (evaluation, a replay), so the model's
        parameters are the sharded ones again (checkpoints read them)."""
        for m in self.modules:
            m.reshard()

    def sync_gradients(self, enabled: bool) -> None:
        """Whether the next backwards reduce-scatter the gradients (False: each rank accumulates its
        unsharded gradients, in the reduce dtype, until a backward with True reduces them all)."""
        for m in self.modules:
            m.set_requires_gradient_sync(enabled, recurse=False)

    def count_traffic(self, micro_batches: int, reductions: Optional[int] = None) -> None:
        """Add a training step's FSDP collectives to their groups' ``bytes_sent`` (FSDP runs them itself):
        gathers every micro-batch, gradient reduce-scatters ``reductions`` times (default: every one)."""
        reductions = micro_batches if reductions is None else reductions
        for comm, gather, reduce in self.traffic:
            comm.bytes_sent += gather * micro_batches + reduce * reductions

    def comms(self) -> list[Communicator]:
        return list({id(c): c for c, _, _ in self.traffic}.values())


def _galaxy_meta(param: torch.Tensor) -> dict:
    return {k: v for k, v in vars(param).items() if k.startswith(_META_PREFIX)}


def _sum_reductions(module) -> None:
    """Plain SUM reductions: no division by the group size (the loop's loss weights make sums exact)."""
    setter = getattr(module, "set_gradient_divide_factor", None) or module.set_reduce_scatter_divide_factor
    setter(1.0)
    force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
    if force_sum is not None:  # else NCCL's PREMUL_SUM(1.0): the same sum
        force_sum(True)


def shard_model(model: nn.Module, ctx, *, over_dp: bool, replicated_over_mp: bool, reshard_after_forward: bool,
                param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None,
                float8_all_gather: bool = False) -> Sharding:
    """Apply ``fully_shard`` to ``model`` (this rank's stage), in place: ``replicated_over_mp``: the
    replicated weights of SP blocks over mp (over dp x mp when ``over_dp``); ``over_dp``: each layer
    and the root over dp. Galaxy's parameter metadata (gradient rule, TP shard spec, pipeline ties,
    weight decay) is carried over to the sharded parameters, which also get ``fsdp_axes``.
    ``float8_all_gather``: the float8 linears' weights (``galaxy.core.float8``, tensorwise) are gathered
    already cast to fp8 (torchao's weight wrapper, made here before sharding)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    meta = {name: _galaxy_meta(p) for name, p in model.named_parameters()}
    if float8_all_gather:
        from galaxy.core.float8 import wrap_weights_for_float8_all_gather

        wrapped = wrap_weights_for_float8_all_gather(model)
        logger.info("FSDP float8 all-gather: %d weights gathered as fp8", wrapped)
    sharding = Sharding(over_dp=over_dp and ctx.dp.size > 1)
    layers = [layer for stack in layer_stacks(model) for layer in stack]
    compute = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    axes_of: dict[str, tuple[str, ...]] = {}  # parameter name -> the groups of the unit that shards it
    def wrap(module: nn.Module, comm: Communicator, axes: tuple[str, ...], policy, reshard: bool) -> None:
        # Vectors (norm scales, biases) stay whole parameters (see the module docstring).
        ignored = {p for p in module.parameters() if p.dim() < 2 and not is_dtensor(p)}
        fully_shard(module, mesh=device_mesh(comm, ctx.device), reshard_after_forward=reshard,
                    mp_policy=policy, **({"ignored_params": ignored} if ignored else {}))
        _sum_reductions(module)
        sharding.modules.append(module)
        gathered = reduced = 0
        for name, p in model.named_parameters():  # those this call made DTensors
            if is_dtensor(p) and name not in axes_of:
                axes_of[name] = axes
                gathered += p.numel() * (policy.param_dtype or p.dtype).itemsize * (2 if reshard else 1)
                reduced += p.numel() * (policy.reduce_dtype or p.dtype).itemsize
        sharding.traffic.append((comm, gathered, reduced))

    if replicated_over_mp and ctx.mp.size > 1:
        if sharding.over_dp:
            if ctx.dp_mp is None:
                raise ConfigError("config key 'mp_grad_reduce' is 'fsdp' with dp_engine 'fsdp2', which shards over "
                                  "the dp x mp ranks of a stage, and this ParallelContext has no such group "
                                  "(ParallelContext.initialize builds it)")
            comm, axes = ctx.dp_mp, ("dp", "mp")
        else:
            if ctx.mp_grad is None or ctx.mp_grad.group is ctx.mp.group:
                raise ConfigError("config key 'mp_grad_reduce' is 'fsdp', whose collectives run on a second process "
                                  "group of the mp ranks, and this ParallelContext has none "
                                  "(ParallelContext.initialize builds it)")
            comm, axes = ctx.mp_grad, ("mp",)
        units = [unit for layer in layers for unit in replicated_units(layer)]
        if not units:
            logger.warning("mp_grad_reduce 'fsdp': the plan has no SP block with replicated weights to shard "
                           "over mp")
        for unit in units:
            wrap(unit, comm, axes, compute, reshard_after_forward)
    if sharding.over_dp:
        for layer in layers:
            wrap(layer, ctx.dp, ("dp",), compute, reshard_after_forward)
        # The root (embeddings, final norm, head) stays gathered from forward into backward, as torch's docs
        # advise: the head's backward needs it first. Resharded, torch 2.11 fails there on a tied head
        # ("setStorage ... storage of size 0": its saved weight freed before the root's pre-backward gather).
        wrap(model, ctx.dp, ("dp",), MixedPrecisionPolicy(reduce_dtype=reduce_dtype, cast_forward_inputs=False),
             False)
    for name, p in model.named_parameters():
        for key, value in meta[name].items():
            setattr(p, key, value)
        if name in axes_of:
            setattr(p, _AXES_ATTR, axes_of[name])
    sharded = [p for p in model.parameters() if fsdp_axes(p)]
    logger.info("FSDP: %d modules, %d parameters sharded (%s)", len(sharding.modules), len(sharded),
                ", ".join(sorted({"x".join(fsdp_axes(p)) for p in sharded})) or "none")
    return sharding
