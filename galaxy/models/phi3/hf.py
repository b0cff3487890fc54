"""Phi-3's HF conversion: ``config.json`` both ways (plain RoPE; no LongRoPE, no partial rotary, no
sliding window shorter than the model's positions) and the two fused weights' layouts:

    HF ``self_attn.qkv_proj.weight``  [(heads + 2 kv_heads) d, hidden]   q rows, then k, then v
    ours                              [kv_heads, group + 2, d, hidden]     each key/value group's query
                                                                           heads, then its key, its value
    HF ``mlp.gate_up_proj.weight``    [2 intermediate, hidden]             gate rows, then up
    ours                              [2, intermediate, hidden]

Ours keep a TP shard one slice of one dim (whole key/value groups; the same intermediate rows of gate
and up) and carry the group size and head size in their shapes, so either layout converts without the
config (a checkpoint exports without building a model)."""

from __future__ import annotations

from typing import Optional

import torch

from galaxy.config import ModelConfig
from galaxy.models.llama.hf import HF_DEFAULTS, LlamaHF

# HF Phi3Config defaults, for keys a config.json leaves out.
PHI3_HF_DEFAULTS = dict(HF_DEFAULTS, vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                        max_position_embeddings=4096, rms_norm_eps=1e-5)
QKV, GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"


def qkv_to_groups(w: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
    """HF's ``[(heads + 2 kv_heads) d, hidden]`` -> ``[kv_heads, group + 2, d, hidden]``."""
    hidden = w.shape[-1]
    group = w.shape[0] // (kv_heads * head_dim) - 2
    q, k, v = w.split([kv_heads * group * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    return torch.cat([q.reshape(kv_heads, group, head_dim, hidden), k.reshape(kv_heads, 1, head_dim, hidden),
                      v.reshape(kv_heads, 1, head_dim, hidden)], dim=1)


def qkv_from_groups(w: torch.Tensor) -> torch.Tensor:
    """``[kv_heads, group + 2, d, hidden]`` -> HF's ``[(heads + 2 kv_heads) d, hidden]``."""
    hidden = w.shape[-1]
    return torch.cat([w[:, :-2].reshape(-1, hidden), w[:, -2].reshape(-1, hidden), w[:, -1].reshape(-1, hidden)])


class Phi3HF(LlamaHF):
    """The HF side of ``Phi3ForCausalLM``: LLaMA's config conversion with Phi-3's keys, and the fused layouts."""

    model_type = "phi3"
    hf_architecture = "Phi3ForCausalLM"
    hf_defaults = PHI3_HF_DEFAULTS

    def state_from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF's tensors (2-D fused weights) -> ours; ours pass unchanged."""
        c, out = self.config, {}
        for name, t in state.items():
            if name.endswith(QKV) and t.dim() == 2:
                t = qkv_to_groups(t, c.kv_heads, c.head_dim)
            elif name.endswith(GATE_UP) and t.dim() == 2:
                t = t.view(2, -1, t.shape[-1])
            out[name] = t
        return out

    @classmethod
    def state_to_hf(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state.items():
            if name.endswith(QKV) and t.dim() == 4:
                t = qkv_from_groups(t)
            elif name.endswith(GATE_UP) and t.dim() == 3:
                t = t.reshape(-1, t.shape[-1])
            out[name] = t
        return out

    @classmethod
    def hf_layout_differs(cls, config: ModelConfig) -> Optional[str]:
        return ("Phi-3 holds HF's fused qkv_proj and gate_up_proj in its own layout (galaxy.models.phi3.hf); set "
                "quantize_base to none")

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"HF config has partial_rotary_factor={partial}; Galaxy's Phi-3 rotates whole heads")
        positions = hf.get("max_position_embeddings", cls.hf_defaults["max_position_embeddings"])
        if hf.get("sliding_window") is not None and hf["sliding_window"] < positions:
            raise ValueError(f"HF config has sliding_window={hf['sliding_window']} below max_position_embeddings "
                             f"{positions}; Galaxy's Phi-3 attends over the whole sequence: set "
                             "max_position_embeddings to the window at most")
        cfg = super().config_from_hf({k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
                                     | ({"rope_parameters": rope} if rope else {}))
        cfg.hidden_dropout_prob = float(hf.get("resid_pdrop", 0.0))  # after attention and after the MLP, as ours
        return cfg

    @classmethod
    def hf_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
        hf = super().hf_config(config, dtype)
        for key in ("attention_bias", "mlp_bias"):  # LLaMA's switches; Phi-3 has no biases
            del hf[key]
        hf.update(resid_pdrop=config.hidden_dropout_prob, embd_pdrop=0.0,
                  original_max_position_embeddings=config.max_position_embeddings, sliding_window=None)
        return hf
