"""``bench/bench_peft_mp.py``: on CPU + Gloo at world 2 and 4, tiny GQA shapes, one launch yields a row for every
contender asked for, each doing the same work (the global batch, counted where the token ids enter the model),
the TP rows holding their shard of the base; and what the bench trains on a plan is what the serial LoRA (and
QLoRA) trains, in float64, through the same builder and Trainer steps."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from tests import REPO

sys.path.insert(0, REPO)

from bench.bench_peft_mp import SCENARIOS, contender_names, peft_contender, ratios, select  # noqa: E402


def bench(tmp_path, world, contenders):
    out = tmp_path / f"peft_{world}.json"
    run = subprocess.run([sys.executable, "bench/bench_peft_mp.py", "--cpu", "--world", str(world), "--scenario",
                          "smoke", "--warmup", "0", "--iters", "1", "--contenders", contenders, "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


@pytest.mark.parametrize("world,contenders", [(2, "*-none,*-tp,*-galaxy,*-galaxy2,*-sp,qlora-galaxy+recompute"),
                                               (4, "lora-tp,qlora-tp,lora-galaxy,qlora-galaxy2")])
def test_every_mode_runs_and_does_the_same_work(tmp_path, world, contenders):
    report, stdout = bench(tmp_path, world, contenders)
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == select(contenders) and report["world"] == world
    batch, seq = SCENARIOS["smoke"]["global_batch"], SCENARIOS["smoke"]["seq"]
    assert report["facts"]["tokens_per_step"] == batch * seq and "4*N" in report["facts"]["mfu_formula"]
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["gpus"] == (1 if "-none" in name else world) and r["plan"] == name.split("-")[1].split("+")[0], name
        assert r["recompute"] == ("full" if name.endswith("+recompute") else "none"), name
        assert (r["sequences_per_step"], r["tokens_per_step"]) == (batch, batch * seq), name
        assert r["tokens_per_s_per_gpu"] * r["gpus"] == pytest.approx(r["tokens_per_s"], rel=1e-12), name
        assert r["host_peak_mib"] > 0 and r["frozen_mib"] > 0 and r["peak_mib"] is None, name  # no GPU memory here
        assert (r["comm_bytes"] > 0) == (r["gpus"] > 1), name
        # the frozen base in its format: bf16, or NF4 linears beside bf16 embeddings and head
        assert r["frozen_bytes_per_weight"] == 2.0 if name.startswith("lora") else r["frozen_bytes_per_weight"] < 1.5
    if world == 2:  # TP shards the linears: each rank holds less of the base than the one-GPU row
        assert rows["lora-tp"]["frozen_mib"] < 0.7 * rows["lora-none"]["frozen_mib"]
        assert rows["qlora-tp"]["frozen_mib"] < rows["qlora-none"]["frozen_mib"]  # (whole bf16 embeddings and head)
    assert "tok/s/GPU" in stdout and "peak MiB/GPU" in stdout


def test_contenders_and_ratios():
    assert select("lora-*") == ["lora-none", "lora-tp", "lora-galaxy", "lora-galaxy2", "lora-sp",
                                "lora-none+recompute", "lora-tp+recompute", "lora-galaxy+recompute",
                                "lora-galaxy2+recompute", "lora-sp+recompute"]
    assert set(contender_names()) == set(select("*"))
    with pytest.raises(ValueError, match="matches none"):
        select("lora-megatron")
    rows = [{"name": "lora-tp", "peak_mib": 200.0}, {"name": "qlora-tp", "peak_mib": 80.0},
            {"name": "qlora-none", "peak_mib": 50.0}, {"name": "lora-none", "error": "out of memory"},
            {"name": "qlora-tp+recompute", "peak_mib": 30.0}, {"name": "lora-tp+recompute", "peak_mib": 100.0}]
    ratios(rows)
    assert rows[1]["qlora_over_lora"] == 0.4 and "qlora_over_lora" not in rows[2]
    assert rows[4]["qlora_over_lora"] == 0.3
    from bench.bench_peft_mp import main
    with pytest.raises(SystemExit):
        main(["--contenders", "full-tp"])


def trained_as_serial(ctx, method, plan, suffix=""):
    """The bench's contender on ``plan`` (this pool's ranks) and on one rank, 3 Trainer steps each in float64:
    every trainable parameter the same (gathered), every frozen one unmoved."""
    import torch

    from galaxy.core.context import ParallelContext
    from galaxy.core.grad_sync import gather_full
    from tests.core.test_llama_equivalence import RTOL, rel_err

    args = argparse.Namespace(dtype="float64", micro_batch=None)
    shape = SCENARIOS["smoke"]
    serial = peft_contender(f"{method}-none", args, shape, ParallelContext.serial())
    par = peft_contender(f"{method}-{plan}{suffix}", args, shape, ctx)
    before = {n: p.detach().clone() for n, p in serial.entry.named_parameters()}
    for _ in range(3):
        serial.step()
        par.step()
    want = dict(serial.entry.named_parameters())
    worst, moved = 0.0, 0
    for name, p in par.entry.named_parameters():
        full = gather_full(p.detach(), p, ctx.mp)
        assert full.dtype == torch.float64 and p.requires_grad == want[name].requires_grad, name
        if not p.requires_grad:
            assert torch.equal(want[name].detach(), before[name]), name
            continue
        moved += not torch.equal(want[name].detach(), before[name])
        err = rel_err(full, want[name].detach(), floor=1e-2)
        assert err < RTOL, f"{method} on {plan}: {name} after 3 steps: relative error {err:.2e}"
        worst = max(worst, err)
    trainable = [n for n, p in want.items() if p.requires_grad]
    assert moved == len(trainable) == 2 * 2 * shape["layers"], (moved, trainable)  # A and B of q and v, every layer
    for prepared in (serial, par):
        for undo in prepared.teardown:
            undo()
    return worst


@pytest.mark.parametrize("world,plans", [(2, ("tp", "galaxy", "galaxy2")), (4, ("tp", "galaxy"))])
@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_the_bench_trains_on_a_plan_as_serial(dist_pool, method, world, plans):
    for plan in plans:
        assert max(dist_pool.run(trained_as_serial, world, method, plan)) < 1e-9
    if world == 2:  # each layer recomputed in backward: the same training
        assert max(dist_pool.run(trained_as_serial, world, method, "galaxy", "+recompute")) < 1e-9
