"""``infer_galaxy.py`` as a user runs it: the greedy tokens it generates on an SP plan (KV cache,
several ranks) are the serial model's, its JSON holds the timings, bad input is one line."""

import json

import pytest
import torch

from galaxy.cli.infer import main
from galaxy.config import GalaxyConfig
from galaxy.models.generation import generate
from galaxy.models.llama import LlamaForCausalLM
from tests import REPO  # noqa: E402
from tests.in_process import run_script

ROOT = REPO


def run(args, timeout=180):
    """``python infer_galaxy.py args`` in this process (tests.in_process: a new interpreter would only import torch
    and Galaxy again); its ranks are processes of their own."""
    return run_script(["infer_galaxy.py"] + args, cwd=ROOT, timeout=timeout)


def test_generation_on_uneven_galaxy2_plan_equals_serial(tmp_path):
    summary = tmp_path / "s.json"
    out = run(["--model", "llama-tiny", "--world", "2", "--plan", "galaxy2", "--seq_length", "12", "--generate", "5",
               "--override", "seq_scatter_list=[9,3]", "--override", "tp_num_attention_heads_list=[2,2]",
               "--warmup", "0", "--reps", "2", "--seed", "5", "--summary_json", str(summary)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "inference latency (batch 1)" in out.stdout and "per_token latency" in out.stdout
    got = json.loads(summary.read_text())
    assert got["plan"] == "galaxy2" and got["seq_split"] == [9, 3] and got["world"] == 2
    for key in ("forward", "generate", "first_token"):
        t = got[key]
        assert t["reps"] == 2 and 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"], (key, t)
    assert got["per_token"]["reps"] == 2  # (whole - prefill) / 4 per repetition: a difference, noise may flip it
    # The serial model of the same seed, on the same seeded prompt, greedily.
    cfg = GalaxyConfig.from_dict({"model": {"preset": "llama-tiny"}}, {"seq_length": 12, "seed": 5})
    ids = torch.randint(0, cfg.model.vocab_size, (12,), generator=torch.Generator().manual_seed(5))[None]
    serial = LlamaForCausalLM(cfg.model, seed=5)
    assert got["new_tokens"] == generate(serial, ids, 5)[0, 12:].tolist()


def test_bert_forward_on_one_rank(tmp_path, capsys):
    summary = tmp_path / "s.json"
    assert main(["--model", "bert-tiny", "--seq_length", "16", "--warmup", "1", "--reps", "3",
                 "--prompt_ids", ",".join(["7"] * 16), "--summary_json", str(summary)]) == 0
    got = json.loads(summary.read_text())
    assert got["model"] == "bert" and got["plan"] == "none" and got["forward"]["reps"] == 3
    assert len(got["forward"]["all_ms"]) == 3 and "generate" not in got


@pytest.mark.parametrize("args,message", [
    (["--model", "bert-tiny", "--generate", "4"], "--generate needs a causal LM"),
    (["--model", "llama-tiny", "--seq_length", "8", "--prompt_ids", "1,2,3"], "--prompt_ids has 3 tokens"),
    (["--model", "llama-tiny", "--prompt_ids", "1,x"], "comma-separated integers"),
    (["--model", "llama-tiny", "--seq_length", "500", "--generate", "20"], "max_position_embeddings"),
    (["--model", "llama-tiny", "--world", "2", "--override", "pp_size=2"], "dp_size and pp_size"),
    (["--model", "bert-tiny", "--reps", "0"], "--reps at least 1"),
    (["--model", "no-such-model"], "neither a preset"),
])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
