"""The Qwen2 family: LLaMA's, with its own model class and small config."""

from galaxy.models.llama.family import LlamaFamily
from galaxy.models.qwen2.model import Qwen2ForCausalLM


class Qwen2Family(LlamaFamily):
    classes = {"lm": Qwen2ForCausalLM}
    tiny_config = dict(preset="llama-tiny", model_type="qwen2", rope_theta=1000000.0)


QWEN2 = Qwen2Family()
