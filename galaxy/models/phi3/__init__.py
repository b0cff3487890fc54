"""Phi-3: the module (``model``), its HF conversion (``hf``) and the family object (``family``, ``PHI3``)."""

from galaxy.models.phi3.family import PHI3, Phi3Family
from galaxy.models.phi3.model import Phi3Attention, Phi3DecoderLayer, Phi3ForCausalLM

__all__ = ["PHI3", "Phi3Family", "Phi3Attention", "Phi3DecoderLayer", "Phi3ForCausalLM"]
