"""What the PEFT methods share (``galaxy.loralib.utils``): target matching by module name equals HF PEFT's
``check_target_module_exists``; freezing keeps exactly what it is told; parameter counts count a tied
parameter once."""

import pytest
import torch.nn as nn
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists

from galaxy.loralib.utils import count_parameters, freeze_all_but, in_modules, matches

NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj",
         "model.layers.1.mlp.gate_up_proj", "q_proj", "lm_head", "model.layers.10.self_attn.q_proj", "xq_proj"]
TARGETS = [["q_proj"], ["q_proj", "up_proj"], ["mlp.up_proj"], ["proj"], "q_proj", r".*\.q_proj",
           r"model\.layers\.1\..*", r".*layers\.(0|1)\.self_attn\.(q|k)_proj"]


@pytest.mark.parametrize("targets", TARGETS, ids=str)
def test_matches_is_hf_peft_target_matching(targets):
    config = LoraConfig(target_modules=targets)
    for name in NAMES:
        assert matches(name, targets) == bool(check_target_module_exists(config, name)), name


def test_in_modules_names_parameters_under_a_target_module():
    assert in_modules("classifier.weight", ["classifier"]) and in_modules("bert.pooler.dense.bias", ["pooler"])
    assert not in_modules("classifier_head.weight", ["classifier"]) and not in_modules("classifier", ["classifier"])
    assert not in_modules("classifier.weight", None)


def test_freeze_and_count_parameters():
    embed = nn.Embedding(10, 4)
    model = nn.ModuleDict({"embed": embed, "body": nn.Linear(4, 3), "head": nn.Linear(4, 10, bias=False)})
    model["head"].weight = embed.weight  # tied: one parameter under two names
    kept = freeze_all_but(model, lambda name, p: name.startswith("body."))
    assert kept == ["body.weight", "body.bias"]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == kept
    assert count_parameters(model) == (4 * 3 + 3, 10 * 4 + 4 * 3 + 3)
