"""FSDP2 under the plans: ``dp_engine: fsdp2`` (torch's ``fully_shard`` over dp) and ``mp_grad_reduce:
fsdp`` (the replicated weights of SP blocks sharded over mp, over dp x mp with fsdp2) give the serial
model in float64: the loss, every gradient (DTensor shards gathered) and the clipped global norm on
each of 3 steps, and every parameter after the 3 AdamW steps; the sharded mode holds 1/mp of those
weights' parameters, gradients and optimizer state per rank; the config refuses what it cannot do.
The harness (tiny BERT / LLaMA, float64) is tests/core/test_dp_pp.py's."""

import pytest
import torch
from torch._dynamo.utils import counters

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.fsdp import fsdp_axes, is_dtensor, local
from galaxy.core.grad_sync import gather_full
from galaxy.core.pipeline import layer_stacks
from galaxy.train.loop import Trainer, autocast_context, train
from tests import COMPILED_WITHOUT_KERNELS
from tests.core.test_dp_pp import RTOL, STEPS, build, rel_err
from tests.train.checkpoint.helpers import build as build_overriding_train

UNEVEN2 = dict(tp_num_attention_heads_list=[6, 2], tp_intermediate_size_list=[15, 25], seq_scatter_list=[7, 5])
UNEVEN3 = dict(tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10],
               seq_scatter_list=[2, 5, 5])
FSDP2 = dict(dp_engine="fsdp2")
# name: (world, case); the BERT of test_dp_pp unless the case says llama.
CASES = {
    "dp2-mp1": (2, dict(FSDP2, plan="tp", dp_size=2, num_microbatches=2)),
    # unsharded gradients accumulated over the micro-batches, one reduce-scatter per step
    "dp2-mp1-sync-once": (2, dict(FSDP2, plan="tp", dp_size=2, num_microbatches=2, fsdp_grad_sync="last_micro_batch")),
    "dp2-galaxy2-mpfsdp-sync-once": (4, dict(FSDP2, plan="galaxy2", dp_size=2, mp_grad_reduce="fsdp",
                                             num_microbatches=2, fsdp_grad_sync="last_micro_batch")),
    "dp2-tp2": (4, dict(FSDP2, plan="tp", dp_size=2)),
    "dp2-galaxy2-llama": (4, dict(FSDP2, model="llama", plan="galaxy", dp_size=2)),
    "dp2-galaxy2": (4, dict(FSDP2, plan="galaxy2", dp_size=2, num_microbatches=2)),
    "dp2-galaxy2-mpfsdp": (4, dict(FSDP2, plan="galaxy2", dp_size=2, mp_grad_reduce="fsdp")),
    "galaxy2-mpfsdp-w2-uneven-llama": (2, dict(model="llama", plan="galaxy2", mp_grad_reduce="fsdp", **UNEVEN2)),
    "galaxy2-mpfsdp-w3-uneven": (3, dict(plan="galaxy2", mp_grad_reduce="fsdp", **UNEVEN3)),
    # the FSDP unit (the SP MLP) inside a recomputed region: its gathers run again in backward
    "galaxy2-mpfsdp-recompute-mlp-llama": (2, dict(model="llama", plan="galaxy2", mp_grad_reduce="fsdp",
                                                   recompute="mlp", num_microbatches=2)),
    "galaxy2-mpfsdp-recompute-full": (2, dict(plan="galaxy2", mp_grad_reduce="fsdp", recompute="full")),
    "ddp-dp2-sp-mpfsdp": (4, dict(plan="sp", dp_size=2, mp_grad_reduce="fsdp", reshard_after_forward="never")),
    "dp2-pp2-llama-tied": (4, dict(FSDP2, model="llama", plan="none", dp_size=2, pp_size=2,
                                   tie_word_embeddings=True, num_microbatches=2)),
}


def full(t: torch.Tensor, p: torch.Tensor, ctx) -> torch.Tensor:
    """The full tensor of parameter ``p`` (or its gradient ``t``): FSDP shards gathered, then TP shards."""
    if is_dtensor(t):
        t = t.full_tensor()
    return gather_full(t, p, ctx.mp)


def fsdp_equals_serial(ctx, case):
    cfg, serial_cfg, model, serial, batch_at = build(ctx, case)
    par = Trainer(model, cfg, ctx)
    ref = Trainer(serial, serial_cfg, ParallelContext.serial())
    axes = {"x".join(fsdp_axes(p)) for p in model.parameters()}
    for group in par.optimizer.param_groups:  # fused AdamW (CUDA) takes no group mixing DTensor and Tensor
        assert len({is_dtensor(p) for p in group["params"]}) == 1
    params_s = dict(serial.named_parameters())
    for step in range(STEPS):
        loss_t, loss_st = par.forward_backward(par.read_batch(batch_at, step)), ref.forward_backward(batch_at(step))
        assert abs(loss_t.item() - loss_st.item()) <= RTOL * abs(loss_st.item()), (step, loss_t, loss_st)
        for name, p in model.named_parameters():
            assert (p.grad is None) == (params_s[name].grad is None), name
            if p.grad is not None:
                err = rel_err(full(p.grad, p, ctx), params_s[name].grad)
                assert err < RTOL, f"step {step}: grad of {name}: relative error {err:.2e}"
        norm, norm_s = par.optimizer_step(loss_t, step + 1).grad_norm, ref.optimizer_step(loss_st, step + 1).grad_norm
        assert abs(norm.item() - norm_s.item()) <= RTOL * norm_s.item(), (step, norm.item(), norm_s.item())
        assert norm_s.item() > cfg.train.grad_clip, "the test should exercise clipping"
    for name, p in model.named_parameters():
        floor = 0.02 * params_s[name].numel() ** 0.5
        err = rel_err(full(p.detach(), p, ctx), params_s[name].detach(), floor)
        assert err < RTOL, f"{name} after {STEPS} AdamW steps: relative error {err:.2e}"
    par.grad_sync.remove()
    traffic = sum(gathered + reduced for _, gathered, reduced in par.sharding.traffic)
    in_layers = {id(p) for stack in layer_stacks(model) for layer in stack for p in layer.parameters()}
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    return (sorted(axes), traffic, sum(p.numel() for p in matrices if id(p) in in_layers),
            sum(p.numel() for p in matrices if id(p) not in in_layers))


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_equals_serial(dist_pool, name):
    world, case = CASES[name]
    out = dist_pool.run(fsdp_equals_serial, world, case, dp=case.get("dp_size", 1), pp=case.get("pp_size", 1))
    dp, mp_fsdp = case.get("dp_engine") == "fsdp2", case.get("mp_grad_reduce") == "fsdp"
    mp = world // (case.get("dp_size", 1) * case.get("pp_size", 1))
    expected = {"", "dp"} if dp else {""}  # fsdp2 shards every matrix over dp at least (vectors stay whole)
    if mp_fsdp and mp > 1:
        expected.add("dpxmp" if dp else "mp")
    assert all(set(axes) == expected for axes, _, _, _ in out), (out, expected)
    if name == "dp2-mp1":  # float64 matrices: a layer's gathered in forward and again in backward, the root's
        # (embeddings, head) once, kept from forward into backward; every one reduce-scattered
        assert all(traffic == 8 * (3 * layers + 2 * root) for _, traffic, layers, root in out), out


def compiled_fsdp_equals_serial(ctx, case):
    """``compile: true`` over FSDP units inside a layer (``mp_grad_reduce: fsdp``'s SP MLP): the serial
    model as above, the layers traced into graphs, and dynamo's only graph breaks FSDP's own hooks (torch
    marks them ``torch._dynamo.disable``; a layer without them traces whole, tests/core/test_compile.py).
    Compiled without kernels (``COMPILED_WITHOUT_KERNELS``): what is checked is where the graphs break and how
    they meet the hooks."""
    torch._dynamo.reset()  # this test's graphs only (dynamo's recompile limit counts earlier ones)
    counters.clear()
    fsdp_equals_serial(ctx, dict(case, **COMPILED_WITHOUT_KERNELS))
    return counters["stats"]["unique_graphs"], dict(counters["graph_break"])


@pytest.mark.parametrize("world,case", [
    (2, dict(model="llama", plan="galaxy2", mp_grad_reduce="fsdp", **UNEVEN2)),
    (4, dict(FSDP2, plan="galaxy2", dp_size=2, mp_grad_reduce="fsdp", num_microbatches=2)),
])
def test_compiled_layers_around_fsdp_units_equal_serial(dist_pool, world, case):
    for graphs, breaks in dist_pool.run(compiled_fsdp_equals_serial, world, case, dp=case.get("dp_size", 1)):
        assert graphs >= 2, "each layer compiles in the stretches around its FSDP unit"
        assert breaks and all("disable" in reason for reason in breaks), breaks


def replicated_bytes(ctx, case):
    """Bytes this rank holds of the weights ``mp_grad_reduce: fsdp`` shards over mp (parameters and
    gradients after a backward, AdamW moments after the step), under ``after_backward`` and ``fsdp``."""
    held, names = {}, None
    for mode in ("fsdp", "after_backward"):
        cfg, _, model, _, batch_at = build(ctx, dict(case, mp_grad_reduce=mode))
        par = Trainer(model, cfg, ctx)
        if names is None:
            names = {n for n, p in model.named_parameters() if "mp" in fsdp_axes(p)}
        params = {n: p for n, p in model.named_parameters() if n in names}
        loss = par.forward_backward(par.read_batch(batch_at, 0))
        nbytes = lambda t: local(t).numel() * t.element_size()  # noqa: E731
        total = sum(nbytes(p) + nbytes(p.grad) for p in params.values())
        par.optimizer_step(loss, 1)
        total += sum(nbytes(par.optimizer.state[p][k]) for p in params.values() for k in ("exp_avg", "exp_avg_sq"))
        # The bound: each weight's largest dim-0 block (FSDP's chunks), in 4 copies.
        bound = sum(-(-p.shape[0] // ctx.mp.size) * p[0].numel() * p.element_size() * 4 for p in params.values())
        held[mode] = total, bound, sorted(names)
        par.grad_sync.remove()
    return held


@pytest.mark.parametrize("world,case", [(2, dict(plan="galaxy2")),
                                        (3, dict(model="llama", plan="galaxy2", **UNEVEN3))])
def test_sharded_replicated_weights_hold_one_mp_th_per_rank(dist_pool, world, case):
    if case.get("model") == "llama":
        case = dict(case, tp_num_attention_heads_list=[2, 4, 2])  # LLaMA's 8 heads, GQA groups of 2
    out = dist_pool.run(replicated_bytes, world, case)
    whole = out[0]["after_backward"][0]
    names = out[0]["fsdp"][2]
    assert names and all(("mlp" in n or "intermediate" in n or "output.dense" in n) for n in names), names
    assert all(r["after_backward"][0] == whole for r in out), "every rank holds them whole without fsdp"
    assert sum(r["fsdp"][0] for r in out) == whole, "the shards partition them"
    for r in out:
        total, bound, _ = r["fsdp"]
        assert total <= bound <= 1.1 * whole / world, (total, bound, whole)


def bf16_run(ctx, model_type):
    """bfloat16 autocast: FSDP gathers bf16 weights (MixedPrecisionPolicy), the sharded fp32 masters are
    what the optimizer steps; the loss curve follows ddp's (fp32 weights under autocast) within bf16 noise."""
    curves = {}
    for engine in ("ddp", "fsdp2"):
        case = dict(plan="galaxy2", dp_size=2, dtype="bfloat16", max_steps=3, grad_clip=1.0)
        if engine == "fsdp2":
            case.update(dp_engine="fsdp2", mp_grad_reduce="fsdp")
        cfg, _, model, _, batch_at = build_overriding_train(ctx, dict(case, model=model_type))
        trainer = Trainer(model, cfg, ctx)
        seen = []
        mlp = model.model.layers[0].mlp if model_type == "llama" else model.bert.encoder.layer[0].output.dense
        weight = (lambda m: m.down_proj.weight) if model_type == "llama" else (lambda m: m.weight)  # noqa: E731
        hook = mlp.register_forward_pre_hook(  # after FSDP's gather
            lambda m, args: seen.append((weight(m).dtype, args[0].dtype)))
        losses = []
        for step in range(cfg.train.max_steps):
            amp = lambda: autocast_context(cfg, ctx.device)  # noqa: E731
            loss = trainer.forward_backward(trainer.read_batch(batch_at, step), amp)
            assert trainer.optimizer_step(loss, step + 1).skipped is None
            losses.append(loss.item())
        hook.remove()
        stepped = [p for g in trainer.optimizer.param_groups for p in g["params"]]
        assert all(p.dtype == torch.float32 for p in stepped)
        if engine == "fsdp2":  # every matrix sharded; vectors whole fp32 (summed by the GradReducer)
            assert all(bool(fsdp_axes(p)) == (p.dim() >= 2) for p in stepped)
            assert set(seen) == {(torch.bfloat16, torch.bfloat16)}, seen
        trainer.grad_sync.remove()
        curves[engine] = losses
    return curves


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_bf16_gathers_bf16_weights_over_fp32_masters(dist_pool, model_type):
    for curves in dist_pool.run(bf16_run, 4, model_type, dp=2):
        assert curves["fsdp2"][0] == pytest.approx(curves["ddp"][0], rel=5e-3), curves
        assert curves["fsdp2"] == pytest.approx(curves["ddp"], rel=2e-2), curves


@pytest.mark.parametrize("raw,match", [
    (dict(dp_engine="fsdp2", zero_stage=2), "'zero_stage' .* DeepSpeed key"),
    (dict(dp_engine="fsdp2", mp_grad_reduce="overlap"), "'mp_grad_reduce' .* inside FSDP"),
    (dict(dp_engine="zero1", mp_grad_reduce="fsdp"), "'mp_grad_reduce' is 'fsdp', which dp_engine 'zero1'"),
    (dict(dp_engine="fsdp2", tuning="lora"), "'dp_engine' .* tuning is 'lora'"),
    (dict(reshard_after_forward="never"), "'reshard_after_forward' applies to FSDP only"),
    (dict(dp_engine="fsdp2", reshard_after_forward="sometimes"), "default, always, never"),
    (dict(fsdp_grad_sync="last_micro_batch"), "'fsdp_grad_sync' applies to FSDP only"),
    (dict(dp_engine="fsdp2", fsdp_grad_sync="never"), "every_micro_batch, last_micro_batch"),
    (dict(dp_engine="fsdp3"), "ddp, zero1, deepspeed, fsdp2"),
])
def test_fsdp_config_is_validated(raw, match):
    with pytest.raises(ConfigError, match=match):
        GalaxyConfig.from_dict(raw)


def fp16_run(ctx):
    """float16 with dynamic loss scaling from a scale that overflows: FSDP's DTensor gradients are
    unscaled, checked and skipped alike on every rank; the curve follows ddp's within fp16 noise."""
    out = {}
    for engine in ("ddp", "fsdp2"):
        case = dict(plan="galaxy2", dp_size=2, dtype="float16", initial_loss_scale=2.0 ** 18, max_steps=6)
        if engine == "fsdp2":
            case.update(dp_engine="fsdp2", mp_grad_reduce="fsdp")
        cfg, _, model, _, batch_at = build_overriding_train(ctx, case)
        result = train(model, batch_at, cfg, ctx)
        out[engine] = result.losses, result.skipped_steps
    return out


def test_fp16_loss_scaling(dist_pool):
    for out in dist_pool.run(fp16_run, 4, dp=2):
        (ref, ref_skipped), (got, skipped) = out["ddp"], out["fsdp2"]
        assert skipped == ref_skipped >= 1 and skipped < len(got), out
        assert got == pytest.approx(ref, rel=1e-2), out
