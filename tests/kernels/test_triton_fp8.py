"""The Triton fp8 row quantization called directly (``galaxy.kernels.triton_fp8.fp8_quantize_rows``) with the
settings its dispatcher (``galaxy.kernels.fp8.quantize_rows``, tested in test_fp8.py) fixes: a
row's amax floor and the code limit are the caller's, rows of ``[..., cols]`` are taken as laid out,
no rows is no launch, and what it cannot read is refused."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import pytest  # noqa: E402
import torch  # noqa: E402

from galaxy.kernels.fp8 import E4M3, E4M3_MAX  # noqa: E402
from galaxy.kernels.triton_fp8 import fp8_quantize_rows  # noqa: E402


def reference(a, floor, limit):
    """Each row divided by ``max(amax, floor) / limit`` (fp32), clamped, cast to e4m3 (round to nearest even)."""
    rows = a.reshape(-1, a.shape[-1]).float()
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=floor) / limit
    return (rows / scale).clamp(-limit, limit).to(E4M3), scale


@pytest.mark.parametrize("floor,limit", [(1e-12, E4M3_MAX), (0.5, E4M3_MAX), (1e-12, 240.0)])
def test_floor_and_limit_are_the_callers(triton_cpu, floor, limit):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 50, generator=g) * torch.tensor([1e-3, 0.1, 2.0])[:, None]  # rows below and above the floor
    codes, scale = fp8_quantize_rows(a, None, E4M3, limit, floor)
    want_codes, want_scale = reference(a, floor, limit)
    assert torch.equal(scale, want_scale) and torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))


def test_no_rows_and_fp64_inputs(triton_cpu):
    codes, scale = fp8_quantize_rows(torch.empty(0, 16), None, E4M3, E4M3_MAX, 1e-12)
    assert codes.shape == (0, 16) and codes.dtype == E4M3 and scale.shape == (0, 1)
    with pytest.raises(ValueError, match="reads fp32/bf16/fp16, not torch.float64"):
        fp8_quantize_rows(torch.ones(2, 4, dtype=torch.float64), None, E4M3, E4M3_MAX, 1e-12)
