"""Named model sizes (``galaxy.config.presets``): each preset of a public model has that model's shapes (the
values of its published config.json) and, built by transformers from the preset's HF config on the meta
device, the published parameter count. (llama-8b, Llama-3.1-8B: tests/models/test_llama_8b_preset.py.)"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from galaxy.config import GalaxyConfig, parse_override  # noqa: E402
from galaxy.config.presets import MODEL_PRESETS  # noqa: E402
from galaxy.models import model_class  # noqa: E402


def shapes(vocab, hidden, layers, heads, ffn, **more):
    return dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                intermediate_size=ffn, **more)


# The published checkpoints: google-bert/bert-base-uncased and bert-large-uncased (the encoder with its
# pooler: transformers' BertModel), meta-llama/Llama-2-7b-hf and meta-llama/Llama-3.2-1B (with its llama3
# RoPE scaling).
PUBLISHED = {
    "bert-base": ("BertModel", 109_482_240, shapes(30522, 768, 12, 12, 3072)),
    "bert-large": ("BertModel", 335_141_888, shapes(30522, 1024, 24, 16, 4096)),
    "llama-7b": ("LlamaForCausalLM", 6_738_415_616,
                 shapes(32000, 4096, 32, 32, 11008, num_key_value_heads=32, tie_word_embeddings=False)),
    "llama-1b": ("LlamaForCausalLM", 1_235_814_400,
                 shapes(128256, 2048, 16, 32, 8192, num_key_value_heads=8, tie_word_embeddings=True,
                        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=8192))),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_public_presets_are_the_published_models(preset):
    hf_class, published, config_json = PUBLISHED[preset]
    model = GalaxyConfig.from_dict({"model": dict(MODEL_PRESETS[preset])}).model
    cls = getattr(transformers, hf_class)
    config = cls.config_class.from_dict(model_class(model.model_type, "lm").hf_config(model))
    assert {key: getattr(config, key) for key in config_json} == config_json
    with torch.device("meta"):
        theirs = cls(config)
    assert sum(p.numel() for p in theirs.parameters()) == published


def test_presets_and_overrides():
    cfg = GalaxyConfig.from_dict({"preset": "bert-large"}, {"num_hidden_layers": 2})
    assert cfg.model.hidden_size == 1024 and cfg.model.num_hidden_layers == 2
    assert parse_override("hidden_dropout_prob=0") == ("hidden_dropout_prob", 0)
    assert parse_override("plan=galaxy") == ("plan", "galaxy")
