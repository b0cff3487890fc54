"""Triton kernels vs their torch references (forward and every gradient), and the
references vs independent implementations (torch.nn.functional, transformers).

Triton kernels run on CPU via TRITON_INTERPRET=1 (set in conftest.py); shapes are small
and deliberately odd (non-power-of-2 widths, partial blocks, ignored targets).
"""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import galaxy.kernels as K  # noqa: E402
from galaxy.kernels import reference as R  # noqa: E402
from tests import REPO  # noqa: E402

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-2, atol=2e-2)


def leaf(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def grads(out, inputs, grad_out):
    """Gradients of ``out`` w.r.t. those inputs that require grad (None elsewhere)."""
    outs = out if isinstance(out, tuple) else (out,)
    gos = grad_out if isinstance(grad_out, tuple) else (grad_out,)
    wanted = [t for t in inputs if t.requires_grad]
    got = iter(torch.autograd.grad(outs, wanted, gos))
    return [next(got) if t.requires_grad else None for t in inputs]


def fp64_truth(fn, inputs, grad_out):
    """Outputs and input gradients of ``fn`` run in float64 on upcast copies of ``inputs``:
    the oracle for bf16 tests, where the bf16 reference has its own rounding error."""
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs64)
    outs = out if isinstance(out, tuple) else (out,)
    gos = tuple(g.double() for g in (grad_out if isinstance(grad_out, tuple) else (grad_out,)))
    return [*outs, *grads(out, inputs64, gos if isinstance(out, tuple) else gos[0])]


def assert_all_close(xs, ys, cast=False, **tol):
    assert len(xs) == len(ys)
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x is None or y is None:
            assert x is None and y is None, f"item {i}: one gradient is None"
            continue
        if cast:  # compare against a higher-precision truth in the tested dtype
            y = y.to(x.dtype)
        assert x.dtype == y.dtype, f"item {i}: dtype {x.dtype} != {y.dtype}"
        torch.testing.assert_close(x, y, **tol, msg=lambda m, i=i: f"item {i}: {m}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class MaxAllocation(TorchDispatchMode):
    """Records the largest new tensor any torch op produces while active
    (views, in-place and out= results alias existing memory and are not counted)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(ret.alias_info is not None for ret in func._schema.returns):
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


# ---------------------------------------------------------------- backend selection


def test_invalid_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        K.rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        K.lora_linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(1, 4), torch.randn(3, 1), 1.0, backend="x")


def test_auto_picks_per_op_from_the_measured_table(monkeypatch):
    from galaxy.kernels import _backend

    picks = {"H100": {"swiglu": _backend.Pick("triton", 1000, "m1"), "layer_norm": _backend.Pick("torch", 0, "m2")},
             "H200": {"swiglu": _backend.Pick("torch", 0, "m3")}}
    monkeypatch.setattr(_backend, "AUTO_PICKS", picks)
    assert _backend.device_class("NVIDIA H100 80GB HBM3") == "H100"
    assert _backend.auto_pick("swiglu", "NVIDIA H100 80GB HBM3") == "triton"
    assert _backend.auto_pick("swiglu", "NVIDIA H100 80GB HBM3", numel=1000) == "triton"
    assert _backend.auto_pick("swiglu", "NVIDIA H100 80GB HBM3", numel=999) == "torch"  # below min_numel
    assert _backend.auto_pick("swiglu", "NVIDIA H200") == "torch"
    assert _backend.auto_pick("layer_norm", "NVIDIA H100 PCIe") == "torch"
    assert _backend.auto_pick("rope", "NVIDIA H100 PCIe") == "torch"  # not in the table: torch
    assert _backend.device_class("NVIDIA A100-SXM4-80GB") is None
    assert _backend.auto_pick("swiglu", "NVIDIA A100-SXM4-80GB") == "triton"  # FALLBACK_CLASS's picks
    with pytest.raises(ValueError, match="unknown kernel op"):
        _backend.auto_pick("softmax", "NVIDIA H100")


def test_auto_table_names_known_ops_and_its_measurements():
    from galaxy.kernels import _backend

    assert _backend.FALLBACK_CLASS in _backend.AUTO_PICKS
    for cls, picks in _backend.AUTO_PICKS.items():
        for op, pick in picks.items():
            assert op in _backend.OPS and pick.backend in ("triton", "torch") and pick.measured, (cls, op)


def test_launch_settings_follow_the_device_class(triton_cpu, monkeypatch):
    from galaxy.kernels import _backend, triton_cross_entropy

    monkeypatch.setattr(_backend, "_cuda_device_name", {0: "NVIDIA H200", 1: "NVIDIA A100-SXM4-80GB"}.get)
    assert _backend.device_class_of(torch.device("cuda", 0)) == "H200"
    assert _backend.device_class_of(torch.device("cuda", 1)) == _backend.FALLBACK_CLASS  # not measured
    assert _backend.device_class_of(torch.device("cpu")) == _backend.FALLBACK_CLASS  # the interpreter
    # Every class auto can land on has its cross-entropy tiles, each ending with an open-ended vocab.
    assert set(triton_cross_entropy.GRAD_TILES) == set(_backend.AUTO_PICKS)
    assert all(tiles[-1][0] is None for tiles in triton_cross_entropy.GRAD_TILES.values())


def test_auto_uses_torch_on_cpu():
    assert K.resolve_backend("auto", torch.randn(2)) == "torch"
    assert K.resolve_backend("torch", torch.randn(2)) == "torch"


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    if not K.triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        K.swiglu(torch.randn(4), torch.randn(4), backend="triton")


def test_package_imports_and_falls_back_without_triton():
    """In a fresh interpreter where `import triton` fails, the package still imports, auto
    runs the torch path, and backend='triton' names the pip command."""
    code = textwrap.dedent(
        """
        import sys
        class _NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked for this test")
        sys.meta_path.insert(0, _NoTriton())
        import torch
        import galaxy.kernels as K
        assert not K.triton_available()
        x, w = torch.randn(3, 8), torch.ones(8)
        torch.testing.assert_close(K.rms_norm(x, w, 1e-6), K.reference.rms_norm(x, w, 1e-6))
        try:
            K.rms_norm(x, w, 1e-6, backend="triton")
        except ImportError as err:
            assert "pip install triton" in str(err), err
        else:
            raise AssertionError("backend='triton' without triton did not raise")
        print("OK")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(), timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr


def test_kernels_compile_for_cuda_without_gpu(tmp_path):
    """The real Triton compiler (not the interpreter) accepts every kernel, down to sm_90 code."""
    if not K.triton_available():
        pytest.skip("triton is not installed")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile for")
    env = _subprocess_env(TRITON_CACHE_DIR=str(tmp_path))  # fresh cache: really compile
    env.pop("TRITON_INTERPRET", None)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_all_kernels.py")
    proc = subprocess.run([sys.executable, script, "90"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("OK ") == 32, proc.stdout  # 16 kernel variants x 2 dtypes


def _subprocess_env(**extra):
    root = REPO
    return dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


# ---------------------------------------------------------------- references vs real implementations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_matches_transformers(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = llama.LlamaRMSNorm(100, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(100))
    x = leaf(3, 5, 100, dtype=dtype)
    w = hf.weight.detach().clone().requires_grad_()
    y_hf, y = hf(x), R.rms_norm(x, w, 1e-5)
    assert torch.equal(y, y_hf)
    dy = torch.randn_like(y)
    assert_all_close(grads(y, (x, w), dy), grads(y_hf, (x, hf.weight), dy), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_reference_matches_torch(dtype):
    x, w, b = leaf(4, 7, 48, dtype=dtype), leaf(48, dtype=dtype), leaf(48, dtype=dtype)
    y = R.layer_norm(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    # Truth from F.layer_norm in fp64 (torch's own bf16 CPU kernel accumulates the bias
    # gradient in low precision, so it is not a sharper oracle than the reference).
    truth = fp64_truth(lambda *t: F.layer_norm(t[0], (48,), t[1], t[2], 1e-5), (x, w, b), dy)
    tol = FP32 if dtype == torch.float32 else BF16
    assert_all_close([y, *grads(y, (x, w, b), dy)], truth, cast=True, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_reference_matches_transformers(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    rotary = llama.LlamaRotaryEmbedding(config)
    q, k = leaf(2, 4, 6, 24, dtype=dtype), leaf(2, 2, 6, 24, dtype=dtype)
    # Global positions of a sequence shard that starts at token 10 (as under SP).
    positions = torch.arange(10, 16).expand(2, 6)
    cos, sin = rotary(q, positions)
    q_hf, k_hf = llama.apply_rotary_pos_emb(q, k, cos, sin)
    q_r, k_r = R.apply_rope(q, k, cos, sin)
    assert torch.equal(q_r, q_hf) and torch.equal(k_r, k_hf)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_reference_matches_torch(reduction):
    logits, targets = leaf(19, 257), torch.randint(0, 257, (19,))
    targets[::4] = -100
    loss = R.cross_entropy(logits, targets, reduction=reduction)
    loss_t = F.cross_entropy(logits, targets, reduction=reduction)
    dl = torch.randn_like(loss)
    assert_all_close([loss, *grads(loss, (logits,), dl)], [loss_t, *grads(loss_t, (logits,), dl)], **FP32)


def test_cross_entropy_reference_explicit_denominator():
    logits, targets = leaf(10, 33), torch.randint(0, 33, (10,))
    targets[:3] = -100
    summed = F.cross_entropy(logits, targets, reduction="sum")
    torch.testing.assert_close(R.cross_entropy(logits, targets, num_targets=40), summed / 40, **FP32)


def test_fused_linear_cross_entropy_reference_matches_torch():
    h, w, b, targets = leaf(11, 16), leaf(257, 16), leaf(257), torch.randint(0, 257, (11,))
    targets[1] = -100
    loss = R.fused_linear_cross_entropy(h, w, targets, bias=b)
    loss_t = F.cross_entropy(F.linear(h, w, b), targets)
    torch.testing.assert_close(loss, loss_t, **FP32)


# ---------------------------------------------------------------- Triton vs reference: norms


NORM_SHAPES = [(2, 7, 100), (13, 48), (1, 3, 5, 33)]


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_triton_fp32(triton_cpu, shape):
    x, w = leaf(*shape), leaf(shape[-1])
    y = K.rms_norm(x, w, 1e-6, backend="triton")
    y_r = R.rms_norm(x, w, 1e-6)
    dy = torch.randn_like(y)
    assert_all_close([y, *grads(y, (x, w), dy)], [y_r, *grads(y_r, (x, w), dy)], **FP32)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_triton_bf16_input(triton_cpu, w_dtype):
    # bf16 activations with a bf16 or fp32 weight: output dtype follows HF's promotion.
    x, w = leaf(6, 100, dtype=torch.bfloat16), leaf(100, dtype=w_dtype)
    y = K.rms_norm(x, w, 1e-6, backend="triton")
    assert y.dtype == R.rms_norm(x, w, 1e-6).dtype
    dy = torch.randn_like(y)
    truth = fp64_truth(lambda a, b: R.rms_norm(a, b, 1e-6), (x, w), dy)
    assert_all_close([y, *grads(y, (x, w), dy)], truth, cast=True, **BF16)


def test_rms_norm_triton_noncontiguous_and_frozen_weight(triton_cpu):
    base = leaf(48, 10)
    x = base.t()  # [10, 48] with a non-unit last stride
    w = torch.randn(48)  # frozen: no weight grad requested
    y = K.rms_norm(x, w, 1e-5, backend="triton")
    y_r = R.rms_norm(x, w, 1e-5)
    dy = torch.randn_like(y)
    assert_all_close([y, *grads(y, (base, w), dy)], [y_r, *grads(y_r, (base, w), dy)], **FP32)


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_layer_norm_triton_fp32(triton_cpu, shape):
    x, w, b = leaf(*shape, scale=3.0), leaf(shape[-1]), leaf(shape[-1])
    with torch.no_grad():
        x += 5.0  # a large mean, so a wrong centering would show
    y = K.layer_norm(x, w, b, 1e-5, backend="triton")
    y_r = R.layer_norm(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    assert_all_close([y, *grads(y, (x, w, b), dy)], [y_r, *grads(y_r, (x, w, b), dy)], **FP32)


def test_layer_norm_triton_bf16(triton_cpu):
    x, w, b = (leaf(5, 100, dtype=torch.bfloat16), leaf(100, dtype=torch.bfloat16), leaf(100, dtype=torch.bfloat16))
    y = K.layer_norm(x, w, b, 1e-5, backend="triton")
    dy = torch.randn_like(y)
    truth = fp64_truth(lambda *t: F.layer_norm(t[0], (100,), t[1], t[2], 1e-5), (x, w, b), dy)
    assert_all_close([y, *grads(y, (x, w, b), dy)], truth, cast=True, **BF16)


def test_layer_norm_triton_half_input_over_fp32_weights_returns_fp32(triton_cpu):
    # Autocast's case (bf16 activations, fp32 master weights): F.layer_norm runs in fp32 there and
    # returns fp32, so the kernel must not round its output to bf16.
    x, w, b = leaf(6, 100, dtype=torch.bfloat16), leaf(100), leaf(100)
    y = K.layer_norm(x, w, b, 1e-5, backend="triton")
    y_r = R.layer_norm(x, w, b, 1e-5)
    assert y.dtype == y_r.dtype == F.layer_norm(x.float(), (100,), w, b, 1e-5).dtype == torch.float32
    dy = torch.randn_like(y)
    truth = fp64_truth(lambda *t: F.layer_norm(t[0], (100,), t[1], t[2], 1e-5), (x, w, b), dy)
    dx, dw, db = grads(y, (x, w, b), dy)
    ty, tdx, tdw, tdb = truth
    # fp32 output and parameter gradients to fp32 precision; dx is bf16 like x.
    assert_all_close([y, dw, db], [ty, tdw, tdb], cast=True, rtol=1e-5, atol=1e-5)
    assert_all_close([dx], [tdx], cast=True, **BF16)


@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_layer_norm_triton_one_parameter_frozen(triton_cpu, frozen):
    # Only one of dweight / dbias is summed then (the other half of the partial rows is skipped).
    x, w, b = leaf(9, 40), leaf(40), leaf(40)
    (w if frozen == "weight" else b).requires_grad_(False)
    y = K.layer_norm(x, w, b, 1e-5, backend="triton")
    y_r = R.layer_norm(x, w, b, 1e-5)
    dy = torch.randn_like(y)
    assert_all_close([y, *grads(y, (x, w, b), dy)], [y_r, *grads(y_r, (x, w, b), dy)], **FP32)


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.bfloat16, torch.float32)])
def test_sum_partials_adds_up_columns_in_the_asked_dtypes(triton_cpu, dtypes):
    # More partial rows than one row tile and a column count off the tile: the loop and both masks run.
    from galaxy.kernels.triton_norms import sum_partials

    partials = torch.randn(150, 70, dtype=torch.float64).float()
    outs = sum_partials(partials, dtypes, block_c=32, block_p=64)
    truth = partials.double().sum(0).split(70 // len(dtypes))
    assert len(outs) == len(dtypes)
    for out, want, dtype in zip(outs, truth, dtypes):
        assert out.dtype == dtype and out.shape == want.shape
        torch.testing.assert_close(out, want.to(dtype), **(FP32 if dtype == torch.float32 else BF16))


# ---------------------------------------------------------------- Triton vs reference: RoPE


@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rope_triton_fp32_gqa_noncontiguous(triton_cpu, cos_batch):
    b, hq, hk, s, d = 2, 6, 2, 5, 24  # GQA, half head_dim 12 (not a power of 2)
    q_bshd = leaf(b, s, hq, d)
    q = q_bshd.transpose(1, 2)  # [b, h, s, d] view, as attention code produces it
    k = leaf(b, hk, s, d)
    # Independent halves (not HF's duplicated frequencies) so every coefficient is exercised.
    cos, sin = torch.randn(cos_batch, s, d), torch.randn(cos_batch, s, d)
    out = K.apply_rope(q, k, cos, sin, backend="triton")
    out_r = R.apply_rope(q, k, cos, sin)
    dout = (torch.randn_like(out[0]), torch.randn_like(out[1]))
    assert_all_close(
        [*out, *grads(out, (q_bshd, k), dout)], [*out_r, *grads(out_r, (q_bshd, k), dout)], **FP32
    )


@pytest.mark.parametrize("half_table", [False, True])
def test_rope_triton_bf16_with_hf_tables(triton_cpu, half_table):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32)
    q, k = leaf(1, 4, 7, 32, dtype=torch.bfloat16), leaf(1, 1, 7, 32, dtype=torch.bfloat16)
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, torch.arange(100, 107)[None])
    # HF's tables repeat their first half; the half-width form passes it once (a strided view).
    c, s = (cos[..., :16], sin[..., :16]) if half_table else (cos, sin)
    out = K.apply_rope(q, k, c, s, backend="triton")
    dout = (torch.randn_like(out[0]), torch.randn_like(out[1]))
    truth = fp64_truth(lambda a, b: llama.apply_rotary_pos_emb(a, b, cos.double(), sin.double()), (q, k), dout)
    assert_all_close([*out, *grads(out, (q, k), dout)], truth, cast=True, **BF16)


def test_rope_half_tables_match_full_tables_in_fp64():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    q, k = leaf(2, 4, 6, 24, dtype=torch.float64), leaf(2, 2, 6, 24, dtype=torch.float64)
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, torch.arange(3, 9).expand(2, 6))
    cos, sin = cos.double(), sin.double()
    want = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = R.apply_rope(q, k, cos[..., :12], sin[..., :12])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rope_rejects_bad_shapes(triton_cpu):
    q, k = torch.randn(1, 2, 3, 5), torch.randn(1, 2, 3, 5)
    with pytest.raises(ValueError, match="even"):
        K.apply_rope(q, k, torch.randn(1, 3, 5), torch.randn(1, 3, 5), backend="triton")
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="cos"):
        K.apply_rope(q, k, torch.randn(1, 4, 4), torch.randn(1, 4, 4), backend="triton")
    with pytest.raises(ValueError, match="head_dim or head_dim / 2"):
        K.apply_rope(q, k, torch.randn(1, 3, 3), torch.randn(1, 3, 3), backend="triton")
    with pytest.raises(ValueError, match="same width"):
        K.apply_rope(q, k, torch.randn(1, 3, 4), torch.randn(1, 3, 2), backend="triton")


def test_ce_designs_bench_checks_every_design_against_torch(triton_cpu, tmp_path):
    from bench import ce_designs

    out = tmp_path / "designs.json"
    assert ce_designs.main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["design"] for r in rows} == {"galaxy", "lane", "persistent", "ablation", "tail"}
    assert all(r["ok"] and r["exact"] for r in rows)


# ---------------------------------------------------------------- Triton vs reference: SwiGLU


def test_swiglu_triton_fp32(triton_cpu):
    gate, up = leaf(3, 5, 100, scale=3.0), leaf(3, 5, 100)  # 1500 elements: a partial block
    y = K.swiglu(gate, up, backend="triton")
    y_r = R.swiglu(gate, up)
    dy = torch.randn_like(y)
    assert_all_close([y, *grads(y, (gate, up), dy)], [y_r, *grads(y_r, (gate, up), dy)], **FP32)


def test_swiglu_triton_bf16(triton_cpu):
    gate, up = leaf(7, 100, dtype=torch.bfloat16, scale=3.0), leaf(7, 100, dtype=torch.bfloat16)
    y = K.swiglu(gate, up, backend="triton")
    dy = torch.randn_like(y)
    truth = fp64_truth(R.swiglu, (gate, up), dy)
    assert_all_close([y, *grads(y, (gate, up), dy)], truth, cast=True, **BF16)


# ---------------------------------------------------------------- Triton vs reference: cross-entropy


def _targets(n, vocab, ignore_every=4):
    t = torch.randint(0, vocab, (n,))
    t[::ignore_every] = -100
    return t


@pytest.mark.parametrize("vocab,block_v", [(257, 64), (1000, 128), (1000, None)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_triton_fp32(triton_cpu, vocab, block_v, reduction, inplace):
    from galaxy.kernels.triton_cross_entropy import TritonCrossEntropy

    logits, targets = leaf(13, vocab, scale=4.0), _targets(13, vocab)
    loss_r = R.cross_entropy(logits, targets, reduction=reduction)
    dl = torch.randn_like(loss_r)
    expected = [loss_r, *grads(loss_r, (logits,), dl)]
    # In place the logits' memory becomes their gradient: give the kernel its own copy.
    z = logits.detach().clone().requires_grad_() if inplace else logits
    loss = TritonCrossEntropy.apply(z, targets, -100, reduction, None, block_v, inplace)
    assert_all_close([loss, *grads(loss, (z,), dl)], expected, **FP32)


@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_triton_one_hot_lands_in_every_block(triton_cpu, inplace):
    # The one-hot is subtracted by a last store over the block's: targets at the first and last
    # column, in the last (register-held, partial) block and in the re-read blocks.
    from galaxy.kernels.triton_cross_entropy import TritonCrossEntropy

    vocab, block_v = 300, 64  # blocks of 64: four re-read, the last holds 44 columns
    targets = torch.tensor([0, 299, 256, 255, 63, 64, 130, -100])
    logits = leaf(len(targets), vocab, scale=4.0)
    loss_r = R.cross_entropy(logits, targets)
    expected = [loss_r, *grads(loss_r, (logits,), torch.ones(()))]
    z = logits.detach().clone().requires_grad_() if inplace else logits
    loss = TritonCrossEntropy.apply(z, targets, -100, "mean", None, block_v, inplace)
    assert_all_close([loss, *grads(loss, (z,), torch.ones(()))], expected, **FP32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a race between warps needs a GPU")
def test_cross_entropy_in_place_reads_the_target_logit_before_any_warp_overwrites_it():
    # Without the barrier before the in-place stores, a warp that ran ahead overwrote a row's target
    # entry before a slower warp read it as a logit: ~1 wrong loss row per 4096-row call on H100
    # (fp32, 32k vocab, 16 warps), 0 in 30 calls with it.
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        pytest.skip("the interpreter runs programs one thread at a time")
    from galaxy.kernels.triton_cross_entropy import ce_forward_rows

    torch.manual_seed(0)
    n, vocab = 4096, 32000
    logits = torch.randn(n, vocab, device="cuda") * 2
    targets = torch.randint(0, vocab, (n,), device="cuda")
    want = F.cross_entropy(logits.double(), targets, reduction="none")
    for _ in range(30):
        z = logits.clone()
        loss = ce_forward_rows(z, targets, -100, z, torch.ones((), device="cuda"))
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)


def test_cross_entropy_inplace_unit_grad_and_single_backward(triton_cpu):
    """grad_output 1 (loss.backward()) leaves the in-forward gradient as it is; a second backward raises."""
    logits, targets = leaf(9, 300, scale=3.0), _targets(9, 300)
    expected = grads(R.cross_entropy(logits, targets), (logits,), torch.tensor(1.0))
    z = logits.detach().clone().requires_grad_()
    loss = K.cross_entropy(z, targets, backend="triton", inplace=True)
    loss.backward(retain_graph=True)
    assert_all_close([z.grad], expected, **FP32)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_cross_entropy_gradient_from_forward_leaves_logits_and_runs_backward_once(triton_cpu):
    """Not in place, forward writes the gradient into its own buffer: the logits stay as they were,
    a non-unit upstream gradient scales it, and a second backward raises instead of rescaling."""
    logits, targets = leaf(11, 300, scale=3.0), _targets(11, 300)
    before = logits.detach().clone()
    loss = K.cross_entropy(logits, targets, backend="triton")
    assert torch.equal(logits.detach(), before)
    loss_r = R.cross_entropy(logits, targets)
    g = torch.tensor(0.37)
    got = torch.autograd.grad(loss, logits, g, retain_graph=True)
    assert_all_close([loss, *got], [loss_r, *grads(loss_r, (logits,), g)], **FP32)
    with pytest.raises(RuntimeError, match="only once"):
        torch.autograd.grad(loss, logits, g)


def test_cross_entropy_no_grad_allocates_no_gradient(triton_cpu):
    logits, targets = leaf(8, 300), _targets(8, 300)
    with torch.no_grad(), MaxAllocation() as mode:
        loss = K.cross_entropy(logits, targets, backend="triton")
    assert mode.max_numel < logits.numel(), "a [N, V] gradient buffer was allocated under no_grad"
    torch.testing.assert_close(loss, R.cross_entropy(logits, targets), **FP32)


def test_cross_entropy_triton_dispatch_3d_bf16_num_targets(triton_cpu):
    logits = leaf(2, 5, 257, dtype=torch.bfloat16, scale=4.0)
    targets = _targets(10, 257).view(2, 5)
    loss = K.cross_entropy(logits, targets, num_targets=37, backend="triton")
    assert loss.dtype == torch.float32
    dl = torch.randn_like(loss)
    truth = fp64_truth(lambda t: F.cross_entropy(t, targets.view(-1), reduction="sum") / 37, (logits.view(-1, 257),), dl)
    assert_all_close([loss, *grads(loss, (logits,), dl)], [truth[0], truth[1].view(2, 5, 257)], cast=True, **BF16)
    per_token = K.cross_entropy(logits, targets, reduction="none", backend="triton")
    assert per_token.shape == targets.shape
    torch.testing.assert_close(per_token, K.cross_entropy(logits, targets, reduction="none", backend="torch"), **BF16)


def test_cross_entropy_triton_bad_target_gives_nan(triton_cpu):
    logits, targets = torch.randn(3, 50), torch.tensor([1, 50, -100])
    loss = K.cross_entropy(logits, targets, reduction="none", backend="triton")
    assert torch.isnan(loss[1]) and torch.isfinite(loss[0]) and loss[2] == 0


# ---------------------------------------------------------------- fused linear cross-entropy


@pytest.mark.parametrize(
    "chunk_size,use_bias,reduction,num_targets",
    [(8, True, "mean", None), (8, False, "sum", None), (None, True, "mean", 50), (64, False, "mean", None)],
)
def test_fused_linear_cross_entropy_triton_fp32(triton_cpu, chunk_size, use_bias, reduction, num_targets):
    from galaxy.kernels.triton_cross_entropy import FusedLinearCrossEntropy

    n, hidden, vocab = 37, 24, 257  # 37 tokens: the last chunk is partial
    h, w, targets = leaf(n, hidden), leaf(vocab, hidden, scale=0.5), _targets(n, vocab)
    b = leaf(vocab) if use_bias else None
    loss = FusedLinearCrossEntropy.apply(h, w, targets, b, -100, reduction, num_targets, chunk_size, 64)
    loss_r = R.fused_linear_cross_entropy(h, w, targets, -100, reduction, num_targets, b)
    inputs = (h, w) if b is None else (h, w, b)
    # A non-unit upstream gradient checks that backward scales the stored grads by it.
    assert_all_close([loss, *grads(loss, inputs, torch.tensor(1.7))], [loss_r, *grads(loss_r, inputs, torch.tensor(1.7))], **FP32)


def test_default_chunk_keeps_a_frozen_heads_logits_smaller():
    pytest.importorskip("triton")
    from galaxy.kernels.triton_cross_entropy import CHUNK_LOGITS_BYTES, FROZEN_CHUNK_LOGITS_BYTES, default_chunk_size

    vocab, bf16 = 128256, 2  # Llama-3's head, 8 x 1024 tokens
    trained, frozen = default_chunk_size(8192, vocab, bf16), default_chunk_size(8192, vocab, bf16, weight_grad=False)
    assert (trained, frozen) == (2048, 512)
    assert frozen * vocab * bf16 <= FROZEN_CHUNK_LOGITS_BYTES < trained * vocab * bf16 <= CHUNK_LOGITS_BYTES
    assert default_chunk_size(100, vocab, bf16, weight_grad=False) == 128  # never past the tokens there are


def test_fused_linear_cross_entropy_dispatch_frozen_head_bf16(triton_cpu):
    h = leaf(2, 9, 32, dtype=torch.bfloat16)
    w = torch.randn(1000, 32, dtype=torch.bfloat16) * 0.3  # frozen LM head
    targets = _targets(18, 1000).view(2, 9)
    loss = K.fused_linear_cross_entropy(h, w, targets, chunk_size=4, backend="triton")
    truth = fp64_truth(lambda a, b: R.fused_linear_cross_entropy(a, b, targets.view(-1)), (h.view(-1, 32), w), torch.tensor(1.0))
    assert_all_close([loss, *grads(loss, (h, w), torch.tensor(1.0))], [truth[0], truth[1].view(2, 9, 32), truth[2]], cast=True, **BF16)


def test_fused_linear_cross_entropy_never_holds_full_logits(triton_cpu):
    # Shapes chosen so that N*V exceeds every legitimate buffer (N*H, V*H).
    n, hidden, vocab, chunk = 40, 16, 257, 8
    h, w, targets = leaf(n, hidden), leaf(vocab, hidden), _targets(n, vocab)
    full_logits = n * vocab

    def run(backend):
        saved = []

        def pack(t):
            saved.append(t.numel())
            return t

        with MaxAllocation() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = K.fused_linear_cross_entropy(h, w, targets, chunk_size=chunk, backend=backend)
            loss.backward()
        return mode.max_numel, saved

    max_numel, saved = run("triton")
    assert max_numel < full_logits, f"an op produced {max_numel} elements (the full logits are {full_logits})"
    assert all(numel < full_logits for numel in saved), saved
    # Positive control: the plain reference does materialize [N, V], so the probe can fail.
    ref_max, ref_saved = run("torch")
    assert ref_max >= full_logits and max(ref_saved) >= full_logits


def test_fused_linear_cross_entropy_no_grad_skips_gradients(triton_cpu):
    h, w, targets = leaf(6, 8), leaf(33, 8), _targets(6, 33)
    with torch.no_grad(), MaxAllocation() as mode:
        loss = K.fused_linear_cross_entropy(h, w, targets, chunk_size=2, backend="triton")
    assert mode.max_numel < w.numel(), "a weight-gradient buffer was allocated under no_grad"
    torch.testing.assert_close(loss, R.fused_linear_cross_entropy(h, w, targets), **FP32)


def test_fused_linear_cross_entropy_second_backward_raises(triton_cpu):
    h, w, targets = leaf(6, 8), leaf(33, 8), _targets(6, 33)
    loss = K.fused_linear_cross_entropy(h, w, targets, backend="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_fused_linear_cross_entropy_all_ignored_with_global_count(triton_cpu):
    # A sequence shard whose tokens are all ignored still contributes 0 with a global count.
    h, w = leaf(5, 8), leaf(33, 8)
    targets = torch.full((5,), -100)
    loss = K.fused_linear_cross_entropy(h, w, targets, num_targets=12, backend="triton")
    g_h, g_w = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0.0 and not g_h.any() and not g_w.any()


# ---------------------------------------------------------------- LoRA


def _lora_inputs(dtype=torch.float32, tokens=(3, 5), d_in=64, d_out=48, rank=4, frozen=True):
    x = leaf(*tokens, d_in, dtype=dtype)
    w = (torch.randn(d_out, d_in, dtype=torch.float64) * 0.1).to(dtype).requires_grad_(not frozen)
    a, b = leaf(rank, d_in, dtype=dtype, scale=0.1), leaf(d_out, rank, dtype=dtype, scale=0.1)
    bias = (torch.randn(d_out, dtype=torch.float64)).to(dtype).requires_grad_(not frozen)
    return x, w, a, b, bias


@pytest.mark.parametrize("frozen", [True, False])
def test_lora_linear_matches_reference(frozen):
    x, w, a, b, bias = _lora_inputs(frozen=frozen)
    y = K.lora_linear(x, w, a, b, 2.0, bias)
    y_r = K.lora_linear(x, w, a, b, 2.0, bias, backend="torch")
    dy = torch.randn_like(y)
    inputs = (x, w, a, b, bias)
    assert_all_close([y, *grads(y, inputs, dy)], [y_r, *grads(y_r, inputs, dy)], **FP32)


def test_lora_linear_gradcheck_fp64():
    from galaxy.kernels.lora import LoRALinearFunction

    x, w, a, b, bias = _lora_inputs(torch.float64, tokens=(2, 3), d_in=6, d_out=5, rank=2, frozen=False)
    assert torch.autograd.gradcheck(lambda *t: LoRALinearFunction.apply(*t[:4], 0.75, t[4]), (x, w, a, b, bias))


def test_lora_linear_backward_has_no_hidden_by_hidden_temporary():
    # tokens * hidden < hidden * hidden, so any [hidden, hidden]-sized product would stand out.
    x, w, a, b, _ = _lora_inputs(tokens=(8,), d_in=64, d_out=64, rank=4)
    with MaxAllocation() as mode:
        K.lora_linear(x, w, a, b, 0.5).sum().backward()
    assert mode.max_numel < 64 * 64, mode.max_numel
    # Positive control: merging B @ A does create one.
    with MaxAllocation() as mode:
        F.linear(x, w + 0.5 * b @ a).sum().backward()
    assert mode.max_numel >= 64 * 64


# ---------------------------------------------------------------- benchmark script


def test_bench_script_smoke(triton_cpu, tmp_path, monkeypatch):
    """bench/bench_kernels.py --smoke runs end to end (a few kernels, to stay quick)."""
    import importlib.util
    import json

    root = REPO
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(root, "bench", "bench_kernels.py"))
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--only", "swiglu", "cross_entropy", "lora_linear", "--repeats", "1",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    impls = {(r["op"], r["model"], r["impl"]) for r in report["results"]}
    assert {("swiglu", "tiny TP/2", "galaxy-triton"), ("cross_entropy", "tiny", "torch-fused"),
            ("lora_linear", "tiny", "galaxy-triton")} <= impls
    assert all(len(r["wall_ms"]) == 1 and len(r["gpu_ms"]) == 1 for r in report["results"])
    floors = {(r["op"], r["model"]): r for r in report["results"] if r["impl"] == "copy-floor"}
    assert all(r["ok"] for r in report["results"] if r["impl"] != "copy-floor"), report["results"]
    # Memory-bound ops get a floor of the bytes they must move; compute-bound ones (LoRA) none.
    assert {("swiglu", "tiny"), ("cross_entropy", "tiny")} <= set(floors) and ("lora_linear", "tiny") not in floors
    tokens, width, vocab = 48, 96, 257  # the smoke shapes: bf16 gate/up [48, 96], logits [48, 257]
    assert floors[("swiglu", "tiny")]["moved_bytes"] == [3 * tokens * width * 2, 5 * tokens * width * 2]
    assert floors[("cross_entropy", "tiny")]["moved_bytes"] == [2 * tokens * vocab * 2]  # backward: a scale
    verdict = next(v for v in report["verdicts"] if (v["op"], v["model"]) == ("swiglu", "tiny"))
    assert verdict["floor_ms"] == floors[("swiglu", "tiny")]["gpu_ms"][0]
    # fp32: errors against a float64 truth; torch's own fp32 path is then off by rounding, not 0.
    assert bench.main(["--smoke", "--dtype", "fp32", "--only", "fused_linear_cross_entropy", "--repeats", "1",
                       "--json", str(out)]) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    assert all(r["ok"] for r in rows.values()), rows
    assert 0 < rows["torch"]["max_err"] < 1e-5 and rows["galaxy-triton"]["max_err"] < 1e-4


def test_late_interpreter_flag_gives_clear_error():
    """Kernels first imported without TRITON_INTERPRET are compiled-mode: CPU use must say why."""
    if not K.triton_available():
        pytest.skip("triton is not installed")
    code = textwrap.dedent(
        """
        import os, torch
        os.environ.pop("TRITON_INTERPRET", None)
        import galaxy.kernels.triton_swiglu  # compiled-mode kernels
        os.environ["TRITON_INTERPRET"] = "1"
        import galaxy.kernels as K
        try:
            K.swiglu(torch.randn(4), torch.randn(4), backend="triton")
        except ValueError as err:
            assert "already compiled" in str(err), err
            print("OK")
        """
    )
    env = _subprocess_env()
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
