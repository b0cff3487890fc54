"""Frozen base weights in the compute dtype and QLoRA (NF4 base; int8 too):

- storage: frozen weights take 2 bytes a parameter in bf16 and 0.5 + scales in NF4 (counted from
  the parameters and buffers); trainable ones and their AdamW state stay fp32;
- with a bf16 base, Galaxy LoRA equals HF ``peft`` on the same bf16 weights (bf16 autocast both);
- every plan equals serial QLoRA: the gathered NF4 buffers bit for bit, and in fp64 the loss,
  logits and every LoRA gradient to 1e-9; bf16-stored bases across plans agree to bf16 rounding;
- adapters trained under QLoRA load in ``peft`` on the dequantized base with the same logits, and
  the merged bf16 export loads in ``transformers``."""

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.grad_sync import gather_full
from galaxy.loralib.quantized import dequantize_linears, load_quantized, quantize_linears
from galaxy.loralib.quantized_layers import Int8Weight, NF4Weight, QuantizedWeight
from galaxy.models.llama import LlamaForCausalLM
from galaxy.core.context import ParallelContext
from galaxy.peft import apply_tuning, build_base, export_merged, frozen_bytes, save_tuning
from tests.core.test_llama_equivalence import RTOL, backward_both, rel_err
from tests.peft.test_peft_equivalence import LORA_TARGETS, MODELS, UNEVEN, edges, make_batch
from tests import REPO  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

HF_LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.05, bos_token_id=None,
                eos_token_id=None)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def cfg_for(**extra):
    return GalaxyConfig.from_dict(dict(dict(preset="llama-tiny", seq_length=13, tuning="lora"), **extra))


def batch(vocab=50, seq=13):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, vocab, (3, seq), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


# ----------------------------------------------------------------------------- storage


def test_frozen_weights_are_stored_in_bf16_and_trainable_ones_in_fp32():
    cfg = cfg_for(dtype="bfloat16")
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.1)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert frozen and trainable
    assert all(p.dtype == torch.bfloat16 for p in frozen) and all(p.dtype == torch.float32 for p in trainable)
    nbytes, count = frozen_bytes(model)
    assert count == sum(p.numel() for p in frozen) and nbytes == 2 * count
    # One step under autocast: gradients and AdamW state fp32, the frozen base untouched and still bf16.
    before = [p.detach().clone() for p in frozen]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch()).loss
    loss.backward()
    optimizer.step()
    assert all(p.grad.dtype == torch.float32 for p in trainable)
    assert all(s.dtype == torch.float32 for st in optimizer.state.values() for s in st.values() if s.dim())
    assert all(torch.equal(a, b) and a.dtype == torch.bfloat16 for a, b in zip(before, frozen))
    # Opting out keeps fp32 copies.
    cfg32 = cfg_for(dtype="bfloat16", frozen_dtype="float32")
    kept = apply_tuning(LlamaForCausalLM(cfg32.model, seed=1), cfg32)
    assert frozen_bytes(kept)[0] == 4 * frozen_bytes(kept)[1]


def nf4_bytes_of(rows: int, cols: int) -> int:
    blocks = -(-cols // 64)
    return rows * (blocks * 32 + blocks + 4 * -(-blocks // 256) + 4)  # codes, absmax codes, scales, offsets


def test_nf4_storage_is_half_a_byte_plus_scales():
    cfg = cfg_for(dtype="bfloat16", quantize_base="nf4")
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg)
    quantized = [m for m in model.modules() if isinstance(m, NF4Weight)]
    assert len(quantized) == 7 * cfg.model.num_hidden_layers  # every linear of every layer; not the LM head
    stored = [(m.packed.shape[0], m.cols) for m in quantized]
    others = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    nbytes, count = frozen_bytes(model)
    assert count == others + sum(r * c for r, c in stored)
    assert nbytes == 2 * others + sum(nf4_bytes_of(r, c) for r, c in stored)
    # A LLaMA-7B projection: 0.5 bytes a weight, 1/64 for the 8-bit absmax codes, and per row of 4096 one fp32
    # second-level scale (every 256 blocks) and one fp32 offset: 0.5176 bytes (4.14 bits) a weight.
    big = NF4Weight.quantize(torch.randn(4096, 4096), None, transposed=False)
    per_param = big.nbytes() / 4096 ** 2
    assert big.nbytes() == nf4_bytes_of(4096, 4096) and 0.5 < per_param < 0.5 + 1 / 64 + 0.0025, per_param


def test_qlora_config_errors():
    with pytest.raises(ConfigError, match="quantize_base"):
        cfg_for(tuning="full", quantize_base="nf4")
    with pytest.raises(ConfigError, match="fused_gate_up"):
        cfg_for(quantize_base="nf4", fused_gate_up=True)
    with pytest.raises(ConfigError, match="frozen_dtype"):
        cfg_for(frozen_dtype="int3")


# ----------------------------------------------------------------------------- HF peft on a bf16 base


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf_llama")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_LLAMA)).save_pretrained(path)
    return str(path)


def test_bf16_base_lora_equals_peft(hf_llama, tmp_path):
    cfg = cfg_for(dtype="bfloat16", lora_dim=4, lora_alpha=8.0)
    ours = apply_tuning(LlamaForCausalLM.from_pretrained(hf_llama), cfg, targets=TARGETS, init_std=0.2)
    save_tuning(ours, str(tmp_path / "adapter"))
    base = transformers.LlamaForCausalLM.from_pretrained(hf_llama, torch_dtype=torch.bfloat16)
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"), is_trainable=True)
    assert {p.dtype for n, p in theirs.named_parameters() if "lora_" in n} == {torch.float32}  # peft upcasts too
    data = batch(96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_o = ours(**data)
        out_t = theirs(**data)
    out_o.loss.backward()
    out_t.loss.backward()
    # bf16 tolerance: both compute every matmul in bf16 on identical bf16 weights (seen: logits equal, LoRA
    # gradients 1e-2 apart, where the backward's bf16 roundings fall differently: a few ulps of 2^-8).
    assert rel_err(out_o.logits.float(), out_t.logits.float()) < 5e-3
    assert abs(out_o.loss.item() - out_t.loss.item()) < 1e-3 * out_t.loss.item()
    grads_t = {n.replace("base_model.model.", "").replace(".default", ""): p.grad
               for n, p in theirs.named_parameters() if "lora_" in n}
    grads_o = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert set(grads_o) == set(grads_t)
    for name, g in grads_o.items():
        assert rel_err(g, grads_t[name]) < 3e-2, (name, rel_err(g, grads_t[name]))


# ----------------------------------------------------------------------------- QLoRA adapters in peft, export


def test_qlora_adapter_loads_in_peft_and_merged_bf16_export_loads_in_transformers(hf_llama, tmp_path):
    cfg = cfg_for(lora_dim=4, lora_alpha=8.0, quantize_base="nf4")
    ours = apply_tuning(LlamaForCausalLM.from_pretrained(hf_llama), cfg, targets=TARGETS, init_std=0.1)
    optimizer = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=1e-2)
    data = batch(96)
    for _ in range(3):  # trained under QLoRA
        optimizer.zero_grad()
        ours(**data).loss.backward()
        optimizer.step()
    save_tuning(ours, str(tmp_path / "adapter"))
    # The base peft sees: the same checkpoint, quantized and dequantized as Galaxy did.
    base = LlamaForCausalLM.from_pretrained(hf_llama)
    assert len(quantize_linears(base)) == len(dequantize_linears(base)) == 14
    base.save_pretrained(str(tmp_path / "dequantized"))
    dequantized = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "dequantized"))
    theirs = peft.PeftModel.from_pretrained(dequantized, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want = ours.eval()(data["input_ids"]).logits
        got = theirs(input_ids=data["input_ids"]).logits
        plain = transformers.LlamaForCausalLM.from_pretrained(hf_llama)(input_ids=data["input_ids"]).logits
    assert rel_err(want, plain) > 1e-2  # NF4 and the trained adapter do change the model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    export_merged(ours, str(tmp_path / "merged"), dtype=torch.bfloat16)
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"), torch_dtype=torch.bfloat16)
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert rel_err(merged(input_ids=data["input_ids"]).logits.float(), want) < 2e-2  # bf16-rounded weights


# ----------------------------------------------------------------------------- quantize on load


def test_building_on_the_meta_device_allocates_nothing():
    import resource

    cfg = GalaxyConfig.from_dict(dict(preset="llama-7b", seq_length=16))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = LlamaForCausalLM(cfg.model, meta=True)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 6e9
    assert grown_mib < 1024, f"building the 7B layout grew the process by {grown_mib:.0f} MiB"


def process_wide_state():
    """torch's process-wide module hooks and default device: what building a model must leave as it was."""
    import torch.nn.modules.module as module

    hooks = {name: dict(value) for name, value in vars(module).items() if name.startswith("_global_")
             and isinstance(value, dict)}
    return hooks, torch.get_default_device()


def test_building_a_quantized_base_leaves_no_global_state(hf_llama):
    """The meta layout is the constructor's own option: nothing process-wide changes, even while the
    model is built (a module that other code creates meanwhile gets real parameters)."""
    others = []

    class BuiltBesideOthers(LlamaForCausalLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            others.append(torch.nn.Linear(2, 2))  # no part of the model

    before = process_wide_state()
    model = load_quantized(BuiltBesideOthers, hf_llama)
    assert process_wide_state() == before
    assert not any(p.is_meta for p in others[0].parameters())
    assert any(isinstance(m, NF4Weight) for m in model.modules()) and not any(p.is_meta for p in model.parameters())
    assert not any(p.is_meta for p in LlamaForCausalLM(model.config).parameters())


def test_load_quantized_equals_load_then_quantize(hf_llama):
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", seq_length=13, tuning="lora", quantize_base="nf4",
                                      model_path=hf_llama))
    ours = build_base(cfg, None, ParallelContext.serial())
    assert any(isinstance(m, NF4Weight) for m in ours.modules())
    want = LlamaForCausalLM.from_pretrained(hf_llama)
    quantize_linears(want)
    assert not any(p.is_meta for p in ours.parameters())
    state, state_w = ours.state_dict(), want.state_dict()
    assert set(state) == set(state_w) and any(k.endswith("qweight.packed") for k in state)
    for key, value in state.items():
        assert torch.equal(value, state_w[key]), key
    ids = batch(96)["input_ids"]
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, want(ids).logits)


@pytest.mark.parametrize("cls", ["BertForMaskedLM", "BertForSequenceClassification"])
def test_bert_quantized_on_load_equals_load_then_quantize(tmp_path, cls):
    from galaxy.models import bert

    model_cls = getattr(bert, cls)
    cfg = GalaxyConfig.from_dict(dict(preset="bert-tiny", seq_length=16))
    assert all(p.is_meta for p in model_cls(cfg.model, meta=True).parameters())
    model_cls(cfg.model, seed=1).save_pretrained(str(tmp_path))
    ours = load_quantized(model_cls, str(tmp_path))
    want = model_cls.from_pretrained(str(tmp_path))
    quantize_linears(want)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids).logits, want.eval()(ids).logits)


def load_quantized_on_plan(ctx, path, plan):
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", **{k: v for k, v in HF_LLAMA.items() if k not in (
        "bos_token_id", "eos_token_id", "initializer_range")}, seq_length=13, plan=plan))
    ours = load_quantized(LlamaForCausalLM, path, cfg.resolve_plan(ctx.mp.size), ctx)
    serial = load_quantized(LlamaForCausalLM, path)
    _same_quantized_buffers(serial, ours, ctx)
    for name, p in ours.named_parameters():
        assert torch.equal(gather_full(p.detach(), p, ctx.mp), dict(serial.named_parameters())[name])
    data = batch(96)
    with torch.no_grad():
        out = edges(ours).to_replicated(ours(**data).logits)
        assert rel_err(out, serial(**data).logits) < 1e-5


# ----------------------------------------------------------------------------- every plan equals serial QLoRA


def qlora_pair(ctx, model_type, plan, uneven, **extra):
    cls, tiny = MODELS[model_type]
    raw = dict(tiny, seq_length=11, tuning="lora", plan=plan, **extra)
    if uneven:
        raw.update(UNEVEN[model_type][ctx.mp.size])
    cfg = GalaxyConfig.from_dict(raw)
    frozen = ("embed_tokens", "word_embeddings") + (("lm_head",) if extra.get("quantize_head") else ())
    opts = dict(init_std=0.2, targets=[t for t in LORA_TARGETS[model_type] if t not in frozen])
    serial = apply_tuning(cls(cfg.model, seed=7), cfg, **opts)
    par = apply_tuning(cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=7), cfg, **opts)
    return serial, par


def _same_quantized_buffers(serial, par, ctx):
    ours = dict(par.named_modules())
    checked = 0
    for name, m in serial.named_modules():
        if isinstance(m, QuantizedWeight):
            piece = ours[name]
            for buf in m.BUFFERS:
                local = getattr(piece, buf)
                full = local if piece.spec is None else ctx.mp.all_gather(local.contiguous(), 0, piece.spec.sizes)
                assert torch.equal(full, getattr(m, buf)), f"{name}.{buf} differs from serial"
            checked += 1
    assert checked


def qlora_equals_serial(ctx, model_type, plan, uneven, kind="nf4", head=False):
    extra = dict(quantize_head=True) if head else {}  # the output head's logits on fp8 too (test_fp8_head)
    serial, par = qlora_pair(ctx, model_type, plan, uneven, quantize_base=kind, **extra)
    _same_quantized_buffers(serial, par, ctx)
    serial, par = serial.double(), par.double()  # NF4 dequantized to fp64: exact products, fp64 sums
    _, worst = backward_both(serial, par, make_batch(model_type), ctx, edges(par))
    grads = dict(serial.named_parameters())
    for name, p in par.named_parameters():
        if p.requires_grad:
            err = rel_err(gather_full(p.grad, p, ctx.mp), grads[name].grad)
            assert err < RTOL, f"QLoRA on {plan}: grad of {name}: relative error {err:.2e}"
            worst = max(worst, err)
    assert worst < RTOL, worst
    return worst


def bf16_base_equals_serial(ctx, model_type, plan, uneven):
    serial, par = qlora_pair(ctx, model_type, plan, uneven, dtype="bfloat16")
    for name, p in par.named_parameters():
        if not p.requires_grad:
            assert p.dtype == torch.bfloat16
            assert torch.equal(gather_full(p.detach(), p, ctx.mp), dict(serial.named_parameters())[name].detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_s, out_p = serial(**make_batch(model_type)), par(**make_batch(model_type))
    assert rel_err(edges(par).to_replicated(out_p.logits).float().detach(), out_s.logits.float().detach()) < 2e-2
    return abs(out_p.loss.item() - out_s.loss.item()) / out_s.loss.item()


@pytest.mark.parametrize("model_type,world,plan,uneven", [
    ("llama", 2, "tp", False), ("llama", 2, "sp", False), ("llama", 2, "galaxy", False),
    ("llama", 2, "galaxy2", False), ("llama", 3, "galaxy", True), ("bert", 2, "galaxy", False),
    ("bert", 3, "tp", True)])
def test_every_plan_equals_serial_qlora(dist_pool, model_type, world, plan, uneven):
    dist_pool.run(qlora_equals_serial, world, model_type, plan, uneven)


@pytest.mark.parametrize("plan", ["tp", "galaxy"])
def test_load_quantized_on_a_plan_equals_serial(dist_pool, hf_llama, plan):
    dist_pool.run(load_quantized_on_plan, 2, hf_llama, plan)


@pytest.mark.parametrize("model_type,world,plan,uneven", [("llama", 2, "galaxy", False), ("bert", 3, "tp", True)])
def test_every_plan_equals_serial_int8(dist_pool, model_type, world, plan, uneven):
    dist_pool.run(qlora_equals_serial, world, model_type, plan, uneven, "int8")


@pytest.mark.parametrize("world,plan,uneven", [(2, "galaxy", False), (3, "tp", True)])
def test_bf16_base_plans_equal_serial(dist_pool, world, plan, uneven):
    assert max(dist_pool.run(bf16_base_equals_serial, world, "llama", plan, uneven)) < 1e-2


# ----------------------------------------------------------------------------- DP and PP around QLoRA


def qlora_dp_pp_equals_serial(ctx, case):
    """The Trainer (dp sum, pipeline schedule, mp rules, AdamW) on QLoRA equals serial QLoRA in fp64."""
    from galaxy.train.loop import Trainer
    from tests.core.test_dp_pp import LLAMA, TRAIN, llama_batch_at

    tuning = dict(tuning="lora", quantize_base="nf4", lora_target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    cfg = GalaxyConfig.from_dict(dict(LLAMA, **TRAIN, **tuning, **case))
    serial_cfg = GalaxyConfig.from_dict(dict(LLAMA, **TRAIN, **tuning))
    ctx.stage_layers = cfg.stage_layers()
    model = apply_tuning(LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11), cfg, init_std=0.2)
    serial = apply_tuning(LlamaForCausalLM(serial_cfg.model, seed=11), serial_cfg, init_std=0.2)
    assert any(isinstance(m, NF4Weight) for m in model.modules())
    par, ref = Trainer(model, cfg, ctx), Trainer(serial, serial_cfg, ParallelContext.serial())
    params_s = dict(serial.named_parameters())
    for step in range(2):
        loss = par.forward_backward(par.read_batch(llama_batch_at, step))
        loss_s = ref.forward_backward(llama_batch_at(step))
        assert abs(loss.item() - loss_s.item()) <= RTOL * abs(loss_s.item()), (step, loss.item(), loss_s.item())
        for name, p in model.named_parameters():
            if p.requires_grad:
                err = rel_err(gather_full(p.grad, p, ctx.mp), params_s[name].grad)
                assert err < RTOL, f"step {step}: grad of {name}: relative error {err:.2e}"
        par.optimizer_step(loss, step + 1)
        ref.optimizer_step(loss_s, step + 1)
    for name, p in model.named_parameters():
        err = rel_err(gather_full(p.detach(), p, ctx.mp), params_s[name].detach(), floor=1e-2)
        assert err < RTOL, f"{name} after 2 AdamW steps: relative error {err:.2e}"
    par.grad_sync.remove()


@pytest.mark.parametrize("case", [dict(dp_size=2, pp_size=2, num_microbatches=2),
                                  dict(dp_size=2, plan="galaxy"),
                                  dict(pp_size=2, plan="tp", num_microbatches=2, pipeline_schedule="gpipe")],
                         ids=["dp2-pp2", "dp2-galaxy2", "pp2-tp2"])
def test_qlora_dp_pp_equal_serial(dist_pool, case):
    dist_pool.run(qlora_dp_pp_equals_serial, 4, case, dp=case.get("dp_size", 1), pp=case.get("pp_size", 1))


def test_parameter_counts_do_not_change_with_quantization():
    from galaxy.peft import trainable_parameters

    cfg, cfg_q = cfg_for(), cfg_for(quantize_base="nf4")
    plain = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg)
    quantized = apply_tuning(LlamaForCausalLM(cfg_q.model, seed=1), cfg_q)
    assert trainable_parameters(quantized) == trainable_parameters(plain)


@pytest.mark.parametrize("method,quantize_base", [("lora", "none"), ("lora", "nf4"), ("adapter", "none")])
def test_a_bf16_base_also_runs_without_autocast(method, quantize_base):
    """Generation runs outside autocast: the fp32 trainable weights take the bf16 activations (cast,
    as PEFT does) and hand bf16 back, so the model computes what it computes under autocast."""
    cfg = cfg_for(tuning=method, dtype="bfloat16", quantize_base=quantize_base)
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.1)
    ids = batch()["input_ids"]
    with torch.no_grad():
        plain = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(ids).logits
    assert plain.dtype == torch.bfloat16
    assert rel_err(plain.float(), amp.float()) < 2e-2


def test_casting_a_qlora_model_keeps_the_nf4_scales():
    cfg = cfg_for(quantize_base="nf4")
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg)
    q = next(m for m in model.modules() if isinstance(m, NF4Weight))
    before = q.dequantize(torch.float32)
    model.to(torch.bfloat16)
    assert q.absmax_scale.dtype == q.absmax_offset.dtype == torch.float32 and q.packed.dtype == torch.uint8
    assert torch.equal(q.dequantize(torch.float32), before)


def bf16_qlora_pipeline_step(ctx, quantize_base):
    """A bf16 QLoRA / bf16-base LoRA step over two pipeline stages: the stages agree on the dtype the
    activations travel in (the stream's: bf16), and the loss is the serial model's to bf16 rounding."""
    from galaxy.train.loop import Trainer, autocast_context
    from tests.core.test_dp_pp import LLAMA, TRAIN, llama_batch_at

    raw = dict(LLAMA, **dict(TRAIN, dtype="bfloat16"), tuning="lora", quantize_base=quantize_base)
    cfg = GalaxyConfig.from_dict(dict(raw, pp_size=2, num_microbatches=2))
    serial_cfg = GalaxyConfig.from_dict(raw)
    ctx.stage_layers = cfg.stage_layers()
    model = apply_tuning(LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11), cfg, init_std=0.2)
    serial = apply_tuning(LlamaForCausalLM(serial_cfg.model, seed=11), serial_cfg, init_std=0.2)
    amp = lambda: autocast_context(cfg, ctx.device)  # noqa: E731
    par, ref = Trainer(model, cfg, ctx), Trainer(serial, serial_cfg, ParallelContext.serial())
    loss, loss_s = par.forward_backward(llama_batch_at(0), amp), ref.forward_backward(llama_batch_at(0), amp)
    assert abs(loss.item() - loss_s.item()) < 1e-2 * loss_s.item(), (loss.item(), loss_s.item())


@pytest.mark.parametrize("quantize_base", ["none", "nf4"])
def test_bf16_base_pipeline_step(dist_pool, quantize_base):
    dist_pool.run(bf16_qlora_pipeline_step, 2, quantize_base, pp=2)


def test_int8_is_bitsandbytes_llm_int8_weights():
    try:
        import bitsandbytes.functional as bnbf
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        pytest.skip(f"bitsandbytes does not import here: {e}")
    torch.manual_seed(6)
    w = torch.randn(24, 80) * 0.05
    q = Int8Weight.quantize(w, None, transposed=False)
    codes, absmax, _ = bnbf.int8_vectorwise_quant(w.clone())
    assert torch.equal(q.codes, codes) and torch.equal(q.absmax, absmax)
    assert torch.equal(q.dequantize(torch.float32), bnbf.int8_vectorwise_dequant(codes, absmax))
    assert q.nbytes() == 24 * (80 + 4)  # 1 byte a weight and one fp32 absmax a row


def test_int8_base_stores_a_byte_a_weight():
    cfg = cfg_for(dtype="bfloat16", quantize_base="int8")
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.1)
    stored = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    assert stored and all(isinstance(m, Int8Weight) for m in stored)
    others = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen_bytes(model)[0] == 2 * others + sum(m.codes.numel() + 4 * m.codes.shape[0] for m in stored)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch()).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_qlora_resume_from_a_checkpoint_repeats_the_run(tmp_path):
    """A bf16-base QLoRA run saved at step 2 and resumed gives steps 3 and 4 exactly as the run that went on
    (the checkpoint holds the fp32 LoRA factors and their AdamW state; the NF4 base is rebuilt from the seed)."""
    import json

    from tests.in_process import run_script

    common = ["pretrain_galaxy.py", "--world", "2", "--max_steps", "4",
              "--no_progress", "--override", "tuning=lora", "--override", "dtype=bfloat16",
              "--override", "quantize_base=nf4", "--override", "global_batch_size=4"]

    def losses(extra, name):
        metrics = tmp_path / name
        # in this process (tests.in_process); the ranks are processes of their own
        out = run_script(common + extra + ["--metrics_file", str(metrics)], cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return {row["step"]: row["loss"] for row in map(json.loads, metrics.read_text().splitlines())}

    whole = losses(["--save_dir", str(tmp_path / "ck"), "--save_every", "2"], "whole.jsonl")
    resumed = losses(["--resume", str(tmp_path / "ck" / "step_000002")], "resumed.jsonl")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == whole[s] for s in (3, 4)), (whole, resumed)
