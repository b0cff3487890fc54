"""Activation recomputation (``recompute: full | selective | mlp``, ``recompute_num_layers``) changes
nothing but memory: with dropout on and the same seed, BERT and LLaMA in float64 give exactly the
loss and every gradient of ``recompute: none`` on every plan (uneven splits, CoC, world 1-4; ``mlp``
under CoC to 1e-12, its MLP's edges then unfused), under
1F1B with pipeline and data parallelism, and under bf16 autocast; the dropout streams end where
they would have; and fewer activations are saved for backward."""

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.recompute import layer_modes
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.train.loop import Trainer
from tests import COMPILED_WITHOUT_KERNELS

SEQ, BATCH = 11, 4
LLAMA = dict(model_type="llama", vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=40, hidden_act="silu", max_position_embeddings=32,
             initializer_range=0.1, pad_token_id=None)
BERT = dict(model_type="bert", vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=6,
            intermediate_size=40, max_position_embeddings=32)
# Every dropout on: attention probabilities, residual branches (LLaMA's too), embeddings.
DROPOUT = dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.2, seq_length=SEQ)
UNEVEN = {
    "llama": {3: dict(tp_num_attention_heads_list=[2, 4, 2], tp_intermediate_size_list=[10, 20, 10],
                      seq_scatter_list=[2, 5, 4]),
              4: dict(tp_num_attention_heads_list=[2, 2, 2, 2], tp_intermediate_size_list=[5, 10, 15, 10],
                      seq_scatter_list=[3, 2, 4, 2])},
    "bert": {2: dict(tp_num_attention_heads_list=[4, 2], tp_intermediate_size_list=[15, 25], seq_scatter_list=[7, 4]),
             3: dict(tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10],
                     seq_scatter_list=[2, 5, 4])},
}
MODES = [dict(recompute="full"), dict(recompute="selective"), dict(recompute="full", recompute_num_layers=1),
         dict(recompute="mlp")]
# recompute mlp runs a TP MLP unfused (one region), so under CoC its sums differ in order from the chunked run's
COC_MLP_RTOL = 1e-12


def make_batch(rows=BATCH, seed=0, seq=SEQ, vocab=50):
    """Token rows with the second one padded at the end and one more label ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, seq - 3:] = 0
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    labels[0, 2] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def same(a, b):
    """Bitwise equal, or both None (a row-parallel bias off rank 0 takes no part)."""
    return a is b is None or (a is not None and b is not None and torch.equal(a, b))


def streams(ctx):
    return [ctx.generator(sharded=False), ctx.generator(sharded=True)]


def one_step(ctx, model_type, raw, extra, start):
    """Loss, gradients and the dropout streams' end states of one forward/backward from ``start``."""
    for g, state in zip(streams(ctx), start):
        g.set_state(state)
    cfg = GalaxyConfig.from_dict(dict(raw, **extra))
    cls = LlamaForCausalLM if model_type == "llama" else BertForMaskedLM
    model = cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).double().train()
    out = model(**make_batch())
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.loss.detach(), grads, [g.get_state() for g in streams(ctx)]


def compare_modes(ctx, model_type, plan, uneven, extra=None):
    raw = dict(LLAMA if model_type == "llama" else BERT, **DROPOUT, plan=plan, **(extra or {}))
    if uneven:
        raw.update(UNEVEN[model_type][ctx.mp.size])
    start = [g.get_state() for g in streams(ctx)]
    loss, grads, end = one_step(ctx, model_type, raw, {}, start)
    for mode in MODES:
        loss_r, grads_r, end_r = one_step(ctx, model_type, raw, mode, start)
        if mode["recompute"] == "mlp" and "coc_parallel_num" in (extra or {}):
            assert torch.allclose(loss_r, loss, rtol=COC_MLP_RTOL, atol=0), (mode, loss_r.item(), loss.item())
            for name, g in grads.items():
                assert same(grads_r[name], g) or torch.allclose(grads_r[name], g, rtol=COC_MLP_RTOL, atol=1e-15), \
                    f"{mode}: gradient of {name} differs"
        else:
            assert torch.equal(loss_r, loss), (mode, loss_r.item(), loss.item())
            for name, g in grads.items():
                assert same(grads_r[name], g), f"{mode}: gradient of {name} differs"
        # The streams end where they would without recomputation: the replay was rewound, then put back.
        assert all(torch.equal(a, b) for a, b in zip(end_r, end)), mode
    # The test can fail: dropout is on, so a step from other stream states gives another loss.
    assert not torch.equal(one_step(ctx, model_type, raw, {}, end)[0], loss)
    return loss.item()


CASES = [("llama", 1, "none", False, None), ("llama", 2, "tp", False, None), ("llama", 2, "sp", False, None),
         ("llama", 3, "galaxy", True, None), ("llama", 4, "galaxy2", True, None),
         ("llama", 4, "tp", True, dict(coc_parallel_num=2, fused_gate_up=True)),
         ("bert", 2, "galaxy", True, dict(coc_parallel_num=2)), ("bert", 3, "tp", True, None),
         ("bert", 4, "sp", False, None)]


@pytest.mark.parametrize("model_type,world,plan,uneven,extra", CASES,
                         ids=[f"{c[0]}-{c[2]}-w{c[1]}{'-uneven' if c[3] else ''}{'-coc' if c[4] else ''}"
                              for c in CASES])
def test_recompute_gives_exact_gradients(dist_pool, model_type, world, plan, uneven, extra):
    losses = dist_pool.run(compare_modes, world, model_type, plan, uneven, extra)
    assert len(set(losses)) == 1  # one loss on every rank


def pipeline_modes(ctx, parallel):
    """Trainer steps (1F1B micro-batches, dp gradient all-reduce) with and without recomputation."""
    train = dict(global_batch_size=8, dtype="float64", seed=7, **parallel)
    raw = dict(LLAMA, num_hidden_layers=4, **DROPOUT, **train)
    ctx.stage_layers = GalaxyConfig.from_dict(raw).stage_layers()
    batch = make_batch(rows=8, seed=1)
    start = [g.get_state() for g in streams(ctx)]
    results = []
    # recompute_num_layers counts per stage: 1 of each stage's 2 layers.
    for extra in ({}, dict(recompute="full"), dict(recompute="selective", recompute_num_layers=1)):
        for g, state in zip(streams(ctx), start):
            g.set_state(state)
        cfg = GalaxyConfig.from_dict(dict(raw, **extra))
        model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3)
        assert [layer.recompute_mode for layer in model.model.layers] == \
            layer_modes(cfg.model.recompute, cfg.model.recompute_num_layers, 2)
        trainer = Trainer(model, cfg, ctx)
        loss = trainer.forward_backward(trainer.read_batch(lambda step: batch, 0))
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), others = results[0], results[1:]
    for loss_r, grads_r in others:
        assert torch.equal(loss_r, loss)
        for name, g in grads.items():
            assert same(grads_r[name], g), f"gradient of {name} differs"
    return loss.item()


@pytest.mark.parametrize("parallel", [dict(pp_size=2, dp_size=2, num_microbatches=2),
                                      dict(pp_size=2, plan="galaxy", num_microbatches=4)],
                         ids=["pp2-dp2", "pp2-galaxy-mp2"])
def test_recompute_under_1f1b_and_dp(dist_pool, parallel):
    losses = dist_pool.run(pipeline_modes, 4, parallel, dp=parallel.get("dp_size", 1), pp=2)
    assert len(set(losses)) == 1


def test_recompute_under_bf16_autocast_is_exact():
    """The recompute replays the forward's autocast state, so bf16 matmuls round the same way."""
    ctx = ParallelContext.serial(seed=2)
    start = [g.get_state() for g in streams(ctx)]
    results = []
    for extra in ({}, dict(recompute="full"), dict(recompute="selective"), dict(recompute="mlp")):
        for g, state in zip(streams(ctx), start):
            g.set_state(state)
        cfg = GalaxyConfig.from_dict(dict(LLAMA, **DROPOUT, **extra))
        model = LlamaForCausalLM(cfg.model, None, ctx, seed=3).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**make_batch()).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))


def test_recompute_mlp_replays_lora_dropout_exactly():
    """LoRA on the MLP's projections with its dropout on: ``recompute: mlp`` replays the LoRA streams, so the
    loss, every LoRA gradient and the streams' end states are those without recomputation (float64)."""
    from galaxy.peft import apply_tuning

    ctx = ParallelContext.serial(seed=2)
    start = [g.get_state() for g in streams(ctx)]
    results = []
    for extra in ({}, dict(recompute="mlp")):
        for g, state in zip(streams(ctx), start):
            g.set_state(state)
        cfg = GalaxyConfig.from_dict(dict(LLAMA, **DROPOUT, **extra, tuning="lora", lora_dim=4, lora_dropout=0.3,
                                          lora_target_modules=["gate_proj", "up_proj", "down_proj"]))
        model = apply_tuning(LlamaForCausalLM(cfg.model, None, ctx, seed=3).double(), cfg).train()
        loss = model(**make_batch()).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        [g.get_state() for g in streams(ctx)]))
    (loss, grads, end), (loss_r, grads_r, end_r) = results
    assert torch.equal(loss_r, loss) and grads and grads.keys() == grads_r.keys()
    assert all(torch.equal(grads_r[n], g) for n, g in grads.items())
    assert all(torch.equal(a, b) for a, b in zip(end_r, end))


def saved_bytes(model_type, extra):
    """Bytes autograd keeps for backward outside recomputed regions (their own saved tensors are
    held by the checkpoint, which regenerates them, and never reach these hooks)."""
    raw = dict(LLAMA if model_type == "llama" else BERT, **DROPOUT, num_hidden_layers=3, **extra)
    cfg = GalaxyConfig.from_dict(raw)
    cls = LlamaForCausalLM if model_type == "llama" else BertForMaskedLM
    model = cls(cfg.model, None, ParallelContext.serial(), seed=3).train()
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**make_batch()).loss
    loss.backward()
    return total[0]


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_recompute_saves_fewer_activations(model_type):
    none = saved_bytes(model_type, {})
    selective = saved_bytes(model_type, dict(recompute="selective"))
    first = saved_bytes(model_type, dict(recompute="full", recompute_num_layers=1))
    full = saved_bytes(model_type, dict(recompute="full"))
    mlp = saved_bytes(model_type, dict(recompute="mlp"))
    assert full < first < none, (full, first, none)
    assert full < selective < none, (full, selective, none)
    assert full < mlp < none, (full, mlp, none)


def unfused_mlp_warnings(ctx, plan, chunks):
    """How many times building a LLaMA with ``recompute: mlp`` said it runs the MLP's edges unfused."""
    import logging

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("galaxy.core.recompute")
    logger.addHandler(handler)
    try:
        cfg = GalaxyConfig.from_dict(dict(LLAMA, seq_length=SEQ, recompute="mlp", plan=plan, coc_parallel_num=chunks))
        LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3)
    finally:
        logger.removeHandler(handler)
    return sum("recompute 'mlp'" in r.getMessage() for r in records)


@pytest.mark.parametrize("plan,chunks,warnings", [("tp", 2, 1), ("galaxy2", 2, 0), ("tp", 1, 0)])
def test_recompute_mlp_says_when_it_unfuses_the_mlp_edges(dist_pool, plan, chunks, warnings):
    """``recompute: mlp`` over a TP MLP whose edges CoC would overlap runs them unfused, and says so once."""
    assert dist_pool.run(unfused_mlp_warnings, 2, plan, chunks) == [warnings] * 2


def test_layer_modes():
    assert layer_modes("full", None, 3) == ["full"] * 3
    assert layer_modes("selective", 2, 3) == ["selective", "selective", "none"]
    assert layer_modes("full", 5, 2) == ["full", "full"]


@pytest.mark.parametrize("raw,match", [
    (dict(recompute="partial"), "'recompute': 'partial' is not one of none, full, selective"),
    (dict(recompute="full", recompute_num_layers=0), "'recompute_num_layers' must be at least 1"),
    (dict(recompute_num_layers=2), "'recompute_num_layers' is set but 'recompute' is 'none'"),
])
def test_recompute_config_errors(raw, match):
    with pytest.raises(ConfigError, match=match):
        GalaxyConfig.from_dict(raw)
    assert GalaxyConfig.from_dict(dict(recompute_granularity="selective")).model.recompute == "selective"


def test_bench_recompute_smoke(tmp_path):
    import json

    from bench import bench_recompute

    out = tmp_path / "recompute.json"
    assert bench_recompute.main(["--smoke", "--device", "cpu", "--modes", "none,full", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["recompute"] for r in report["rows"]] == ["none", "full"]
    assert all(r["tokens_per_s"] > 0 for r in report["rows"]) and report["commit"]


def saved_by_a_compiled_step(model, batch) -> list:
    """The tensors a compiled model's forward under bf16 autocast saves for backward (the second step's:
    the first compiles)."""
    for _ in range(2):
        saved = []
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(**batch).loss
        loss.backward()
    return saved


def kept(saved: list, x: torch.Tensor) -> bool:
    """``x`` is among ``saved`` (in any shape of its size): a tensor computed by other kernels (compiled
    against eager) differs by a bf16 rounding here and there, and past the first layer by what the roundings
    before it added up to, so at least 70% of its elements within one rounding (seen: 78-100%; another
    tensor of the same shape and scale, at most 51%)."""
    def close(t):
        t, y = t.reshape(x.shape).float(), x.float()
        return ((t - y).abs() <= 2**-7 * y.abs() + 1e-3).float().mean() >= 0.7
    return any(t.numel() == x.numel() and t.dtype == x.dtype and close(t) for t in saved)


@pytest.mark.parametrize("tuning", ["lora", "full"])
def test_a_compiled_layer_rebuilds_its_normed_input_instead_of_keeping_it(tuning):
    """Compiled, under bf16 autocast: the attention norm's output in the compute dtype (q/k/v's input, kept for
    their weight gradients or LoRA A's) is not among the tensors saved for backward; the layer input it is
    rebuilt from is. LoRA on a bf16 base (the norm computes in bf16) and full training over fp32 weights (the
    norm computes in fp32, its bf16 copy is what the projections keep). Eagerly (and before this) it was kept."""
    from galaxy.peft import apply_tuning

    peft = {"tuning": "lora", "lora_dim": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "lora_target_modules": ["q_proj", "v_proj"]} if tuning == "lora" else {}
    cfg = GalaxyConfig.from_dict({
        "model": dict(LLAMA, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, **COMPILED_WITHOUT_KERNELS),
        "train": {"seq_length": SEQ, "dtype": "bfloat16"}, "peft": peft})
    model = apply_tuning(LlamaForCausalLM(cfg.model, None, ParallelContext.serial("cpu"), seed=3), cfg)
    layer = model.model.layers[1]  # the second: the first layer's input needs no gradient
    assert layer.input_layernorm.weight.dtype == (torch.bfloat16 if tuning == "lora" else torch.float32)
    inputs = []
    layer.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
    saved = saved_by_a_compiled_step(model, make_batch())
    h = inputs[-1]
    with torch.no_grad():
        normed = layer.input_layernorm(h).to(torch.bfloat16)
    assert kept(saved, h)
    assert not kept(saved, normed)


def test_a_compiled_bert_layer_rebuilds_its_mlp_input_instead_of_keeping_it():
    """Full training, compiled, under bf16 autocast over fp32 weights: BERT's post-LN output in bf16 (the MLP's
    first dense keeps it for its weight gradient) is not among the tensors saved for backward (backward rebuilds
    it with the norm); the attention's bf16 input, which nothing can rebuild, is. The values come from the model
    run eagerly."""
    def build(compile_):
        cfg = GalaxyConfig.from_dict({  # weights large enough that each layer's LayerNorm outputs differ
            "model": dict(BERT, hidden_size=64, num_attention_heads=4, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, initializer_range=0.5,
                          **(COMPILED_WITHOUT_KERNELS if compile_ else {})),
            "train": {"seq_length": SEQ, "dtype": "bfloat16"}})
        return BertForMaskedLM(cfg.model, None, ParallelContext.serial("cpu"), seed=3)

    batch, seen = make_batch(), {}
    eager = build(False)
    layer = eager.bert.encoder.layer[1]
    layer.attention.self.query.register_forward_pre_hook(lambda _, args: seen.setdefault("att", args[0]))
    layer.intermediate.dense.register_forward_pre_hook(lambda _, args: seen.setdefault("mlp", args[0]))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager(**batch)
    saved = saved_by_a_compiled_step(build(True), batch)
    assert kept(saved, seen["att"].to(torch.bfloat16))
    assert not kept(saved, seen["mlp"].to(torch.bfloat16))


@pytest.mark.parametrize("model_type", ["llama", "llama-fused_gate_up", "bert"])
def test_a_compiled_mlp_rebuilds_its_activation_instead_of_keeping_it(model_type):
    """Full training, compiled, under bf16 autocast: the MLP's second projection's input (LLaMA's
    act(gate) * up, BERT's gelu(i), which its weight gradient reads) is not among the tensors saved for
    backward; what backward rebuilds it from (gate and up, packed or not; i) is. The values to look for come
    from the same model run eagerly."""
    raw = BERT if model_type == "bert" else dict(LLAMA, fused_gate_up=model_type.endswith("fused_gate_up"))
    cls = BertForMaskedLM if model_type == "bert" else LlamaForCausalLM

    def build(compile_):
        cfg = GalaxyConfig.from_dict({
            "model": dict(raw, hidden_size=64, num_attention_heads=4, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, **(COMPILED_WITHOUT_KERNELS if compile_ else {})),
            "train": {"seq_length": SEQ, "dtype": "bfloat16"}})
        return cls(cfg.model, None, ParallelContext.serial("cpu"), seed=3)

    batch, seen = make_batch(), {"inputs": []}
    eager = build(False)
    if model_type != "bert":  # the first layer: its input is the embedding, the same eager and compiled
        mlp = eager.model.layers[0].mlp
        first = (mlp.gate_up_proj,) if mlp.fused else (mlp.gate_proj, mlp.up_proj)
        second = mlp.down_proj
    else:
        layer = eager.bert.encoder.layer[0]
        first, second = (layer.intermediate.dense,), layer.output.dense
    for m in first:
        m.register_forward_hook(lambda _, args, out: seen["inputs"].append(out))
    second.register_forward_pre_hook(lambda _, args: seen.setdefault("act", args[0]))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager(**batch)
    saved = saved_by_a_compiled_step(build(True), batch)
    assert len(seen["inputs"]) == len(first) and all(kept(saved, x) for x in seen["inputs"])
    assert not kept(saved, seen["act"])
