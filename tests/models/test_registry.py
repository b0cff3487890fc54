"""The registry of model families (``galaxy.models``): every family builds from its tiny config, its
facts match the model it builds (LoRA targets and adapter sites are module names of it, the planner's
parameter counts and MFU's matmul weights are its own tensors), and a model_type nobody registered is one
line naming the key, also from the CLI before any rank starts."""

import re

import pytest

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.models import MODEL_FAMILIES, build_model, check_config, family
from tests import REPO
from tests.in_process import run_script


@pytest.fixture(params=sorted(MODEL_FAMILIES))
def built(request):
    cfg = GalaxyConfig.from_dict(dict(family(request.param).tiny_config, num_hidden_layers=2))
    return cfg, build_model(cfg, cfg.resolve_plan(1), ParallelContext.serial())


def test_each_model_type_is_registered_to_its_folders_family_and_model():
    """The registry's entry for a model_type is the family object ``galaxy/models/<family>/family.py`` defines,
    and its LM class is the one ``model.py`` beside it defines."""
    from galaxy.models.bert.family import BERT
    from galaxy.models.bert.model import BertForMaskedLM, BertForSequenceClassification
    from galaxy.models.llama.family import LLAMA
    from galaxy.models.llama.model import LlamaForCausalLM
    from galaxy.models.phi3.family import PHI3
    from galaxy.models.phi3.model import Phi3ForCausalLM
    from galaxy.models.qwen2.family import QWEN2
    from galaxy.models.qwen2.model import Qwen2ForCausalLM

    folders = {"bert": (BERT, BertForMaskedLM), "llama": (LLAMA, LlamaForCausalLM), "phi3": (PHI3, Phi3ForCausalLM),
               "qwen2": (QWEN2, Qwen2ForCausalLM)}
    for model_type, (fam, lm) in folders.items():
        assert family(model_type) is fam and fam.lm is lm and fam.model_type == model_type
    assert BERT.for_task("classify") is BertForSequenceClassification


def test_the_tiny_config_builds_the_family(built):
    cfg, model = built
    assert isinstance(model, family(cfg.model.model_type))


def test_lora_targets_and_adapter_sites_name_modules_of_the_model(built):
    cfg, model = built
    fam = family(cfg.model.model_type)
    names = [n for n, _ in model.named_modules()]
    for target in fam.lora_targets:
        assert any(n.split(".")[-1] == target for n in names), target
    for site, pattern in fam.adapter_points.items():
        assert sum(bool(re.fullmatch(pattern, n)) for n in names) == cfg.model.num_hidden_layers, site


def test_layer_counts_are_the_models_own_tensors(built):
    cfg, model = built
    m, fam = cfg.model, family(cfg.model.model_type)
    counts = fam.layer_parameters(m, m.num_attention_heads, m.intermediate_size)
    per_layer = sum(p.numel() for n, p in model.named_parameters() if re.search(r"\.0\.", n))
    assert counts.att_sharded + counts.att_row_bias + counts.mlp_sharded + counts.mlp_row_bias + counts.con == per_layer
    # A stacked weight (fused gate/up, fused q/k/v: [parts, ..., in]) holds several matmuls' matrices.
    per_layer_matrices = sum(p.numel() for n, p in model.named_parameters() if re.search(r"\.0\.", n) and p.dim() >= 2)
    assert fam.matmul_weights(m)[0] == per_layer_matrices


def test_an_unknown_model_type_is_one_line_naming_the_key():
    cfg = GalaxyConfig.from_dict(dict(model_type="gpt9"))
    with pytest.raises(ConfigError, match=r"config key 'model_type': unknown model 'gpt9'; use one of bert, llama"):
        check_config(cfg.model)
    # in this process (tests.in_process): the launcher refuses it before any rank starts
    out = run_script(["pretrain_galaxy.py", "--world", "2", "--override", "model_type=gpt9"], cwd=REPO, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "config key 'model_type': unknown model 'gpt9'" in out.stderr
