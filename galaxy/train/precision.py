"""What a training step does about precision: float16 loss scaling, and finding where a
non-finite value came from when a step goes bad.

float16 training keeps fp32 master weights (the parameters; autocast computes in fp16) and fp32
optimizer state. Its gradients would underflow in fp16, so the loss is multiplied by a scale for
backward and the gradients divided by it before clipping and the step. With dynamic scaling (as
Megatron's and torch's ``GradScaler``) a step whose gradients overflowed anywhere is skipped and the
scale halved; after ``loss_scale_window`` clean steps it doubles. Whether a step overflowed is read
from the global gradient norm, which every rank computes with the same collectives, so all ranks
skip the same steps.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn as nn

from galaxy.config import TrainConfig
from galaxy.core.fsdp import local

logger = logging.getLogger(__name__)


class LossScaler:
    """The loss scale of float16 training (static when ``loss_scale`` is set, else dynamic)."""

    def __init__(self, t: TrainConfig):
        self.dynamic = t.loss_scale is None
        self.scale = float(t.initial_loss_scale if self.dynamic else t.loss_scale)
        self.window, self.min_scale = t.loss_scale_window, t.min_loss_scale
        self.clean_steps = 0

    def unscale_(self, params: list[nn.Parameter]) -> None:
        grads = [local(p.grad) for p in params if p.grad is not None]  # FSDP's DTensors: their shards
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale = max(self.scale / 2, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def first_nonfinite_parameter(model: nn.Module, grads: bool) -> Optional[str]:
    """Name of the first parameter (in module order) whose value, or gradient, is not finite."""
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is not None and not torch.isfinite(t).all():
            return name
    return None


def first_nonfinite_module(model: nn.Module, replay: Callable[[], None]) -> Optional[str]:
    """Run ``replay`` (a forward of the failed step's batch) with a hook on every submodule and
    return the name of the first module, in call order, whose output holds a non-finite value."""
    found: list[str] = []

    def hook(name):
        def check(module, inputs, output):
            tensors = output if isinstance(output, (tuple, list)) else (getattr(output, "logits", output),)
            if not found and any(isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all()
                                 for t in tensors):
                found.append(name)
        return check

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if name]
    try:
        replay()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
