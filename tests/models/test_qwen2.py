"""Qwen2 against ``transformers.Qwen2ForCausalLM`` on the same weights (random q/k/v biases; equal logits,
loss, saved directories and greedy ``generate``: tests/models/test_variants_hf.py); a sliding window refused;
every plan (TP, SP, Galaxy, Galaxy2, mixed, uneven splits, 2 and 3 ranks) equal to the serial
model in float64, loss, logits and every gradient, and so is LoRA on it; LoRA files crossing to
and from HF ``peft`` with equal logits; the planner's parameter counts equal the model's, and its
profiler times Qwen2's blocks."""

import numpy as np
import pytest
import torch

from galaxy.config import GalaxyConfig, Method
from galaxy.core.grad_sync import GradientSync, gather_full
from galaxy.models import build_model, family
from galaxy.models.generation import generate
from galaxy.models.qwen2.model import Qwen2ForCausalLM
from galaxy.peft import apply_tuning, load_tuning, save_tuning

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ, BATCH = 96, 11, 3
HF = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, bos_token_id=None,
          eos_token_id=None)
# 8 query heads sharing 4 key/value heads (GQA pairs), for the plans.
TINY = dict(model_type="qwen2", vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=40, hidden_act="silu", max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.1, pad_token_id=None)
UNEVEN3 = dict(tp_num_attention_heads_list=[2, 4, 2], tp_intermediate_size_list=[10, 20, 10],
               seq_scatter_list=[2, 5, 4])
RTOL, ATOL = 1e-9, 1e-5


def rel_err(a, b, floor=1e-6):
    return ((a - b).norm() / b.norm().clamp(min=floor)).item()


def hf_qwen2(**kw):
    """A tiny random HF Qwen2 whose q/k/v biases are not zero (HF initialises them to zero)."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**dict(HF, **kw))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def padded_batch(vocab=VOCAB):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 3:] = 0  # right padding
    mask[2, :2] = 0  # left padding
    return ids, mask


def test_sliding_window_is_refused_and_the_familys_tiny_config_builds():
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen2ForCausalLM.config_from_hf(dict(hf_qwen2().config.to_dict(), use_sliding_window=True))
    cfg = GalaxyConfig.from_dict(dict(family("qwen2").tiny_config, seq_length=16))
    assert cfg.model.model_type == "qwen2"
    model = Qwen2ForCausalLM(cfg.model, seed=1)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None


# ----------------------------------------------------------------------------- every plan equals serial


def plan_config(plan_spec, uneven, extra=None):
    raw = dict(TINY, seq_length=SEQ, **(extra or {}))
    if isinstance(plan_spec, str):
        raw["plan"] = plan_spec
    else:
        raw.update(zip(("att_parallel_method", "con_parallel_method", "mlp_parallel_method"), plan_spec))
    if uneven:
        raw.update(UNEVEN3)
    return GalaxyConfig.from_dict(raw)


def plan_batch():
    g = torch.Generator().manual_seed(1000)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 3:] = 0
    mask[2, :2] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), ids, torch.full_like(ids, -100)))


def compare_with_serial(ctx, plan_spec, uneven, tuning=None):
    cfg = plan_config(plan_spec, uneven, dict(tuning=tuning, lora_dropout=0.0) if tuning else None)
    serial = Qwen2ForCausalLM(cfg.model, seed=3).double()
    par = Qwen2ForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).double()
    g = torch.Generator().manual_seed(7)  # non-zero q/k/v biases (they start at zero, as in HF)
    state = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) if n.endswith(".bias") else p
             for n, p in serial.state_dict().items()}
    serial.load_full_state_dict(state)
    par.load_full_state_dict(state)  # q/k/v biases sharded with their heads
    if tuning:
        for model in (serial, par):
            apply_tuning(model, cfg, targets=["q_proj", "v_proj", "o_proj", "down_proj"], init_std=0.2)
    batch = plan_batch()
    sync = GradientSync([p for p in par.parameters() if p.requires_grad], ctx.mp)
    out_s, out_p = serial(**batch), par(**batch)
    out_s.loss.backward()
    out_p.loss.backward()
    sync()
    assert abs(out_p.loss.item() - out_s.loss.item()) <= RTOL * abs(out_s.loss.item())
    worst = rel_err(par.model.stream.to_replicated(out_p.logits).detach(), out_s.logits.detach())
    grads = {n: p.grad for n, p in serial.named_parameters() if p.requires_grad}
    assert grads and set(grads) == {n for n, p in par.named_parameters() if p.requires_grad}
    for name, p in par.named_parameters():
        if p.requires_grad:
            worst = max(worst, rel_err(gather_full(p.grad, p, ctx.mp), grads[name]))
    assert worst < RTOL, worst
    return worst


@pytest.mark.parametrize("plan", ["tp", "sp", "galaxy", "galaxy2"])
def test_plan_equals_serial(dist_pool, plan):
    dist_pool.run(compare_with_serial, 2, plan, False)


@pytest.mark.parametrize("plan_spec", ["galaxy", "tp", ("SP", "None", "TP"), ("TP", "SP", "SP")])
def test_uneven_world3_equals_serial(dist_pool, plan_spec):
    dist_pool.run(compare_with_serial, 3, plan_spec, True)


@pytest.mark.parametrize("plan,world", [("galaxy", 2), ("tp", 3)])
def test_lora_on_plan_equals_serial(dist_pool, plan, world):
    dist_pool.run(compare_with_serial, world, plan, world == 3, "lora")


def generate_on_plan(ctx, plan_spec):
    cfg = plan_config(plan_spec, True)
    serial = Qwen2ForCausalLM(cfg.model, seed=3).double()
    par = Qwen2ForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).double()
    ids = plan_batch()["input_ids"]
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    want = generate(serial, ids, 5, attention_mask=mask)
    assert torch.equal(generate(par, ids, 5, attention_mask=mask), want)


@pytest.mark.parametrize("plan_spec", ["galaxy", "tp"])
def test_generate_on_plan_equals_serial(dist_pool, plan_spec):
    dist_pool.run(generate_on_plan, 3, plan_spec)


# ----------------------------------------------------------------------------- HF peft both ways


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    hf_qwen2().save_pretrained(path)
    return path


def test_galaxy_lora_loads_in_hf_peft(hf_dir, tmp_path):
    ours = Qwen2ForCausalLM.from_pretrained(hf_dir).eval()
    cfg = GalaxyConfig.from_dict(dict(TINY, seq_length=SEQ, tuning="lora", lora_dim=4, lora_alpha=12.0))
    apply_tuning(ours, cfg, init_std=0.3)  # the family's default targets: q_proj, v_proj
    save_tuning(ours, str(tmp_path / "adapter"))
    base = transformers.Qwen2ForCausalLM.from_pretrained(hf_dir).eval()
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
        plain = transformers.Qwen2ForCausalLM.from_pretrained(hf_dir).eval()(ids, attention_mask=mask).logits
        got = theirs(input_ids=ids, attention_mask=mask).logits
    assert (want - plain).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_hf_peft_lora_loads_in_galaxy(hf_dir, tmp_path):
    torch.manual_seed(1)
    theirs = peft.get_peft_model(transformers.Qwen2ForCausalLM.from_pretrained(hf_dir),
                                 peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "up_proj"]))
    for name, p in theirs.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    theirs.save_pretrained(str(tmp_path / "peft"))
    ours = load_tuning(Qwen2ForCausalLM.from_pretrained(hf_dir).eval(), str(tmp_path / "peft"))
    ids, mask = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits,
                                   theirs.eval()(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the planner


def count_params(ctx, raw):
    from galaxy.core.layers import GradRule, grad_rule

    cfg = GalaxyConfig.from_dict(raw)
    params = list(build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx).parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if grad_rule(p) == GradRule.PARTIAL)


@pytest.mark.parametrize("methods", [("TP", "SP", "TP"), ("SP", "SP", "TP")])
def test_parameter_counts_match_the_model(dist_pool, methods):
    from galaxy.planner.workload import edge_params, layer_params

    heads, ffn = [6, 2], [15, 25]
    raw = dict(TINY, seq_length=SEQ, att_parallel_method=methods[0], con_parallel_method=methods[1],
               mlp_parallel_method=methods[2], tp_num_attention_heads_list=heads, tp_intermediate_size_list=ffn,
               seq_scatter_list=[7, 4])
    real = dist_pool.run(count_params, 2, raw)
    m = GalaxyConfig.from_dict(raw).model
    att, con, mlp = (Method(x) for x in methods)
    per_layer = layer_params(m, att, mlp, con, np.array(heads), np.array(ffn))
    edges = sum(edge_params(m))
    for rank, (total, partial) in enumerate(real):
        assert per_layer.total[rank] * m.num_hidden_layers + edges == total
        assert per_layer.partial[rank] * m.num_hidden_layers + (edges if con == Method.SP else 0) == partial


def profile_case(ctx):
    from galaxy.planner.profile import profile_rank

    m = GalaxyConfig.from_dict(dict(TINY, seq_length=8)).model
    cluster = profile_rank(ctx, m, rows=[1], seq=8, dtype="float32", reps=1, most_bytes=2**12)
    return None if cluster is None else cluster.to_dict()


def test_planner_profiles_qwen2(dist_pool):
    from galaxy.planner.cluster import PIECES, cluster_from_dict

    cluster = cluster_from_dict(dist_pool.run(profile_case, 2)[0], "profiled")
    assert cluster.model.model_type == "qwen2" and cluster.world == 2
    pieces = cluster.ranks[0].pieces[1]
    assert set(pieces) == set(PIECES)
    assert pieces["att_proj.heads"].fwd.sizes == (2, 4, 6, 8)  # whole GQA pairs only
    assert all(min(p.fwd.values) > 0 for p in pieces.values())
