"""Named model sizes (``preset``) and named parallel plans (``plan``)."""

from __future__ import annotations

from typing import Any

from galaxy.config.sections import Method

# Named model sizes (config keys); a family needs none. galaxy.models checks the model_type itself.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "bert-tiny": dict(model_type="bert", hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=512),
    "bert-mini": dict(model_type="bert", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      intermediate_size=1024),
    "bert-base": dict(model_type="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072),
    "bert-large": dict(model_type="bert", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       intermediate_size=4096),
    "llama-tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                       max_position_embeddings=512, hidden_act="silu", tie_word_embeddings=False, pad_token_id=None,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # Llama-3.2-1B: about 1.24B parameters with the 128k vocabulary, tied embeddings, llama3 RoPE scaling.
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
                     max_position_embeddings=131072, hidden_act="silu", tie_word_embeddings=True,
                     rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0,
                                                            original_max_position_embeddings=8192),
                     rms_norm_eps=1e-5, pad_token_id=None, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # Llama-3.1-8B shapes: 8.03B parameters, 128k vocabulary, untied, llama3 RoPE scaling to 128k positions.
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                     max_position_embeddings=131072, hidden_act="silu", tie_word_embeddings=False,
                     rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0,
                                                            original_max_position_embeddings=8192),
                     rms_norm_eps=1e-5, pad_token_id=None, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "llama-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                     max_position_embeddings=4096, hidden_act="silu", tie_word_embeddings=False,
                     rms_norm_eps=1e-5, pad_token_id=None, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}



PLAN_PRESETS = {
    "none": (Method.NONE, Method.NONE, Method.NONE),
    "tp": (Method.TP, Method.NONE, Method.TP),
    "sp": (Method.SP, Method.SP, Method.SP),
    "galaxy": (Method.TP, Method.SP, Method.TP),
    "galaxy2": (Method.TP, Method.SP, Method.SP),
}
