"""Model FLOPs of a training step, analytic, as torchtitan and PaLM (appendix B) count them: the
numerator of MFU.

For full training, per token of a batch of sequences of length S:

    model_flops_per_token = 6 * N + 12 * L * H * S

* N: the weights of the matmuls every token goes through (each model family counts its own:
  ``Family.matmul_weights``): in each of the L
  layers the attention projections (q, k, v, o; LLaMA's k and v at ``num_key_value_heads``) and
  the MLP's (BERT: 2 x H x I; LLaMA: gate, up and down, 3 x H x I), plus the output head: BERT's
  MLM transform (H x H) and decoder (H x V), LLaMA's ``lm_head`` (H x V). The H x V head counts
  even when it is tied to the word embeddings, since its matmul runs. Left out: embedding lookups
  (word, position, token type: no matmul), biases and norms (not matmul work), and the sequence
  classification head (pooler and classifier run once per row, not per token).
* 6 = 2 (forward) + 2 (gradient of the input) + 2 (gradient of the weight) FLOPs per weight.
* 12 * L * H * S: the attention scores Q K^T and their product with V, 2 x 2 x H x S FLOPs per
  token and layer forward and twice that backward, over the full S x S matrix (no halving for a
  causal mask, as torchtitan).

Recomputation (activation checkpointing) is not counted: these are model FLOPs, not hardware
FLOPs; nor is the fused attention kernels' recomputation of the scores in backward, which
``torch.utils.flop_counter.FlopCounterMode`` does count (2 * L * H * S more per token). With that
term taken off, ``FlopCounterMode`` on a real forward and backward of a full-training step counts
exactly this number (tests/train/test_metrics.py).

With parameter-efficient tuning the frozen base takes no weight gradients, so the count is what
that run needs: ``lora`` / ``adapter``: 4 * N + 12 * L * H * S (forward and input gradients);
``side``: the backbone runs forward only (2 per layer weight, 4 * L * H * S) and the head 4 per
weight. These are approximate: the small trainable additions (LoRA's A and B, adapters, the side
network) are left out, and so is that autograd skips the input gradients of the first layer's
frozen projections (within 10% on the tiny presets, where the additions weigh the most).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MatmulWeights", "training_flops_per_token"]

# FLOPs per matmul weight and token: forward, + input gradient, + weight gradient.
FORWARD, FORWARD_AND_INPUT_GRAD, TRAINED = 2, 4, 6
# FLOPs per token, layer, hidden unit and key position of the attention core (Q K^T and P V).
ATTENTION_FORWARD, ATTENTION_TRAINED = 4, 12


@dataclass(frozen=True)
class MatmulWeights:
    """The matmul weights a token goes through, in elements, of the whole (unsharded) model."""

    per_layer: int  # attention and MLP projections of one transformer layer
    head: int  # the output head (BERT: MLM transform + decoder; LLaMA: lm_head)
    num_layers: int

    @property
    def total(self) -> int:
        return self.per_layer * self.num_layers + self.head


def training_flops_per_token(weights: MatmulWeights, hidden_size: int, seq_length: int, tuning: str = "full") -> float:
    """Model FLOPs per token of one training step (forward and backward) of a model with these matmul
    ``weights`` (its family's count: ``Family.matmul_weights``) and ``hidden_size``, on sequences of
    ``seq_length`` tokens: ``6 * N + 12 * L * H * S`` for full training; the module doc gives the counts
    for ``tuning`` lora, adapter and side."""
    attention = weights.num_layers * hidden_size * seq_length
    if tuning == "full":
        return TRAINED * weights.total + ATTENTION_TRAINED * attention
    if tuning in ("lora", "adapter"):
        return FORWARD_AND_INPUT_GRAD * weights.total + ATTENTION_TRAINED * attention
    if tuning == "side":
        layers = weights.per_layer * weights.num_layers
        return FORWARD * layers + FORWARD_AND_INPUT_GRAD * weights.head + ATTENTION_FORWARD * attention
    raise ValueError(f"no FLOP formula for tuning method '{tuning}'")
