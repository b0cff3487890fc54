"""What every Galaxy model shares: seeded plan-independent init, full <-> sharded state dicts,
the HF-style ``from_pretrained`` / ``save_pretrained`` over local directories, and how its layers
compute (``parallelize``). What a family is to the rest of the house is its family object
(``galaxy.models.family``), which the planner, PEFT, training and the CLIs read through
``galaxy.models``' registry instead of asking which model it is."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from galaxy.config import ConfigError, Method, ModelConfig, Plan
from galaxy.core.context import ParallelContext, param_seed
from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import shard_spec
from galaxy.core.parallelize import parallelize as parallelize_layers
from galaxy.core.pipeline import gather_stage_states, stage_of
from galaxy.kernels import cross_entropy, resolve_backend, resolve_backend_for

logger = logging.getLogger(__name__)

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Losses are computed in fp32 under bf16/fp16 autocast, and in float64 when the model is."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def use_triton(kernels: str, x: torch.Tensor, op: str) -> bool:
    """Whether the ``kernels`` setting (auto | triton | torch) runs the Triton kernel of ``op`` on ``x``. Never
    inside a torch.compile graph: there the torch reference is traced and inductor fuses it."""
    return kernels != "torch" and not torch.compiler.is_compiling() and resolve_backend(kernels, x, op) == "triton"


def plain(module: nn.Module) -> bool:
    """No hook wraps the module, so computing its math directly (a fused kernel) skips nothing."""
    return not (module._forward_hooks or module._forward_pre_hooks)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, count: torch.Tensor, kernels: str,
                   ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy summed over this rank's tokens, divided by the global target ``count``: per-rank
    values of a sequence-sharded stream add up to the serial mean. fp32 (fp64 for a fp64 model)."""
    if use_triton(kernels, logits, "cross_entropy"):  # reads half-precision logits as they are, no fp32 copy
        return cross_entropy(logits, targets, ignore_index, "mean", num_targets=count, backend="triton")
    return F.cross_entropy(at_least_fp32(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction="sum") / count


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"config key 'hidden_act': unsupported activation '{name}'; use one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def default_plan_and_context(config: ModelConfig, plan: Optional[Plan], ctx: Optional[ParallelContext]):
    """A model built without a plan is serial; a plan must fit the context's model-parallel group."""
    ctx = ctx or ParallelContext.serial()
    if plan is None:
        if ctx.mp.size != 1:
            raise ValueError("a model on several ranks needs a plan: pass cfg.resolve_plan(world_size)")
        plan = Plan(Method.NONE, Method.NONE, Method.NONE, (config.num_attention_heads,),
                    (config.intermediate_size,), (config.max_position_embeddings,))
    if plan.size != ctx.mp.size:
        raise ValueError(f"the plan has {plan.size} ranks but the model-parallel group has {ctx.mp.size}")
    return plan, ctx


class LayerParameters(NamedTuple):
    """Parameters of one transformer layer on a rank, by where their gradients go. Numbers or numpy
    arrays (the planner broadcasts over candidate splits). ``*_sharded``: the block's weights that
    TP shards (SP replicates them); ``*_row_bias``: a row-parallel output bias, whole on every rank."""

    att_sharded: np.ndarray
    att_row_bias: int
    mlp_sharded: np.ndarray
    mlp_row_bias: int
    con: int  # the norms, in CON's layout


@dataclass
class ModelOutput:
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None  # in the stream's layout: this rank's tokens under CON.sp
    hidden_states: Optional[torch.Tensor] = None


class GalaxyModel(nn.Module):
    """Base of the model definitions. Subclasses set ``hf_architecture`` and implement
    ``_init_full`` (the serial init of one full tensor), ``hf_config`` and ``config_from_hf``.

    Every model's constructor takes ``meta``: False (default) creates the parameters on
    ``ctx.device`` and draws them (``init_weights``); True lays them out on the meta device (shapes,
    dtypes, gradient rules and shard specs, no storage, no init), for a loader that fills each one in
    the format it is stored in (``galaxy.loralib.quantized.materialize``: from a checkpoint, or from
    ``initial_piece``, the same init). Only parameters go to the meta device; what a
    forward needs besides them (RoPE's frequencies, dropout streams) is made on ``ctx.device``."""

    hf_architecture = ""
    tied_keys: dict[str, str] = {}  # HF key -> the key it is tied to (not stored twice)

    # -- what the module is (the family's facts are its ``galaxy.models.family.Family``)
    model_type = ""  # the registry key, and HF's model_type
    gate_up_fusable = False  # ``fused_gate_up`` applies (a gated MLP)
    fresh_for_task: tuple[str, ...] = ()  # parameter prefixes a pretraining checkpoint lacks (task heads)

    def __init__(self, config: ModelConfig, plan: Plan, ctx: ParallelContext):
        super().__init__()
        self.config, self.plan, self.ctx = config, plan, ctx
        self.stage = stage_of(config.num_hidden_layers, ctx)  # the whole model unless ctx.pp has stages
        if config.fused_gate_up and not self.gate_up_fusable:
            raise ConfigError(f"config key 'fused_gate_up' fuses a gated MLP's gate_proj/up_proj, but "
                              f"{type(self).__name__} has none; set it to false")
        try:  # 'triton' that cannot run here fails now, not at the first forward
            resolve_backend_for(config.kernels, ctx.device)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"config key 'kernels' is '{config.kernels}' but {e}") from None

    # -- how the layers compute

    lora_fusion = False  # the PEFT setting the block edges are picked with (``parallelize``)

    def parallelize(self, lora_fusion: Optional[bool] = None) -> None:
        """Configure how the layers compute, from this model's plan and config (``galaxy.core.parallelize``):
        their block edges, memory modes (``recompute`` / ``layer_memory``, ``mlp_chunks``) and ``compile``. The
        constructor applies it; ``lora_fusion`` (kept until given again) picks the edges again for that PEFT
        setting (``galaxy.loralib.set_lora_fusion``)."""
        if lora_fusion is not None:
            self.lora_fusion = lora_fusion
        parallelize_layers(self, self.plan, self.ctx.mp, self.config, self.lora_fusion)

    # -- init

    def parameter_device(self, meta: bool) -> torch.device:
        """The device a constructor builds its parameters on (see the class docstring)."""
        return torch.device("meta") if meta else self.ctx.device

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Each full tensor drawn from a generator seeded by (seed, name), then sliced to this rank's
        shard: every plan and world size starts from exactly the serial model's weights."""
        for name, param in self.named_parameters():
            param.copy_(self.initial_piece(name, param, seed))

    def initial_piece(self, name: str, param: torch.Tensor, seed: int,
                      device: Optional[torch.device] = None) -> torch.Tensor:
        """This rank's piece of parameter ``name``'s serial init: the full tensor drawn in float32
        (``_init_param``) and sliced to ``param``'s shard (``param`` may be on the meta device: a loader
        that stores each tensor in its own format as it is made, ``galaxy.loralib.quantized.materialize``).

        ``device``: where the full tensor is drawn, by that device's generator (None: the host's, the serial
        init). A GPU draws a 7B's tensors in about a second where the host takes minutes; its values are
        those of the device type's generator (the same on every plan and world size of that device type,
        not the host's), and the full tensor of one parameter exists there until it is sliced."""
        spec = shard_spec(param)
        full = self._init_param(name, spec.full_shape(param.shape) if spec else tuple(param.shape), seed, device)
        return spec.slice(full) if spec else full

    def _init_param(self, name: str, shape: tuple[int, ...], seed: int,
                    device: Optional[torch.device] = None) -> torch.Tensor:
        """The full tensor of parameter ``name``, drawn on ``device`` (None: the host); a model whose
        layout merges HF tensors overrides this to draw each part under its HF name, so both layouts
        start from the same weights."""
        gen = torch.Generator(device=device or "cpu").manual_seed(param_seed(seed, name))
        return self._init_full(name, shape, gen)

    def _init_full(self, name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        """The full tensor of ``name`` drawn from ``gen``, on ``gen``'s device."""
        raise NotImplementedError

    # -- HF layout <-> this model's layout (the same unless a model fuses HF tensors)

    def state_from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors named as HF (or as another layout of this architecture) -> this model's names."""
        return state

    @classmethod
    def state_to_hf(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors with this model's names (either layout of the class) -> HF's names and shapes."""
        return state

    # -- state dicts in full (plan-independent) form

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's full tensors on CPU; a collective over the mp group, and over ``ctx.pp``
        on a pipeline stage (every rank must call it)."""
        local = {name: gather_full(p.detach(), p, self.ctx.mp).cpu() for name, p in self.named_parameters()}
        return gather_stage_states(local, self.ctx)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor], source: str = "state dict",
                             keep_fresh: tuple[str, ...] = ()) -> list[str]:
        """Full tensors by name, in this model's layout or HF's (``state_from_hf`` converts).
        Parameters whose names start with a ``keep_fresh`` prefix (a task head that a pretraining
        checkpoint lacks) may be missing and keep their initialisation; returns their names."""
        state = {k: v for k, v in self.state_from_hf(state).items() if k not in self.tied_keys}
        if not self.stage.is_whole:  # a pipeline stage takes the tensors it holds from a full checkpoint
            names = {name for name, _ in self.named_parameters()}
            state = {k: v for k, v in state.items() if k in names}
        params = dict(self.named_parameters())
        fresh = sorted(n for n in set(params) - set(state) if n.startswith(keep_fresh or ("\0",)))
        for name in fresh:
            del params[name]
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            raise ValueError(f"{source} does not match the model: missing {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                             f"{' ...' if len(unexpected) > 5 else ''}")
        for name, param in params.items():
            full = state[name]
            spec = shard_spec(param)
            expected = spec.full_shape(param.shape) if spec else tuple(param.shape)
            if tuple(full.shape) != tuple(expected):
                raise ValueError(f"{source}: '{name}' has shape {tuple(full.shape)} but the model needs "
                                 f"{tuple(expected)}; the checkpoint is for another model size")
            param.copy_(spec.slice(full) if spec else full)
        return fresh

    # -- HF directories

    @classmethod
    def config_from_hf(cls, hf: dict) -> ModelConfig:
        raise NotImplementedError

    @classmethod
    def hf_layout_differs(cls, config: ModelConfig) -> Optional[str]:
        """None when every parameter of a model of ``config`` is the HF checkpoint's tensor of the same name
        and shape (a loader may read them one by one); else why not, and what to set instead."""
        return None

    @classmethod
    def hf_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None) -> dict:
        """HF's ``config.json`` for a model of this class and ``config`` whose weights are stored in
        ``dtype``: what ``save_pretrained`` writes, and the checkpoint export without building a model."""
        raise NotImplementedError

    def config_to_hf(self) -> dict:
        """This model's ``config.json``."""
        return self.hf_config(self.config, next(self.parameters()).dtype)

    @classmethod
    def config_from_dir(cls, path: str, config_overrides: Optional[dict] = None):
        """The model config of a local HF checkpoint directory's config.json, with ``config_overrides``."""
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise FileNotFoundError(f"model_path '{path}' has no config.json; point it at a local HF model directory")
        with open(config_file) as f:
            config = cls.config_from_hf(json.load(f))
        for key, value in (config_overrides or {}).items():
            setattr(config, key, value)
        return config

    @classmethod
    def from_pretrained(cls, path: str, plan: Optional[Plan] = None, ctx: Optional[ParallelContext] = None,
                        config_overrides: Optional[dict] = None) -> "GalaxyModel":
        """Load a local HF checkpoint directory (config.json + safetensors or torch weights)."""
        model = cls(cls.config_from_dir(path, config_overrides), plan=plan, ctx=ctx)
        model.load_full_state_dict(load_weights(path), source=f"checkpoint '{path}'")
        model.loaded_from(path)
        return model

    def loaded_from(self, path: str) -> None:
        """Called once the weights of checkpoint directory ``path`` are in (by ``from_pretrained`` and by the
        streaming loader): what else the model keeps from the directory (a family's extra config keys)."""

    def save_pretrained(self, path: str) -> None:
        """Write config.json + model.safetensors with HF names; a collective, rank 0 writes."""
        from safetensors.torch import save_file

        state = self.state_to_hf(self.full_state_dict())
        if self.ctx.rank != 0:
            return
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config_to_hf(), f, indent=2)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a local checkpoint: safetensors (sharded or not) or torch files read with weights_only."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        from safetensors.torch import load_file

        state = {}
        for f in files:
            state.update(load_file(os.path.join(path, f)))
        return state
    bins = sorted(f for f in os.listdir(path) if f.startswith("pytorch_model") and f.endswith(".bin"))
    if not bins:
        raise FileNotFoundError(f"model_path '{path}' holds no *.safetensors or pytorch_model*.bin weights")
    state = {}
    for f in bins:
        state.update(torch.load(os.path.join(path, f), map_location="cpu", weights_only=True))
    return state
