"""``bench/bench_lora.py`` without a GPU: unsloth's contenders are named as documented, run in their own
process with ``--unsloth_path`` first on its path, and a row that cannot run says why in one line while the
launch goes on."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

from bench.bench_lora import (CONTENDERS, best_per_family, config, family_of, galaxy_base_format, galaxy_compile_mode,
                              galaxy_compile_options, galaxy_head_on_fp8, galaxy_model, galaxy_recompute, search_lengths,
                              unsloth_variant)
from galaxy.config import MODEL_PRESETS
from galaxy.core.context import ParallelContext
from galaxy.planner.activation import peak_allocated
from tests import REPO

TINY = ["--preset", "llama-tiny", "--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "0"]
TINY_LAYERS = MODEL_PRESETS["llama-tiny"]["num_hidden_layers"]
# The CPU smoke rows of several tests, in one launch (each contender still a process of its own; the launch's own
# process, and the model unsloth's rows load, paid once): the stand-in unsloth's rows first, so the Galaxy rows
# after them show the launch going on.
SMOKE_ROWS = ("unsloth-lora", "galaxy-lora-fp8", "galaxy-lora+mlp1", "unsloth-qlora-gc-sdpa", "galaxy-lora+auto1",
              "galaxy-qlora-compiled")


def standin_unsloth(root):
    """An unsloth under ``root`` that selected its CPU backend, as unsloth does without a GPU."""
    fake = root / "deps" / "unsloth"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.0-standin'\n_IS_CPU_BACKEND = True\n")
    return root / "deps"


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory):
    """The launch of SMOKE_ROWS at TINY shapes, one warm-up step (the compiled row's compile) and one timed step
    each, with the stand-in unsloth: (its JSON, its stdout, the stand-in's directory); every contender has its row,
    in the order asked."""
    tmp_path = tmp_path_factory.mktemp("smoke_rows")
    deps = standin_unsloth(tmp_path)
    out = subprocess.run([sys.executable, "bench/bench_lora.py", *TINY, "--warmup", "1", "--json",
                          str(tmp_path / "out.json"), "--contenders", ",".join(SMOKE_ROWS), "--unsloth_path",
                          str(deps)],
                         cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert [r["contender"] for r in result["rows"]] == list(SMOKE_ROWS), result["rows"]
    return result, out.stdout, deps


def rows_of(smoke_rows, *names):
    rows = {r["contender"]: r for r in smoke_rows[0]["rows"]}
    return [rows[n] for n in names]


def test_unsloth_contender_names():
    assert unsloth_variant("unsloth-lora") == (False, False, False)
    assert unsloth_variant("unsloth-qlora") == (True, False, False)
    assert unsloth_variant("unsloth-lora-gc") == (False, "unsloth", False)
    assert unsloth_variant("unsloth-qlora-gc-sdpa") == (True, "unsloth", True)
    assert unsloth_variant("unsloth-lora-sdpa") == (False, False, True)
    for other in ("peft-bf16", "galaxy-lora", "unsloth-lora-sdpa-gc", "unsloth-dora", "unsloth-lora-"):
        assert unsloth_variant(other) is None


def test_galaxy_base_formats():
    assert [galaxy_base_format(n) for n in ("galaxy-lora", "galaxy-lora-compiled", "galaxy-qlora-cudagraphs",
                                            "galaxy-lora-fp8", "galaxy-lora-fp8-compiled")] == \
        ["none", "none", "nf4", "fp8", "fp8"]
    assert galaxy_base_format("galaxy-lora-fp8head-cudagraphs") == "fp8"
    assert [galaxy_head_on_fp8(n) for n in ("galaxy-lora-fp8-compiled", "galaxy-lora-fp8head-compiled")] == [False, True]
    assert galaxy_compile_mode("galaxy-lora-fp8") is None
    assert galaxy_compile_mode("galaxy-lora-fp8-compiled") == "default"
    assert galaxy_compile_mode("galaxy-lora-fp8-cudagraphs-multikernel") == "reduce-overhead"
    assert galaxy_compile_options("galaxy-lora-fp8-cudagraphs-multikernel") == {"triton.multi_kernel": 1}
    assert galaxy_compile_options("galaxy-lora-fp8-cudagraphs") is None
    with pytest.raises(ValueError, match="-multikernel follows a compile mode"):
        galaxy_compile_options("galaxy-lora-multikernel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on a GPU the bench itself is the check")
def test_galaxy_lora_fp8_trains_on_cpu(smoke_rows):
    """``galaxy-lora-fp8``: LoRA over the fp8 base (1 byte a weight + a scale a row), eager, trains."""
    (row,) = rows_of(smoke_rows, "galaxy-lora-fp8")
    assert row["step_ms"] > 0 and 1.0 < row["frozen_bytes_per_param"] < 2.0, row  # fp8 linears, bf16 rest


def test_the_galaxy_contender_makes_its_base_in_bf16_without_an_fp32_model():
    """A Galaxy contender's model is made tensor by tensor in its stored format (``galaxy_model``): the frozen base
    in bf16, never the whole model in fp32 (4 bytes a weight; for the 8B on the H200 that was 32 GB drawn by the
    host's generator, over 30 s, then copied and cast), so the build's peak stays under the fp32 model's bytes."""
    args = argparse.Namespace(preset="llama-tiny", seq=16, batch=2, steps=1, warmup=0)
    cfg, ctx, built = config(args), ParallelContext.serial("cpu", seed=0), []
    peak = peak_allocated(ctx.device, lambda: built.append(galaxy_model(cfg, ctx)))
    (model,) = built
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and {p.dtype for p in frozen} == {torch.bfloat16}
    assert peak < 4 * sum(p.numel() for p in model.parameters()), peak


def test_galaxy_recompute_suffix():
    assert galaxy_recompute("galaxy-lora-compiled") == ("galaxy-lora-compiled", {})
    assert galaxy_recompute("galaxy-lora-compiled+mlp8") == ("galaxy-lora-compiled",
                                                             {"recompute": "mlp", "recompute_num_layers": 8})
    assert galaxy_recompute("galaxy-qlora+full") == ("galaxy-qlora", {"recompute": "full"})
    for bad in ("galaxy-lora+mlp-8", "galaxy-lora+attn", "galaxy-lora+"):
        with pytest.raises(ValueError, match="recompute mode"):
            galaxy_recompute(bad)
    assert galaxy_recompute("galaxy-lora-compiled+auto", 139.8) == (
        "galaxy-lora-compiled", {"activation_memory": "auto", "memory_budget_gib": 139.8})
    assert galaxy_recompute("galaxy-qlora+auto4.25", 139.8) == (  # a named budget wins over the card's
        "galaxy-qlora", {"activation_memory": "auto", "memory_budget_gib": 4.25})
    with pytest.raises(ValueError, match="recompute mode"):
        galaxy_recompute("galaxy-lora+auto-1")
    out = subprocess.run([sys.executable, "bench/bench_lora.py", *TINY, "--contenders", "galaxy-lora+attn2"],
                         cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert out.returncode == 2 and "contender 'galaxy-lora+attn2'" in out.stderr.splitlines()[-1], out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on a GPU the bench itself is the check")
def test_galaxy_lora_recomputing_its_mlp_trains_on_cpu(smoke_rows):
    """``galaxy-lora+mlp1``: the LoRA contender with ``recompute: mlp`` on its first layer, eager, trains and
    says what it recomputed; ``galaxy-lora+auto1`` plans each layer's memory mode within 1 GiB first, as the CLIs
    do (the bench once built the model without the plan: every +auto row was an error on the H200)."""
    mlp, auto = rows_of(smoke_rows, "galaxy-lora+mlp1", "galaxy-lora+auto1")
    assert mlp["step_ms"] > 0 and (mlp["recompute"], mlp["recompute_num_layers"]) == ("mlp", 1), mlp
    assert auto.get("step_ms", 0) > 0 and auto["layer_memory"] and len(auto["layer_memory"]) == TINY_LAYERS, auto


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the unsloth rows run")
def test_unsloth_rows_say_why_in_one_line(smoke_rows):
    """A stand-in unsloth under --unsloth_path that selected its CPU backend, as unsloth does without a GPU:
    each row says so in one line, so the contender imported it from there, and the launch ends with its JSON."""
    launch, stdout, deps = smoke_rows
    result = dict(launch, rows=[r for r in launch["rows"] if r["contender"].startswith("unsloth")])
    assert [r["contender"] for r in result["rows"]] == ["unsloth-lora", "unsloth-qlora-gc-sdpa"]
    for row in result["rows"]:
        assert row["error"].startswith("unsloth 0.0-standin found no CUDA device"), row
        assert "\n" not in row["error"] and len(row["error"]) <= 400 and row["error"][:200] in stdout
    facts = result["facts"]
    assert facts["device"].startswith("cpu") and "transformers" in facts["versions"]
    assert facts["unsloth_path"] == str(deps)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on a GPU the bench itself is the check")
def test_galaxy_qlora_compiled_trains_on_cpu(smoke_rows):
    """The ``galaxy-qlora-compiled`` contender (NF4 base, ``compile: true``, bf16) trains through Galaxy's loop on
    the CPU: a timed row over a quantized base (inductor compiles each layer, about a minute here)."""
    (row,) = rows_of(smoke_rows, "galaxy-qlora-compiled")
    assert row["contender"] == "galaxy-qlora-compiled" and row["step_ms"] > 0, row
    assert row["frozen_bytes_per_param"] < 2, row  # the linears in NF4; embeddings and head stay bf16


def test_every_launch_runs_both_of_unsloths_attention_paths_and_the_report_picks_each_familys_best():
    """The default contenders hold unsloth with xformers and with SDPA, LoRA and QLoRA; the summary sets Galaxy's
    fastest row of a family against the fastest other row of it, whichever recipe or attention path that is."""
    for four_bit in ("lora", "qlora"):
        assert {f"unsloth-{four_bit}", f"unsloth-{four_bit}-sdpa"} <= set(CONTENDERS)
    names = ("galaxy-lora-compiled+mlp6", "unsloth-lora-gc-sdpa", "peft-bf16-liger", "galaxy-qlora-cudagraphs",
             "peft-qlora-bnb", "unsloth-qlora", "galaxy-lora-fp8")
    assert [family_of(n) for n in names] == ["bf16 base"] * 3 + ["nf4 base"] * 3 + ["fp8 base"]
    rows = [{"contender": "galaxy-lora-compiled", "step_ms": 80.0, "steps_per_s": 12.5, "peak_mib": 9000.0},
            {"contender": "galaxy-lora-compiled+mlp6", "step_ms": 90.0, "steps_per_s": 1 / 0.09, "peak_mib": 7800.0},
            {"contender": "unsloth-lora", "step_ms": 100.0, "steps_per_s": 10.0, "peak_mib": 9800.0},
            {"contender": "unsloth-lora-sdpa", "step_ms": 88.0, "steps_per_s": 1 / 0.088, "peak_mib": 9900.0},
            {"contender": "unsloth-qlora", "error": "exit 1: out of memory"},
            {"contender": "galaxy-qlora-compiled", "step_ms": 85.0, "steps_per_s": 1 / 0.085, "peak_mib": 7900.0}]
    summary = best_per_family(rows)
    assert list(summary) == ["bf16 base"]  # no NF4 anchor ran
    best = summary["bf16 base"]
    assert (best["galaxy"], best["anchor"]) == ("galaxy-lora-compiled", "unsloth-lora-sdpa")
    assert best["steps_per_s_ratio"] == pytest.approx(88.0 / 80.0) and best["peak_ratio"] == pytest.approx(9000 / 9900)
    # LoRA over an fp8 base has no other recipe: it is set against the bf16 base's fastest other row
    rows.append({"contender": "galaxy-lora-fp8-cudagraphs", "step_ms": 66.0, "steps_per_s": 1 / 0.066,
                 "peak_mib": 7800.0})
    fp8 = best_per_family(rows)["fp8 base"]
    assert (fp8["galaxy"], fp8["anchor"]) == ("galaxy-lora-fp8-cudagraphs", "unsloth-lora-sdpa")
    assert fp8["steps_per_s_ratio"] == pytest.approx(88.0 / 66.0) and fp8["peak_ratio"] == pytest.approx(7800 / 9900)


def test_the_longest_context_summary_sets_lengths_against_lengths():
    """``--max_seq`` rows hold each contender's steps/s at its own longest length: the summary compares the lengths
    (a longer context steps slower, so steps/s would rank the shorter first)."""
    rows = [{"contender": "galaxy-qlora-compiled+auto6.5", "max_seq": 98304, "step_ms": 4000.0,
             "steps_per_s": 0.25, "peak_mib": 6905.0},
            {"contender": "unsloth-qlora-gc-sdpa", "max_seq": 65536, "step_ms": 2500.0, "steps_per_s": 0.4,
             "peak_mib": 7911.0},
            {"contender": "unsloth-qlora-gc", "max_seq": None, "tries": []}]  # nothing fitted
    best = best_per_family(rows, "max_seq")["nf4 base"]
    assert (best["galaxy"], best["anchor"]) == ("galaxy-qlora-compiled+auto6.5", "unsloth-qlora-gc-sdpa")
    assert best["max_seq_ratio"] == 1.5 and best["peak_ratio"] == pytest.approx(6905 / 7911)
    assert best_per_family(rows)["nf4 base"]["steps_per_s_ratio"] == pytest.approx(0.25 / 0.4)


@pytest.mark.parametrize("start", [512, 4096, 8192, 65536])
def test_the_longest_length_search_is_the_same_from_any_start(start):
    """Powers of two up while they fit and down while they fail, then one bisection step: whatever the start (the
    memory model's for Galaxy, --max_seq_start for the others), the same longest length for the same limit."""
    limit = 12000  # the lengths that fit
    tried = []

    def fits(n):
        tried.append(n)
        return n <= limit

    low, high = search_lengths(start, 512, 262144, fits)
    assert (low, high) == (8192, 16384) and tried[-1] == 12288 and len(tried) == len(set(tried))
    assert search_lengths(start, 512, 8192, lambda n: True) == (8192, None)  # the limit reached
    assert search_lengths(start, 512, 262144, lambda n: False) == (None, 512)  # nothing fits


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on a GPU the bench itself is the check")
def test_max_seq_on_cpu_finds_the_limit_and_keeps_every_try(tmp_path):
    """``--max_seq`` end to end on the CPU: Galaxy's LoRA fits every length up to the limit (each try a process of
    its own, two whole steps), a stand-in unsloth that cannot run fails every length down to the floor; both rows
    keep their tries, and the longest length's row carries its step time and peak."""
    deps = standin_unsloth(tmp_path)
    out = subprocess.run([sys.executable, "bench/bench_lora.py", "--preset", "llama-tiny", "--batch", "1",
                          "--max_seq", "--max_seq_start", "32", "--max_seq_floor", "16", "--max_seq_limit", "64",
                          "--contenders", "galaxy-lora,unsloth-lora", "--unsloth_path", str(deps),
                          "--json", str(tmp_path / "out.json")],
                         cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    galaxy, unsloth = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert (galaxy["max_seq"], galaxy["reached_limit"], [t["seq"] for t in galaxy["tries"]]) == (64, True, [32, 64])
    assert galaxy["step_ms"] > 0 and "step_ms" in galaxy["tries"][1]
    # two timed steps after the compile's; the step is their span over their count, the rates follow from it
    assert len(galaxy["times_ms"]) == 2 and galaxy["step_ms"] == pytest.approx(sum(galaxy["times_ms"]) / 2, rel=1e-3)
    assert galaxy["steps_per_s"] == pytest.approx(1e3 / galaxy["step_ms"], rel=1e-3)
    assert unsloth["max_seq"] is None and [t["seq"] for t in unsloth["tries"]] == [16, 32]
    assert all("found no CUDA device" in t["error"] for t in unsloth["tries"])
