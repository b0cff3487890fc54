"""Shared by the checkpoint tests of ``Trainer`` runs (tests/train/checkpoint/test_regions.py,
tests/train/test_checkpoint_fsdp.py, the interrupt and save-failure tests): test_dp_pp's tiny BERT / LLaMA
(float64) with its serial twin, steps of a ``Trainer``, the serial reference after ``SAVED_AT`` steps, and a
checkpoint's full tensors."""

from __future__ import annotations

import os

import torch

from galaxy.config import KEY_SECTION, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.train.checkpoint import latest_valid_checkpoint, save_checkpoint
from galaxy.train.checkpoint.files import read_manifest
from galaxy.train.checkpoint.shards import ShardReader
from galaxy.train.loop import Trainer, train
from galaxy.train.options import Checkpointing
from galaxy.data.pretraining import mlm_data
from tests.core.test_dp_pp import BERT, LLAMA, TRAIN, llama_batch_at


STEPS, SAVED_AT = 5, 3
TOL = 1e-9


def build(ctx, case):
    """test_dp_pp's model, its serial twin and batches; ``case`` may override train keys (``dtype``)."""
    raw = {**(LLAMA if case.get("model") == "llama" else BERT), **TRAIN}
    extra = {k: v for k, v in case.items() if k != "model"}
    cfg = GalaxyConfig.from_dict({**raw, **extra})
    serial_cfg = GalaxyConfig.from_dict({**raw, **{k: v for k, v in extra.items()
                                                   if KEY_SECTION[k] in ("model", "train")}})
    ctx.stage_layers = cfg.stage_layers()
    cls = LlamaForCausalLM if case.get("model") == "llama" else BertForMaskedLM
    model = cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11)
    serial = cls(serial_cfg.model, seed=11)
    batch_at = llama_batch_at if case.get("model") == "llama" else mlm_data(cfg)[0]
    return cfg, serial_cfg, model, serial, batch_at


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    manifest = read_manifest(path)
    return ShardReader(path, manifest).read_full(list(manifest["tensors"]))


def through_train(ctx, case, **kw) -> list[float]:
    cfg, _, model, _, batch_at = build(ctx, case)
    return train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(**kw)).losses


def sharded_resume_is_exact(ctx, case, directory):
    whole, resumed = os.path.join(directory, "whole"), os.path.join(directory, "resumed")
    expected = through_train(ctx, case, save_dir=whole, save_every=SAVED_AT)
    got = through_train(ctx, case, save_dir=resumed, resume=os.path.join(whole, f"step_{SAVED_AT:06d}"))
    assert got == expected[SAVED_AT:], f"resumed losses {got} != uninterrupted {expected[SAVED_AT:]}"
    if ctx.rank == 0:  # the checkpoints after the last step: every weight, master, moment and step count
        assert latest_valid_checkpoint(whole).endswith(f"step_{STEPS:06d}")
        final = f"step_{STEPS:06d}"
        a, b = checkpoint_tensors(os.path.join(whole, final)), checkpoint_tensors(os.path.join(resumed, final))
        assert set(a) == set(b) and any(k.startswith("optim/") for k in a)
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"tensors differ after resuming: {differ[:3]}"
        return {k: str(v.dtype) for k, v in a.items() if k.startswith("model/")}
    return None


def run_steps(trainer: Trainer, batch_at, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        loss = trainer.forward_backward(trainer.read_batch(batch_at, step))
        trainer.optimizer_step(loss, step + 1)
        losses.append(loss.item())
    return losses


def serial_reference(ctx, case):
    """The serial model's trainer after ``SAVED_AT`` steps, and its losses of the steps after."""
    _, serial_cfg, _, serial, batch_at = build(ctx, dict(case, max_steps=STEPS))
    ref = Trainer(serial, serial_cfg, ParallelContext.serial())
    run_steps(ref, batch_at, 0, SAVED_AT)
    state = {n: {k: v.clone() for k, v in ref.optimizer.state[p].items()} for n, p in serial.named_parameters()}
    weights = {n: p.detach().clone() for n, p in serial.named_parameters()}
    return weights, state, run_steps(ref, batch_at, SAVED_AT, STEPS)


def save_after_steps(ctx, case, directory):
    cfg, _, model, _, batch_at = build(ctx, dict(case, max_steps=STEPS))
    trainer = Trainer(model, cfg, ctx)
    run_steps(trainer, batch_at, 0, SAVED_AT)
    save_checkpoint(directory, SAVED_AT, model, trainer.optimizer, trainer.schedule, ctx, cfg,
                    grad_reducer=trainer.grad_sync)
    trainer.grad_sync.remove()
    return True


def saved_runs(runs: dict, dist_pool, tmp_path_factory):
    """name -> the checkpoint after 3 steps of run ``runs[name]`` ((world, dp, case)), made when first asked for."""
    root, made = tmp_path_factory.mktemp("saved"), {}

    def path(name):
        if name not in made:
            world, dp, case = runs[name]
            made[name] = str(root / name)
            dist_pool.run(save_after_steps, world, case, made[name], dp=dp)
        return made[name]

    return path
