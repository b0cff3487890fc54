"""Checkpoints: exact resume (dropout on), resharding between plans, world sizes and optimizers,
corrupt and interrupted saves, pruning, HF export, format 1 checkpoints, async saves, DCP's own reader,
what each rank verifies when it loads.

The steps are driven by a small local loop built from the pieces the real loop uses
(``build_optimizer``, ``lr_lambda``, ``GradientSync``, ``clip_grad_norm``, ``mlm_data``), so these
tests do not depend on the ``Trainer`` API, but for the last, whose pipeline stages train through the
``Trainer`` (tests/train/checkpoint/helpers.py)."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.grad_sync import GradientSync, clip_grad_norm
from galaxy.models.bert import BertForMaskedLM
from galaxy.train.checkpoint import files as ckpt_files
from galaxy.train.checkpoint import legacy
from galaxy.train.checkpoint import (CheckpointError, export_hf, latest_valid_checkpoint, load_checkpoint, prune,
                                     save_checkpoint)
from galaxy.train.loop import Trainer, build_optimizer, lr_lambda, train
from galaxy.train.options import Checkpointing
from galaxy.data.pretraining import mlm_data
from tests.train.checkpoint.helpers import STEPS, build, run_steps

SMALL = {"model": {"preset": "bert-tiny", "vocab_size": 300, "hidden_size": 32, "num_attention_heads": 4,
                   "intermediate_size": 64, "num_hidden_layers": 2, "hidden_dropout_prob": 0.1,
                   "attention_probs_dropout_prob": 0.1},
         "train": {"global_batch_size": 4, "seq_length": 24, "max_steps": 10, "lr": 2e-3, "warmup_steps": 2}}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
TP3_UNEVEN = {"plan": "tp", "tp_num_attention_heads_list": [2, 1, 1], "tp_intermediate_size_list": [30, 20, 14]}


@dataclasses.dataclass
class Run:
    ctx: ParallelContext
    cfg: GalaxyConfig
    model: BertForMaskedLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sync: GradientSync
    batch_at: object

    @classmethod
    def fresh(cls, ctx: ParallelContext, overrides: dict) -> "Run":
        """Everything built anew, as a restarted process would: model, optimizer, schedule and the
        context's dropout streams (a copy of ``ctx`` with no generators yet)."""
        cfg = GalaxyConfig.from_dict(SMALL, overrides)
        ctx = ctx.with_fresh_streams()
        model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=cfg.train.seed)
        optimizer = build_optimizer(model, cfg, ctx)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        sync = GradientSync([p for p in model.parameters() if p.requires_grad], ctx.mp)
        return cls(ctx, cfg, model, optimizer, scheduler, sync, mlm_data(cfg)[0])

    def steps(self, start: int, stop: int) -> list[float]:
        """Optimizer steps ``start..stop-1`` (0-based); returns their losses."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        losses = []
        self.model.train()
        for step in range(start, stop):
            loss = self.model(**self.batch_at(step)).loss
            loss.backward()
            self.sync()
            clip_grad_norm(params, self.cfg.train.grad_clip, self.ctx.mp)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    def save(self, directory: str, step: int, **kw) -> str:
        return save_checkpoint(directory, step, self.model, self.optimizer, self.scheduler, self.ctx, self.cfg, **kw)

    def load(self, path: str):
        return load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.ctx, self.cfg)


# ----------------------------------------------------------------------------- exact resume


def resume_is_exact(ctx, plan, directory):
    overrides = {"plan": plan}
    whole = Run.fresh(ctx, overrides)
    expected = whole.steps(0, 10)
    expected_params = whole.model.full_state_dict()

    first = Run.fresh(ctx, overrides)
    got = first.steps(0, 5)
    path = first.save(directory, 5, extra={"note": "half way"})
    del first

    second = Run.fresh(ctx, overrides)
    state = second.load(directory)  # the save directory: the newest valid checkpoint
    assert (state.step, state.path, state.extra) == (5, path, {"note": "half way"})
    got += second.steps(state.step, 10)
    assert got == expected, f"{plan}: resumed losses {got} != uninterrupted {expected}"
    params = second.model.full_state_dict()
    differ = [k for k in expected_params if not torch.equal(expected_params[k], params[k])]
    assert not differ, f"{plan}: parameters differ after resuming: {differ[:3]}"
    # the dropout streams matter: a resume that re-seeded them would not match
    assert whole.ctx.generators, "dropout drew from the context's streams"
    return got


@pytest.mark.parametrize("plan,world", [("none", 1), ("galaxy", 2), ("tp", 2)])
def test_resume_is_bit_identical(dist_pool, tmp_path, plan, world):
    losses = dist_pool.run(resume_is_exact, world, plan, str(tmp_path))
    assert all(l == losses[0] for l in losses)
    files = sorted(os.listdir(tmp_path / "step_000005"))
    # every rank wrote its own shards
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(world)] + ["manifest.json", "rng.json",
                                                                                  "state.json"]


# ----------------------------------------------------------------------------- exact resume through train()


def through_train(ctx, overrides: dict, **kw):
    """``galaxy.train.loop.train`` on a fresh model and a fresh copy of ``ctx`` (no dropout streams
    yet), as a restarted process would run it; returns (losses, this rank's parameters, the ctx)."""
    cfg = GalaxyConfig.from_dict(SMALL, overrides)
    ctx = ctx.with_fresh_streams()
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=cfg.train.seed)
    result = train(model, mlm_data(cfg)[0], cfg, ctx, checkpointing=Checkpointing(**kw))
    return result.losses, {k: v.detach().clone() for k, v in model.named_parameters()}, ctx


def train_resume_is_exact(ctx, overrides, resume_overrides, directory):
    expected, expected_params, whole_ctx = through_train(ctx, overrides, save_dir=directory, save_every=5)
    assert whole_ctx.generators, "dropout drew from the context's streams"
    assert sorted(os.listdir(directory)) == ["step_000005", "step_000010"]
    losses, params, _ = through_train(ctx, {**overrides, **resume_overrides},
                                      resume=os.path.join(directory, "step_000005"))
    assert losses == expected[5:], f"resumed losses {losses} != uninterrupted {expected[5:]}"
    differ = [k for k in expected_params if not torch.equal(expected_params[k], params[k])]
    assert not differ, f"parameters differ after resuming: {differ[:3]}"
    return expected


DP2 = {"dp_size": 2}
PP2_1F1B = {"pp_size": 2, "num_microbatches": 2, "pipeline_schedule": "1f1b"}


@pytest.mark.parametrize("name,world,dp,pp,overrides,resume_overrides", [
    ("serial", 1, 1, 1, {"plan": "none"}, {}),
    ("tp2", 2, 1, 1, {"plan": "tp"}, {}),
    ("galaxy2", 2, 1, 1, {"plan": "galaxy"}, {}),
    ("pp2-1f1b-m2", 2, 1, 2, PP2_1F1B, {}),
    ("dp2-ddp", 2, 2, 1, DP2, {}),
    ("dp2-zero1", 2, 2, 1, {**DP2, "dp_engine": "zero1"}, {}),
    # the checkpoint is the same for both engines, and so are their steps
    ("dp2-zero1-resumed-as-ddp", 2, 2, 1, {**DP2, "dp_engine": "zero1"}, {"dp_engine": "ddp"}),
    ("dp2-ddp-resumed-as-zero1", 2, 2, 1, DP2, {"dp_engine": "zero1"}),
])
def test_train_resumes_bit_identically(dist_pool, tmp_path, name, world, dp, pp, overrides, resume_overrides):
    """10 steps of ``train`` with dropout, a checkpoint after step 5; steps 6-10 resumed from it in a
    fresh model, optimizer and context repeat the uninterrupted run's losses and parameters exactly."""
    losses = dist_pool.run(train_resume_is_exact, world, overrides, resume_overrides, str(tmp_path), dp=dp, pp=pp)
    assert all(l == losses[0] for l in losses), "every rank reports the global loss"
    assert len(losses[0]) == 10 and losses[0][0] != losses[0][-1]


def test_deepspeed_checkpoints_are_refused():
    cfg = GalaxyConfig.from_dict(SMALL, {"plan": "none", "dp_engine": "deepspeed"})
    ctx = ParallelContext.serial()
    model = BertForMaskedLM(cfg.model, cfg.resolve_plan(1), ctx, seed=0)
    with pytest.raises(ConfigError, match="'dp_engine' is 'deepspeed'.*use dp_engine 'zero1' or 'ddp'"):
        train(model, mlm_data(cfg)[0], cfg, ctx, checkpointing=Checkpointing(save_dir="unused"))


# ----------------------------------------------------------------------------- resharding


def galaxy_reference(ctx, directory):
    run = Run.fresh(ctx, {"plan": "galaxy", **NO_DROPOUT})
    run.steps(0, 5)
    run.save(directory, 5)
    losses = run.steps(5, 7)
    return losses, {k: v for k, v in run.model.full_state_dict().items()}


def resume_under(ctx, overrides, directory):
    run = Run.fresh(ctx, {**overrides, **NO_DROPOUT})
    assert run.load(directory).step == 5
    losses = run.steps(5, 7)
    return losses, run.model.full_state_dict()


def test_galaxy_checkpoint_resumes_under_uneven_tp3_and_serial(dist_pool, tmp_path):
    ref_losses, ref_params = dist_pool.run(galaxy_reference, 2, str(tmp_path))[0]
    for name, (world, overrides) in {"tp3-uneven": (3, TP3_UNEVEN), "serial": (1, {"plan": "none"})}.items():
        losses, params = dist_pool.run(resume_under, world, overrides, str(tmp_path))[0]
        # the next step's loss depends on the weights only
        assert abs(losses[0] - ref_losses[0]) <= 1e-6, (name, losses[0], ref_losses[0])
        # the step after depends on the resharded AdamW moments and step count too
        assert abs(losses[1] - ref_losses[1]) <= 1e-5 * abs(ref_losses[1]), (name, losses, ref_losses)
        worst = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
        assert worst <= 1e-6, f"{name}: parameters after two resumed steps differ by {worst}"


# ----------------------------------------------------------------------------- faults


def serial_run(overrides=None) -> Run:
    return Run.fresh(ParallelContext.serial(), {"plan": "none", **(overrides or {})})


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A save directory with valid checkpoints after steps 1 and 2 (serial)."""
    directory = tmp_path_factory.mktemp("two")
    run = serial_run()
    run.steps(0, 1)
    run.save(str(directory), 1)
    run.steps(1, 2)
    run.save(str(directory), 2)
    return directory


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_bytes(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(4)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(x ^ 0xFF for x in b))


def set_manifest_sha(path):
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"]["state.json"]["sha256"] = "0" * 64
    with open(path, "w") as f:
        json.dump(manifest, f)


def garble(path):
    with open(path, "w") as f:
        f.write("{ not json")


@pytest.mark.parametrize("target,damage,message", [
    ("__0_0.distcp", truncate, r"__0_0\.distcp' is truncated"),
    ("__0_0.distcp", flip_bytes, r"__0_0\.distcp' fails its sha256"),
    ("rng.json", flip_bytes, r"rng\.json' fails its sha256"),
    ("manifest.json", set_manifest_sha, r"state\.json' fails its sha256"),
    ("manifest.json", garble, r"manifest\.json' is corrupt"),
    ("manifest.json", os.remove, r"has no manifest\.json"),
])
def test_corrupt_checkpoint_names_the_file_and_resume_falls_back(two_checkpoints, tmp_path, caplog, target, damage,
                                                                message):
    directory = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, directory)
    newest = directory / "step_000002"
    damage(str(newest / target))
    run = serial_run()
    with pytest.raises(CheckpointError, match=message):
        run.load(str(newest))
    with caplog.at_level(logging.WARNING, logger="galaxy.train.checkpoint"):
        assert latest_valid_checkpoint(str(directory)) == str(directory / "step_000001")
    assert any("skipping invalid checkpoint" in r.getMessage() and "step_000002" in r.getMessage()
               for r in caplog.records)
    assert run.load(str(directory)).step == 1  # --resume with a directory falls back as well


def test_checkpoint_of_another_model_shape_is_refused(two_checkpoints):
    run = serial_run({"hidden_size": 48})
    with pytest.raises(CheckpointError, match=r"step_000001': 'bert\.embeddings\.word_embeddings\.weight' "
                                              r"has shape \(300, 32\) but the model needs \(300, 48\)"):
        run.load(str(two_checkpoints / "step_000001"))


def test_no_valid_checkpoint(tmp_path):
    assert latest_valid_checkpoint(str(tmp_path)) is None
    with pytest.raises(CheckpointError, match="no valid checkpoint under"):
        serial_run().load(str(tmp_path))


def test_prune_keeps_the_newest(tmp_path):
    run = serial_run()
    for step in range(1, 5):
        run.steps(step - 1, step)
        run.save(str(tmp_path), step, keep_last=2)
    os.makedirs(tmp_path / "step_000009.tmp-deadbeef")  # an interrupted save's leftovers
    prune(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["step_000003", "step_000004"]


def test_export_hf(two_checkpoints, tmp_path):
    out = export_hf(str(two_checkpoints), str(tmp_path / "hf"))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    exported = BertForMaskedLM.from_pretrained(out)
    run = serial_run()
    run.load(str(two_checkpoints / "step_000002"))
    ours = dict(run.model.named_parameters())
    for name, p in exported.named_parameters():
        assert torch.equal(p, ours[name]), name


def test_export_hf_in_several_files_loads_in_transformers(two_checkpoints, tmp_path):
    """Files of at most 20 kB, with HF's index, which transformers itself reads."""
    import transformers

    out = export_hf(str(two_checkpoints), str(tmp_path / "hf"), max_shard_bytes=20_000)
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 2
    hf = transformers.BertForMaskedLM.from_pretrained(out)
    run = serial_run()
    run.load(str(two_checkpoints / "step_000002"))
    hf_params = dict(hf.named_parameters())
    for name, p in run.model.named_parameters():
        assert torch.equal(hf_params[name], p), name


# ----------------------------------------------------------------------------- kill -9 during a save


def _stall(directory: str) -> None:
    with open(os.path.join(directory, "stalled"), "w"):
        pass
    time.sleep(120)


def _save_then_hang(directory: str, stall_on: str) -> None:
    """Child process: save after step 1, then start the save after step 2 and stall it when it
    writes ``stall_on`` (half of a tensor in a shard file, or the manifest after the rename)."""
    torch.set_num_threads(1)
    run = serial_run()
    run.steps(0, 1)
    run.save(directory, 1)
    run.steps(1, 2)
    # test-only: hold the save mid-write so the parent can kill it
    if stall_on == "shard":  # DCP writes each chunk with torch.save
        save = torch.save

        def stalling_save(obj, f, *args, **kwargs):
            buffer = io.BytesIO()
            save(obj, buffer, *args, **kwargs)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            _stall(directory)

        torch.save = stalling_save
    else:
        write = ckpt_files.write_bytes

        def stalling(path, data):
            if os.path.basename(path).startswith(stall_on):
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                _stall(directory)
            return write(path, data)

        ckpt_files.write_bytes = stalling
    run.save(directory, 2)


@pytest.mark.parametrize("stall_on", ["shard", "manifest.json"])
def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path, stall_on):
    child = multiprocessing.get_context("spawn").Process(target=_save_then_hang, args=(str(tmp_path), stall_on))
    child.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "stalled").exists():
        assert child.is_alive() and time.monotonic() < deadline, "the child never reached the save"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL
    leftovers = [d for d in os.listdir(tmp_path) if d.startswith("step_000002")]
    assert leftovers, "the kill landed inside the second save"

    assert latest_valid_checkpoint(str(tmp_path)) == str(tmp_path / "step_000001")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child ran: another thread count may round differently
    try:
        reference = serial_run().steps(0, 3)
        run = serial_run()
        assert run.load(str(tmp_path)).step == 1
        assert run.steps(1, 3) == reference[1:]
    finally:
        torch.set_num_threads(threads)
    run.save(str(tmp_path), 3, keep_last=1)  # saving goes on over the debris, pruning clears it
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("step_")) == ["step_000003"]


# ----------------------------------------------------------------------------- pipeline and data parallel layouts


def fake_step(run: Run) -> None:
    """One optimizer step on gradients that depend only on the parameter's name, each rank taking
    its shard: every layout then holds the serial model's parameters and AdamW moments."""
    from galaxy.core.context import param_seed
    from galaxy.core.layers import shard_spec

    for name, p in run.model.named_parameters():
        spec = shard_spec(p)
        full = torch.randn(spec.full_shape(p.shape) if spec else p.shape,
                           generator=torch.Generator().manual_seed(param_seed(7, name)))
        p.grad = spec.slice(full).clone() if spec else full
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)


def save_from_layout(ctx, directory, engine):
    run = Run.fresh(ctx, {"plan": "galaxy" if ctx.mp.size > 1 else "none", "dp_size": ctx.dp.size,
                          "dp_engine": engine, **NO_DROPOUT})
    fake_step(run)
    if engine == "zero1":  # each dp rank holds the states of only its share of the parameters
        owned = sum(1 for p in run.model.parameters() if run.optimizer.optim.state.get(p))
        assert 0 < owned < len(list(run.model.parameters()))
    run.save(directory, 1)
    return True


@pytest.mark.parametrize("dp,pp,world,engine", [(1, 2, 2, "ddp"), (2, 1, 2, "ddp"), (1, 2, 4, "ddp"), (2, 1, 4, "ddp"),
                                               (2, 1, 2, "zero1"), (2, 1, 4, "zero1"), (2, 2, 4, "zero1")])
def test_pipeline_and_data_parallel_checkpoints_load_serially(dist_pool, tmp_path, dp, pp, world, engine):
    """Every stage's tensors (a pipeline's tied embedding copy included) and one dp replica (with
    ZeRO-1, the optimizer states of every dp rank) end up in the checkpoint, which a serial model
    then loads exactly."""
    dist_pool.run(save_from_layout, world, str(tmp_path), engine, dp=dp, pp=pp)
    reference = serial_run(NO_DROPOUT)
    fake_step(reference)
    loaded = serial_run(NO_DROPOUT)
    assert loaded.load(str(tmp_path)).step == 1
    ref_params, params = dict(reference.model.named_parameters()), dict(loaded.model.named_parameters())
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=1e-7, msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(loaded.optimizer.state[params[name]][key],
                                       reference.optimizer.state[p][key], rtol=0, atol=1e-7, msg=f"{name} {key}")
    assert loaded.scheduler.state_dict() == reference.scheduler.state_dict()


# ----------------------------------------------------------------------------- format 1, async saves, DCP's own reader


def save_both_formats(ctx, directory):
    """A Galaxy run on 2 ranks saved after step 3 by the sharded writer and by format 1's writer."""
    run = Run.fresh(ctx, {"plan": "galaxy", **NO_DROPOUT})
    run.steps(0, 3)
    run.save(os.path.join(directory, "sharded"), 3)
    legacy.save_checkpoint_v1(os.path.join(directory, "format1"), 3, run.model, run.optimizer, run.scheduler, ctx,
                              run.cfg)
    return True


def test_format1_checkpoints_still_load_and_export(dist_pool, tmp_path):
    dist_pool.run(save_both_formats, 2, str(tmp_path))
    runs = {}
    for fmt in ("sharded", "format1"):
        runs[fmt] = serial_run(NO_DROPOUT)
        assert runs[fmt].load(str(tmp_path / fmt)).step == 3
    assert json.loads((tmp_path / "format1" / "step_000003" / "manifest.json").read_text())["format_version"] == 1
    ours, old = (dict(runs[f].model.named_parameters()) for f in ("sharded", "format1"))
    for name, p in ours.items():
        assert torch.equal(old[name], p), name
        for key, value in runs["sharded"].optimizer.state[p].items():
            assert torch.equal(runs["format1"].optimizer.state[old[name]][key], value), (name, key)
    assert runs["sharded"].scheduler.state_dict() == runs["format1"].scheduler.state_dict()
    exported = {fmt: BertForMaskedLM.from_pretrained(export_hf(str(tmp_path / fmt), str(tmp_path / f"hf-{fmt}")))
                for fmt in ("sharded", "format1")}
    old = dict(exported["format1"].named_parameters())
    for name, p in exported["sharded"].named_parameters():
        assert torch.equal(p, old[name]) and torch.equal(p, ours[name]), name


def save_async_then_step(ctx, directory):
    """Start an async save after step 3, run step 4 while it may still write, then commit it; the
    checkpoint holds the state after step 3 (the tensors were staged when the save started)."""
    from galaxy.train.checkpoint import shards

    run = Run.fresh(ctx, {"plan": "tp", **NO_DROPOUT})
    run.steps(0, 3)
    expected = {k: v.clone() for k, v in run.model.full_state_dict().items()}
    stepped, write = threading.Event(), shards._RankWriter.write_data

    def write_after_the_step(self, plan, planner):
        assert stepped.wait(60)
        return write(self, plan, planner)

    shards._RankWriter.write_data = write_after_the_step  # test-only: the files are written after step 4
    try:
        pending = run.save(directory, 3, async_save=True)
        run.steps(3, 4)
        assert not pending.done()
        stepped.set()
        assert pending.result() == os.path.join(directory, "step_000003")
    finally:
        shards._RankWriter.write_data = write
    resumed = Run.fresh(ctx, {"plan": "tp", **NO_DROPOUT})
    assert resumed.load(directory).step == 3
    got = resumed.model.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert resumed.steps(3, 4) == Run.fresh(ctx, {"plan": "tp", **NO_DROPOUT}).steps(0, 4)[3:]
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_async_save_holds_the_state_when_it_started(dist_pool, tmp_path, world):
    dist_pool.run(save_async_then_step, world, str(tmp_path))


def test_dcp_reads_the_checkpoint_with_its_own_planner(two_checkpoints):
    """torch.distributed.checkpoint's default reader and planner (which read the ``.metadata`` written
    for them) load the full tensors the serial model holds: the chunks are described as DCP describes them."""
    import torch.distributed.checkpoint as dcp

    run = serial_run()
    run.load(str(two_checkpoints / "step_000002"))
    params = dict(run.model.named_parameters())
    state = {f"model/{name}": torch.empty_like(p) for name, p in params.items()}
    state.update({f"optim/{name}/exp_avg": torch.empty_like(p) for name, p in params.items()})
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(two_checkpoints / "step_000002")), no_dist=True)
    for name, p in params.items():
        assert torch.equal(state[f"model/{name}"], p), name
        assert torch.equal(state[f"optim/{name}/exp_avg"], run.optimizer.state[p]["exp_avg"]), name


def load_damaged(ctx, directory):
    run = Run.fresh(ctx, {"plan": "tp"})
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp' fails its sha256") as raised:
        run.load(os.path.join(directory, "step_000001"))
    return str(raised.value)


def save_tp(ctx, directory):
    run = Run.fresh(ctx, {"plan": "tp"})
    run.steps(0, 1)
    run.save(directory, 1)
    return True


def test_a_damaged_shard_fails_every_rank_with_its_name(dist_pool, tmp_path):
    """Each rank reads only the files that hold its part; whichever rank finds the damage, every rank
    raises the same error (none is left waiting for the others)."""
    dist_pool.run(save_tp, 2, str(tmp_path))
    flip_bytes(str(tmp_path / "step_000001" / "__1_0.distcp"))
    messages = dist_pool.run(load_damaged, 3, str(tmp_path))
    assert len(set(messages)) == 1


# ----------------------------------------------------------------------------- optimizers that shard their own way


class RowFragments:
    """Test double of an optimizer that spreads its states its own way (as ZeRO over the model-parallel
    group would): AdamW over each parameter's shard cut into two row fragments, each a tensor of its
    own, placed by ``checkpoint_state_regions``."""

    def __init__(self, model, groups_of: torch.optim.Optimizer):
        """The parameter groups (and their hyper-parameters) are those of ``groups_of``."""
        names = {p: name for name, p in model.named_parameters()}
        self.fragments, groups = {}, []
        for group in groups_of.param_groups:
            fragments = []
            for p in group["params"]:
                cuts = [0, p.shape[0] // 2, p.shape[0]] if p.dim() > 1 else [0, p.shape[0]]
                for start, stop in zip(cuts, cuts[1:]):
                    fragments.append(p.detach()[start:stop].clone().requires_grad_())
                    self.fragments[fragments[-1]] = (names[p], p, start)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fragments})
        self.optim = torch.optim.AdamW(groups)
        self.param_groups = self.optim.param_groups

    def checkpoint_state_regions(self, model):
        from galaxy.train.checkpoint.regions import StateRegion, param_region

        regions = {}
        for fragment, (name, p, row) in self.fragments.items():
            whole = param_region(name, p)
            regions[fragment] = StateRegion(name, whole.shape, (whole.offsets[0] + row,) + whole.offsets[1:])
        return self.optim, regions

    def fake_step(self):
        """``fake_step``'s gradients, each fragment taking its rows of its shard."""
        from galaxy.core.context import param_seed
        from galaxy.core.layers import shard_spec

        for fragment, (name, p, row) in self.fragments.items():
            spec = shard_spec(p)
            full = torch.randn(spec.full_shape(p.shape) if spec else p.shape,
                               generator=torch.Generator().manual_seed(param_seed(7, name)))
            fragment.grad = (spec.slice(full) if spec else full)[row: row + fragment.shape[0]].clone()
        self.optim.step()


def save_fragmented(ctx, directory):
    run = Run.fresh(ctx, {"plan": "galaxy", **NO_DROPOUT})
    run.optimizer = RowFragments(run.model, run.optimizer)
    run.scheduler = None
    run.optimizer.fake_step()
    run.save(directory, 1)
    return True


def test_an_optimizer_that_shards_its_own_way_plugs_in(dist_pool, tmp_path):
    """Its states, saved from 2 ranks in its own fragments, load into a serial AdamW (and a serial
    AdamW's back into its fragments) equal to one AdamW step on the whole model."""
    dist_pool.run(save_fragmented, 2, str(tmp_path / "fragments"))
    reference = serial_run(NO_DROPOUT)
    fake_step(reference)
    loaded = serial_run(NO_DROPOUT)
    load_checkpoint(str(tmp_path / "fragments"), loaded.model, loaded.optimizer, None, loaded.ctx)
    ref_params = dict(reference.model.named_parameters())
    for name, p in loaded.model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(loaded.optimizer.state[p][key], reference.optimizer.state[ref_params[name]][key],
                                       rtol=0, atol=1e-7, msg=f"{name} {key}")
    reference.save(str(tmp_path / "whole"), 1)
    back = serial_run(NO_DROPOUT)
    back.optimizer = RowFragments(back.model, back.optimizer)
    load_checkpoint(str(tmp_path / "whole"), back.model, back.optimizer, None, back.ctx)
    for fragment, (name, _, row) in back.optimizer.fragments.items():
        expected = reference.optimizer.state[ref_params[name]]["exp_avg"][row: row + fragment.shape[0]]
        assert torch.equal(back.optimizer.optim.state[fragment]["exp_avg"], expected), name


def test_export_hf_splits_llamas_fused_gate_up(tmp_path):
    """A LLaMA with ``fused_gate_up`` saves its own [2, I, H] tensor; the export, read by transformers,
    holds HF's separate gate and up projections."""
    import transformers

    from galaxy.models import build_model

    cfg = GalaxyConfig.from_dict({"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2,
                                  "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 40,
                                  "max_position_embeddings": 32, "fused_gate_up": True, "pad_token_id": None,
                                  "seq_length": 16})
    ctx = ParallelContext.serial()
    model = build_model(cfg, None, ctx)
    save_checkpoint(str(tmp_path / "ckpt"), 1, model, torch.optim.AdamW(model.parameters()), None, ctx, cfg)
    hf = transformers.LlamaForCausalLM.from_pretrained(export_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf")))
    expected = model.state_to_hf(model.full_state_dict())
    assert "model.layers.1.mlp.up_proj.weight" in expected
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) == set(expected)
    for name, value in expected.items():
        assert torch.equal(hf_params[name], value), name


def pipeline_case():
    return dict(model="llama", pp_size=2, plan="none", tie_word_embeddings=False, num_microbatches=2)


def save_pipeline(ctx, directory):
    cfg, _, model, _, batch_at = build(ctx, dict(pipeline_case(), max_steps=STEPS))
    trainer = Trainer(model, cfg, ctx)
    for step in (1, 2):
        run_steps(trainer, batch_at, step - 1, step)
        save_checkpoint(directory, step, model, trainer.optimizer, trainer.schedule, ctx, cfg)
    trainer.grad_sync.remove()
    return True


def load_counting_hashes(ctx, directory):
    """Load from the save directory, recording which files this rank hashes (test-only wrapper)."""
    hashed, file_entry = [], ckpt_files.file_entry

    def counting(path):
        hashed.append(os.path.relpath(path, directory))
        return file_entry(path)

    ckpt_files.file_entry = counting
    try:
        cfg, _, model, _, _ = build(ctx, dict(pipeline_case(), max_steps=STEPS))
        trainer = Trainer(model, cfg, ctx)
        state = load_checkpoint(directory, model, trainer.optimizer, trainer.schedule, ctx, cfg)
        trainer.grad_sync.remove()
    finally:
        ckpt_files.file_entry = file_entry
    return os.path.basename(state.path), hashed


def test_each_rank_hashes_only_the_files_it_reads(dist_pool, tmp_path):
    """Two pipeline stages write disjoint files; resuming from the save directory, each rank hashes its
    own shard file (and the JSON files) once, never the other stage's. Damage in the file only rank 1
    reads makes every rank skip that checkpoint for the older one."""
    dist_pool.run(save_pipeline, 2, str(tmp_path), pp=2)
    for rank, (step, hashed) in enumerate(dist_pool.run(load_counting_hashes, 2, str(tmp_path), pp=2)):
        assert step == "step_000002"
        assert sorted(hashed) == sorted([f"step_000002/__{rank}_0.distcp", "step_000002/state.json",
                                         "step_000002/rng.json"]), hashed
    flip_bytes(str(tmp_path / "step_000002" / "__1_0.distcp"))
    for rank, (step, hashed) in enumerate(dist_pool.run(load_counting_hashes, 2, str(tmp_path), pp=2)):
        assert step == "step_000001", "every rank fell back to the older checkpoint"
        assert "step_000002/__1_0.distcp" not in hashed if rank == 0 else "step_000002/__0_0.distcp" not in hashed
