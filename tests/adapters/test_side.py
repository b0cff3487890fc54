"""Ladder Side-Tuning (``galaxy.adapters.side``) on a backbone of plain layers, in fp64: the tuned output
is the backbone's plus the up-projected side state written out from the paper's gate equation
``s <- mu_i down_i(h_i) + (1 - mu_i) s``, ``mu_i = sigmoid(alpha_i / T)``; only side parameters get
gradients (the backbone runs without them); a second side network on the same model is refused."""

import pytest
import torch
import torch.nn as nn

from galaxy.adapters.side import GATE_TEMPERATURE, SideSpec, add_side_network, mark_only_side_as_trainable
from galaxy.core.layers import GradRule

H, D, N = 6, 3, 2


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(H, H, dtype=torch.float64), nn.Tanh()) for _ in range(N))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def attached():
    torch.manual_seed(0)
    model = nn.ModuleDict({"backbone": Backbone(), "head": nn.Linear(H, 2, dtype=torch.float64)})
    backbone = model["backbone"]
    spec = SideSpec(backbone=backbone, layers=list(backbone.layers),
                    side_layers=[nn.Linear(D, D, dtype=torch.float64) for _ in range(N)], hidden_size=H,
                    side_hidden_size=D, run_layer=lambda layer, s, call: torch.relu(layer(s)),
                    init_full=lambda name, shape, gen: torch.randn(shape, generator=gen) * 0.5)
    side = add_side_network(model, spec, GradRule.REPLICATED, seed=4, init_up_std=0.5)
    with torch.no_grad():
        side.gates.copy_(torch.tensor([0.05, -0.2]))  # mu = sigmoid(0.5), sigmoid(-2)
    return model, side


def test_output_is_the_backbone_plus_the_written_out_ladder():
    model, side = attached()
    x = torch.randn(2, 5, H, dtype=torch.float64)
    with torch.no_grad():
        taps, h = [x], x
        for layer in model["backbone"].layers:
            h = layer(h)
            taps.append(h)
        s = side.downsamplers[0](taps[0])
        for i in range(N):
            s = torch.relu(side.layers[i](s))
            mu = torch.sigmoid(side.gates[i] / GATE_TEMPERATURE)
            s = mu * side.downsamplers[i + 1](taps[i + 1]) + (1 - mu) * s
        want = h + side.upsampler(s)
    out = model["backbone"](x)
    torch.testing.assert_close(out, want, rtol=1e-14, atol=1e-14)
    assert not torch.equal(out, h)  # the side network contributes

    kept = mark_only_side_as_trainable(model, also=["head"])
    assert kept and all(n.startswith(("side.", "head.")) for n in kept) and "head.weight" in kept
    model["head"](model["backbone"](x)).sum().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == name.startswith(("side.", "head.")), name
    with pytest.raises(ValueError, match="side-tuning is applied once"):
        add_side_network(model, SideSpec(model["backbone"], [], [], H, D, lambda layer, s, call: s),
                         GradRule.REPLICATED)
