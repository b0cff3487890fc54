"""CCLoRA (galaxy.core.overlap.cclora, config key ``lora_fusion``) computes plain LoRA exactly.

On one rank: whole / column / row ``LoRALinear`` and the fused-QKV ``MergedLoRALinear`` with
fusion give the unfused layer's output, dx, dA, dB (and dW, bias grads; no dW when W is frozen)
to 1e-9 relative in float64, on the merged path (rows >= in) and the unmerged one, and with LoRA
dropout in training (the same masks as plain LoRA, from a generator seeded alike). At the TP
block edges (world 2 and 3, uneven splits, batch 1 and 2): every fused function equals
``transition`` + the LoRA formula, ranks may take different paths, and the unmerged S -> T entry
gathers only the r-wide product besides x. Whole models: BERT and LLaMA with LoRA + lora_fusion
under TP / Galaxy (world 2) and uneven Galaxy (world 3), also with CoC chunks on the edges without
LoRA, equal the serial plain-LoRA model (loss, logits, every trainable gradient); with LoRA dropout
they equal plain LoRA on the same plan over training steps; merge / unmerge still work, and the
saved HF PEFT files are those of plain LoRA (A unscaled).
"""

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.grad_sync import GradientSync, gather_full
from galaxy.core.layers import Dropout, ParallelLinear
from galaxy.core.overlap.edges import CcloraEdge
from galaxy.core.pipeline import layer_stacks
from galaxy.core.transitions import Layout, transition
from galaxy.core.overlap.cclora import (LinearOperands, all_gather_cclora, cclora_all_reduce,
                                   cclora_reduce_scatter, copy_cclora, merges)
from galaxy.loralib import LoRALinear, MergedLoRALinear, lora_modules, merge_lora, set_lora_fusion, unmerge_lora
from galaxy.peft import apply_tuning, save_tuning
from tests.peft.test_peft_equivalence import LORA_TARGETS, MODELS, RTOL, SEQ, edges, make_batch, rel_err, tuned_pair

SPLITS = {2: (3, 5), 3: (2, 4, 1)}  # tokens per rank


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(shape, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _assert_close(got, want, what):
    if got is None or want is None:
        assert got is None and want is None, f"{what}: got {got is not None}, want {want is not None}"
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    err = (got - want).norm().item()
    assert err <= RTOL * max(want.norm().item(), 1e-300), f"{what}: relative error {err / want.norm().item():.2e}"


def _compare(fused, reference, inputs, grad_outputs, requires, label):
    """Both functions on fresh leaf copies of ``inputs``: outputs and every input's gradient."""
    results = []
    for fn in (fused, reference):
        leaves = [None if t is None else t.detach().clone().requires_grad_(need) for t, need in zip(inputs, requires)]
        ys = fn(*leaves)
        ys = list(ys) if isinstance(ys, (list, tuple)) else [ys]
        torch.autograd.backward(ys, grad_outputs)
        results.append(([y.detach() for y in ys], [None if t is None or not t.requires_grad else t.grad
                                                    for t in leaves]))
    (y1, g1), (y0, g0) = results
    for i, (a, b) in enumerate(zip(y1, y0)):
        _assert_close(a, b, f"{label}: output {i}")
    for i, (a, b) in enumerate(zip(g1, g0)):
        _assert_close(a, b, f"{label}: grad of input {i}")


# ----------------------------------------------------------------------------- one rank: the layers


def _layer(style, inf, out, bias, fan_in_fan_out=False):
    if style == "column":
        base = ParallelLinear(inf, out, bias, "column", [out], 0, dtype=torch.float64)
    elif style == "row":
        base = ParallelLinear(inf, out, bias, "row", [inf], 0, dtype=torch.float64)
    else:
        base = torch.nn.Linear(inf, out, bias, dtype=torch.float64)
    gen = _gen(1)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(_randn(p.shape, gen))
        if fan_in_fan_out:
            base.weight = torch.nn.Parameter(base.weight.t().contiguous())
    layer = LoRALinear(base, 3, lora_alpha=5.0, fan_in_fan_out=fan_in_fan_out)
    with torch.no_grad():
        layer.lora_A.weight.copy_(_randn(layer.lora_A.weight.shape, gen))
        layer.lora_B.weight.copy_(_randn(layer.lora_B.weight.shape, gen))
    return layer


def _fused_copy(plain, dropout=0.0):
    """A CCLoRA copy of ``plain``; with ``dropout`` both drop the branch input with masks drawn from
    generators seeded alike, so they must draw the same masks."""
    fused = copy.deepcopy(plain)
    fused.fusion = True
    if dropout:
        plain.lora_dropout, fused.lora_dropout = Dropout(dropout, _gen(11)), Dropout(dropout, _gen(11))
    return fused


def _layer_grads(layer, x, grad_out):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad_out)
    names = [n for n, p in layer.named_parameters() if p.requires_grad]
    grads = {n: p.grad for n, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    return y.detach(), x.grad, grads, names


@pytest.mark.parametrize("style,fan_in_fan_out", [("whole", False), ("whole", True), ("column", False),
                                                  ("row", False)])
@pytest.mark.parametrize("rows", [4, 30])  # in_features is 10: unmerged, merged
@pytest.mark.parametrize("weight_trains,dropout", [(False, 0.0), (True, 0.0), (False, 0.4)])
def test_layer_equals_plain_lora(style, fan_in_fan_out, rows, weight_trains, dropout):
    plain = _layer(style, 10, 7, True, fan_in_fan_out)
    plain.weight.requires_grad_(weight_trains)
    fused = _fused_copy(plain, dropout)
    assert merges(rows, 10) == (rows == 30)
    x = _randn((2, rows // 2, 10), _gen(2))
    grad_out = _randn((2, rows // 2, 7), _gen(3))
    y0, dx0, g0, names = _layer_grads(plain, x, grad_out)
    y1, dx1, g1, _ = _layer_grads(fused, x, grad_out)
    if dropout:  # the masks were drawn and are the same: both differ from the layer without dropout
        plain.lora_dropout = torch.nn.Identity()
        assert not torch.allclose(_layer_grads(plain, x, grad_out)[0], y0)
    _assert_close(y1, y0, "output")
    _assert_close(dx1, dx0, "dx")
    assert {"lora_A.weight", "lora_B.weight"} <= set(names)
    for name in g0:  # dA, dB, the bias's; dW only when W trains
        _assert_close(g1[name], g0[name], f"grad of {name}")
    assert (g1["weight"] is not None) == weight_trains
    # The parameters are HF PEFT's, untouched: A is not stored scaled.
    assert torch.equal(fused.lora_A.weight, plain.lora_A.weight)


@pytest.mark.parametrize("rows,dropout", [(4, 0.0), (30, 0.0), (30, 0.4)])
def test_fused_qkv_layer_equals_plain_lora(rows, dropout):
    gen = _gen(4)
    base = ParallelLinear(10, 14, True, "whole", dtype=torch.float64)
    with torch.no_grad():
        base.weight.copy_(_randn(base.weight.shape, gen))
        base.bias.copy_(_randn(base.bias.shape, gen))
    plain = MergedLoRALinear(base, (6, 4, 4), (True, False, True), r=2, lora_alpha=3.0)
    with torch.no_grad():
        for p in plain.parameters():
            if p is not base.weight and p is not base.bias:
                p.copy_(_randn(p.shape, gen))
    plain.weight.requires_grad_(False)
    fused = _fused_copy(plain, dropout)
    x, grad_out = _randn((1, rows, 10), _gen(5)), _randn((1, rows, 14), _gen(6))
    y0, dx0, g0, _ = _layer_grads(plain, x, grad_out)
    y1, dx1, g1, _ = _layer_grads(fused, x, grad_out)
    _assert_close(y1, y0, "output")
    _assert_close(dx1, dx0, "dx")
    for name in g0:
        _assert_close(g1[name], g0[name], f"grad of {name}")
    assert torch.allclose(fused.stacked_b().detach() @ fused.lora_A.weight.detach() * fused.scaling,
                          fused.delta_weight(), rtol=0, atol=1e-12)


def test_merge_unmerge_with_fusion():
    layer = _layer("column", 10, 7, True)
    layer.fusion = True
    x = _randn((3, 5, 10), _gen(7))
    with torch.no_grad():
        want = layer(x)
        layer.merge()
        assert layer.merged and layer.cclora_operands().lora_a is None
        merged = layer(x)
        layer.unmerge()
        again = layer(x)
    _assert_close(merged, want, "merged")
    _assert_close(again, want, "unmerged again")


def test_autocast_matches_plain_lora():
    """CPU bf16 autocast, fp32 parameters: dtypes as F.linear's and values as plain LoRA's."""
    plain = _layer("whole", 16, 8, False).float()
    fused = copy.deepcopy(plain)
    fused.fusion = True
    x = torch.randn(2, 20, 16, generator=_gen(8))
    out = []
    for layer in (plain, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        assert layer.lora_A.weight.grad.dtype == torch.float32
        out.append([y.float(), layer.lora_A.weight.grad, layer.lora_B.weight.grad])
    for got, want in zip(out[1], out[0]):  # bf16 rounds the merged weight and the branch differently
        assert rel_err(got, want) < 1e-2, rel_err(got, want)


def test_config_key():
    assert GalaxyConfig.from_dict({}).peft.lora_fusion is False
    assert GalaxyConfig.from_dict({"peft": {"tuning": "lora", "lora_fusion": True}}).peft.lora_fusion is True
    assert GalaxyConfig.from_dict({"tuning": "lora", "lora_fusion": True, "lora_dropout": 0.1}).peft.lora_fusion
    with pytest.raises(ConfigError, match="lora_fusion"):
        GalaxyConfig.from_dict({"lora_fusion": "yes"})


# ----------------------------------------------------------------------------- TP block edges (on the ranks)

HIDDEN = {"merged": 6, "unmerged": 20}  # rows are 7..16 here


def _dropout(p, seed):
    """A fresh LoRA dropout (both LoRA linears of an edge draw from its one generator, as the
    model's draw from one stream), or the identity."""
    return Dropout(p, _gen(seed)) if p else torch.nn.Identity()


def column_case(ctx, mode, batch, path, dropout=0.0):
    """S -> T ("gather") or R -> T ("copy"), then a LoRA linear with bias, a plain one and a LoRA
    one without bias (uneven column shards); W trains on one of them only. With ``dropout`` the
    LoRA inputs drop out, with the same masks on every rank (a replicated region)."""
    comm, r = ctx.mp, ctx.mp.rank
    split = SPLITS[comm.size]
    total, h = sum(split), HIDDEN[path]
    shared, own = _gen(7), _gen(100 + r)
    x = _randn((batch, split[r], h), own) if mode == "gather" else _randn((batch, total, h), shared)
    widths, ranks, scales = (3 + r, 2, 4), (2, None, 3), (0.5, None, 2.0)
    weights = [_randn((w, h), own) for w in widths]
    biases = [_randn((widths[0],), own), None, None]
    lora_a = [None if k is None else _randn((k, h), shared) for k in ranks]  # A is whole (replicated)
    lora_b = [None if k is None else _randn((w, k), own) for w, k in zip(widths, ranks)]
    grad_outputs = [_randn((batch, total, w), own) for w in widths]
    src = Layout.S if mode == "gather" else Layout.R

    def split_params(params):
        return params[:3], params[3:6], params[6:9], params[9:]

    def reference(x, *params):
        ws, bs, a_s, b_s = split_params(params)
        full = transition(x, src, Layout.T, comm, split)
        drop = _dropout(dropout, 21)
        return [F.linear(full, w, b) + (0 if a is None else (drop(full) @ a.t()) @ bb.t() * s)
                for w, b, a, bb, s in zip(ws, bs, a_s, b_s, scales)]

    def fused(x, *params):
        drop = _dropout(dropout, 21) if dropout else None
        ops = [LinearOperands(w, b, a, bb, s or 1.0, drop) for w, b, a, bb, s in zip(*split_params(params), scales)]
        if mode == "gather":
            return all_gather_cclora(x, ops, comm, split)
        return copy_cclora(x, ops, comm)

    inputs = [x, *weights, *biases, *lora_a, *lora_b]
    requires = [True, False, True, False] + [True] * 9
    label = f"{mode} b={batch} {path} dropout={dropout}"
    _compare(fused, reference, inputs, grad_outputs, requires, label)
    _compare(fused, reference, inputs, grad_outputs, [False] + requires[1:], f"{label} no dx")
    if mode == "gather" and not dropout:  # what travels: x, plus only the r-wide product when unmerged
        seen = []
        comm.observers.append(lambda rec: seen.append((rec.op, rec.phase, rec.nbytes)))
        try:
            fused(*[t if t is None else t.detach().requires_grad_(True) for t in inputs])
        finally:
            comm.observers.pop()
        row = total * batch * 8
        want = [("all_gather", "fwd", row * h)] + ([("all_gather", "fwd", row * 5)] if path == "unmerged" else [])
        assert seen == want, seen
    return True


def row_case(ctx, mode, batch, path, dropout=0.0):
    """A row-parallel LoRA linear (A sharded, B whole, bias on rank 0) then P -> S or P -> R; with
    ``dropout`` each rank drops its input shard with its own stream (a sharded region)."""
    comm, r = ctx.mp, ctx.mp.rank
    split = SPLITS[comm.size]
    total, out, k = sum(split), 5, 3
    in_local = {"merged": 2 + r, "unmerged": 30 + r, "mixed": 5 + 4 * r}[path]  # mixed: ranks differ
    shared, own = _gen(7), _gen(100 + r)
    x = _randn((batch, total, in_local), own)
    weight, bias = _randn((out, in_local), own), _randn((out,), shared)
    lora_a, lora_b = _randn((k, in_local), own), _randn((out, k), shared)
    grad_output = _randn((batch, split[r], out), own) if mode == "scatter" else _randn((batch, total, out), shared)
    dst = Layout.S if mode == "scatter" else Layout.R

    def reference(x, w, b, a, bb):
        y = F.linear(x, w, b if r == 0 else None) + (_dropout(dropout, 30 + r)(x) @ a.t()) @ bb.t() * 1.5
        return transition(y, Layout.P, dst, comm, split)

    def fused(x, w, b, a, bb):
        op = LinearOperands(w, b if r == 0 else None, a, bb, 1.5, _dropout(dropout, 30 + r) if dropout else None)
        if mode == "scatter":
            return cclora_reduce_scatter(x, op, comm, split)
        return cclora_all_reduce(x, op, comm)

    for requires in ([True, False, True, True, True], [True, True, True, True, True]):
        _compare(fused, reference, [x, weight, bias, lora_a, lora_b], [grad_output], requires,
                 f"{mode} b={batch} {path} dW={requires[1]} dropout={dropout}")
    return True


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["gather", "copy"])
def test_column_edges(dist_pool, world, mode):
    for batch in (1, 2):
        for path in HIDDEN:
            assert all(dist_pool.run(column_case, world, mode, batch, path))
    assert all(dist_pool.run(column_case, world, mode, 2, "merged", 0.3))  # dropout: unmerged, masks alike


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["scatter", "reduce"])
def test_row_edges(dist_pool, world, mode):
    for batch, path in ((1, "merged"), (2, "unmerged"), (1, "mixed")):
        assert all(dist_pool.run(row_case, world, mode, batch, path))
    assert all(dist_pool.run(row_case, world, mode, 2, "merged", 0.3))


# ----------------------------------------------------------------------------- whole models (on the ranks)


def model_case(ctx, model_type, plan, uneven, coc=None):
    """LoRA + lora_fusion on ``plan`` against the serial model with plain LoRA: a batch of 3 sequences
    (33 rows: the merged path at every edge) and of 1 (11 rows: unmerged, or mixed over ranks)."""
    if coc is not None:  # the documented fallback when coc_parallel_num is unset
        old = os.environ.get("COC_PARALLEL_NUM")
        os.environ["COC_PARALLEL_NUM"] = str(coc)
    try:
        serial, par = tuned_pair(ctx, model_type, "lora", plan, uneven, lora_fusion=True)
    finally:
        if coc is not None and old is None:
            del os.environ["COC_PARALLEL_NUM"]
        elif coc is not None:
            os.environ["COC_PARALLEL_NUM"] = old
    set_lora_fusion(serial, False)  # the reference is plain LoRA
    fused_edges = [e for stack in layer_stacks(par) for layer in stack for e in layer.edges
                   if isinstance(e, CcloraEdge)]
    assert fused_edges and all(c.chunks == (coc or 1) for c in fused_edges)
    assert all(layer.fusion for name, layer in lora_modules(par).items() if "embed" not in name)
    sync = GradientSync(par.parameters(), ctx.mp)
    grads_s = dict(serial.named_parameters())
    full = make_batch(model_type)
    for batch in (full, {k: v[:1] for k, v in full.items()}):
        for model in (serial, par):
            model.zero_grad(set_to_none=True)
        gathers = []
        ctx.mp.observers.append(lambda rec: gathers.append(rec) if rec.op == "all_gather" else None)
        try:
            out_s, out_p = serial(**batch), par(**batch)
        finally:
            ctx.mp.observers.pop()
        if plan == "galaxy":  # each S -> T entry (ATT, MLP per layer) gathers x, and the r-wide x A_s when unmerged
            entries = 2 * serial.config.num_hidden_layers
            assert len(gathers) == entries * (1 if batch is full else 2), (plan, len(gathers))
        out_s.loss.backward()
        out_p.loss.backward()
        sync()
        assert abs(out_p.loss.item() - out_s.loss.item()) <= RTOL * abs(out_s.loss.item())
        assert rel_err(edges(par).to_replicated(out_p.logits).detach(), out_s.logits.detach()) < RTOL
        for name, p in par.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, f"frozen {name} got a gradient"
                continue
            err = rel_err(gather_full(p.grad, p, ctx.mp), grads_s[name].grad)
            assert err < RTOL, f"{plan}: grad of {name}: relative error {err:.2e}"
    return True


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_models_with_fusion_equal_serial_lora(dist_pool, model_type):
    for plan in ("tp", "galaxy"):
        dist_pool.run(model_case, 2, model_type, plan, False)
    dist_pool.run(model_case, 3, model_type, "galaxy", True)


def test_fusion_with_coc_chunks(dist_pool):
    """coc_parallel_num 2: edges with LoRA run CCLoRA, the others CoC's chunks; still exact."""
    dist_pool.run(model_case, 2, "llama", "galaxy", False, 2)


def dropout_case(ctx, model_type, plan, uneven):
    """LoRA dropout 0.3 in training: the fused model and the plain-LoRA model on the same plan draw
    the same masks from the context's streams (restored before each model's step) and take the
    same two AdamW steps: losses, logits and every trainable gradient to 1e-9."""
    targets = [t for t in LORA_TARGETS[model_type] if "embed" not in t]  # embeddings have no dropout
    models = [tuned_pair(ctx, model_type, "lora", plan, uneven, targets=targets, lora_dropout=0.3,
                         lora_fusion=True)[1] for _ in range(2)]
    fused, plain = models
    set_lora_fusion(plain, False)
    assert all(m.active_dropout is not None for m in lora_modules(fused).values())
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    batch = make_batch(model_type)
    plain.eval()
    without_dropout = plain(**batch).loss.item()
    plain.train()
    for step in range(2):
        streams = {key: g.get_state() for key, g in ctx.generators.items()}
        results = []
        for model, optimizer in zip(models, optimizers):
            for key, state in streams.items():
                ctx.generators[key].set_state(state)
            out = model(**batch)
            out.loss.backward()
            GradientSync(model.parameters(), ctx.mp)()
            results.append((out.loss.item(), edges(model).to_replicated(out.logits).detach(),
                            {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        (loss_f, logits_f, grads_f), (loss_p, logits_p, grads_p) = results
        assert abs(loss_f - loss_p) <= RTOL * abs(loss_p), (step, loss_f, loss_p)
        assert rel_err(logits_f, logits_p) < RTOL
        assert grads_f.keys() == grads_p.keys()
        for name in grads_p:
            assert rel_err(grads_f[name], grads_p[name]) < RTOL, f"{plan} step {step}: grad of {name}"
        if step == 0:  # the masks mattered
            assert abs(loss_p - without_dropout) > 1e-6
    return True


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_fusion_with_lora_dropout_equals_plain_lora(dist_pool, model_type):
    for plan in ("tp", "galaxy2"):
        assert all(dist_pool.run(dropout_case, 2, model_type, plan, False))
    assert all(dist_pool.run(dropout_case, 3, model_type, "galaxy", True))


def merge_case(ctx, model_type, plan):
    targets = [t for t in LORA_TARGETS[model_type] if "embed" not in t]  # a tied weight is not merged
    serial, par = tuned_pair(ctx, model_type, "lora", plan, ctx.mp.size == 3, targets=targets, lora_fusion=True)
    batch = make_batch(model_type)
    with torch.no_grad():
        want = serial(**batch).logits
        merge_lora(par)
        merged = edges(par).to_replicated(par(**batch).logits)
        unmerge_lora(par)
        again = edges(par).to_replicated(par(**batch).logits)
    assert rel_err(merged, want) < RTOL and rel_err(again, want) < RTOL
    return True


def test_merge_unmerge_on_a_plan(dist_pool):
    dist_pool.run(merge_case, 3, "llama", "galaxy")


def save_case(ctx, directory):
    serial, par = tuned_pair(ctx, "llama", "lora", "galaxy", False, lora_fusion=True)
    set_lora_fusion(serial, False)
    par(**make_batch("llama")).loss.backward()  # a fused step leaves the factors as they were
    save_tuning(par, os.path.join(directory, "fused"))
    if ctx.rank == 0:
        save_tuning(serial, os.path.join(directory, "plain"))
    return True


def test_saved_lora_is_unchanged_by_fusion(dist_pool, tmp_path):
    from safetensors.torch import load_file

    dist_pool.run(save_case, 2, str(tmp_path))
    fused = load_file(os.path.join(tmp_path, "fused", "adapter_model.safetensors"))
    plain = load_file(os.path.join(tmp_path, "plain", "adapter_model.safetensors"))
    assert fused.keys() == plain.keys() and any(k.endswith("lora_A.weight") for k in fused)
    assert all(torch.equal(fused[k], plain[k]) for k in fused)
    with open(os.path.join(tmp_path, "fused", "adapter_config.json")) as f:
        config = json.load(f)
    assert "lora_fusion" not in config  # a runtime choice, not part of the adapter


def test_apply_tuning_turns_fusion_on():
    cls, tiny = MODELS["llama"]
    cfg = GalaxyConfig.from_dict(dict(tiny, seq_length=SEQ, tuning="lora", lora_fusion=True))
    model = apply_tuning(cls(cfg.model, seed=7), cfg)
    layers = lora_modules(model)
    assert layers and all(m.fusion for m in layers.values())
    assert model.peft_config.lora_fusion is True
