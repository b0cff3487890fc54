"""NF4 storage (galaxy.loralib.nf4) against a reference written here from the QLoRA paper's NF4
table and against bitsandbytes' own functional quantize/dequantize (where it imports); the Triton
dequantize-and-matmul kernel (TRITON_INTERPRET=1, set in conftest.py) against the torch reference."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import pytest  # noqa: E402
import torch  # noqa: E402

from galaxy.loralib.nf4 import dequantize_absmax, dequantize_nf4, nf4_linear, quantize_nf4  # noqa: E402
from galaxy.loralib.nf4_format import NF4Rows, dynamic_code  # noqa: E402

# QLoRA (Dettmers et al. 2023), appendix E: the 16 values of the 4-bit NormalFloat data type.
PAPER_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]


def unpack(q: NF4Rows) -> torch.Tensor:
    """Codes [rows, padded cols], first element of a pair in the high nibble."""
    return torch.stack([q.packed >> 4, q.packed & 0xF], dim=-1).reshape(q.rows, -1).long()


def reference_nf4(w: torch.Tensor, block: int = 64):
    """Row by row, block by block: absmax, then the nearest of the 16 table values (a loop, fp64)."""
    table = torch.tensor(PAPER_NF4, dtype=torch.float64)
    codes, absmax = [], []
    for row in w.double():
        row_codes, row_absmax = [], []
        for start in range(0, row.numel(), block):
            chunk = row[start:start + block]
            m = chunk.abs().max()
            row_absmax.append(m)
            row_codes.append((chunk / m).unsqueeze(1).sub(table).abs().argmin(dim=1))
        codes.append(torch.cat(row_codes))
        absmax.append(torch.stack(row_absmax))
    return torch.stack(codes), torch.stack(absmax)


def test_paper_table_is_the_normal_quantiles():
    # The paper's construction: 8 positive and 7 negative quantiles of N(0, 1) at offset 0.9677, plus 0, scaled to 1.
    normal = torch.distributions.Normal(0.0, 1.0)
    offset = 0.9677083
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    torch.testing.assert_close(values / values.max(), torch.tensor(PAPER_NF4, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(5, 256), (3, 100), (2, 64 * 300)])  # partial blocks; > 256 absmax per row
def test_nf4_equals_the_paper_reference(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * 0.05
    w[0, :7] = 0.0  # a block with zeros; and exact block maxima (code 15 / 0)
    q = quantize_nf4(w)
    codes, absmax = reference_nf4(w)
    assert torch.equal(unpack(q)[:, :shape[1]], codes)
    # Double quantization: each absmax within the 8-bit dynamic code's largest rounding distance on [-1, 1]
    # (half its widest gap, or the end -1 that the signed code lacks), times its block scale.
    got = dequantize_absmax(q).double()
    code = dynamic_code().double()
    worst = max(code.diff().max().item() / 2, 1 + code.min().item(), 1 - code.max().item())
    step = worst * q.absmax_scale.double().repeat_interleave(256, 1)[:, :got.shape[1]]
    assert ((got - absmax).abs() <= step * (1 + 1e-4)).all()  # slack: the fp32 products
    # Dequantization: table value times the (double-dequantized) absmax, for every element.
    want = torch.tensor(PAPER_NF4, dtype=torch.float64)[codes] * got.repeat_interleave(64, 1)[:, :shape[1]]
    assert torch.equal(dequantize_nf4(q, torch.float64), want)
    assert torch.equal(dequantize_nf4(q, torch.float32), want.float())
    assert dequantize_nf4(q, torch.bfloat16).dtype == torch.bfloat16


def _bnb():
    try:
        import bitsandbytes.functional as bnbf
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        pytest.skip(f"bitsandbytes does not import here: {e}")
    return bnbf


def test_nf4_equals_bitsandbytes():
    bnbf = _bnb()
    torch.manual_seed(1)
    x = torch.randn(64 * 700) * 0.02  # 700 absmax: three second-level blocks, the last partial
    packed, state = bnbf.quantize_4bit(x, blocksize=64, compress_statistics=True, quant_type="nf4")
    ours = quantize_nf4(x[None])  # one row is bitsandbytes' flat layout
    assert torch.equal(ours.packed.view(-1), packed.view(-1))  # NF4 codes: identical
    assert torch.equal(ours.absmax_scale.view(-1), state.state2.absmax)
    assert torch.equal(ours.absmax_offset.view(-1), state.offset.view(-1))
    assert torch.equal(dynamic_code(), bnbf.create_dynamic_map(signed=True))
    # 8-bit absmax codes: ours is the nearest code; bitsandbytes' CPU search is nearest but for rare near-ties.
    diff = (ours.absmax_code.view(-1).long() - state.absmax.long()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
    # Dequantization of bitsandbytes' own quantized state by our code equals theirs, bit for bit.
    theirs = NF4Rows(packed.view(1, -1), state.absmax.view(1, -1), state.state2.absmax.view(1, -1),
                     state.offset.view(1), x.numel())
    for dtype in (torch.float32, torch.bfloat16):
        state.dtype = dtype
        assert torch.equal(dequantize_nf4(theirs, dtype).view(-1), bnbf.dequantize_4bit(packed, state).view(-1))


def test_nf4_rows_are_bitsandbytes_rows():
    """A matrix quantized row by row: each row is bitsandbytes' quantization of that row."""
    bnbf = _bnb()
    torch.manual_seed(2)
    w = torch.randn(4, 128 * 3)
    q = quantize_nf4(w)
    for r in range(w.shape[0]):
        packed, state = bnbf.quantize_4bit(w[r], blocksize=64, compress_statistics=True, quant_type="nf4")
        assert torch.equal(q.packed[r], packed.view(-1))
        torch.testing.assert_close(dequantize_nf4(q, torch.float32)[r], bnbf.dequantize_4bit(packed, state).view(-1),
                                   rtol=0, atol=2e-3 * w[r].abs().max().item())


@pytest.mark.parametrize("shape", [(3, 100), (5, 64 * 300)])  # a partial block; several programs a row
def test_triton_nf4_dequantize_equals_reference(shape):
    from galaxy.loralib.nf4 import triton_dequantize

    torch.manual_seed(5)
    q = quantize_nf4(torch.randn(*shape))
    for dtype in (torch.float32, torch.bfloat16):
        want = dequantize_nf4(q, dtype)
        got = triton_dequantize(q, dtype)
        assert got.dtype == dtype and got.shape == want.shape
        if dtype == torch.float32:
            assert torch.equal(got, want)  # the same fp32 operations, each rounded as in the reference
        else:  # Triton 3.9's interpreter truncates to bf16 where GPUs round to nearest (bench/bench_nf4.py checks)
            torch.testing.assert_close(got.float(), dequantize_nf4(q, torch.float32), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_triton_nf4_matmul_equals_reference(dtype, transposed):
    torch.manual_seed(3)
    rows, cols, tokens = 40, 100, 7  # partial NF4 blocks, partial tiles
    q = quantize_nf4(torch.randn(rows, cols))
    features = rows if transposed else cols
    x = torch.randn(2, tokens, features, dtype=torch.float64)
    bias = torch.randn(cols if transposed else rows, dtype=torch.float64)
    dy = torch.randn(2, tokens, cols if transposed else rows, dtype=torch.float64)
    # The truth: fp64 matmul on the weight as dequantized to `dtype`.
    w = dequantize_nf4(q, dtype).double()
    want = x.to(dtype).double() @ (w if transposed else w.t()) + bias.to(dtype).double()
    want_dx = dy.to(dtype).double() @ (w.t() if transposed else w)
    # bf16: the output is rounded to bf16 once (half an ulp, 2^-9 relative) after fp32 accumulation.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2 * want.abs().max().item())
    for backend in ("torch", "triton"):
        xb = x.to(dtype).requires_grad_()
        bb = bias.to(dtype).requires_grad_()
        y = nf4_linear(xb, q, bb, transposed=transposed, backend=backend)
        dx, db = torch.autograd.grad(y, (xb, bb), dy.to(dtype))
        assert y.dtype == dtype and dx.dtype == dtype
        torch.testing.assert_close(y.double(), want, **tol, msg=lambda m: f"{backend} forward: {m}")
        torch.testing.assert_close(dx.double(), want_dx, **tol, msg=lambda m: f"{backend} dx: {m}")
        torch.testing.assert_close(db.double(), dy.to(dtype).double().sum((0, 1)), **tol)


def test_nf4_linear_under_autocast_computes_in_the_autocast_dtype():
    torch.manual_seed(4)
    q = quantize_nf4(torch.randn(16, 64))
    x = torch.randn(3, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = nf4_linear(x, q, backend="torch")
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(y, x.detach().bfloat16() @ dequantize_nf4(q, torch.bfloat16).t())


@pytest.mark.parametrize("quantize_base", ["none", "nf4"])
def test_bf16_and_nf4_bases_run_the_fused_kernels(quantize_base, triton_cpu):
    """LoRA over a bf16-stored (or NF4) base with kernels=triton (RMSNorm, RoPE, SwiGLU, cross-entropy,
    NF4 dequantize) equals kernels=torch to bf16 rounding: loss and every LoRA gradient."""
    from galaxy.config import GalaxyConfig
    from galaxy.models.llama import LlamaForCausalLM
    from galaxy.peft import apply_tuning

    ids = torch.randint(0, 50, (2, 13), generator=torch.Generator().manual_seed(0))
    runs = {}
    for kernels in ("torch", "triton"):
        cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", seq_length=13, tuning="lora", dtype="bfloat16",
                                          kernels=kernels, quantize_base=quantize_base))
        model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.1)
        assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids)
        out.loss.backward()
        runs[kernels] = out.loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    (loss_t, grads_t), (loss_k, grads_k) = runs["torch"], runs["triton"]
    assert abs(loss_k - loss_t) < 1e-3 * loss_t
    for name, g in grads_t.items():  # bf16 activations: a few ulps (2^-8) of relative error
        assert ((grads_k[name] - g).norm() / g.norm()).item() < 5e-2, name
