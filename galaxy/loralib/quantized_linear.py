"""``x W^T + b`` over a frozen weight kept quantized: the weight is dequantized to the compute dtype
for each matmul (forward, and again in backward, so nothing but the quantized storage is kept)
and multiplied by cuBLAS; only the input (and a trainable bias) get gradients. Shared by the
storage formats (``galaxy.loralib.nf4``, ``galaxy.loralib.int8``).

Two paths compute the same thing:
* eager: ``_DequantizedLinear``, an autograd.Function whose backward dequantizes again (the format's
  fastest dequantization: for NF4 on CUDA the Triton kernel);
* inside a torch.compile graph (model key ``compile``, ``galaxy.core.compile``): plain torch ops that
  dynamo traces into the layer's graph, with no graph break and no Python per call: the format's torch
  reference dequantizes (inductor fuses it into one kernel) and the matmul is the graph's. The
  dequantization runs in a checkpointed region, so the compiled backward recomputes the weight
  from the quantized buffers instead of keeping it from forward, as the eager backward does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

# dtype -> the stored matrix S in that dtype (W [out, in], or W^T [in, out] when transposed)
Stored = Callable[[torch.dtype], torch.Tensor]


class _DequantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, stored: Stored, transposed: bool):
        x2 = x.reshape(-1, x.shape[-1])
        w = stored(x2.dtype)
        y = x2 @ (w if transposed else w.t())
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.stored, ctx.transposed, ctx.x_shape, ctx.has_bias = stored, transposed, x.shape, bias is not None
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        need_x, need_bias = ctx.needs_input_grad[:2]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dbias = None
        if need_x:  # dx = dy W: the other orientation of the same stored matrix
            w = ctx.stored(dy2.dtype)
            dx = (dy2 @ (w.t() if ctx.transposed else w)).view(ctx.x_shape)
        if ctx.has_bias and need_bias:
            dbias = dy2.sum(0)
        return dx, dbias, None, None


def _weight_transposed(stored: Stored, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    """``W^T [in, out]`` in ``dtype``: the right operand of ``x W^T``. Oriented inside the checkpointed
    region, so what the backward's matmul needs is the region's own (recomputed) output, not a view of
    it that the compiled graph would keep from forward."""
    w = stored(dtype)
    return w if transposed else w.t()


def _traced_linear(x: torch.Tensor, stored: Stored, bias: Optional[torch.Tensor], transposed: bool) -> torch.Tensor:
    """The linear as plain ops for a torch.compile graph; the weight recomputed in backward."""
    weight_t = checkpoint(_weight_transposed, stored, transposed, x.dtype, use_reentrant=False)
    y = x @ weight_t
    return y if bias is None else y + bias.to(y.dtype)


def dequantized_linear(x: torch.Tensor, stored: Stored, bias: Optional[torch.Tensor] = None,
                       transposed: bool = False) -> torch.Tensor:
    """``x W^T + b`` in the autocast dtype when autocast is on, else in ``x``'s dtype. Inside a
    torch.compile graph ``stored`` must be traceable (the format's torch reference)."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    with torch.autocast(device_type, enabled=False):
        if torch.compiler.is_compiling():
            return _traced_linear(x, stored, bias, transposed)
        return _DequantizedLinear.apply(x, bias, stored, transposed)
