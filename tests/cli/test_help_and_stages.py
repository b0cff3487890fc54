"""What a command shows people: ``galaxy <command> --help`` names the command and lists only its own flags,
each default once, as the README's tables list them; long work (preparing a corpus and training its tokenizer,
profiling a cluster, the search, each validation run) says each stage on stderr as it goes."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from galaxy.cli.main import COMMANDS, main
from tests import REPO
from tests.in_process import run_script

TRAINING_FLAGS = ("--max_steps", "--eval_every", "--data", "--tokenizer", "--metrics_file", "--tensorboard",
                  "--profile_step", "--profile_json", "--save_dir", "--save_every", "--resume", "--keep_last",
                  "--no_progress")


def help_of(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return out.getvalue()


def flag_entries(text: str) -> list[str]:
    """Each flag's entry of a help text (its lines joined), up to the epilog."""
    return [" ".join(block.split()) for block in re.split(r"\n(?=  -)", text)[1:]]


def flags(text: str) -> set[str]:
    return {m for entry in flag_entries(text) for m in re.findall(r"(?<![\w-])--\w+", entry.split("  ")[0])}


@pytest.mark.parametrize("argv", [[name] for name in COMMANDS] + [["plan", "profile"]])
def test_each_command_names_itself_and_says_each_default_once(argv):
    text = help_of([*argv, "--help"])
    assert text.startswith(f"usage: galaxy {' '.join(argv)} ["), text[:200]
    for entry in flag_entries(text.split("\nThe flags of step 1:")[0]):
        assert entry.count("default") <= 1 and "(default: None)" not in entry, entry


def test_profile_lists_no_training_flags_and_plan_lists_both_steps():
    profile = flags(help_of(["profile", "--help"]))
    assert {"--preset", "--model_path", "--world", "--json", "--peak_tflops"} <= profile
    assert not profile & set(TRAINING_FLAGS), profile & set(TRAINING_FLAGS)
    plan = help_of(["plan", "--help"])
    assert "usage: galaxy plan profile [" in plan and "1. galaxy plan profile --model M" in plan
    assert {"--cluster", "--validate", "--rows", "--calibration_layers"} <= flags(plan)


def test_a_script_names_itself():
    out = run_script(["pretrain_tp_bert.py", "--help"], timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: pretrain_tp_bert.py ["), out.stdout[:300]
    assert "galaxy pretrain --plan tp" in out.stdout


def readme_table(heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading`` in the README, as cells."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    rows = []
    for line in text[text.index(heading):].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


def test_the_readme_tables_match_the_commands_and_their_flags():
    commands = {re.search(r"`galaxy (\w+)`", row[0]).group(1): row for row in readme_table("### Commands")}
    assert set(commands) == set(COMMANDS)
    for name, row in commands.items():
        assert f"`{COMMANDS[name][2]}`" in row[1], (name, row)
    listed = {flag for row in readme_table("### Flags of the training commands")
              for flag in re.findall(r"`(--\w+)", row[0])}
    assert listed == flags(help_of(["pretrain", "--help"])) - {"--help"}


def run(argv, **env):
    """``python argv`` in this process (tests.in_process: a new interpreter would only import torch and Galaxy
    again); the processes it starts are its own."""
    return run_script(argv, env=env, timeout=600)


def stage_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("-- ") or " INFO galaxy." in line]


def in_order(lines: list[str], needles: list[str]) -> bool:
    at = 0
    for line in lines:
        if at < len(needles) and needles[at] in line:
            at += 1
    return at == len(needles)


def test_preparing_a_corpus_says_each_stage(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"document {i} says {' '.join(['word'] * (i % 7))} and more" for i in range(200)))
    out = run(["pretrain_galaxy.py", "--world", "1", "--max_steps", "1", "--no_progress", "--data", str(corpus),
               "--override", "seq_length=16", "--override", "global_batch_size=2"], XDG_CACHE_HOME=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = stage_lines(out.stderr)
    assert in_order(lines, [f"-- data: reading '{corpus}'", f"reading {corpus}", "200 documents",
                            "WordPiece: training a vocabulary", "TextCorpus", "-- data: ready"]), lines


def test_profiling_searching_and_validating_say_each_stage(tmp_path):
    cluster, plan = tmp_path / "cluster.json", tmp_path / "plan.json"
    shape = ["--model", "bert-tiny", "--seq_length", "16", "--global_batch_size", "2"]
    out = run(["plan_galaxy.py", "profile", *shape, "--world", "1", "--rows", "1", "--reps", "1", "--window_ms", "0",
               "--out", str(cluster)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert in_order(stage_lines(out.stderr), [
        "-- profile: bert of 2 layers", "profile: whole serial training steps", "profile: each block at 1 row",
        "profile: the optimizer step", "profile: the serial training steps again", "-- profile: done"]), out.stderr
    out = run(["plan_galaxy.py", *shape, "--cluster", str(cluster), "--out", str(plan), "--validate", "1",
               "--validate_steps", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert in_order(stage_lines(out.stderr), [
        f"-- search: plans of bert (2 layers) on the 1 ranks of '{cluster}'", "-- validate 1/1: plan 1",
        "-- validate 1/1: "]), out.stderr
    assert re.search(r"-- validate 1/1: [\d.]+ ms measured, [\d.]+ ms predicted", out.stderr), out.stderr
