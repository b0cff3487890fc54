"""``x W^T + b`` over a frozen stored weight (``galaxy.loralib.quantized_linear.dequantized_linear``) against
``F.linear`` in fp64, forward and the input's and bias's gradients, W stored as is or transposed; the stored
weight is read again in backward (nothing of it kept) and gets no gradient; under autocast it computes in
the autocast dtype."""

import pytest
import torch
import torch.nn.functional as F

from galaxy.loralib.quantized_linear import dequantized_linear


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_f_linear_forward_and_backward(transposed, with_bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 7, generator=g, dtype=torch.float64)  # [out, in]
    reads = []

    def stored(dtype):
        reads.append(dtype)
        return (w.t() if transposed else w).to(dtype)

    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    y = dequantized_linear(x, stored, bias, transposed)
    x_ref = x.detach().clone().requires_grad_()
    bias_ref = bias.detach().clone().requires_grad_() if with_bias else None
    y_ref = F.linear(x_ref, w, bias_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-14, atol=1e-14)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-14, atol=1e-14)
    if with_bias:
        torch.testing.assert_close(bias.grad, bias_ref.grad, rtol=1e-14, atol=1e-14)
    assert reads == [torch.float64, torch.float64]  # dequantized in forward and again in backward


def test_autocast_computes_in_the_autocast_dtype():
    w = torch.randn(4, 6, dtype=torch.float32)
    x = torch.randn(3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = dequantized_linear(x, lambda dtype: w.to(dtype))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, x.bfloat16() @ w.bfloat16().t())
