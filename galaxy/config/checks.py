"""Every check of a config that needs no world size: each bad value or clash of keys is one ConfigError
line naming the key and the fix (``GalaxyConfig.validate`` runs them; the plan's splits are checked by
``galaxy.config.plan.resolve_plan`` once the world size is known)."""

from __future__ import annotations

import logging

from galaxy.config.keys import TUNING_FLAGS
from galaxy.config.plan import methods, stage_layers
from galaxy.config.presets import PLAN_PRESETS
from galaxy.config.sections import (COMPILE_MODES, CUDA_GRAPH_MODES, DP_ENGINES, FSDP_GRAD_SYNCS, KERNEL_BACKENDS,
                                    KEY_SECTION, LAYER_MEMORY_MODES, MP_GRAD_REDUCE, OFFLOAD, OPTIMIZER_IMPLEMENTATIONS,
                                    OPTIMIZERS, PIPELINE_ENGINES, PIPELINE_SCHEDULES, RECOMPUTE_MODES,
                                    RESHARD_AFTER_FORWARD, SP_ATTENTIONS, TP_OVERLAPS, ConfigError, ConfigSections,
                                    Method, fused_gate_up_targets)

logger = logging.getLogger(__name__)


def validate(cfg: ConfigSections) -> None:
    """Each value, and the keys that must agree, as far as they can be checked before the world size is known."""
    m, t = cfg.model, cfg.train
    if not isinstance(m.model_type, str) or not m.model_type:  # which types exist: galaxy.models.check_config
        raise ConfigError(f"config key 'model_type' must name a model family, got {m.model_type!r}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"config key '{key}' must be positive, got {getattr(m, key)}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"config key 'hidden_size' ({m.hidden_size}) must be divisible by "
                          f"num_attention_heads ({m.num_attention_heads})")
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(f"config key 'num_key_value_heads' ({m.kv_heads}) must divide "
                          f"num_attention_heads ({m.num_attention_heads})")
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "mlm_probability"):
        value = getattr(getattr(cfg, KEY_SECTION[key]), key)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"config key '{key}' must be in [0, 1), got {value}")
    for key in ("global_batch_size", "seq_length", "max_steps"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"config key '{key}' must be positive, got {getattr(t, key)}")
    if t.seq_length > m.max_position_embeddings:
        raise ConfigError(f"config key 'seq_length' ({t.seq_length}) exceeds max_position_embeddings "
                          f"({m.max_position_embeddings}); shorten the sequence or raise the limit")
    _validate_precision_and_steps(cfg)
    if not t.lr > 0:
        raise ConfigError(f"config key 'lr' must be positive, got {t.lr}")
    for key in ("warmup_steps", "weight_decay", "grad_clip"):  # grad_clip 0: no clipping
        if getattr(t, key) < 0:
            raise ConfigError(f"config key '{key}' must be 0 or positive, got {getattr(t, key)}")
    choices = {
        ("train", "lr_schedule"): ("linear", "cosine", "constant"),
        ("train", "dtype"): ("float32", "float64", "bfloat16", "float16"),
        ("train", "task"): ("mlm", "classify"),
        ("train", "checkpoint_async_mode"): ("disabled", "async"),
        ("train", "device"): ("auto", "cpu", "cuda", "npu"),
        ("distributed", "distributed_backend"): ("auto", "gloo", "nccl", "hccl"),
        ("peft", "tuning"): tuple(TUNING_FLAGS.values()),
        ("peft", "lora_bias"): ("none", "all", "lora_only"),
        ("peft", "adapter_type"): ("houlsby", "pfeiffer"),
        ("peft", "adapter_non_linearity"): ("relu", "gelu", "gelu_new", "silu", "swish", "tanh"),
        ("peft", "frozen_dtype"): ("compute", "float32"),
        ("peft", "quantize_base"): ("none", "nf4", "int8", "fp8"),
        ("train", "float8_training"): ("none", "tensorwise", "rowwise"),
        ("model", "recompute"): RECOMPUTE_MODES,
        ("model", "activation_memory"): ("manual", "auto"),
        ("model", "kernels"): KERNEL_BACKENDS,
        ("model", "compile_mode"): COMPILE_MODES,
        ("model", "classifier_pooling"): ("cls", "mean"),
        ("train", "optimizer"): OPTIMIZERS,
        ("train", "optimizer_implementation"): OPTIMIZER_IMPLEMENTATIONS,
        ("parallel", "pipeline_schedule"): PIPELINE_SCHEDULES,
        ("parallel", "pipeline_engine"): PIPELINE_ENGINES,
        ("parallel", "dp_engine"): DP_ENGINES,
        ("parallel", "mp_grad_reduce"): MP_GRAD_REDUCE,
        ("parallel", "reshard_after_forward"): RESHARD_AFTER_FORWARD,
        ("parallel", "fsdp_grad_sync"): FSDP_GRAD_SYNCS,
        ("parallel", "sp_attention"): SP_ATTENTIONS,
    }
    for (section, key), allowed in choices.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"config key '{key}': '{value}' is not one of {', '.join(allowed)}")
    for key in ("lora_dim", "lora_alpha", "adapter_reduction_factor", "side_reduction_factor"):  # alpha 0: LoRA off
        if getattr(cfg.peft, key) <= 0:
            raise ConfigError(f"config key '{key}' must be positive, got {getattr(cfg.peft, key)}")
    if not 0.0 <= cfg.peft.lora_dropout < 1.0:
        raise ConfigError(f"config key 'lora_dropout' must be in [0, 1), got {cfg.peft.lora_dropout}")
    if cfg.distributed.timeout_s <= 0:
        raise ConfigError(f"config key 'timeout_s' must be positive, got {cfg.distributed.timeout_s}")
    devices = cfg.distributed.devices
    if devices is not None and (not devices or min(devices) < 0 or len(set(devices)) != len(devices)):
        raise ConfigError(f"config key 'devices' must list distinct cluster ranks (0, 1, ...), got {devices}")
    p = cfg.parallel
    if p.plan is not None and p.plan.lower() not in PLAN_PRESETS:
        raise ConfigError(f"config key 'plan': unknown plan '{p.plan}'; use one of {', '.join(PLAN_PRESETS)}")
    if p.coc_parallel_num is not None and p.coc_parallel_num not in (1, 2, 4, 8):
        raise ConfigError(f"config key 'coc_parallel_num' must be 1, 2, 4 or 8 (chunks per TP linear; "
                          f"1 = no overlap), got {p.coc_parallel_num}")
    _validate_tp_overlap(cfg)
    methods(cfg)  # method names are checked here, splits once the world size is known
    _validate_sp_attention(cfg)
    _validate_dp_pp(cfg)
    _validate_compute(cfg)


def _validate_tp_overlap(cfg: ConfigSections) -> None:
    """What can be checked before the world size is known (resolve_plan checks the splits and
    galaxy.core.overlap.async_tp the device, backend and torch build)."""
    p = cfg.parallel
    if p.tp_overlap is None:
        return
    if p.tp_overlap not in TP_OVERLAPS:
        raise ConfigError(f"config key 'tp_overlap': '{p.tp_overlap}' is not one of {', '.join(TP_OVERLAPS)}")
    chunks = p.coc_parallel_num
    if p.tp_overlap != "coc" and chunks is not None and chunks > 1:
        raise ConfigError(f"config key 'tp_overlap' is '{p.tp_overlap}' but coc_parallel_num is {chunks} (CoC "
                          f"chunks); set tp_overlap to coc, or drop coc_parallel_num")
    if p.tp_overlap == "coc" and chunks == 1:
        raise ConfigError("config key 'tp_overlap' is 'coc' but coc_parallel_num is 1 (no overlap); set "
                          "coc_parallel_num to 2, 4 or 8, or tp_overlap to none")
    if p.tp_overlap == "async_tp" and cfg.peft.lora_fusion:
        raise ConfigError("config key 'tp_overlap' async_tp does not combine with lora_fusion (CCLoRA overlaps "
                          "the LoRA branch with its own chunked collectives); set tp_overlap to coc or "
                          "lora_fusion to false")


def _validate_sp_attention(cfg: ConfigSections) -> None:
    """What the SP attention flavours cannot do (resolve_plan checks Ulysses' heads per rank)."""
    p, m = cfg.parallel, cfg.model
    if p.sp_attention == "allgather":
        return
    att = methods(cfg)[0]
    if att != Method.SP:
        raise ConfigError(f"config key 'sp_attention' is '{p.sp_attention}', which chooses how an SP attention "
                          f"block attends, but att_parallel_method is {att.value}; use a plan with ATT SP (e.g. "
                          "sp) or drop sp_attention")
    if p.sp_attention == "ring" and m.attention_probs_dropout_prob > 0:
        raise ConfigError(f"config key 'sp_attention' ring attends block by block without attention dropout, but "
                          f"attention_probs_dropout_prob is {m.attention_probs_dropout_prob}; set it to 0 or use "
                          "sp_attention allgather or ulysses")


def _validate_compute(cfg: ConfigSections) -> None:
    m = cfg.model
    if m.recompute_num_layers is not None:
        if m.recompute_num_layers < 1:
            raise ConfigError(f"config key 'recompute_num_layers' must be at least 1, got "
                              f"{m.recompute_num_layers}; leave it unset to recompute every layer")
        if m.recompute == "none":
            raise ConfigError("config key 'recompute_num_layers' is set but 'recompute' is 'none'; "
                              "set recompute to full, selective or mlp, or drop recompute_num_layers")
    _validate_activation_memory(cfg)
    q = cfg.peft
    if q.quantize_base != "none" and q.tuning == "full":
        raise ConfigError(f"config key 'quantize_base' is '{q.quantize_base}' but tuning is 'full', which trains "
                          "the base weights; choose lora, adapter or side, or set quantize_base to none")
    if q.quantize_base != "none" and m.fused_gate_up:
        raise ConfigError("config key 'quantize_base' quantizes each linear on its own, but fused_gate_up holds "
                          "gate and up as one [2, I, H] weight; set fused_gate_up to false")
    if q.quantize_head and q.quantize_base != "fp8":
        raise ConfigError(f"config key 'quantize_head' puts the output head's logits on the fp8 tensor cores beside "
                          f"an fp8 base, but quantize_base is '{q.quantize_base}'; set quantize_base to fp8 or "
                          "quantize_head to false")
    if q.quantize_head and "lm_head" in (q.modules_to_save or []):
        raise ConfigError("config key 'quantize_head' keeps the output head frozen, but modules_to_save trains "
                          "lm_head; drop it from modules_to_save or set quantize_head to false")
    if q.quantize_base != "none" and q.lora_fusion:
        raise ConfigError("config key 'lora_fusion' (CCLoRA) merges W + BA, which a quantized base cannot hold; "
                          "set lora_fusion to false or quantize_base to none")
    _validate_float8(cfg)
    if m.compile_mode != "default" and not m.compile:
        raise ConfigError(f"config key 'compile_mode' is '{m.compile_mode}' but compile is false; set compile "
                          "to true or drop compile_mode")
    if m.compile_options is not None:
        _validate_compile_options(m)
    if m.compile_backend != "inductor":
        _validate_compile_backend(m)
    if m.compile:
        lora = cfg.peft.lora_dropout if cfg.peft.tuning == "lora" else 0.0
        on = [f"{k}={v}" for k, v in (("hidden_dropout_prob", m.hidden_dropout_prob),
                                      ("attention_probs_dropout_prob", m.attention_probs_dropout_prob),
                                      ("lora_dropout", lora)) if v > 0]
        if on:
            logger.warning("config key 'compile' is true, but dropout is on (%s): layers run eagerly while "
                           "training, because compiled graphs do not draw from Galaxy's per-layer dropout "
                           "streams; set these to 0 to train compiled (evaluation is compiled either way)",
                           ", ".join(on))
    clash = fused_gate_up_targets(cfg.peft.lora_target_modules) if cfg.peft.tuning == "lora" else []
    if m.fused_gate_up and clash:
        raise ConfigError(f"config key 'lora_target_modules' names {clash}, but with fused_gate_up the gate "
                          "and up projections are one fused weight that LoRA cannot wrap; drop them from "
                          "lora_target_modules or set fused_gate_up to false")


def _validate_float8(cfg: ConfigSections) -> None:
    t, p = cfg.train, cfg.parallel
    if t.float8_training != "none":
        if cfg.peft.tuning != "full":
            raise ConfigError(f"config key 'float8_training' is '{t.float8_training}' but tuning is "
                              f"'{cfg.peft.tuning}', which freezes the base; for an fp8 frozen base set "
                              "quantize_base to fp8 and float8_training to none")
        if t.dtype == "float64":
            raise ConfigError("config key 'float8_training' rounds the linears' operands to float8, which a "
                              "float64 run would not measure; set dtype to bfloat16 or float32")
        if cfg.model.fused_gate_up:
            raise ConfigError("config key 'float8_training' runs the parallel linears in float8, but "
                              "fused_gate_up makes gate and up one [2, I, H] weight that is none; set "
                              "fused_gate_up to false")
        if p.dp_engine == "deepspeed":
            raise ConfigError("config key 'float8_training' runs on Galaxy's Trainer, and dp_engine 'deepspeed' "
                              "keeps its own bf16 weights; use dp_engine fsdp2 (torchtitan's float8 recipe), "
                              "ddp or zero1")
        if p.tp_overlap not in (None, "none") or (p.coc_parallel_num or 1) > 1:
            raise ConfigError("config key 'float8_training' runs each linear through torchao's float8 matmul, "
                              "which the overlapped TP edges (tp_overlap, coc_parallel_num) do not call; "
                              "drop tp_overlap and coc_parallel_num")
    if t.float8_fsdp_all_gather and (t.float8_training != "tensorwise" or p.dp_engine != "fsdp2"):
        raise ConfigError("config key 'float8_fsdp_all_gather' needs float8_training 'tensorwise' (torchao "
                          f"gathers tensorwise-scaled weights only) and dp_engine 'fsdp2', got "
                          f"'{t.float8_training}' and '{p.dp_engine}'")


def _validate_activation_memory(cfg: ConfigSections) -> None:
    m = cfg.model
    for key in ("memory_budget_gib", "host_memory_budget_gib", "host_link_gb_per_s"):
        value = getattr(m, key)
        if value is not None and not value > 0:
            raise ConfigError(f"config key '{key}' must be positive, got {value}")
    if m.mlp_chunks < 1:
        raise ConfigError(f"config key 'mlp_chunks' must be at least 1 (1: the MLP whole), got {m.mlp_chunks}")
    if m.layer_memory is not None:
        bad = [x for x in m.layer_memory if x not in LAYER_MEMORY_MODES]
        if bad:
            raise ConfigError(f"config key 'layer_memory': '{bad[0]}' is not one of "
                              f"{', '.join(LAYER_MEMORY_MODES)}")
        if len(m.layer_memory) != m.num_hidden_layers:
            raise ConfigError(f"config key 'layer_memory' lists {len(m.layer_memory)} modes for "
                              f"{m.num_hidden_layers} layers; give one per layer")
    manual_keys = [k for k, on in (("recompute", m.recompute != "none"),
                                   ("recompute_num_layers", m.recompute_num_layers is not None),
                                   ("layer_memory", m.layer_memory is not None)) if on]
    if m.activation_memory == "auto" and manual_keys:
        raise ConfigError(f"config key 'activation_memory' is auto, which picks each layer's mode, but "
                          f"{manual_keys[0]} is set; drop it or set activation_memory to manual")
    if m.activation_memory == "manual":
        if m.layer_memory is not None and len(manual_keys) > 1:
            raise ConfigError(f"config key 'layer_memory' gives every layer's mode, but {manual_keys[0]} is "
                              "set too; drop one of them")
        for key in ("memory_budget_gib", "host_memory_budget_gib", "host_link_gb_per_s"):
            if getattr(m, key) is not None:
                raise ConfigError(f"config key '{key}' is set but activation_memory is manual (it is what auto "
                                  "plans with); set activation_memory to auto or drop it")
    if m.mlp_chunks > 1 and cfg.peft.tuning == "lora" and cfg.peft.lora_dropout > 0:
        logger.warning("config key 'mlp_chunks' is %d, but lora_dropout is on: an MLP whose LoRA projections "
                       "draw dropout masks runs whole (chunks would draw them in another order)", m.mlp_chunks)
    offloads = m.activation_memory == "auto" or any(x.endswith(OFFLOAD) for x in m.layer_memory or ())
    if offloads and m.captures_cuda_graphs:
        key = "compile_mode" if m.compile_mode in CUDA_GRAPH_MODES else "compile_options"
        raise ConfigError(f"config key '{key}' replays layers as CUDA graphs, whose saved tensors cannot go to "
                          "the host; use compile_mode default without triton.cudagraphs, or no +offload mode")


def _validate_compile_options(m) -> None:
    """``compile_options``: inductor's own option names with JSON scalar values (inductor checks each value's
    meaning when it compiles)."""
    if not m.compile:
        raise ConfigError("config key 'compile_options' is set but compile is false; set compile to true or drop "
                          "compile_options")
    import difflib

    from torch._inductor import list_options

    known = list_options()
    for key, value in m.compile_options.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else " (torch._inductor.list_options() lists them)"
            raise ConfigError(f"config key 'compile_options' names '{key}', which is no inductor option{hint}")
        if not isinstance(value, (bool, int, float, str)):
            raise ConfigError(f"config key 'compile_options' sets '{key}' to {value!r}; give a number, a string "
                              "or true/false")


def _validate_compile_backend(m) -> None:
    """``compile_backend``: a backend torch.compile knows; modes and options are inductor's."""
    if not m.compile:
        raise ConfigError(f"config key 'compile_backend' is '{m.compile_backend}' but compile is false; set compile "
                          "to true or drop compile_backend")
    for key, unset in (("compile_mode", m.compile_mode == "default"), ("compile_options", m.compile_options is None)):
        if not unset:
            raise ConfigError(f"config key '{key}' is inductor's, but compile_backend is '{m.compile_backend}'; drop "
                              f"{key} or set compile_backend to inductor")
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if m.compile_backend not in known:
        raise ConfigError(f"config key 'compile_backend' is '{m.compile_backend}', which torch.compile does not know; "
                          f"use one of {', '.join(sorted(known))}")


def _validate_precision_and_steps(cfg: ConfigSections) -> None:
    t = cfg.train
    if not 0.0 <= t.sgd_momentum < 1.0:
        raise ConfigError(f"config key 'sgd_momentum' must be in [0, 1), got {t.sgd_momentum}")
    if t.grad_reduce_dtype not in ("float32", t.dtype):
        raise ConfigError(f"config key 'grad_reduce_dtype': '{t.grad_reduce_dtype}' must be float32 or the "
                          f"compute dtype '{t.dtype}'")
    if t.loss_scale is not None and t.loss_scale <= 0:
        raise ConfigError(f"config key 'loss_scale' must be positive (a static scale), got {t.loss_scale}; "
                          "leave it unset for dynamic scaling")
    if not t.min_loss_scale > 0 or t.initial_loss_scale < t.min_loss_scale:
        raise ConfigError(f"config keys 'initial_loss_scale' ({t.initial_loss_scale}) and 'min_loss_scale' "
                          f"({t.min_loss_scale}) must be positive with initial >= min")
    if t.peak_tflops is not None and not t.peak_tflops > 0:
        raise ConfigError(f"config key 'peak_tflops' must be positive (dense TFLOP/s of one device), got "
                          f"{t.peak_tflops}; leave it unset to look it up for known GPUs")
    for key, least in (("loss_scale_window", 1), ("eval_every", 0), ("eval_iters", 1)):
        if getattr(t, key) < least:
            raise ConfigError(f"config key '{key}' must be at least {least}, got {getattr(t, key)}")


def _validate_dp_pp(cfg: ConfigSections) -> None:
    p, t = cfg.parallel, cfg.train
    for key in ("dp_size", "pp_size", "num_microbatches"):
        if getattr(p, key) < 1:
            raise ConfigError(f"config key '{key}' must be at least 1, got {getattr(p, key)}")
    if p.zero_stage not in (1, 2):
        raise ConfigError(f"config key 'zero_stage' must be 1 or 2, got {p.zero_stage}")
    _validate_fsdp(cfg)
    if p.dp_bucket_mb <= 0:
        raise ConfigError(f"config key 'dp_bucket_mb' must be positive, got {p.dp_bucket_mb}")
    stage_layers(cfg)
    if t.global_batch_size % p.dp_size:
        raise ConfigError(f"config key 'global_batch_size' ({t.global_batch_size}) is not divisible into "
                          f"dp_size={p.dp_size} data-parallel shards; use a multiple of {p.dp_size}")
    shard = t.global_batch_size // p.dp_size
    if t.micro_batch_size is not None:
        if t.micro_batch_size < 1 or shard % t.micro_batch_size:
            raise ConfigError(f"config key 'micro_batch_size' ({t.micro_batch_size}) must be a positive divisor "
                              f"of the {shard} rows of each data-parallel shard (global_batch_size "
                              f"{t.global_batch_size} / dp_size {p.dp_size})")
        steps = shard // t.micro_batch_size
        if p.num_microbatches not in (1, steps):
            raise ConfigError(f"config keys 'micro_batch_size' ({t.micro_batch_size}) and 'num_microbatches' "
                              f"({p.num_microbatches}) disagree: {shard} rows per dp shard make {steps} "
                              "micro-batches; set only one of them")
        p.num_microbatches = steps
    if shard % p.num_microbatches:
        raise ConfigError(f"config key 'num_microbatches' ({p.num_microbatches}) does not divide the "
                          f"{shard} rows of each data-parallel shard (global_batch_size "
                          f"{t.global_batch_size} / dp_size {p.dp_size}); use a divisor of {shard}")


def _validate_fsdp(cfg: ConfigSections) -> None:
    """What torch's fully_shard (``dp_engine: fsdp2``, ``mp_grad_reduce: fsdp``) cannot be combined with."""
    p = cfg.parallel
    fsdp2, mp_fsdp = p.dp_engine == "fsdp2", p.mp_grad_reduce == "fsdp"
    if p.reshard_after_forward != "default" and not (fsdp2 or mp_fsdp):
        raise ConfigError("config key 'reshard_after_forward' applies to FSDP only; set dp_engine fsdp2 or "
                          "mp_grad_reduce fsdp, or drop it")
    if p.fsdp_grad_sync != "every_micro_batch" and not (fsdp2 or mp_fsdp):
        raise ConfigError("config key 'fsdp_grad_sync' applies to FSDP only; set dp_engine fsdp2 or "
                          "mp_grad_reduce fsdp, or drop it")
    if not (fsdp2 or mp_fsdp):
        return
    key = "dp_engine" if fsdp2 else "mp_grad_reduce"
    if fsdp2 and p.zero_stage != 1:
        raise ConfigError(f"config key 'zero_stage' ({p.zero_stage}) is a DeepSpeed key but dp_engine is "
                          "'fsdp2', which shards everything over dp already; drop zero_stage")
    if fsdp2 and p.mp_grad_reduce in ("overlap", "sharded"):
        raise ConfigError(f"config key 'mp_grad_reduce' is '{p.mp_grad_reduce}' but dp_engine 'fsdp2' reduces "
                          "gradients inside FSDP; use mp_grad_reduce after_backward or fsdp")
    if mp_fsdp and p.dp_engine in ("zero1", "deepspeed"):
        raise ConfigError(f"config key 'mp_grad_reduce' is 'fsdp', which dp_engine '{p.dp_engine}' cannot "
                          "step (its weights are DTensor shards); use dp_engine ddp or fsdp2")
    if cfg.peft.tuning != "full":
        raise ConfigError(f"config key '{key}' is '{getattr(p, key)}', which shards trainable weights of full "
                          f"tuning only, but tuning is '{cfg.peft.tuning}'; use tuning full, or dp_engine "
                          "ddp and mp_grad_reduce after_backward")
