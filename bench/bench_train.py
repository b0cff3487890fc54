"""Whole training steps of every contender, in one launch: Galaxy's plans beside what a user runs instead.

    torchrun --nproc_per_node 2 bench/bench_train.py --scenario stack4 --json stack4.json
    torchrun --nproc_per_node 2 bench/bench_train.py --scenario llama7b --contenders 'galaxy-*,torchtitan*,megatron*'
    python bench/bench_train.py --cpu --world 2 --scenario smoke --json smoke.json     # CPU + Gloo, tiny shapes

A timed step is one optimizer step of a causal LM on random tokens (batch x seq): embedding, every
decoder layer, final norm, head and cross-entropy forward, backward, every gradient reduction the
recipe needs, gradient clipping (1.0) and AdamW. Trainable weights are fp32 masters; the compute is
bf16 (``--dtype``) the way each recipe does it: Galaxy and plain PyTorch under autocast,
torchtitan through FSDP2's mixed-precision policy (bf16 params, fp32 reductions), megatron-core
with bf16 weights and its distributed optimizer's fp32 main params.

Scenarios: ``stack4`` (LLaMA-7B shapes with 4 layers: hidden 4096, ffn 11008, 32 heads, seq 4096),
``llama7b`` (all 32 layers), ``smoke`` (tiny, for CPU and one-GPU checks). Contenders (``--list``):

    serial-eager, serial-compiled       plain PyTorch LLaMA (bench_coc's layers), rank 0 alone
    galaxy-none                         Galaxy's model, plan none, rank 0 alone
    galaxy-<plan>[-<reduce>][+compile]  Galaxy's Trainer on all ranks: plan tp|galaxy|galaxy2|sp,
                                        mp_grad_reduce after_backward (default)|overlap|sharded
    native-tp-sp-eager|-compiled|-asynctp
                                        the plain model under parallelize_module (torchtitan's plan:
                                        Colwise/Rowwise + SequenceParallel, loss parallel); compiled per
                                        block; + inductor micro-pipeline TP over symmetric memory
    torchtitan-compile-asynctp          torchtitan's llama3 model and parallelize_llama, compile + async TP
    megatron-tp, megatron-tp-sp, megatron-tp-sp-overlap
                                        megatron-core GPTModel, local (non-TE) layer spec, TP (+ sequence
                                        parallel, + tp_comm_overlap)

A contender that cannot run here gets one line saying why in its JSON row (``error``), and the launch
goes on. Per contender: median step ms with min / quartiles / max over ``--iters`` steps after
``--warmup`` (CUDA events; the slowest rank counts), peak memory (max over ranks, weights and
optimizer state included), and comm bytes per step: ``comm_bytes`` counts every collective payload
a rank issues in one step (all-reduce: the tensor; all-gather: the gathered result; reduce-scatter:
the input), read from the dispatcher in one eager step; Galaxy rows also carry
``comm_bytes_metrics``, what Galaxy's own metrics report for the same step.
Multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_key] = _value

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.bench_coc import PlainStack, RMSNorm, launch, publish, pytorch_tp_sp, release, run_facts  # noqa: E402
from bench.bench_plans import causal_lm_data  # noqa: E402
from galaxy.config import GalaxyConfig  # noqa: E402
from galaxy.core.context import ParallelContext, build_groups  # noqa: E402
from galaxy.models import build_model  # noqa: E402
from galaxy.train.loop import Trainer, autocast_context  # noqa: E402

SCENARIOS = {
    "stack4": dict(hidden=4096, ffn=11008, heads=32, layers=4, seq=4096, batch=1, vocab=32000),
    "llama7b": dict(hidden=4096, ffn=11008, heads=32, layers=32, seq=4096, batch=1, vocab=32000),
    "smoke": dict(hidden=64, ffn=176, heads=4, layers=2, seq=32, batch=2, vocab=256),
}
PLANS = ("tp", "galaxy", "galaxy2", "sp")
REDUCES = ("after_backward", "overlap", "sharded")
LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0


def contender_names() -> list[str]:
    names = ["serial-eager", "serial-compiled", "galaxy-none"]
    for compiled in ("", "+compile"):
        for plan in PLANS:
            for reduce in (("after_backward",) if plan == "tp" else REDUCES):  # tp has no PARTIAL gradients
                names.append(f"galaxy-{plan}" + ("" if reduce == "after_backward" else f"-{reduce}") + compiled)
    names += ["native-tp-sp-eager", "native-tp-sp-compiled", "native-tp-sp-asynctp",
              "torchtitan-compile-asynctp", "megatron-tp", "megatron-tp-sp", "megatron-tp-sp-overlap"]
    return names


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


# ----------------------------------------------------------------------------- contenders


@dataclass
class Prepared:
    """A contender built and ready: ``step()`` runs one whole training step."""
    step: Callable[[], None]
    note: str = ""
    comm_bytes_metrics: Optional[Callable[[Callable[[], None]], int]] = None  # Galaxy: its own count of a step
    teardown: list = field(default_factory=list)


def token_batches(shape: dict, device: torch.device, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A few fixed (input ids, labels) pairs, identical on every rank, rotated through the steps."""
    gen = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=gen).to(device)
                  for _ in range(2)) for _ in range(count)]


def adamw(params: list, device: torch.device) -> torch.optim.Optimizer:
    """Galaxy's optimizer recipe (train.loop.build_optimizer): AdamW, no decay on norm scales, fused on GPU."""
    decay = [p for p in params if p.dim() > 1]
    rest = [p for p in params if p.dim() <= 1]
    groups = [g for g in ({"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0})
              if g["params"]]
    return torch.optim.AdamW(groups, lr=LR, **({"fused": True} if device.type == "cuda" else {}))


def galaxy_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """Galaxy's own Trainer: forward_backward + optimizer_step, exactly what ``train()`` runs per step."""
    body, compiled = name.removeprefix("galaxy-").partition("+")[::2]
    plan, _, reduce = body.partition("-")
    cfg = GalaxyConfig.from_dict({
        "model": {"preset": "llama-7b", "num_hidden_layers": shape["layers"], "hidden_size": shape["hidden"],
                  "intermediate_size": shape["ffn"], "num_attention_heads": shape["heads"],
                  "num_key_value_heads": shape["heads"], "vocab_size": shape["vocab"],
                  "max_position_embeddings": max(4096, shape["seq"]), "compile": compiled == "compile"},
        "parallel": {"plan": plan, "mp_grad_reduce": reduce or "after_backward"},
        "train": {"global_batch_size": shape["batch"], "seq_length": shape["seq"], "dtype": args.dtype,
                  "lr": LR, "weight_decay": WEIGHT_DECAY, "grad_clip": CLIP, "warmup_steps": 0,
                  "lr_schedule": "constant", "max_steps": 10**6}})
    model = build_model(cfg, cfg.resolve_plan(ctx.mp.size), ctx)
    trainer = Trainer(model, cfg, ctx)
    batch_at = causal_lm_data(cfg)
    amp = lambda: autocast_context(cfg, ctx.device)  # noqa: E731
    count = [0]
    model.train()

    def step():
        count[0] += 1
        loss = trainer.forward_backward(trainer.read_batch(batch_at, count[0] % 4), amp)
        trainer.optimizer_step(loss, count[0])

    def metrics_bytes(run: Callable[[], None]) -> int:
        before = trainer.comm_bytes()  # what train() writes to metrics as comm_bytes
        run()
        return trainer.comm_bytes() - before

    return Prepared(step, comm_bytes_metrics=metrics_bytes, teardown=[trainer.grad_sync.remove])


class PlainLM(nn.Module):
    """bench_coc's plain PyTorch LLaMA layers with an embedding, final norm and head: a whole causal LM."""

    def __init__(self, shape: dict):
        super().__init__()
        self.embed = nn.Embedding(shape["vocab"], shape["hidden"])
        self.stack = PlainStack(shape)
        self.norm = RMSNorm(shape["hidden"])
        self.head = nn.Linear(shape["hidden"], shape["vocab"], bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.stack(self.embed(ids))))


def plain_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """Plain PyTorch: serial (rank 0), or under torch's tensor parallel API (torchtitan's plan)."""
    with torch.device(ctx.device):  # built and drawn on the device: a 7B init on the host takes minutes
        model = PlainLM(shape)
    gen = torch.Generator(ctx.device).manual_seed(0)  # the same draws on every rank
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if not pname.endswith("norm.weight"):
                p.normal_(0.0, 0.02, generator=gen)
    loss_context = contextlib.nullcontext
    teardown = []
    if name.startswith("native"):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       loss_parallel, parallelize_module)

        world = ctx.mp.size
        if shape["seq"] % world or shape["heads"] % world or shape["ffn"] % world or shape["vocab"] % world:
            raise Unavailable("needs seq, heads, ffn and vocab divisible by the world size")
        pytorch_tp_sp(model.stack, world, ctx.device)
        parallelize_module(model, model.stack.layers[0].attention.wq.weight.device_mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
        loss_context = loss_parallel
        if name == "native-tp-sp-asynctp":
            import torch._inductor.config as inductor_config
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            enable_symm_mem_for_group(dist.group.WORLD.group_name)
            inductor_config._micro_pipeline_tp = True
            teardown.append(lambda: setattr(inductor_config, "_micro_pipeline_tp", False))
    if name.endswith(("compiled", "asynctp")):
        for i, layer in enumerate(model.stack.layers):  # per block, as torchtitan compiles
            model.stack.layers[i] = torch.compile(layer, dynamic=False)
    params = list(model.parameters())
    optimizer = adamw(params, ctx.device)
    batches = token_batches(shape, ctx.device)
    count = [0]
    dtype = getattr(torch, args.dtype)
    amp = (lambda: torch.autocast(ctx.device.type, dtype=dtype)) if dtype in (torch.bfloat16, torch.float16) \
        else contextlib.nullcontext

    def step():
        ids, labels = batches[count[0] % len(batches)]
        count[0] += 1
        with loss_context():
            with amp():
                logits = model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Prepared(step, teardown=teardown)


def torchtitan_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """torchtitan's llama3 model, built and parallelized as its Trainer does (meta init, parallelize_llama
    with compile + async TP, FSDP2 mixed precision at degree 1, init_weights), stepped with its loss,
    mask and clipping and the AdamW every contender uses."""
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
    training = TrainingConfig(seq_len=shape["seq"], local_batch_size=shape["batch"],
                              mixed_precision_param=args.dtype, mixed_precision_reduce="float32")
    model = llama3.parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                     compile_config=compile_cfg, ac_config=None, dump_folder="/tmp/torchtitan")
    model.to_empty(device=ctx.device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=shape["vocab"]), compile_config=compile_cfg)
    params = list(model.parameters())
    optimizer = adamw(params, ctx.device)
    train_context = titan_dist.get_spmd_context(parallel_dims=parallel_dims)
    batches = token_batches(shape, ctx.device)
    tokens = torch.tensor(shape["batch"] * shape["seq"], device=ctx.device)
    positions = torch.arange(shape["seq"], device=ctx.device)[None].expand(shape["batch"], -1)
    count = [0]
    import torch._inductor.config as inductor_config

    def step():
        ids, labels = batches[count[0] % len(batches)]
        count[0] += 1
        with train_context():
            # as its Trainer's post_dataloading_process: per-document positions give the (block-)causal mask
            masks = model.get_attention_masks(positions=positions)
            loss, _ = loss_fn(model(ids, positions=positions, attention_masks=masks), labels, tokens)
            loss.backward()
        titan_dist.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Prepared(step, note=f"torchtitan {getattr(torchtitan, '__version__', '?')}",
                    teardown=[lambda: setattr(inductor_config, "_micro_pipeline_tp", False)])


def megatron_contender(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    """megatron-core's GPTModel with the local (non-Transformer-Engine) layer spec, its DDP wrapper and
    distributed optimizer (bf16 weights, fp32 main params and grads), finalize_model_grads (the
    sequence-parallel norm all-reduce), as megatron's pretrain_gpt does per step."""
    try:
        import megatron.core
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
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
    world = ctx.mp.size
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    teardown = [parallel_state.destroy_model_parallel]
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        sequence_parallel = "-sp" in name
        config = TransformerConfig(
            num_layers=shape["layers"], hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
            num_attention_heads=shape["heads"], normalization="RMSNorm", gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            bf16=args.dtype == "bfloat16", params_dtype=getattr(torch, args.dtype), pipeline_dtype=None,
            tensor_model_parallel_size=world, sequence_parallel=sequence_parallel,
            tp_comm_overlap=name.endswith("overlap"))
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=shape["vocab"], max_sequence_length=shape["seq"], position_embedding_type="rope",
                         share_embeddings_and_output_weights=False).to(ctx.device)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=LR, weight_decay=WEIGHT_DECAY, bf16=args.dtype == "bfloat16",
            params_dtype=getattr(torch, args.dtype), use_distributed_optimizer=True, clip_grad=CLIP), [ddp])
    except BaseException:
        parallel_state.destroy_model_parallel()
        raise
    batches = token_batches(shape, ctx.device)
    positions = torch.arange(shape["seq"], device=ctx.device)[None].expand(shape["batch"], -1)
    count = [0]

    def step():
        ids, labels = batches[count[0] % len(batches)]
        count[0] += 1
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(ids, positions, None, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        optimizer.step()

    return Prepared(step, note=f"megatron-core {getattr(megatron.core, '__version__', '?')}", teardown=teardown)


def build(name: str, args, shape: dict, ctx: ParallelContext) -> Prepared:
    if name.startswith("galaxy-"):
        return galaxy_contender(name, args, shape, ctx)
    if name.startswith(("serial", "native")):
        return plain_contender(name, args, shape, ctx)
    if name.startswith("torchtitan"):
        return torchtitan_contender(name, args, shape, ctx)
    return megatron_contender(name, args, shape, ctx)


# ----------------------------------------------------------------------------- timing


def timed_steps(step: Callable[[], None], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` steps after ``warmup``: CUDA events on GPU, wall clock on CPU."""
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


def spread(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    return {"median_ms": statistics.median(times), "min_ms": min(times), "q1_ms": q[0], "q3_ms": q[2],
            "max_ms": max(times), "iters": len(times)}


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}" if not isinstance(e, Unavailable) else str(e)
    return " ".join(text.split())[:400]


def first_error(error: Optional[str], ctx: ParallelContext, alone: bool) -> Optional[str]:
    """This rank's error, else another rank's (ranks must not diverge into different collectives)."""
    if alone or ctx.world_size == 1:
        return error
    errors = [None] * ctx.world_size
    dist.all_gather_object(errors, error)
    return error or next((f"rank {i}: {e}" for i, e in enumerate(errors) if e), None)


def run_contender(name: str, args, shape: dict, ctx: ParallelContext) -> dict:
    """Build, warm up, time, count bytes and peak memory; any failure becomes the row's ``error``."""
    alone = name.startswith(("serial", "galaxy-none"))
    ranks = 1 if alone else ctx.world_size
    row = {"name": name, "ranks": ranks}
    if alone and ctx.rank != 0:
        return row
    release(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    prepared, error, t0 = None, None, time.time()
    run_ctx = ParallelContext.serial(ctx.device, seed=1234) if alone else ctx
    try:
        prepared = build(name, args, shape, run_ctx)
        row["build_s"] = round(time.time() - t0, 1)
        times = timed_steps(prepared.step, ctx.device, args.warmup, args.iters)
        peak = torch.cuda.max_memory_allocated(ctx.device) / 2**20 if ctx.device.type == "cuda" else None
        row.update(spread(times), peak_mib=peak)
        row["comm_bytes"] = eager_comm_bytes(prepared.step)
        if prepared.comm_bytes_metrics is not None:
            row["comm_bytes_metrics"] = prepared.comm_bytes_metrics(prepared.step)
        if prepared.note:
            row["note"] = prepared.note
    except Exception as e:  # noqa: BLE001 -- a failing contender is data, not the end of the launch
        error = one_line(e)
    finally:
        for undo in (prepared.teardown if prepared else []):
            undo()
        torch._dynamo.reset()
        del prepared
        release(ctx.device)
    error = first_error(error, ctx, alone)
    if error:  # how far it got: build_s is there when the build succeeded
        return {"name": name, "ranks": ranks, "error": error, **{k: row[k] for k in ("build_s",) if k in row}}
    if not alone and ctx.world_size > 1:
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, row)
        row["per_rank_median_ms"] = [g["median_ms"] for g in gathered]
        row["comm_bytes_per_rank"] = [g["comm_bytes"] for g in gathered]
        for key in ("median_ms", "min_ms", "q1_ms", "q3_ms", "max_ms", "peak_mib"):  # the slowest rank counts
            row[key] = max(g[key] for g in gathered) if row[key] is not None else None
    return row


# ----------------------------------------------------------------------------- launch and report


def select(patterns: str, skip: str) -> list[str]:
    names = contender_names()
    chosen = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns.split(","))]
    return [n for n in chosen if not any(fnmatch.fnmatch(n, p) for p in skip.split(",") if p)]


def worker(rank: int, world: int, local_rank: int, args, init_method: str) -> None:
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=30), **({"device_id": device} if use_cuda else {}))
    ctx = ParallelContext(rank=rank, world_size=world, device=device, seed=1234, backend=backend,
                          **build_groups(rank, world, 1, 1))
    shape = dict(SCENARIOS[args.scenario])
    rows = []
    for name in args.contenders:
        torch.manual_seed(0)
        row = run_contender(name, args, shape, ctx)
        dist.barrier()
        if rank == 0:
            rows.append(row)
            print("ROW " + json.dumps(row), flush=True)  # each row as it lands: a killed launch keeps them
    if rank == 0:
        report = {"benchmark": "train", **run_facts(ctx), "world": world, "scenario": args.scenario, "shape": shape,
                  "dtype": args.dtype, "warmup": args.warmup, "env": {k: os.environ.get(k) for k in (
                      "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")},
                  "rows": rows}
        publish(report, print_table, args.json)
    dist.barrier()
    dist.destroy_process_group()


def print_table(report: dict) -> None:
    s = report["shape"]
    print(f"\n{report['scenario']}: {s['layers']} layers, hidden {s['hidden']}, ffn {s['ffn']}, seq {s['seq']}, "
          f"batch {s['batch']}, vocab {s['vocab']}, {report['dtype']}; whole training steps; "
          f"{report['world']} x {report['device']}, torch {report['torch']}, {report['date']}, {report['commit']}")
    head = f"{'contender':<34}{'ranks':>6}{'median ms':>11}{'q1-q3 ms':>16}{'peak MiB':>10}{'comm MiB':>10}"
    print(head + "\n" + "-" * len(head))
    for r in report["rows"]:
        if "median_ms" not in r:
            print(f"{r['name']:<34}{r['ranks']:>6}  not run: {r['error']}")
            continue
        peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
        print(f"{r['name']:<34}{r['ranks']:>6}{r['median_ms']:>11.2f}{r['q1_ms']:>8.2f}-{r['q3_ms']:<7.2f}"
              f"{peak:>10}{r['comm_bytes'] / 2**20:>10.1f}")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="stack4")
    p.add_argument("--contenders", default="*", help="comma-separated names or globs (see --list)")
    p.add_argument("--skip", default="", help="comma-separated names or globs to leave out")
    p.add_argument("--list", action="store_true", help="print the contender names and exit")
    p.add_argument("--world", type=int, default=None, help="self-spawn this many ranks (ignored under torchrun)")
    p.add_argument("--cpu", action="store_true", help="CPU + Gloo even where GPUs are present")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(contender_names()))
        return
    args.contenders = select(args.contenders, args.skip)
    if not args.contenders:
        p.error(f"--contenders {args.contenders!r} matches none of: {', '.join(contender_names())}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    launch(worker, args, p, on_cpu=args.cpu)


if __name__ == "__main__":
    main()
