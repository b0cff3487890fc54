"""Plain-PyTorch reference implementations of the fused kernels.

These are the CPU (and non-CUDA) path and the oracle the Triton kernels are tested against.
They follow the Hugging Face conventions exactly (same op order and casts), so a model built
on them reproduces ``transformers`` outputs bit for bit; autograd provides their backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))``, as ``transformers`` ``LlamaRMSNorm``.

    Statistics in fp32; the normalized value is cast back to ``x.dtype`` *before* the weight
    multiply, so the result dtype is ``promote(x.dtype, weight.dtype)``.
    """
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim, computed in fp32 and returned in the promoted dtype of ``x`` and
    ``weight``: ``x.dtype`` for a half-precision model, fp32 for half activations over fp32 weights
    (what ``F.layer_norm`` returns under autocast, which runs it in fp32)."""
    h = x.to(torch.float32)
    mean = h.mean(-1, keepdim=True)
    centered = h - mean
    var = centered.pow(2).mean(-1, keepdim=True)
    y = centered * torch.rsqrt(var + eps) * weight.to(torch.float32) + bias.to(torch.float32)
    return y.to(torch.promote_types(x.dtype, weight.dtype))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF convention: ``[x1, x2] -> [-x2, x1]`` on the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, HF ``apply_rotary_pos_emb`` with ``unsqueeze_dim=1``.

    q: [b, heads, s, d], k: [b, kv_heads, s, d], cos/sin: [b or 1, s, d] (or [s, d]), or only
    their first halves (width d / 2; a ``rotate_half`` table's halves are equal).
    cos/sin are indexed by the caller, so global positions under sequence parallelism work.
    """
    if cos.shape[-1] * 2 == q.shape[-1]:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if cos.dim() == 3:  # [b, s, d] -> [b, 1, s, d] to broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the LLaMA MLP activation)."""
    return F.silu(gate) * up


def _reduce(loss_rows: torch.Tensor, valid: torch.Tensor, reduction: str, num_targets) -> torch.Tensor:
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    if reduction == "sum":
        return total
    denom = valid.sum() if num_targets is None else num_targets
    return total / denom


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_targets=None,
) -> torch.Tensor:
    """Cross-entropy of ``logits [N, V]`` against ``targets [N]``, loss in fp32.

    'mean' divides by the number of targets that are not ``ignore_index``, or by
    ``num_targets`` when given (a global count when tokens are sharded across ranks).
    'none' returns per-token losses (0 where ignored).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    logits32 = logits.to(torch.float32)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    target_logit = logits32.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    loss_rows = torch.where(valid, torch.logsumexp(logits32, dim=-1) - target_logit, 0.0)
    return _reduce(loss_rows, valid, reduction, num_targets)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_targets=None,
    bias: torch.Tensor | None = None,
    weight_fp8=None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, targets)``. Materializes the full logits:
    this is the oracle, not the memory-saving path. ``weight_fp8``: the logits product on ``weight``'s
    row-wise e4m3 (``galaxy.kernels.fp8.logits_on_fp8``)."""
    if weight_fp8 is None:
        logits = F.linear(hidden, weight, bias)
    else:
        from galaxy.kernels.fp8 import logits_on_fp8

        logits = logits_on_fp8(hidden, weight, weight_fp8, "torch")
        logits = logits if bias is None else logits + bias
    return cross_entropy(logits, targets, ignore_index, reduction, num_targets)


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias) + scale * (x @ A^T) @ B^T``; A: [r, in], B: [out, r]."""
    return F.linear(x, weight, bias) + scale * F.linear(F.linear(x, lora_A), lora_B)
