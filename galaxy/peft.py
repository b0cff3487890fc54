"""Choosing and applying a tuning method (full / lora / adapter / side) to a built Galaxy model,
and the checkpoints that hold only what the method trains.

    model = build_base(cfg, plan, ctx)        # build_model; a frozen base made in its format, tensor by tensor
    model = apply_tuning(model, cfg)          # cfg.peft.tuning picks the method
    ...train...
    save_tuning(model, "out/adapter")         # LoRA: HF PEFT layout; adapter/side: Galaxy layout
    load_tuning(other_model, "out/adapter")   # on any plan

The method's options come from ``cfg.peft``; keys the config does not have yet (target modules,
adapter and side sizes) take the defaults below or keyword overrides.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from galaxy.adapters import add_adapters, add_side_network, mark_only_adapters_as_trainable, mark_only_side_as_trainable
from galaxy.adapters.side import SideSpec
from galaxy.config import ConfigError, GalaxyConfig, Method, ModelConfig, Plan, fused_gate_up_targets
from galaxy.core.grad_sync import gather_full
from galaxy.core.layers import region_rule
from galaxy.core.sp_attention import load_balanced
from galaxy.loralib import (inject_lora, load_lora_pretrained, mark_only_lora_as_trainable, merge_and_unload,
                            save_lora_pretrained)
from galaxy.loralib.model import lora_keeps, lora_target_names
from galaxy.loralib.hf import CONFIG_FILE, WEIGHTS_FILE, load_full_tensors, read_adapter
from galaxy.loralib.quantized_layers import FORMATS
from galaxy.loralib.quantized import (cast_frozen_, dequantize_linears, frozen_bytes,  # noqa: F401
                                     load_quantized, materialize, quantize_head, quantize_linears)
from galaxy.loralib.utils import count_parameters, in_modules

logger = logging.getLogger(__name__)

METHODS = ("full", "lora", "adapter", "side")
# Heads that a task adds on top of the pretrained model train along (PEFT's modules_to_save for SEQ_CLS).
TASK_HEADS = ("classifier",)


@dataclass
class TuningOptions:
    """Everything that defines a tuning method on a model; stored on the model as ``peft_config``."""

    method: str = "full"
    seed: int = 0
    lora_dim: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    fan_in_fan_out: bool = False
    merge_weights: bool = False
    use_rslora: bool = False
    lora_fusion: bool = False  # CCLoRA (galaxy.core.overlap.cclora); the saved factors do not change
    lora_target_modules: Optional[Union[str, list[str]]] = None  # None: the model's lora_targets
    lora_bias: str = "none"
    adapter_type: str = "houlsby"
    adapter_reduction_factor: int = 16
    adapter_non_linearity: str = "relu"
    adapter_residual: bool = True
    side_reduction_factor: int = 8
    modules_to_save: Optional[list[str]] = None  # None: the task head (classifier) when there is one
    init_std: float = 0.0  # > 0: zero-initialised factors (LoRA B, adapter/side up) drawn N(0, std); tests
    frozen_dtype: Optional[str] = None  # 'bfloat16' / 'float16': frozen weights stored so; None: left as built
    quantize_base: str = "none"  # 'nf4' (QLoRA) / 'int8' / 'fp8': frozen linears quantized, galaxy.loralib.quantized
    quantize_head: bool = False  # with fp8: the frozen output head's logits on fp8 too (loralib.quantized.quantize_head)

    @classmethod
    def from_config(cls, cfg: GalaxyConfig, **overrides: Any) -> "TuningOptions":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown tuning option(s) {unknown}; known: {sorted(fields)}")
        values = {k: getattr(cfg.peft, k) for k in fields if hasattr(cfg.peft, k)}
        values["method"] = cfg.peft.tuning
        values["seed"] = cfg.train.seed
        values["frozen_dtype"] = frozen_dtype_name(cfg)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def frozen_dtype_name(cfg: GalaxyConfig) -> Optional[str]:
    """The dtype frozen weights are stored in: the train dtype when it is bf16/fp16, the method
    freezes a base, and ``frozen_dtype`` is 'compute'; else None (they stay as built)."""
    if cfg.peft.tuning == "full" or cfg.peft.frozen_dtype != "compute":
        return None
    return cfg.train.dtype if cfg.train.dtype in ("bfloat16", "float16") else None


def build_base(cfg: GalaxyConfig, plan: Optional[Plan], ctx, task: str = "lm", init_on_device: bool = False,
               **overrides: Any) -> nn.Module:
    """``galaxy.models.build_model``, except that a base the tuning method freezes and stores small
    (``frozen_dtype`` bf16/fp16, ``quantize_base`` nf4/int8/fp8) is made tensor by tensor in that format
    (``galaxy.loralib.quantized.materialize``): laid out on the meta device, then each tensor drawn from
    the seeded init (or read from ``model_path``, slice by slice), stored as the method keeps it
    (frozen: bf16 / quantized; trainable: fp32) and the fp32 tensor freed, so no fp32 copy of the model
    ever exists. The values are those of the fp32 build cast or quantized after, bit for bit. Apply the
    method with ``apply_tuning`` after, with the same options (``overrides``: ``TuningOptions`` keys).

    ``init_on_device`` (no ``model_path``): every tensor is drawn on ``ctx.device`` by its generator and
    made there (``GalaxyModel.initial_piece``), whatever the method and formats: each rank makes only its
    shard, straight in its storage format on its device, and the host holds no weight. On a GPU the values
    are its generator's (plan-independent, not the host's serial init); on the CPU they are the same."""
    from galaxy.config import COMPUTE_KEYS
    from galaxy.models import build_model, check_config, model_class

    opts = TuningOptions.from_config(cfg, **overrides)
    path = cfg.data.model_path
    if (opts.method == "full" or (opts.frozen_dtype is None and opts.quantize_base == "none")) \
            and not (init_on_device and not path):
        return build_model(cfg, plan, ctx, task)
    check_config(cfg.model)
    cls = model_class(cfg.model.model_type, task)
    if path and opts.quantize_base == "none" and not _streamable(path, cls.hf_layout_differs(cfg.model)):
        logger.info("'%s' is read whole (no safetensors, or another layout than HF's), then its frozen weights "
                    "cast", path)
        return build_model(cfg, plan, ctx, task)
    if path:
        config = cls.config_from_dir(path, {k: getattr(cfg.model, k) for k in COMPUTE_KEYS})
        differs = cls.hf_layout_differs(config)
        if differs and opts.quantize_base != "none":
            raise ConfigError(f"quantize-on-load quantizes each linear as the checkpoint stores it, but {differs}")
    else:
        config = cfg.model
    model = cls(config, plan, ctx, seed=cfg.train.seed, meta=True)  # laid out, no storage: filled below
    also = opts.modules_to_save if opts.modules_to_save is not None else _task_heads(model)
    frozen_dtype = getattr(torch, opts.frozen_dtype) if opts.frozen_dtype else None
    return materialize(model, path or None, cfg.train.seed, frozen_by(model, opts), frozen_dtype,
                       kind=opts.quantize_base, skip=also, backend=cfg.model.kernels,
                       init_device=ctx.device if init_on_device and not path else None)


def _streamable(path: str, layout_differs: Optional[str]) -> bool:
    """The checkpoint can be read tensor by tensor under the model's own names (``layout_differs``: why not,
    ``GalaxyModel.hf_layout_differs``)."""
    return not layout_differs and os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))


def frozen_by(model: nn.Module, opts: TuningOptions):
    """``name -> bool``: whether ``opts``' method freezes base parameter ``name`` of ``model`` (what
    ``apply_options`` will mark), asked before it holds any weight, so a base is built in its frozen format."""
    also = opts.modules_to_save if opts.modules_to_save is not None else _task_heads(model)
    if opts.method == "full":
        return lambda name: False
    if opts.method == "lora":
        targets = opts.lora_target_modules or _default_lora_targets(model)
        keep = lora_keeps(opts.lora_bias, also, lora_target_names(model, targets) if targets else ())
    else:
        def keep(name: str) -> bool:
            return in_modules(name, also)
    return lambda name: not keep(name)


def apply_tuning(model: nn.Module, cfg: GalaxyConfig, targets=None, **overrides: Any) -> nn.Module:
    """Apply ``cfg.peft.tuning`` to ``model`` (in place; returned for chaining). ``targets``: the
    LoRA target modules (``lora_target_modules``), names or one regex."""
    return apply_options(model, TuningOptions.from_config(cfg, lora_target_modules=targets, **overrides))


def apply_options(model: nn.Module, opts: TuningOptions) -> nn.Module:
    if opts.method not in METHODS:
        raise ValueError(f"tuning method '{opts.method}' is not one of {', '.join(METHODS)}")
    if getattr(model, "peft_config", None) is not None:
        raise ValueError(f"the model is already tuned with '{model.peft_config.method}'; build a fresh model")
    also = opts.modules_to_save if opts.modules_to_save is not None else _task_heads(model)
    if opts.quantize_base != "none":
        if opts.quantize_base not in FORMATS or opts.method == "full":
            raise ValueError(f"quantize_base '{opts.quantize_base}' needs one of {', '.join(FORMATS)} and a frozen "
                             f"base (lora, adapter, side), not '{opts.method}'")
        # Before the method is injected, so LoRA wraps the quantized linears (as PEFT does over bitsandbytes).
        quantize_linears(model, skip=also, backend=model.config.kernels, kind=opts.quantize_base)
    if opts.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
    elif opts.method == "lora":
        targets = opts.lora_target_modules or _default_lora_targets(model)
        if not targets:
            raise ValueError(f"no default LoRA targets for model type '{model.config.model_type}'; "
                             "set lora_target_modules")
        clash = fused_gate_up_targets(targets) if getattr(model.config, "fused_gate_up", False) else []
        if clash:  # config validation catches this too; targets given in Python arrive here only
            raise ConfigError(f"config key 'lora_target_modules' names {clash}, but the model was built with "
                              "fused_gate_up, whose single gate/up weight LoRA cannot wrap; drop them or build "
                              "the model with fused_gate_up false")
        inject_lora(model, targets, r=opts.lora_dim, lora_alpha=opts.lora_alpha, lora_dropout=opts.lora_dropout,
                    fan_in_fan_out=opts.fan_in_fan_out, merge_weights=opts.merge_weights,
                    use_rslora=opts.use_rslora, seed=opts.seed, init_b_std=opts.init_std, fusion=opts.lora_fusion)
        mark_only_lora_as_trainable(model, opts.lora_bias, also=also)
    elif opts.method == "adapter":
        add_adapters(model, opts.adapter_type, opts.adapter_reduction_factor, opts.adapter_non_linearity,
                     opts.adapter_residual, seed=opts.seed, init_up_std=opts.init_std,
                     points=getattr(_family_of(model), "adapter_points", None))
        mark_only_adapters_as_trainable(model, also=also)
    else:
        add_side_network(model, side_spec(model, opts.side_reduction_factor), region_rule(model.plan.con),
                         seed=opts.seed, init_up_std=opts.init_std)
        mark_only_side_as_trainable(model, also=also)
    built_frozen = [n for n, p in model.named_parameters() if p.requires_grad and getattr(p, "stored_frozen", False)]
    if built_frozen:
        raise ValueError(f"{built_frozen[:3]} were built stored small as frozen weights (build_base), but "
                         f"'{opts.method}' trains them; give build_base the tuning options apply_tuning gets")
    if opts.frozen_dtype is not None and opts.method != "full":
        cast_frozen_(model, getattr(torch, opts.frozen_dtype))
    if opts.quantize_head:
        if opts.quantize_base != "fp8":
            raise ValueError(f"quantize_head puts the head's logits on the fp8 tensor cores beside an fp8 base; "
                             f"quantize_base is '{opts.quantize_base}', not fp8")
        quantize_head(model, backend=model.config.kernels)
    model.peft_config = opts
    trainable, total = count_parameters(model)
    logger.info("tuning '%s': %d of %d parameters trainable (%.3f%%)", opts.method, trainable, total,
                100.0 * trainable / max(total, 1))
    return model


def _task_heads(model: nn.Module) -> list[str]:
    names = {n for n, _ in model.named_modules()}
    return [h for h in TASK_HEADS if h in names]


# ----------------------------------------------------------------------------- side networks per model


def side_config(cfg: ModelConfig, reduction_factor: int) -> ModelConfig:
    """The side network's layer config: width ``hidden // r``, intermediate ``intermediate // r``,
    the most heads (at most the backbone's) that divide the width (with RoPE, into heads of even
    size), and key/value heads that divide the query heads."""
    from galaxy.models import family

    if reduction_factor <= 0:
        raise ValueError(f"side_reduction_factor must be positive, got {reduction_factor}")
    width = cfg.hidden_size // reduction_factor
    rotary = family(cfg.model_type).rotary
    heads = [h for h in range(min(cfg.num_attention_heads, max(width, 1)), 0, -1)
             if width % h == 0 and (not rotary or (width // h) % 2 == 0)]
    if width < 1 or not heads:
        even = " into even heads (RoPE)" if rotary else ""
        raise ValueError(f"side_reduction_factor {reduction_factor} leaves a side width of {width} for hidden size "
                         f"{cfg.hidden_size}, which no head count divides{even}; use a smaller factor")
    h = heads[0]
    kv = None if cfg.num_key_value_heads is None else next(k for k in range(min(cfg.kv_heads, h), 0, -1) if h % k == 0)
    return dataclasses.replace(cfg, hidden_size=width, num_attention_heads=h, num_key_value_heads=kv,
                               intermediate_size=max(1, cfg.intermediate_size // reduction_factor))


def side_plan(plan: Plan, cfg: ModelConfig) -> Plan:
    """CON's layout everywhere: ATT and MLP run SP on sequence shards when CON does, else None."""
    method = Method.SP if plan.con == Method.SP else Method.NONE
    pad = (0,) * (plan.size - 1)
    return Plan(method, plan.con, method, (cfg.num_attention_heads,) + pad, (cfg.intermediate_size,) + pad,
                plan.seq_split)


def side_spec(model: nn.Module, reduction_factor: int) -> SideSpec:
    stage = getattr(model, "stage", None)
    if stage is not None and not stage.is_whole:
        raise ValueError("side-tuning under pipeline parallelism is not supported: the side network runs beside "
                         "every layer; use pp_size 1")
    known = _family_of(model)
    if known is None:
        raise ValueError(f"side-tuning is not supported for {type(model).__name__}: it is no registered model family")
    if load_balanced(model.plan, known.causal):
        raise ConfigError("config key 'tuning' is side, whose side network attends in the natural token order, but "
                          "sp_attention ring runs this causal model's stream in the zigzag order; use sp_attention "
                          "allgather or ulysses")
    scfg = side_config(model.config, reduction_factor)
    return known.side_spec(model, scfg, side_plan(model.plan, scfg))


# ----------------------------------------------------------------------------- checkpoints


def _family_of(model: nn.Module):
    """The registered family of ``model`` (``galaxy.models.family``), or None for another module."""
    from galaxy.models import MODEL_FAMILIES

    return MODEL_FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))


def _default_lora_targets(model: nn.Module) -> list[str]:
    """HF PEFT's default LoRA targets for the model's architecture (none for an unregistered module)."""
    return list(getattr(_family_of(model), "lora_targets", ()))


def _task_type(model: nn.Module) -> Optional[str]:
    if getattr(_family_of(model), "causal", False):
        return "CAUSAL_LM"
    return "SEQ_CLS" if "classifier" in {n for n, _ in model.named_modules()} else None


def save_tuning(model: nn.Module, path: str, base_model_name_or_path: Optional[str] = None) -> None:
    """Save only what the method trains, as full tensors (plan-independent). LoRA goes in HF PEFT's
    layout (``peft.PeftModel.from_pretrained`` loads it on the transformers model); adapters and side
    networks in the same two files with Galaxy's names. A collective: every rank calls it, rank 0 writes."""
    opts: Optional[TuningOptions] = getattr(model, "peft_config", None)
    if opts is None or opts.method == "full":
        raise ValueError("the model has no tuning method applied; save a full model with save_pretrained")
    also = opts.modules_to_save if opts.modules_to_save is not None else _task_heads(model)
    if opts.method == "lora":
        save_lora_pretrained(model, path, targets=opts.lora_target_modules, bias=opts.lora_bias,
                             modules_to_save=also or None, task_type=_task_type(model),
                             base_model_name_or_path=base_model_name_or_path)
        return
    from safetensors.torch import save_file

    comm = model.ctx.mp
    state = {n: gather_full(p.detach(), p, comm).cpu().contiguous() for n, p in model.named_parameters()
             if p.requires_grad}
    if model.ctx.rank != 0:
        return
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"galaxy_tuning": dataclasses.asdict(opts), "base_model_name_or_path": base_model_name_or_path},
                  f, indent=2)
    save_file(state, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    logger.info("saved %d %s tensors to %s", len(state), opts.method, path)


def load_tuning(model: nn.Module, path: str, trainable: bool = True) -> nn.Module:
    """Apply the method saved in ``path`` to a fresh ``model`` (any plan) and load its weights.
    Reads HF PEFT LoRA directories too. ``trainable=False`` freezes the loaded weights as well."""
    config, tensors = read_adapter(path)
    if "galaxy_tuning" in config:
        opts = TuningOptions(**config["galaxy_tuning"])
        apply_options(model, opts)
        load_full_tensors(model, tensors, source=f"adapter '{path}'")
    else:
        seed = getattr(getattr(model, "ctx", None), "seed", 0)
        load_lora_pretrained(model, path, seed=seed)
        also = config.get("modules_to_save") or []
        mark_only_lora_as_trainable(model, config.get("bias", "none"), also=also)
        targets = config.get("target_modules")
        opts = TuningOptions(method="lora", seed=seed, lora_dim=int(config["r"]),
                             lora_alpha=float(config["lora_alpha"]),
                             lora_dropout=float(config.get("lora_dropout") or 0.0),
                             fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
                             use_rslora=bool(config.get("use_rslora", False)),
                             lora_target_modules=targets if isinstance(targets, (str, type(None))) else list(targets),
                             lora_bias=config.get("bias", "none"), modules_to_save=list(also))
        model.peft_config = opts
    if not trainable:
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def export_merged(model: nn.Module, path: str, dtype: Optional[torch.dtype] = None) -> None:
    """Merge LoRA into the base weights, unload it, and ``save_pretrained`` the plain model (HF layout),
    every weight in ``dtype`` when given (e.g. bf16). A quantized base is dequantized first (the merge is
    done in fp32). Changes ``model`` in place (it is the base architecture afterwards). A collective."""
    opts = getattr(model, "peft_config", None)
    if opts is not None and opts.method not in ("full", "lora"):
        raise ValueError(f"'{opts.method}' adds modules the base architecture lacks; only LoRA merges into it")
    dequantize_linears(model, torch.float32)
    merge_and_unload(model)
    if dtype is not None:
        model.to(dtype)
    model.peft_config = None
    model.save_pretrained(path)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters in full, plan-independent sizes (quantized weights counted too)."""
    return count_parameters(model)
