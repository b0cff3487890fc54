"""Fused kernels for Galaxy: Triton implementations with plain-PyTorch references.

Every function takes ``backend``:

* ``"auto"``   Triton when the input is a CUDA tensor, triton imports and the op's Triton kernel
  measured fastest on this device class (``_backend.AUTO_PICKS``), else torch.
* ``"triton"`` always Triton; CPU tensors need ``TRITON_INTERPRET=1`` (slow, for tests).
* ``"torch"``  the reference in :mod:`galaxy.kernels.reference` (autograd backward).

Triton modules are imported only when a Triton backend is chosen, so this package imports
without triton installed. (CoC and CCLoRA live in their own modules, ``coc`` and ``cclora``.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from galaxy.kernels import reference
from galaxy.kernels._backend import (BACKENDS, resolve_backend, resolve_backend_for, triton_available,
                                     triton_interpret_enabled)

if TYPE_CHECKING:
    from galaxy.kernels.fp8 import FP8Matrix

__all__ = [
    "BACKENDS",
    "apply_rope",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "layer_norm",
    "lora_linear",
    "reference",
    "resolve_backend",
    "resolve_backend_for",
    "rms_norm",
    "swiglu",
    "swiglu_packed",
    "triton_available",
    "triton_interpret_enabled",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "auto") -> torch.Tensor:
    """LLaMA RMSNorm over the last dim (HF ``LlamaRMSNorm`` semantics, dtype promotion included)."""
    if resolve_backend(backend, x, "rms_norm") == "triton":
        from galaxy.kernels.triton_norms import TritonRMSNorm

        return TritonRMSNorm.apply(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, backend: str = "auto"
) -> torch.Tensor:
    """LayerNorm over the last dim with weight and bias; fp32 statistics, output in the promoted dtype of
    ``x`` and ``weight`` (see ``reference.layer_norm``)."""
    if resolve_backend(backend, x, "layer_norm") == "triton":
        from galaxy.kernels.triton_norms import TritonLayerNorm

        return TritonLayerNorm.apply(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (HF ``rotate_half``) of q [b, heads, s, d] and k [b, kv_heads, s, d]
    with cos/sin [b or 1, s, d] chosen by the caller (global positions under SP), or only their
    first halves [b or 1, s, d / 2] (the halves of such a table are equal; the kernel reads less)."""
    if resolve_backend(backend, q, "rope") == "triton":
        from galaxy.kernels.triton_rope import TritonRoPE

        return TritonRoPE.apply(q, k, cos, sin)
    return reference.apply_rope(q, k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up``."""
    if resolve_backend(backend, gate, "swiglu") == "triton":
        from galaxy.kernels.triton_swiglu import TritonSwiGLU

        return TritonSwiGLU.apply(gate, up)
    return reference.swiglu(gate, up)


def swiglu_packed(gate_up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim, the output of a fused
    gate/up projection; Triton reads the halves in place and returns the gradient packed."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must hold two equal halves, got {tuple(gate_up.shape)}")
    if resolve_backend(backend, gate_up, "swiglu_packed") == "triton":
        from galaxy.kernels.triton_swiglu import TritonSwiGLUPacked

        return TritonSwiGLUPacked.apply(gate_up)
    return reference.swiglu(*gate_up.chunk(2, dim=-1))


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_targets: int | float | torch.Tensor | None = None,
    backend: str = "auto",
    inplace: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``logits [..., V]`` vs ``targets [...]``; the loss is fp32.

    ``reduction``: 'mean' (over non-ignored targets, or over ``num_targets`` when given, e.g.
    the global count when tokens are sharded across ranks), 'sum', or 'none' (shape of targets).
    The Triton path computes the logits' gradient during forward (one pass over the logits; backward
    only applies ``grad_output``, so it can run once). ``inplace`` (Triton only): the logits' memory
    holds that gradient, so no [N, V] gradient is allocated; the logits must not be read after the call.
    """
    if reduction not in reference.REDUCTIONS:
        raise ValueError(f"reduction must be one of {reference.REDUCTIONS}, got {reduction!r}")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    if resolve_backend(backend, logits, "cross_entropy") == "triton":
        from galaxy.kernels.triton_cross_entropy import TritonCrossEntropy

        if not torch.is_grad_enabled():
            # Evaluation: a detached input tells the Function to skip its in-forward gradient
            # (inside forward, needs_input_grad ignores no_grad).
            flat_logits = flat_logits.detach()
        loss = TritonCrossEntropy.apply(flat_logits, flat_targets, ignore_index, reduction, num_targets, None, inplace)
    else:
        loss = reference.cross_entropy(flat_logits, flat_targets, ignore_index, reduction, num_targets)
    return loss.view(targets.shape) if reduction == "none" else loss


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    num_targets: int | float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    weight_fp8: "FP8Matrix | None" = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, targets)`` for hidden [..., H], weight [V, H].

    ``weight_fp8`` (a frozen ``weight``'s row-wise e4m3, ``galaxy.kernels.fp8``): the logits product on fp8
    values (``hidden`` quantized per row), the gradient of ``hidden`` from ``weight`` (``logits_on_fp8``).

    The Triton path never materializes the full [N, V] logits or their gradient: it works in
    chunks of ``chunk_size`` tokens (default: chunk logits of at most ``CHUNK_LOGITS_BYTES``, a frozen
    ``weight`` ``FROZEN_CHUNK_LOGITS_BYTES``) and
    computes the gradients during forward. Its backward may run only once. The torch path is
    the plain reference and does materialize the logits. 'mean' or 'sum' only; fp32 loss.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_linear_cross_entropy supports reduction 'mean' or 'sum', got {reduction!r}")
    if weight_fp8 is not None and weight.requires_grad:
        raise ValueError("fused_linear_cross_entropy: weight_fp8 serves a frozen weight (its products give no "
                         "weight gradient), but weight requires grad")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if resolve_backend(backend, hidden, "fused_linear_cross_entropy") == "triton":
        from galaxy.kernels.triton_cross_entropy import FusedLinearCrossEntropy

        kind = hidden.device.type
        if torch.is_autocast_enabled(kind):
            # Compute on what F.linear under autocast would (both operands in the autocast dtype),
            # with autocast off inside: the Function's out= matmuls need one dtype, unconverted.
            dtype = torch.get_autocast_dtype(kind)
            cast = lambda t: t if t is None or t.dtype == torch.float64 else t.to(dtype)  # noqa: E731
            flat_hidden, weight, bias = cast(flat_hidden), cast(weight), cast(bias)
            with torch.autocast(kind, enabled=False):
                return fused_linear_cross_entropy(flat_hidden, weight, flat_targets, ignore_index, reduction,
                                                  chunk_size, num_targets, bias, backend, weight_fp8)
        if not torch.is_grad_enabled():
            # Evaluation: detached inputs tell the Function to skip its in-forward gradients
            # (inside forward, needs_input_grad ignores no_grad).
            flat_hidden, weight = flat_hidden.detach(), weight.detach()
            bias = None if bias is None else bias.detach()
        return FusedLinearCrossEntropy.apply(
            flat_hidden, weight, flat_targets, bias, ignore_index, reduction, num_targets, chunk_size, None, weight_fp8
        )
    return reference.fused_linear_cross_entropy(
        flat_hidden, weight, flat_targets, ignore_index, reduction, num_targets, bias, weight_fp8
    )


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``x @ W^T (+ bias) + scale * (x @ A^T) @ B^T`` with A [r, in], B [out, r].

    'auto' and 'triton' use :class:`galaxy.kernels.lora.LoRALinearFunction`, whose backward
    brackets every product through rank r (no hidden x hidden temporary). It is plain torch
    matmuls (no Triton kernel), so it runs on every device and needs no TRITON_INTERPRET.
    'torch' is the reference composition with autograd's backward.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return reference.lora_linear(x, weight, lora_A, lora_B, scale, bias)
    from galaxy.kernels.lora import LoRALinearFunction

    return LoRALinearFunction.apply(x, weight, lora_A, lora_B, float(scale), bias)
