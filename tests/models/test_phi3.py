"""Phi-3 (one folder, galaxy/models/phi3, and one registry line) against ``transformers.Phi3ForCausalLM``
on the same weights in float64 (equal logits and loss, saved directories both ways and greedy ``generate``:
tests/models/test_variants_hf.py); the fused weights' layouts convert both ways; every plan (none, TP, SP, Galaxy, Galaxy2, mixed; even and
uneven splits, 2-4 ranks) trains equal to the serial model in float64, CoC and recompute included, and
generates what it generates; what Galaxy's Phi-3 does not compute is refused by name."""

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.models import check_config, family
from galaxy.models.phi3.model import Phi3ForCausalLM
from galaxy.models.phi3.hf import qkv_from_groups, qkv_to_groups
from tests.core import test_llama_equivalence as llama_eq
from tests.models.test_llama import VOCAB

transformers = pytest.importorskip("transformers")

# HF's RMSNorm computes in float32 even on float64 weights (ours keeps float64): the difference that leaves.
ATOL = 1e-5
PHI3 = dict(model_type="phi3")


def hf_phi3(**kw):
    """A tiny random HF Phi-3: 4 query heads in 2 key/value groups, 3 layers (past the first two)."""
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(**dict(dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64, initializer_range=0.2, pad_token_id=None,
                                              bos_token_id=None, eos_token_id=None), **kw))
    return transformers.Phi3ForCausalLM(cfg).double().eval()


def test_the_fused_layouts_convert_both_ways():
    """qkv_proj's HF rows (q, then k, then v) <-> whole key/value groups; a model's own state and HF's
    both load; the state it saves is HF's."""
    w = torch.randn(4 * 8 + 2 * 2 * 8, 32, dtype=torch.float64)  # 4 query heads, 2 kv heads, head size 8
    groups = qkv_to_groups(w, kv_heads=2, head_dim=8)
    assert groups.shape == (2, 4, 8, 32) and torch.equal(qkv_from_groups(groups), w)
    assert torch.equal(groups[1, 0], w[2 * 8: 3 * 8])  # group 1's first query head is query head 2
    assert torch.equal(groups[0, 2], w[32: 40]) and torch.equal(groups[1, 3], w[32 + 16 + 8:])  # k of 0, v of 1
    cfg = GalaxyConfig.from_dict(dict(llama_eq.TINY, **PHI3, seq_length=11)).model
    model, other = Phi3ForCausalLM(cfg, seed=1), Phi3ForCausalLM(cfg, seed=2)
    own = model.full_state_dict()
    other.load_full_state_dict(own)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))
    hf = model.state_to_hf(own)
    assert hf["model.layers.0.self_attn.qkv_proj.weight"].shape == ((8 + 2 * 4) * 4, 32)
    assert hf["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 40, 32)
    other = Phi3ForCausalLM(cfg, seed=2)
    other.load_full_state_dict(hf)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters()))


@pytest.mark.parametrize("changes,match", [
    (dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4,
                               long_factor=[1.0] * 4)), "rope type 'longrope'"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
     "partial_rotary_factor=0.5"),
    (dict(rope_parameters=None, partial_rotary_factor=0.75), "partial_rotary_factor=0.75"),  # transformers 4's key
    (dict(sliding_window=16), "sliding_window=16 below max_position_embeddings 64"),
])
def test_what_galaxy_does_not_compute_is_refused(changes, match):
    hf = dict(hf_phi3().config.to_dict(), **changes)
    with pytest.raises(ValueError, match=match):
        Phi3ForCausalLM.config_from_hf(hf)


def test_the_familys_tiny_config_builds_and_fused_gate_up_is_refused():
    cfg = GalaxyConfig.from_dict(dict(family("phi3").tiny_config, seq_length=16))
    model = Phi3ForCausalLM(cfg.model, seed=1)
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (2, 4, 16, 64)
    with pytest.raises(ConfigError, match="fused_gate_up.*model_type is 'phi3'"):
        check_config(GalaxyConfig.from_dict(dict(family("phi3").tiny_config, fused_gate_up=True)).model)


def test_a_frozen_base_reads_the_checkpoint_whole_and_quantize_on_load_is_refused(tmp_path):
    """Phi-3's fused weights have another layout than HF's, so ``build_base`` reads the checkpoint whole
    (through ``state_from_hf``) instead of tensor by tensor under its names, and refuses to quantize it as
    it streams (seen to fail before: the streaming loader read HF's 2-D qkv_proj for the 4-D one)."""
    from galaxy.core.context import ParallelContext
    from galaxy.peft import build_base

    hf_phi3().save_pretrained(str(tmp_path))
    raw = dict(family("phi3").tiny_config, seq_length=8, model_path=str(tmp_path), tuning="lora", dtype="bfloat16")
    base = build_base(GalaxyConfig.from_dict(raw), None, ParallelContext.serial())
    want = Phi3ForCausalLM.from_pretrained(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(base.parameters(), want.parameters()))
    with pytest.raises(ConfigError, match="quantize-on-load.*Phi-3 holds HF's fused qkv_proj"):
        build_base(GalaxyConfig.from_dict(dict(raw, quantize_base="nf4")), None, ParallelContext.serial())


# ----------------------------------------------------------------------------- every plan equals serial
# The equivalence machinery of tests/core/test_llama_equivalence.py, with Phi-3's model_type.


@pytest.mark.parametrize("plan", llama_eq.PRESETS)
@pytest.mark.parametrize("world", [2, 4])
def test_preset_equals_serial(dist_pool, plan, world):
    dist_pool.run(llama_eq.compare_with_serial, world, plan, False, PHI3)


@pytest.mark.parametrize("plan", llama_eq.PRESETS)
def test_uneven_world3_equals_serial(dist_pool, plan):
    dist_pool.run(llama_eq.compare_with_serial, 3, plan, True, PHI3)


@pytest.mark.parametrize("methods", llama_eq.MIXED, ids=["-".join(m) for m in llama_eq.MIXED])
def test_mixed_uneven_equals_serial(dist_pool, methods):
    dist_pool.run(llama_eq.compare_with_serial, 3, methods, True, PHI3)


@pytest.mark.parametrize("plan,extra", [("tp", dict(coc_parallel_num=2)), ("galaxy", dict(coc_parallel_num=4)),
                                        ("galaxy", dict(recompute="mlp")), ("galaxy2", dict(recompute="selective")),
                                        ("tp", dict(tie_word_embeddings=True, recompute="full"))])
def test_overlap_recompute_and_tied_equal_serial(dist_pool, plan, extra):
    dist_pool.run(llama_eq.compare_with_serial, 3, plan, True, dict(PHI3, **extra))


@pytest.mark.parametrize("plan_spec", ["tp", "galaxy", "sp"])
def test_generate_on_plan_equals_serial(dist_pool, plan_spec):
    fn = llama_eq.generate_on_plan if plan_spec == "tp" else llama_eq.generate_on_sp_plan
    dist_pool.run(fn, 3, plan_spec, True, PHI3)
