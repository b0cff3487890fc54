"""Checkpoints of ``mp_grad_reduce: sharded`` runs (``galaxy.train.checkpoint.regions``).

The sharded weights' masters and AdamW states live in flat pieces of buckets spread over the mp ranks;
a checkpoint holds them as regions of the full parameters. So a run resumed under the same plan repeats
the uninterrupted run bit for bit (float64 and bfloat16 autocast, whose fp32 masters exist only in the
pieces; DP x mp with ZeRO-1, and pipelines, too), and a checkpoint moves between plans, world sizes and
modes with weights, moments, step counts and pieces equal to the serial model trained as many steps.
Missing regions and a sharded optimizer saved without its layout are refused in one line. The harness
(tiny BERT / LLaMA, float64) is tests/core/test_dp_pp.py's, through tests/train/checkpoint/helpers.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import shard_spec
from galaxy.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from galaxy.train.checkpoint.state import local_optimizer
from galaxy.train.loop import Trainer
from tests.core.test_dp_pp import rel_err
from tests.train.checkpoint.helpers import (SAVED_AT, STEPS, TOL, build, run_steps, saved_runs, serial_reference,
                                            sharded_resume_is_exact)


UNEVEN3 = dict(plan="galaxy", tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10],
               seq_scatter_list=[2, 5, 5])
GALAXY2 = dict(plan="galaxy2")
DP2_ZERO1 = dict(plan="galaxy2", dp_size=2, dp_engine="zero1", num_microbatches=2)


@pytest.mark.parametrize("name,world,dp,pp,case", [
    ("galaxy2-w2", 2, 1, 1, GALAXY2),
    ("galaxy-w3-uneven-async", 3, 1, 1, dict(UNEVEN3, checkpoint_async_mode="async")),
    ("galaxy2-w2-bf16", 2, 1, 1, dict(GALAXY2, dtype="bfloat16")),
    ("dp2-galaxy2-zero1", 4, 2, 1, DP2_ZERO1),
    ("llama-pp2-galaxy2-tied", 4, 1, 2, dict(model="llama", pp_size=2, plan="galaxy2", tie_word_embeddings=True,
                                              num_microbatches=2)),
])
def test_sharded_run_resumes_bit_identically(dist_pool, tmp_path, name, world, dp, pp, case):
    """5 steps of ``train`` under ``sharded`` saving after step 3; steps 4-5 resumed from it in a fresh
    model, trainer and optimizer repeat the uninterrupted run's losses, and its final checkpoint holds
    the same tensors bit for bit (under bfloat16 the weights are saved from the fp32 masters)."""
    case = dict(case, mp_grad_reduce="sharded", max_steps=STEPS)
    dtypes = dist_pool.run(sharded_resume_is_exact, world, case, str(tmp_path), dp=dp, pp=pp)[0]
    wanted = "torch.float32" if case.get("dtype") == "bfloat16" else "torch.float64"
    assert set(dtypes.values()) == {wanted}, dtypes


def check_loaded(trainer: Trainer, model, weights: dict, state: dict) -> int:
    """This rank's weights, pieces and optimizer states against the serial model's (each sharded piece
    against the slice the layout gives of the serial tensors, flattened and padded); returns how many
    stepped tensors were compared."""
    names = {p: n for n, p in model.named_parameters()}

    def local(name, p, full):
        spec = shard_spec(p)
        return spec.slice(full) if spec is not None else full

    for name, p in model.named_parameters():
        err = rel_err(p.detach(), local(name, p, weights[name]), 0.02 * p.numel() ** 0.5)
        assert err < TOL, f"weight {name}: relative error {err:.2e}"
    pieces = {id(e["shard"]): e for e in trainer.grad_sync.shard_layout()}

    def expected(t, source: dict):
        if id(t) not in pieces:
            return local(names[t], t, source[names[t]])
        e = pieces[id(t)]
        flat = torch.cat([source[names[p]].reshape(-1) for p in e["params"]])
        flat = torch.nn.functional.pad(flat, (0, e["stop"] - e["start"]) )
        return flat[e["start"]:e["stop"]]

    optim, compared = local_optimizer(trainer.optimizer), 0
    for group in optim.param_groups:
        for t in group["params"]:
            if id(t) in pieces:  # the master piece
                err = rel_err(t.detach(), expected(t, weights), 0.02 * t.numel() ** 0.5)
                assert err < TOL, f"sharded piece: relative error {err:.2e}"
            got = optim.state[t]
            assert got["step"].item() == SAVED_AT
            # Floors for moments of gradients that are rounding noise (an attention key bias has none).
            for key, floor in (("exp_avg", 1e-6), ("exp_avg_sq", 1e-10)):
                err = rel_err(got[key], expected(t, {n: s[key] for n, s in state.items()}), floor * t.numel() ** 0.5)
                assert err < TOL, f"{names.get(t, 'sharded piece')} {key}: relative error {err:.2e}"
            compared += 1
    return compared


def resume_elsewhere(ctx, case, directory):
    weights, state, later = serial_reference(ctx, case)
    cfg, _, model, _, batch_at = build(ctx, dict(case, max_steps=STEPS))
    trainer = Trainer(model, cfg, ctx)
    assert load_checkpoint(directory, model, trainer.optimizer, trainer.schedule, ctx, cfg,
                           grad_reducer=trainer.grad_sync).step == SAVED_AT
    compared = check_loaded(trainer, model, weights, state)
    losses = run_steps(trainer, batch_at, SAVED_AT, STEPS)
    trainer.grad_sync.remove()
    for got, want in zip(losses, later):
        assert abs(got - want) <= TOL * abs(want), (losses, later)
    return compared, len(trainer.grad_sync.shards())


SAVED = {"sharded-galaxy2-w2": (2, 1, dict(GALAXY2, mp_grad_reduce="sharded")),
         "after_backward-galaxy2-w2": (2, 1, GALAXY2),
         "sharded-dp2-galaxy2-zero1": (4, 2, dict(DP2_ZERO1, mp_grad_reduce="sharded"))}


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory):
    """Checkpoints after 3 steps of each run in ``SAVED``."""
    return saved_runs(SAVED, dist_pool, tmp_path_factory)


@pytest.mark.parametrize("source,world,dp,case", [
    ("sharded-galaxy2-w2", 2, 1, GALAXY2),                                      # -> after_backward
    ("sharded-galaxy2-w2", 3, 1, dict(UNEVEN3, mp_grad_reduce="sharded")),     # -> another plan, world 3 uneven
    ("sharded-galaxy2-w2", 1, 1, dict(plan="none")),                            # -> serial
    ("after_backward-galaxy2-w2", 2, 1, dict(GALAXY2, mp_grad_reduce="sharded")),
    ("after_backward-galaxy2-w2", 3, 1, dict(UNEVEN3, mp_grad_reduce="sharded")),
    ("sharded-dp2-galaxy2-zero1", 3, 1, dict(UNEVEN3, mp_grad_reduce="sharded")),
    ("sharded-galaxy2-w2", 4, 2, dict(DP2_ZERO1, mp_grad_reduce="sharded")),  # -> DP x mp, ZeRO-1 + sharded
])
def test_checkpoint_moves_between_plans_worlds_and_modes(dist_pool, saved, source, world, dp, case):
    """Loaded anywhere, weights, AdamW moments, step counts and sharded pieces equal the serial model's
    after the same 3 steps (float64, 1e-9), and the next 2 steps give the serial model's losses."""
    out = dist_pool.run(resume_elsewhere, world, case, saved(source), dp=dp)
    assert all(compared > 0 for compared, _ in out)
    if case.get("mp_grad_reduce") == "sharded":
        assert all(shards > 0 for _, shards in out), "the loading run steps sharded pieces"


def save_bf16_masters(ctx, directory):
    """galaxy2 under bfloat16 autocast, ``sharded``: 3 steps, saved; returns every weight's fp32 master
    (the sharded ones gathered from the pieces of every mp rank, as the layout says)."""
    from galaxy.train.loop import autocast_context

    cfg, _, model, _, batch_at = build(ctx, dict(GALAXY2, mp_grad_reduce="sharded", dtype="bfloat16"))
    trainer = Trainer(model, cfg, ctx)
    for step in range(SAVED_AT):
        loss = trainer.forward_backward(trainer.read_batch(batch_at, step), lambda: autocast_context(cfg, ctx.device))
        trainer.optimizer_step(loss, step + 1)
    save_checkpoint(directory, SAVED_AT, model, trainer.optimizer, trainer.schedule, ctx, cfg,
                    grad_reducer=trainer.grad_sync)
    masters = {n: gather_full(p.detach(), p, ctx.mp).clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for e in trainer.grad_sync.shard_layout():
        flat = ctx.mp.all_gather(e["shard"].detach(), 0, [e["stop"] - e["start"]] * ctx.mp.size)[:e["numel"]]
        for p, w in zip(e["params"], flat.split([p.numel() for p in e["params"]])):
            assert p.dtype == torch.bfloat16 and w.dtype == torch.float32
            masters[names[p]] = w.view_as(p).clone()
    trainer.grad_sync.remove()
    return masters


def load_bf16_masters(ctx, case, directory, masters):
    cfg, _, model, _, _ = build(ctx, dict(case, dtype="bfloat16"))
    trainer = Trainer(model, cfg, ctx)
    load_checkpoint(directory, model, trainer.optimizer, trainer.schedule, ctx, cfg, grad_reducer=trainer.grad_sync)
    layout = trainer.grad_sync.shard_layout()
    for name, p in model.named_parameters():  # the model's weights: fp32, or bf16 copies of the masters
        spec = shard_spec(p)
        want = spec.slice(masters[name]) if spec is not None else masters[name]
        assert torch.equal(p.detach(), want.to(p.dtype)), name
    names = {p: n for n, p in model.named_parameters()}
    for e in layout:  # the pieces: fp32 masters, exactly the slices the layout gives
        flat = torch.cat([masters[names[p]].reshape(-1) for p in e["params"]])
        flat = torch.nn.functional.pad(flat, (0, e["stop"] - e["start"]))[e["start"]:e["stop"]]
        assert e["shard"].dtype == torch.float32 and torch.equal(e["shard"].detach(), flat)
    trainer.grad_sync.remove()
    return len(layout)


@pytest.mark.parametrize("world,case", [(2, dict(GALAXY2, mp_grad_reduce="sharded")),
                                        (3, dict(UNEVEN3, mp_grad_reduce="sharded")),
                                        (3, UNEVEN3)])
def test_bf16_masters_survive_the_move(dist_pool, tmp_path, world, case):
    """Under bfloat16 autocast the sharded weights' fp32 masters exist only in the pieces; a checkpoint
    carries them exactly into the pieces (or fp32 weights) of another world, plan or mode."""
    masters = dist_pool.run(save_bf16_masters, 2, str(tmp_path))[0]
    pieces = dist_pool.run(load_bf16_masters, world, case, str(tmp_path), masters)
    assert all(n > 0 for n in pieces) == (case.get("mp_grad_reduce") == "sharded")


def load_expecting(ctx, case, directory, message):
    cfg, _, model, _, _ = build(ctx, dict(case, max_steps=STEPS))
    trainer = Trainer(model, cfg, ctx)
    with pytest.raises(CheckpointError, match=message) as raised:
        load_checkpoint(directory, model, trainer.optimizer, trainer.schedule, ctx, cfg,
                        grad_reducer=trainer.grad_sync)
    trainer.grad_sync.remove()
    assert "\n" not in str(raised.value)
    return str(raised.value)


def edit_manifest(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest["tensors"])
    with open(path, "w") as f:
        json.dump(manifest, f)
    return dst


def moments_of(tensors: dict, module: str, split: bool) -> str:
    """The first moments of a replicated weight that galaxy2 shards (the MLP's, the norms'); ``split``:
    one that both mp ranks saved pieces of. A norm scale shares its bucket with others of its kind."""
    return next(k for k, t in tensors.items() if k.startswith("optim/") and k.endswith(f"{module}/exp_avg")
                and (len(t["chunks"]) > 1 or not split))


def test_missing_regions_and_partial_optimizer_states_are_refused(dist_pool, saved, tmp_path):
    source = os.path.join(saved("sharded-galaxy2-w2"), f"step_{SAVED_AT:06d}")
    sharded = dict(GALAXY2, mp_grad_reduce="sharded")
    # a chunk missing from the manifest: the region it held is nowhere
    dropped = edit_manifest(source, str(tmp_path / "dropped"),
                            lambda t: t[moments_of(t, "intermediate.dense.weight", split=True)]["chunks"].pop())
    messages = dist_pool.run(load_expecting, 2, sharded, dropped, r"holds \d+ of the \d+ elements of 'optim/.*"
                                                                   r"manifest lists too few chunks")
    assert len(set(messages)) == 1, "every rank raises the same error"
    # one weight's moments missing altogether, while its piece holds other weights that have them
    lacking = edit_manifest(source, str(tmp_path / "lacking"),
                            lambda t: t.pop(moments_of(t, "output.LayerNorm.weight", split=False)))
    dist_pool.run(load_expecting, 2, sharded, lacking, r"lacks optimizer state 'exp_avg' of .*incomplete")
    dist_pool.run(load_expecting, 2, GALAXY2, lacking, r"holds optimizer states .* for one parameter and .* for "
                                                       r"others; the checkpoint is incomplete")


def save_without_reducer(ctx, directory):
    cfg, _, model, _, batch_at = build(ctx, dict(GALAXY2, mp_grad_reduce="sharded"))
    trainer = Trainer(model, cfg, ctx)
    run_steps(trainer, batch_at, 0, 1)
    with pytest.raises(CheckpointError, match="not a parameter of the model; with mp_grad_reduce 'sharded' pass "
                                              "the trainer's GradReducer"):
        save_checkpoint(directory, 1, model, trainer.optimizer, trainer.schedule, ctx, cfg)
    trainer.grad_sync.remove()
    return True


def test_sharded_optimizer_without_its_layout_is_refused(dist_pool, tmp_path):
    assert all(dist_pool.run(save_without_reducer, 2, str(tmp_path)))


def test_flat_blocks_cover_a_flat_range_in_order():
    """Every range of a row-major tensor's elements, cut into blocks, is those elements in order."""
    from galaxy.train.checkpoint.regions import flat_blocks
    from galaxy.train.checkpoint.shards import narrow

    for shape in [(7,), (3, 5), (2, 3, 4), (1, 1, 6), (4, 1, 3)]:
        index = torch.arange(torch.Size(shape).numel()).view(shape)
        for start in range(index.numel()):
            for stop in range(start + 1, index.numel() + 1):
                blocks = flat_blocks(shape, start, stop)
                got = torch.cat([narrow(index, offsets, sizes).reshape(-1) for offsets, sizes in blocks])
                assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop, blocks)
                assert len(blocks) <= 2 * len(shape) - 1
