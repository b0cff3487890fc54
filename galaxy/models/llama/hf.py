"""LLaMA's HF conversion: ``config.json`` both ways and the weights' layouts (``fused_gate_up`` holds HF's
``gate_proj`` / ``up_proj`` as one ``gate_up_proj`` ``[2, intermediate, hidden]``), as a mixin of the model
classes (``LlamaHF``) so that variants (Qwen2) change only what differs."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from typing import Optional

import torch

from galaxy.config import ConfigError, ModelConfig

logger = logging.getLogger(__name__)

ROPE_TYPES = ("default", "linear", "llama3")
# HF config keys that map one-to-one onto ModelConfig fields.
HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "intermediate_size", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
           "tie_word_embeddings")
# HF LlamaConfig defaults, for keys a config.json leaves out.
HF_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, initializer_range=0.02,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)
# Kept from a loaded checkpoint and written back on save (HF falls back to LLaMA-1's ids otherwise).
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id")
# fused_gate_up: one parameter in place of HF's two (gate first).
GATE, UP, GATE_UP = "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_up_proj.weight"

def fuse_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's ``mlp.gate_proj.weight`` / ``mlp.up_proj.weight`` pairs -> ``mlp.gate_up_proj.weight`` [2, I, H].
    Also maps per-parameter optimizer states: a 0-dim one (a step count) is the gate's."""
    out = {}
    for name, tensor in state.items():
        stem = name[: -len(GATE)] if name.endswith(GATE) else name[: -len(UP)] if name.endswith(UP) else None
        if stem is None or stem + GATE not in state or stem + UP not in state:
            out[name] = tensor  # not a complete pair: left for the loader to name
        elif name.endswith(GATE):
            out[stem + GATE_UP] = tensor if tensor.dim() == 0 else torch.stack([tensor, state[stem + UP]])
    return out


def split_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mlp.gate_up_proj.weight`` -> HF's separate ``gate_proj`` and ``up_proj`` weights (a 0-dim
    optimizer state goes to both)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(GATE_UP):
            stem = name[: -len(GATE_UP)]
            halves = (tensor, tensor) if tensor.dim() == 0 else (tensor[0], tensor[1])
            out[stem + GATE], out[stem + UP] = (t.clone() for t in halves)  # own storage: safetensors
        else:
            out[name] = tensor
    return out



class LlamaHF:
    """The HF side of a LLaMA-family model class: its ``config.json`` and its weights' names and
    layouts. A class sets ``model_type``, ``hf_architecture``, ``qkv_bias`` and ``hf_defaults``."""

    model_type = "llama"
    hf_architecture = "LlamaForCausalLM"
    qkv_bias = False  # HF's architecture has q/k/v biases (a config's qkv_bias None takes this)
    hf_defaults = HF_DEFAULTS

    @classmethod
    def own_config(cls, config: ModelConfig) -> ModelConfig:
        """``config`` with what it leaves to the architecture filled in (``qkv_bias``)."""
        return config if config.qkv_bias is not None else replace(config, qkv_bias=cls.qkv_bias)

    def _init_param(self, name: str, shape, seed: int, device: Optional[torch.device] = None) -> torch.Tensor:
        if name.endswith(GATE_UP) and self.fused_gate_up:  # each half drawn as the unfused model draws it
            stem, init = name[: -len(GATE_UP)], super()._init_param
            return torch.stack([init(stem + part, tuple(shape[1:]), seed, device) for part in (GATE, UP)])
        return super()._init_param(name, shape, seed, device)

    def state_from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return fuse_gate_up(state) if self.fused_gate_up else split_gate_up(state)

    @classmethod
    def state_to_hf(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return split_gate_up(state)

    @classmethod
    def hf_layout_differs(cls, config: ModelConfig) -> Optional[str]:
        if config.fused_gate_up:
            return "fused_gate_up fuses HF's gate_proj/up_proj; set fused_gate_up to false"
        return None

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        if hf.get("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"model_path holds a '{hf.get('model_type')}' model, not {cls.model_type}")
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ValueError(f"HF config has {key}=true; Galaxy's {cls.hf_architecture} has no such biases")
        hf = dict(cls.hf_defaults, **hf)
        if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
            raise ValueError(f"HF config has head_dim={hf['head_dim']} but Galaxy derives it as "
                             "hidden_size / num_attention_heads")
        # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_scaling` + `rope_theta`.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"HF config uses rope type '{kind}'; supported: {', '.join(ROPE_TYPES)}")
        cfg = ModelConfig(model_type=cls.model_type, qkv_bias=cls.qkv_bias, **{k: hf[k] for k in HF_KEYS if k in hf})
        cfg.num_key_value_heads = hf.get("num_key_value_heads") or cfg.num_attention_heads
        cfg.rope_theta = float(theta)
        cfg.rope_scaling = None if kind == "default" else dict(rope, rope_type=kind)
        cfg.pad_token_id = hf.get("pad_token_id")  # HF LLaMA usually has none: no padding row
        cfg.hidden_dropout_prob = 0.0
        cfg.attention_probs_dropout_prob = float(hf.get("attention_dropout", 0.0))
        return cfg

    @classmethod
    def hf_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
        c = cls.own_config(config)
        if c.qkv_bias != cls.qkv_bias:
            raise ConfigError(f"config key 'qkv_bias' is {c.qkv_bias}, but HF's {cls.hf_architecture} "
                              f"{'always' if cls.qkv_bias else 'never'} has q/k/v biases; it has no HF form")
        hf = {k: getattr(c, k) for k in HF_KEYS}
        rope_parameters = dict(c.rope_scaling or {}, rope_theta=c.rope_theta)
        rope_parameters["rope_type"] = rope_parameters.pop("type", rope_parameters.get("rope_type", "default"))
        hf.update(model_type=cls.model_type, architectures=[cls.hf_architecture], num_key_value_heads=c.kv_heads,
                  head_dim=c.head_dim, attention_bias=False, mlp_bias=False,
                  attention_dropout=c.attention_probs_dropout_prob, pad_token_id=c.pad_token_id,
                  # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta/rope_scaling.
                  rope_parameters=rope_parameters, rope_theta=c.rope_theta,
                  rope_scaling=dict(c.rope_scaling) if c.rope_scaling else None)
        if dtype is not None:
            hf["dtype"] = str(dtype).removeprefix("torch.")
        return hf

    def config_to_hf(self) -> dict:
        return dict(super().config_to_hf(), **self.special_token_ids)

    def loaded_from(self, path: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        self.special_token_ids = {k: hf[k] for k in SPECIAL_TOKEN_KEYS if k in hf}
        c = self.config
        logger.info("loaded %s from %s: %d layers, %d query / %d key-value heads, rope %s, plan %s", self.model_type,
                    path, c.num_hidden_layers, c.num_attention_heads, c.kv_heads,
                    (c.rope_scaling or {}).get("rope_type", "default"), self.plan.name)
