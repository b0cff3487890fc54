"""Whole training steps of every contender, in one launch, on the same work: Galaxy's plans beside what a
user runs instead.

    torchrun --nproc_per_node 4 bench/bench_train.py --scenario llama7b --global_batch 16 --json llama7b_4.json
    torchrun --nproc_per_node 2 bench/bench_train.py --scenario stack4 --contenders '*' --json stack4.json
    python bench/bench_train.py --cpu --world 2 --scenario smoke --json smoke.json     # CPU + Gloo, tiny shapes

The same work for every contender: one timed step is one optimizer step over the global batch,
``--global_batch`` sequences of the scenario's length (the same tokens per optimizer step for all), and
each recipe reaches it its own way: D data-parallel ranks (a replica, or a dp shard) each run
``global_batch / D`` sequences as micro-batches of ``--micro_batch`` (or of R, for a contender named with
``:mb<R>``: every recipe at its own best setting in one launch) with gradient accumulation. A pure-TP
recipe on all ranks has D = 1 (it accumulates global_batch / micro_batch micro-batches); FSDP2 on W ranks
has D = W; the 2D recipes D = W / TP. Each row states ``dp``, ``micro_batch`` and ``accumulation``
(dp x micro_batch x accumulation = global batch), and a global batch a recipe cannot reach exactly is
refused (one line in the row's ``error``). The step's tokens are also counted where they enter the
model (a forward pre-hook on the module that takes the token ids, every rank, every micro-batch, in one
extra eager step; distinct sequences over all ranks): ``sequences_per_step`` and ``tokens_per_step``
are what the recipe consumed, and a row whose count is not the global batch's is an error.

A timed step is the whole optimizer step of a causal LM on random tokens: embedding, every decoder
layer, final norm, head and cross-entropy forward and backward for every micro-batch, every gradient
reduction the recipe needs, gradient clipping (1.0) and AdamW; nothing the recipe pays per step is left
outside the timer. Trainable weights are fp32 masters; the compute is bf16 (``--dtype``) the way each
recipe does it: Galaxy and plain PyTorch under autocast, FSDP2 (and torchtitan) through the
mixed-precision policy (bf16 params, fp32 reductions), megatron-core with bf16 weights and its
distributed optimizer's fp32 main params.

Throughput: ``tokens_per_s`` = tokens_per_step / median step time, ``tokens_per_s_per_gpu`` = that over
the row's GPUs (``gpus``), and ``mfu`` = model FLOPs per second per GPU over the GPU's dense peak:

    mfu = (6 N + 12 L H S) x tokens_per_step / step_s / gpus / peak_flops
    mfu_causal = (6 N + 6 L H S) x tokens_per_step / step_s / gpus / peak_flops

N: the matmul weights a token passes through (q, k, v, o and the three MLP projections of every layer,
plus the H x V output head; galaxy.train.metrics.model_flops_per_token on the Galaxy LLaMA
config of the scenario's shapes, which every contender's model has), L layers, H hidden, S sequence
length (``mfu`` counts the whole S x S score matrix, as torchtitan; ``mfu_causal`` the half a causal kernel
computes); peak: galaxy.train.metrics.peak_flops_per_device (galaxy.profiler.devices.PEAK_TFLOPS, dense
bf16 tensor-core peak of the GPU; H100 SXM / H200: 989.4 TFLOP/s) or ``--peak_tflops``. A CPU has no
peak: ``mfu`` is null and ``mfu_reason`` says why. The JSON header's ``facts`` states both. The timed
steps are a training run's steady state (galaxy.train.metrics.SteadyState): ``--warmup`` defaults to
its WARMUP_STEPS, so the CLI's summary and this bench state the same figure for the same configuration.

Scenarios (``--global_batch`` overrides the default): ``stack4`` (LLaMA-7B shapes with 4 layers: hidden
4096, ffn 11008, 32 heads, seq 4096, vocab 32000; global batch 4), ``llama7b`` (all 32 layers; global batch
16), ``smoke`` (tiny, for CPU and one-GPU checks; global batch 4); long sequences, LLaMA-3-8B shapes (32
heads, 8 kv heads, ffn 14336, vocab 128256), 131,072 tokens a step, every contender recomputing whole
layers (torchtitan's full activation checkpointing; Galaxy's ``recompute: full``): ``llama8b-32k`` (4
sequences of 32k), ``llama8b-128k`` (1 of 128k), ``smoke-long`` (the same recipe at tiny shapes). Every
plain model (serial, native TP, FSDP2) starts from one serial init: each rank holds its slice of it.
Contenders (``--list``; the default ``--contenders`` is the 4-GPU 7B comparison, DEFAULT_CONTENDERS):

    serial-eager, serial-compiled       plain PyTorch LLaMA (bench_coc's layers), rank 0 alone (dp 1)
    galaxy-none                         Galaxy's model, plan none, rank 0 alone (dp 1)
    galaxy-<plan>[-<reduce>][+compile][@dp<D>[-<engine>[-noreshard][-onesync]]]
                                        Galaxy's Trainer on all ranks: plan tp|galaxy|galaxy2|sp over
                                        mp = world / D, mp_grad_reduce after_backward (default)|overlap|
                                        sharded|fsdp; @dp<D>: D Galaxy dp ranks with dp_engine <engine>
                                        (config's DP_ENGINES: ddp (default)|zero1|deepspeed|fsdp2;
                                        -noreshard: reshard_after_forward never, FSDP's layers stay
                                        gathered from forward to backward; -onesync: fsdp_grad_sync
                                        last_micro_batch, one reduce-scatter per step).
                                        Without @dp, dp 1: micro-batches + accumulation
    native-tp-sp-eager|-compiled|-asynctp
                                        the plain model under parallelize_module (torchtitan's plan:
                                        Colwise/Rowwise + SequenceParallel, loss parallel) on all ranks (dp 1);
                                        compiled per block; + inductor micro-pipeline TP over symmetric memory
    fsdp2-compile[-noreshard][-onesync] the anchor recipe (../shared/anchors/anchor_fsdp2.py, torchtitan's
                                        default for a 7B on one node): the plain model, fully_shard per block
                                        over all ranks (dp = world), MixedPrecisionPolicy bf16 params / fp32
                                        reduce, torch.compile per block, fused AdamW, clip 1.0,
                                        reshard_after_forward True (-noreshard: False, no backward all-gather;
                                        -onesync: set_requires_gradient_sync(False) but in the last
                                        micro-batch: unsharded fp32 gradients accumulate, one
                                        reduce-scatter per step, as DDP's no_sync)
    fsdp2-cp[@cp<C>]                    torchtitan's long-context recipe with torch's APIs: context_parallel
                                        over C ranks (C = 2 unless given; each sequence split along its length,
                                        K/V all-gathered in attention), dp = world / C, fully_shard over all
                                        ranks, compile per block (CUDA only: its row says so elsewhere)
    fsdp2-tp[@tp<T>]                    torchtitan's 2D recipe with torch's APIs: DeviceMesh dp x tp (T = 2
                                        unless given), the native-tp-sp plan on tp, compile per block,
                                        fully_shard over dp, loss parallel
    torchtitan-compile-asynctp          torchtitan's llama3 model and parallelize_llama, compile + async TP (dp 1)
    megatron-tp, megatron-tp-sp, megatron-tp-sp-overlap
                                        megatron-core GPTModel, local (non-TE) layer spec, TP = world (dp 1)
                                        (+ sequence parallel, + tp_comm_overlap)
    megatron-dp[@tp<T>]                 megatron-core GPTModel with data parallel over world / T and its
                                        distributed optimizer, overlap_grad_reduce and overlap_param_gather,
                                        bf16; T: the smallest TP whose weights, gradients, optimizer state and
                                        activations fit the GPU (1 where they do), unless given
    megatron-*                          all: grads reduced in fp32 (what Megatron-LM forces for bf16),
                                        selective recompute of the attention core (Megatron's
                                        --recompute-activations: its local attention is unfused), the
                                        micro-batches through its own forward_backward_func

``--float8 tensorwise|rowwise`` trains the layers' linears in float8 (torchao's float8 training): Galaxy's
contenders through ``float8_training`` (galaxy.core.float8), the ``fsdp2-compile*`` anchors as torchtitan
does (``convert_to_float8_training`` on the blocks before compile and ``fully_shard``; the head stays
bf16); ``--float8_all_gather`` (tensorwise) gathers their weights as fp8 under FSDP (Galaxy's
``float8_fsdp_all_gather``; the anchors with ``enable_fsdp_float8_all_gather`` and torchtitan's
``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step). Each row states its ``float8``;
the other contenders run without it.

A contender that cannot run here gets one line saying why in its JSON row (``error``), and the launch
goes on. ``--sweep_rows 1,2,4`` runs every contender named at each rows-per-micro-batch, each point a launch
of its own (a child process), so a point that runs out of memory on any rank is a row saying so; the
report's ``summary`` states each recipe at its best, the best anchor, Galaxy's best and their ratio.
Per contender: median step ms with min / quartiles / max over ``--iters`` steps after
``--warmup`` (CUDA events; the slowest rank counts), peak memory (max over ranks, weights and
optimizer state included; memory an earlier contender of the launch left allocated is
subtracted and stated as ``leftover_mib``: megatron-core's buffers outlive its contender, so it
runs last), tokens/s (per GPU) and MFU, and comm bytes per step: ``comm_bytes`` counts every
collective payload a rank issues in one step (all-reduce: the tensor; all-gather: the gathered
result; reduce-scatter: the input), read from the dispatcher in one eager step; Galaxy rows also
carry ``comm_bytes_metrics``, what Galaxy's own metrics report for the same step. ``--profile``
adds each row's ``profile`` (bench/step_profile.py, one more step per contender, every rank).
Multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import hashlib
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_key] = _value

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
# every contender's row ends with torch._dynamo.reset() and most compile: imported here, by the launcher, before its
# ranks start (forked ones inherit it) and make their process groups
import torch._dynamo  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench import exit_without_finalizing, line_buffered_output  # noqa: E402
from bench.step_profile import profile_step  # noqa: E402
from bench.bench_coc import (PlainStack, RMSNorm, launch, publish, pytorch_tp_sp, release, rotate_half,  # noqa: E402
                             run_facts)
from galaxy.config import DP_ENGINES, GalaxyConfig  # noqa: E402
from galaxy.core.context import ParallelContext, build_groups  # noqa: E402
from galaxy.models import build_model  # noqa: E402
from galaxy.train.loop import autocast_context, make_trainer  # noqa: E402
from galaxy.train.metrics import (WARMUP_STEPS, PeakFlops, causal_flops_per_token, model_flops_per_token,  # noqa: E402
                                  model_matmul_weights, peak_flops_per_device, throughput)

# global_batch: sequences per optimizer step (every contender); batch: sequences per rank of the anchor
# scripts (../shared/anchors/anchor_fsdp2.py reads it), not used here.
SCENARIOS = {
    "stack4": dict(hidden=4096, ffn=11008, heads=32, layers=4, seq=4096, global_batch=4, vocab=32000, batch=1),
    "llama7b": dict(hidden=4096, ffn=11008, heads=32, layers=32, seq=4096, global_batch=16, vocab=32000, batch=1),
    "smoke": dict(hidden=64, ffn=176, heads=4, layers=2, seq=32, global_batch=4, vocab=256, batch=2),
    # Long sequences (issue 50): LLaMA-3-8B shapes (GQA, 128k vocabulary), 131,072 tokens per optimizer step at
    # 32k and at 128k tokens a sequence, every contender recomputing whole layers (torchtitan's long-context
    # recipe: full activation checkpointing; Galaxy's recompute: full). A local shape table until
    # galaxy/config/presets.py has a llama-8b preset. ``smoke-long``: the same recipe at tiny shapes, for CPU checks.
    "llama8b-32k": dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, layers=32, seq=32768, global_batch=4,
                        vocab=128256, batch=1, recompute="full"),
    "llama8b-128k": dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, layers=32, seq=131072, global_batch=1,
                         vocab=128256, batch=1, recompute="full"),
    "smoke-long": dict(hidden=64, ffn=176, heads=4, kv_heads=2, layers=2, seq=64, global_batch=2, vocab=256,
                       batch=1, recompute="full"),
}
PLANS = ("tp", "galaxy", "galaxy2", "sp")
REDUCES = ("after_backward", "overlap", "sharded", "fsdp")
LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0
# The 4-GPU 7B comparison: Galaxy's fastest plans beside the recipes people run instead. (tp has no
# PARTIAL gradients, so its fastest reduction is the default: galaxy-tp+compile.)
DEFAULT_CONTENDERS = ("galaxy-galaxy-sharded+compile,galaxy-tp+compile,galaxy-galaxy+compile@dp2-fsdp2,"
                      "fsdp2-compile,fsdp2-compile-noreshard,fsdp2-tp,megatron-dp")
MFU_FORMULA = ("mfu = (6*N + 12*L*H*S) * tokens_per_step / step_s / gpus / peak_flops; N = matmul weights a token "
               "passes through (q,k,v,o + 3 MLP projections per layer, + H x V head), L layers, H hidden, S seq "
               "(galaxy.train.metrics.model_flops_per_token); peak_flops: dense peak of one GPU in the "
               "run's dtype (galaxy.train.metrics.peak_flops_per_device, galaxy.profiler.devices.PEAK_TFLOPS); "
               "mfu_causal: the same with 6*L*H*S, the scores a causal kernel computes "
               "(galaxy.train.metrics.causal_flops_per_token)")


# FSDP2 over every rank, resharding after forward and not, reduce-scattering every micro-batch and once a step.
FSDP2_ANCHORS = ("fsdp2-compile", "fsdp2-compile-onesync", "fsdp2-compile-noreshard", "fsdp2-compile-noreshard-onesync")


def contender_names() -> list[str]:
    names = ["serial-eager", "serial-compiled", "galaxy-none"]
    for compiled in ("", "+compile"):
        for plan in PLANS:
            for reduce in (("after_backward",) if plan == "tp" else REDUCES):  # tp has no PARTIAL gradients
                names.append(f"galaxy-{plan}" + ("" if reduce == "after_backward" else f"-{reduce}") + compiled)
    names += ["native-tp-sp-eager", "native-tp-sp-compiled", "native-tp-sp-asynctp", *FSDP2_ANCHORS, "fsdp2-tp",
              "fsdp2-cp",
              "torchtitan-compile-asynctp", "megatron-tp", "megatron-tp-sp", "megatron-tp-sp-overlap", "megatron-dp"]
    return names


# A listed name with a layout suffix: galaxy-...@dp<D>[-<engine>], fsdp2-tp@tp<T>, megatron-dp@tp<T>.
SUFFIXES = {"galaxy-": re.compile(r"@dp(\d+)(?:-(\w+))?(-noreshard)?(-onesync)?$"),
            "fsdp2-tp": re.compile(r"@tp(\d+)$"),
            "fsdp2-cp": re.compile(r"@cp(\d+)$"),
            "megatron-dp": re.compile(r"@tp(\d+)$")}


def split_suffix(name: str) -> tuple[str, Optional[re.Match]]:
    """``name`` without its ``@...`` layout suffix, and the suffix's match (None: no suffix)."""
    base, at, _ = name.partition("@")
    if not at:
        return name, None
    for prefix, pattern in SUFFIXES.items():
        if base.startswith(prefix) and base != "galaxy-none":
            match = pattern.search(name)
            if match and match.start() == len(base):
                return base, match
    raise ValueError(f"contender '{name}': unknown layout suffix (galaxy-...@dp<D>[-<engine>[-noreshard]"
                     "[-onesync]], fsdp2-tp@tp<T>, fsdp2-cp@cp<C>, megatron-dp@tp<T>)")


class Unavailable(Exception):
    """A contender that cannot run in this environment; its message is the row's one-line reason."""


# ----------------------------------------------------------------------------- comm bytes, independently


class CollectiveBytes(TorchDispatchMode):
    """Payload bytes of every collective that reaches the dispatcher (c10d's and the functional
    ops): all-reduce the tensor, all-gather the gathered result, reduce-scatter the input. Sees
    eager code only: a compiled graph's collectives run inside one opaque call."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    @staticmethod
    def _size(t) -> int:
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        if isinstance(t, (list, tuple)):
            return sum(CollectiveBytes._size(x) for x in t)
        return 0

    # functional ops: the payload is the first argument; a gather's is one rank's piece (x group_size)
    GATHERS = {"all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"}
    FUNCTIONAL = GATHERS | {"all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
                            "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single",
                            "broadcast", "broadcast_"}
    # c10d's in-place ops: op name -> the argument holding the payload
    C10D = {"allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "allgather_": 0, "_allgather_base_": 0,
            "allgather_coalesced_": 0, "allgather_into_tensor_coalesced_": 0, "reduce_scatter_": 1,
            "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1, "alltoall_": 1, "alltoall_base_": 1}

    @staticmethod
    def _group_size(args) -> int:
        """The size of the op's group (a functional op names it last; c10d's pass the ProcessGroup)."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        for a in reversed(args):
            try:
                if isinstance(a, str):
                    return _resolve_process_group(a).size()
                if isinstance(a, torch.ScriptObject):
                    return dist.ProcessGroup.unbox(a).size()
            except (RuntimeError, ValueError):  # a ReduceOp, or a name that is not a group
                continue
        return 2  # unknown: count it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, op = func.namespace, func._opname
        # A group of one rank moves nothing (megatron's distributed optimizer still calls its collectives).
        if ns in ("_c10d_functional", "_c10d_functional_autograd") and op in self.FUNCTIONAL:
            if self._group_size(args) > 1:
                self.bytes += self._size(args[0]) * (int(args[1]) if op in self.GATHERS else 1)  # (input, group_size
        elif ns == "c10d" and op in self.C10D and self._group_size(args) > 1:
            self.bytes += self._size(args[self.C10D[op]])
        return func(*args, **(kwargs or {}))


def eager_comm_bytes(step: Callable[[], None]) -> int:
    """One step run eagerly (compiled graphs too, by dynamo's force_eager stance) under CollectiveBytes."""
    stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") \
        else contextlib.nullcontext()
    with stance, CollectiveBytes() as counter:
        step()
    return counter.bytes


# ----------------------------------------------------------------------------- the global batch


@dataclass(frozen=True)
class Batching:
    """How a recipe reaches the global batch: ``dp`` ranks with their own sequences, each running
    ``micro_batch`` sequences at a time, ``accumulation`` times per optimizer step."""
    global_batch: int
    dp: int
    micro_batch: int
    accumulation: int

    @classmethod
    def reach(cls, global_batch: int, dp: int, micro_batch: int) -> "Batching":
        """The layout for ``dp`` data-parallel ranks, or Unavailable when it cannot be reached exactly."""
        if global_batch % dp:
            raise Unavailable(f"global batch {global_batch} cannot be split evenly over {dp} data-parallel ranks")
        per_rank = global_batch // dp
        if per_rank % micro_batch:
            raise Unavailable(f"global batch {global_batch} over {dp} data-parallel rank(s) is {per_rank} sequences "
                              f"per rank, not a multiple of --micro_batch {micro_batch}")
        return cls(global_batch, dp, micro_batch, per_rank // micro_batch)

    def as_row(self) -> dict:
        return {"dp": self.dp, "micro_batch": self.micro_batch, "accumulation": self.accumulation}


class GlobalBatches:
    """A few fixed global batches of (input ids, labels), the same on every rank, rotated through the
    steps; ``micro_batches(step, dp_rank)`` are a dp rank's rows of the step's batch, in micro-batches."""

    def __init__(self, shape: dict, batching: Batching, device: torch.device, count: int = 2):
        gen = torch.Generator().manual_seed(7)
        size = (shape["global_batch"], shape["seq"])
        self.cpu = [tuple(torch.randint(0, shape["vocab"], size, generator=gen) for _ in range(2))
                    for _ in range(count)]
        self.batching, self.device = batching, device
        self._staged: dict = {}

    def micro_batches(self, step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        key = (step % len(self.cpu), dp_rank)
        if key not in self._staged:  # staged on the device once: no host work inside the timer
            b = self.batching
            ids, labels = self.cpu[key[0]]
            first = dp_rank * b.micro_batch * b.accumulation
            self._staged[key] = [(ids[lo:lo + b.micro_batch].to(self.device), labels[lo:lo + b.micro_batch]
                                  .to(self.device)) for lo in range(first, first + b.micro_batch * b.accumulation,
                                                                    b.micro_batch)]
        return self._staged[key]

    def galaxy_batch_at(self):
        """Galaxy's batcher: the step's global batch on the host (its Trainer takes this dp rank's rows)."""
        return lambda step: {"input_ids": self.cpu[step % len(self.cpu)][0],
                             "labels": self.cpu[step % len(self.cpu)][1]}


class TokenLedger:
    """Counts the sequences a recipe actually feeds its model: a forward pre-hook on the module that takes
    the token ids records a fingerprint and the length of every row it sees; ``distinct`` merges the
    records of every rank (a TP group's ranks see the same rows, dp ranks different ones)."""

    def __init__(self, module: Optional[nn.Module]):
        self.module, self.rows, self.handle = module, {}, None

    @staticmethod
    def _ids(args, kwargs) -> Optional[torch.Tensor]:
        candidates = [kwargs.get("input_ids")] + list(args) + list(kwargs.values())
        for t in candidates:
            if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2:
                return t.full_tensor() if hasattr(t, "full_tensor") else t
        return None

    def _hook(self, module, args, kwargs):
        ids = self._ids(args, kwargs)
        if ids is not None:
            for row in ids.detach().cpu():
                self.rows[hashlib.blake2b(row.numpy().tobytes(), digest_size=16).hexdigest()] = row.numel()
        return None

    def __enter__(self):
        if self.module is not None:
            self.handle = self.module.register_forward_pre_hook(self._hook, with_kwargs=True, prepend=True)
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()

    def distinct(self, gather: bool) -> tuple[int, int]:
        """(sequences, tokens) fed in the step by all ranks (``gather``) or this rank alone."""
        merged = dict(self.rows)
        if gather:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, self.rows)
            for rows in every:
                merged.update(rows)
        return len(merged), sum(merged.values())


# ----------------------------------------------------------------------------- contenders


@dataclass
class Prepared:
    """A contender built and ready: ``step()`` runs one whole training step over the global batch and returns
    its loss (a detached 0-d tensor, read after the timed steps: no synchronization inside them; None where the
    recipe reports none on this rank)."""
    step: Callable[[], Optional[torch.Tensor]]
    batching: Batching
    entry: Optional[nn.Module] = None  # the module whose forward takes the token ids (TokenLedger's hook)
    note: str = ""
    layout: dict = field(default_factory=dict)  # e.g. tp degree, dp engine: stated in the row
    comm_bytes_metrics: Optional[Callable[[Callable[[], None]], int]] = None  # Galaxy: its own count of a step
    teardown: list = field(default_factory=list)
    # True: peak memory counted from the first step on (the build's own peak stated as ``build_peak_mib``)
    peak_from_step: bool = False
    # numbers of this rank read after the timed steps, stated as their maximum over the row's ranks
    per_rank: Optional[Callable[[], dict]] = None


def adamw(params: list, device: torch.device, lr: float) -> torch.optim.Optimizer:
    """Galaxy's optimizer recipe (train.loop.build_optimizer): AdamW, no decay on norm scales, fused on GPU."""
    decay = [p for p in params if p.dim() > 1]
    rest = [p for p in params if p.dim() <= 1]
    groups = [g for g in ({"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0})
              if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, **({"fused": True} if device.type == "cuda" else {}))


def galaxy_config(shape: dict, args, plan: str = "none", reduce: str = "after_backward", compiled: bool = False,
                  dp: int = 1, engine: str = "ddp", micro_batch: int = 1, reshard: str = "default",
                  grad_sync: str = "every_micro_batch", peft: Optional[dict] = None,
                  model: Optional[dict] = None) -> GalaxyConfig:
    """Galaxy's LLaMA at the scenario's shapes (also the model-FLOPs formula's config for every contender);
    ``shape`` may name ``kv_heads`` (GQA; default: ``heads``). ``peft``: the config's peft section (a tuning
    method; default full training); ``model``: more model keys."""
    return GalaxyConfig.from_dict({
        "model": {"preset": "llama-7b", "num_hidden_layers": shape["layers"], "hidden_size": shape["hidden"],
                  "intermediate_size": shape["ffn"], "num_attention_heads": shape["heads"],
                  "num_key_value_heads": shape.get("kv_heads", shape["heads"]), "vocab_size": shape["vocab"],
                  "max_position_embeddings": max(4096, shape["seq"]), "compile": compiled,
                  "recompute": shape.get("recompute", "none"),
                  "compile_mode": compile_mode(args) if compiled else "default", **(model or {})},
        "parallel": {"plan": plan, "mp_grad_reduce": reduce, "dp_size": dp, "dp_engine": engine,
                     "reshard_after_forward": reshard, "fsdp_grad_sync": grad_sync},
        "train": {"global_batch_size": shape["global_batch"], "micro_batch_size": micro_batch,
                  "seq_length": shape["seq"], "dtype": args.dtype,
                  "lr": getattr(args, "lr", LR),  # bench_peft_mp's arguments name no lr
                  "weight_decay": WEIGHT_DECAY, "grad_clip": CLIP, "warmup_steps": 0, "lr_schedule": "constant",
                  "max_steps": 10**6, **galaxy_float8(args, engine)},
        **({"peft": peft} if peft else {})})


def torchao_version() -> Optional[str]:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def float8_recipe(args) -> Optional[str]:
    """``--float8``'s recipe, None without it (bench_peft_mp's arguments name none)."""
    recipe = getattr(args, "float8", "none")
    return None if recipe == "none" else recipe


def galaxy_float8(args, engine: str) -> dict:
    """The train keys of ``--float8`` / ``--float8_all_gather`` for a Galaxy contender (the fp8 gather only under
    fsdp2, where it applies)."""
    recipe = float8_recipe(args)
    if recipe is None:
        return {}
    return {"float8_training": recipe,
            "float8_fsdp_all_gather": bool(getattr(args, "float8_all_gather", False)) and engine == "fsdp2"}


def galaxy_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """Galaxy's own Trainer (``make_trainer``): forward_backward + optimizer_step, exactly what ``train()``
    runs per step; the global batch through Galaxy's dp_size / micro_batch_size (its Trainer reads this dp
    rank's rows and accumulates its micro-batches)."""
    base, suffix = split_suffix(name)
    body, compiled = base.removeprefix("galaxy-").partition("+")[::2]
    plan, _, reduce = body.partition("-")
    dp = int(suffix.group(1)) if suffix else 1
    engine = (suffix.group(2) if suffix else None) or "ddp"
    if engine not in DP_ENGINES:
        raise Unavailable(f"dp engine '{engine}' is not one of Galaxy's ({', '.join(DP_ENGINES)})")
    if ctx.world_size % dp:
        raise Unavailable(f"@dp{dp} needs a world that is a multiple of {dp}, not {ctx.world_size}")
    batching = Batching.reach(shape["global_batch"], dp, args.micro_batch)
    run_ctx = ctx if dp == 1 else ParallelContext(rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
                                                  seed=ctx.seed, backend=ctx.backend,
                                                  **build_groups(ctx.rank, ctx.world_size, dp, 1))
    keep_gathered = bool(suffix and suffix.group(3))  # -noreshard: FSDP keeps the layers gathered after forward
    sync_once = bool(suffix and suffix.group(4))  # -onesync: FSDP reduce-scatters in the last micro-batch only
    cfg = galaxy_config(shape, args, plan, reduce or "after_backward", compiled == "compile", dp, engine,
                        batching.micro_batch, reshard="never" if keep_gathered else "default",
                        grad_sync="last_micro_batch" if sync_once else "every_micro_batch")
    model = build_model(cfg, cfg.resolve_plan(run_ctx.mp.size), run_ctx)
    return galaxy_steps(model, cfg, shape, batching, run_ctx, layout={
        "mp": run_ctx.mp.size, "dp_engine": engine, "reshard_after_forward": cfg.parallel.reshard_after_forward,
        "fsdp_grad_sync": cfg.parallel.fsdp_grad_sync, "float8": float8_recipe(args),
        "float8_all_gather": cfg.train.float8_fsdp_all_gather})


def galaxy_steps(model: nn.Module, cfg: GalaxyConfig, shape: dict, batching: Batching, ctx: ParallelContext,
                 layout: dict, **prepared) -> Prepared:
    """``model`` (built for ``cfg`` on ``ctx``) trained by Galaxy's own Trainer: one ``step()`` is what
    ``train()`` runs per step. ``prepared``: more ``Prepared`` fields."""
    trainer = make_trainer(model, cfg, ctx)
    assert trainer.num_microbatches == batching.accumulation, (trainer.num_microbatches, batching)
    batch_at = GlobalBatches(shape, batching, torch.device("cpu")).galaxy_batch_at()
    amp = lambda: autocast_context(cfg, ctx.device)  # noqa: E731
    count = [0]
    model.train()

    def step():
        count[0] += 1
        loss = trainer.forward_backward(trainer.read_batch(batch_at, count[0]), amp)
        trainer.optimizer_step(loss, count[0])
        return loss.detach()

    def metrics_bytes(run: Callable[[], None]) -> int:
        before = trainer.comm_bytes()  # what train() writes to metrics as comm_bytes
        run()
        return trainer.comm_bytes() - before

    grad_sync = getattr(trainer, "grad_sync", None)
    return Prepared(step, batching, entry=model, layout=layout,
                    comm_bytes_metrics=metrics_bytes if hasattr(trainer, "comm_bytes") else None,
                    teardown=[grad_sync.remove] if grad_sync is not None else [], **prepared)


class GroupedQueryAttention(nn.Module):
    """bench_coc's attention with ``kv_heads`` key/value heads (GQA, LLaMA-3's), each repeated over its query
    heads before SDPA, as torchtitan's llama3 model does (torch's context_parallel shards plain SDPA calls)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim, self.groups = hidden // heads, heads // kv_heads
        self.wq, self.wo = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.wk, self.wv = (nn.Linear(hidden, kv_heads * self.head_dim, bias=False) for _ in range(2))

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        # -1 heads: under PyTorch TP the column-parallel projections hold this rank's heads only
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class PlainLM(nn.Module):
    """bench_coc's plain PyTorch LLaMA layers with an embedding, final norm and head: a whole causal LM
    (grouped-query attention where the shape names fewer ``kv_heads`` than heads)."""

    def __init__(self, shape: dict):
        super().__init__()
        self.embed = nn.Embedding(shape["vocab"], shape["hidden"])
        self.stack = PlainStack(shape)
        if shape.get("kv_heads", shape["heads"]) != shape["heads"]:
            for layer in self.stack.layers:
                layer.attention = GroupedQueryAttention(shape["hidden"], shape["heads"], shape["kv_heads"])
        self.norm = RMSNorm(shape["hidden"])
        self.head = nn.Linear(shape["hidden"], shape["vocab"], bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.stack(self.embed(ids))))


def prepare_blocks(model: PlainLM, shape: dict, args, compiled: bool) -> None:
    """Each block as torchtitan prepares it: wrapped for full activation checkpointing where the scenario
    recomputes (``recompute: full``, its long-context recipe), then compiled (``compiled``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(model.stack.layers):
        if shape.get("recompute") == "full":
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
        model.stack.layers[i] = compile_block(layer, args) if compiled else layer


def init_plain_weights(model: PlainLM, shape: dict, device: torch.device) -> None:
    """One serial init on every rank: N(0, 0.02) weights drawn whole, parameter by parameter in the model's
    order from one seeded generator on ``device``, unit norm scales, the rotary tables (a meta-built model's
    buffers are empty). A sharded parameter (FSDP's, TP's DTensor) keeps its own slice of the whole draw, so
    the sharded model is the serial one whatever the layout (drawing into each local shard instead gave every
    dp rank the same block of values: a model that depended on dp)."""
    gen = torch.Generator(device).manual_seed(0)
    tables = PlainStack(dict(shape, layers=0))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                (p.to_local() if hasattr(p, "to_local") else p).fill_(1.0)
                continue
            whole = torch.empty(p.shape, dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=gen)
            if hasattr(p, "to_local"):  # a DTensor: this rank's slice of the whole, by its placements (no comm)
                from torch.distributed.tensor import DTensor, Replicate

                whole = DTensor.from_local(whole, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                           run_check=False).redistribute(p.device_mesh, p.placements).to_local()
                p = p.to_local()
            p.copy_(whole)
        model.stack.cos.copy_(tables.cos)
        model.stack.sin.copy_(tables.sin)


def plain_tp_plan(model: PlainLM, mesh) -> None:
    """torchtitan's TP + SP plan (bench_coc.pytorch_tp_sp's per block) with the embedding, final norm and
    head: Rowwise embedding to Shard(1), SequenceParallel norm, Colwise head to vocab-sharded logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, \
        parallelize_module

    pytorch_tp_sp(model.stack, mesh.size(), mesh.device_type, mesh=mesh)
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})


def check_tp_shapes(shape: dict, tp: int) -> None:
    if any(shape[k] % tp for k in ("seq", "heads", "ffn", "vocab")) or shape.get("kv_heads", tp) % tp:
        raise Unavailable(f"TP {tp} needs seq, heads, kv heads, ffn and vocab divisible by {tp}")


def compile_mode(args) -> str:
    """The torch.compile mode of every compiled contender (bench_peft_mp's arguments name none)."""
    return getattr(args, "compile_mode", "default")


def compile_block(layer: nn.Module, args) -> nn.Module:
    mode = compile_mode(args)
    return torch.compile(layer, dynamic=False, backend=args.compile_backend, mode=None if mode == "default" else mode)


def accumulate(micro: list, forward_loss: Callable, loss_context=contextlib.nullcontext,
               sync: Optional[Callable[[bool], None]] = None, enter: Optional[Callable] = None) -> torch.Tensor:
    """Forward and backward of every micro-batch, each loss over the accumulation count (the mean);
    ``sync(False)`` before the first and ``sync(True)`` before the last when given (gradient sync once);
    ``enter(stack, ids, labels)``: contexts a micro-batch's forward and backward run in (entered on ``stack``),
    and the ids and labels to run (context_parallel's shards). Returns the mean loss over the micro-batches
    (detached)."""
    total = 0.0
    for i, (ids, labels) in enumerate(micro):
        if sync is not None and i in (0, len(micro) - 1):
            sync(i == len(micro) - 1)
        with contextlib.ExitStack() as stack:
            stack.enter_context(loss_context())
            if enter is not None:
                ids, labels = enter(stack, ids, labels)
            loss = forward_loss(ids, labels) / len(micro)
            loss.backward()
        total = total + loss.detach()
    return total


def plain_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """Plain PyTorch: serial (rank 0), or under torch's tensor parallel API (torchtitan's plan); dp 1."""
    batching = Batching.reach(shape["global_batch"], 1, args.micro_batch)
    with torch.device(ctx.device):  # built and drawn on the device: a 7B init on the host takes minutes
        model = PlainLM(shape)
    init_plain_weights(model, shape, ctx.device)
    loss_context = contextlib.nullcontext
    teardown = []
    if name.startswith("native"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel

        world = ctx.mp.size
        check_tp_shapes(shape, world)
        plain_tp_plan(model, init_device_mesh(ctx.device.type, (world,)))
        loss_context = loss_parallel
        if name == "native-tp-sp-asynctp":
            import torch._inductor.config as inductor_config
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            enable_symm_mem_for_group(dist.group.WORLD.group_name)
            inductor_config._micro_pipeline_tp = True
            teardown.append(lambda: setattr(inductor_config, "_micro_pipeline_tp", False))
    prepare_blocks(model, shape, args, name.endswith(("compiled", "asynctp")))  # per block, as torchtitan compiles
    params = list(model.parameters())
    optimizer = adamw(params, ctx.device, args.lr)
    data = GlobalBatches(shape, batching, ctx.device)
    count = [0]
    dtype = getattr(torch, args.dtype)
    amp = (lambda: torch.autocast(ctx.device.type, dtype=dtype)) if dtype in (torch.bfloat16, torch.float16) \
        else contextlib.nullcontext

    def forward_loss(ids, labels):
        with amp():
            logits = model(ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def step():
        count[0] += 1
        loss = accumulate(data.micro_batches(count[0], 0), forward_loss, loss_context)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return Prepared(step, batching, entry=model, teardown=teardown)


def mean_over(group, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` (a DTensor's whole value: loss_parallel's) averaged over ``group``'s ranks: the loss of the step's
    global batch where each rank holds its rows' (a SUM, then a division: Gloo has no AVG)."""
    loss = (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).clone()
    dist.all_reduce(loss, group=group)
    return loss / dist.get_world_size(group)


def context_parallel_step(cp_mesh, buffers: list, seq_dims: list, entry: nn.Module) -> Callable:
    """``accumulate``'s ``enter`` for torch's context_parallel as torchtitan's ``create_context_parallel_ctx`` and
    train context run it: a micro-batch's ids and labels (copies: the context shards them in place and keeps
    them sharded) and the rotary tables split along the sequence over ``cp_mesh`` (load-balanced for causal
    attention; K/V all-gathered in attention), forward and backward inside, SDPA limited to the kernels its
    ring attention shards. The whole sequences pass ``entry`` first (TokenLedger counts them there). CUDA only
    (it shards CUDA's attention kernels), so imported here, not at the top: this file imports on CPU."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

    def enter(stack: contextlib.ExitStack, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        entry(ids)
        ids, labels = ids.clone(), labels.clone()
        stack.enter_context(sdpa_kernel(kernels))
        stack.enter_context(context_parallel(cp_mesh, buffers=[ids, labels, *buffers],
                                             buffer_seq_dims=[1, 1, *seq_dims], no_restore_buffers={ids, labels}))
        return ids, labels
    return enter


def fsdp2_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """FSDP2 as torchtitan applies it (the anchor's recipe): the plain LM built on meta, (``fsdp2-tp``: the
    TP + SP plan on the mesh's tp dim, loss parallel), full activation checkpointing where the scenario
    recomputes, torch.compile per block, fully_shard per block and at the root with bf16 params and fp32
    gradient reductions, materialized and drawn on the device (each rank its slice of one serial init);
    fused AdamW, clip 1.0. Gradient accumulation as torchtitan's: every micro-batch's backward reduce-scatters
    into the sharded fp32 gradients (``-onesync``: unsharded fp32 gradients accumulate, one reduce-scatter in
    the last micro-batch). ``fsdp2-cp@cp<C>``: torch's context_parallel over C ranks (each sequence split
    along its length, K/V all-gathered in attention) beside dp = world / C, fully_shard over all ranks
    (torchtitan's dp_shard x cp), as its long-context recipe. The reported loss is the global batch's
    (averaged over the data ranks)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import loss_parallel
    except ImportError as e:
        raise Unavailable(f"FSDP2 (torch.distributed.fsdp.fully_shard) does not import on torch "
                          f"{torch.__version__}: {e}") from None
    # torch's clip_grad_norm_ on the 2-D mesh all-reduces the norm over dp, then tp (two scalar collectives)
    # and logs a warning about it at every step: silenced.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    base, suffix = split_suffix(name)
    world = ctx.world_size
    inner = int(suffix.group(1)) if suffix else (2 if base in ("fsdp2-tp", "fsdp2-cp") else 1)
    tp, cp = (inner, 1) if base == "fsdp2-tp" else (1, inner) if base == "fsdp2-cp" else (1, 1)
    if world % inner:
        raise Unavailable(f"{'TP' if tp > 1 else 'CP'} {inner} does not divide the world of {world} ranks")
    if tp > 1:
        check_tp_shapes(shape, tp)
    if cp > 1:
        if ctx.device.type != "cuda":
            raise Unavailable("torch's context_parallel shards CUDA's SDPA kernels (flash, efficient, cuDNN); "
                              "no CPU path: run it on GPUs")
        if shape["seq"] % (2 * cp):
            raise Unavailable(f"CP {cp} needs a sequence length divisible by {2 * cp} (its causal load balancing)")
    batching = Batching.reach(shape["global_batch"], world // inner, args.micro_batch)
    mesh = init_device_mesh(ctx.device.type, (world // inner, inner), mesh_dim_names=("dp", "tp" if tp > 1 else "cp"))
    # FSDP shards over every rank that holds different tokens: dp, or dp x cp (one flat mesh)
    shard_mesh = mesh["dp"] if cp == 1 else init_device_mesh(ctx.device.type, (world,))
    with torch.device("meta"):
        model = PlainLM(shape)
    recipe = float8_recipe(args)
    gather_fp8 = bool(recipe and getattr(args, "float8_all_gather", False))
    if recipe is not None:  # torchtitan's order: float8 linears, then (TP,) compile, FSDP
        if tp > 1:
            raise Unavailable("--float8 with TP needs torchao's float8 TP styles (Float8ColwiseParallel, ...), "
                              "which this anchor does not wire; its pure-FSDP rows (fsdp2-compile*) run float8")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        if gather_fp8:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model.stack, config=config)
    loss_context = contextlib.nullcontext
    if tp > 1:
        plain_tp_plan(model, mesh["tp"])
        loss_context = loss_parallel
    dtype = getattr(torch, args.dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    reshard = "noreshard" not in base
    prepare_blocks(model, shape, args, compiled=True)
    for block in model.stack.layers:
        fully_shard(block, mesh=shard_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=shard_mesh, mp_policy=policy)
    sync = model.set_requires_gradient_sync if base.endswith("onesync") else None
    model.to_empty(device=ctx.device)
    init_plain_weights(model, shape, ctx.device)
    params = list(model.parameters())
    optimizer = adamw(params, ctx.device, args.lr)
    data = GlobalBatches(shape, batching, ctx.device)
    dp_rank = mesh["dp"].get_local_rank()
    shard_group = shard_mesh.get_group()
    entry, enter = model, None
    if cp > 1:  # the sequences enter whole (counted there), context_parallel splits them
        entry = nn.Identity()
        enter = context_parallel_step(mesh["cp"], [model.stack.cos, model.stack.sin], [0, 0], entry)

    def forward_loss(ids, labels):
        return F.cross_entropy(model(ids).flatten(0, 1).float(), labels.flatten())

    count = [0]

    def step():
        count[0] += 1
        loss = accumulate(data.micro_batches(count[0], dp_rank), forward_loss, loss_context, sync, enter)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if gather_fp8:  # torchtitan: every float8 weight's scale in one all-reduce, for the next step's gathers
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        return mean_over(shard_group, loss)

    note = ("unsharded fp32 gradients accumulated, reduce-scattered in the last micro-batch's backward" if sync else
            "gradients reduce-scattered (fp32) at every micro-batch's backward, as torchtitan accumulates")
    if cp > 1:
        note += f"; context_parallel over {cp} ranks (K/V all-gathered), fully_shard over all {world}"
    return Prepared(step, batching, entry=entry, note=note,
                    layout={"tp": tp, "cp": cp, "reshard_after_forward": reshard,
                            "activation_checkpointing": shape.get("recompute") == "full",
                            "float8": recipe, "float8_all_gather": gather_fp8})


def torchtitan_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """torchtitan's llama3 model, built and parallelized as its Trainer does (meta init, parallelize_llama
    with compile + async TP, FSDP2 mixed precision at degree 1, init_weights), stepped with its loss,
    mask and clipping and the AdamW every contender uses; dp 1, the global batch in micro-batches, each
    loss over the step's tokens (its Trainer's gradient accumulation)."""
    try:
        import torchtitan
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as titan_dist
        from torchtitan.models import llama3
        from torchtitan.models.common import Embedding, Linear
    except Exception as e:  # noqa: BLE001 -- any import failure is the reason
        raise Unavailable(f"torchtitan does not import on torch {torch.__version__}: {type(e).__name__}: {e}") from None
    if ctx.device.type != "cuda":
        raise Unavailable("torchtitan's compile + async TP recipe needs CUDA (symmetric memory)")
    world = ctx.mp.size
    batching = Batching.reach(shape["global_batch"], 1, args.micro_batch)
    parallelism = ParallelismConfig(tensor_parallel_degree=world, data_parallel_shard_degree=1)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    head_dim = shape["hidden"] // shape["heads"]
    model_cfg = llama3.Llama3Model.Config(
        dim=shape["hidden"], vocab_size=shape["vocab"],
        tok_embeddings=Embedding.Config(num_embeddings=shape["vocab"], embedding_dim=shape["hidden"],
                                        param_init=llama3._EMBEDDING_INIT),
        norm=llama3.RMSNorm.Config(normalized_shape=shape["hidden"], param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=shape["hidden"], out_features=shape["vocab"],
                              param_init=llama3._output_linear_init(shape["hidden"])),
        # torchtitan's own layer recipe (the one its 8B flavour uses), at these shapes
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=shape["layers"], dim=shape["hidden"], n_heads=shape["heads"],
            n_kv_heads=shape["heads"], hidden_dim=shape["ffn"], attn_backend="flex",  # its default
            rope=llama3.ComplexRoPE.Config(dim=head_dim, max_seq_len=shape["seq"], theta=10000.0, scaling="none")))
    with torch.device("meta"):
        model = model_cfg.build()
    compile_cfg = CompileConfig(enable=True, enable_async_tensor_parallel=world > 1)  # model and loss, its default
    training = TrainingConfig(seq_len=shape["seq"], local_batch_size=batching.micro_batch,
                              mixed_precision_param=args.dtype, mixed_precision_reduce="float32")
    model = llama3.parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                     compile_config=compile_cfg, ac_config=None, dump_folder="/tmp/torchtitan")
    model.to_empty(device=ctx.device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=shape["vocab"]), compile_config=compile_cfg)
    params = list(model.parameters())
    optimizer = adamw(params, ctx.device, args.lr)
    train_context = titan_dist.get_spmd_context(parallel_dims=parallel_dims)
    data = GlobalBatches(shape, batching, ctx.device)
    tokens = torch.tensor(shape["global_batch"] * shape["seq"], device=ctx.device)  # the step's, for the loss
    positions = torch.arange(shape["seq"], device=ctx.device)[None].expand(batching.micro_batch, -1)
    count = [0]
    import torch._inductor.config as inductor_config

    def step():
        count[0] += 1
        total = 0.0
        for ids, labels in data.micro_batches(count[0], 0):
            with train_context():
                # as its Trainer's post_dataloading_process: per-document positions give the (block-)causal mask
                masks = model.get_attention_masks(positions=positions)
                loss, _ = loss_fn(model(ids, positions=positions, attention_masks=masks), labels, tokens)
                loss.backward()
            total = total + loss.detach()  # each micro-batch's loss is over the step's tokens: their sum
        titan_dist.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return Prepared(step, batching, entry=model, note=f"torchtitan {getattr(torchtitan, '__version__', '?')}",
                    teardown=[lambda: setattr(inductor_config, "_micro_pipeline_tp", False)])


def megatron_tp_for(shape: dict, args, world: int, device: torch.device) -> tuple[int, str]:
    """megatron-dp's TP: the smallest that divides the world and whose per-rank memory fits 90% of the GPU
    (pure data parallel where the model fits): bf16 weights and fp32 gradient buffer over TP, fp32 main
    params and Adam moments over TP x DP (distributed optimizer), activations with the attention core
    recomputed, no SP: L x S x b x H x (10 + 24 / TP) bytes (Korthikanti et al. 2022) + fp32 logits."""
    params = (model_matmul_weights(galaxy_config(shape, args)).total + shape["vocab"] * shape["hidden"]
              + (2 * shape["layers"] + 1) * shape["hidden"])
    memory = torch.cuda.get_device_properties(device).total_memory
    fits, tp = [], 1
    for tp in (t for t in range(1, world + 1) if world % t == 0):
        mb, s, h = args.micro_batch, shape["seq"], shape["hidden"]
        est = (params / tp * (2 + 4) + params / world * 12 + shape["layers"] * s * mb * h * (10 + 24 / tp)
               + s * mb * shape["vocab"] / tp * 8)
        fits.append(f"TP {tp}: {est / 2**30:.0f} GiB")
        if est <= 0.9 * memory:
            break
    return tp, f"TP {tp}, the smallest whose estimate fits 90% of {memory / 2**30:.0f} GiB ({'; '.join(fits)})"


def megatron_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """megatron-core's GPTModel with the local (non-Transformer-Engine) layer spec, its DDP wrapper and
    distributed optimizer (bf16 weights, fp32 main params and grads), stepped as Megatron-LM's train_step:
    zero the grad buffers, its forward_backward_func over the rank's micro-batches (no grad sync but on
    the last; finalize_model_grads: the dp reduce-scatter and the sequence-parallel norm all-reduce),
    optimizer.step (clip 1.0, Adam, the param all-gather). ``megatron-tp*``: TP = world, dp 1;
    ``megatron-dp``: dp = world / TP with overlap_grad_reduce and overlap_param_gather (the all-gather of a
    step's new weights overlaps the next step's forward, inside the next timed step)."""
    try:
        import megatron.core
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as e:  # noqa: BLE001 -- any import failure is the reason
        raise Unavailable(f"megatron-core does not import on torch {torch.__version__}: {type(e).__name__}: {e}") \
            from None
    if ctx.device.type != "cuda":
        raise Unavailable("megatron-core trains on CUDA only")
    if name.endswith("overlap"):
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise Unavailable("--tp-comm-overlap needs Transformer Engine (its userbuffers, set up by Megatron-LM's "
                              "initialize_tp_communicators); megatron-core's local linears never read tp_comm_overlap, "
                              "and transformer_engine does not import here") from None
    base, suffix = split_suffix(name)
    world = ctx.world_size
    data_parallel = base == "megatron-dp"
    if data_parallel:
        tp, why = (int(suffix.group(1)), f"TP {suffix.group(1)}, given") if suffix else \
            megatron_tp_for(shape, args, world, ctx.device)
    else:
        tp, why = world, f"TP {world}"
    if world % tp:
        raise Unavailable(f"TP {tp} does not divide the world of {world} ranks")
    check_tp_shapes(shape, tp)
    batching = Batching.reach(shape["global_batch"], world // tp, args.micro_batch)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    teardown = [parallel_state.destroy_model_parallel]
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        sequence_parallel = "-sp" in name
        config = TransformerConfig(
            num_layers=shape["layers"], hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
            num_attention_heads=shape["heads"], normalization="RMSNorm", gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            bf16=args.dtype == "bfloat16", params_dtype=getattr(torch, args.dtype), pipeline_dtype=None,
            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
            tp_comm_overlap=name.endswith("overlap"), recompute_granularity="selective")
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=shape["vocab"], max_sequence_length=shape["seq"], position_embedding_type="rope",
                         share_embeddings_and_output_weights=False).to(ctx.device)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=data_parallel, overlap_param_gather=data_parallel,
            use_distributed_optimizer=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=args.lr, weight_decay=WEIGHT_DECAY, bf16=args.dtype == "bfloat16",
            params_dtype=getattr(torch, args.dtype), use_distributed_optimizer=True,
            overlap_param_gather=data_parallel, clip_grad=CLIP), [ddp])
        # as Megatron-LM's training.setup_model_and_optimizer / train wire the schedule
        if data_parallel:
            config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
    except BaseException:
        parallel_state.destroy_model_parallel()
        raise
    forward_backward = get_forward_backward_func()
    data = GlobalBatches(shape, batching, ctx.device)
    dp_rank = parallel_state.get_data_parallel_rank()
    positions = torch.arange(shape["seq"], device=ctx.device)[None].expand(batching.micro_batch, -1)
    count = [0]

    def forward_step(data_iterator, chunk):
        ids, labels = next(data_iterator)
        per_token = chunk(ids, positions, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            # a copy: the schedule divides the returned loss by the micro-batch count in place, which a
            # detached view would share (the rows reported 1/accumulation of the loss)
            return loss, {"lm loss": loss.detach().clone()}
        return per_token, loss_func

    def step():
        count[0] += 1
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reported = forward_backward(forward_step_func=forward_step,
                                    data_iterator=iter(data.micro_batches(count[0], dp_rank)), model=[ddp],
                                    num_microbatches=batching.accumulation, seq_length=shape["seq"],
                                    micro_batch_size=batching.micro_batch, forward_only=False)
        optimizer.step()
        # the last pipeline stage's micro-batch losses (this rank holds every stage: pp 1)
        return torch.stack([r["lm loss"] for r in reported]).mean() if reported else None

    return Prepared(step, batching, entry=ddp.module, layout={"tp": tp},
                    note=f"megatron-core {getattr(megatron.core, '__version__', '?')}; {why}; selective recompute "
                         "(attention core)", teardown=teardown)


def build(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    if name.startswith("galaxy-"):
        return galaxy_contender(name, args, shape, ctx)
    if name.startswith(("serial", "native")):
        return plain_contender(name, args, shape, ctx)
    if name.startswith("fsdp2"):
        return fsdp2_contender(name, args, shape, ctx)
    if name.startswith("torchtitan"):
        return torchtitan_contender(name, args, shape, ctx)
    return megatron_contender(name, args, shape, ctx)


# ----------------------------------------------------------------------------- timing


def timed_steps(step: Callable[[], Optional[torch.Tensor]], device: torch.device, warmup: int,
                iters: int) -> tuple[list[float], list[Optional[float]]]:
    """Milliseconds of each of ``iters`` steps after ``warmup`` (CUDA events on GPU, wall clock on CPU), and
    the loss of every step, warm-up included, read after the last (a contender that computes wrong gradients
    shows it as a loss that does not fall with the others')."""
    losses = [step() for _ in range(warmup)]
    if device.type != "cuda":
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            losses.append(step())
            out.append((time.perf_counter() - t0) * 1e3)
        return out, [loss_value(x) for x in losses]
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        losses.append(step())
        end.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events], [loss_value(x) for x in losses]


def loss_value(loss: Optional[torch.Tensor]) -> Optional[float]:
    """A step's loss as a number (a DTensor's whole value: loss_parallel's)."""
    if loss is None:
        return None
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return round(float(loss), 5)


def spread(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    return {"median_ms": statistics.median(times), "min_ms": min(times), "q1_ms": q[0], "q3_ms": q[2],
            "max_ms": max(times), "iters": len(times)}


def reserved_by_stream(device: torch.device) -> dict:
    """The caching allocator's segments after the timed steps, per CUDA stream (0: the default, compute
    stream; FSDP's gathers and reduce-scatters allocate on streams of their own, whose freed blocks only
    they reuse): [reserved MiB, allocated MiB, segments]. Where the reserved peak stands far above the
    allocated one, this says which stream's cache holds the difference."""
    out: dict[str, list] = {}
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device.index) != device.index:
            continue
        entry = out.setdefault(str(seg["stream"]), [0.0, 0.0, 0])
        entry[0] += seg["total_size"] / 2**20
        entry[1] += seg["allocated_size"] / 2**20
        entry[2] += 1
    return {stream: [round(r, 1), round(a, 1), n] for stream, (r, a, n) in sorted(out.items())}


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if not isinstance(e, Unavailable) else str(e)
    return " ".join(text.split())[:400]


# How long a rank whose contender failed waits for the other ranks' word. A failure every rank meets (an
# import, a refused layout) reaches every rank at once; one rank's alone (out of memory on the fullest GPU)
# leaves the others inside the step's collectives, where they wait for it until the process group's timeout
# (a 2-GPU launch sat idle 11 minutes that way, 2026-11-27): the launch then ends instead.
ERROR_WAIT = datetime.timedelta(minutes=3)


def first_error(error: Optional[str], ctx: ParallelContext, alone: bool, name: str = "",
                errors_group=None) -> Optional[str]:
    """This rank's error, else another rank's (ranks must not diverge into different collectives), told over
    ``errors_group`` (Gloo, with a timeout). A rank that failed and hears nothing from the others in that
    time prints its row and ends the launch (its launcher ends the other ranks)."""
    if alone or ctx.world_size == 1:
        return error
    errors = [None] * ctx.world_size
    try:
        dist.all_gather_object(errors, error, group=errors_group)
    except RuntimeError:  # a timeout: the others are still inside the collectives of the step that failed
        if not error:
            raise
        print("ROW " + json.dumps({"name": name, "ranks": ctx.world_size, "gpus": ctx.world_size,
                                   "error": f"rank {ctx.rank}: {error}; the other ranks did not report (inside "
                                            f"the failed step's collectives): the launch ends here"}), flush=True)
        logging.getLogger(__name__).error("contender %s failed on rank %d alone: ending the launch", name, ctx.rank)
        os._exit(1)
    return error or next((f"rank {i}: {e}" for i, e in enumerate(errors) if e), None)


def run_contender(name: str, args, shape: dict, ctx: ParallelContext, peak: PeakFlops,
                  flops_per_token: float, builder: Optional[Callable[..., Prepared]] = None,
                  alone: Optional[bool] = None, errors_group=None,
                  causal_flops_per_token: Optional[float] = None) -> dict:
    """Build, warm up, time, count tokens, bytes and peak memory; any failure becomes the row's ``error``
    (``first_error``, over ``errors_group``). ``builder(name, args, shape, ctx)``: the contender (default: this
    file's ``build``); ``alone``: it runs on rank 0 by itself (default: the serial and galaxy-none contenders);
    ``causal_flops_per_token``: the row's ``mfu_causal`` too."""
    builder = builder or build
    alone = name.startswith(("serial", "galaxy-none")) if alone is None else alone
    ranks = 1 if alone else ctx.world_size
    row = {"name": name, "ranks": ranks, "gpus": ranks}
    if alone and ctx.rank != 0:
        return row
    cuda = ctx.device.type == "cuda"
    leftover = 0
    if cuda:  # the previous contender's memory back (a full gc costs ~0.5 s: skipped for CPU's tiny shapes)
        release(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        # what an earlier contender left allocated (megatron-core's global buffers, 2026-11-27): not this row's
        leftover = torch.cuda.memory_allocated(ctx.device)
    prepared, ledger, error, t0 = None, None, None, time.time()
    maxed = ("median_ms", "min_ms", "q1_ms", "q3_ms", "max_ms", "peak_mib", "build_peak_mib", "peak_reserved_mib",
             "alloc_retries")  # over ranks
    run_ctx = ParallelContext.serial(ctx.device, seed=1234) if alone else ctx
    try:
        prepared = builder(name, args, shape, run_ctx)
        row["build_s"] = round(time.time() - t0, 1)
        row.update(global_batch=shape["global_batch"], **prepared.batching.as_row(), **prepared.layout)
        if prepared.peak_from_step:
            row["build_peak_mib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if cuda else None
            if cuda:
                release(ctx.device)
                torch.cuda.reset_peak_memory_stats(ctx.device)
        retries = torch.cuda.memory_stats(ctx.device).get("num_alloc_retries", 0) if cuda else 0
        times, losses = timed_steps(prepared.step, ctx.device, args.warmup, args.iters)
        peak_mib = (torch.cuda.max_memory_allocated(ctx.device) - leftover) / 2**20 if cuda else None
        row.update(spread(times), peak_mib=peak_mib, losses=losses,
                   **({"leftover_mib": leftover / 2**20} if leftover else {}))
        if cuda:  # near a memory cap the allocator frees its cache and retries: each retry synchronizes the GPU
            row.update(peak_reserved_mib=torch.cuda.max_memory_reserved(ctx.device) / 2**20,
                       alloc_retries=torch.cuda.memory_stats(ctx.device).get("num_alloc_retries", 0) - retries)
            try:  # a diagnostic (first run on torch 2.11 pending): its failure is its field's, not the row's
                row["reserved_by_stream"] = reserved_by_stream(ctx.device)
            except (KeyError, TypeError, RuntimeError) as e:
                row["reserved_by_stream"] = one_line(e)
        if prepared.per_rank is not None:
            extra = prepared.per_rank()
            row.update(extra)
            maxed += tuple(extra)
        with TokenLedger(prepared.entry) as ledger:  # the sequences the step feeds, counted where they enter
            row["comm_bytes"] = eager_comm_bytes(prepared.step)
        if prepared.comm_bytes_metrics is not None:
            row["comm_bytes_metrics"] = prepared.comm_bytes_metrics(prepared.step)
        if getattr(args, "profile", None):  # one more step under torch.profiler (bench/step_profile.py)
            trace = os.path.join(args.profile, f"{name}.rank{ctx.rank}.json.gz") if ctx.rank == 0 else None
            row["profile"] = profile_step(prepared.step, ctx.device, keep_trace=trace)
        if prepared.note:
            row["note"] = prepared.note
    except Exception as e:  # noqa: BLE001 -- a failing contender is data, not the end of the launch
        error = one_line(e)
    finally:
        for undo in (prepared.teardown if prepared else []):
            undo()
        torch._dynamo.reset()
        del prepared
        if cuda:
            release(ctx.device)
    error = first_error(error, ctx, alone, name, errors_group)
    if error:  # how far it got: build_s is there when the build succeeded
        return {"name": name, "ranks": ranks, "gpus": ranks, "error": error,
                **{k: row[k] for k in ("build_s",) if k in row}}
    gather = not alone and ctx.world_size > 1 and not fake_world(args)  # a fake world's ranks are this one
    sequences, tokens = ledger.distinct(gather=gather)
    if fake_world(args):  # every rank's rows are this rank's: its dp group's share, times the dp ranks
        sequences, tokens = sequences * row["dp"], tokens * row["dp"]
    row.update(sequences_per_step=sequences, tokens_per_step=tokens)
    if gather:
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, row)
        row["per_rank_median_ms"] = [g["median_ms"] for g in gathered]
        row["comm_bytes_per_rank"] = [g["comm_bytes"] for g in gathered]
        if getattr(args, "profile", None):
            row["profile"] = [g["profile"] for g in gathered]
        if row["peak_mib"] is not None:
            row["peak_mib_per_rank"] = [g["peak_mib"] for g in gathered]
        for key in (k for k in maxed if k in row):  # the slowest rank counts, and the fullest
            row[key] = max(g[key] for g in gathered) if row[key] is not None else None
    row.update(throughput(tokens, flops_per_token * tokens, row["median_ms"] / 1e3, ranks, peak,
                          None if causal_flops_per_token is None else causal_flops_per_token * tokens))
    if row["mfu"] is None:
        row["mfu_reason"] = peak.source
    want = (shape["global_batch"], shape["global_batch"] * shape["seq"])
    if (sequences, tokens) != want:
        row["error"] = (f"consumed {sequences} sequences, {tokens} tokens per optimizer step; the global batch is "
                        f"{want[0]} sequences, {want[1]} tokens")
    return row


# ----------------------------------------------------------------------------- launch and report


ROWS_SUFFIX = re.compile(r":mb(\d+)$")


def split_rows_suffix(entry: str) -> tuple[str, Optional[int]]:
    """A contender entry without its ``:mb<R>`` suffix (R rows per micro-batch for this contender alone: each
    recipe at its own best setting in one launch), and R (None: ``--micro_batch``)."""
    match = ROWS_SUFFIX.search(entry)
    if match is None:
        return entry, None
    if int(match.group(1)) < 1:
        raise ValueError(f"contender '{entry}': rows per micro-batch must be at least 1 (:mb1, :mb2, ...)")
    return entry[:match.start()], int(match.group(1))


def select(patterns: str, skip: str) -> list[str]:
    """The contenders ``patterns`` names, in the order given (they run in it: megatron-core's buffers outlive
    its contender, so it goes last): each name or layout variant (``galaxy-...@dp2``, ``fsdp2-tp@tp4``,
    ``megatron-dp@tp1``) where it stands, each glob's matches in the listed contenders' order; less ``skip``.
    A ``:mb<R>`` suffix (``fsdp2-compile:mb2``) stays on each name it selects. Raises ValueError for a variant
    of no listed contender or with an unknown suffix, and for a name or glob that matches none."""
    names = contender_names()
    chosen = []
    for entry in (e for e in patterns.split(",") if e):
        p, rows = split_rows_suffix(entry)
        mark = "" if rows is None else f":mb{rows}"
        if "@" in p and not any(c in p for c in "*?["):
            base, _ = split_suffix(p)
            if base not in names:
                raise ValueError(f"contender '{p}': '{base}' is not a contender")
            matched = [p + mark]
        else:
            matched = [n + mark for n in names if fnmatch.fnmatch(n, p)]
            if not matched:  # a typo or a retired name is said, not dropped from the launch in silence
                raise ValueError(f"contender '{p}' matches none of the contenders (--list names them)")
        chosen += [n for n in matched if n not in chosen]
    return [n for n in chosen if not any(fnmatch.fnmatch(split_rows_suffix(n)[0], p) for p in skip.split(",") if p)]


def rank_context(rank: int, world: int, local_rank: int, args, init_method: Optional[str]) -> ParallelContext:
    """This rank's process group (NCCL on its GPU, or Gloo with ``--cpu`` or no GPU; torch's fake one with
    ``--fake_world``) and context: mp = world."""
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        if getattr(args, "memory_cap_gib", None) is not None:  # a smaller card (bench_peft_mp has no cap)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total), device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if fake_world(args):  # collectives that return at once, their outputs filled from this rank's inputs
        from torch.testing._internal.distributed.fake_pg import FakeStore

        backend = "fake"
        dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    else:
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30), **({"device_id": device} if use_cuda else {}))
    return ParallelContext(rank=rank, world_size=world, device=device, seed=1234, backend=backend,
                           **build_groups(rank, world, 1, 1))


def fake_world(args) -> bool:
    """Whether this process plays rank 0 of ``--fake_world`` ranks alone (bench_peft_mp's arguments name none)."""
    return bool(getattr(args, "fake_world", None))


def run_rows(names: list[str], args, shape: dict, ctx: ParallelContext, peak: PeakFlops, flops_per_token: float,
             builder: Optional[Callable[..., Prepared]] = None, alone: Optional[Callable[[str], bool]] = None,
             error_wait: datetime.timedelta = ERROR_WAIT, causal_flops_per_token: Optional[float] = None) -> list:
    """``run_contender`` for each name in turn (``alone(name)``: it runs on rank 0 by itself); rank 0 prints
    each row as it lands (``ROW {json}``: a killed launch keeps them) and returns them all. Failures are told
    over a Gloo group of their own that waits ``error_wait`` (``first_error``)."""
    alone_in_world = ctx.world_size == 1 or fake_world(args)  # a fake world's failures are this process's
    errors_group = None if alone_in_world else dist.new_group(backend="gloo", timeout=error_wait)
    rows = []
    for entry in names:
        torch.manual_seed(0)
        name, micro_batch = split_rows_suffix(entry)
        run_args = args if micro_batch is None else argparse.Namespace(**{**vars(args), "micro_batch": micro_batch})
        row = run_contender(name, run_args, shape, ctx, peak, flops_per_token, builder,
                            alone(name) if alone is not None else None, errors_group, causal_flops_per_token)
        row["name"] = entry
        dist.barrier()
        if ctx.rank == 0:
            rows.append(row)
            print("ROW " + json.dumps(row), flush=True)
    return rows


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    ctx = rank_context(rank, world, local_rank, args, init_method)
    shape = dict(SCENARIOS[args.scenario])
    if args.global_batch is not None:
        shape["global_batch"] = args.global_batch
    model_cfg = galaxy_config(shape, args)  # the plain LLaMA's shapes: the FLOP count of every contender
    flops_per_token = model_flops_per_token(model_cfg, shape["seq"])
    causal = causal_flops_per_token(model_cfg, shape["seq"])
    peak = peak_flops_per_device(ctx.device, args.dtype, args.peak_tflops)
    rows = run_rows(args.contenders, args, shape, ctx, peak, flops_per_token, causal_flops_per_token=causal)
    if rank == 0:
        facts = {
            "global_batch": shape["global_batch"], "seq": shape["seq"],
            "tokens_per_step": shape["global_batch"] * shape["seq"], "micro_batch": args.micro_batch,
            "same_work": "every contender's optimizer step covers the global batch: dp x micro_batch x "
                         "accumulation = global_batch sequences (rows: dp, micro_batch, accumulation; "
                         "sequences_per_step and tokens_per_step as counted where the token ids enter the model)",
            "timed_step": "forward and backward of every micro-batch, every gradient reduction, clip 1.0, AdamW",
            "model_flops_per_token": flops_per_token, "causal_flops_per_token": causal,
            "matmul_weights": model_matmul_weights(model_cfg).total,
            "mfu_formula": MFU_FORMULA, "peak_tflops": peak.tflops, "peak_source": peak.source,
            "compile_backend": args.compile_backend, "compile_mode": args.compile_mode,
            "memory_cap_gib": args.memory_cap_gib, "fake_world": args.fake_world,
            "float8": args.float8, "float8_all_gather": args.float8_all_gather, "torchao": torchao_version()}
        report = {"benchmark": "train", **run_facts(ctx), "world": world, "scenario": args.scenario, "shape": shape,
                  "dtype": args.dtype, "warmup": args.warmup, "facts": facts, "env": {k: os.environ.get(k) for k in (
                      "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                      "PYTORCH_CUDA_ALLOC_CONF")},
                  "rows": rows, "summary": summarize(rows)}
        publish(report, print_table, args.json)
    dist.barrier()
    dist.destroy_process_group()


def summarize(rows: list) -> dict:
    """Each recipe at its best: every contender's fastest row (its name without ``:mb<R>``; tokens/s per GPU),
    the fastest anchor (every contender not Galaxy's) and Galaxy's fastest, and Galaxy's over the anchor."""
    best: dict[str, dict] = {}
    for r in rows:
        if "error" not in r and r.get("tokens_per_s_per_gpu"):
            base = split_rows_suffix(r["name"])[0]
            if base not in best or r["tokens_per_s_per_gpu"] > best[base]["tokens_per_s_per_gpu"]:
                best[base] = r
    keys = ("name", "median_ms", "tokens_per_s_per_gpu", "mfu", "mfu_causal", "peak_mib", "dp", "micro_batch")
    out: dict = {"best_per_contender": {base: r["name"] for base, r in best.items()}}
    for label, galaxy in (("best_anchor", False), ("best_galaxy", True)):
        chosen = [r for base, r in best.items() if base.startswith("galaxy-") == galaxy]
        if chosen:
            out[label] = {k: v for k, v in max(chosen, key=lambda r: r["tokens_per_s_per_gpu"]).items() if k in keys}
    if "best_anchor" in out and "best_galaxy" in out:
        a, g = out["best_anchor"], out["best_galaxy"]
        out["galaxy_over_anchor"] = g["tokens_per_s_per_gpu"] / a["tokens_per_s_per_gpu"]
        if a.get("peak_mib") and g.get("peak_mib"):
            out["galaxy_peak_over_anchor"] = g["peak_mib"] / a["peak_mib"]
    return out


def loss_span(losses: Optional[list]) -> str:
    known = [x for x in losses or [] if x is not None]
    return f"{known[0]:.4f} -> {known[-1]:.4f}" if known else "-"


def print_table(report: dict) -> None:
    s, f = report["shape"], report["facts"]
    print(f"\n{report['scenario']}: {s['layers']} layers, hidden {s['hidden']}, ffn {s['ffn']}, seq {s['seq']}, "
          f"vocab {s['vocab']}, {report['dtype']}; global batch {s['global_batch']} ({f['tokens_per_step']} tokens "
          f"per optimizer step); whole training steps; {report['world']} x {report['device']}, torch "
          f"{report['torch']}, {report['date']}, {report['commit']}; peak {f['peak_tflops']} TFLOP/s "
          f"({f['peak_source']})")
    if f.get("fake_world"):
        print(f"rank 0 of {f['fake_world']} alone over torch's fake process group: peak MiB is a rank's; the times "
              "leave out every collective")
    head = (f"{'contender':<38}{'gpus':>5}{'dp x mb x acc':>15}{'median ms':>11}{'q1-q3 ms':>18}{'tok/s/GPU':>11}"
            f"{'MFU':>7}{'causal':>7}{'peak MiB':>10}{'comm MiB':>10}  loss first -> last step")
    print(head + "\n" + "-" * len(head))
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['name']:<38}{r['gpus']:>5}  not run: {r['error']}")
            continue
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        mfu, causal = (f"{r[k]:.1%}" if r.get(k) is not None else "-" for k in ("mfu", "mfu_causal"))
        layout = f"{r['dp']} x {r['micro_batch']} x {r['accumulation']}"
        print(f"{r['name']:<38}{r['gpus']:>5}{layout:>15}{r['median_ms']:>11.2f}{r['q1_ms']:>9.2f}-{r['q3_ms']:<8.2f}"
              f"{r['tokens_per_s_per_gpu']:>11.0f}{mfu:>7}{causal:>7}{peak:>10}{r['comm_bytes'] / 2**20:>10.1f}  "
              f"{loss_span(r.get('losses'))}")
    best = report.get("summary", {})
    for label in ("best_anchor", "best_galaxy"):
        if label in best:
            r = best[label]
            mfu = "/".join(f"{r[k]:.1%}" if r.get(k) is not None else "-" for k in ("mfu", "mfu_causal"))
            print(f"{label.replace('_', ' ')}: {r['name']} {r['median_ms']:.1f} ms, {r['tokens_per_s_per_gpu']:.0f} "
                  f"tok/s/GPU, MFU {mfu} (12*L*H*S / causal 6*L*H*S)")
    if "galaxy_over_anchor" in best:
        print(f"Galaxy's best over the best anchor: {best['galaxy_over_anchor']:.3f}x tokens/s per GPU"
              + (f", {best['galaxy_peak_over_anchor']:.3f}x its peak" if "galaxy_peak_over_anchor" in best else ""))
    profiled = [r for r in report["rows"] if r.get("profile")]
    if profiled:  # where the profiled step's GPU time went, on its slowest rank (by window)
        keys = ("window", "idle", "exposed_comm", "gemm", "attention", "fused", "elementwise", "optimizer",
                "collective")
        print(f"\nprofiled step, slowest rank (ms): {'contender':<38}" + "".join(f"{k:>13}" for k in keys))
        for r in profiled:
            every = r["profile"] if isinstance(r["profile"], list) else [r["profile"]]
            ranks = [p for p in every if "error" not in p]
            if ranks:
                worst = max(ranks, key=lambda p: p["window_ms"])
                print(f"{'':<33}{r['name']:<38}" + "".join(f"{worst[k + '_ms']:>13.1f}" for k in keys))


def without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each of ``flags`` and its value (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in flags:
            skip = True
        elif not token.startswith(tuple(f + "=" for f in flags)):
            out.append(token)
    return out


def run_point(command: list[str], timeout_s: float) -> tuple[int, str, str]:
    """One launch in its own process group (its spawned ranks with it): (exit code, stdout, stderr); past
    ``timeout_s`` the whole group is killed and the code is None."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def sweep(args, argv: list[str], rows_per_micro_batch: list[int]) -> None:
    """``--sweep_rows``: every contender at every R rows per micro-batch, each point a launch of its own (a
    child process with this one's arguments and ``--contenders <name>:mb<R>``). A point that fails is a row with
    its one-line reason, whether its launch wrote it (a refused layout, out of memory on every rank), ended
    (out of memory on one rank ends a launch: its ROW line says which and why), or timed out (killed after
    ``--sweep_timeout_s``); every point starts with every GPU empty. Then one report of all the rows, and each
    recipe at its best (``summary``)."""
    child = without_flags(argv, ("--sweep_rows", "--contenders", "--skip", "--json", "--sweep_timeout_s"))
    rows, report = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name in dict.fromkeys(split_rows_suffix(n)[0] for n in args.contenders):
            for r in rows_per_micro_batch:
                entry, out = f"{name}:mb{r}", os.path.join(tmp, f"point{len(rows)}.json")
                code, stdout, stderr = run_point([sys.executable, os.path.abspath(__file__), *child, "--contenders",
                                                  entry, "--json", out], args.sweep_timeout_s)
                said = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]
                if code == 0 and os.path.isfile(out):
                    with open(out) as f:
                        point = json.load(f)
                    report = report or point
                    row = point["rows"][0]
                elif said:
                    row = said[-1]
                else:
                    tail = [ln for ln in stderr.splitlines() if ln.strip()]
                    why = (f"killed after {args.sweep_timeout_s:g} s" if code is None else f"exit {code}")
                    row = {"name": entry, "error": f"{why}: " + (" ".join(tail[-1].split())[:300] if tail else
                                                                 "no output")}
                row["name"] = entry
                rows.append(row)
                print("ROW " + json.dumps(row), flush=True)
    if report is None:  # no point ran to its end: the rows alone
        report = {"benchmark": "train", "scenario": args.scenario, "rows": rows}
        print("\n".join(f"{r['name']}: {r['error']}" for r in rows))
    report.update(rows=rows, summary=summarize(rows))
    report.setdefault("facts", {})["sweep_rows"] = rows_per_micro_batch
    if "shape" in report:
        publish(report, print_table, args.json)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="stack4")
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                   help="comma-separated names, globs or layout variants (see --list), each with an optional "
                        ":mb<R> (R rows per micro-batch for it, e.g. fsdp2-compile:mb2); default: the 4-GPU 7B "
                        "comparison")
    p.add_argument("--skip", default="", help="comma-separated names or globs to leave out")
    p.add_argument("--list", action="store_true", help="print the contender names and exit")
    p.add_argument("--global_batch", type=int, default=None,
                   help="sequences per optimizer step, for every contender (default: the scenario's)")
    p.add_argument("--micro_batch", type=int, default=1, help="sequences per micro-batch on each dp rank")
    p.add_argument("--world", type=int, default=None, help="self-spawn this many ranks (ignored under torchrun)")
    p.add_argument("--cpu", action="store_true", help="CPU + Gloo even where GPUs are present")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--warmup", type=int, default=WARMUP_STEPS,
                   help="untimed steps first (default: galaxy.train.metrics.WARMUP_STEPS, the steps a training run's "
                        "steady-state summary leaves out)")
    p.add_argument("--lr", type=float, default=LR, help="every contender's AdamW learning rate (constant)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--peak_tflops", type=float, default=None, help="dense peak TFLOP/s of one device, for MFU "
                   "(default: galaxy.profiler.devices.PEAK_TFLOPS for the GPU)")
    p.add_argument("--compile_backend", default="inductor",
                   help="torch.compile backend of the per-block compiled contenders (eager: CPU checks of the "
                        "wiring without code generation; timings then are not the recipe's)")
    p.add_argument("--compile_mode", choices=("default", "max-autotune-no-cudagraphs"), default="default",
                   help="torch.compile mode of every compiled contender, Galaxy's layers and the anchors' blocks "
                        "alike (max-autotune-no-cudagraphs: inductor's Triton GEMM templates timed against "
                        "cuBLAS, pointwise epilogues fused)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one more step of every contender (bench/step_profile.py: GPU time by kernel "
                        "category, idle and exposed communication per rank, in the row's 'profile'); rank 0's "
                        "chrome traces go to DIR")
    p.add_argument("--memory_cap_gib", type=float, default=None, metavar="GIB",
                   help="cap each GPU's caching allocator at GIB (torch.cuda.set_per_process_memory_fraction), to "
                        "show a contender fits a smaller card; the CUDA context and NCCL's buffers sit outside it")
    p.add_argument("--fake_world", type=int, default=None, metavar="N",
                   help="one process plays rank 0 of N over torch's fake process group (as torchtitan's "
                        "fake_backend dry run): what a rank of an N-GPU launch allocates, on one GPU; collectives "
                        "take no time and move no bytes, so the rows' times are compute alone (torch 2.11's fake "
                        "reduce-scatter leaves its output unwritten: a Galaxy row may stop on non-finite "
                        "gradients there)")
    p.add_argument("--sweep_rows", default=None, metavar="R,R,...",
                   help="every contender at each of these rows per micro-batch (e.g. 1,2,4), each point a launch of "
                        "its own (a child process): a point that runs out of memory or is refused is a row saying "
                        "so, and the report states each recipe at its best (its 'summary'); not under torchrun")
    p.add_argument("--sweep_timeout_s", type=float, default=1200.0,
                   help="with --sweep_rows: a point's launch is killed (and its row says so) after this long")
    p.add_argument("--float8", choices=("none", "tensorwise", "rowwise"), default="none",
                   help="float8 training (torchao) of the layers' linears in Galaxy's contenders and the fsdp2-compile "
                        "anchors")
    p.add_argument("--float8_all_gather", action="store_true",
                   help="with --float8 tensorwise: FSDP gathers the float8 weights as fp8 (Galaxy @dp...-fsdp2 rows "
                        "and the fsdp2-compile anchors)")
    p.add_argument("--json", default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.memory_cap_gib is not None and (args.memory_cap_gib <= 0 or args.cpu or not torch.cuda.is_available()):
        p.error("--memory_cap_gib caps a GPU's allocator: give a positive GiB, on GPUs (not with --cpu)")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if args.list:
        print("\n".join(contender_names()))
        return
    try:
        args.contenders = select(args.contenders, args.skip)
    except ValueError as e:
        p.error(str(e))
    if not args.contenders:
        p.error(f"--contenders {args.contenders!r} matches none of: {', '.join(contender_names())}")
    if args.float8_all_gather and args.float8 != "tensorwise":
        p.error("--float8_all_gather needs --float8 tensorwise (torchao gathers tensorwise-scaled weights only)")
    if args.iters < 1 or args.warmup < 0 or args.micro_batch < 1 or (args.global_batch or 1) < 1:
        p.error("--iters, --micro_batch and --global_batch must be at least 1, --warmup at least 0")
    if args.sweep_rows is not None:
        try:
            rows = [int(r) for r in args.sweep_rows.split(",") if r]
        except ValueError:
            rows = []
        if not rows or min(rows) < 1:
            p.error(f"--sweep_rows takes rows per micro-batch, each at least 1, e.g. 1,2,4 (got {args.sweep_rows!r})")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            p.error("--sweep_rows launches each point itself: run it without torchrun (--world N, or --fake_world N)")
        sweep(args, argv, rows)
        return
    if args.fake_world is not None:
        if args.fake_world < 2 or args.world is not None:
            p.error("--fake_world N plays rank 0 of N >= 2 ranks in this one process; drop --world")
        worker(0, args.fake_world, 0, args, None)
        return
    launch(worker, args, p, on_cpu=args.cpu)


if __name__ == "__main__":
    line_buffered_output()
    main()
    exit_without_finalizing()
