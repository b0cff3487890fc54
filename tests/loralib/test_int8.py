"""Row-wise int8 storage (``galaxy.loralib.int8``): each row's codes are its values scaled to +-127 by the
row's absmax and rounded, so dequantization is within half a step of the weight and the absmax's
entry is +-127; a row quantizes alone, so a shard of whole rows is the serial quantization of those
rows; ``int8_linear`` is ``F.linear`` on the dequantized weight. (bitsandbytes' own
``int8_vectorwise_quant`` is the reference in tests/loralib/test_qlora.py.)"""

import pytest
import torch
import torch.nn.functional as F

from galaxy.loralib.int8 import dequantize_int8, int8_linear, quantize_int8


def weight():
    w = torch.randn(6, 20, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 6)[:, None]
    w[2, 4] = -w[2].abs().max() * 2  # a negative absmax
    return w


def test_dequantization_is_within_half_a_step_and_rows_quantize_alone():
    w = weight()
    q = quantize_int8(w)
    assert q.codes.dtype == torch.int8 and (q.rows, q.cols) == (6, 20) and torch.equal(q.absmax, w.abs().amax(1))
    back = dequantize_int8(q, torch.float64)
    step = q.absmax.double()[:, None] / 127
    assert ((back - w.double()).abs() <= step / 2 * (1 + 1e-6)).all()
    assert q.codes[2, 4] == -127 and q.codes.abs().amax(1).eq(127).all()
    shard = quantize_int8(w[3:5])
    assert torch.equal(shard.codes, q.codes[3:5]) and torch.equal(shard.absmax, q.absmax[3:5])
    with pytest.raises(ValueError, match="takes a matrix"):
        quantize_int8(w[0])


def test_int8_linear_is_f_linear_on_the_dequantized_weight():
    w = weight()
    q = quantize_int8(w)
    x = torch.randn(2, 4, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64)
    want = F.linear(x, dequantize_int8(q, torch.float64), bias)
    torch.testing.assert_close(int8_linear(x, q, bias), want, rtol=1e-14, atol=1e-14)
    x_t = torch.randn(3, 6, dtype=torch.float64)  # the same storage read as W^T [in, out]
    torch.testing.assert_close(int8_linear(x_t, q, transposed=True), x_t @ dequantize_int8(q, torch.float64),
                               rtol=1e-14, atol=1e-14)
