"""The pretraining CLIs as a user runs them: shipped configs, launch modes, bad input."""

import json
import os
import subprocess
import sys

import pytest

from galaxy.cli.pretrain import main
from tests.dist_pool import free_port
from tests import REPO  # noqa: E402
from tests.in_process import run_script

ROOT = REPO
FAST = ["--max_steps", "2", "--no_progress", "--override", "global_batch_size=4"]


def run(args, env=None, timeout=240):
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable] + args, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("script,config,world", [
    ("pretrain_bert.py", "train_config/bert/full.json", 1),
    ("pretrain_tp_bert.py", "train_config/bert/tp/full.json", 2),
    ("pretrain_sp_bert.py", "train_config/bert/sp/full.json", 2),
    ("pretrain_galaxy.py", "train_config/bert/galaxy/full.json", 2),
    ("pretrain_galaxy.py", "train_config/bert/galaxy/galaxy2.json", 2),
    ("pretrain_galaxy.py", "train_config/bert/galaxy/uneven.json", 3),
    # dp / pp around the plans, on shorter sequences to stay quick with 4 processes on a small machine
    ("pretrain_dp_bert.py", "train_config/bert/dp/full.json", 2),
    ("pretrain_dp_bert.py", "train_config/bert/dp/galaxy.json", 4),
    ("pretrain_pp_bert.py", "train_config/bert/pp/galaxy.json", 4),
    ("pretrain_dp_bert.py", "train_config/bert/dp/lora.json", 2),
    ("pretrain_dp_bert.py", "train_config/bert/dp/adapter.json", 2),
    ("pretrain_dp_bert.py", "train_config/bert/dp/side.json", 2),
    ("pretrain_pp_bert.py", "train_config/bert/pp/lora.json", 2),
    ("pretrain_pp_bert.py", "train_config/bert/pp/adapter.json", 2),
])
def test_shipped_configs_run(tmp_path, script, config, world):
    metrics = tmp_path / "m.jsonl"
    short = ["--override", "seq_length=32"] if "/dp/" in config or "/pp/" in config else []
    # in this process (tests.in_process): the script as __main__, its ranks still processes of their own
    out = run_script([script, "--config_file", config, "--world", str(world), "--metrics_file", str(metrics)]
                     + FAST + short)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pretraining summary" in out.stdout
    lines = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2]
    assert {"step", "loss", "tokens_per_s", "step_time_s", "peak_mem_mb"} <= set(lines[0])


@pytest.mark.parametrize("shells", [1, 2])
def test_pipeline_cli_trains_with_a_falling_loss(tmp_path, shells):
    """``--world 2`` alone, and ``--world 2 --rank 0`` / ``--rank 1`` as two shells would start them."""
    metrics = tmp_path / "m.jsonl"
    args = ["pretrain_pp_bert.py", "--config_file", "train_config/bert/pp/full.json", "--world", "2",
            "--max_steps", "5", "--no_progress", "--metrics_file", str(metrics),
            "--override", "global_batch_size=8", "--override", "seq_length=32", "--override", "warmup_steps=2"]
    if shells == 1:
        out = run_script(args)
        assert out.returncode == 0, out.stderr[-3000:]
        stdout = out.stdout
    else:
        # One thread each: two ranks on a small machine must not oversubscribe its cores.
        env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable] + args + ["--rank", str(r)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
        assert "pretraining summary" not in outs[1][0], "rank 0 reports"
        stdout = outs[0][0]
    assert "pretraining summary" in stdout and "bubble_analytic" in stdout and "0.2" in stdout
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("rank,needle", [(0, "rank(s) [1] did not join"), (1, "rank 0 (the master) did not answer")])
def test_a_missing_rank_is_named_within_the_timeout(rank, needle):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = run(["pretrain_galaxy.py", "--world", "2", "--rank", str(rank), "--override", "timeout_s=1"], env=env)
    assert out.returncode != 0
    assert needle in out.stderr and "within 1s" in out.stderr, out.stderr[-2000:]  # the rank's own deadline


@pytest.mark.parametrize("argv,needle", [
    (["--override", "hiden_size=64"], "did you mean 'hidden_size'"),
    (["--override", "dropout"], "must look like KEY=VALUE"),
    (["--config_file", "train_config/bert/galaxy/uneven.json", "--world", "2"],
     "has 3 entries but the model-parallel group has 2"),
    (["--config_file", "missing.json"], "does not exist"),
    (["--world", "2", "--rank", "2"], "--rank 2 is outside --world 2"),
    (["--world", "64"], "world size 64 cannot be used"),
    (["--override", "att_parallel_method=XP"], "unknown parallel method 'XP'"),
    (["--config_file", "train_config/bert/pp/full.json", "--world", "3"],
     "world size 3 is not divisible by dp_size x pp_size = 1 x 2 = 2"),
    (["--config_file", "train_config/bert/pp/full.json", "--override", "stage_num_hidden_layers_list=[1,2,1]"],
     "'stage_num_hidden_layers_list' has 3 entries but pp_size is 2"),
    (["--config_file", "train_config/bert/pp/full.json", "--override", "stage_num_hidden_layers_list=[1,2]"],
     "sums to 3 but num_hidden_layers is 4"),
    (["--config_file", "train_config/bert/pp/full.json", "--override", "num_microbatches=3"],
     "'num_microbatches' (3) does not divide the 16 rows"),
    (["--config_file", "train_config/bert/dp/full.json", "--override", "global_batch_size=5"],
     "not divisible into dp_size=2 data-parallel shards"),
    (["--config_file", "train_config/bert/dp/full.json", "--world", "2", "--override", "dp_engine=deepspeed",
      "--override", "device=cpu"], "DeepSpeed ZeRO needs CUDA GPUs"),
    (["--config_file", "train_config/bert/pp/full.json", "--override", "pipeline_schedule=zb"],
     "'pipeline_schedule': 'zb' is not one of gpipe, 1f1b"),
])
def test_bad_input_is_one_clear_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_plan_specific_cli_refuses_another_plan(capsys):
    assert main(["--config_file", "train_config/bert/galaxy/full.json"], plan="tp", strict=True) == 2
    assert "runs the 'tp' plan" in capsys.readouterr().err
    assert main(["--world", "2"], plan="none", strict=True) == 2
    assert "serial CLI runs on one rank" in capsys.readouterr().err


def test_help_lists_every_common_flag():
    out = run_script(["pretrain_galaxy.py", "--help"])
    assert out.returncode == 0, out.stderr
    for flag in ("--config_file", "--world", "--rank", "--max_steps", "--seed", "--metrics_file", "--model_path",
                 "--data", "--override"):
        assert flag in out.stdout
