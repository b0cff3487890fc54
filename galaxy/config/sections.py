"""The typed sections of a run's configuration and the values their keys allow.

The bottom of ``galaxy.config``: the six section dataclasses, ``ConfigSections`` (a config's data, which
the checks, the plan resolution and ``GalaxyConfig`` read), the parallel ``Method``, the choice lists and
the index from each key to its section (every key name is unique across sections).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Optional

from galaxy.errors import UserError


class ConfigError(UserError, ValueError):
    """A problem with the user's configuration; the message names the key and the fix."""


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
    memory_budget_gib: Optional[float] = None  # auto: one device's memory for the run; unset: what is free to it
    host_memory_budget_gib: Optional[float] = None  # auto: pinned host memory one rank may offload to
    host_link_gb_per_s: Optional[float] = None  # auto without a profile: the host link's GB/s (unset: a default)
    mlp_chunks: int = 1  # the MLP over this many sequence chunks (auto may raise it; with recompute a chunk at a time)
    fused_gate_up: bool = False  # LLaMA: gate and up in one [2, intermediate, hidden] weight, one matmul
    # auto (per op, the measured winner on the device: galaxy/kernels/_backend.py) | triton | torch
    kernels: str = "auto"
    compile: bool = False  # torch.compile each transformer layer (rules: galaxy.core.compile)
    # torch.compile's mode for those layers; reduce-overhead replays each layer's kernels as a CUDA graph
    compile_mode: str = "default"
    # inductor options for those layers over the mode's own (torch._inductor.list_options()), e.g.
    # {"triton.multi_kernel": 1}: a reduction compiled persistent and looped, the faster picked per size
    compile_options: Optional[dict] = None
    # torch.compile's backend for those layers: inductor generates their kernels; aot_eager_decomp_partition traces
    # them with inductor's decompositions and partitions them with its min-cut partitioner (which choose what is saved
    # for backward; inductor's joint-graph rewrites aside) and runs the ops eagerly, building no kernel; any backend
    # torch._dynamo.list_backends(exclude_tags=()) names
    compile_backend: str = "inductor"

    @property
    def captures_cuda_graphs(self) -> bool:
        """Whether the compiled layers replay as CUDA graphs (their mode's or ``compile_options``' choice)."""
        options = self.compile_options or {}
        return self.compile and bool(options.get("triton.cudagraphs", self.compile_mode in CUDA_GRAPH_MODES))

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
    # torch's kernels for it: auto (fused where every parameter is on a GPU, else torch's default) | fused | foreach.
    # Fused steps skip a non-finite update on the device, so the loop never waits for the device (Trainer.settle)
    optimizer_implementation: str = "auto"
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
    # With quantize_base fp8, the frozen output head's logits product on the fp8 tensor cores too: its row-wise
    # e4m3 copy kept beside the weight (+1 byte a head weight; the tied embedding and the head's input gradient
    # read the weight itself). QLoRA and torchao keep the head in full precision: a choice of speed over that.
    quantize_head: bool = False




@dataclass
class ConfigSections:
    """A config's six sections: the data that ``GalaxyConfig`` loads and checks."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "distributed": DistributedConfig,
    "peft": PeftConfig,
}


def _key_index() -> dict[str, str]:
    index = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"duplicate config key {f.name}"
            index[f.name] = section
    return index


KEY_SECTION = _key_index()


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


# The values a key allows.
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PIPELINE_ENGINES = ("torch", "galaxy")
DP_ENGINES = ("ddp", "zero1", "deepspeed", "fsdp2")
MP_GRAD_REDUCE = ("after_backward", "overlap", "sharded", "fsdp")
RESHARD_AFTER_FORWARD = ("default", "always", "never")
FSDP_GRAD_SYNCS = ("every_micro_batch", "last_micro_batch")
OPTIMIZERS = ("adamw", "sgd")
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach")
RECOMPUTE_MODES = ("none", "full", "selective", "mlp")
OFFLOAD = "+offload"  # a layer memory mode's suffix: what the layer still saves is held on the host
LAYER_MEMORY_MODES = RECOMPUTE_MODES + tuple(m + OFFLOAD for m in RECOMPUTE_MODES)
TP_OVERLAPS = ("none", "coc", "async_tp")
SP_ATTENTIONS = ("allgather", "ring", "ulysses")
COC_DEFAULT_CHUNKS = 4  # tp_overlap coc without coc_parallel_num
KERNEL_BACKENDS = ("auto", "triton", "torch")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes whose layers replay as CUDA graphs
# ModelConfig keys that choose how a model computes, not what it is: a model loaded from a
# checkpoint directory takes them from the run's config (e.g. ``cfg.model = config_from_hf(...)``
# should carry them over).
ACTIVATION_MEMORY_KEYS = ("activation_memory", "layer_memory", "memory_budget_gib", "host_memory_budget_gib",
                          "host_link_gb_per_s", "mlp_chunks")
COMPUTE_KEYS = ("recompute", "recompute_num_layers", *ACTIVATION_MEMORY_KEYS, "fused_gate_up", "kernels", "compile",
                "compile_mode", "compile_options", "compile_backend")
FUSED_GATE_UP_NAMES = ("gate_proj", "up_proj", "gate_up_proj")


def fused_gate_up_targets(targets) -> list[str]:
    """The LoRA targets that name LLaMA's gate/up projections, which ``fused_gate_up`` merges."""
    if isinstance(targets, str):  # a regex (Python API): does it match a layer's gate/up modules?
        import re

        return [n for n in FUSED_GATE_UP_NAMES if re.fullmatch(targets, f"model.layers.0.mlp.{n}")]
    return [t for t in targets or () if t.rsplit(".", 1)[-1] in FUSED_GATE_UP_NAMES]
