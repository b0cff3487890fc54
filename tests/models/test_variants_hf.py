"""The LLaMA variants (Qwen2 with random q/k/v biases in float32, Phi-3 with fused q/k/v and gate/up in
float64) against transformers on the same weights, one test per check over both families: equal logits
and loss loading HF's directory (GQA, padding, tied and untied embeddings); our saved directory loads in
transformers (HF's own layout, bit for bit) and in Galaxy; greedy ``generate`` token for token."""

import json
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from galaxy.models import family
from galaxy.models.generation import generate
from galaxy.models.phi3.model import Phi3ForCausalLM
from galaxy.models.qwen2.model import Qwen2ForCausalLM
from tests.models.test_llama import batch as llama_batch  # 3 rows of 10 tokens, right and left padding
from tests.models.test_phi3 import ATOL as PHI3_ATOL, hf_phi3
from tests.models.test_qwen2 import ATOL as QWEN2_ATOL, hf_qwen2, padded_batch

transformers = pytest.importorskip("transformers")


@dataclass(frozen=True)
class Variant:
    model: type
    hf_name: str  # transformers' class
    hf: Callable  # a tiny random HF model: hf(tie_word_embeddings=...)
    batch: Callable  # (ids, mask)
    dtype: torch.dtype  # both models run in it
    atol: float
    new_tokens: int
    saved: dict = field(default_factory=dict)  # config.json values HF reads for this family
    not_saved: tuple = ()  # config.json keys left out


VARIANTS = {
    "qwen2": Variant(Qwen2ForCausalLM, "Qwen2ForCausalLM", hf_qwen2, padded_batch, torch.float32, QWEN2_ATOL, 10,
                     saved=dict(use_sliding_window=False), not_saved=("attention_bias",)),
    "phi3": Variant(Phi3ForCausalLM, "Phi3ForCausalLM", hf_phi3, llama_batch, torch.float64, PHI3_ATOL, 8),
}


@pytest.fixture(scope="module", params=[(name, tie) for name in VARIANTS for tie in ("untied", "tied")],
                ids=lambda p: "-".join(p))
def pair(request, tmp_path_factory):
    """(the family's name, HF model, ours loaded from its saved directory)."""
    name, tie = request.param
    v = VARIANTS[name]
    hf = v.hf(tie_word_embeddings=tie == "tied").to(v.dtype).eval()
    path = str(tmp_path_factory.mktemp(f"{name}-{tie}"))
    hf.save_pretrained(path)
    return name, hf, v.model.from_pretrained(path).to(v.dtype).eval()


@torch.no_grad()
def test_logits_and_loss_equal_hf(pair):
    name, hf, ours = pair
    v = VARIANTS[name]
    assert ours.config.model_type == name and isinstance(ours, family(name))
    assert ours.config.qkv_bias == (name == "qwen2")
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in hf.named_parameters()}
    ids, mask = v.batch()
    valid = mask.bool()  # padded queries are undefined in both; compare real tokens
    torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=0, atol=v.atol)
    torch.testing.assert_close(ours(ids, attention_mask=mask).logits[valid],
                               hf(ids, attention_mask=mask).logits[valid], rtol=0, atol=v.atol)
    labels = ids.masked_fill(~valid, -100)
    want = hf(ids, attention_mask=mask, labels=labels).loss
    assert abs(ours(ids, attention_mask=mask, labels=labels).loss.item() - want.item()) < v.atol


@torch.no_grad()
def test_save_pretrained_loads_in_transformers_and_in_galaxy(pair, tmp_path):
    name, hf, ours = pair
    v = VARIANTS[name]
    ours.save_pretrained(str(tmp_path))
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)
    assert saved["model_type"] == name and saved["architectures"] == [v.hf_name]
    assert all(saved[k] == value for k, value in v.saved.items()) and not set(v.not_saved) & set(saved)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).to(v.dtype).eval()
    assert type(back) is getattr(transformers, v.hf_name)
    for key, p in hf.named_parameters():  # HF's own layout, bit for bit
        assert torch.equal(dict(back.named_parameters())[key], p), key
    ids, mask = v.batch()
    assert torch.equal(back(ids, attention_mask=mask).logits, hf(ids, attention_mask=mask).logits)
    again = v.model.from_pretrained(str(tmp_path)).to(v.dtype).eval()
    assert torch.equal(again(ids).logits, ours(ids).logits)


def test_greedy_generate_equals_hf(pair):
    name, hf, ours = pair
    v = VARIANTS[name]
    ids, _ = v.batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as generation pads
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=v.new_tokens, do_sample=False)
    assert torch.equal(generate(ours, ids, v.new_tokens, attention_mask=mask), want)
    assert torch.equal(generate(ours, ids, v.new_tokens, attention_mask=mask, use_cache=False), want)
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=v.new_tokens, do_sample=False), want)
