"""Per-layer memory modes (``layer_memory``: recompute none | selective | mlp | full, each with or without
``+offload``; ``mlp_chunks``) change nothing but memory:

- every mode and mixes of modes give exactly the loss and every gradient of no recompute (float64, dropout on:
  the recomputes replay the streams), LLaMA and BERT, on plans none / tp / sp / galaxy at world 2 (and uneven
  splits at world 3); LoRA and QLoRA; compiled (float32: offload and full recompute do not change the compiled
  graph: bitwise; mlp / selective recompute inside it: to 1e-5) and eager; an MLP over sequence chunks
  equals it whole to 1e-12 (other GEMM shapes);
- offload moves what a layer saves to host copies: the bytes packed are the bytes autograd saves in the layer
  without offload (less its parameters and buffers: frozen bases and NF4 buffers are never copied), every byte
  comes back in backward, the copies are not the originals' storage, and the originals are gone after forward;
  with full recompute only the layer input is copied; each layer's copies come back while the next layer's
  backward runs (prefetched), the last layer's as its own backward starts.
"""

import gc

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.offload import OffloadTraffic
from galaxy.core.recompute import MemoryMode, layer_memory_modes, run_layer_with_memory_mode
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.peft import apply_tuning
from tests import COMPILED_WITHOUT_KERNELS
from tests.core.test_llama_equivalence import rel_err
from tests.core.test_recompute import BERT, DROPOUT, LLAMA, UNEVEN, make_batch, same, streams

LAYERS = 3
MIXES = [
    ["none+offload"] * LAYERS,
    ["full+offload"] * LAYERS,
    ["selective+offload", "mlp+offload", "full+offload"],
    ["full+offload", "none", "mlp+offload"],  # a layer that keeps everything between two that offload
    ["mlp", "full", "selective"],
]
CHUNKS_RTOL = 1e-12  # an MLP over sequence chunks runs other GEMM shapes: float64 sums in another order
FP32_RTOL = 1e-5  # the same in float32 (QLoRA), as tests/core/test_compile.py


def lm(model_type):
    return (LlamaForCausalLM, LLAMA) if model_type == "llama" else (BertForMaskedLM, BERT)


def one_step(ctx, model_type, raw, extra, start, tuning=None):
    """Loss, gradients and the dropout streams' end states of one forward/backward from ``start``."""
    for g, state in zip(streams(ctx), start):
        g.set_state(state)
    cls, _ = lm(model_type)
    cfg = GalaxyConfig.from_dict(dict(raw, **extra, **(tuning or {})))
    model = cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3)
    if tuning:
        model = apply_tuning(model, cfg, init_std=0.1)
    model = model.double().train() if not tuning or tuning.get("quantize_base", "none") == "none" else model.train()
    out = model(**make_batch())
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), grads, [g.get_state() for g in streams(ctx)]


def compare_memory_modes(ctx, model_type, plan, uneven=False, tuning=None, mixes=MIXES, chunks=(1, 2)):
    """Every mix of ``mixes`` (and each with its MLP in ``chunks``) against no recompute on this rank."""
    _, base = lm(model_type)
    raw = dict(base, **DROPOUT, plan=plan, num_hidden_layers=LAYERS)
    if uneven:
        raw.update(UNEVEN[model_type][ctx.mp.size])
    start = [g.get_state() for g in streams(ctx)]
    loss, grads, end = one_step(ctx, model_type, raw, {}, start, tuning)
    assert grads and all(g is not None for g in grads.values() if g is not None)
    for mix in mixes:
        for n in chunks:
            loss_r, grads_r, end_r = one_step(ctx, model_type, raw, dict(layer_memory=mix, mlp_chunks=n), start,
                                              tuning)
            if n == 1:
                assert torch.equal(loss_r, loss), (mix, loss_r.item(), loss.item())
                for name, g in grads.items():
                    assert same(grads_r[name], g), f"{mix}: gradient of {name} differs"
            else:  # QLoRA runs in float32
                rtol, atol = (CHUNKS_RTOL, 1e-15) if loss.dtype == torch.float64 else (FP32_RTOL, 1e-7)
                assert torch.allclose(loss_r, loss, rtol=rtol, atol=0), (mix, n)
                for name, g in grads.items():
                    assert same(grads_r[name], g) or torch.allclose(grads_r[name], g, rtol=rtol, atol=atol), \
                        f"{mix}, mlp_chunks {n}: gradient of {name} differs"
            assert all(torch.equal(a, b) for a, b in zip(end_r, end)), mix
    return loss.item()


CASES = [("llama", 1, "none", False), ("llama", 2, "tp", False), ("llama", 2, "sp", False),
         ("llama", 2, "galaxy", False), ("llama", 3, "galaxy", True), ("bert", 1, "none", False),
         ("bert", 2, "tp", False), ("bert", 2, "sp", False), ("bert", 2, "galaxy", False)]


@pytest.mark.parametrize("model_type,world,plan,uneven", CASES,
                         ids=[f"{c[0]}-{c[2]}-w{c[1]}{'-uneven' if c[3] else ''}" for c in CASES])
def test_memory_modes_give_exact_gradients(dist_pool, model_type, world, plan, uneven):
    if world == 1:
        compare_memory_modes(ParallelContext.serial(seed=2), model_type, plan)
    else:
        losses = dist_pool.run(compare_memory_modes, world, model_type, plan, uneven)
        assert len(set(losses)) == 1


LORA = dict(tuning="lora", lora_dim=4, lora_alpha=8, lora_dropout=0.2,
            lora_target_modules=["q_proj", "v_proj", "down_proj"])
QLORA = dict(LORA, quantize_base="nf4", lora_dropout=0.0)
BERT_LORA = dict(LORA, lora_target_modules=["query", "value", "output.dense"])


@pytest.mark.parametrize("model_type,tuning,world,plan", [
    ("llama", LORA, 1, "none"), ("llama", LORA, 2, "galaxy"), ("llama", QLORA, 1, "none"), ("llama", QLORA, 2, "tp"),
    ("bert", BERT_LORA, 2, "sp")], ids=["llama-lora", "llama-lora-galaxy", "llama-qlora", "llama-qlora-tp",
                                        "bert-lora-sp"])
def test_memory_modes_under_lora_and_qlora(dist_pool, model_type, tuning, world, plan):
    """LoRA (its dropout replayed by the recomputes) and QLoRA (NF4 base, float32): the same loss and gradients."""
    mixes = [["mlp+offload", "full+offload", "none+offload"], ["selective", "mlp+offload", "full"]]
    chunks = (1,) if tuning.get("lora_dropout") else (1, 2)  # LoRA dropout on the MLP: it runs whole anyway
    if world == 1:
        compare_memory_modes(ParallelContext.serial(seed=2), model_type, plan, tuning=tuning, mixes=mixes,
                             chunks=chunks)
    else:
        dist_pool.run(compare_memory_modes, world, model_type, plan, False, tuning, mixes, chunks)


def compiled_step(model_type, extra, tuning):
    _, base = lm(model_type)
    cls, _ = lm(model_type)
    cfg = GalaxyConfig.from_dict(dict(base, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, seq_length=11,
                                      num_hidden_layers=2, **COMPILED_WITHOUT_KERNELS, **tuning, **extra))
    model = apply_tuning(cls(cfg.model, None, ParallelContext.serial(seed=2), seed=3), cfg, init_std=0.1)
    for _ in range(2):  # the second step runs the compiled graphs the first one made
        model.zero_grad(set_to_none=True)
        loss = model(**make_batch()).loss
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model_type,tuning", [("llama", dict(LORA, lora_dropout=0.0)), ("llama", QLORA),
                                               ("bert", dict(BERT_LORA, lora_dropout=0.0))],
                         ids=["llama-lora", "llama-qlora", "bert-lora"])
def test_memory_modes_of_compiled_layers(model_type, tuning):
    """The hooks set around a compiled layer take its compiled autograd function's saved tensors: offload and
    full recompute (around the compiled call) give bitwise the compiled model's loss and gradients; mlp and
    selective recompute (inside the compiled graph, which is then partitioned otherwise) to a relative error of
    1e-5 (as tests/loralib/test_qlora_compile.py). In float32."""
    torch._dynamo.reset()  # each model compiles its own layers: the recompile limit counts them all
    loss, grads = compiled_step(model_type, {}, tuning)
    for mix, exact in ((["none+offload", "full+offload"], True), (["mlp+offload", "selective+offload"], False)):
        loss_r, grads_r = compiled_step(model_type, dict(layer_memory=mix), tuning)
        for a, b in [(loss_r, loss)] + [(grads_r[n], g) for n, g in grads.items()]:
            assert torch.equal(a, b) if exact else rel_err(a, b) <= FP32_RTOL, mix


# ----------------------------------------------------------------------------- what offload moves


def layers_of(model):
    return [m for m in model.modules() if isinstance(getattr(m, "memory_mode", None), MemoryMode)]


def layer_inputs(model, batch):
    """Each layer's positional arguments in a forward of ``batch`` (no autograd)."""
    seen = []
    handles = [layer.register_forward_pre_hook(lambda _, args: seen.append(args)) for layer in layers_of(model)]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    return seen


def saved_in_layer(layer, args):
    """Bytes autograd saves in one call of ``layer`` (unique storages; its parameters and buffers apart)."""
    own = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer.compute(*args)
    return sum(storages.values())


def run_stack(model, args0, mode, traffic):
    """The model's layers on the first layer's arguments (its input made to need a gradient), each under
    ``mode``: the output and the input."""
    h = args0[0].detach().requires_grad_()
    out = h
    for layer in layers_of(model):
        out = run_layer_with_memory_mode(mode, layer, layer.compute, out, *args0[1:], traffic=traffic)
    return out, h


@pytest.mark.parametrize("tuning", [None, QLORA], ids=["full", "qlora"])
def test_offload_moves_every_saved_byte_to_host_copies(tuning):
    cfg = GalaxyConfig.from_dict(dict(LLAMA, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      num_hidden_layers=LAYERS, seq_length=11, **(tuning or {})))
    model = LlamaForCausalLM(cfg.model, None, ParallelContext.serial(seed=2), seed=3)
    if tuning:
        model = apply_tuning(model, cfg, init_std=0.1)
    args = layer_inputs(model, make_batch())[0]
    layer0 = layers_of(model)[0]
    x = args[0].detach().requires_grad_()
    expected = saved_in_layer(layer0, (x, *args[1:]))
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    reference, h_ref = run_stack(model, args, MemoryMode(), None)
    reference.pow(2).sum().backward()
    reference_grads = [h_ref.grad] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)

    traffic = OffloadTraffic()
    out, h = run_stack(model, args, MemoryMode(offload=True), traffic)
    gc.collect()
    assert traffic.to_host_bytes == LAYERS * expected > 0  # every layer's saved bytes, no weight among them
    assert not {ptr for ptr, _, _ in traffic.copies} & weights
    # what autograd holds are the copies: every original storage is freed after forward (a layer's input too:
    # the previous layer's output, which nothing else holds), but the first layer's input, which this test holds
    assert all(host != ptr and (ref() is None or ptr == h.untyped_storage().data_ptr())
               for ptr, host, ref in traffic.copies)
    out.pow(2).sum().backward()
    assert traffic.to_device_bytes == traffic.to_host_bytes
    grads = [h.grad] + [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(reference_grads) and all(torch.equal(a, b) for a, b in zip(grads, reference_grads))


def test_full_recompute_offloads_only_the_layer_input():
    """(and the padding mask beside it: the layer's only other tensor argument)"""
    cfg = GalaxyConfig.from_dict(dict(LLAMA, num_hidden_layers=LAYERS, seq_length=11))
    model = LlamaForCausalLM(cfg.model, None, ParallelContext.serial(seed=2), seed=3).train()
    args = layer_inputs(model, make_batch())[0]
    traffic = OffloadTraffic()
    out, h = run_stack(model, args, MemoryMode("full", offload=True), traffic)
    mask = args[1]
    assert traffic.to_host_bytes == LAYERS * (h.numel() * h.element_size() + mask.numel() * mask.element_size())
    out.sum().backward()
    assert traffic.to_device_bytes == traffic.to_host_bytes and h.grad is not None


def test_each_layer_comes_back_while_the_next_layer_runs_backward():
    """All but the last layer's copies are brought back before their own backward starts."""
    cfg = GalaxyConfig.from_dict(dict(LLAMA, num_hidden_layers=4, seq_length=11))
    model = LlamaForCausalLM(cfg.model, None, ParallelContext.serial(seed=2), seed=3).train()
    args = layer_inputs(model, make_batch())[0]
    traffic = OffloadTraffic()
    out, _ = run_stack(model, args, MemoryMode("mlp", offload=True), traffic)
    out.sum().backward()
    per_layer = traffic.to_host_bytes // 4
    assert traffic.to_device_bytes == traffic.to_host_bytes
    assert traffic.prefetched_bytes == 3 * per_layer > 0


@pytest.mark.parametrize("mode,chunks,backward_calls", [("full", 1, 1), ("full", 2, 4), ("full+offload", 2, 4),
                                                         ("mlp", 2, 2), ("none", 2, 0)])
def test_a_rebuilt_layer_rebuilds_its_chunked_mlp_a_chunk_at_a_time(mode, chunks, backward_calls):
    """Under full recompute a chunked MLP's chunks are recomputed regions of their own inside the rebuilt layer
    (it never holds the whole MLP's FFN-wide tensors): a layer's gate projection runs per chunk in forward,
    then in backward once per chunk as the layer is rebuilt and once more per chunk as each chunk is."""
    cfg = GalaxyConfig.from_dict(dict(LLAMA, num_hidden_layers=1, seq_length=11, mlp_chunks=chunks,
                                      layer_memory=[mode]))
    model = LlamaForCausalLM(cfg.model, None, ParallelContext.serial(seed=2), seed=3).double().train()
    calls = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *_: calls.append(1))
    loss = model(**make_batch()).loss
    forward = len(calls)
    loss.backward()
    assert (forward, len(calls) - forward) == (chunks, backward_calls)


def test_mlp_chunks_run_whole_where_the_mlp_draws_dropout(caplog):
    """LoRA dropout on an MLP projection: chunks would draw its masks in another order; the MLP runs whole
    (the exact loss of mlp_chunks 1) and says so."""
    raw = dict(LLAMA, **DROPOUT, num_hidden_layers=2)
    ctx = ParallelContext.serial(seed=2)
    start = [g.get_state() for g in streams(ctx)]
    loss, _, _ = one_step(ctx, "llama", raw, {}, start, LORA)
    with caplog.at_level("WARNING", logger="galaxy.config"):
        chunked, _, _ = one_step(ctx, "llama", raw, dict(mlp_chunks=3), start, LORA)
    assert torch.equal(chunked, loss)
    assert any("runs whole" in r.getMessage() for r in caplog.records)


def test_layer_memory_modes_per_stage():
    cfg = GalaxyConfig.from_dict(dict(LLAMA, num_hidden_layers=4, seq_length=11,
                                      layer_memory=["full+offload", "mlp", "none", "selective+offload"]))
    assert layer_memory_modes(cfg.model, range(2, 4)) == ["none", "selective+offload"]
    first = GalaxyConfig.from_dict(dict(LLAMA, seq_length=11, recompute="mlp", recompute_num_layers=1)).model
    assert layer_memory_modes(first, range(0, 2)) == ["mlp", "none"]
    assert str(MemoryMode.parse("mlp+offload")) == "mlp+offload"
    with pytest.raises(ConfigError, match="'activation_memory' is auto, but no per-layer plan"):
        layer_memory_modes(GalaxyConfig.from_dict(dict(LLAMA, seq_length=11, activation_memory="auto")).model,
                           range(2))


@pytest.mark.parametrize("raw,match", [
    (dict(layer_memory=["mlp+offlaod"] * 2), "'layer_memory': 'mlp\\+offlaod' is not one of none, full"),
    (dict(layer_memory=["mlp"]), "'layer_memory' lists 1 modes for 2 layers"),
    (dict(layer_memory=["mlp"] * 2, recompute="full"), "'layer_memory' gives every layer's mode, but recompute"),
    (dict(activation_memory="auto", recompute_num_layers=1, recompute="mlp"), "is auto, which picks each layer"),
    (dict(memory_budget_gib=10), "'memory_budget_gib' is set but activation_memory is manual"),
    (dict(activation_memory="auto", memory_budget_gib=0), "'memory_budget_gib' must be positive"),
    (dict(mlp_chunks=0), "'mlp_chunks' must be at least 1"),
    (dict(layer_memory=["none+offload"] * 2, compile=True, compile_mode="reduce-overhead"), "CUDA graphs"),
])
def test_activation_memory_config_errors(raw, match):
    with pytest.raises(ConfigError, match=match):
        GalaxyConfig.from_dict(dict(LLAMA, seq_length=11, **raw))
