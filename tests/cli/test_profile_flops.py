"""profile_flops.py counts a training step (forward + backward) unless told ``--forward_only``, and
takes ``--preset``: its FLOPs equal torch.utils.flop_counter's on the same step of the same model."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from galaxy.cli.profile import build, main, parser, random_batch, resolve_config
from galaxy.core.context import ParallelContext
from galaxy.profiler import extra_flop_formulas

SMALL = ["--batch", "2", "--seq_len", "16", "--warm_up", "0", "--no_detailed"]


def profiled(argv, tmp_path) -> dict:
    path = tmp_path / "profile.json"
    assert main([*argv, *SMALL, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def torch_counted(argv, backward: bool) -> int:
    """torch's FLOP count of the step on the same model and batch (serial: one rank), with the formula
    of the CPU fused attention kernel that torch's registry lacks."""
    cfg = resolve_config(parser().parse_args([*argv, *SMALL]))
    ctx = ParallelContext.serial("cpu", cfg.train.seed)
    model = build(cfg, ctx, serial=True)
    batch = random_batch(cfg, ctx.device)
    with FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as counter:
        if backward:
            model.train()
            model(**batch).loss.backward()
        else:
            model.eval()
            with torch.no_grad():
                model(**batch)
    return counter.get_total_flops()


@pytest.mark.parametrize("preset,model_type", [("bert-tiny", "bert"), ("llama-tiny", "llama")])
def test_default_step_is_forward_and_backward(tmp_path, capsys, preset, model_type):
    argv = ["--preset", preset]
    data = profiled(argv, tmp_path)
    capsys.readouterr()
    assert data["config"]["model"]["model_type"] == model_type and data["config"]["model"]["preset"] == preset
    assert data["step"]["backward"] is True
    flops = data["local"]["flops"]
    assert flops["bwd"] > flops["fwd"] > 0
    assert flops["fwd"] + flops["bwd"] == torch_counted(argv, backward=True)


def test_forward_only(tmp_path, capsys):
    argv = ["--preset", "bert-tiny", "--forward_only"]
    data = profiled(argv, tmp_path)
    capsys.readouterr()
    assert data["step"]["backward"] is False and data["local"]["flops"]["bwd"] == 0
    assert data["local"]["flops"]["fwd"] == torch_counted(argv, backward=False)


@pytest.mark.parametrize("argv,says", [
    (["--preset", "bert-tny"],
     "error: --preset 'bert-tny' is not a model preset (did you mean 'bert-tiny'?); use one of"),
    (["--preset", "bert-tiny", "--config", "llama-tiny"],
     "error: --config llama-tiny and --preset bert-tiny both name"),
    (["--forward_only", "--optimizer"], "error: --forward_only profiles no backward but --optimizer asks for one"),
    (["--model", "bert", "--preset", "llama-tiny"], "error: --model bert but the config describes a llama model"),
])
def test_bad_flags_get_one_line(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(says), err
