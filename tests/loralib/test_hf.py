"""LoRA adapters in HF PEFT's layout (``galaxy.loralib.hf``) on their own (through ``galaxy.peft`` and against
``peft`` itself: tests/peft/test_peft.py): an adapter saved from one model loads into a model without LoRA,
injecting it on exactly the saved modules with the saved r/alpha/rsLoRA, to the same tensors and logits;
what the format cannot carry or Galaxy does not compute is refused by name."""

import json

import pytest
import torch

from galaxy.config import ModelConfig
from galaxy.loralib.hf import CONFIG_FILE, WEIGHTS_FILE, load_lora_pretrained, save_lora_pretrained
from galaxy.loralib.model import inject_lora, lora_modules, lora_state_dict, merge_lora
from galaxy.models.bert.model import BertForMaskedLM

TINY = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16)


def tuned():
    model = BertForMaskedLM(ModelConfig(**TINY), seed=1)
    inject_lora(model, ["query", "value"], r=2, lora_alpha=6.0, use_rslora=True, seed=2, init_b_std=0.3)
    return model.eval()


def test_a_saved_adapter_loads_into_a_model_without_lora(tmp_path):
    ours = tuned()
    save_lora_pretrained(ours, str(tmp_path))
    with open(tmp_path / CONFIG_FILE) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["use_rslora"], config["target_modules"]) == \
        (2, 6.0, True, ["query", "value"])
    fresh = BertForMaskedLM(ModelConfig(**TINY), seed=1).eval()
    loaded = load_lora_pretrained(fresh, str(tmp_path), seed=9)
    assert sorted(lora_modules(fresh)) == sorted(lora_modules(ours)) and sorted(loaded) == sorted(lora_state_dict(ours))
    for name, tensor in lora_state_dict(ours).items():
        assert torch.equal(lora_state_dict(fresh)[name], tensor), name
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, ours(ids).logits, rtol=0, atol=0)


def test_what_cannot_be_carried_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no LoRA layers to save"):
        save_lora_pretrained(BertForMaskedLM(ModelConfig(**TINY)), str(tmp_path / "none"))
    save_lora_pretrained(tuned(), str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    for key, value, says in (("use_dora", True, "PEFT option use_dora=True"), ("peft_type", "IA3", "is IA3, not LORA")):
        (tmp_path / "a" / CONFIG_FILE).write_text(json.dumps(dict(config, **{key: value})))
        with pytest.raises(ValueError, match=says):
            load_lora_pretrained(BertForMaskedLM(ModelConfig(**TINY)), str(tmp_path / "a"))
    (tmp_path / "a" / CONFIG_FILE).write_text(json.dumps(config))
    merged = tuned()
    merge_lora(merged)
    with pytest.raises(ValueError, match="merged; unmerge before loading"):
        load_lora_pretrained(merged, str(tmp_path / "a"))
    (tmp_path / "a" / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=f"has no {WEIGHTS_FILE}"):
        load_lora_pretrained(BertForMaskedLM(ModelConfig(**TINY)), str(tmp_path / "a"))
