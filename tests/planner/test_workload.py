"""galaxy.planner.workload: the parameter counts per layer and of the edges, against the real models'
parameters and their gradient rules on two Gloo ranks."""

import numpy as np
import pytest

from galaxy.config import GalaxyConfig
from galaxy.planner.workload import edge_params, layer_params
from tests.planner.helpers import BERT, LLAMA, PLANS, SP, model_config


def count_params(ctx, config):
    from galaxy.core.layers import GradRule, grad_rule
    from galaxy.models import build_model

    cfg = GalaxyConfig.from_dict(config)
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    params = list(model.parameters())
    return (sum(p.numel() for p in params), sum(p.numel() for p in params if grad_rule(p) == GradRule.PARTIAL))


@pytest.mark.parametrize("model_type,methods,heads,ffn,seq", PLANS[:2] + PLANS[3:4] + PLANS[5:])
def test_parameter_counts_match_the_model(dist_pool, model_type, methods, heads, ffn, seq):
    raw = BERT if model_type == "bert" else LLAMA
    names = ("att_parallel_method", "con_parallel_method", "mlp_parallel_method")
    config = {"model": raw, "train": {"seq_length": 16, "global_batch_size": 2},
              "parallel": {**{k: m.value for k, m in zip(names, methods)}, "tp_num_attention_heads_list": heads,
                           "tp_intermediate_size_list": ffn, "seq_scatter_list": seq}}
    real = dist_pool.run(count_params, 2, config)
    m = model_config(raw)
    att, con, mlp = methods
    per_layer = layer_params(m, att, mlp, con, np.array(heads), np.array(ffn))
    edges = sum(edge_params(m))
    for rank, (total, partial) in enumerate(real):
        assert per_layer.total[rank] * m.num_hidden_layers + edges == total
        assert per_layer.partial[rank] * m.num_hidden_layers + (edges if con == SP else 0) == partial
