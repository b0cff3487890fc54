"""Frozen base weights stored small: in the compute dtype (bf16/fp16), or quantized: NF4 (QLoRA)
or row-wise int8 (LLM.int8 weights).

``cast_frozen_`` moves every frozen floating-point parameter to the compute dtype in place (the
Parameter objects, and so their gradient rules and shard specs, stay). ``quantize_linears``
replaces the frozen linears by ``QuantLinear``s whose weight is a ``QuantizedWeight`` (buffers, no
Parameter), quantized from this rank's shard alone.

Why every plan equals serial QLoRA: both formats quantize one row of the stored matrix at a time
(``galaxy.loralib.nf4``, ``galaxy.loralib.int8``), and a linear is stored so that tensor parallelism splits whole rows:
a column-parallel linear (q/k/v, gate/up, BERT query/key/value/intermediate) as ``W [out, in]``
(TP splits ``out``), a row-parallel one (o_proj, down_proj, BERT ``output.dense``) as
``W^T [in, out]`` (TP splits ``in``). The orientation belongs to the linear's TP form, not to the
plan, so a whole weight under SP or serial is stored the same way and the shards of every plan
are slices of the serial buffers, bit for bit. ``QuantizedWeight.spec`` records that slice (dim 0 of
every buffer), which is what gathering, checkpoints and resharding read.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn as nn

from galaxy.config import ConfigError
from galaxy.core.layers import ParallelLinear, ShardSpec, grad_rule, shard_spec
from galaxy.loralib.quantized_layers import FORMATS, QuantizedWeight, QuantLinear, row_parallel_name
from galaxy.loralib.utils import in_modules, parent_of

logger = logging.getLogger(__name__)

# Never quantized (QLoRA and bitsandbytes keep the output head in full precision).
KEEP_HEADS = ("lm_head", "classifier")


def quantizable(name: str, module: nn.Module, skip=()) -> bool:
    """A plain linear (``ParallelLinear`` / ``nn.Linear``) that is neither a head nor under ``skip``."""
    return type(module) in (ParallelLinear, nn.Linear) and not in_modules(f"{name}.weight", [*skip, *KEEP_HEADS])


def quantize_linears(model: nn.Module, skip=(), backend: str = "auto", kind: str = "nf4") -> list[str]:
    """Replace every ``ParallelLinear`` / ``nn.Linear`` of ``model`` (not under ``skip`` module
    names nor an output head) by a ``QuantLinear`` quantized (``kind``: nf4 | int8) from this rank's
    weight; returns the names."""
    done = []
    for name, module in list(model.named_modules()):
        if not quantizable(name, module, skip):
            continue
        parent, child = parent_of(model, name)
        setattr(parent, child, QuantLinear.from_linear(module, row_parallel_name(name), kind, backend))
        done.append(name)
    logger.info("%s: quantized %d linears (e.g. %s)", kind, len(done), done[:3])
    return done


def dequantize_linears(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[str]:
    """Undo ``quantize_linears`` (to the dequantized values, in ``dtype``): every ``QuantLinear``
    becomes a ``ParallelLinear`` and every quantized LoRA layer gets its ``weight`` back."""
    from galaxy.loralib.layers import LoRALinear

    done = []
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            parent, child = parent_of(model, name)
            setattr(parent, child, module.to_linear(dtype))
            done.append(name)
        elif isinstance(module, LoRALinear) and module.quantized:
            module.dequantize_base(dtype)
            done.append(name)
    return done


@torch.no_grad()
def cast_frozen_(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen floating-point parameter in ``dtype`` (in place); returns how many."""
    n = 0
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            n += 1
    return n


def frozen_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes, logical parameters) of this rank's frozen base weights: frozen parameters and quantized
    weights (every buffer they hold: codes and scales)."""
    nbytes = count = 0
    for p in model.parameters():
        if not p.requires_grad:
            nbytes += p.numel() * p.element_size()
            count += p.numel()
    for m in model.modules():
        if isinstance(m, QuantizedWeight):
            nbytes += m.nbytes()
            count += m.shape[0] * m.shape[1]
    return nbytes, count


# ----------------------------------------------------------------------------- quantize on load


class _Checkpoint:
    """The tensors of a local safetensors checkpoint, read lazily: a rank reads only its slices."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"model_path '{path}' holds no *.safetensors; quantize-on-load reads safetensors "
                                    "slices (convert the checkpoint, or load it with from_pretrained)")
        self.path = path
        self.handles = [safe_open(os.path.join(path, f), framework="pt", device="cpu") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}

    def piece(self, name: str, spec: Optional[ShardSpec], shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's piece of tensor ``name`` (the slice ``spec`` names, or all of it)."""
        if name not in self.where:
            raise ValueError(f"checkpoint '{self.path}' has no tensor '{name}' (quantize-on-load reads the model's own "
                             "parameter names; load other layouts with from_pretrained)")
        sl = self.where[name].get_slice(name)
        index = [slice(None)] * len(sl.get_shape())
        if spec is not None:
            index[spec.dim] = slice(spec.offset, spec.offset + spec.sizes[spec.rank])
        t = sl[tuple(index)]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"checkpoint '{self.path}': '{name}' gives {tuple(t.shape)} on this rank but the model "
                             f"needs {tuple(shape)}; the checkpoint is for another model size")
        return t


@torch.no_grad()
def load_quantized(model_cls, path: str, plan=None, ctx=None, config_overrides: Optional[dict] = None,
                   skip=(), dtype: torch.dtype = torch.float32, backend: str = "auto",
                   kind: str = "nf4") -> nn.Module:
    """A Galaxy model from a local HF checkpoint directory with its linears quantized (``kind``) as
    they are read: the model is laid out on the meta device, then each rank reads its own slice of
    each tensor (safetensors lazy slices), quantizes the linears (all but heads and ``skip``) and
    keeps the rest in ``dtype``. Peak host memory: one tensor slice in the checkpoint's dtype.
    Equal to ``model_cls.from_pretrained`` + ``quantize_linears`` (the buffers bit for bit)."""
    config = model_cls.config_from_dir(path, config_overrides)
    if getattr(config, "fused_gate_up", False):
        raise ConfigError("quantize-on-load quantizes each linear on its own; set fused_gate_up to false")
    model = model_cls(config, plan=plan, ctx=ctx, meta=True)  # laid out, no storage: filled below
    device = model.ctx.device
    ckpt = _Checkpoint(path)
    for name, module in list(model.named_modules()):
        if not quantizable(name, module, skip):
            continue
        w = module.weight
        spec = shard_spec(w)
        qweight = FORMATS[kind].quantize(ckpt.piece(f"{name}.weight", spec, tuple(w.shape)).to(device), spec,
                                     row_parallel_name(name), backend)
        bias = module.bias
        if bias is not None:
            bias = _materialized(bias, ckpt.piece(f"{name}.bias", shard_spec(bias), tuple(bias.shape)), device, dtype)
        parent, child = parent_of(model, name)
        setattr(parent, child, QuantLinear(qweight, bias, getattr(module, "style", "whole"), getattr(module, "rank", 0),
                                           spec, grad_rule(w)))
    done: dict[int, nn.Parameter] = {}
    tied = set(getattr(model, "tied_keys", {}) or {})
    for mod_name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                full = f"{mod_name}.{pname}" if mod_name else pname
                if full in tied:
                    continue  # filled through the module it is tied to
                done[id(p)] = _materialized(p, ckpt.piece(full, shard_spec(p), tuple(p.shape)), device, dtype)
            module._parameters[pname] = done[id(p)]
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"checkpoint '{path}' left parameters unfilled: {left[:5]}")
    logger.info("loaded '%s' with %s linears (%d tensors read as slices)", path, kind, len(done))
    return model


def _materialized(meta: nn.Parameter, data: torch.Tensor, device, dtype) -> nn.Parameter:
    p = nn.Parameter(data.to(device=device, dtype=dtype if data.is_floating_point() else data.dtype),
                     requires_grad=meta.requires_grad)
    p.__dict__.update(meta.__dict__)  # gradient rule, shard spec, pipeline tie
    return p


__all__ = ["quantize_linears", "dequantize_linears", "cast_frozen_", "frozen_bytes", "load_quantized"]
