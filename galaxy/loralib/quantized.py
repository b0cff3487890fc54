"""Frozen base weights stored small: in the compute dtype (bf16/fp16), or quantized: NF4 (QLoRA),
row-wise int8 (LLM.int8 weights) or row-wise fp8 e4m3 (multiplied on the fp8 tensor cores).

``cast_frozen_`` moves every frozen floating-point parameter to the compute dtype in place (the
Parameter objects, and so their gradient rules and shard specs, stay). ``quantize_linears``
replaces the frozen linears by ``QuantLinear``s whose weight is a ``QuantizedWeight`` (buffers, no
Parameter), quantized from this rank's shard alone.

Why every plan equals serial QLoRA: every format quantizes one row of the stored matrix at a time
(``galaxy.loralib.nf4``, ``galaxy.loralib.int8``, ``galaxy.loralib.fp8``), and a linear is stored so that
tensor parallelism splits whole rows: a column-parallel linear (q/k/v, gate/up, BERT
query/key/value/intermediate) as ``W [out, in]`` (TP splits ``out``), a row-parallel one (o_proj, down_proj,
BERT ``output.dense``) as ``W^T [in, out]`` (TP splits ``in``). The orientation belongs to the linear's TP
form, not to the plan, so a whole weight under SP or serial is stored the same way and the shards of every
plan are slices of the serial buffers, bit for bit. ``QuantizedWeight.spec`` records that slice (dim 0 of
every buffer), which is what gathering, checkpoints and resharding read. fp8 also quantizes the activations
per token row, and a product that sums over the stored rows takes each token row's amax over the mp group
(``QuantizedWeight.comm``), so a shard quantizes its piece of a row as serial does.

``materialize`` is the one loader of every storage format (bf16, fp16, nf4, int8, fp8, fp32): it fills a
model laid out on the meta device tensor by tensor, from a safetensors checkpoint read slice by slice
or from the model's own seeded init, each tensor made straight in the format it is stored in, so a
frozen base never exists in fp32 (``galaxy.peft.build_base``).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import torch
import torch.nn as nn

from galaxy.config import ConfigError
from galaxy.core.layers import ParallelLinear, ShardSpec, grad_rule, shard_spec
from galaxy.loralib.quantized_layers import FORMATS, FP8HeadCopy, QuantizedWeight, QuantLinear, row_parallel
from galaxy.loralib.utils import in_modules, parent_of

logger = logging.getLogger(__name__)

# Never quantized (QLoRA and bitsandbytes keep the output head in full precision).
KEEP_HEADS = ("lm_head", "classifier")


def quantizable(name: str, module: nn.Module, skip=()) -> bool:
    """A plain linear (``ParallelLinear`` / ``nn.Linear``) that is neither a head nor under ``skip``."""
    return type(module) in (ParallelLinear, nn.Linear) and not in_modules(f"{name}.weight", [*skip, *KEEP_HEADS])


def quantize_linears(model: nn.Module, skip=(), backend: str = "auto", kind: str = "nf4") -> list[str]:
    """Replace every ``ParallelLinear`` / ``nn.Linear`` of ``model`` (not under ``skip`` module
    names nor an output head) by a ``QuantLinear`` quantized (``kind``: nf4 | int8 | fp8) from this rank's
    weight; returns the names."""
    done = []
    comm = _mp_group(model)
    for name, module in list(model.named_modules()):
        if not quantizable(name, module, skip):
            continue
        parent, child = parent_of(model, name)
        setattr(parent, child, QuantLinear.from_linear(module, row_parallel(module), kind, backend, comm))
        done.append(name)
    logger.info("%s: quantized %d linears (e.g. %s)", kind, len(done), done[:3])
    return done


def quantize_head(model: nn.Module, backend: str = "auto") -> bool:
    """``peft.quantize_head``: the frozen output head's logits product on the fp8 tensor cores. The head's
    weight stays as it is (the tied embedding reads it, and the head's input gradient is multiplied by it);
    its row-wise e4m3 copy (``FP8HeadCopy``, 1 byte a weight more) becomes the model's ``lm_head_fp8``, which
    its forward multiplies the logits by, and is made again whenever a state dict is loaded into the model.
    False on a pipeline stage without the head."""
    if not hasattr(model, "lm_head_fp8"):
        raise ConfigError(f"config key 'quantize_head' quantizes a causal LM's output head, which "
                          f"{type(model).__name__} has not; set quantize_head to false")
    from galaxy.loralib.layers import LoRALinear

    head = model.lm_head
    if head is None:
        return False
    if isinstance(head, LoRALinear) or head.weight.requires_grad:
        raise ConfigError("config key 'quantize_head' keeps the output head frozen in fp8, but lm_head is "
                          f"{'a LoRA target' if isinstance(head, LoRALinear) else 'trained'}; take lm_head out of "
                          "lora_target_modules and modules_to_save, or set quantize_head to false")
    model.lm_head_fp8 = _head_in_fp8(head.weight, backend)
    model.register_load_state_dict_post_hook(lambda m, incompatible: _requantize_head(m, backend))
    logger.info("fp8 head: the logits product on %s", "the fp8 tensor cores" if model.lm_head_fp8.tensor_cores
                else "fp8 values in the compute dtype")
    return True


def _head_in_fp8(weight: torch.Tensor, backend: str) -> FP8HeadCopy:
    whole = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # an FSDP2 shard: the whole head
    return FP8HeadCopy.quantize(whole, None, False, backend)


def _requantize_head(model: nn.Module, backend: str) -> None:
    """The copy follows the weight a state dict brought (resuming, ``load_state_dict``)."""
    model.lm_head_fp8 = _head_in_fp8(model.lm_head.weight, backend)


def _mp_group(model: nn.Module):
    """The model's mp group (a Galaxy model's ``ctx.mp``), over which its TP shards lie; None for others."""
    return getattr(getattr(model, "ctx", None), "mp", None)


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
            count += 0 if m.COPY else m.shape[0] * m.shape[1]
    return nbytes, count


# ----------------------------------------------------------------------------- a base made in its storage format


class _Checkpoint:
    """The tensors of a local safetensors checkpoint, read lazily: a rank reads only its slices. Each
    read opens its file on its own (``safe_open`` maps the file; the mapping, whose pages count in the
    process's resident memory, goes with the handle), so at most one tensor's pages are mapped at a time."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"model_path '{path}' holds no *.safetensors; the streaming loader reads "
                                    "safetensors slices (convert the checkpoint, or load it with from_pretrained)")
        self.path, self.open = path, safe_open
        self.where = {}
        for f in files:
            with safe_open(os.path.join(path, f), framework="pt", device="cpu") as handle:
                self.where.update(dict.fromkeys(handle.keys(), os.path.join(path, f)))

    def piece(self, name: str, spec: Optional[ShardSpec], shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's piece of tensor ``name`` (the slice ``spec`` names, or all of it), a tensor of its own."""
        if name not in self.where:
            raise ValueError(f"checkpoint '{self.path}' has no tensor '{name}' (the streaming loader reads the model's "
                             "own parameter names; load other layouts with from_pretrained)")
        with self.open(self.where[name], framework="pt", device="cpu") as handle:
            sl = handle.get_slice(name)
            index = [slice(None)] * len(sl.get_shape())
            if spec is not None:
                index[spec.dim] = slice(spec.offset, spec.offset + spec.sizes[spec.rank])
            t = sl[tuple(index)]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"checkpoint '{self.path}': '{name}' gives {tuple(t.shape)} on this rank but the model "
                             f"needs {tuple(shape)}; the checkpoint is for another model size")
        return t


@torch.no_grad()
def materialize(model: nn.Module, path: Optional[str] = None, seed: int = 0,
                frozen: Optional[Callable[[str], bool]] = None, frozen_dtype: Optional[torch.dtype] = None,
                kind: str = "none", skip=(), backend: str = "auto", dtype: torch.dtype = torch.float32,
                init_device: Optional[torch.device] = None) -> nn.Module:
    """Fill ``model``, laid out on the meta device (its constructor's ``meta=True``), one tensor at a
    time, each made in the format it is stored in; returns it. The one loader of every storage format.

    Values: this rank's slice of each tensor of the local checkpoint directory ``path`` (safetensors, read
    lazily slice by slice), or without a path the model's serial init from ``seed``
    (``GalaxyModel.initial_piece``: the full tensor drawn in float32 as ``init_weights`` draws it, then sliced;
    on ``init_device``, by its generator, when given: a GPU draws in seconds what the host draws in minutes, and
    the host then holds no weight at all). Formats: with ``kind`` (nf4 | int8 | fp8) every ``quantizable``
    linear (all but heads and ``skip``) becomes a ``QuantLinear`` quantized from its fp32 piece; the other
    parameters that ``frozen(name)`` says stay frozen (default: all) are stored in ``frozen_dtype`` (None:
    ``dtype``), the rest (trainable: fp32 masters) in ``dtype``. So the model equals the one built in ``dtype``
    (or ``from_pretrained``) followed by ``quantize_linears`` and ``cast_frozen_`` bit for bit, and host memory
    peaks at the stored model plus one tensor as drawn or read (and its stored copy)."""
    if kind != "none" and kind not in FORMATS:
        raise ValueError(f"quantize_base '{kind}' is not one of none, {', '.join(FORMATS)}")
    device = model.ctx.device
    if path is not None:
        if getattr(model.config, "fused_gate_up", False):
            raise ConfigError("a streamed checkpoint is read tensor by tensor under the model's own names, but "
                              "fused_gate_up fuses HF's gate_proj/up_proj; set fused_gate_up to false")
        ckpt, tied = _Checkpoint(path), dict(getattr(model, "tied_keys", {}) or {})

        def read(name: str, meta: nn.Parameter) -> torch.Tensor:
            return ckpt.piece(tied.get(name, name), shard_spec(meta), tuple(meta.shape))
    else:
        def read(name: str, meta: nn.Parameter) -> torch.Tensor:
            return model.initial_piece(name, meta, seed, init_device)

    frozen = frozen or (lambda name: True)
    quantized = []
    if kind != "none":
        for name, module in list(model.named_modules()):
            if not quantizable(name, module, skip) or not module.weight.is_meta:
                continue
            w = module.weight
            spec = shard_spec(w)
            qweight = FORMATS[kind].quantize(read(f"{name}.weight", w).to(device).contiguous(), spec,
                                             row_parallel(module), backend, model.ctx.mp)
            parent, child = parent_of(model, name)
            setattr(parent, child, QuantLinear(qweight, module.bias, getattr(module, "style", "whole"),
                                               getattr(module, "rank", 0), spec, grad_rule(w)))
            quantized.append(name)
    # Every meta Parameter once, under its first name (``named_parameters``' and so ``init_weights``'),
    # with every module slot that holds it.
    slots: dict[int, tuple[str, nn.Parameter, list]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and p.is_meta:
                name = f"{mod_name}.{attr}" if mod_name else attr
                slots.setdefault(id(p), (name, p, []))[2].append((module, attr))
    small = 0
    for name, meta, places in slots.values():
        keep_frozen = frozen(name) and frozen_dtype is not None and frozen_dtype != dtype
        p = _materialized(meta, lambda: read(name, meta), device, frozen_dtype if keep_frozen else dtype)
        if keep_frozen and p.is_floating_point():
            p.stored_frozen = True  # apply_tuning refuses to train it (its fp32 values are gone)
            small += 1
        for module, attr in places:
            module._parameters[attr] = p
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"{'checkpoint ' + repr(path) if path else 'the init'} left parameters unfilled: {left[:5]}")
    if path is not None:
        model.loaded_from(path)
    logger.info("made %s tensor by tensor: %d linears in %s, %d frozen tensors in %s, %d in %s",
                f"'{path}'" if path else f"the init (seed {seed})", len(quantized), kind, small,
                frozen_dtype, len(slots) - small, dtype)
    return model


def load_quantized(model_cls, path: str, plan=None, ctx=None, config_overrides: Optional[dict] = None,
                   skip=(), dtype: torch.dtype = torch.float32, backend: str = "auto",
                   kind: str = "nf4") -> nn.Module:
    """A Galaxy model from a local HF checkpoint directory with its linears quantized (``kind``) as
    they are read (``materialize``): all but heads and ``skip``; the rest kept in ``dtype``. Peak host
    memory: the stored model and one tensor slice in the checkpoint's dtype. Equal to
    ``model_cls.from_pretrained`` + ``quantize_linears`` (the buffers bit for bit)."""
    config = model_cls.config_from_dir(path, config_overrides)
    if getattr(config, "fused_gate_up", False):
        raise ConfigError("quantize-on-load quantizes each linear on its own; set fused_gate_up to false")
    model = model_cls(config, plan=plan, ctx=ctx, meta=True)  # laid out, no storage: filled below
    return materialize(model, path, kind=kind, skip=skip, backend=backend, dtype=dtype)


def _materialized(meta: nn.Parameter, make: Callable[[], torch.Tensor], device, dtype) -> nn.Parameter:
    # The lasting tensor is allocated before ``make`` draws or reads the transient one, so the transient
    # one sits above it and its space is reused by the next (the other order leaves the host heap in holes).
    t = torch.empty(meta.shape, dtype=dtype if meta.is_floating_point() else meta.dtype, device=device)
    t.copy_(make())
    p = nn.Parameter(t, requires_grad=meta.requires_grad)
    p.__dict__.update(meta.__dict__)  # gradient rule, shard spec, pipeline tie
    return p


__all__ = ["quantize_linears", "dequantize_linears", "cast_frozen_", "frozen_bytes", "materialize", "load_quantized"]
