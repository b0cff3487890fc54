"""LoRA for Galaxy's parallel linears and embeddings: every plan computes the serial LoRA.

    from galaxy.loralib import inject_lora, mark_only_lora_as_trainable
    inject_lora(model, ["query", "value"], r=8, lora_alpha=16, seed=cfg.train.seed)
    mark_only_lora_as_trainable(model)
"""

from galaxy.loralib.hf import load_lora_pretrained, save_lora_pretrained
from galaxy.loralib.layers import LoRAEmbedding, LoRALayer, LoRALinear, MergedLoRALinear
from galaxy.loralib.model import (init_lora_weights, inject_lora, lora_modules, lora_state_dict,
                                  mark_only_lora_as_trainable, merge_and_unload, merge_lora, set_lora_fusion,
                                  unmerge_lora)

__all__ = ["LoRALayer", "LoRALinear", "MergedLoRALinear", "LoRAEmbedding", "inject_lora",
           "init_lora_weights", "lora_modules", "lora_state_dict", "mark_only_lora_as_trainable", "merge_lora",
           "unmerge_lora", "merge_and_unload", "set_lora_fusion", "save_lora_pretrained", "load_lora_pretrained"]
