"""Row-wise e4m3 quantization of activations (galaxy.kernels.fp8): the torch reference against a
nearest-value search over every e4m3 number written here, and the Triton kernel (TRITON_INTERPRET=1)
against the reference, bit for bit: codes, signs of zero, subnormals, scales."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import pytest  # noqa: E402
import torch  # noqa: E402

from galaxy.kernels.fp8 import E4M3, E4M3_MAX, quantize_rows, quantize_rows_reference  # noqa: E402


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3fn number (fp64), from its 256 bit patterns."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).double()
    return values[values.isfinite()].unique()


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Each element's nearest e4m3 value (fp64); the caller avoids exact ties."""
    table = e4m3_values()
    return table[(x.double().unsqueeze(-1) - table).abs().argmin(dim=-1)]


def activations(dtype=torch.float32, rows=23, cols=300, seed=0):
    """Rows over eight decades, a block of tiny values (e4m3 subnormals after scaling), a zero row, a -0."""
    g = torch.Generator().manual_seed(seed)
    decades = torch.logspace(-4, 4, rows, dtype=torch.float64)[:, None]
    a = torch.randn(rows, cols, generator=g, dtype=torch.float64) * decades
    a[:, :30] *= 1e-4
    a[3] = 0.0
    a[4, 5] = -0.0
    return a.to(dtype)


@pytest.mark.parametrize("with_col_scale", [False, True])
def test_reference_is_the_nearest_e4m3_of_the_row_scaled_by_its_amax(with_col_scale):
    a = activations(torch.float64)
    col = torch.rand(a.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
    scaled = a * col if with_col_scale else a
    codes, scale = quantize_rows_reference(a, col if with_col_scale else None)
    assert codes.dtype == E4M3 and scale.shape == (a.shape[0], 1)
    amax = scaled.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(scale, amax.clamp(min=1e-12) / E4M3_MAX, rtol=0, atol=0)
    assert torch.equal(codes.double(), nearest_e4m3(scaled / scale))
    nonzero = amax.squeeze(1) > 0
    assert torch.equal(codes.double().abs().amax(dim=1)[nonzero], torch.full((int(nonzero.sum()),), E4M3_MAX,
                                                                          dtype=torch.float64))
    assert (codes.double()[3] == 0).all()  # a zero row: zeros, a finite scale
    assert (codes.double().abs() < 2 ** -6).any()  # subnormals are exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_col_scale", [False, True])
def test_triton_quantization_equals_the_reference(triton_cpu, dtype, with_col_scale):
    a = activations(dtype, cols=300)  # a partial block of 512
    col = torch.rand(300, generator=torch.Generator().manual_seed(2)) + 0.5 if with_col_scale else None
    codes, scale = quantize_rows(a, col, backend="triton")
    want_codes, want_scale = quantize_rows_reference(a, col)
    assert codes.dtype == E4M3 and scale.dtype == torch.float32
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))  # -0.0 and subnormals too
    assert torch.equal(scale, want_scale)


def test_triton_quantization_of_strided_rows(triton_cpu):
    """A [b, s, h] view whose rows are not contiguous (the attention output's transpose) is read as rows."""
    a = activations(rows=24, cols=64).view(4, 6, 64).transpose(0, 1)
    codes, scale = quantize_rows(a, None, backend="triton")
    want_codes, want_scale = quantize_rows_reference(a.reshape(-1, 64))
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_auto_is_torch_on_cpu():
    a = activations()
    codes, scale = quantize_rows(a)
    want_codes, want_scale = quantize_rows_reference(a)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scale, want_scale)
