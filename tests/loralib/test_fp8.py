"""The fp8 frozen base (``quantize_base: fp8``, galaxy.loralib.fp8):

- storage: per stored row, its amax / 448 (fp32) and the nearest e4m3 of each weight over it (a search
  over every e4m3 number, written here); 1 byte a weight + 4 a row; a model cast leaves it alone;
- products: the emulated product equals ``torch._scaled_mm`` (row-wise scales) on the CPU, and the
  ``_scaled_mm`` call itself (column-major operand made on the fly) runs there; ``fp8_linear`` forward and
  input gradient are, in fp64 and exactly, the dequantized weight's products of the same quantized
  activations (forward ``x`` per row; backward ``dy`` with the weight's row scales folded in where it
  contracts over stored rows), both orientations, with a bias; the Triton quantization gives the same;
- LoRA over it: the factors' gradients equal those of a LoRA layer over that reference product (exact
  structure), and over the unquantized base they differ by fp8's rounding: more than 0.1%, less than
  FP8_GRAD_RTOL (e4m3 rounds each operand to 2^-4 relative, 3.6% rms for uniform rounding; a gradient
  through two layers of such products lands at ~5-7%);
- every plan (TP, SP, Galaxy, uneven splits; BERT and LLaMA; LoRA, adapters, side networks) equals serial in
  fp64 to 1e-9: the gathered buffers bit for bit, the loss, logits and every trainable gradient;
- a compiled layer fuses each activation's quantization into the kernel that makes the activation;
- checkpoints: quantized on load slice by slice (the buffers of load-then-quantize), a LoRA save holds
  the factors only, a merged export dequantizes and loads in ``transformers``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from galaxy.config import ConfigError, GalaxyConfig  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.core.grad_sync import gather_full  # noqa: E402
from galaxy.kernels.fp8 import E4M3  # noqa: E402
from galaxy.loralib.fp8 import dequantize_fp8, fp8_linear, quantize_fp8, scaled_product  # noqa: E402
from galaxy.loralib.quantized import dequantize_linears, load_quantized, quantize_linears  # noqa: E402
from galaxy.loralib.quantized_layers import FP8Weight, QuantizedWeight  # noqa: E402
from galaxy.models.llama import LlamaForCausalLM  # noqa: E402
from galaxy.peft import apply_tuning, build_base, export_merged, frozen_bytes, save_tuning  # noqa: E402
from tests import COMPILED_WITHOUT_KERNELS  # noqa: E402
from tests.core.test_llama_equivalence import RTOL, backward_both, rel_err  # noqa: E402
from tests.kernels.test_fp8 import nearest_e4m3  # noqa: E402
from tests.loralib.test_qlora import (TARGETS, _same_quantized_buffers, batch, cfg_for, hf_llama,  # noqa: E402,F401
                                      qlora_equals_serial)
from tests.peft.test_peft_equivalence import MODELS, UNEVEN, edges, make_batch  # noqa: E402

transformers = pytest.importorskip("transformers")

FP8_GRAD_RTOL = 0.15


# ----------------------------------------------------------------------------- storage


def test_weights_are_the_nearest_e4m3_over_the_row_amax():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g) * torch.logspace(-3, 1, 40)[:, None]
    w[5] = 0.0
    q = quantize_fp8(w)
    amax = w.abs().amax(dim=1)
    assert q.codes.dtype == torch.uint8 and q.scale.dtype == torch.float32
    assert torch.equal(q.scale, amax.clamp(min=1e-12) / 448.0)
    want = nearest_e4m3(w.double() / q.scale.double()[:, None])
    assert torch.equal(q.values().double(), want)
    assert torch.equal(dequantize_fp8(q, torch.float64), want * q.scale.double()[:, None])
    assert rel_err(dequantize_fp8(q, torch.float64), w.double()) < 2 ** -4


def test_fp8_storage_is_a_byte_a_weight_and_a_cast_leaves_it():
    cfg = cfg_for(dtype="bfloat16", quantize_base="fp8")
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.1)
    stored = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    assert len(stored) == 7 * cfg.model.num_hidden_layers and all(isinstance(m, FP8Weight) for m in stored)
    others = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    rows_cols = [m.codes.shape for m in stored]
    assert frozen_bytes(model)[0] == 2 * others + sum(r * c + 4 * r for r, c in rows_cols)
    big = FP8Weight.quantize(torch.randn(4096, 4096), None, transposed=False)
    assert big.nbytes() == 4096 * 4096 + 4 * 4096  # 1.001 bytes a weight
    q = stored[0]
    before = q.dequantize(torch.float32)
    model.to(torch.bfloat16)
    assert q.codes.dtype == torch.uint8 and q.scale.dtype == torch.float32
    assert torch.equal(q.dequantize(torch.float32), before)


def test_an_fp8_base_grows_host_memory_by_its_storage():
    """build_base + apply_tuning of an fp8-base LoRA LLaMA (hidden 512, intermediate 16384) at 2 and 4 layers,
    each in a fresh process (tests/loralib/build_memory_child.py): the peak RSS grows by about the fp8 bytes
    stored (1.0 a weight; seen 0.98), not by a bf16 or fp32 copy of the base (2 or 4)."""
    from tests.loralib.test_stored_base import MEMORY_SIZES, bytes_per_added_frozen, measure

    rows = measure([dict(layers=n, dtype="bfloat16", quantize_base="fp8", step=False) for n in MEMORY_SIZES])
    added = bytes_per_added_frozen(*rows)
    assert rows[1]["frozen"] - rows[0]["frozen"] > 50e6, rows
    assert added <= 1.5, (added, [(r["spec"], r["peak_kib"]) for r in rows])


def test_config():
    assert cfg_for(quantize_base="fp8").peft.quantize_base == "fp8"
    with pytest.raises(ConfigError, match="quantize_base"):
        cfg_for(tuning="full", quantize_base="fp8")
    with pytest.raises(ConfigError, match="quantize_base"):
        cfg_for(quantize_base="fp4")


# ----------------------------------------------------------------------------- products


def fake_quant_rows(a: torch.Tensor) -> torch.Tensor:
    """Each row of ``a`` (fp64) scaled by its amax / 448, rounded to e4m3, scaled back (written here)."""
    scale = a.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return nearest_e4m3(a / scale) * scale


class ReferenceFP8Linear(torch.autograd.Function):
    """The fp8 linear's arithmetic on the dequantized weight ``w [out, in]`` with stored row scales ``s``
    (``transposed``: stored as ``W^T``, so ``s`` scales ``W``'s columns): each product quantizes its
    activation operand per row, folding ``s`` in where the product sums over the stored rows."""

    @staticmethod
    def forward(ctx, x, w, s, transposed):
        ctx.save_for_backward(w, s)
        ctx.transposed = transposed
        return (fake_quant_rows(x * s) / s if transposed else fake_quant_rows(x)) @ w.t()

    @staticmethod
    def backward(ctx, dy):
        w, s = ctx.saved_tensors
        return (fake_quant_rows(dy) if ctx.transposed else fake_quant_rows(dy * s) / s) @ w, None, None, None


def stored_matrix(rows=48, cols=80, seed=3):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8(torch.randn(rows, cols, generator=g) * 0.1)


@pytest.mark.parametrize("transposed", [False, True], ids=["W", "W^T"])
def test_fp8_linear_is_the_dequantized_product_of_the_quantized_activations(transposed):
    q = stored_matrix()
    stored = dequantize_fp8(q, torch.float64)
    w = stored.t() if transposed else stored  # [out, in]
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 7, w.shape[1], generator=g, dtype=torch.float64) * 3).requires_grad_()
    bias = torch.randn(w.shape[0], generator=g, dtype=torch.float64).requires_grad_()
    dy = torch.randn(2, 7, w.shape[0], generator=g, dtype=torch.float64)
    y = fp8_linear(x, q, bias, transposed)
    dx, dbias = torch.autograd.grad(y, (x, bias), dy)
    xr = x.detach().clone().requires_grad_()
    yr = ReferenceFP8Linear.apply(xr, w, q.scale.double(), transposed) + bias.detach()
    (dxr,) = torch.autograd.grad(yr, xr, dy)
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dxr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dbias, dy.sum((0, 1)), rtol=1e-12, atol=1e-12)
    plain = x.detach() @ w.t() + bias.detach()
    assert 1e-3 < rel_err(y.detach(), plain) < 2 ** -4  # the activations were quantized, within e4m3's rounding


@pytest.mark.parametrize("transposed", [False, True], ids=["W", "W^T"])
def test_the_triton_quantization_gives_the_same_linear(triton_cpu, transposed):
    q = stored_matrix()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 48 if transposed else 80, generator=g)
    dy = torch.randn(9, 80 if transposed else 48, generator=g)
    runs = []
    for backend in ("torch", "triton"):
        xb = x.clone().requires_grad_()
        y = fp8_linear(xb, q, None, transposed, backend=backend)
        y.backward(dy)
        runs.append((y.detach(), xb.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def scaled_mm_rowwise_on_cpu() -> bool:
    a, b = torch.ones(16, 16, dtype=E4M3), torch.ones(16, 16, dtype=E4M3).t()
    try:
        torch._scaled_mm(a, b, torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not scaled_mm_rowwise_on_cpu(), reason="this torch's CPU _scaled_mm has no row-wise scaling")
@pytest.mark.parametrize("layout", ["direct", "folded"])
def test_scaled_product_is_torch_scaled_mm(layout):
    """torch's own fp8 matmul (CPU) on the operands the linear hands it: the emulated product equals it to
    fp32 summation order, and the tensor-core call (bf16 out, the weight made column-major when it is
    not) runs and gives it to bf16 rounding."""
    q = stored_matrix(rows=48, cols=80)
    g = torch.Generator().manual_seed(6)
    if layout == "direct":  # a [M, cols] S^T: the stored codes transposed are column-major already
        a, b, sb = torch.randn(32, 80, generator=g), q.values().t(), q.scale.view(1, -1)
    else:  # a [M, rows] S: the codes are row-major, transposed on the fly for _scaled_mm
        a, b, sb = torch.randn(32, 48, generator=g), q.values(), None
    a_codes = (a / (a.abs().amax(1, keepdim=True) / 448)).to(E4M3)
    a_scale = a.abs().amax(1, keepdim=True) / 448
    ones = torch.ones(1, b.shape[1])
    theirs = torch._scaled_mm(a_codes, b.t().contiguous().t(), a_scale, sb if sb is not None else ones,
                              out_dtype=torch.float32)
    ours = scaled_product(a_codes, a_scale, b, sb, torch.float32, tensor_cores=False)
    assert rel_err(ours, theirs) < 1e-6  # fp32 sums in another order (torch scales its operands first)
    cores = scaled_product(a_codes, a_scale, b, sb, torch.bfloat16, tensor_cores=True)
    assert cores.dtype == torch.bfloat16
    assert rel_err(cores.float(), theirs) < 2 ** -8


# ----------------------------------------------------------------------------- LoRA over an fp8 base


@pytest.mark.parametrize("transposed", [False, True], ids=["q_proj (W)", "o_proj (W^T)"])
def test_lora_gradients_on_an_fp8_base_are_those_of_its_products(transposed):
    """A LoRA layer over the fp8 base applied twice (its weight is square), so that the factors' gradient
    from the first application flows through the second's base, its input gradient: in fp64 they are
    exactly those of LoRA over ``ReferenceFP8Linear`` on the dequantized weight."""
    cfg = cfg_for(quantize_base="fp8", lora_dim=4, lora_alpha=8.0, lora_target_modules=["q_proj", "o_proj"])
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.3).double()
    attn = model.model.layers[0].self_attn
    layer = attn.o_proj if transposed else attn.q_proj
    q = layer.qweight
    assert q.transposed == transposed and q.shape[0] == q.shape[1]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, q.shape[1], generator=g, dtype=torch.float64)
    dy = torch.randn(5, q.shape[0], generator=g, dtype=torch.float64)
    factors = (layer.lora_A.weight, layer.lora_B.weight)
    got = torch.autograd.grad(layer(layer(x)), factors, dy)

    w, s = q.dequantize(torch.float64), q.scale.double()
    a, b = (f.detach().clone().requires_grad_() for f in factors)

    def reference(h):
        return ReferenceFP8Linear.apply(h, w, s, transposed) + layer.scaling * (h @ a.t()) @ b.t()

    want = torch.autograd.grad(reference(reference(x)), (a, b), dy)
    for g_ours, g_ref in zip(got, want):
        assert rel_err(g_ours, g_ref) < 1e-12


def test_lora_gradients_on_an_fp8_base_are_the_full_precision_ones_to_fp8_rounding():
    """The whole model: every LoRA gradient over the fp8 base against the same LoRA over the dequantized base
    (only the activations' quantization differs) and over the fp32 base the fp8 one was made from."""
    cfg_q = cfg_for(quantize_base="fp8", lora_target_modules=TARGETS)
    cfg = cfg_for(lora_target_modules=TARGETS)
    fp8 = apply_tuning(LlamaForCausalLM(cfg_q.model, seed=1), cfg_q, init_std=0.2)
    dequantized = apply_tuning(LlamaForCausalLM(cfg_q.model, seed=1), cfg_q, init_std=0.2)
    dequantize_linears(dequantized)
    full = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.2)
    grads = {}
    for name, model in (("fp8", fp8), ("dequantized", dequantized), ("full", full)):
        model.double()(**batch()).loss.backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads["fp8"]) == 2 * 7 * 2
    for other in ("dequantized", "full"):
        errors = {n: rel_err(g, grads[other][n]) for n, g in grads["fp8"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] < FP8_GRAD_RTOL, (other, worst, errors[worst])
        assert min(errors.values()) > 1e-3, other  # fp8 rounding is there


# ----------------------------------------------------------------------------- every plan equals serial


@pytest.mark.parametrize("model_type,world,plan,uneven", [
    ("llama", 2, "tp", False), ("llama", 2, "sp", False), ("llama", 3, "galaxy", True), ("bert", 3, "tp", True)])
def test_every_plan_equals_serial_fp8(dist_pool, model_type, world, plan, uneven):
    dist_pool.run(qlora_equals_serial, world, model_type, plan, uneven, "fp8")


def frozen_base_method_equals_serial(ctx, method, plan):
    """Adapters or a side network over the fp8 base: every plan's trainable gradients are serial's (fp64)."""
    cls, tiny = MODELS["llama"]
    raw = dict(tiny, seq_length=11, tuning=method, plan=plan, quantize_base="fp8")
    raw.update(UNEVEN["llama"][ctx.mp.size] if ctx.mp.size == 3 else {})
    cfg = GalaxyConfig.from_dict(raw)
    serial = apply_tuning(cls(cfg.model, seed=7), cfg, init_std=0.2)
    par = apply_tuning(cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=7), cfg, init_std=0.2)
    _same_quantized_buffers(serial, par, ctx)
    serial, par = serial.double(), par.double()
    backward_both(serial, par, make_batch("llama"), ctx, edges(par))
    grads = dict(serial.named_parameters())
    trained = [(n, p) for n, p in par.named_parameters() if p.requires_grad]
    assert trained
    for name, p in trained:
        err = rel_err(gather_full(p.grad, p, ctx.mp), grads[name].grad)
        assert err < RTOL, f"{method} over fp8 on {plan}: grad of {name}: relative error {err:.2e}"


@pytest.mark.parametrize("method,world,plan", [("adapter", 2, "galaxy"), ("side", 3, "tp")])
def test_adapters_and_side_networks_on_an_fp8_base_equal_serial(dist_pool, method, world, plan):
    dist_pool.run(frozen_base_method_equals_serial, world, method, plan)


def built_stored_on_a_plan(ctx):
    """build_base (materialize: each rank quantizes its slices of the seeded init) on a TP plan gives the
    fp8 model apply_tuning makes from the fp32 build on that plan: the same buffers, each sharded weight
    knowing its mp group, the same loss."""
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", seq_length=13, tuning="lora", quantize_base="fp8",
                                      plan="tp"))
    plan = cfg.resolve_plan(ctx.mp.size)
    stored = apply_tuning(build_base(cfg, plan, ctx), cfg, init_std=0.2)
    built = apply_tuning(LlamaForCausalLM(cfg.model, plan, ctx, seed=cfg.train.seed), cfg, init_std=0.2)
    weights = [m for m in stored.modules() if isinstance(m, FP8Weight)]
    assert weights and all(m.comm is ctx.mp for m in weights if m.spec is not None)
    assert all(torch.equal(b, dict(built.named_buffers())[n]) for n, b in stored.named_buffers())
    assert torch.equal(stored(**batch()).loss, built(**batch()).loss)


def test_a_base_built_stored_on_a_plan_is_the_one_quantized_after(dist_pool):
    dist_pool.run(built_stored_on_a_plan, 2)


# ----------------------------------------------------------------------------- compiled


def test_a_compiled_layer_fuses_the_quantization_into_the_activations_producer():
    """In the forward graph inductor generates (C++ here), every kernel that computes an activation's row
    amax for an fp8 product also computes that activation: the norms (rsqrt), the MLP's SiLU, the attention
    output's layout copy (transpose; the attention itself is a library kernel). No kernel re-reads a
    finished activation to quantize it."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", hidden_size=96, num_hidden_layers=1, seq_length=13,
                                      tuning="lora", quantize_base="fp8", compile=True))
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.1)

    def step():
        model(**batch()).loss.backward()

    _, codes = run_and_get_code(step)
    forward = next(c for c in codes if "rsqrt" in c)
    kernels = set(re.findall(r"(cpp_fused_\w+) = async_compile", forward))
    quantizing = [k for k in kernels if "amax" in k]
    assert len(quantizing) == 4, kernels  # q/k/v's shared input, o_proj, gate/up's shared input, down_proj
    assert all(any(op in k for op in ("rsqrt", "silu", "transpose")) for k in quantizing), quantizing
    assert sum("rsqrt" in k for k in quantizing) == 2 and sum("silu" in k for k in quantizing) == 1


def activation_bytes_saved(quantize_base: str, compile_: bool, recompute: str) -> int:
    """The bytes of the storages a LoRA LLaMA's forward under bf16 autocast saves for backward, the model's own
    weights and buffers (which the fp8 linear saves by reference) left out; the second step's, the first compiles."""
    torch._dynamo.reset()
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", num_hidden_layers=1, seq_length=13, tuning="lora",
                                      dtype="bfloat16", quantize_base=quantize_base,
                                      **(COMPILED_WITHOUT_KERNELS if compile_ else {}),
                                      recompute=recompute))
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.1)
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    for _ in range(2):
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in held:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch()).loss
        loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_recompute_mlp_keeps_as_little_over_an_fp8_base_as_over_a_bf16_one(compile_):
    """``recompute: mlp`` takes the MLP's FFN-wide tensors (gate, up) off what the step keeps over the fp8 base
    as over the bf16 one: the same bytes less. Compiled, the region's ops inside the fp8 linear's autograd
    Function are recomputed too (``galaxy.core.recompute``: under torch 2.11 a plain checkpoint marked only the
    ops outside it, the partitioner kept the projections' outputs, and the fp8 drop was 0; seen on CPU). Compiled
    without kernels (``COMPILED_WITHOUT_KERNELS``): the partitioner chooses what is kept."""
    drop = {base: activation_bytes_saved(base, compile_, "none") - activation_bytes_saved(base, compile_, "mlp")
            for base in ("none", "fp8")}
    assert drop["none"] > 0 and drop["fp8"] == drop["none"], drop


# ----------------------------------------------------------------------------- checkpoints in and out


def test_quantized_on_load_is_load_then_quantize(hf_llama):
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", seq_length=13, tuning="lora", quantize_base="fp8",
                                      model_path=hf_llama))
    ours = build_base(cfg, None, ParallelContext.serial())
    want = LlamaForCausalLM.from_pretrained(hf_llama)
    quantize_linears(want, kind="fp8")
    state, state_w = ours.state_dict(), want.state_dict()
    assert set(state) == set(state_w) and any(k.endswith("qweight.codes") for k in state)
    assert all(torch.equal(v, state_w[k]) for k, v in state.items())
    assert torch.equal(load_quantized(LlamaForCausalLM, hf_llama, kind="fp8").state_dict()["model.layers.0.mlp."
                                                                                         "down_proj.qweight.codes"],
                       state_w["model.layers.0.mlp.down_proj.qweight.codes"])


def test_a_lora_save_holds_the_factors_and_a_merged_export_loads_in_transformers(hf_llama, tmp_path):
    from safetensors.torch import load_file

    cfg = cfg_for(lora_dim=4, lora_alpha=8.0, quantize_base="fp8")
    ours = apply_tuning(LlamaForCausalLM.from_pretrained(hf_llama), cfg, targets=TARGETS, init_std=0.1)
    data = batch(96)
    save_tuning(ours, str(tmp_path / "adapter"))
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:4]
    with torch.no_grad():
        want = ours.eval()(data["input_ids"]).logits
    export_merged(ours, str(tmp_path / "merged"))
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    with torch.no_grad():
        got = merged(input_ids=data["input_ids"]).logits
    # The export holds the dequantized weights merged with the factors; transformers does not quantize the
    # activations, which the fp8 model does: the logits agree to fp8's activation rounding.
    assert rel_err(got, want) < 5e-2
    plain = transformers.LlamaForCausalLM.from_pretrained(hf_llama)
    with torch.no_grad():
        assert rel_err(plain(input_ids=data["input_ids"]).logits, want) > rel_err(got, want)
