"""BERT's HF conversion: ``config.json`` both ways (its weights have HF's names and layouts), as a mixin of
the model classes."""

from __future__ import annotations

from typing import Optional

import torch

from galaxy.config import ModelConfig

HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
           "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_dropout_prob",
           "attention_probs_dropout_prob", "initializer_range", "pad_token_id")


class BertHF:
    """The HF side of a BERT model class: its ``config.json``."""

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        if hf.get("model_type", "bert") != "bert":
            raise ValueError(f"model_path holds a '{hf.get('model_type')}' model, not BERT")
        cfg = ModelConfig(model_type="bert", **{k: hf[k] for k in HF_KEYS if k in hf})
        cfg.classifier_pooling = hf.get("classifier_pooling", "cls")
        if "id2label" in hf:
            cfg.num_labels = len(hf["id2label"])
        return cfg

    @classmethod
    def hf_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
        # No dtype recorded, as Galaxy's BERT files never had one: exports load in transformers as before.
        hf = {k: getattr(config, k) for k in HF_KEYS}
        hf.update(model_type="bert", architectures=[cls.hf_architecture], tie_word_embeddings=True)
        return hf
