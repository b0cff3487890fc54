"""The Triton NF4 dequantization called directly (``galaxy.kernels.triton_nf4.nf4_dequantize``; through
``galaxy.loralib.nf4.triton_dequantize`` it is checked bit for bit in fp32 in tests/loralib/test_nf4.py):
the fp16 it writes is the fp32 reference rounded to fp16, and a dtype it does not write is refused."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import pytest  # noqa: E402
import torch  # noqa: E402

from galaxy.kernels.triton_nf4 import nf4_dequantize  # noqa: E402
from galaxy.loralib.nf4 import dequantize_nf4, quantize_nf4  # noqa: E402
from galaxy.loralib.nf4_format import BLOCK, SCALE_BLOCK, dynamic_code, nf4_code  # noqa: E402


def dequantize(q, dtype):
    cpu = torch.device("cpu")
    return nf4_dequantize(q.packed, q.absmax_code, q.absmax_scale, q.absmax_offset, q.cols, nf4_code(cpu),
                          dynamic_code(cpu), BLOCK, SCALE_BLOCK, dtype)


def test_fp16_is_the_fp32_reference_rounded(triton_cpu):
    q = quantize_nf4(torch.randn(3, 100, generator=torch.Generator().manual_seed(0)))  # a partial block
    got = dequantize(q, torch.float16)
    assert got.dtype == torch.float16
    # within one fp16 rounding of the fp32 values (the interpreter may truncate where a GPU rounds)
    torch.testing.assert_close(got.float(), dequantize_nf4(q, torch.float32), rtol=2 ** -10, atol=0)
    with pytest.raises(ValueError, match="writes fp32/bf16/fp16, not torch.float64"):
        dequantize(q, torch.float64)
