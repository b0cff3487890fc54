"""A checkpoint exported to a HF directory (``export_hf``) without building a model: its config.json is
derived from the checkpoint's typed config, is what ``save_pretrained`` of the model writes, and
transformers loads the export to the same logits."""

import json

import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.models import build_model
from galaxy.train.checkpoint import save_checkpoint
from galaxy.train.checkpoint.hf_export import export_hf

transformers = pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 4, "intermediate_size": 40, "max_position_embeddings": 32, "pad_token_id": None,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "seq_length": 16}
BERT = {"preset": "bert-tiny", "vocab_size": 60, "num_labels": 3, "max_position_embeddings": 32,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "seq_length": 16}
CASES = {
    # GQA, llama3 rope scaling, tied embeddings, and the fused gate/up layout the export splits.
    "llama": (LLAMA, dict(tie_word_embeddings=True, fused_gate_up=True, rope_theta=500.0,
                          rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=8)), "lm", "LlamaForCausalLM"),
    "bert-classify": (BERT, dict(task="classify"), "classify", "BertForSequenceClassification"),
    "bert-mlm": (BERT, {}, "lm", "BertForMaskedLM"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_config_is_save_pretrained_config_and_loads_in_transformers(tmp_path, case):
    raw, extra, task, hf_class = CASES[case]
    cfg = GalaxyConfig.from_dict(dict(raw, **extra))
    ctx = ParallelContext.serial()
    model = build_model(cfg, None, ctx, task).eval()
    save_checkpoint(str(tmp_path / "ckpt"), 1, model, torch.optim.AdamW(model.parameters()), None, ctx, cfg)
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    model.save_pretrained(str(tmp_path / "saved"))
    with open(tmp_path / "hf" / "config.json") as f, open(tmp_path / "saved" / "config.json") as g:
        assert json.load(f) == json.load(g)
    hf = getattr(transformers, hf_class).from_pretrained(out).eval()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset,task,hf_class", [("llama-7b", "lm", "LlamaForCausalLM"),
                                                  ("llama-1b", "lm", "LlamaForCausalLM"),
                                                  ("bert-base", "classify", "BertForSequenceClassification")])
def test_hf_config_describes_the_same_model_to_transformers(preset, task, hf_class):
    """Full-size configs, both models laid out on the meta device: transformers builds from the derived
    config exactly our parameters (HF names and shapes)."""
    from galaxy.models import model_class

    cfg = GalaxyConfig.from_dict({"preset": preset, "seq_length": 16, "num_labels": 4})
    cls = model_class(cfg.model.model_type, task)
    ours = cls(cfg.model, meta=True)
    hf_config = getattr(transformers, hf_class).config_class.from_dict(cls.hf_config(cfg.model, torch.bfloat16))
    with torch.device("meta"):
        theirs = getattr(transformers, hf_class)(hf_config)
    want = {n: tuple(p.shape) for n, p in cls.state_to_hf(dict(ours.named_parameters())).items()}
    got = {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    assert got == want
