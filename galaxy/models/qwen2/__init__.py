"""Qwen2: LLaMA with q/k/v biases (``model``: the class and its HF config; ``family``: ``QWEN2``)."""

from galaxy.models.qwen2.family import QWEN2, Qwen2Family
from galaxy.models.qwen2.model import Qwen2ForCausalLM

__all__ = ["QWEN2", "Qwen2Family", "Qwen2ForCausalLM"]
