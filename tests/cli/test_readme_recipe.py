"""The README's Python API recipe runs as printed: its code block, read from README.md here (so the two cannot
drift), on two rank processes as torchrun starts them, against a BERT checkpoint that transformers saved; both
ranks exit 0 (the ``with`` block shuts the process group down: no abort at exit) and the checkpoint it saves
loads in transformers with the weights it read."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests import REPO
from tests.dist_pool import free_port


def readme_recipe() -> str:
    """The first python block under the README's '## Python API' heading."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("\n## Python API\n"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_readme_recipe_runs_as_printed(tmp_path):
    transformers = pytest.importorskip("transformers")
    recipe = readme_recipe()
    assert '"path/to/hf_bert"' in recipe and '"train_config/bert/galaxy/full.json"' in recipe
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=512)
    saved = transformers.BertForMaskedLM(config)
    saved.save_pretrained(str(tmp_path / "path" / "to" / "hf_bert"))
    # The places the recipe names, as a user's checkout holds them: the shipped configs, the checkpoint, the script.
    os.symlink(os.path.join(REPO, "train_config"), tmp_path / "train_config")
    (tmp_path / "recipe.py").write_text(recipe)
    env = dict(os.environ, PYTHONPATH=REPO, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, "recipe.py"], cwd=tmp_path, env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in ranks]
    for r, (p, (_, err)) in enumerate(zip(ranks, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}: {err[-3000:]}"
        assert "terminate called" not in err, err[-3000:]
    loaded = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / "out_dir"))
    expected = saved.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
