"""Typed, validated run configuration loaded from JSON.

A config file is either nested (``{"model": {...}, "parallel": {...}, "train": {...},
"data": {...}, "distributed": {...}, "peft": {...}}``) or flat, as in the original Galaxy-LM
files (``{"hidden_size": 768, "pad_size": 128, "att_parallel_method": "TP", ...}``). Every key
name is unique across sections, so a flat key always finds its section. Unknown keys are errors
that name the closest valid key; nothing is dropped silently.

``GalaxyConfig.resolve_plan(mp_size)`` turns the parallel section into a ``Plan``: one method
per block and the per-rank head, FFN and sequence splits, validated against the model.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, get_args, get_origin, get_type_hints

from galaxy.errors import UserError

logger = logging.getLogger(__name__)


class ConfigError(UserError, ValueError):
    """A problem with the user's configuration; the message names the key and the fix."""


# ----------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    model_type: str = "bert"
    preset: Optional[str] = None
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: Optional[int] = None  # LLaMA GQA; None = num_attention_heads
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02
    pad_token_id: Optional[int] = 0  # None: no padding row (HF LLaMA's default)
    num_labels: int = 2
    # BERT classification: the pooler reads the [CLS] state (HF's BertForSequenceClassification) or the mean
    # over the real tokens (ModernBERT's 'mean'), for bases whose [CLS] was never trained (MLM-only).
    classifier_pooling: str = "cls"
    # LLaMA-family fields (ignored by BERT)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = False
    qkv_bias: Optional[bool] = None  # LLaMA family: q/k/v projection biases; None: the architecture's
    # How the model computes, not what it is (never written to HF configs):
    # none | full (each layer's forward again in backward) | selective (attention core) | mlp (the MLP block)
    recompute: str = "none"
    recompute_num_layers: Optional[int] = None  # recompute only the first K layers of the model or stage; None: all
    # Per-layer activation memory (galaxy.core.recompute.MemoryMode): manual (recompute / recompute_num_layers, or
    # layer_memory) | auto (the planner picks the fastest per-layer mix within memory_budget_gib)
    activation_memory: str = "manual"
    # one mode per model layer: none | selective | mlp | full, each optionally +offload (what the layer still
    # saves for backward is held in host memory, copied during forward and brought back ahead of its backward)
    layer_memory: Optional[list[str]] = None
    memory_budget_gib: Optional[float] = None  # auto: one device's memory for the run; unset: the device's total
    host_memory_budget_gib: Optional[float] = None  # auto: pinned host memory one rank may offload to
    host_link_gb_per_s: Optional[float] = None  # auto without a profile: the host link's GB/s (unset: a default)
    mlp_chunks: int = 1  # the MLP over this many sequence chunks (with mlp recompute: one chunk rebuilt at a time)
    fused_gate_up: bool = False  # LLaMA: gate and up in one [2, intermediate, hidden] weight, one matmul
    kernels: str = "auto"  # auto (per op, the measured winner on the device: galaxy/kernels/_backend.py) | triton | torch
    compile: bool = False  # torch.compile each transformer layer (rules: galaxy.core.compile)
    # torch.compile's mode for those layers; reduce-overhead replays each layer's kernels as a CUDA graph
    compile_mode: str = "default"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads


@dataclass
class ParallelConfig:
    plan: Optional[str] = None  # preset: none | tp | sp | galaxy | galaxy2
    att_parallel_method: Optional[str] = None  # TP | SP | None
    con_parallel_method: Optional[str] = None  # SP | None
    mlp_parallel_method: Optional[str] = None  # TP | SP | None
    tp_num_attention_heads_list: Optional[list[int]] = None
    tp_intermediate_size_list: Optional[list[int]] = None
    seq_scatter_list: Optional[list[int]] = None
    # CoC: TP linears at block edges overlap their collectives in 1|2|4|8 chunks (1 = no overlap);
    # None = the COC_PARALLEL_NUM environment variable, else 1.
    coc_parallel_num: Optional[int] = None
    # Overlap of the TP edges' collectives with their matmuls: none | coc (chunked, coc_parallel_num chunks,
    # 4 when unset) | async_tp (symmetric-memory fused all-gather/reduce-scatter matmuls, torchtitan's
    # async TP: CUDA + NCCL, sequence-sharded stream, even seq splits). None: coc_parallel_num alone decides.
    tp_overlap: Optional[str] = None
    # How an SP attention block (ATT.sp) attends over the whole sequence from its sequence shard
    # (galaxy.core.sp_attention): allgather (K and V gathered in one collective, Llama 3's context
    # parallelism) | ring (K/V blocks passed around the mp ranks, overlapped with the blocks' attention,
    # merged by their log-sum-exp; causal models in the load-balanced zigzag order) | ulysses
    # (DeepSpeed-Ulysses: all-to-all to head shards, whole-sequence attention on this rank's heads, back).
    sp_attention: str = "allgather"
    # Data and pipeline parallelism around the mp group: world = dp_size x pp_size x mp.
    dp_size: int = 1
    pp_size: int = 1
    stage_num_hidden_layers_list: Optional[list[int]] = None  # layers per pipeline stage; None = balanced
    num_microbatches: int = 1  # micro-batches per dp shard of the global batch
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b
    # Who runs the schedule when pp_size > 1: torch (torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B,
    # galaxy.core.pipeline_torch) | galaxy (Galaxy's own point-to-point schedules, galaxy.core.pipeline)
    pipeline_engine: str = "torch"
    # ddp (bucketed all-reduce overlapping backward) | zero1 | deepspeed | fsdp2 (torch's fully_shard over the dp
    # ranks: parameters, gradients and optimizer state sharded over dp, gradients reduce-scattered per layer)
    dp_engine: str = "ddp"
    zero_stage: int = 1  # DeepSpeed ZeRO stage (1 or 2) when dp_engine is deepspeed
    dp_bucket_mb: float = 25.0  # size of one gradient bucket (the dp sum and the mp PARTIAL reductions)
    # PARTIAL gradients (replicated weights used on sequence shards) summed over mp: after_backward |
    # overlap (bucketed, during backward) | sharded (reduce-scattered during backward; their optimizer
    # state and fp32 masters sharded over mp, the updated weights all-gathered: ZeRO-2 over mp) | fsdp (the
    # replicated weights of SP blocks sharded over mp by torch's fully_shard, with their gradients and
    # optimizer state: all-gathered before use, gradients reduce-scattered (summed); over dp x mp with fsdp2)
    mp_grad_reduce: str = "after_backward"
    # FSDP (dp_engine fsdp2, mp_grad_reduce fsdp), as torchtitan's: default (always, or never with pp > 1) |
    # always (free the gathered weights after forward, gather again in backward) | never (keep them to backward)
    reshard_after_forward: str = "default"
    # FSDP's gradient reduce-scatter with several micro-batches: every_micro_batch (torchtitan's: sharded
    # gradients accumulate) | last_micro_batch (unsharded fp32 gradients accumulate on each rank, one
    # reduce-scatter per step, as DDP's no_sync and Megatron do: less traffic and copies, more memory)
    fsdp_grad_sync: str = "every_micro_batch"


@dataclass
class TrainConfig:
    global_batch_size: int = 8
    seq_length: int = 128
    max_steps: int = 100
    lr: float = 1e-4
    warmup_steps: int = 0
    lr_schedule: str = "linear"  # linear | cosine | constant
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    mlm_probability: float = 0.15
    seed: int = 1234
    dtype: str = "float32"  # float32 | float64 | bfloat16 | float16 (autocast with fp32 master weights)
    device: str = "auto"  # auto | cpu | cuda | npu
    log_every: int = 10
    optimizer: str = "adamw"  # adamw | sgd
    sgd_momentum: float = 0.9
    # Rows of one micro-batch on each dp rank: global_batch_size = micro_batch_size x dp_size x
    # accumulation steps, so it sets num_microbatches (None: num_microbatches as given).
    micro_batch_size: Optional[int] = None
    grad_reduce_dtype: str = "float32"  # float32 | the compute dtype: precision of gradient all-reduces
    loss_scale: Optional[float] = None  # float16: a static loss scale; None = dynamic scaling
    initial_loss_scale: float = 65536.0  # float16 dynamic scaling: the starting scale
    loss_scale_window: int = 1000  # steps without overflow before the dynamic scale doubles
    min_loss_scale: float = 1.0
    skip_nonfinite: bool = False  # a non-finite loss or gradient skips the step instead of stopping the run
    task: str = "mlm"  # BERT: mlm (masked-LM pretraining) | classify (sequence classification on labelled data)
    eval_every: int = 0  # evaluate on the held-out split every N steps (0: never)
    eval_iters: int = 4  # global batches per evaluation
    # Checkpoint saves (--save_dir), as torchtitan's async_mode: 'disabled' (each save finishes before the
    # next step) | 'async' (the tensors are copied to CPU, written while training goes on; the next save
    # and the end of training wait for it).
    checkpoint_async_mode: str = "disabled"
    # Peak dense TFLOP/s of one device, for MFU (also --peak_tflops); None: looked up for known GPUs
    # (galaxy/profiler/devices.py), none on CPU, where MFU is then not reported.
    peak_tflops: Optional[float] = None
    # Full training with the transformer layers' linears on float8 tensor cores (torchao's float8 training:
    # inputs, weights and output gradients cast to e4m3 each step, galaxy.core.float8): none | tensorwise
    # (one scale a tensor) | rowwise (one scale a row: more accurate, slower); the output head and linears with
    # a dim that is not a multiple of 16 stay in the compute dtype.
    float8_training: str = "none"
    # With float8_training tensorwise and dp_engine fsdp2: FSDP all-gathers the weights already cast to fp8
    # (torchao's enable_fsdp_float8_all_gather: half of bf16's bytes).
    float8_fsdp_all_gather: bool = False


@dataclass
class DataConfig:
    data: Optional[str] = None  # a local .txt / .jsonl file; None = the built-in synthetic corpus
    tokenizer: Optional[str] = None  # a local HF tokenizer directory
    eval_data: Optional[str] = None
    model_path: Optional[str] = None  # a local HF checkpoint directory to start from


@dataclass
class DistributedConfig:
    init_method: str = "env://"
    distributed_backend: str = "auto"  # auto | gloo | nccl | hccl
    timeout_s: float = 120.0
    # the devices (ranks of a profiled / emulated cluster) this run's ranks take, in order; None: all
    devices: Optional[list[int]] = None


@dataclass
class PeftConfig:
    tuning: str = "full"  # full | lora | adapter | side
    lora_dim: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    fan_in_fan_out: bool = False
    merge_weights: bool = False
    lora_target_modules: Optional[list[str]] = None  # None: BERT query/value, LLaMA q_proj/v_proj; any module name
    lora_bias: str = "none"  # none | all | lora_only
    use_rslora: bool = False  # scale alpha / sqrt(r) instead of alpha / r
    # CCLoRA (galaxy.core.overlap.cclora): scale folded into A, W + B(sA) merged when tokens >= hidden (not
    # while LoRA dropout is active), and the branch overlapped with the TP collectives; same math, same
    # dropout masks and same saved factors as plain LoRA.
    lora_fusion: bool = False
    adapter_type: str = "houlsby"  # houlsby (after ATT and MLP) | pfeiffer (after MLP)
    adapter_reduction_factor: int = 16
    adapter_non_linearity: str = "relu"  # relu | gelu | gelu_new | silu | swish | tanh
    adapter_residual: bool = True
    side_reduction_factor: int = 8  # side network width = hidden_size / side_reduction_factor
    modules_to_save: Optional[list[str]] = None  # trained along with the method; None: the task head
    # Frozen base weights (tuning other than full) under train dtype bfloat16/float16: 'compute' stores them in
    # that dtype (no fp32 copy, no per-step cast); 'float32' keeps fp32 copies. Trainable weights stay fp32.
    frozen_dtype: str = "compute"
    # QLoRA: frozen linear weights (all but the LM head and modules_to_save) in 4-bit NF4, blocks of 64 with
    # double-quantized absmax (galaxy.loralib.nf4), or 'int8' (row-wise absmax, LLM.int8 weights,
    # galaxy.loralib.int8), or 'fp8' (row-wise e4m3, 1 byte a weight, multiplied on the fp8 tensor cores with
    # the activations quantized per token row, galaxy.loralib.fp8); 'none' keeps them in frozen_dtype.
    quantize_base: str = "none"


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "distributed": DistributedConfig,
    "peft": PeftConfig,
}

# Flat names used by the original Galaxy-LM configs and common CLI habits.
ALIASES = {
    "pad_size": "seq_length",
    "seq_len": "seq_length",
    "batch_size": "global_batch_size",
    "learning_rate": "lr",
    "train_path": "data",
    "dev_path": "eval_data",
    "vocab_path": "tokenizer",
    "lora_r": "lora_dim",
    "lora_att_dim": "lora_dim",
    "timeout": "timeout_s",
    "backend": "distributed_backend",
    "parallel_plan": "plan",
    "target_modules": "lora_target_modules",
    "num_micro_batches": "num_microbatches",
    "recompute_granularity": "recompute",  # Megatron-LM's name
}

# Galaxy-LM keys that have no meaning here: accepted, with a warning naming why.
IGNORED_LEGACY_KEYS = {
    "directionality": "BERT is always bidirectional",
    "train": "training is selected by the CLI you run",
    "test_path": "evaluation uses eval_data",
    "num_epochs": "training length is max_steps",
    "att_head_size": "derived from hidden_size / num_attention_heads",
    "class_list": "classification labels come from the data",
}

# Seed-style tuning flags, mapped onto peft.tuning.
TUNING_FLAGS = {"full_model": "full", "use_lora": "lora", "use_adapter": "adapter", "use_side": "side"}

# Named model sizes (config keys); a family needs none. galaxy.models checks the model_type itself.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "bert-tiny": dict(model_type="bert", hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=512),
    "bert-mini": dict(model_type="bert", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                      intermediate_size=1024),
    "bert-base": dict(model_type="bert", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072),
    "bert-large": dict(model_type="bert", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       intermediate_size=4096),
    "llama-tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=176,
                       max_position_embeddings=512, hidden_act="silu", tie_word_embeddings=False, pad_token_id=None,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # Llama-3.2-1B shapes: about 1.24B parameters with the 128k vocabulary, tied embeddings.
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
                     max_position_embeddings=131072, hidden_act="silu", tie_word_embeddings=True,
                     rope_theta=500000.0, rms_norm_eps=1e-5, pad_token_id=None,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # Llama-3.1-8B shapes: 8.03B parameters, 128k vocabulary, untied, llama3 RoPE scaling to 128k positions.
    "llama-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                     max_position_embeddings=131072, hidden_act="silu", tie_word_embeddings=False,
                     rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0,
                                                            original_max_position_embeddings=8192),
                     rms_norm_eps=1e-5, pad_token_id=None, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "llama-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                     max_position_embeddings=4096, hidden_act="silu", tie_word_embeddings=False,
                     rms_norm_eps=1e-5, pad_token_id=None, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}


def _key_index() -> dict[str, str]:
    index = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"duplicate config key {f.name}"
            index[f.name] = section
    return index


KEY_SECTION = _key_index()


def _suggest(key: str) -> str:
    candidates = list(KEY_SECTION) + list(ALIASES) + list(SECTIONS) + list(TUNING_FLAGS)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _coerce(section_cls, key: str, value: Any) -> Any:
    """Check ``value`` against the field's annotation, converting the safe cases (int -> float)."""
    hint = get_type_hints(section_cls)[key]
    optional = get_origin(hint) is not None and type(None) in get_args(hint)
    if optional:
        if value is None:
            return None
        hint = next(a for a in get_args(hint) if a is not type(None))
    origin = get_origin(hint)
    if origin is list:
        (item,) = get_args(hint)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, item) and not isinstance(v, bool)
                                                           for v in value):
            raise ConfigError(f"config key '{key}' must be a list of {item.__name__}, got {value!r}")
        return list(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if hint is dict and isinstance(value, dict):
        return value
    if not isinstance(value, hint) or (hint in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"config key '{key}' must be {hint.__name__}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- plan


class Method(str, enum.Enum):
    TP = "TP"
    SP = "SP"
    NONE = "None"

    @classmethod
    def parse(cls, key: str, value: Optional[str]) -> "Method":
        text = "None" if value is None else str(value)
        for m in cls:
            if text.lower() == m.value.lower():
                return m
        raise ConfigError(f"config key '{key}': unknown parallel method '{value}'; use one of TP, SP, None")


PLAN_PRESETS = {
    "none": (Method.NONE, Method.NONE, Method.NONE),
    "tp": (Method.TP, Method.NONE, Method.TP),
    "sp": (Method.SP, Method.SP, Method.SP),
    "galaxy": (Method.TP, Method.SP, Method.TP),
    "galaxy2": (Method.TP, Method.SP, Method.SP),
}


@dataclass(frozen=True)
class Plan:
    """The resolved parallel plan of one model-parallel group: a method per block and the splits."""

    att: Method
    con: Method
    mlp: Method
    heads_split: tuple[int, ...]
    ffn_split: tuple[int, ...]
    seq_split: tuple[int, ...]
    coc_parallel_num: Optional[int] = None  # as configured; galaxy.core.overlap.coc.coc_chunks resolves it
    tp_overlap: Optional[str] = None  # "async_tp" selects galaxy.core.overlap.async_tp at the TP edges
    sp_attention: str = "allgather"  # ATT.sp's flavour (galaxy.core.sp_attention); heads_split is Ulysses' split

    @property
    def size(self) -> int:
        return len(self.seq_split)

    @property
    def name(self) -> str:
        for name, methods in PLAN_PRESETS.items():
            if methods == (self.att, self.con, self.mlp):
                return name
        return f"att={self.att.value},con={self.con.value},mlp={self.mlp.value}"

    @staticmethod
    def serial(cfg: "GalaxyConfig") -> "Plan":
        m = cfg.model
        return Plan(Method.NONE, Method.NONE, Method.NONE, (m.num_attention_heads,),
                    (m.intermediate_size,), (cfg.train.seq_length,))


PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PIPELINE_ENGINES = ("torch", "galaxy")
DP_ENGINES = ("ddp", "zero1", "deepspeed", "fsdp2")
MP_GRAD_REDUCE = ("after_backward", "overlap", "sharded", "fsdp")
RESHARD_AFTER_FORWARD = ("default", "always", "never")
FSDP_GRAD_SYNCS = ("every_micro_batch", "last_micro_batch")
OPTIMIZERS = ("adamw", "sgd")
RECOMPUTE_MODES = ("none", "full", "selective", "mlp")
OFFLOAD = "+offload"  # a layer memory mode's suffix: what the layer still saves is held on the host
LAYER_MEMORY_MODES = RECOMPUTE_MODES + tuple(m + OFFLOAD for m in RECOMPUTE_MODES)
TP_OVERLAPS = ("none", "coc", "async_tp")
SP_ATTENTIONS = ("allgather", "ring", "ulysses")
COC_DEFAULT_CHUNKS = 4  # tp_overlap coc without coc_parallel_num
KERNEL_BACKENDS = ("auto", "triton", "torch")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# ModelConfig keys that choose how a model computes, not what it is: a model loaded from a
# checkpoint directory takes them from the run's config (e.g. ``cfg.model = config_from_hf(...)``
# should carry them over).
ACTIVATION_MEMORY_KEYS = ("activation_memory", "layer_memory", "memory_budget_gib", "host_memory_budget_gib",
                          "host_link_gb_per_s", "mlp_chunks")
COMPUTE_KEYS = ("recompute", "recompute_num_layers", *ACTIVATION_MEMORY_KEYS, "fused_gate_up", "kernels", "compile",
                "compile_mode")
FUSED_GATE_UP_NAMES = ("gate_proj", "up_proj", "gate_up_proj")


def fused_gate_up_targets(targets) -> list[str]:
    """The LoRA targets that name LLaMA's gate/up projections, which ``fused_gate_up`` merges."""
    if isinstance(targets, str):  # a regex (Python API): does it match a layer's gate/up modules?
        import re

        return [n for n in FUSED_GATE_UP_NAMES if re.fullmatch(targets, f"model.layers.0.mlp.{n}")]
    return [t for t in targets or () if t.rsplit(".", 1)[-1] in FUSED_GATE_UP_NAMES]


def balanced_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal positive pieces, larger pieces first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# ----------------------------------------------------------------------------- config


@dataclass
class GalaxyConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)

    # -- loading

    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: Optional[dict[str, Any]] = None) -> "GalaxyConfig":
        flat = _flatten(raw)
        flat.update(_flatten(overrides or {}))
        cfg = cls()
        preset = flat.pop("preset", None)
        if preset is not None:
            if preset not in MODEL_PRESETS:
                raise ConfigError(f"config key 'preset': unknown model preset '{preset}'; "
                                  f"use one of {', '.join(MODEL_PRESETS)}")
            cfg.model.preset = preset
            for key, value in MODEL_PRESETS[preset].items():
                setattr(cfg.model, key, dict(value) if isinstance(value, dict) else value)  # the preset's own stays
        for key, value in flat.items():
            section = getattr(cfg, KEY_SECTION[key])
            setattr(section, key, _coerce(type(section), key, value))
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str, overrides: Optional[dict[str, Any]] = None) -> "GalaxyConfig":
        return cls.from_dict(read_config_file(path), overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- validation

    def validate(self) -> None:
        m, t = self.model, self.train
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
            value = getattr(getattr(self, KEY_SECTION[key]), key)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"config key '{key}' must be in [0, 1), got {value}")
        for key in ("global_batch_size", "seq_length", "max_steps"):
            if getattr(t, key) <= 0:
                raise ConfigError(f"config key '{key}' must be positive, got {getattr(t, key)}")
        if t.seq_length > m.max_position_embeddings:
            raise ConfigError(f"config key 'seq_length' ({t.seq_length}) exceeds max_position_embeddings "
                              f"({m.max_position_embeddings}); shorten the sequence or raise the limit")
        self._validate_precision_and_steps()
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
        }
        for (section, key), allowed in choices.items():
            value = getattr(getattr(self, section), key)
            if value not in allowed:
                raise ConfigError(f"config key '{key}': '{value}' is not one of {', '.join(allowed)}")
        for key in ("lora_dim", "lora_alpha", "adapter_reduction_factor", "side_reduction_factor"):  # alpha 0: LoRA off
            if getattr(self.peft, key) <= 0:
                raise ConfigError(f"config key '{key}' must be positive, got {getattr(self.peft, key)}")
        if not 0.0 <= self.peft.lora_dropout < 1.0:
            raise ConfigError(f"config key 'lora_dropout' must be in [0, 1), got {self.peft.lora_dropout}")
        if self.distributed.timeout_s <= 0:
            raise ConfigError(f"config key 'timeout_s' must be positive, got {self.distributed.timeout_s}")
        devices = self.distributed.devices
        if devices is not None and (not devices or min(devices) < 0 or len(set(devices)) != len(devices)):
            raise ConfigError(f"config key 'devices' must list distinct cluster ranks (0, 1, ...), got {devices}")
        p = self.parallel
        if p.plan is not None and p.plan.lower() not in PLAN_PRESETS:
            raise ConfigError(f"config key 'plan': unknown plan '{p.plan}'; use one of {', '.join(PLAN_PRESETS)}")
        if p.coc_parallel_num is not None and p.coc_parallel_num not in (1, 2, 4, 8):
            raise ConfigError(f"config key 'coc_parallel_num' must be 1, 2, 4 or 8 (chunks per TP linear; "
                              f"1 = no overlap), got {p.coc_parallel_num}")
        self._validate_tp_overlap()
        self.methods()  # method names are checked here, splits once the world size is known
        self._validate_sp_attention()
        self._validate_dp_pp()
        self._validate_compute()

    def _validate_tp_overlap(self) -> None:
        """What can be checked before the world size is known (resolve_plan checks the splits and
        galaxy.core.overlap.async_tp the device, backend and torch build)."""
        p = self.parallel
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
        if p.tp_overlap == "async_tp" and self.peft.lora_fusion:
            raise ConfigError("config key 'tp_overlap' async_tp does not combine with lora_fusion (CCLoRA overlaps "
                              "the LoRA branch with its own chunked collectives); set tp_overlap to coc or "
                              "lora_fusion to false")

    def _validate_sp_attention(self) -> None:
        """What the SP attention flavours cannot do (resolve_plan checks Ulysses' heads per rank)."""
        p, m = self.parallel, self.model
        if p.sp_attention not in SP_ATTENTIONS:
            raise ConfigError(f"config key 'sp_attention': '{p.sp_attention}' is not one of {', '.join(SP_ATTENTIONS)}")
        if p.sp_attention == "allgather":
            return
        att = self.methods()[0]
        if att != Method.SP:
            raise ConfigError(f"config key 'sp_attention' is '{p.sp_attention}', which chooses how an SP attention "
                              f"block attends, but att_parallel_method is {att.value}; use a plan with ATT SP (e.g. "
                              "sp) or drop sp_attention")
        if p.sp_attention == "ring" and m.attention_probs_dropout_prob > 0:
            raise ConfigError(f"config key 'sp_attention' ring attends block by block without attention dropout, but "
                              f"attention_probs_dropout_prob is {m.attention_probs_dropout_prob}; set it to 0 or use "
                              "sp_attention allgather or ulysses")

    def _validate_compute(self) -> None:
        m = self.model
        if m.recompute_num_layers is not None:
            if m.recompute_num_layers < 1:
                raise ConfigError(f"config key 'recompute_num_layers' must be at least 1, got "
                                  f"{m.recompute_num_layers}; leave it unset to recompute every layer")
            if m.recompute == "none":
                raise ConfigError("config key 'recompute_num_layers' is set but 'recompute' is 'none'; "
                                  "set recompute to full, selective or mlp, or drop recompute_num_layers")
        self._validate_activation_memory()
        q = self.peft
        if q.quantize_base != "none" and q.tuning == "full":
            raise ConfigError(f"config key 'quantize_base' is '{q.quantize_base}' but tuning is 'full', which trains "
                              "the base weights; choose lora, adapter or side, or set quantize_base to none")
        if q.quantize_base != "none" and m.fused_gate_up:
            raise ConfigError("config key 'quantize_base' quantizes each linear on its own, but fused_gate_up holds "
                              "gate and up as one [2, I, H] weight; set fused_gate_up to false")
        if q.quantize_base != "none" and q.lora_fusion:
            raise ConfigError("config key 'lora_fusion' (CCLoRA) merges W + BA, which a quantized base cannot hold; "
                              "set lora_fusion to false or quantize_base to none")
        self._validate_float8()
        if m.compile_mode != "default" and not m.compile:
            raise ConfigError(f"config key 'compile_mode' is '{m.compile_mode}' but compile is false; set compile "
                              "to true or drop compile_mode")
        if m.compile:
            lora = self.peft.lora_dropout if self.peft.tuning == "lora" else 0.0
            on = [f"{k}={v}" for k, v in (("hidden_dropout_prob", m.hidden_dropout_prob),
                                          ("attention_probs_dropout_prob", m.attention_probs_dropout_prob),
                                          ("lora_dropout", lora)) if v > 0]
            if on:
                logger.warning("config key 'compile' is true, but dropout is on (%s): layers run eagerly while "
                               "training, because compiled graphs do not draw from Galaxy's per-layer dropout "
                               "streams; set these to 0 to train compiled (evaluation is compiled either way)",
                               ", ".join(on))
        clash = fused_gate_up_targets(self.peft.lora_target_modules) if self.peft.tuning == "lora" else []
        if m.fused_gate_up and clash:
            raise ConfigError(f"config key 'lora_target_modules' names {clash}, but with fused_gate_up the gate "
                              "and up projections are one fused weight that LoRA cannot wrap; drop them from "
                              "lora_target_modules or set fused_gate_up to false")

    def _validate_float8(self) -> None:
        t, p = self.train, self.parallel
        if t.float8_training != "none":
            if self.peft.tuning != "full":
                raise ConfigError(f"config key 'float8_training' is '{t.float8_training}' but tuning is "
                                  f"'{self.peft.tuning}', which freezes the base; for an fp8 frozen base set "
                                  "quantize_base to fp8 and float8_training to none")
            if t.dtype == "float64":
                raise ConfigError("config key 'float8_training' rounds the linears' operands to float8, which a "
                                  "float64 run would not measure; set dtype to bfloat16 or float32")
            if self.model.fused_gate_up:
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

    def _validate_activation_memory(self) -> None:
        m = self.model
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
        if m.mlp_chunks > 1 and self.peft.tuning == "lora" and self.peft.lora_dropout > 0:
            logger.warning("config key 'mlp_chunks' is %d, but lora_dropout is on: an MLP whose LoRA projections "
                           "draw dropout masks runs whole (chunks would draw them in another order)", m.mlp_chunks)
        offloads = m.activation_memory == "auto" or any(x.endswith(OFFLOAD) for x in m.layer_memory or ())
        if offloads and m.compile and m.compile_mode in ("reduce-overhead", "max-autotune"):
            raise ConfigError(f"config key 'compile_mode' {m.compile_mode} replays layers as CUDA graphs, whose "
                              "saved tensors cannot go to the host; use compile_mode default, or no +offload mode")

    def _validate_precision_and_steps(self) -> None:
        t = self.train
        if t.optimizer not in OPTIMIZERS:
            raise ConfigError(f"config key 'optimizer': '{t.optimizer}' is not one of {', '.join(OPTIMIZERS)}")
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

    def _validate_dp_pp(self) -> None:
        p, t = self.parallel, self.train
        for key in ("dp_size", "pp_size", "num_microbatches"):
            if getattr(p, key) < 1:
                raise ConfigError(f"config key '{key}' must be at least 1, got {getattr(p, key)}")
        if p.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"config key 'pipeline_schedule': '{p.pipeline_schedule}' is not one of "
                              f"{', '.join(PIPELINE_SCHEDULES)}")
        if p.pipeline_engine not in PIPELINE_ENGINES:
            raise ConfigError(f"config key 'pipeline_engine': '{p.pipeline_engine}' is not one of "
                              f"{', '.join(PIPELINE_ENGINES)}")
        if p.dp_engine not in DP_ENGINES:
            raise ConfigError(f"config key 'dp_engine': '{p.dp_engine}' is not one of {', '.join(DP_ENGINES)}")
        if p.mp_grad_reduce not in MP_GRAD_REDUCE:
            raise ConfigError(f"config key 'mp_grad_reduce': '{p.mp_grad_reduce}' is not one of "
                              f"{', '.join(MP_GRAD_REDUCE)}")
        if p.zero_stage not in (1, 2):
            raise ConfigError(f"config key 'zero_stage' must be 1 or 2, got {p.zero_stage}")
        self._validate_fsdp()
        if p.dp_bucket_mb <= 0:
            raise ConfigError(f"config key 'dp_bucket_mb' must be positive, got {p.dp_bucket_mb}")
        self.stage_layers()
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

    def _validate_fsdp(self) -> None:
        """What torch's fully_shard (``dp_engine: fsdp2``, ``mp_grad_reduce: fsdp``) cannot be combined with."""
        p = self.parallel
        fsdp2, mp_fsdp = p.dp_engine == "fsdp2", p.mp_grad_reduce == "fsdp"
        if p.reshard_after_forward not in RESHARD_AFTER_FORWARD:
            raise ConfigError(f"config key 'reshard_after_forward': '{p.reshard_after_forward}' is not one of "
                              f"{', '.join(RESHARD_AFTER_FORWARD)}")
        if p.reshard_after_forward != "default" and not (fsdp2 or mp_fsdp):
            raise ConfigError("config key 'reshard_after_forward' applies to FSDP only; set dp_engine fsdp2 or "
                              "mp_grad_reduce fsdp, or drop it")
        if p.fsdp_grad_sync not in FSDP_GRAD_SYNCS:
            raise ConfigError(f"config key 'fsdp_grad_sync': '{p.fsdp_grad_sync}' is not one of "
                              f"{', '.join(FSDP_GRAD_SYNCS)}")
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
        if self.peft.tuning != "full":
            raise ConfigError(f"config key '{key}' is '{getattr(p, key)}', which shards trainable weights of full "
                              f"tuning only, but tuning is '{self.peft.tuning}'; use tuning full, or dp_engine "
                              "ddp and mp_grad_reduce after_backward")

    def stage_layers(self) -> tuple[int, ...]:
        """Hidden layers held by each pipeline stage: ``stage_num_hidden_layers_list`` checked
        against ``pp_size`` and ``num_hidden_layers``, or a balanced split (larger stages first)."""
        p, layers = self.parallel, self.model.num_hidden_layers
        if p.stage_num_hidden_layers_list is None:
            if p.pp_size > layers:
                raise ConfigError(f"config key 'pp_size' ({p.pp_size}) exceeds num_hidden_layers ({layers}); "
                                  "every pipeline stage needs at least one layer")
            return tuple(balanced_split(layers, p.pp_size))
        given = p.stage_num_hidden_layers_list
        if len(given) != p.pp_size:
            raise ConfigError(f"config key 'stage_num_hidden_layers_list' has {len(given)} entries but pp_size is "
                              f"{p.pp_size}; give one layer count per pipeline stage")
        if any(n <= 0 for n in given):
            raise ConfigError(f"config key 'stage_num_hidden_layers_list' must hold positive layer counts, "
                              f"got {given}")
        if sum(given) != layers:
            raise ConfigError(f"config key 'stage_num_hidden_layers_list' sums to {sum(given)} but "
                              f"num_hidden_layers is {layers}; make the stages add up to {layers}")
        return tuple(given)

    def mp_size(self, world_size: int) -> int:
        """The model-parallel size left when ``dp_size x pp_size`` ranks are taken from the world."""
        p = self.parallel
        if world_size % (p.dp_size * p.pp_size):
            raise ConfigError(f"world size {world_size} is not divisible by dp_size x pp_size = {p.dp_size} x "
                              f"{p.pp_size} = {p.dp_size * p.pp_size}; use a world that is a multiple of it")
        return world_size // (p.dp_size * p.pp_size)

    def methods(self) -> tuple[Method, Method, Method]:
        p = self.parallel
        explicit = [Method.parse(k, getattr(p, k)) if getattr(p, k) is not None else None
                    for k in ("att_parallel_method", "con_parallel_method", "mlp_parallel_method")]
        preset = PLAN_PRESETS[p.plan.lower()] if p.plan else (Method.NONE,) * 3
        if p.plan:
            for key, given, wanted in zip(("att_parallel_method", "con_parallel_method", "mlp_parallel_method"),
                                          explicit, preset):
                if given is not None and given != wanted:
                    raise ConfigError(f"config key '{key}' is {given.value} but plan '{p.plan}' needs "
                                      f"{wanted.value}; drop one of the two")
        att, con, mlp = (e if e is not None else d for e, d in zip(explicit, preset))
        if con == Method.TP:
            raise ConfigError("config key 'con_parallel_method': CON has no TP form (it holds no weight "
                              "matrix to split); use SP or None")
        return att, con, mlp

    def resolve_plan(self, mp_size: int) -> Plan:
        """The plan for a model-parallel group of ``mp_size`` ranks, with every split checked."""
        att, con, mlp = self.methods()
        m, p, seq = self.model, self.parallel, self.train.seq_length
        uses_seq = Method.SP in (att, con, mlp)

        def splits(key: str, given: Optional[list[int]], total: int, used: bool, what: str) -> tuple[int, ...]:
            if given is None:
                if used and total < mp_size:
                    raise ConfigError(f"world size {mp_size} cannot be used: {what} ({total}) must be at least "
                                      f"the model-parallel size so every rank gets a share; use fewer ranks")
                return tuple(balanced_split(total, mp_size)) if total >= mp_size else (total,) + (0,) * (mp_size - 1)
            if len(given) != mp_size:
                raise ConfigError(f"config key '{key}' has {len(given)} entries but the model-parallel group has "
                                  f"{mp_size} ranks; give one entry per rank")
            if any(v <= 0 for v in given):
                raise ConfigError(f"config key '{key}' must hold positive splits, got {given}")
            if sum(given) != total:
                raise ConfigError(f"config key '{key}' sums to {sum(given)} but {what} is {total}; "
                                  f"make the splits add up to {total}")
            return tuple(given)

        ulysses = att == Method.SP and p.sp_attention == "ulysses" and mp_size > 1
        if ulysses and m.num_attention_heads < mp_size:
            raise ConfigError(f"config key 'sp_attention' ulysses splits the attention heads over the model-parallel "
                              f"ranks, but there are {m.num_attention_heads} heads for {mp_size} ranks; use "
                              "sp_attention ring or allgather, or at most as many ranks as heads")
        heads = splits("tp_num_attention_heads_list", p.tp_num_attention_heads_list, m.num_attention_heads,
                       att == Method.TP or ulysses, "num_attention_heads")
        ffn = splits("tp_intermediate_size_list", p.tp_intermediate_size_list, m.intermediate_size,
                     mlp == Method.TP, "intermediate_size")
        seqs = splits("seq_scatter_list", p.seq_scatter_list, seq, uses_seq, "seq_length")
        if att == Method.TP and m.kv_heads != m.num_attention_heads:
            group = m.num_attention_heads // m.kv_heads
            if any(h % group for h in heads):
                raise ConfigError(f"config key 'tp_num_attention_heads_list' {list(heads)} splits a group of "
                                  f"{group} query heads that share one key/value head; make every entry a "
                                  f"multiple of {group}")
        chunks = {"none": 1, "async_tp": 1, "coc": p.coc_parallel_num or COC_DEFAULT_CHUNKS}.get(
            p.tp_overlap, p.coc_parallel_num)
        if p.tp_overlap == "async_tp":
            self._check_async_tp_plan(att, con, mlp, seqs)
        return Plan(att, con, mlp, heads, ffn, seqs, chunks, p.tp_overlap, p.sp_attention)

    @staticmethod
    def _check_async_tp_plan(att: Method, con: Method, mlp: Method, seqs: tuple[int, ...]) -> None:
        """Async TP fuses the S -> T all-gather and the P -> S reduce-scatter around TP blocks, in
        equal shards (torch's symm_mem ops split evenly): the plan must have those edges."""
        if con != Method.SP or Method.TP not in (att, mlp):
            raise ConfigError(f"config key 'tp_overlap' async_tp fuses the all-gather/reduce-scatter between a "
                              f"sequence-sharded stream and TP blocks, which this plan (att={att.value}, "
                              f"con={con.value}, mlp={mlp.value}) does not have; use plan galaxy or galaxy2 "
                              f"(con SP, a TP block), or tp_overlap coc")
        if len(set(seqs)) > 1:
            raise ConfigError(f"config key 'tp_overlap' async_tp needs equal sequence shards (torch's fused "
                              f"symm_mem ops split evenly), but seq_scatter_list is {list(seqs)}; make the splits "
                              f"equal (seq_length divisible by the model-parallel size) or use tp_overlap coc")


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """Nested or flat JSON -> {canonical key: value}, with aliases, tuning flags and legacy keys handled."""
    flat: dict[str, Any] = {}
    tuning_flags = []

    def put(key: str, value: Any, where: str) -> None:
        if key in TUNING_FLAGS:
            if not isinstance(value, bool):
                raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
            if value:
                tuning_flags.append(key)
            return
        if key in IGNORED_LEGACY_KEYS:
            logger.warning("config key '%s' is ignored: %s", key, IGNORED_LEGACY_KEYS[key])
            return
        canonical = ALIASES.get(key, key)
        if canonical not in KEY_SECTION:
            raise ConfigError(f"unknown config key '{key}'{where}{_suggest(key)}")
        if canonical in flat and flat[canonical] != value:
            raise ConfigError(f"config key '{canonical}' is given twice with different values "
                              f"({flat[canonical]!r} and {value!r}); keep one")
        flat[canonical] = value

    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            for inner, v in value.items():
                put(inner, v, f" in section '{key}'")
        else:
            put(key, value, "")
    if len(tuning_flags) > 1:
        raise ConfigError(f"config keys {', '.join(tuning_flags)} select more than one tuning method; "
                          "set only one (or use 'tuning')")
    if tuning_flags:
        chosen = TUNING_FLAGS[tuning_flags[0]]
        if "tuning" in flat and flat["tuning"] != chosen:
            raise ConfigError(f"config key '{tuning_flags[0]}' selects '{chosen}' but 'tuning' is "
                              f"'{flat['tuning']}'; keep one")
        flat["tuning"] = chosen
    return flat


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """The JSON object in the file ``path`` (``what`` names it in the one-line error of a file that is not one)."""
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} '{path}' is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} '{path}' must hold a JSON object")
    return raw


def read_config_file(path: str) -> dict[str, Any]:
    """A config file's raw JSON object (nested or flat; ``GalaxyConfig.from_dict`` reads it)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist; pass --config_file with a JSON file "
                          "(see train_config/)")
    return read_json_object(path, "config file")


def canonical_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A raw config, nested or flat, as {canonical key: value} (aliases and tuning flags resolved, a preset
    left as its name), checked as ``GalaxyConfig.from_dict`` checks it: what the CLIs merge configs by."""
    return _flatten(raw)


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line; VALUE is read as JSON when it parses, else as a string."""
    if "=" not in text:
        raise ConfigError(f"--override '{text}' must look like KEY=VALUE, e.g. --override hidden_dropout_prob=0")
    key, value = text.split("=", 1)
    key = key.strip()
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key, parsed
