"""galaxy.cli.plan (``plan_galaxy.py``): one-line errors, ``--validate`` (the top plans run through the CLIs,
the fastest measured written), the written plan trains, and the profile subcommand on three local ranks."""

import json
import math

import pytest

from galaxy.config import GalaxyConfig
from galaxy.planner.cluster import OPS, candidate_groups, load_cluster
from tests.planner.helpers import BERT, synthetic_cluster


def test_cli_bad_cluster_is_one_line(tmp_path, capsys):
    from galaxy.cli.plan import main

    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps({"version": 1, "world": 2}))
    code = main(["--model", "bert-tiny", "--cluster", str(bad), "--out", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "key 'rows' is missing" in err


def test_validate_under_a_launcher_is_one_line(tmp_path, capsys, monkeypatch):
    """Under torchrun every rank would run the search and launch every plan: refused before either."""
    from galaxy.cli.plan import main

    cluster, model = tmp_path / "cluster.json", tmp_path / "model.json"
    synthetic_cluster(BERT, 2, [1.0, 1.0]).save(str(cluster))
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 8, "global_batch_size": 2}}))
    monkeypatch.setenv("WORLD_SIZE", "4")
    code = main(["--model", str(model), "--cluster", str(cluster), "--out", str(tmp_path / "plan.json"),
                 "--validate", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "run plan_galaxy.py with python" in err
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("objective", ["latency", "train"])
def test_validate_runs_the_top_plans_through_the_clis(tmp_path, capsys, objective):
    """``--validate 2`` runs the two best plans with infer_galaxy.py / pretrain_galaxy.py on local
    processes, puts each measured time beside its prediction (table and JSON) and writes the faster of the
    two as the plan. One launch each: several launches per plan, taking turns, are
    test_validate_runs_take_turns_and_their_mean_and_largest_peak_are_kept's (a second real launch of the
    same plan added four processes here and checked nothing those do not)."""
    from galaxy.cli.plan import main

    cluster = synthetic_cluster(BERT, 2, [1.0, 1.0], seq=16, alpha=1e-5, beta=1e-10)
    cluster.save(str(tmp_path / "cluster.json"))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 2}}))
    out = tmp_path / "plan.json"
    assert main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"), "--out", str(out),
                 "--objective", objective, "--validate", "2", "--validate_steps", "2", "--validate_runs", "1",
                 "--top", "3"]) == 0
    printed = capsys.readouterr().out
    assert "measured_ms" in printed and "error" in printed
    rows = json.loads((tmp_path / "plan.plans.json").read_text())["plans"]
    assert all(r["measured_ms"] > 0 for r in rows[:2]) and rows[2]["measured_ms"] is None, rows
    peaks = [r["measured_peak_mb_rank0"] for r in rows]
    assert (all(p > 0 for p in peaks[:2]) if objective == "train" else peaks[:2] == [None, None]) and peaks[2] is None
    # the plan written is the fastest of those measured, whichever the model ranked first
    table = json.loads((tmp_path / "plan.plans.json").read_text())
    fastest = min(range(2), key=lambda i: rows[i]["measured_ms"])
    assert table["picked"] == fastest and json.loads(out.read_text()) == table["configs"][fastest]
    assert f"the fastest validated plan (rank {rows[fastest]['rank']}" in printed


def test_validate_writes_the_fastest_measured_plan_not_the_first_predicted(tmp_path, capsys, monkeypatch):
    """The model ranks the plans; among those ``--validate`` ran, the measured fastest is the plan written (here
    the second: the launches are replaced by fixed times, the first plan measured slowest)."""
    from galaxy.cli import plan as plan_cli

    cluster = synthetic_cluster(BERT, 2, [1.0, 1.0], seq=16, alpha=1e-5, beta=1e-10)
    cluster.save(str(tmp_path / "cluster.json"))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 2}}))
    launched = []

    def measure(config, world, args):
        launched.append(config)
        return plan_cli.Measured([0.3, 0.1, 0.2][len(launched) - 1], 1.0)
    monkeypatch.setattr(plan_cli, "validate", measure)
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"), "--out", str(out),
                          "--validate", "3", "--top", "3"]) == 0
    table = json.loads((tmp_path / "plan.plans.json").read_text())
    assert [r["measured_ms"] for r in table["plans"]] == [300.0, 100.0, 200.0] and table["picked"] == 1
    assert json.loads(out.read_text()) == table["configs"][1] == launched[1] != table["configs"][0]


def test_validate_runs_take_turns_and_their_mean_and_largest_peak_are_kept(tmp_path, capsys, monkeypatch):
    """``--validate_runs 2``: each validated plan is launched twice, the plans taking turns (first, second,
    third, then again); a plan's measured time is the mean of its launches, its peak the largest, a launch that
    failed (None) is left out of both, and a plan whose every launch failed is not measured (the launches are
    replaced by fixed results)."""
    from galaxy.cli import plan as plan_cli

    cluster = synthetic_cluster(BERT, 2, [1.0, 1.0], seq=16, alpha=1e-5, beta=1e-10)
    cluster.save(str(tmp_path / "cluster.json"))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 2}}))
    launched = []
    results = [plan_cli.Measured(0.3, 10.0), plan_cli.Measured(0.2, 20.0), None,
               plan_cli.Measured(0.5, 30.0), None, None]

    def measure(config, world, args):
        launched.append(config)
        return results[len(launched) - 1]
    monkeypatch.setattr(plan_cli, "validate", measure)
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"), "--out", str(out),
                          "--validate", "3", "--validate_runs", "2", "--top", "3"]) == 0
    table = json.loads((tmp_path / "plan.plans.json").read_text())
    assert launched == table["configs"][:3] * 2  # taking turns
    assert [r["measured_ms"] for r in table["plans"]] == [400.0, 200.0, None]
    assert [r["measured_peak_mb_rank0"] for r in table["plans"]] == [30.0, 20.0, None]
    assert table["picked"] == 1 and json.loads(out.read_text()) == table["configs"][1]


def test_validate_on_an_emulated_cluster_refuses_another_world(tmp_path, capsys):
    from galaxy.cli.plan import main

    synthetic_cluster(BERT, 2, [1.0, 1.0], seq=16).save(str(tmp_path / "cluster.json"))
    emulated = tmp_path / "emulated.json"
    emulated.write_text(json.dumps({"ranks": [{"compute_share": 0.5}] * 3}))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 2}}))
    code = main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"),
                 "--out", str(tmp_path / "plan.json"), "--validate", "1", "--emulate", str(emulated)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "has 3 ranks but the cluster file" in err, err


def train_two_steps(ctx, config):
    from galaxy.models import build_model
    from galaxy.train.loop import train
    from galaxy.data.pretraining import mlm_data

    cfg = GalaxyConfig.from_dict(config, {"max_steps": 2})
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    result = train(model, mlm_data(cfg)[0], cfg, ctx)
    return result.losses


def test_written_plan_loads_and_trains(tmp_path, dist_pool, capsys):
    from galaxy.cli.plan import main

    cluster = synthetic_cluster(BERT, 2, [1.0, 2.0], seq=16, alpha=1e-5, beta=1e-10)
    cluster.save(str(tmp_path / "cluster.json"))
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 16, "global_batch_size": 4}}))
    out = tmp_path / "plan.json"
    assert main(["--model", str(model), "--cluster", str(tmp_path / "cluster.json"), "--out", str(out),
                 "--ffn_unit", "8"]) == 0
    assert "predicted_ms" in capsys.readouterr().out
    table = json.loads((tmp_path / "plan.plans.json").read_text())
    assert table["configs"][0] == json.loads(out.read_text())
    times = [p["predicted_ms"] for p in table["plans"]]
    assert times == sorted(times)
    # the best plan, and the best one that splits the model over both ranks, train as written
    GalaxyConfig.from_file(str(out))
    split = next(c for c in table["configs"] if c["parallel"]["dp_size"] * c["parallel"]["pp_size"] == 1)
    for config in (table["configs"][0], split):
        par = config["parallel"]
        world = len(config.get("distributed", {}).get("devices") or [0, 1])
        losses = dist_pool.run(train_two_steps, world, config, dp=par["dp_size"], pp=par["pp_size"])[0]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_profiler_on_three_ranks(tmp_path):
    """Three local ranks (the CLI's own launch): every subgroup a plan can use is created and timed.
    It hung once: members that had created different numbers of groups named the next one apart."""
    from tests.in_process import run_script

    model = tmp_path / "model.json"
    model.write_text(json.dumps({"model": BERT, "train": {"seq_length": 8, "global_batch_size": 2}}))
    out = tmp_path / "cluster.json"
    # in this process (tests.in_process); the three ranks are processes of their own
    run = run_script(["plan_galaxy.py", "profile", "--model", str(model), "--world", "3", "--rows", "2", "--reps", "1",
                      "--window_ms", "0", "--out", str(out)], timeout=90)
    assert run.returncode == 0, run.stderr[-2000:]
    cluster = load_cluster(str(out))
    assert cluster.world == 3 and set(cluster.groups) == set(candidate_groups(3)) == {(0, 1, 2), (0, 1), (1, 2), (0, 2)}
    for group in cluster.groups:
        assert all(cluster.collective(group, op).beta_s_per_byte >= 0 for op in OPS)
