"""Checkpoints of ``mp_grad_reduce: sharded`` runs, async saves in the training loop, and what each rank
verifies when it loads.

The sharded weights' masters and AdamW states live in flat pieces of buckets spread over the mp ranks;
a checkpoint holds them as regions of the full parameters. So a run resumed under the same plan repeats
the uninterrupted run bit for bit (float64 and bfloat16 autocast, whose fp32 masters exist only in the
pieces; DP x mp with ZeRO-1, and pipelines, too), and a checkpoint moves between plans, world sizes and
modes with weights, moments, step counts and pieces equal to the serial model trained as many steps.
The harness (tiny BERT / LLaMA, float64) is tests/test_dp_pp.py's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from galaxy.config import KEY_SECTION, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import shard_spec
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.train.checkpoint import (CheckpointError, latest_valid_checkpoint, load_checkpoint, save_checkpoint,
                                     files as ckpt_files)
from galaxy.train.checkpoint.files import read_manifest
from galaxy.train.checkpoint.shards import ShardReader
from galaxy.train.checkpoint.state import local_optimizer
from galaxy.train.loop import Trainer, train
from galaxy.train.options import Checkpointing
from galaxy.data.pretraining import mlm_data
from tests.train.test_checkpoint import flip_bytes
from tests.core.test_dp_pp import BERT, LLAMA, TRAIN, llama_batch_at, rel_err

UNEVEN3 = dict(plan="galaxy", tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10],
               seq_scatter_list=[2, 5, 5])
GALAXY2 = dict(plan="galaxy2")
DP2_ZERO1 = dict(plan="galaxy2", dp_size=2, dp_engine="zero1", num_microbatches=2)
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


# ----------------------------------------------------------------------------- same plan: bit for bit


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


# ----------------------------------------------------------------------------- other plans, worlds and modes


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


def test_async_staging_copies_a_piece_as_it_was(tmp_path):
    """A sharded piece is a view into its flat shard: the async save stages that view alone, with the
    values it had when the save started (the write itself held back until the shard has changed)."""
    import io
    import threading

    from galaxy.train.checkpoint import shards

    flat = torch.arange(20, dtype=torch.float64)
    gate, write = threading.Event(), shards._RankWriter.write_data

    def held_back(self, plan, planner):
        assert gate.wait(30)
        return write(self, plan, planner)

    shards._RankWriter.write_data = held_back  # test-only: the write waits for the change below
    try:
        done = shards.write_chunks(str(tmp_path), 0, [shards.Chunk("x", (4, 3), (1, 0), flat[5:11].view(2, 3))],
                                   async_save=True)
        flat.add_(100)
        gate.set()
        chunk = done.result()["chunks"]["x"][0]
    finally:
        shards._RankWriter.write_data = write
    with open(tmp_path / chunk["file"], "rb") as f:
        f.seek(chunk["offset"])
        saved = torch.load(io.BytesIO(f.read(chunk["length"])), weights_only=True)
    assert torch.equal(saved, torch.arange(5, 11, dtype=torch.float64).view(2, 3))
    assert saved.untyped_storage().nbytes() == 6 * 8, "only the piece is written, not its whole shard"


# ----------------------------------------------------------------------------- bad input: one clear line


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


# ----------------------------------------------------------------------------- async saves in train()


def test_async_saves_overlap_the_next_steps_and_resume_exactly(tmp_path):
    """``checkpoint_async_mode: async``: the save after step 1 is still being written while step 2 runs
    (its write is held until step 2 has ended: a synchronous save would wait forever); the save after
    step 2 and the end of training wait for the pending ones, so all are complete when ``train``
    returns, and resuming from the first repeats the run."""
    import threading

    from galaxy.train.checkpoint import shards

    ctx = ParallelContext.serial()
    case = dict(plan="none", max_steps=3, checkpoint_async_mode="async")
    cfg, _, model, _, batch_at = build(ctx, case)
    step_two, write = threading.Event(), shards._RankWriter.write_data

    def after_step_two(self, plan, planner):
        assert step_two.wait(60), "the save held training up"
        return write(self, plan, planner)

    shards._RankWriter.write_data = after_step_two  # test-only
    try:
        whole = train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(tmp_path), save_every=1),
                      on_step=lambda step, loss: step == 2 and step_two.set()).losses
    finally:
        shards._RankWriter.write_data = write
    assert sorted(os.listdir(tmp_path)) == ["step_000001", "step_000002", "step_000003"]
    assert all(ckpt_files.verify_checkpoint(str(tmp_path / d)) for d in os.listdir(tmp_path))
    cfg, _, model, _, batch_at = build(ctx, case)
    resumed = train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(resume=str(tmp_path / "step_000001"))).losses
    assert resumed == whole[1:]


def test_async_save_failure_stops_training_with_one_line(tmp_path):
    """The save directory is a file: the failed write surfaces when the next save waits for it."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    ctx = ParallelContext.serial()
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=3, checkpoint_async_mode="async"))
    steps = []
    with pytest.raises(CheckpointError, match=r"saving checkpoint '.*step_000001' failed on rank 0: ") as raised:
        train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(not_a_dir), save_every=1),
              on_step=lambda step, loss: steps.append(step))
    assert "\n" not in str(raised.value)
    assert steps == [1, 2], "training went on while the first save was pending; the second save waited for it"


# ----------------------------------------------------------------------------- what each rank verifies


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


def test_bare_resume_hands_the_save_directory_to_the_load(tmp_path):
    """``--resume`` without a path: nothing to resume from an empty directory or an interrupted save;
    otherwise the save directory itself, whose newest valid checkpoint the collective load picks."""
    import argparse

    from galaxy.cli.args import resume_path

    args = argparse.Namespace(resume="latest", save_dir=str(tmp_path))
    assert resume_path(args) is None
    (tmp_path / "step_000002").mkdir()  # an interrupted save: no manifest
    assert resume_path(args) is None
    ctx = ParallelContext.serial()
    cfg, _, model, _, batch_at = build(ctx, dict(plan="none", max_steps=1))
    train(model, batch_at, cfg, ctx, checkpointing=Checkpointing(save_dir=str(tmp_path)))
    assert resume_path(args) == str(tmp_path)
    cfg, _, model, _, _ = build(ctx, dict(plan="none", max_steps=1))
    trainer = Trainer(model, cfg, ctx)
    assert load_checkpoint(resume_path(args), model, trainer.optimizer, trainer.schedule, ctx).step == 1


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
