"""Ladder Side-Tuning (Sung et al. 2022): a narrow side network trained next to a frozen backbone.

The side network has width ``hidden / r``. It starts from a down-projection of the backbone's
embedding output; after side layer i it takes in backbone layer i's output through LST's gate,

    s <- mu_i * down_i(h_i) + (1 - mu_i) * s,     mu_i = sigmoid(alpha_i / T),  alpha_i = 0, T = 0.1

and its final state, normalised and up-projected, is added to the backbone's output before the
head (``up`` starts at zero: the tuned model starts as the backbone).

The backbone runs under ``torch.no_grad()``: forward hooks collect its layer outputs (the "ladder"
taps) and a hook on the backbone module adds the side network's output with gradients enabled,
so autograd keeps none of the backbone's internal activations. What it keeps of the backbone is
the taps themselves (one ``[b, s, hidden]`` tensor per layer), which the down-projections need
for their own weight gradients.

The side layers are the model's own layer class built with a reduced config and a plan that keeps
CON's layout (ATT and MLP run SP when CON is SP, else None; all weights whole), so the side
network computes on the residual stream's layout on every plan, exactly as the serial one.
Model-specific glue (how to build and call a side layer) comes in a ``SideSpec``.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from galaxy.core.layers import GradRule, ParallelLinear, mark_module
from galaxy.loralib.utils import freeze_all_but, in_modules, seeded_init_, trainable_dtype

logger = logging.getLogger(__name__)

GATE_TEMPERATURE = 0.1  # LST's T


@dataclass
class SideSpec:
    """How to attach a side network to one model.

    backbone:    the module run without gradients (its output, in the stream layout, gets the side's added)
    layers:      its layers; the taps are the input of ``layers[0]`` and the output of each layer
    side_layers: the side network's layers (built by the caller, one per backbone layer)
    run_layer:   ``run_layer(side_layer, s, call) -> s``; ``call`` holds the backbone's arguments by name
                 plus what ``prepare`` added
    prepare:     ``prepare(call, s) -> dict`` once per forward, before the first side layer (e.g. RoPE tables)
    final_norm:  applied to the side state before the up-projection (None: none)
    init_full:   serial init of a side-layer tensor by its full name (the model's own ``_init_full``)
    """

    backbone: nn.Module
    layers: Sequence[nn.Module]
    side_layers: Sequence[nn.Module]
    hidden_size: int
    side_hidden_size: int
    run_layer: Callable[[nn.Module, torch.Tensor, dict], torch.Tensor]
    prepare: Optional[Callable[[dict, torch.Tensor], dict]] = None
    final_norm: Optional[nn.Module] = None
    init_full: Optional[Callable[[str, tuple, torch.Generator], torch.Tensor]] = None


class LadderSideNetwork(nn.Module):
    def __init__(self, spec: SideSpec, rule: GradRule, gate_temperature: float = GATE_TEMPERATURE):
        super().__init__()
        h, d, n = spec.hidden_size, spec.side_hidden_size, len(spec.side_layers)
        if n != len(spec.layers):
            raise ValueError(f"the side network needs one layer per backbone layer ({len(spec.layers)}), got {n}")
        w = next(spec.backbone.parameters())
        kw = dict(device=w.device, dtype=trainable_dtype(w.dtype))
        self.downsamplers = nn.ModuleList(ParallelLinear(h, d, True, "whole", rule=rule, **kw) for _ in range(n + 1))
        self.gates = nn.Parameter(torch.zeros(n, **kw))
        self.layers = nn.ModuleList(spec.side_layers)
        self.final_norm = spec.final_norm
        self.upsampler = ParallelLinear(d, h, True, "whole", rule=rule, **kw)
        self.gate_temperature = gate_temperature
        mark_module(self, rule)  # gates, and any side-layer tensor its builder left untagged
        # Not modules: the spec's callbacks and the per-forward state the hooks pass along.
        self._run_layer, self._prepare = spec.run_layer, spec.prepare
        self._taps: list[torch.Tensor] = []
        self._call: dict[str, Any] = {}
        self._grad_enabled = True
        self._handles: list = []

    def forward(self, taps: Sequence[torch.Tensor], call: dict) -> torch.Tensor:
        """The side network's contribution (stream layout, hidden width) from the backbone taps."""
        s = self.downsamplers[0](taps[0])
        if self._prepare is not None:
            call = dict(call, **self._prepare(call, s))
        for i, layer in enumerate(self.layers):
            s = self._run_layer(layer, s, call)
            mu = torch.sigmoid(self.gates[i] / self.gate_temperature)
            s = mu * self.downsamplers[i + 1](taps[i + 1]) + (1 - mu) * s
        if self.final_norm is not None:
            s = self.final_norm(s)
        return self.upsampler(s)

    # -- hooks on the backbone

    def attach(self, backbone: nn.Module, layers: Sequence[nn.Module]) -> None:
        self._handles = [
            backbone.register_forward_pre_hook(self._enter, with_kwargs=True),
            backbone.register_forward_hook(self._leave, with_kwargs=True, always_call=True),
            layers[0].register_forward_pre_hook(self._tap_input),
        ] + [layer.register_forward_hook(self._tap_output) for layer in layers]

    def detach_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _enter(self, module, args, kwargs):
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        self._call, self._taps = dict(bound.arguments), []
        self._grad_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(False)  # the frozen backbone records no graph
        return None

    def _tap_input(self, _module, args):
        self._taps.append(args[0])

    def _tap_output(self, _module, _args, output):
        self._taps.append(output)

    def _leave(self, _module, _args, _kwargs, output):
        torch.set_grad_enabled(self._grad_enabled)
        taps, call = self._taps, self._call
        self._taps, self._call = [], {}
        if len(taps) != len(self.layers) + 1:  # the backbone raised part-way: leave its error alone
            return None
        return output + self(taps, call)


def add_side_network(model: nn.Module, spec: SideSpec, rule: GradRule, seed: int = 0, init_up_std: float = 0.0,
                     name: str = "side") -> LadderSideNetwork:
    """Register ``LadderSideNetwork(spec)`` as ``model.<name>``, seed it plan-independently and
    hook it onto the backbone. Side layers take the model's serial init by name, down-projections
    N(0, 0.02), gates 0 (mu = 0.5), up-projection zero (``init_up_std > 0``: N(0, std), for tests)."""
    if hasattr(model, name):
        raise ValueError(f"the model already has a '{name}' attribute; side-tuning is applied once")
    side = LadderSideNetwork(spec, rule)
    model.add_module(name, side)

    def init_full(full_name: str, shape, gen):
        local = full_name[len(name) + 1:]
        if local.startswith("layers.") and spec.init_full is not None:
            return spec.init_full(full_name, shape, gen)
        if local.startswith("downsamplers.") and local.endswith("weight"):
            return torch.randn(shape, generator=gen) * 0.02
        if local == "upsampler.weight" and init_up_std > 0:
            return torch.randn(shape, generator=gen) * init_up_std
        if local.startswith("final_norm.") and local.endswith("weight"):
            return torch.ones(shape)
        return torch.zeros(shape)

    seeded_init_(((f"{name}.{n}", p) for n, p in side.named_parameters()), seed, init_full)
    side.attach(spec.backbone, spec.layers)
    logger.info("side network: width %d, %d layers, %d parameters", spec.side_hidden_size, len(side.layers),
                sum(p.numel() for p in side.parameters()))
    return side


def mark_only_side_as_trainable(model: nn.Module, name: str = "side", also=None) -> list[str]:
    """Freeze all but the side network (and the modules named in ``also``, e.g. a classifier)."""
    return freeze_all_but(model, lambda n, p: n.startswith(name + ".") or in_modules(n, also))
