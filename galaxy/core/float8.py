"""Float8 training of the transformer layers' linears (config key ``float8_training``): torchao's float8
matmul (``torchao.float8``, the one its ``Float8Linear`` runs) called from ``ParallelLinear.forward``.

Why the matmul and not torchao's module swap: ``convert_to_float8_training`` replaces ``nn.Linear``s by
``Float8Linear``s, and a ``ParallelLinear`` carries what a swap would drop or have to copy field by field:
its style (a row-parallel bias added on one rank), and on its Parameters the gradient rule and TP shard spec
that gradient sync, FSDP and checkpoints read. Called from the linear's own forward, the matmul runs on the
same Parameter objects, on every plan (a TP shard is one more matrix to torchao; its scales are the shard's
own, so a plan equals serial to fp8's rounding, not bit for bit), inside compiled layers too
(``matmul_with_hp_or_float8_args`` is ``allow_in_graph``). What this adds to torchao's own ``Float8Linear``:
the input is cast to the autocast dtype on any device (``Float8Linear`` does it for CUDA's autocast only),
and the matmul then runs with autocast off, its output in that dtype as F.linear's would be.

Which linears: every ``ParallelLinear`` of the layer stacks whose dims are multiples of 16 (``_scaled_mm``'s
need, as torchao's own filters); embeddings and the output head stay in the compute dtype (torchtitan leaves
the head out too). Recipes: ``tensorwise`` (one scale per tensor, the fastest), ``rowwise`` (per-row scales,
rounded down to powers of two). Under ``dp_engine: fsdp2`` with ``float8_fsdp_all_gather`` (tensorwise) the
weights are wrapped as torchao's ``WeightWithDynamicFloat8CastTensor`` before ``fully_shard``
(``galaxy.core.fsdp``): FSDP then gathers them as fp8 (each weight's amax one all-reduce over dp before its
gather; torchao's ``precompute_float8_dynamic_scale_for_fsdp`` would batch them, but it finds
``Float8Linear`` modules only). Not applied: torchao's ``convert_to_float8_training`` also patches inductor's
Triton min/max codegen around a Triton fp8-store bug of torch 2.14 dev builds; this calls no patch (the
project patches nothing), and torch 2.11 / 2.13 predate the codegen it works around.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.nn as nn

from galaxy.config import ConfigError
from galaxy.core.layers import ParallelLinear

logger = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
MULTIPLE = 16  # torch._scaled_mm: both dims of a weight


def _torchao_float8():
    try:
        import torchao.float8 as float8  # noqa: F401
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    except ImportError as e:
        raise ConfigError(f"config key 'float8_training' needs torchao ({e}); pip install torchao==0.18.0") from None
    return float8, Float8Linear, matmul_with_hp_or_float8_args


class Float8Matmul:
    """``x W^T + b`` through torchao's float8 matmul for one recipe (a ``ParallelLinear``'s ``float8``)."""

    def __init__(self, recipe: str, fsdp_all_gather: bool = False):
        if recipe not in RECIPES:
            raise ConfigError(f"config key 'float8_training': '{recipe}' is not one of none, {', '.join(RECIPES)}")
        float8, float8_linear, self.matmul = _torchao_float8()
        self.recipe = recipe
        self.config = float8.Float8LinearConfig.from_recipe_name(recipe)
        if fsdp_all_gather:
            self.config = dataclasses.replace(self.config, enable_fsdp_float8_all_gather=True)
        # torchao's own per-GEMM settings (fast accumulation in the output's GEMM only), as Float8Linear makes
        # them: from a module laid out on the meta device.
        self.mm_config = float8_linear(MULTIPLE, MULTIPLE, bias=False, config=self.config,
                                       device="meta").linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            y = self.matmul.apply(x, weight.t(), self.mm_config, self.config)
        return y if bias is None else y + bias.to(y.dtype)

    def __repr__(self) -> str:
        return f"Float8Matmul({self.recipe})"


def float8_linears(model: nn.Module) -> list[tuple[str, ParallelLinear]]:
    """The linears float8 training runs: ``ParallelLinear``s inside the layer stacks, dims multiples of 16."""
    from galaxy.core.pipeline import layer_stacks

    inside = {id(m) for stack in layer_stacks(model) for layer in stack for m in layer.modules()}
    return [(name, m) for name, m in model.named_modules() if type(m) is ParallelLinear and id(m) in inside
            and not (m.weight.shape[0] % MULTIPLE or m.weight.shape[1] % MULTIPLE)]


def enable_float8_training(model: nn.Module, recipe: str, fsdp_all_gather: bool = False) -> list[str]:
    """Run ``model``'s layer linears in float8 (``recipe``: tensorwise | rowwise); returns their names."""
    chosen = float8_linears(model)
    matmul = Float8Matmul(recipe, fsdp_all_gather)
    for _, linear in chosen:
        linear.float8 = matmul
    others = [n for n, m in model.named_modules() if type(m) is ParallelLinear and m.float8 is None]
    logger.info("float8 training (%s): %d linears, e.g. %s; left in the compute dtype: %s", recipe, len(chosen),
                [n for n, _ in chosen][:2], others[:4])
    if not chosen:
        logger.warning("float8_training '%s': no layer linear has both dims a multiple of %d; nothing runs in "
                       "float8", recipe, MULTIPLE)
    return [n for n, _ in chosen]


def wrap_weights_for_float8_all_gather(model: nn.Module) -> int:
    """Before ``fully_shard``: each float8 linear's weight becomes torchao's ``WeightWithDynamicFloat8CastTensor``
    (a new Parameter; ``galaxy.core.fsdp.shard_model`` carries Galaxy's metadata over by name), so FSDP
    all-gathers it cast to fp8. Returns how many."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    n = 0
    for _, linear in float8_linears(model):
        matmul = linear.float8
        if matmul is None or not matmul.config.enable_fsdp_float8_all_gather:
            continue
        w = linear.weight
        linear.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(w.data, matmul.mm_config,
                                                                       matmul.config.cast_config_weight.target_dtype),
                                     requires_grad=w.requires_grad)
        n += 1
    return n


__all__ = ["Float8Matmul", "enable_float8_training", "float8_linears", "wrap_weights_for_float8_all_gather"]
