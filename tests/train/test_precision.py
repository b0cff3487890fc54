"""Mixed precision and step hygiene: bf16 tracks fp32, fp16 loss scaling survives overflows (one
rank's included) with every rank skipping the same steps, non-finite losses are stopped with the
offending module's name or skipped, gradient reduction in the compute dtype, SGD."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.layers import GradRule, grad_rule
from galaxy.models import build_model
from galaxy.train.loop import NonFiniteError, Trainer, train
from galaxy.train.interrupts import Interrupts, TrainingInterrupted
from galaxy.train.options import Checkpointing, Reporting
from galaxy.data.pretraining import mlm_data

SMALL = {"model": {"preset": "bert-tiny", "vocab_size": 300, "hidden_size": 32, "num_attention_heads": 4,
                   "intermediate_size": 64, "num_hidden_layers": 2},
         "train": {"global_batch_size": 8, "seq_length": 32, "max_steps": 200, "lr": 5e-3, "warmup_steps": 10}}


def run(ctx, overrides: dict, metrics: str | None = None, steps: int | None = None, prepare=None):
    cfg = GalaxyConfig.from_dict(SMALL, dict(overrides, **({"max_steps": steps} if steps else {})))
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    if prepare is not None:
        prepare(model, ctx)
    result = train(model, mlm_data(cfg)[0], cfg, ctx, reporting=Reporting(metrics_file=metrics))
    return result, model


def records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_bf16_with_fp32_master_weights_tracks_the_fp32_loss_curve():
    """Tolerance: over 200 steps of the tiny model, no step's bf16 loss is more than 0.02 from the
    fp32 loss (the curve falls by ~0.5 meanwhile); the parameters stay fp32."""
    curves = {}
    for dtype in ("float32", "bfloat16"):
        result, model = run(ParallelContext.serial("cpu"), {"dtype": dtype})
        assert all(p.dtype == torch.float32 for p in model.parameters())
        curves[dtype] = result.losses
    fp32, bf16 = curves["float32"], curves["bfloat16"]
    assert fp32[0] - min(fp32[-10:]) > 0.3, "the curve should fall"
    gap = max(abs(a - b) for a, b in zip(fp32, bf16))
    assert gap < 0.02, f"bf16 strays {gap:.4f} from fp32"
    assert bf16 != fp32, "bf16 should actually compute in bf16"


def fp16_with_overflows(ctx, metrics: str, poison_step: int):
    """float16 starting at a scale that overflows, plus one overflow injected on the last mp rank
    only (a sharded gradient made infinite at ``poison_step``)."""
    step = {"n": 0}

    def prepare(model, ctx):
        sharded = next(p for p in model.parameters() if grad_rule(p) == GradRule.SHARDED) if ctx.mp.size > 1 \
            else next(iter(model.parameters()))
        if ctx.mp.rank == ctx.mp.size - 1:
            sharded.register_hook(lambda g: g * float("inf") if step["n"] == poison_step else g)

        def count(module, args):
            step["n"] += 1 if module.training else 0
        model.register_forward_pre_hook(count)

    result, model = run(ctx, {"dtype": "float16", "initial_loss_scale": 2.0 ** 24, "loss_scale_window": 5,
                              "plan": "galaxy" if ctx.mp.size > 1 else "none"},
                        metrics if ctx.rank == 0 else None, steps=30, prepare=prepare)
    replicated = {n: p.detach().clone() for n, p in model.named_parameters() if grad_rule(p) != GradRule.SHARDED}
    return result.losses, result.skipped_steps, replicated


@pytest.mark.parametrize("world", [1, 2])
def test_fp16_loss_scaling_survives_overflow_on_every_rank_alike(dist_pool, tmp_path, world):
    metrics = str(tmp_path / "metrics.jsonl")
    out = dist_pool.run(fp16_with_overflows, world, metrics, 20)
    rows = records(metrics)
    skipped = [r["step"] for r in rows if r.get("skipped")]
    scales = [r["loss_scale"] for r in rows]
    assert skipped[0] == 1 and scales[1] == scales[0] / 2, "the first scale overflows and is halved"
    assert 20 in skipped, "the overflow injected on one rank skips the step everywhere"
    assert any(b == 2 * a for a, b in zip(scales, scales[1:])), "the scale grows back after clean steps"
    assert all(r["skipped"] == "overflow" for r in rows if r.get("skipped"))
    losses, count, params = out[0]
    assert count == len(skipped) and all(o[1] == count for o in out), "every rank skipped the same steps"
    assert all(torch.isfinite(torch.tensor(losses)))
    assert min(losses[-5:]) < losses[0] - 0.05, "training goes on and learns"
    for other in out[1:]:
        assert all(torch.equal(params[n], other[2][n]) for n in params), "replicated weights stay identical"


class PoisonAt:
    """A test hook that makes one module's output infinite at training step ``at`` (1-based) and
    in any replay of it (the forward that follows in eval mode)."""

    def __init__(self, model, module: str, at: int):
        self.steps, self.at = 0, at
        model.register_forward_pre_hook(self.count)
        names = dict(model.named_modules())
        if module in names:  # on a pipeline, only the stage that holds it
            names[module].register_forward_hook(self.poison)

    def count(self, module, args):
        if module.training:
            self.steps += 1

    def poison(self, module, args, output):
        return output * float("inf") if self.steps == self.at else output


TARGET = "bert.encoder.layer.1.intermediate.dense"


def nonfinite_stops(ctx):
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": "galaxy" if ctx.mp.size > 1 else "none", "max_steps": 5,
                                         "pp_size": ctx.pp.size})
    ctx.stage_layers = cfg.stage_layers()
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    PoisonAt(model, TARGET, at=3)
    with pytest.raises(NonFiniteError) as err:
        train(model, mlm_data(cfg)[0], cfg, ctx)
    return str(err.value)


def nonfinite_skipped(ctx):
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": "galaxy" if ctx.mp.size > 1 else "none", "max_steps": 3,
                                         "skip_nonfinite": True, "warmup_steps": 0})
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    poison = PoisonAt(model, TARGET, at=2)
    trainer = Trainer(model, cfg, ctx)
    batch_at = mlm_data(cfg)[0]
    snapshots, outcomes = [], []
    for step in range(3):
        loss = trainer.forward_backward(trainer.read_batch(batch_at, step))
        outcomes.append(trainer.optimizer_step(loss, step + 1).skipped)
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert poison.steps == 3
    unchanged = all(torch.equal(snapshots[0][n], snapshots[1][n]) for n in snapshots[0])
    changed = not all(torch.equal(snapshots[1][n], snapshots[2][n]) for n in snapshots[0])
    return outcomes, unchanged, changed, trainer.schedule.last_epoch


@pytest.mark.parametrize("world", [1, 2])
def test_nonfinite_loss_stops_naming_step_and_module(dist_pool, world):
    for message in dist_pool.run(nonfinite_stops, world):
        assert "non-finite loss" in message and "at step 3" in message, message
        assert f"module '{TARGET}'" in message, message
        assert "skip_nonfinite" in message


def test_nonfinite_loss_stops_on_a_pipeline_naming_the_stage(dist_pool):
    for message in dist_pool.run(nonfinite_stops, 2, pp=2):
        assert f"module '{TARGET}' (pipeline stage 1)" in message and "at step 3" in message, message


def test_skip_nonfinite_skips_the_step_and_goes_on(dist_pool):
    for outcomes, unchanged, changed, schedule_steps in dist_pool.run(nonfinite_skipped, 2):
        assert outcomes == [None, "nonfinite", None]
        assert unchanged, "a skipped step changes no parameter"
        assert changed, "the next step trains again"
        assert schedule_steps == 2, "the schedule advances only on real updates"


class PoisonBatch:
    """A test hook that makes one module's output infinite whenever the model runs on one batch (its
    ``input_ids``): in training and in any replay of that batch, whenever it comes."""

    def __init__(self, model, module: str, input_ids: torch.Tensor):
        self.ids, self.active = input_ids, False
        model.register_forward_pre_hook(self.look, with_kwargs=True)
        dict(model.named_modules())[module].register_forward_hook(self.poison)

    def look(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.active = ids is not None and ids.shape == self.ids.shape and torch.equal(ids, self.ids)

    def poison(self, module, args, output):
        return output * float("inf") if self.active else output


def fused_trainer(cfg, poison_step=None):
    """A serial trainer (its own context: dropout streams start alike) stepping torch's fused AdamW (CPU kernels
    since torch 2.4; ``optimizer_implementation: fused``), as a GPU run does by default, so a CPU runs the deferred
    step (``Trainer.settle``); ``poison_step`` (1-based): that step's batch makes a non-finite output."""
    ctx = ParallelContext.serial("cpu")
    model = build_model(cfg, None, ctx)
    trainer = Trainer(model, cfg, ctx)
    assert trainer.optimizer.defaults["fused"]
    if poison_step is not None:
        PoisonBatch(model, TARGET, trainer.read_batch(mlm_data(cfg)[0], poison_step - 1)["input_ids"])
    return trainer


def steps_of(trainer, cfg, mode: str, steps: int = 3):
    """(each step's skipped, the parameters after each step) over ``steps`` steps: ``sync`` (the synchronous
    step), ``deferred`` (the update queued, then ``settle``), or ``ahead`` as the training loop runs a step that
    goes ahead (the next step's forward and backward queued before this step is settled; the last step does not)."""
    batch_at = mlm_data(cfg)[0]
    outcomes, params, queued = [], [], None

    def ends(outcome, loss, step):
        trainer.settle(outcome, loss, step)
        outcomes.append(outcome.skipped)
        params.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})

    for step in range(steps):
        loss = trainer.forward_backward(trainer.read_batch(batch_at, step))
        if queued is not None:
            ends(*queued)
            queued = None
        ahead = mode == "ahead" and step + 1 < steps
        outcome = trainer.optimizer_step(loss, step + 1, defer=mode != "sync", ahead=ahead)
        if ahead:
            queued = (outcome, loss, step + 1)
        else:
            ends(outcome, loss, step + 1)
    return outcomes, params


def test_a_fused_optimizer_skips_a_nonfinite_update_on_the_device_without_waiting_for_it():
    """With a fused optimizer the training loop steps without a device sync between backward and the update
    (``optimizer_step(defer=True)``: the kernels skip a non-finite update themselves, ``settle`` decides
    once the step's values are on the host), and a step may go ahead (``ahead=True``: the next step's forward and
    backward queued before it is settled): every step equals the synchronous step bit for bit (clipping and the
    warm-up schedule on); a non-finite loss stops the run with the synchronous step's message and no update made
    (a step gone ahead is replayed to find where); under ``skip_nonfinite`` the step is skipped, the schedule not
    advanced, and training goes on with the same parameters as the synchronous run."""
    cfg = GalaxyConfig.from_dict(SMALL, {"max_steps": 5, "grad_clip": 0.05, "warmup_steps": 2,
                                         "optimizer_implementation": "fused"})
    runs = {mode: fused_trainer(cfg) for mode in ("sync", "deferred", "ahead")}
    assert runs["deferred"].skips_on_device()
    after = {mode: steps_of(trainer, cfg, mode)[1] for mode, trainer in runs.items()}
    for mode in ("deferred", "ahead"):
        for a, b in zip(after[mode], after["sync"]):
            assert all(torch.equal(a[n], b[n]) for n in a), mode
        assert runs[mode].schedule.last_epoch == runs["sync"].schedule.last_epoch == 3
    assert not all(torch.equal(after["sync"][0][n], after["sync"][1][n]) for n in after["sync"][0])

    messages = {}
    for mode in ("sync", "deferred", "ahead"):
        trainer = fused_trainer(cfg, poison_step=2)
        with pytest.raises(NonFiniteError) as err:
            steps_of(trainer, cfg, mode)
        messages[mode] = str(err.value)
        assert trainer.optimizer.state[next(iter(trainer.params))]["step"].item() == 1, "no second update"
    assert messages["deferred"] == messages["ahead"] == messages["sync"]
    assert f"module '{TARGET}'" in messages["sync"] and "at step 2" in messages["sync"]

    skipping = GalaxyConfig.from_dict(SMALL, {"max_steps": 5, "grad_clip": 0.05, "skip_nonfinite": True,
                                              "optimizer_implementation": "fused"})
    results = {mode: steps_of(fused_trainer(skipping, poison_step=2), skipping, mode) for mode in ("sync", "ahead")}
    for mode, (outcomes, params) in results.items():
        assert outcomes == [None, "nonfinite", None], mode
        assert all(torch.equal(params[0][n], params[1][n]) for n in params[0]), "a skipped step changes nothing"
        assert not all(torch.equal(params[1][n], params[2][n]) for n in params[0]), "the next step trains again"
    assert all(torch.equal(a[n], b[n]) for a, b in zip(results["ahead"][1], results["sync"][1]) for n in a)


def test_the_loop_reads_each_step_after_queueing_the_next_and_trains_as_the_synchronous_loop(tmp_path):
    """``train`` with a fused optimizer: every step but the last, and those evaluated or saved after, goes ahead
    (its values read once the next step's forward and backward are queued): the same losses, records and
    parameters, bit for bit, as the same run saving after every step (so that no step goes ahead)."""
    cfg = GalaxyConfig.from_dict(SMALL, {"max_steps": 6, "optimizer_implementation": "fused", "eval_every": 4,
                                         "eval_iters": 1})

    def run(save_every=0, save_dir=None, interrupts=None, resume=None, untimed_steps=0):
        ctx = ParallelContext.serial("cpu")
        model = build_model(cfg, None, ctx)
        seen, forwards = [], []  # (step, loss) as each step ends, and how many training forwards had run by then

        def on_step(step, loss):
            seen.append((step, loss, len(forwards)))
            if interrupts is not None and step == 2:
                interrupts.caught = signal.SIGTERM  # as its handler notes one
        model.register_forward_pre_hook(lambda m, args: forwards.append(None) if m.training else None)
        metrics = tmp_path / f"metrics{save_every}{resume is not None}.jsonl"
        reporting = Reporting(metrics_file=str(metrics), untimed_steps=untimed_steps)
        result = train(model, mlm_data(cfg)[0], cfg, ctx, reporting,
                       Checkpointing(save_dir=save_dir, save_every=save_every, resume=resume),
                       eval_at=mlm_data(cfg)[0], on_step=on_step, interrupts=interrupts)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        timing = ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "mfu_causal", "peak_mem_mb")
        return (result.losses, seen, [{k: v for k, v in r.items() if k not in timing} for r in records],
                {n: p.detach().clone() for n, p in model.named_parameters()})

    ahead, synchronous = run(), run(save_every=1, save_dir=str(tmp_path / "every"))
    # steps 1-3 and 5 end after the next step's forward; 4 (evaluated) and 6 (the last) before any other
    assert [f for _, _, f in ahead[1]] == [2, 3, 4, 4, 6, 6] and [f for _, _, f in synchronous[1]] == [1, 2, 3, 4, 5, 6]
    assert [(s, loss) for s, loss, _ in ahead[1]] == [(s, loss) for s, loss, _ in synchronous[1]]
    assert ahead[0] == synchronous[0] and ahead[2] == synchronous[2] and "eval_loss" in ahead[2][3]
    assert all(torch.equal(ahead[3][n], synchronous[3][n]) for n in ahead[3])
    # with two untimed steps, step 2 (the warm-up's last: the steady state's clock starts at its end) ends before
    # step 3 is queued, and the run is the same
    warm = run(untimed_steps=2)
    assert [f for _, _, f in warm[1]] == [2, 2, 4, 4, 6, 6] and warm[0] == ahead[0]
    assert all(torch.equal(warm[3][n], ahead[3][n]) for n in ahead[3])

    # A signal noted while step 2 ends, with step 3 gone ahead: step 3 ends, is saved, and the run stops there;
    # resumed, it trains to the uninterrupted run's parameters.
    with pytest.raises(TrainingInterrupted) as stopped:
        run(save_dir=str(tmp_path / "stopped"), interrupts=Interrupts())
    assert stopped.value.step == 3 and stopped.value.checkpoint
    resumed = run(save_dir=str(tmp_path / "stopped"), resume=stopped.value.checkpoint)
    assert [s for s, _, _ in resumed[1]] == [4, 5, 6]
    assert all(torch.equal(resumed[3][n], ahead[3][n]) for n in ahead[3])


def ahead_against_synchronous(ctx, poisoned: bool):
    """``train`` on this layout with fused AdamW, its steps going ahead, and the same run evaluating after every
    step (so that none goes ahead): (forwards run as each step ended, per run; losses or the non-finite message,
    per run; whether the parameters agree bitwise). No dropout: the pool's context carries its dropout streams
    from one run to the next."""
    out = []
    for eval_every in (0, 1):
        cfg = GalaxyConfig.from_dict(SMALL, {"plan": "galaxy" if ctx.mp.size > 1 else "none", "max_steps": 4,
                                             "dp_size": ctx.dp.size, "pp_size": ctx.pp.size, "eval_every": eval_every,
                                             "eval_iters": 1, "optimizer_implementation": "fused",
                                             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
        ctx.stage_layers = cfg.stage_layers()
        model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
        batch_at = mlm_data(cfg)[0]
        if poisoned:
            PoisonBatch(model, TARGET, batch_at(1)["input_ids"])
        forwards, ended = [], []
        model.register_forward_pre_hook(lambda m, args: forwards.append(None) if m.training else None)
        try:
            result = train(model, batch_at, cfg, ctx, eval_at=batch_at if eval_every else None,
                           on_step=lambda step, loss: ended.append(len(forwards))).losses
        except NonFiniteError as e:
            result = str(e)
        out.append((ended, result, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (ahead_ended, ahead, ahead_params), (sync_ended, sync, sync_params) = out
    return ahead_ended, sync_ended, ahead, sync, all(torch.equal(ahead_params[n], sync_params[n]) for n in sync_params)


@pytest.mark.parametrize("world,dp,pp", [(2, 1, 1), (4, 2, 1), (2, 1, 2)], ids=["mp2", "dp2-mp2", "pp2"])
def test_steps_go_ahead_on_every_layout_as_the_synchronous_loop(dist_pool, world, dp, pp):
    """Every rank's steps go ahead alike (steps 1 and 3 end after the next step's forward; step 2, the last of the
    default two warm-up steps, before it) and the run equals
    the synchronous one bit for bit: losses, and every rank's parameters (mp collectives, dp gradient reduction,
    pipeline stages)."""
    for ahead_ended, sync_ended, ahead, sync, same in dist_pool.run(ahead_against_synchronous, world, False,
                                                                     dp=dp, pp=pp):
        assert ahead_ended == [2, 2, 4, 4] and sync_ended == [1, 2, 3, 4]
        assert ahead == sync and same


def test_a_nonfinite_step_gone_ahead_is_named_on_every_mp_rank_as_the_synchronous_loop_names_it(dist_pool):
    """Step 2's batch makes a non-finite output; gone ahead, step 2 is settled after step 3's forward (its
    gradients gone), so its replay names the module."""
    for ahead_ended, sync_ended, ahead, sync, _ in dist_pool.run(ahead_against_synchronous, 2, True):
        assert ahead_ended == [2] and sync_ended == [1]
        assert ahead == sync and f"module '{TARGET}'" in sync and "at step 2" in sync, (ahead, sync)


def reduce_in(ctx, dtype: str, reduce_dtype: str):
    cfg = GalaxyConfig.from_dict(SMALL, {"dp_size": 2, "dtype": dtype, "grad_reduce_dtype": reduce_dtype,
                                         "max_steps": 1})
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    trainer = Trainer(model, cfg, ctx)
    before = ctx.dp.bytes_sent  # the pool's communicators live on between tasks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainer.forward_backward(trainer.read_batch(mlm_data(cfg)[0], 0))
    trainer.grad_sync.remove()
    return ctx.dp.bytes_sent - before, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_reduce_in_the_compute_dtype_by_choice(dist_pool):
    fp32_bytes, fp32_grads = dist_pool.run(reduce_in, 2, "bfloat16", "float32", dp=2)[0]
    bf16_bytes, bf16_grads = dist_pool.run(reduce_in, 2, "bfloat16", "bfloat16", dp=2)[0]
    # the loss-target count and the reported loss (fp64 scalars) ride along with the gradient buckets
    assert abs(bf16_bytes * 2 - fp32_bytes) <= 32, (bf16_bytes, fp32_bytes)
    errors = {}
    for name, g in fp32_grads.items():
        assert bf16_grads[name].dtype == torch.float32, "master gradients stay fp32"
        errors[name] = ((bf16_grads[name] - g).norm() / g.norm().clamp(min=1e-30)).item()
        assert errors[name] < 1e-2, f"{name}: bf16 reduction off by {errors[name]:.1e} (relative, whole tensor)"
    assert max(errors.values()) > 0, "the sums really travelled in bf16"


def test_sgd_matches_torch_sgd_on_the_serial_model():
    cfg = GalaxyConfig.from_dict(SMALL, {"optimizer": "sgd", "sgd_momentum": 0.9, "grad_clip": 0.0,
                                         "warmup_steps": 0, "lr_schedule": "constant", "weight_decay": 0.0})
    ctx = ParallelContext.serial("cpu")
    model = build_model(cfg, None, ctx)
    reference = build_model(cfg, None, ParallelContext.serial("cpu"))
    trainer = Trainer(model, cfg, ctx)
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    sgd = torch.optim.SGD(reference.parameters(), lr=cfg.train.lr, momentum=0.9)
    batch_at = mlm_data(cfg)[0]
    for step in range(3):
        loss = trainer.forward_backward(batch_at(step))
        trainer.optimizer_step(loss, step + 1)
        reference(**batch_at(step)).loss.backward()
        sgd.step()
        sgd.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_fp16_keys_are_validated():
    from galaxy.config import ConfigError

    for bad, key in (({"loss_scale": -1.0}, "loss_scale"), ({"grad_reduce_dtype": "float16"}, "grad_reduce_dtype"),
                     ({"initial_loss_scale": 0.5, "min_loss_scale": 1.0}, "initial_loss_scale")):
        with pytest.raises(ConfigError, match=key):
            GalaxyConfig.from_dict(SMALL, bad)


def test_fp16_resume_restores_the_loss_scale(tmp_path):
    overrides = {"dtype": "float16", "initial_loss_scale": 2.0 ** 20, "loss_scale_window": 3}

    def fresh(steps):
        cfg = GalaxyConfig.from_dict(SMALL, dict(overrides, max_steps=steps))
        ctx = ParallelContext.serial("cpu")
        return cfg, ctx, build_model(cfg, None, ctx)

    cfg, ctx, model = fresh(8)
    whole = train(model, mlm_data(cfg)[0], cfg, ctx, reporting=Reporting(metrics_file=str(tmp_path / "whole.jsonl")))
    cfg, ctx, model = fresh(4)
    train(model, mlm_data(cfg)[0], cfg, ctx, checkpointing=Checkpointing(save_dir=str(tmp_path / "ckpt"), save_every=4))
    cfg, ctx, model = fresh(8)
    resumed = train(model, mlm_data(cfg)[0], cfg, ctx,
                    reporting=Reporting(metrics_file=str(tmp_path / "resumed.jsonl")),
                    checkpointing=Checkpointing(resume=str(tmp_path / "ckpt")))
    assert resumed.losses == whole.losses[4:]
    scales = [r["loss_scale"] for r in records(str(tmp_path / "whole.jsonl"))]
    assert [r["loss_scale"] for r in records(str(tmp_path / "resumed.jsonl"))] == scales[4:]
    assert len(set(scales)) > 1, "the scale moved during the run"


def test_dynamic_loss_scale_halves_on_overflow_doubles_after_a_clean_window_and_stops_at_the_floor():
    """``galaxy.train.precision.LossScaler`` on its own: the scale after a run of steps is the initial
    scale times 2 per clean window and / 2 per overflow (a window counts from the last overflow), never
    below ``min_loss_scale``; a static scale never moves; the state round-trips."""
    from galaxy.config import TrainConfig
    from galaxy.train.precision import LossScaler

    scaler = LossScaler(TrainConfig(initial_loss_scale=8.0, loss_scale_window=3, min_loss_scale=2.0))
    seen = []
    for overflow in [False, False, True, False, False, False, False, True, True, True, False]:
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == [8, 8, 4, 4, 4, 8, 8, 4, 2, 2, 2]
    resumed = LossScaler(TrainConfig(initial_loss_scale=8.0, loss_scale_window=3, min_loss_scale=2.0))
    resumed.load_state_dict(scaler.state_dict())
    for s in (scaler, resumed):
        s.update(False)
        s.update(False)
    assert scaler.scale == resumed.scale == 4  # the clean step before the save counts toward the window
    static = LossScaler(TrainConfig(loss_scale=128.0))
    static.update(True)
    assert static.scale == 128.0
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([128.0, -3.0, 1e-30])
    static.unscale_([p, torch.nn.Parameter(torch.ones(1))])  # one without a gradient is passed over
    assert torch.equal(p.grad, torch.tensor([1.0, -3.0 / 128, 1e-30 / 128]))


def test_the_first_nonfinite_module_in_call_order_is_named():
    from galaxy.train.precision import first_nonfinite_module, first_nonfinite_parameter

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    with torch.no_grad():
        model[1][0].bias[1] = float("inf")
    assert first_nonfinite_parameter(model, grads=False) == "1.0.bias"
    assert first_nonfinite_module(model, lambda: model(torch.ones(1, 2))) == "1.0"
    assert not any(m._forward_hooks for m in model.modules())  # the hooks are removed
    assert first_nonfinite_parameter(model, grads=True) is None  # no gradients yet
