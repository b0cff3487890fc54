"""``x W^T + b`` over a frozen weight kept quantized: the weight is dequantized to the compute dtype
for each matmul (forward, and again in backward, so nothing but the quantized storage is kept)
and multiplied by cuBLAS; only the input (and a trainable bias) get gradients. Shared by the
storage formats (``galaxy.loralib.nf4``, ``galaxy.loralib.int8``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

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


def dequantized_linear(x: torch.Tensor, stored: Stored, bias: Optional[torch.Tensor] = None,
                       transposed: bool = False) -> torch.Tensor:
    """``x W^T + b`` in the autocast dtype when autocast is on, else in ``x``'s dtype."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x = x.to(torch.get_autocast_dtype(device_type))
    with torch.autocast(device_type, enabled=False):
        return _DequantizedLinear.apply(x, bias, stored, transposed)
