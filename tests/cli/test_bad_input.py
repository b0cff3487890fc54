"""What a new user hits (issue 30, item 7): bad input gives one line and exit code 2, before any rank
starts where it can be checked, and once (not once per rank) where only a rank finds it; a resume says
where it continues from and its progress bar counts on from there."""

from __future__ import annotations

import os
import shutil

import pytest

from galaxy.cli import pretrain
from galaxy.cli.launch import Launch, launch_ranks
from galaxy.config import GalaxyConfig
from galaxy.errors import DataError
from tests.in_process import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--override", "seq_length=16", "--override", "global_batch_size=4"]


def run(args, timeout=300):
    """``python args`` in this process (tests.in_process: a new interpreter would only import torch and Galaxy
    again); the ranks a launch starts are processes of their own."""
    return run_script(args, cwd=ROOT, timeout=timeout)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    """A real save directory: two steps of the default BERT on one rank, one checkpoint (step 2)."""
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    out = run(["pretrain_galaxy.py", "--world", "1", "--max_steps", "2", "--no_progress", "--save_dir",
               str(directory), *TINY])
    assert out.returncode == 0, out.stderr[-3000:]
    assert os.listdir(directory) == ["step_000002"]
    return directory


def damaged_copy(save_dir, tmp_path, how: str):
    """A copy of the save directory whose only checkpoint has its tensor file truncated, or one byte
    flipped (same size: only the checksum of the file, which the ranks read, tells)."""
    copy = tmp_path / how
    shutil.copytree(save_dir, copy)
    shard = copy / "step_000002" / "__0_0.distcp"
    size = shard.stat().st_size
    if how == "truncated":
        os.truncate(shard, size - 10)
    else:
        with open(shard, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    return copy, shard


def refused_before_the_ranks(argv, capsys, monkeypatch) -> str:
    """The one line ``pretrain_galaxy.py argv`` prints, asserting exit code 2 and that no rank started."""
    def no_ranks(*_):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(pretrain, "launch_ranks", no_ranks)
    assert pretrain.main(argv) == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1, err
    return err[0]


# ----------------------------------------------------------------------------- before any rank starts


def test_async_tp_on_cpu(capsys, monkeypatch):
    line = refused_before_the_ranks(["--world", "2", "--override", "tp_overlap=async_tp", "--override",
                                     "device=cpu"], capsys, monkeypatch)
    assert line == ("error: config key 'tp_overlap' is 'async_tp', which runs on CUDA GPUs over NCCL (symmetric "
                    "memory), but this run uses device cpu; use tp_overlap coc or none")


def test_resume_of_a_path_that_does_not_exist(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nope"
    line = refused_before_the_ranks(["--world", "2", "--resume", str(missing)], capsys, monkeypatch)
    assert line == (f"error: --resume '{missing}' does not exist; pass a step_N checkpoint directory or the "
                    "--save_dir of an earlier run")


@pytest.mark.parametrize("content,says", [
    (b"", "is empty; add at least one non-blank line"),
    (b" \n\n\t\n", "is empty (only blank lines); add at least one non-blank line"),
    (b"caf\xc3\xa9 ok\nbad \xff byte\n", "is not UTF-8 (byte 0xff at offset 13, line 2); re-encode it as UTF-8"),
])
def test_data_file(tmp_path, capsys, monkeypatch, content, says):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    line = refused_before_the_ranks(["--world", "2", "--data", str(path)], capsys, monkeypatch)
    assert line == f"error: config key 'data' (--data): file '{path}' {says}"


@pytest.mark.parametrize("block", [1, 2, 3, 1 << 20])
def test_data_file_is_read_in_blocks(tmp_path, monkeypatch, block):
    """A character split between two blocks is whole; the bad byte's offset and line count over blocks."""
    from galaxy.data import files

    monkeypatch.setattr(files, "BLOCK", block)
    path = tmp_path / "corpus.txt"
    path.write_bytes("é\n€ x\n".encode() + b"\xe2\x82 y\n")
    with pytest.raises(DataError, match=r"byte 0xe2 at offset 9, line 3\)"):
        files.check_text_file(str(path), "data")
    path.write_bytes("é\n€ x\n".encode())
    files.check_text_file(str(path), "data")


def test_save_dir_whose_only_checkpoint_is_truncated(save_dir, tmp_path, capsys, monkeypatch):
    damaged, shard = damaged_copy(save_dir, tmp_path, "truncated")
    size = shard.stat().st_size
    line = refused_before_the_ranks(["--world", "2", "--save_dir", str(damaged), "--resume"], capsys, monkeypatch)
    assert line == (f"error: --resume (from --save_dir '{damaged}'): checkpoint file '{shard}' is truncated or "
                    f"altered: {size} bytes, the manifest says {size + 10}")


@pytest.mark.parametrize("flag,where", [("tensorboard", "a file"), ("save_dir", "a file"),
                                        ("metrics_file", "a directory"), ("summary_json", "under a file"),
                                        ("profile_json", "under a file")])
def test_an_output_path_that_cannot_be_written(tmp_path, capsys, monkeypatch, flag, where):
    """Found before training, not when the first write comes (the summary after the whole run)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    path = {"a file": a_file, "a directory": tmp_path, "under a file": a_file / "out.json"}[where]
    extra = ["--profile_step", "1"] if flag == "profile_json" else []
    line = refused_before_the_ranks([f"--{flag}", str(path), *extra], capsys, monkeypatch)
    assert line.startswith(f"error: --{flag} '{path}'") and "; pass a" in line, line


def test_rank_0_files_are_not_checked_where_rank_0_does_not_run(tmp_path, monkeypatch):
    """Started elsewhere, rank 1 never writes the metrics file; only --save_dir (each rank writes its part) is
    checked there."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    started = []
    monkeypatch.setattr(pretrain, "launch_ranks", lambda *args: started.append(args) or 0)
    assert pretrain.main(["--world", "2", "--rank", "1", "--metrics_file", str(a_file / "m.jsonl")]) == 0
    assert len(started) == 1
    assert pretrain.main(["--world", "2", "--rank", "1", "--save_dir", str(a_file)]) == 2


def test_output_directories_are_made_and_nothing_is_left_in_them(tmp_path):
    from galaxy.cli.output import check_output_path

    check_output_path("metrics_file", str(tmp_path / "a" / "b" / "m.jsonl"))
    check_output_path("tensorboard", str(tmp_path / "tb" / "run1"), directory=True)
    assert os.listdir(tmp_path / "a" / "b") == [] and os.listdir(tmp_path / "tb" / "run1") == []


def test_the_other_clis_check_their_outputs_first(tmp_path, capsys, monkeypatch):
    """The planner's, the FLOPs profiler's, inference's and the tuning comparison's output flags."""
    from galaxy.cli import compare, infer, plan, profile

    def no_ranks(*_):
        raise AssertionError("ranks were started")

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    bad = str(a_file / "out.json")
    cluster = os.path.join(ROOT, "docs", "results", "cluster_2026-11-28_8a042c8_h200x2_llama7b.json")
    for module, main, argv, flag in (
            (plan, plan.profile_main, ["--model", "llama-tiny", "--out", bad], "out"),
            (plan, plan.plan_main, ["--model", "llama-7b", "--seq_length", "4096", "--global_batch_size", "16",
                                    "--cluster", cluster, "--out", str(tmp_path / "plan.json"), "--table", bad],
             "table"),
            (profile, profile.main, ["--json", bad], "json"),
            (infer, infer.main, ["--summary_json", bad], "summary_json"),
            (compare, compare.main, ["--out_dir", str(a_file)], "out_dir")):
        if hasattr(module, "launch_ranks"):
            monkeypatch.setattr(module, "launch_ranks", no_ranks)
        assert main(argv) == 2
        err = lines(capsys.readouterr().err)
        assert len(err) == 1 and err[0].startswith(f"error: --{flag} '{a_file if flag == 'out_dir' else bad}'"), err


# ----------------------------------------------------------------------------- found inside the ranks


def test_save_dir_whose_only_checkpoint_fails_its_checksum_gets_one_line(save_dir, tmp_path):
    """Only the ranks, reading the tensors, find this: both do, and the launcher prints one line, exit 2."""
    damaged, shard = damaged_copy(save_dir, tmp_path, "flipped")
    out = run(["pretrain_galaxy.py", "--world", "2", "--max_steps", "3", "--no_progress", "--save_dir",
               str(damaged), "--resume", *TINY])
    assert out.returncode == 2, out.stderr[-3000:]
    assert lines(out.stderr) == [
        f"error: no valid checkpoint under '{damaged}', the newest is damaged (checkpoint file '{shard}' fails its "
        "sha256 checksum: the file is corrupt); pass another checkpoint or start without resuming"], out.stderr


def bad_data_in_every_rank(rank: int, launch: Launch, payload) -> None:
    """A launcher child: every rank finds the same bad line (as each reads the data file)."""
    raise DataError(payload)


def test_launcher_prints_a_bad_input_found_by_every_rank_once(capfd):
    message = "corpus.jsonl:3: JSON line has no 'text' field"
    assert launch_ranks(bad_data_in_every_rank, Launch(2, None, None, None), message, GalaxyConfig()) == 2
    out, err = capfd.readouterr()
    assert lines(err) == [f"error: {message}"], err


# ----------------------------------------------------------------------------- resuming


def test_resume_says_where_it_continues_and_the_bar_counts_on(save_dir):
    out = run(["pretrain_galaxy.py", "--world", "1", "--max_steps", "3", "--resume", str(save_dir), *TINY])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from checkpoint '{save_dir / 'step_000002'}' at step 2 of 3\n" in out.stdout, out.stdout
    bar = out.stderr.replace("\r", "\n")
    assert "| 2/3 [" in bar and "| 3/3 [" in bar, bar
    assert "| 0/3 [" not in bar and "| 1/3 [" not in bar, bar
