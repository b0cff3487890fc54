"""The ``llama-8b`` preset is Llama-3.1-8B (the values of its published config.json): its HF config is a
transformers ``LlamaConfig`` with those values and reads back to the same model config; on the meta device
it has transformers' parameter count; its llama3 RoPE frequencies are transformers' rope init; and a tiny
model with the same RoPE settings gives transformers' logits in float64."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from galaxy.config import GalaxyConfig  # noqa: E402
from galaxy.models.llama.model import LlamaForCausalLM, rope_inv_freq  # noqa: E402

# meta-llama/Llama-3.1-8B config.json
LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
                   hidden_act="silu", tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)


def preset():
    return GalaxyConfig.from_dict({"model": {"preset": "llama-8b"}, "train": {"seq_length": 8192}}).model


def test_hf_config_is_llama_31_8b_and_round_trips():
    ours = preset()
    hf = transformers.LlamaConfig(**LlamaForCausalLM.hf_config(ours))
    for key, value in LLAMA_31_8B.items():
        assert getattr(hf, key) == value, key
    assert hf.head_dim == 128 and hf.rope_parameters == ROPE
    back = LlamaForCausalLM.config_from_hf(hf.to_dict())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
                "rope_theta", "rope_scaling", "pad_token_id"):
        assert getattr(back, key) == getattr(ours, key), key


def test_parameter_count_is_transformers():
    ours = LlamaForCausalLM(preset(), meta=True)
    with torch.device("meta"):
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LlamaForCausalLM.hf_config(preset())))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == 8_030_261_248


def test_llama3_rope_frequencies_are_transformers_rope_init():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    want, scale = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**LLAMA_31_8B, rope_parameters=ROPE), "cpu")
    got = rope_inv_freq(preset())
    assert scale == 1.0 and got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)
    default = rope_inv_freq(GalaxyConfig.from_dict({"model": {"preset": "llama-8b", "rope_scaling": None}}).model)
    assert not torch.equal(got, default), "the scaling moves the low frequencies"


@torch.no_grad()
def test_tiny_model_with_the_8b_rope_equals_transformers_in_float64(tmp_path):
    """Head size 16 (8 frequencies): with theta 500k the wavelengths fall on both sides of llama3's band
    [8192 / 4, 8192] and inside it, so every branch of the scaling is taken. The cos/sin tables are
    transformers' bit for bit; the logits to 1e-6, as transformers' RMSNorm computes its statistics in
    fp32 even in a float64 model (about 2e-7 here), while the same model without the scaling is 1e-2 off."""
    from galaxy.models.llama.model import LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=131072,
                                   rms_norm_eps=1e-5, initializer_range=0.2, rope_parameters=ROPE,
                                   bos_token_id=None, eos_token_id=None)
    hf = transformers.LlamaForCausalLM(cfg).double().eval()
    hf.save_pretrained(str(tmp_path))
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path)).double().eval()
    assert ours.config.rope_scaling == {k: v for k, v in ROPE.items() if k != "rope_theta"}
    wavelengths = 2 * torch.pi / rope_inv_freq(dataclasses.replace(ours.config, rope_scaling=None))
    assert (wavelengths < 8192 / 4).any() and (wavelengths > 8192).any()
    assert ((wavelengths >= 8192 / 4) & (wavelengths <= 8192)).any()
    positions = torch.arange(40)[None]
    x = torch.zeros(1, 40, 32, dtype=torch.float64)
    tables = LlamaRotaryEmbedding(ours.config)(positions, torch.float64), hf.model.rotary_emb(x, positions)
    for got, want in zip(*tables):
        assert torch.equal(got, want)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    got = ours(ids).logits
    assert got.dtype == torch.float64
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    unscaled = LlamaForCausalLM.from_pretrained(str(tmp_path), config_overrides={"rope_scaling": None}).double()
    assert ((unscaled(ids).logits - want).norm() / want.norm()).item() > 1e-3, "the scaling matters here"
