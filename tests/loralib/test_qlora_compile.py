"""QLoRA with ``compile: true``: each layer's dequantize-and-matmul traced into its compiled graph.

- the compiled model (inductor's C++ backend, as ``compile: true`` runs it) equals the eager QLoRA model:
  loss and every LoRA gradient to FP32_RTOL in fp32, for an NF4 and an int8 base;
- a layer traces without a graph break (dynamo's counters; ``fullgraph=True`` under bf16 autocast);
- the compiled backward keeps no dequantized weight: no saved tensor has a quantized weight's shape,
  and the tensors saved for backward (beyond the model's own parameters and buffers) take no more
  bytes than eager's, whose backward dequantizes again;
- the frozen weights stay quantized: the same buffers, unchanged, and no floating copy of a weight
  appears among the model's parameters or buffers.

The model is llama-tiny with one layer and hidden 96 (NF4 rows of 96 columns: a padded block),
so a weight's shape ([96, 96], [48, 96], [176, 96] and transposes) is never an activation's (39
tokens). Compiling the layer costs about a minute of CPU on a cold inductor cache.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from galaxy.config import GalaxyConfig
from galaxy.loralib.quantized import frozen_bytes
from galaxy.loralib.quantized_layers import FORMATS, QuantizedWeight
from galaxy.models.llama import LlamaForCausalLM
from galaxy.peft import apply_tuning
from tests.core.test_llama_equivalence import rel_err

FP32_RTOL = 1e-5  # as tests/core/test_compile.py (inductor reorders fp32 reductions)
BF16_RTOL = 2e-2


def qlora_model(kind: str, compiled: bool) -> LlamaForCausalLM:
    cfg = GalaxyConfig.from_dict(dict(preset="llama-tiny", hidden_size=96, num_hidden_layers=1, seq_length=13,
                                      tuning="lora", quantize_base=kind, compile=compiled,
                                      lora_target_modules=["q_proj", "v_proj", "down_proj"]))
    return apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.1)


def batch(vocab=50, seq=13):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, vocab, (3, seq), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


def weight_shapes(model) -> set[tuple[int, int]]:
    """Every quantized weight's shape, in both orientations."""
    shapes = {tuple(q.shape) for q in model.modules() if isinstance(q, QuantizedWeight)}
    return shapes | {s[::-1] for s in shapes}


def step(model):
    """One forward and backward: the loss, the LoRA gradients, and the tensors saved for backward that
    are not the model's own parameters or buffers (one entry per storage: bytes, shape, dtype)."""
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned:
            saved[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch()).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, list(saved.values())


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_compiled_qlora_equals_eager(kind):
    torch._dynamo.reset()
    counters.clear()
    eager_model, compiled_model = qlora_model(kind, False), qlora_model(kind, True)
    stored = {n: b.clone() for n, b in compiled_model.named_buffers()}
    stored_bytes = frozen_bytes(compiled_model)
    eager_loss, eager_grads, eager_saved = step(eager_model)
    loss, grads, saved = step(compiled_model)

    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    errors = {"loss": rel_err(loss.double(), eager_loss.double())}
    errors.update({f"grad of {n}": rel_err(grads[n].double(), g.double()) for n, g in eager_grads.items()})
    assert len(eager_grads) == 6 and all(g is not None for g in grads.values())  # A and B of 3 targets
    worst = max(errors, key=errors.get)
    assert errors[worst] < FP32_RTOL, (worst, errors[worst])

    shapes = weight_shapes(compiled_model)
    kept = [(shape, dtype) for _, shape, dtype in saved if dtype.is_floating_point and shape in shapes]
    assert not kept, f"the compiled backward keeps dequantized weights: {kept}"
    assert sum(n for n, _, _ in saved) <= sum(n for n, _, _ in eager_saved), (saved, eager_saved)

    assert dict(compiled_model.named_buffers()).keys() == stored.keys()
    assert all(torch.equal(b, stored[n]) and b.dtype == stored[n].dtype for n, b in compiled_model.named_buffers())
    assert frozen_bytes(compiled_model) == stored_bytes
    floating = [n for n, t in [*compiled_model.named_parameters(), *compiled_model.named_buffers()]
                if t.is_floating_point() and tuple(t.shape) in shapes]
    assert not floating, f"floating copies of quantized weights: {floating}"


def test_quantized_layer_traces_whole_under_bf16_autocast():
    """The bench's recipe (bf16 autocast over an NF4 base): the layer is one graph (``fullgraph``
    raises on a break), its output and input gradient equal eager's to bf16 rounding."""
    torch._dynamo.reset()
    model = qlora_model("nf4", False)
    layer = model.model.layers[0]
    captured = []
    handle = layer.register_forward_pre_hook(lambda module, args: captured.append(args))
    model(**batch())
    handle.remove()
    h, mask, rope = captured[0][:3]
    runs = {}
    for name, compute in (("eager", layer.compute),
                          ("compiled", torch.compile(layer.compute, backend="aot_eager", fullgraph=True))):
        x = h.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = compute(x, mask, rope)
        y.float().square().sum().backward()
        runs[name] = (y.detach().float(), x.grad, layer.self_attn.q_proj.lora_A.weight.grad.clone())
        layer.zero_grad(set_to_none=True)
    for eager, compiled in zip(runs["eager"], runs["compiled"]):
        assert rel_err(compiled.double(), eager.double()) < BF16_RTOL
