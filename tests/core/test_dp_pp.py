"""Data and pipeline parallelism around the mp plans, on 4 CPU/Gloo processes, equal to the serial
model in float64: the reported loss, every parameter's gradient (after the dp sum, the mp rules and
the tied-embedding sum) and the gradient norm on each of 3 steps, and every parameter after the 3
clipped AdamW steps. Every pipeline case runs on both pipeline engines (torch.distributed.pipelining's
schedules and Galaxy's own). Plus the schedules' activation memory, the rank layout, the stage split."""

import pytest
import torch

from galaxy.config import KEY_SECTION, GalaxyConfig
from galaxy.core.context import ParallelContext, rank_of
from galaxy.core.grad_sync import gather_full
from galaxy.core.pipeline import PipelineRunner, StageLayers, schedule_actions
from galaxy.core.pipeline_torch import TorchPipelineRunner
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.train.loop import DeepSpeedTrainer, Trainer, autocast_context, train
from galaxy.train.microbatch import split_rows
from galaxy.data.pretraining import mlm_data

BERT = dict(vocab_size=64, hidden_size=24, num_hidden_layers=4, num_attention_heads=6, intermediate_size=40,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=40, hidden_act="silu", max_position_embeddings=32,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.1, pad_token_id=None)
# Small dp buckets, so each step's backward launches several of them before it ends.
TRAIN = dict(seq_length=12, global_batch_size=8, lr=1e-2, warmup_steps=0, weight_decay=0.01, grad_clip=0.5,
             dtype="float64", seed=7, dp_bucket_mb=0.004)
RTOL = 1e-9
STEPS = 3


def rel_err(a, b, floor=1e-6):
    return ((a - b).norm() / b.norm().clamp(min=floor)).item()


def llama_batch_at(step):
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, LLAMA["vocab_size"], (TRAIN["global_batch_size"], TRAIN["seq_length"]), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = torch.where(mask.bool() & (torch.rand(ids.shape, generator=g) < 0.7), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def build(ctx, case):
    model_raw = LLAMA if case.get("model") == "llama" else BERT
    extra = {k: v for k, v in case.items() if k != "model"}
    cfg = GalaxyConfig.from_dict(dict(model_raw, **TRAIN, **extra))
    serial_cfg = GalaxyConfig.from_dict(dict(model_raw, **TRAIN, **{k: v for k, v in extra.items()
                                                                       if KEY_SECTION[k] in ("model", "train")
                                                                       and not k.startswith("compile")}))
    ctx.stage_layers = cfg.stage_layers()
    cls = LlamaForCausalLM if case.get("model") == "llama" else BertForMaskedLM
    model = cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11)
    serial = cls(serial_cfg.model, seed=11)
    batch_at = llama_batch_at if case.get("model") == "llama" else mlm_data(cfg)[0]
    return cfg, serial_cfg, model, serial, batch_at


def compare_with_serial(ctx, case):
    cfg, serial_cfg, model, serial, batch_at = build(ctx, case)
    # DeepSpeed ZeRO keeps fp32 gradient partitions and fp32 master weights even for a float64 model.
    RTOL = 2e-5 if cfg.parallel.dp_engine == "deepspeed" else globals()["RTOL"]
    assert (ctx.dp.size, ctx.pp.size) == (cfg.parallel.dp_size, cfg.parallel.pp_size)
    if cfg.parallel.dp_engine == "deepspeed":  # DeepSpeed's CPU accelerator runs ZeRO 1/2 over Gloo
        par = DeepSpeedTrainer(model, cfg, ctx, require_cuda=False)
    else:
        par = Trainer(model, cfg, ctx)
    ref = Trainer(serial, serial_cfg, ParallelContext.serial())
    grads_s = dict(serial.named_parameters())
    for step in range(STEPS):
        loss_t, loss_st = par.forward_backward(par.read_batch(batch_at, step)), ref.forward_backward(batch_at(step))
        loss, loss_s = loss_t.item(), loss_st.item()
        assert abs(loss - loss_s) <= RTOL * abs(loss_s), (step, loss, loss_s)
        for name, p in model.named_parameters():
            grad = p.grad
            if isinstance(par, DeepSpeedTrainer):  # ZeRO keeps the reduced gradients in its own buffers
                from deepspeed.utils import safe_get_full_grad

                grad = safe_get_full_grad(p)
            err = rel_err(gather_full(grad, p, ctx.mp), grads_s[name].grad)
            assert err < RTOL, f"step {step}: grad of {name}: relative error {err:.2e}"
        norm, norm_s = par.optimizer_step(loss_t, step + 1).grad_norm, ref.optimizer_step(loss_st, step + 1).grad_norm
        assert abs(norm.item() - norm_s.item()) <= RTOL * norm_s.item(), (step, norm.item(), norm_s.item())
        assert norm_s.item() > cfg.train.grad_clip, "the test should exercise clipping"
        if ctx.dp.size > 1 and not isinstance(par, DeepSpeedTrainer):
            assert par.grad_sync.overlapped > 0, "dp buckets are sent while backward runs"
    params_s = dict(serial.named_parameters())
    for name, p in model.named_parameters():
        floor = 0.02 * params_s[name].numel() ** 0.5
        err = rel_err(gather_full(p.detach(), p, ctx.mp), params_s[name].detach(), floor)
        assert err < RTOL, f"{name} after {STEPS} AdamW steps: relative error {err:.2e}"
    par.grad_sync.remove()
    return (sorted(n for n, _ in model.named_parameters()), sorted(params_s), par.last_step.order,
            type(par.runner).__name__)


CASES = {
    "dp4": dict(dp_size=4),
    "dp2-galaxy2": dict(dp_size=2, plan="galaxy"),
    "dp2-galaxy2-uneven-zero1-m2": dict(dp_size=2, plan="galaxy", seq_scatter_list=[7, 5],
                                        dp_engine="zero1", num_microbatches=2),
    "pp2-gpipe": dict(pp_size=2, num_microbatches=4, pipeline_schedule="gpipe"),
    "pp2-1f1b": dict(pp_size=2, num_microbatches=4, pipeline_schedule="1f1b"),
    "pp3-uneven-gpipe": dict(pp_size=3, stage_num_hidden_layers_list=[1, 2, 1], num_microbatches=2,
                             pipeline_schedule="gpipe"),
    "pp3-uneven-1f1b": dict(pp_size=3, stage_num_hidden_layers_list=[2, 1, 1], num_microbatches=4,
                            pipeline_schedule="1f1b"),
    "pp2-galaxy2-1f1b": dict(pp_size=2, plan="galaxy", stage_num_hidden_layers_list=[3, 1], num_microbatches=4),
    "pp2-tp2-gpipe": dict(pp_size=2, plan="tp", num_microbatches=2, pipeline_schedule="gpipe"),
    "dp2-pp2-1f1b": dict(dp_size=2, pp_size=2, num_microbatches=2),
    "llama-pp2-galaxy2-tied": dict(model="llama", pp_size=2, plan="galaxy", tie_word_embeddings=True,
                                   num_microbatches=2),
    "llama-dp2-pp2-untied": dict(model="llama", dp_size=2, pp_size=2, num_microbatches=4),
}
WORLD = {"pp2-gpipe": 2, "pp2-1f1b": 2, "pp3-uneven-gpipe": 3, "pp3-uneven-1f1b": 3}


ENGINE_RUNNERS = {"torch": "TorchPipelineRunner", "galaxy": "PipelineRunner"}
RUNS = [(name, engine) for name, case in CASES.items()
        for engine in (ENGINE_RUNNERS if case.get("pp_size", 1) > 1 else ["galaxy"])]


@pytest.mark.parametrize("name,engine", RUNS, ids=[f"{name}-{engine}" for name, engine in RUNS])
def test_dp_pp_equal_serial(dist_pool, name, engine):
    case = dict(CASES[name], pipeline_engine=engine)
    world = WORLD.get(name, 4)
    out = dist_pool.run(compare_with_serial, world, case, dp=case.get("dp_size", 1), pp=case.get("pp_size", 1))
    held = set().union(*(set(names) for names, _, _, _ in out))
    assert held == set(out[0][1]), "the stages together hold every parameter of the serial model"
    if case.get("pp_size", 1) > 1:
        assert {runner for _, _, _, runner in out} == {ENGINE_RUNNERS[engine]}
        schedule = case.get("pipeline_schedule", "1f1b")
        mp = world // (case.get("dp_size", 1) * case["pp_size"])
        for rank, (_, _, order, _) in enumerate(out):
            stage = (rank // mp) % case["pp_size"]
            assert order == schedule_actions(schedule, stage, case["pp_size"], case["num_microbatches"])


def test_torch_engine_runs_gpipe_when_1f1b_has_fewer_micro_batches_than_stages(dist_pool):
    """torch's Schedule1F1B needs a micro-batch per stage: with 2 on 3 stages the step is GPipe's, still serial."""
    case = dict(pp_size=3, num_microbatches=2, pipeline_schedule="1f1b", pipeline_engine="torch")
    out = dist_pool.run(compare_with_serial, 3, case, pp=3)
    for stage, (_, _, order, runner) in enumerate(out):
        assert runner == "TorchPipelineRunner" and order == schedule_actions("gpipe", stage, 3, 2)


def compare_with_serial_without_deepspeed_ops(ctx, case):
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at init (minutes of C++ on two cores,
    longer than a pool task may wait) that ZeRO over Gloo never calls; its cached table of compatible ops,
    set empty before the first probe, tells it to build none."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}
    return compare_with_serial(ctx, case)


def test_deepspeed_zero2_equals_serial():
    """``dp_engine: deepspeed`` (the CLIs refuse it on CPU, but DeepSpeed's CPU accelerator runs ZeRO
    over Gloo). In a pool of its own, so importing deepspeed touches no other test's processes;
    to fp32 accuracy, as ZeRO keeps fp32 gradient partitions and master weights."""
    from tests.dist_pool import DistPool

    pool = DistPool(2)
    try:
        case = dict(dp_size=2, dp_engine="deepspeed", zero_stage=2, num_microbatches=2)
        pool.run(compare_with_serial_without_deepspeed_ops, 2, case, dp=2)
    finally:
        pool.close()


def train_curve(ctx, case):
    cfg, serial_cfg, model, serial, batch_at = build(ctx, dict(case, max_steps=STEPS))
    result = train(model, batch_at, cfg, ctx)
    expected = train(serial, batch_at, serial_cfg, ParallelContext.serial()).losses
    return result.losses, expected, result.summary()


def test_train_loop_reports_the_serial_loss_on_every_rank(dist_pool):
    case = dict(dp_size=2, pp_size=2, num_microbatches=2, pipeline_schedule="gpipe")
    out = dist_pool.run(train_curve, 4, case, dp=2, pp=2)
    for losses, expected, summary in out:
        assert losses == out[0][0], "rank 0 and every other rank report the same loss"
        assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(losses, expected)), (losses, expected)
        assert summary["bubble_analytic"] == round(1 / 3, 4) and len(summary["bubble_measured_per_stage"]) == 2


# ----------------------------------------------------------------------------- schedules


class SavedCounter:
    """Counts the tensors autograd saves for backward that are still alive."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, t):
        counter = self

        class Held:
            def __init__(self):
                self.t = t
                counter.live += 1
                counter.peak = max(counter.peak, counter.live)

            def __del__(self):
                counter.live -= 1

        return Held()

    @staticmethod
    def unpack(held):
        return held.t


def saved_activations(ctx, schedule, m, runner_class=PipelineRunner):
    cfg = GalaxyConfig.from_dict(dict(BERT, **TRAIN, pp_size=ctx.pp.size, num_microbatches=m))
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=1).double()
    micro = split_rows(mlm_data(cfg)[0](0), m)
    runner = runner_class(model, ctx, schedule)
    counter = SavedCounter()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        result = runner.run(micro, [1.0 / m] * m)
    assert counter.live == 0, "every saved activation is freed by the end of the step"
    return counter.peak, result.peak_in_flight


@pytest.mark.parametrize("runner_class", [TorchPipelineRunner, PipelineRunner])
def test_1f1b_holds_at_most_pp_size_microbatches_gpipe_all(dist_pool, runner_class):
    p, m = 4, 8
    for stage in range(p):
        one_f_one_b = schedule_actions("1f1b", stage, p, m)
        assert sorted(one_f_one_b) == sorted(schedule_actions("gpipe", stage, p, m))
    per_mb = [peak for peak, _ in dist_pool.run(saved_activations, p, "gpipe", 1, runner_class, pp=p)]
    gpipe = dist_pool.run(saved_activations, p, "gpipe", m, runner_class, pp=p)
    ofob = dist_pool.run(saved_activations, p, "1f1b", m, runner_class, pp=p)
    for s in range(p):
        assert per_mb[s] > 0
        assert gpipe[s] == (m * per_mb[s], m), f"stage {s}: GPipe holds all {m} micro-batches"
        assert ofob[s] == ((p - s) * per_mb[s], p - s), f"stage {s}: 1F1B holds p - s micro-batches"
        assert ofob[s][1] <= p


# ----------------------------------------------------------------------------- layout and stages


def test_rank_layout_keeps_mp_ranks_adjacent():
    dp, pp, mp = 2, 2, 2
    ranks = [[[rank_of(d, p, m, pp, mp) for m in range(mp)] for p in range(pp)] for d in range(dp)]
    assert ranks == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def stage_names(ctx):
    cfg = GalaxyConfig.from_dict(dict(BERT, **TRAIN, pp_size=2, plan="tp", stage_num_hidden_layers_list=[1, 3]))
    ctx.stage_layers = cfg.stage_layers()
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=1)
    layers = model.bert.encoder.layer
    indices = [int(n.split(".")[3]) for n, _ in model.named_parameters() if n.startswith("bert.encoder.layer.")]
    if ctx.pp.rank == 1:
        assert isinstance(layers, StageLayers) and layers[1] is layers[-3] and layers[3] is layers[-1]
        with pytest.raises(IndexError, match="holds layers 1..3, not 0"):
            layers[0]
    heads = {n.split(".")[0] for n, _ in model.named_parameters()}
    return sorted(set(indices)), sorted(heads), model.bert.embeddings is not None


def test_stages_keep_hf_layer_names(dist_pool):
    first0, first1, last0, last1 = dist_pool.run(stage_names, 4, pp=2)
    assert first0 == first1 == ([0], ["bert"], True)
    assert last0 == last1 == ([1, 2, 3], ["bert", "cls"], True)  # the last stage holds the tied word embeddings


def stage_state_round_trip(ctx, model_type):
    raw = dict(LLAMA, tie_word_embeddings=True) if model_type == "llama" else BERT
    cfg = GalaxyConfig.from_dict(dict(raw, **TRAIN, pp_size=2, plan="galaxy", stage_num_hidden_layers_list=[3, 1]))
    ctx.stage_layers = cfg.stage_layers()
    cls = LlamaForCausalLM if model_type == "llama" else BertForMaskedLM
    serial = cls(cfg.model, seed=1).full_state_dict()
    stage = cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=2)
    stage.load_full_state_dict(serial)
    merged = stage.full_state_dict()
    assert merged.keys() == serial.keys()
    assert all(torch.equal(merged[k], serial[k]) for k in serial)
    return len(merged)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_stages_load_and_gather_full_state_dicts(dist_pool, model_type):
    assert len(set(dist_pool.run(stage_state_round_trip, 4, model_type, pp=2))) == 1


# ----------------------------------------------------------------------------- the two engines


def one_bf16_step(ctx, engine):
    cfg = GalaxyConfig.from_dict(dict(LLAMA, **dict(TRAIN, dtype="bfloat16"), pp_size=2, plan="galaxy",
                                      num_microbatches=2, pipeline_engine=engine))
    ctx.stage_layers = cfg.stage_layers()
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11)
    trainer = Trainer(model, cfg, ctx)
    assert type(trainer.runner).__name__ == ENGINE_RUNNERS[engine]
    sent = ctx.pp.bytes_sent
    loss = trainer.forward_backward(trainer.read_batch(llama_batch_at, 0), lambda: autocast_context(cfg, ctx.device))
    sent = ctx.pp.bytes_sent - sent
    trainer.grad_sync.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, sent, cfg


def engines_agree_under_bf16_autocast(ctx):
    (loss_g, grads_g, sent_g, cfg), (loss_t, grads_t, sent_t, _) = (one_bf16_step(ctx, e) for e in ("galaxy", "torch"))
    assert loss_t == loss_g, (loss_t, loss_g)
    assert grads_t.keys() == grads_g.keys() and grads_g
    for name, g in grads_g.items():
        assert torch.equal(grads_t[name], g), f"gradient of {name} differs between the engines"
    # The stream between the stages travels in fp32 (the parameters' dtype), not autocast's bf16: on this
    # mp rank, the sequence shard of every row, once forward (stage 0) or backward (stage 1); the other 8
    # bytes are the reported loss's float64 broadcast over pp (counted on every rank).
    rows, seq = cfg.train.global_batch_size, cfg.resolve_plan(ctx.mp.size).seq_split[ctx.mp.rank]
    stream = rows * seq * cfg.model.hidden_size * 4
    assert sent_t == sent_g == stream + 8, (sent_t, sent_g, stream)
    return True


def test_torch_and_galaxy_engines_agree_bit_for_bit_under_bf16_autocast(dist_pool):
    """The same step on both engines under bf16 autocast (pp2 x galaxy mp2, LLaMA): the same loss and
    gradients to the bit (the same ops in the same order, only the scheduler differs), fp32 between stages."""
    assert all(dist_pool.run(engines_agree_under_bf16_autocast, 4, pp=2))


def hook_weights_and_scale(ctx):
    m, weights = 4, [0.1, 0.2, 0.3, 0.4]
    cfg = GalaxyConfig.from_dict(dict(BERT, **TRAIN, pp_size=2, num_microbatches=m))
    ctx.stage_layers = cfg.stage_layers()
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=1).double()
    micro = split_rows(mlm_data(cfg)[0](0), m)
    first = next(model.parameters())
    accumulated = [0]
    first.register_post_accumulate_grad_hook(lambda p: accumulated.__setitem__(0, accumulated[0] + 1))
    out = {}
    for runner_class, scale in ((PipelineRunner, None), (TorchPipelineRunner, None), (TorchPipelineRunner, 4.0)):
        model.zero_grad(set_to_none=True)
        accumulated[0], armed = 0, []
        result = runner_class(model, ctx, "1f1b").run(micro, weights, grad_scale=scale,
                                                      before_last_backward=lambda: armed.append(accumulated[0]))
        assert armed == [m - 1] and accumulated[0] == m, "the hook runs once, right before the last backward"
        out[runner_class.__name__, scale] = result.loss, {n: p.grad.clone() for n, p in model.named_parameters()}
    (loss_g, grads_g), (loss_t, grads_t), (loss_s, grads_s) = out.values()
    if ctx.pp.rank == 1:
        assert loss_t == loss_g == loss_s, "the loss is the weighted sum, unscaled"
    else:
        assert loss_t is loss_g is loss_s is None
    for name, g in grads_g.items():
        assert torch.equal(grads_t[name], g) and torch.equal(grads_s[name], 4 * g), name
    # One runner, then shorter sequences in fewer micro-batches: torch's stage is built again for the new shapes.
    runner, short = TorchPipelineRunner(model, ctx, "gpipe"), split_rows({k: v[:, :8] for k, v in
                                                                          mlm_data(cfg)[0](1).items()}, 2)
    grads = []
    for run in (lambda: runner.run(micro, weights), lambda: runner.run(short, [0.5, 0.5]),
                lambda: PipelineRunner(model, ctx, "gpipe").run(short, [0.5, 0.5])):
        model.zero_grad(set_to_none=True)
        run()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[1][n], grads[2][n]) for n in grads[2])
    return True


def test_torch_engine_weights_losses_scales_backward_and_arms_the_sync_before_the_last_backward(dist_pool):
    """Loss weights, float16's loss scale (backward only) and before_last_backward on torch's schedule,
    against Galaxy's runner on the same micro-batches."""
    assert all(dist_pool.run(hook_weights_and_scale, 2, pp=2))
