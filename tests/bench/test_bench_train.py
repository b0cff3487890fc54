"""``bench/bench_train.py`` on CPU + Gloo at world 2, tiny shapes: one launch yields a row for every contender
asked for (a time or a one-line reason); every contender that runs does the same work per optimizer step (the
global batch's sequences and tokens, counted where the token ids enter the model, not read from its config);
the rows carry tokens/s (per GPU) and MFU (null on CPU, with the reason); the comm bytes it reads from the
dispatcher for Galaxy's plans equal what Galaxy's own metrics report for the same step; a global batch a
recipe cannot reach is refused in its row."""

import json
import math
import os
import subprocess
import sys
import time

import pytest

from tests import REPO

ROOT = REPO
sys.path.insert(0, ROOT)

from bench.bench_train import Batching, DEFAULT_CONTENDERS, SCENARIOS, Unavailable, contender_names, select  # noqa: E402

# Compiling on two shared CPU cores takes minutes: the inductor-compiled contenders run in the GPU smoke
# (bench/device/train_harness.sh 1 smoke) instead. The FSDP2 recipes stay, compiled with the eager backend
# (dynamo traces every block, no code generation): the wiring of compile + fully_shard is what is checked.
# megatron-tp-sp(-overlap) stop where megatron-tp does on CPU (the import, or CUDA): left out to save time.
# fsdp2-cp (torch's context_parallel) shards CUDA's attention kernels only: its CPU row has its own test.
SKIP = "serial-compiled,galaxy-*+compile,native-tp-sp-compiled,native-tp-sp-asynctp,megatron-tp-sp*,fsdp2-cp"
# Galaxy's own dp axis, per row (the fsdp2 engine's row is also the fake-world test's real rank)
VARIANTS = "galaxy-galaxy@dp2,galaxy-galaxy@dp2-fsdp2"
SMOKE = ("--cpu", "--scenario", "smoke", "--warmup", "0", "--iters", "1", "--compile_backend", "eager")

# Each launch costs seconds of CPU before its first contender (torch and Galaxy imported by the launcher, Gloo
# joined): tests that read the same launch share it (module-scoped fixtures below).


def bench(tmp_path, *flags, world=2):
    out = tmp_path / "train.json"
    run = subprocess.run([sys.executable, "bench/bench_train.py", "--world", str(world), *SMOKE, "--json", str(out),
                          *flags],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


@pytest.fixture(scope="module")
def every_contender(tmp_path_factory):
    """One launch of every contender that runs on CPU (and Galaxy's dp variants), 1 step each: the same-work test
    reads all its rows, the fake-world test the real world's rows of its contenders."""
    return bench(tmp_path_factory.mktemp("every"), "--contenders", "*," + VARIANTS, "--skip", SKIP)


def test_every_contender_does_the_same_work_and_reports_it(every_contender):
    report, stdout = every_contender
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == select("*," + VARIANTS, SKIP) and report["world"] == 2
    batch, seq = SCENARIOS["smoke"]["global_batch"], SCENARIOS["smoke"]["seq"]
    facts = report["facts"]
    assert facts["global_batch"] == batch and facts["tokens_per_step"] == batch * seq
    assert "6*N + 12*L*H*S" in facts["mfu_formula"] and facts["model_flops_per_token"] > 0
    assert facts["peak_tflops"] is None and "cpu" in facts["peak_source"]
    for name, r in rows.items():
        if "error" in r:  # a contender that cannot run here says why, in one line
            assert r["error"].strip() and "\n" not in r["error"], name
            assert not name.startswith(("galaxy", "serial-eager", "native-tp-sp-eager", "fsdp2")), (name, r["error"])
            if name.startswith("megatron"):
                assert "megatron-core" in r["error"], r["error"]  # not installed here, or CUDA only
            continue
        assert r["median_ms"] > 0 and r["min_ms"] <= r["median_ms"] <= r["max_ms"], name
        # the same work: the global batch, however the recipe splits it, as counted at the model's input
        assert r["global_batch"] == batch and r["dp"] * r["micro_batch"] * r["accumulation"] == batch, (name, r)
        assert (r["sequences_per_step"], r["tokens_per_step"]) == (batch, batch * seq), (name, r)
        assert r["gpus"] == r["ranks"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / (r["median_ms"] / 1e3), rel=1e-9), name
        assert r["tokens_per_s_per_gpu"] * r["gpus"] == pytest.approx(r["tokens_per_s"], rel=1e-12), name
        assert r["mfu"] is None and "cpu" in r["mfu_reason"], name
        if name.startswith("galaxy-") and r["ranks"] == 2:
            assert r["comm_bytes"] > 0 and r["comm_bytes"] == r["comm_bytes_metrics"], name
            assert r["comm_bytes_per_rank"] == [r["comm_bytes"]] * 2, name
    # how each reaches the global batch of 4 at world 2
    layout = {n: (rows[n]["dp"], rows[n]["accumulation"]) for n in
              ("serial-eager", "galaxy-tp", "native-tp-sp-eager", "fsdp2-compile", "fsdp2-tp", "galaxy-galaxy@dp2")}
    assert layout == {"serial-eager": (1, 4), "galaxy-tp": (1, 4), "native-tp-sp-eager": (1, 4),
                      "fsdp2-compile": (2, 2), "fsdp2-tp": (1, 4), "galaxy-galaxy@dp2": (2, 2)}
    assert rows["fsdp2-tp"]["tp"] == 2 and rows["fsdp2-compile-noreshard"]["reshard_after_forward"] is False
    assert rows["serial-eager"]["comm_bytes"] == 0 and rows["galaxy-none"]["comm_bytes"] == 0
    assert rows["native-tp-sp-eager"]["comm_bytes"] > 0 and rows["fsdp2-compile"]["comm_bytes"] > 0
    # PARTIAL gradients are reduced inside the step: galaxy2 moves more than tp (its replicated MLP weights)
    assert rows["galaxy-galaxy2"]["comm_bytes"] > rows["galaxy-tp"]["comm_bytes"]
    assert "native-tp-sp-eager" in stdout and "tok/s/GPU" in stdout  # the table for people


ALIKE = ("galaxy-none,galaxy-tp,galaxy-galaxy,galaxy-galaxy2-sharded,galaxy-galaxy@dp2,serial-eager,"
         "native-tp-sp-eager")


def alike_losses(tmp_path, lr, contenders=ALIKE, world=2):
    """Every step's loss of each of ``contenders`` (3 steps, float32, learning rate ``lr``), and the report."""
    report, _ = bench(tmp_path, "--contenders", contenders, "--dtype", "float32", "--iters", "3", "--lr", lr,
                      world=world)
    rows = {r["name"]: r for r in report["rows"]}
    assert all("error" not in r and len(r["losses"]) == 3 for r in rows.values()), rows
    return {n: r["losses"] for n, r in rows.items()}, report


# Two contenders at 2 rows per micro-batch beside the others' 1 (``name:mb<R>``), in the same launch: the rows test's.
OWN_ROWS = "galaxy-tp:mb2,fsdp2-compile:mb2"


@pytest.fixture(scope="module")
def alike_trained(tmp_path_factory):
    """The ALIKE rows and OWN_ROWS' trained at a learning rate of 1e-2: the alike test's rows, the rows test's, and
    the float8 test's un-converted run (galaxy-none, float32, 1e-2)."""
    return alike_losses(tmp_path_factory.mktemp("alike"), "1e-2", f"{ALIKE},{OWN_ROWS}")


def test_rows_that_start_alike_train_alike(alike_trained, tmp_path):
    """Each row's ``losses`` (every step's loss, read after the timing): Galaxy's plans, gradient reductions and
    dp layouts start from the same weights and read the same batches, so in float32 their losses agree at every
    step, and so do the plain model's serial and tensor-parallel rows; a row whose gradients were wrong would
    part from them at its second step (the check's reach: the same rows at a learning rate of ~0 part by more
    than 100 times the tolerance by the third step). On GPUs the same column shows a row that trains another
    model (as compiled one-row micro-batches did on 2 x H200: bench/device/microbatch_check.sh)."""
    trained = alike_trained[0]
    for name, got in trained.items():
        reference = trained["serial-eager" if name.startswith(("serial", "native", "fsdp2")) else "galaxy-none"]
        assert got == pytest.approx(reference, rel=1e-4), name
    # the reach is read on galaxy-none, which runs on rank 0 by itself: a launch of that one rank
    still = alike_losses(tmp_path, "1e-9", "galaxy-none", world=1)[0]
    assert abs(still["galaxy-none"][2] - trained["galaxy-none"][2]) > 100 * 1e-4 * trained["galaxy-none"][2]


def test_float8_rows_train_galaxy_and_the_fsdp2_anchor_in_float8(tmp_path, alike_trained):
    """``--float8 rowwise``: Galaxy's rows (float8_training) and the fsdp2-compile anchor (torchao's
    convert_to_float8_training, as torchtitan) state it and train; float8 moves Galaxy's losses off the
    un-converted run's, and an anchor that cannot take it (fsdp2-tp: float8 TP styles not wired) says why."""
    names = "galaxy-none,galaxy-tp,galaxy-galaxy@dp2-fsdp2,fsdp2-compile,fsdp2-tp"
    report, _ = bench(tmp_path, "--contenders", names, "--dtype", "float32", "--iters", "2", "--lr", "1e-2",
                      "--float8", "rowwise")
    # the un-converted run: the alike launch's galaxy-none (float32, lr 1e-2; its second step is this launch's)
    plain = alike_trained[1]
    assert plain["rows"][0]["name"] == "galaxy-none" and plain["dtype"] == "float32"
    rows = {r["name"]: r for r in report["rows"]}
    assert report["facts"]["float8"] == "rowwise" and report["facts"]["torchao"]
    assert "float8 with TP" in rows["fsdp2-tp"]["error"]
    for name in ("galaxy-none", "galaxy-tp", "galaxy-galaxy@dp2-fsdp2", "fsdp2-compile"):
        assert "error" not in rows[name] and rows[name]["float8"] == "rowwise", rows[name]
        assert all(math.isfinite(x) for x in rows[name]["losses"]), rows[name]
    assert rows["galaxy-tp"]["losses"] == pytest.approx(rows["galaxy-none"]["losses"], rel=1e-2)
    assert rows["galaxy-none"]["losses"][1] != plain["rows"][0]["losses"][1]


def test_each_contender_at_its_own_rows_in_one_launch(alike_trained):
    """``name:mb<R>``: that contender runs R rows per micro-batch, the others ``--micro_batch`` (1), in one launch
    (each recipe at its best setting); the same plan at 2 rows and at 1 trains alike (the same global batch). The
    launch is the alike rows' (OWN_ROWS among them: a launch of its own cost seconds of CPU to start)."""
    rows = {r["name"]: r for r in alike_trained[1]["rows"]}
    assert list(rows) == f"{ALIKE},{OWN_ROWS}".split(",")
    assert all("error" not in r for r in rows.values()), rows
    layout = {n: (rows[n]["dp"], rows[n]["micro_batch"], rows[n]["accumulation"])
              for n in ("galaxy-tp:mb2", "galaxy-tp", "fsdp2-compile:mb2")}
    assert layout == {"galaxy-tp:mb2": (1, 2, 2), "galaxy-tp": (1, 1, 4), "fsdp2-compile:mb2": (2, 2, 1)}
    assert rows["galaxy-tp:mb2"]["losses"] == pytest.approx(rows["galaxy-tp"]["losses"], rel=1e-4)


def test_a_fake_world_runs_the_program_of_one_rank_of_a_real_one(tmp_path, every_contender):
    """``--fake_world 2``: this one process plays rank 0 of 2 over torch's fake process group (what a rank of a
    2-GPU launch allocates, measured on one GPU). It runs the program rank 0 runs in a real world of 2: the same
    layout, the same collectives of the same sizes (counted where they are dispatched), the whole global batch
    accounted for (rank 0's dp share times dp)."""
    probe = ("import torch, torch.distributed as dist; "
             "from torch.testing._internal.distributed.fake_pg import FakeStore; "
             "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2); "
             "out = torch.full((2,), -1.0); dist.reduce_scatter_tensor(out, torch.ones(4)); print(out.tolist())")
    wrote = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if wrote.stdout.strip() != "[1.0, 1.0]":  # torch 2.11's leaves it as it was: gradients of garbage, non-finite
        pytest.skip(f"this torch's fake reduce-scatter does not write its output "
                    f"({wrote.stdout.strip() or wrote.stderr[-200:]})")
    names = "galaxy-galaxy@dp2-fsdp2,fsdp2-compile,galaxy-tp"
    # the real world of 2: these contenders' rows of the every-contender launch (the same flags, 1 step)
    every = {r["name"]: r for r in every_contender[0]["rows"]}
    real = {"rows": [every[n] for n in names.split(",")]}
    out = tmp_path / "fake.json"
    run = subprocess.run([sys.executable, "bench/bench_train.py", "--fake_world", "2", *SMOKE, "--contenders", names,
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    fake = json.loads(out.read_text())
    assert fake["world"] == 2 and fake["facts"]["fake_world"] == 2 and "fake process group" in run.stdout
    for r, f in zip(real["rows"], fake["rows"]):
        assert "error" not in r and "error" not in f, (r, f)
        for key in ("ranks", "dp", "micro_batch", "accumulation", "sequences_per_step", "tokens_per_step"):
            assert f[key] == r[key], (f["name"], key)
        assert f["comm_bytes"] == r["comm_bytes_per_rank"][0] > 0, f["name"]
    with pytest.raises(SystemExit):
        from bench.bench_train import main
        main(["--fake_world", "2", "--world", "2"])


def test_a_global_batch_out_of_reach_is_refused():
    """Refused before anything is built or any collective runs (run_contender makes it the row's error)."""
    import argparse

    import torch

    from bench.bench_train import build
    from galaxy.core.context import Communicator, ParallelContext

    args = argparse.Namespace(micro_batch=2, dtype="float32", compile_backend="eager")
    shape = dict(SCENARIOS["smoke"], global_batch=3)
    world2 = ParallelContext(rank=0, world_size=2, device=torch.device("cpu"), seed=0, mp=Communicator("mp"))
    for name, ctx, why in (("fsdp2-compile", world2, "cannot be split evenly over 2 data-parallel ranks"),
                           ("galaxy-tp@dp2", world2, "cannot be split evenly over 2 data-parallel ranks"),
                           ("galaxy-none", ParallelContext.serial(), "not a multiple of --micro_batch 2"),
                           ("serial-eager", ParallelContext.serial(), "not a multiple of --micro_batch 2")):
        with pytest.raises(Unavailable, match=why):
            build(name, args, shape, ctx)


def test_batching():
    assert Batching.reach(16, 4, 1) == Batching(16, 4, 1, 4)
    assert Batching.reach(16, 1, 2) == Batching(16, 1, 2, 8)
    with pytest.raises(Unavailable):
        Batching.reach(16, 3, 1)
    with pytest.raises(Unavailable):
        Batching.reach(16, 4, 3)


def test_contender_selection():
    names = contender_names()
    assert len(names) == len(set(names))
    assert select("galaxy-galaxy2*", "*+compile") == ["galaxy-galaxy2", "galaxy-galaxy2-overlap",
                                                      "galaxy-galaxy2-sharded", "galaxy-galaxy2-fsdp"]
    assert "galaxy-tp-overlap" not in names  # tp has no PARTIAL gradients to reduce differently
    assert select(DEFAULT_CONTENDERS, "") == DEFAULT_CONTENDERS.split(",")  # in the order given: megatron-dp last
    assert select("megatron-dp,galaxy-galaxy2-sharded*", "") == ["megatron-dp", "galaxy-galaxy2-sharded",
                                                                 "galaxy-galaxy2-sharded+compile"]
    assert select("fsdp2-tp@tp4,megatron-dp@tp1,galaxy-tp+compile@dp2-zero1", "") == [
        "fsdp2-tp@tp4", "megatron-dp@tp1", "galaxy-tp+compile@dp2-zero1"]
    from bench.bench_train import split_suffix
    base, suffix = split_suffix("galaxy-tp+compile@dp4-fsdp2-noreshard")
    assert base == "galaxy-tp+compile" and suffix.groups() == ("4", "fsdp2", "-noreshard", None)
    assert split_suffix("galaxy-tp@dp2-fsdp2-onesync")[1].groups() == ("2", "fsdp2", None, "-onesync")
    assert split_suffix("galaxy-tp@dp2")[1].groups() == ("2", None, None, None)
    # rows per micro-batch for one contender: kept on each name it selects
    assert select("fsdp2-compile:mb2,galaxy-tp+compile@dp2-fsdp2:mb4,galaxy-galaxy2-s*:mb1", "*+compile") == [
        "fsdp2-compile:mb2", "galaxy-tp+compile@dp2-fsdp2:mb4", "galaxy-galaxy2-sharded:mb1"]
    from bench.bench_train import main
    with pytest.raises(ValueError, match="'galaxy-none[+]compile' matches none"):  # not dropped beside a good name
        select("fsdp2-compile,galaxy-none+compile", "")
    for bad in ("no-such-contender", "galaxy-none@dp2", "fsdp2-compile@tp2", "galaxy-nope@dp2", "galaxy-tp:mb0",
                "galaxy-nope:mb2"):
        with pytest.raises(SystemExit):
            main(["--contenders", bad])


@pytest.mark.parametrize("flags", (["--cpu", "--memory_cap_gib", "70"], ["--memory_cap_gib", "0"]))
def test_a_memory_cap_is_refused_where_there_is_no_gpu_allocator_to_cap(flags, capsys):
    from bench.bench_train import main
    with pytest.raises(SystemExit):
        main(["--contenders", "serial-eager", *flags])
    assert "--memory_cap_gib caps a GPU's allocator" in capsys.readouterr().err


def _failing_contender(name, args, shape, ctx):
    """``everywhere`` fails on every rank as it is built; ``one-rank`` runs a step whose all-reduce rank 0 enters
    while rank 1 cannot allocate (a real allocator failure, as one GPU out of memory); ``after`` would run next."""
    import torch
    import torch.distributed as dist

    from bench.bench_train import Batching, Prepared

    if name == "everywhere":
        raise ValueError("refused on every rank")

    def step():
        if name == "one-rank" and ctx.rank == 1:
            torch.empty(1 << 60, dtype=torch.uint8)
        total = torch.ones(1)
        dist.all_reduce(total)
        return total

    return Prepared(step, Batching.reach(2, 1, 1))


def _one_rank_fails_worker(rank, world, local_rank, args, init_method):
    import datetime

    from bench.bench_train import rank_context, run_rows

    ctx = rank_context(rank, world, local_rank, args, init_method)
    run_rows(["everywhere", "one-rank", "after"], args, dict(SCENARIOS["smoke"], global_batch=2), ctx, None, 1.0,
             _failing_contender, error_wait=datetime.timedelta(seconds=5))


def test_a_contender_failing_on_one_rank_ends_the_launch_instead_of_hanging():
    """A failure every rank meets is the row's error and the launch goes on; one rank's alone (the others
    inside the step's collective, waiting for it) ends the launch with that rank's row, within the wait."""
    code = ("import argparse; from bench.bench_coc import launch; "
            "from tests.bench.test_bench_train import _one_rank_fails_worker as w; "
            "launch(w, argparse.Namespace(cpu=True, world=2, warmup=0, iters=1), None, on_cpu=True)")
    t0 = time.time()
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert time.time() - t0 < 120 and run.returncode != 0, (run.returncode, run.stderr[-2000:])
    rows = [json.loads(line[4:]) for line in run.stdout.splitlines() if line.startswith("ROW ")]
    assert [r["name"] for r in rows[:2]] == ["everywhere", "one-rank"] and "after" not in str(rows), run.stdout
    assert rows[0]["error"] == "ValueError: refused on every rank"
    (failed,) = [r["error"] for r in rows if r["error"].startswith("rank 1: ")]
    assert "can't allocate memory" in failed and "the launch ends here" in failed


def _anchor_init_worker(rank, world, local_rank, args, init_method):
    """The FSDP2 anchor built at this world: each parameter's local shard against its slice of the serial init
    (drawn here on one rank's CPU), and the first step's loss; rank 0 writes both to ``args.out``."""
    import torch

    from bench.bench_train import PlainLM, fsdp2_contender, init_plain_weights, rank_context

    ctx = rank_context(rank, world, local_rank, args, init_method)
    shape = dict(SCENARIOS["smoke"])
    prepared = fsdp2_contender("fsdp2-compile", args, shape, ctx)
    serial = PlainLM(shape)
    init_plain_weights(serial, shape, torch.device("cpu"))
    slices = {}
    for (name, p), (_, whole) in zip(prepared.entry.named_parameters(), serial.named_parameters()):
        gathered = p.full_tensor()  # a collective: every rank, whatever its own shard holds
        mine = torch.chunk(whole.detach(), world, dim=0)[rank]
        slices[name] = bool(torch.equal(p.to_local(), mine)) and bool(torch.equal(gathered, whole))
    loss = float(prepared.step())
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"slices": slices, "first_loss": loss}, f)


def test_the_anchor_is_the_serial_init_sliced_whatever_its_world(tmp_path):
    """FSDP2's anchor at world 2 holds, on each rank, that rank's slice of one serial init (drawing into each local
    shard instead gave both dp ranks the same block: a model that depended on dp), and so its first loss over the
    global batch is the world-1 loss (float32)."""
    losses = {}
    # both worlds launched by one process (its imports paid once)
    code = ("import argparse, os; from bench.bench_coc import launch; "
            "from tests.bench.test_bench_train import _anchor_init_worker as w\n"
            "for world in (1, 2):\n"
            f"    out = os.path.join({str(tmp_path)!r}, f'world{{world}}.json')\n"
            "    launch(w, argparse.Namespace(cpu=True, world=world, out=out, micro_batch=1, dtype='float32', "
            "lr=1e-4, compile_backend='eager'), None, on_cpu=True)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    for world in (1, 2):
        out = tmp_path / f"world{world}.json"
        got = json.loads(out.read_text())
        assert got["slices"] and all(got["slices"].values()), got["slices"]
        losses[world] = got["first_loss"]
    assert losses[2] == pytest.approx(losses[1], rel=1e-6)


def test_long_sequence_rows_recompute_and_train_alike(tmp_path):
    """The long-sequence recipe at tiny shapes (``smoke-long``: grouped-query attention, every contender recomputing
    whole layers): the FSDP2 anchor (each block checkpointed, then compiled) and the plain model's tensor-parallel row
    train as the serial plain model does, Galaxy's sequence-sharded plan as Galaxy's serial one; context_parallel's
    anchor says in one line that it needs CUDA."""
    report, _ = bench(tmp_path, "--scenario", "smoke-long", "--contenders",
                      "serial-eager,fsdp2-compile,native-tp-sp-eager,galaxy-none,galaxy-sp,fsdp2-cp@cp2",
                      "--dtype", "float32", "--iters", "2")
    rows = {r["name"]: r for r in report["rows"]}
    assert report["shape"]["kv_heads"] == 2 and report["shape"]["recompute"] == "full"
    assert "CUDA" in rows["fsdp2-cp@cp2"]["error"] and "\n" not in rows["fsdp2-cp@cp2"]["error"]
    assert all("error" not in r for n, r in rows.items() if n != "fsdp2-cp@cp2"), rows
    assert rows["fsdp2-compile"]["activation_checkpointing"] is True
    for name in ("fsdp2-compile", "native-tp-sp-eager"):
        assert rows[name]["losses"] == pytest.approx(rows["serial-eager"]["losses"], rel=1e-5), name
    assert rows["galaxy-sp"]["losses"] == pytest.approx(rows["galaxy-none"]["losses"], rel=1e-5)
    best = report["summary"]
    assert best["best_galaxy"]["name"] in ("galaxy-none", "galaxy-sp") and "galaxy_over_anchor" in best


def test_a_sweep_runs_each_point_in_a_launch_of_its_own_and_keeps_failures_as_rows(tmp_path, capsys):
    """``--sweep_rows 1,2,4``: every contender at each R rows per micro-batch, each point its own launch; a point
    that cannot run (4 rows where a rank has 2 sequences) or whose launch is killed is a row saying why, and the
    report states each recipe at its best."""
    from bench.bench_train import main

    def sweep(tmp_path, *flags, world):
        """The sweep's own process is this one (it only starts the points' launches and reads their rows)."""
        out = tmp_path / "train.json"
        main(["--world", str(world), *SMOKE, "--json", str(out), *flags])
        return json.loads(out.read_text()), capsys.readouterr().out

    # The sweep's mechanics (a launch per point; a refused, failed or killed point a row) are the same at any world:
    # one rank and a global batch of 2 (a rank's 2 sequences, as at world 2 with 4) spare a process per point.
    one_rank = ("--global_batch", "2")
    report, stdout = sweep(tmp_path, "--contenders", "fsdp2-compile", "--sweep_rows", "1,2,4", *one_rank, world=1)
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["fsdp2-compile:mb1", "fsdp2-compile:mb2", "fsdp2-compile:mb4"]
    assert [rows[n]["micro_batch"] for n in list(rows)[:2]] == [1, 2]
    assert "not a multiple of --micro_batch 4" in rows["fsdp2-compile:mb4"]["error"]
    fastest = max(list(rows)[:2], key=lambda n: rows[n]["tokens_per_s_per_gpu"])
    assert report["summary"]["best_per_contender"] == {"fsdp2-compile": fastest}
    assert report["facts"]["sweep_rows"] == [1, 2, 4] and stdout.count("ROW ") >= 3
    killed, _ = sweep(tmp_path, "--contenders", "fsdp2-compile", "--sweep_rows", "2", "--sweep_timeout_s", "1",
                      *one_rank, world=1)
    (row,) = killed["rows"]
    assert row["name"] == "fsdp2-compile:mb2" and row["error"].startswith("killed after 1 s"), row
