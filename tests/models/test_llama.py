"""LLaMA against ``transformers`` on the same weights: a tiny random HF ``LlamaForCausalLM`` with
GQA loads through our ``from_pretrained`` with equal logits (padding, llama3 / linear RoPE
scaling, tied embeddings) and loss; our ``save_pretrained`` loads back in transformers; greedy
``generate`` equals HF's token for token, the KV cache equals re-running the sequence, and
seeded sampling is reproducible."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from galaxy.config import GalaxyConfig  # noqa: E402
from galaxy.models.generation import generate, top_k_top_p_filter  # noqa: E402
from galaxy.models.llama.model import LlamaForCausalLM  # noqa: E402

VOCAB, SEQ = 96, 10
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
LINEAR = dict(rope_type="linear", rope_theta=1000.0, factor=2.0)
VARIANTS = {"default": dict(), "llama3": dict(rope_parameters=LLAMA3), "linear": dict(rope_parameters=LINEAR),
            "tied": dict(tie_word_embeddings=True)}
ATOL = 1e-5


def hf_model(variant="default", **kw):
    torch.manual_seed(0)
    options = {"bos_token_id": None, "eos_token_id": None, **VARIANTS[variant], **kw}
    # initializer_range 0.2 spreads the logits, so greedy choices are not near-ties.
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.2, **options)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(HF model, ours loaded from its saved directory, the directory)."""
    hf = hf_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    return hf, LlamaForCausalLM.from_pretrained(path).eval(), path


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 3:] = 0  # right padding
    mask[2, :2] = 0  # left padding
    return ids, mask


def close(a, b):
    return torch.allclose(a, b, atol=ATOL, rtol=0)


@torch.no_grad()
def test_logits_and_loss_equal_hf(pair):
    hf, ours, _ = pair
    ids, mask = batch()
    assert close(ours(ids).logits, hf(ids).logits)
    valid = mask.bool()  # padded queries are undefined in both; compare real tokens
    assert close(ours(ids, attention_mask=mask).logits[valid], hf(ids, attention_mask=mask).logits[valid])
    labels = ids.masked_fill(~valid, -100)
    labels[0, 3] = -100
    want = hf(ids, attention_mask=mask, labels=labels).loss
    got = ours(ids, attention_mask=mask, labels=labels).loss
    assert abs(got.item() - want.item()) < ATOL, (got.item(), want.item())


def test_config_round_trip(pair):
    hf, ours, path = pair
    c = ours.config
    assert c.num_key_value_heads == 2 and c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert c.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert (c.rope_scaling or {}).get("rope_type", "default") == hf.config.rope_parameters["rope_type"]
    names = {n for n, _ in ours.named_parameters()}
    assert ("lm_head.weight" in names) != c.tie_word_embeddings
    assert {n for n, _ in hf.named_parameters()} == names


@torch.no_grad()
def test_save_pretrained_loads_in_transformers(pair, tmp_path):
    hf, ours, _ = pair
    ours.save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)
    assert saved["model_type"] == "llama" and saved["architectures"] == ["LlamaForCausalLM"]
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert back.config.rope_parameters == hf.config.rope_parameters
    ids, mask = batch()
    assert torch.equal(back(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits)
    # and our own loader reads what we wrote
    again = LlamaForCausalLM.from_pretrained(str(tmp_path))
    assert torch.equal(again(ids).logits, ours(ids).logits)


def test_greedy_generate_equals_hf(pair):
    hf, ours, _ = pair
    ids, _ = batch()
    want = hf.generate(ids, max_new_tokens=12, do_sample=False)
    got = generate(ours, ids, 12)
    assert torch.equal(got, want), (got, want)
    # the HF-style method, with HF's argument names
    assert torch.equal(ours.generate(ids, max_new_tokens=12, do_sample=False), want)
    assert torch.equal(generate(ours, ids, 12, use_cache=False), got)


def test_left_padded_generate_equals_hf():
    hf = hf_model()
    ours = _ours_from(hf)
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = generate(ours, ids, 12, attention_mask=mask)
    assert torch.equal(got, want)
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False), want)
    assert torch.equal(generate(ours, ids, 12, attention_mask=mask, use_cache=False), got)


def _ours_from(hf):
    ours = LlamaForCausalLM(LlamaForCausalLM.config_from_hf(hf.config.to_dict()))
    ours.load_full_state_dict(hf.state_dict())
    return ours.eval()


def test_eos_stops_and_pads_like_hf():
    hf = hf_model()
    ours = _ours_from(hf)
    ids, _ = batch()
    free = generate(ours, ids, 12)
    eos = int(free[0, SEQ + 4])  # a token row 0 emits mid-way: it finishes there, others run on
    want = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    got = generate(ours, ids, 12, eos_token_id=eos)
    assert torch.equal(got, want), (got, want)
    assert (got[0, SEQ + 4:] == eos).all()


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    ours = _ours_from(hf_model())
    ids, _ = batch()

    def sample(seed, **kw):
        return generate(ours, ids, 8, do_sample=True, generator=torch.Generator().manual_seed(seed), **kw)

    a, b = sample(5, temperature=0.8, top_k=20, top_p=0.9), sample(5, temperature=0.8, top_k=20, top_p=0.9)
    assert torch.equal(a, b)
    assert not torch.equal(sample(5, temperature=5.0), sample(6, temperature=5.0))
    assert torch.equal(sample(7, top_k=1, temperature=3.0), generate(ours, ids, 8))
    assert torch.equal(sample(7, top_p=1e-6), generate(ours, ids, 8))


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(top_k_top_p_filter(logits, **kw))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.7) == [True, True, False, False]  # 0.5 < 0.7, 0.8 covers it
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(top_k=1, top_p=0.99) == [True, False, False, False]


def test_llama_tiny_preset_builds_and_trains():
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", seq_length=16)).model
    model = LlamaForCausalLM(cfg, seed=1)
    again = LlamaForCausalLM(cfg, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert abs(out.loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5
    assert all(p.grad is not None for p in model.parameters())


def test_unsupported_hf_configs_are_refused():
    base = hf_model().config.to_dict()
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        LlamaForCausalLM.config_from_hf(dict(base, rope_parameters=dict(rope_type="yarn", factor=2.0)))
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaForCausalLM.config_from_hf(dict(base, attention_bias=True))
    # transformers 4.x spelling: rope_scaling + top-level rope_theta
    old = {k: v for k, v in base.items() if k != "rope_parameters"}
    cfg = LlamaForCausalLM.config_from_hf(dict(old, rope_theta=123.0, rope_scaling=dict(type="linear", factor=2.0)))
    assert cfg.rope_theta == 123.0 and cfg.rope_scaling == dict(rope_type="linear", factor=2.0)


def test_save_keeps_special_token_ids(tmp_path):
    hf = hf_model(bos_token_id=3, eos_token_id=4)
    src = tmp_path / "src"
    hf.save_pretrained(str(src))
    ours = LlamaForCausalLM.from_pretrained(str(src))
    ours.save_pretrained(str(tmp_path / "out"))
    with open(os.path.join(tmp_path, "out", "config.json")) as f:
        saved = json.load(f)
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (3, 4)


@torch.no_grad()
def test_prefill_with_the_cache_equals_the_forward_without_it():
    """Every position's logits of a prefill that fills the KV cache equal those of the plain forward, with
    more than two layers (a layer past the second read the first layer's cache length as its own, which
    made its prefill attention non-causal: seen to fail before)."""
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", seq_length=16, num_hidden_layers=3)).model
    model = LlamaForCausalLM(cfg, seed=1).double().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model(ids, use_cache=True).logits, model(ids).logits, atol=1e-12, rtol=0)
