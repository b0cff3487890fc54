"""``activation_memory: auto`` for one run: the fastest per-layer memory mode mix (``memory.choose_layer_memory``)
that fits ``memory_budget_gib``, and the MLP's sequence chunks (``mlp_chunks``) that let it, from a probe of the
run's own layer.

The probe builds the run's model (its tuning, quantized base, dtype; two layers, eager) on the run's device at two
short sequence lengths and runs its second layer under each recompute mode with its saved tensors offloaded
(``galaxy.core.offload``): what goes to the host is exactly what the layer keeps for backward, weights apart, and
``FlopCounterMode`` counts what its backward runs again. Kept bytes are affine in tokens (fused attention keeps
no [seq, seq] tensor), FLOPs ``a s + b s^2`` (projections and MLP, attention), so two lengths give both at the
run's ``seq_length``. Times are FLOPs at a device rate (``peak_tflops`` or the device table, at
``ACHIEVED_FRACTION`` of it) and host copies at ``host_link_gb_per_s`` (unset: the cluster profile's default;
``plan_galaxy.py profile`` measures a GPU's). The probe is eager: a compiled layer
keeps less (its norms' outputs and MLP activation are rebuilt), so the plan is on the safe side. Every rank
measures the same serial layer and so picks the same plan; under TP or SP a rank keeps its share of what is
counted, so the plan holds there too (more cautiously). The probe's weights are drawn on the device by its
generator: what it measures does not depend on their values.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from galaxy.config import OFFLOAD, OPTIMIZERS, ConfigError, GalaxyConfig, Plan
from galaxy.core.context import ParallelContext
from galaxy.core.offload import OffloadTraffic
from galaxy.core.recompute import MODES, MemoryMode, run_layer_with_memory_mode
from galaxy.planner.cluster import DEFAULT_HOST_LINK_BYTES_PER_S
from galaxy.planner.memory import ModeCost, choose_layer_memory, with_offload

logger = logging.getLogger(__name__)
aten = torch.ops.aten


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages ops make on ``device`` while it is on (views and in-place results of existing
    storages apart) that are still alive: ``now``, and their most at once (``peak``): what a piece of work
    allocates beyond what existed before it, where the device keeps no allocator statistics (a CPU). Kernels'
    internal workspaces are not op outputs and are not seen."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.now, self.peak, self.live = torch.device(device), 0, 0, set()

    def _freed(self, key, nbytes):
        self.live.discard(key)
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if type(t) is not torch.Tensor or t.device.type != self.device.type:  # a subclass: its parts count
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self.live or storage.nbytes() == 0:
                continue
            self.live.add(key)
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def peak_allocated(device: torch.device, work: Callable[[], object]) -> int:
    """The most bytes ``work()`` holds on ``device`` at once beyond what was allocated before it: on a GPU the
    caching allocator's count (kernels' workspaces included), elsewhere ``LiveBytes``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with LiveBytes(device) as live:
        work()
    return live.peak


def _heads_of(q: tuple, kv: tuple) -> tuple:
    """A key / value shape [batch, heads, seq, dim] with the query's heads: grouped-query attention (fewer K/V
    heads, each serving a group of query heads) computes as many scores as the query has heads, and torch's
    formulas assert equal heads."""
    return (kv[0], q[1], *kv[2:])


def _forward_flops(q, k, v, *_, **__) -> int:
    return sdpa_flop_count(q, _heads_of(q, k), _heads_of(q, v))


def _backward_flops(grad, q, k, v, *_, **__) -> int:
    return sdpa_backward_flop_count(grad, q, _heads_of(q, k), _heads_of(q, v))


# The fused attention kernels counted with grouped-query K/V (a GPU's flash, memory-efficient and cuDNN kernels),
# and a CPU's, which FlopCounterMode does not count by itself, as on a GPU.
ATTENTION_FLOPS = {op: _forward_flops for op in (
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention)}
ATTENTION_FLOPS.update({op: _backward_flops for op in (
    aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward, aten._scaled_dot_product_cudnn_attention_backward)})

PROBE_TOKENS = 1024  # the longer probe's tokens (the run's seq_length where shorter); the other has half
PROBE_SHARE = 0.5  # of the memory budget a longer probe may take (probe_layer)
ACHIEVED_FRACTION = 0.5  # of a device's peak FLOP/s a layer's matmuls and attention run at
CPU_TFLOPS = 0.1  # a CPU's rate, where no peak is known
MAX_MLP_CHUNKS = 32  # the most sequence chunks auto runs an MLP in
MIN_CHUNK_TOKENS = 1024  # the fewest tokens of a chunk auto makes (smaller products run below the device's rate)
OPTIMIZER_BYTES = dict(zip(OPTIMIZERS, (8, 4)))  # per fp32 trainable weight: AdamW's two moments, SGD's one


@dataclass(frozen=True)
class LayerProbe:
    """One layer of a run at ``seq`` tokens (``rows`` rows): bytes it keeps for backward under each recompute
    mode and bytes its backward allocates beyond them at its peak (``working``: what it rebuilds, the gradients
    of its activations, its kernels' outputs; ``halved``: the same with the MLP in two chunks; ``floor``: with
    the MLP in ``MAX_MLP_CHUNKS`` chunks, what chunking leaves, the attention's backward above all), FLOPs of its
    forward, of its backward and of what each mode runs again in backward; and the model's weights (per layer,
    the rest), trainable parameters (per layer, the rest) and the activations its embeddings, head and loss
    save."""

    seq: int
    kept: dict
    working: dict
    halved: dict
    floor: dict
    again_flops: dict
    fwd_flops: float
    bwd_flops: float
    layer_weight_bytes: int
    edge_weight_bytes: int
    layer_trainable: int
    edge_trainable: int
    edge_saved: float


def probe_config(cfg: GalaxyConfig, seq: int, rows: int, recompute: str, mlp_chunks: int = 1) -> GalaxyConfig:
    """The run's config for a probe: two layers offloading under ``recompute``, eager, ``seq`` tokens, the MLP
    in ``mlp_chunks`` chunks."""
    m = replace(cfg.model, num_hidden_layers=2, activation_memory="manual", layer_memory=[recompute + OFFLOAD] * 2,
                mlp_chunks=mlp_chunks,
                memory_budget_gib=None, host_memory_budget_gib=None, host_link_gb_per_s=None, recompute="none",
                recompute_num_layers=None, compile=False, compile_mode="default", compile_options=None,
                compile_backend="inductor",
                max_position_embeddings=max(cfg.model.max_position_embeddings, seq))
    return replace(cfg, model=m, train=replace(cfg.train, seq_length=seq, global_batch_size=rows),
                   data=replace(cfg.data, model_path=None))


def _weights(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the parameters and buffers, trainable parameters), each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}
    return sum(storages.values()), sum(p.numel() for p in module.parameters() if p.requires_grad)


def probe_at(cfg: GalaxyConfig, device: torch.device, seq: int, rows: int) -> LayerProbe:
    """One probe length: a model per recompute mode and MLP chunk count (a layer's mode is built into it), its
    second layer run on the input that layer got in the first model's forward, offloading to count what it
    keeps, then again keeping it to measure what its backward allocates."""
    from galaxy.peft import apply_tuning, build_base

    dtype = cfg.train.dtype
    low = dtype in ("bfloat16", "float16")

    def autocast():
        return torch.autocast(device.type, dtype=getattr(torch, dtype)) if low else contextlib.nullcontext()

    ids = torch.randint(1, cfg.model.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0)).to(device)
    kept, bwd, fwd, inputs = {}, {}, 0.0, []
    working: dict[int, dict] = {1: {}, 2: {}, MAX_MLP_CHUNKS: {}}  # by the MLP's chunks
    for recompute, chunks in itertools.product(MODES, working):
        pc = probe_config(cfg, seq, rows, recompute, chunks)
        # on the device: the host's generator (one core, about 250 M values a second) takes 6 s for each of an
        # 8B's sixteen probe models (1.5B values: its vocabulary's two 0.5B tensors, two 0.2B layers)
        model = apply_tuning(build_base(pc, Plan.serial(pc), ParallelContext.serial(device, seed=cfg.train.seed),
                                        init_on_device=True), pc).to(device).train()
        if dtype == "float64":
            model.double()
        layer = [m for m in model.modules() if isinstance(getattr(m, "memory_mode", None), MemoryMode)][1]
        if not inputs:  # the first model's forward: the layer's inputs (the same for every model: one seed)
            own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
            outside: dict[int, int] = {}

            def count(t):  # what autograd saves outside the layers (theirs go to their host stores)
                if t.untyped_storage().data_ptr() not in own:
                    outside[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            hook = layer.register_forward_pre_hook(lambda _, args: inputs.extend(args))
            with autocast(), torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
                model(input_ids=ids, labels=ids)
            hook.remove()
            edge_saved = float(sum(outside.values()))
            (layer_bytes, layer_trainable), (all_bytes, all_trainable) = _weights(layer), _weights(model)
        h, *rest = inputs
        if chunks == 1:
            traffic = OffloadTraffic()
            forward, backward = (FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS) for _ in range(2))
            with autocast(), forward:
                out = run_layer_with_memory_mode(layer.memory_mode, layer, layer.compute,
                                                 h.detach().requires_grad_(), *rest, traffic=traffic)
            with backward:
                out.backward(torch.ones_like(out))
            kept[recompute], bwd[recompute] = float(traffic.to_host_bytes), float(backward.get_total_flops())
            if recompute == "none":
                fwd = float(forward.get_total_flops())
        # what is kept staying where it was made: the backward's own allocations at their peak
        with autocast():
            out = run_layer_with_memory_mode(replace(layer.memory_mode, offload=False), layer, layer.compute,
                                             h.detach().requires_grad_(), *rest)
        grad = torch.ones_like(out)
        working[chunks][recompute] = float(peak_allocated(device, lambda: out.backward(grad)))
    return LayerProbe(seq, kept, working[1], working[2], working[MAX_MLP_CHUNKS],
                      {r: bwd[r] - bwd["none"] for r in MODES}, fwd, bwd["none"],
                      layer_bytes, all_bytes - 2 * layer_bytes, layer_trainable, all_trainable - 2 * layer_trainable,
                      edge_saved)


def probe_layer(cfg: GalaxyConfig, device: torch.device, rows: int, budget_bytes: Optional[float] = None
                ) -> tuple[LayerProbe, LayerProbe]:
    """The run's layer probed at two sequence lengths (``PROBE_TOKENS`` or the run's, and half of it). With
    ``budget_bytes``, probed again at the longest doubling of them, up to the run's length, whose probe the short
    probes say fits ``PROBE_SHARE`` of it: a backward's peak is the largest of several allocations, some fixed
    (dequantized weights), some growing with the sequence, so lengths where the growing ones already dominate
    extrapolate to a long run. (The probe is eager; a compiled layer's buffers differ: docs/benchmarks.md, Long
    context.)"""
    seq = cfg.train.seq_length
    long = min(seq, PROBE_TOKENS)
    short, long_probe = probe_at(cfg, device, max(long // 2, 1), rows), probe_at(cfg, device, long, rows)
    if budget_bytes is None or seq <= long:
        return short, long_probe
    farthest = long
    fits = PROBE_SHARE * budget_bytes
    while farthest * 2 <= seq and probe_bytes(at_length(short, long_probe, farthest * 2)) <= fits:
        farthest *= 2
    if farthest == long:
        return short, long_probe
    return probe_at(cfg, device, farthest // 2, rows), probe_at(cfg, device, farthest, rows)


def probe_bytes(probe: LayerProbe) -> float:
    """What a probe at ``probe.seq`` tokens holds at most: its two-layer model's weights, both layers' activations
    kept whole, the largest backward working set and what the embeddings, head and loss save."""
    return (probe.edge_weight_bytes + 2 * probe.layer_weight_bytes + 2 * max(probe.kept.values())
            + max(*probe.working.values(), *probe.halved.values()) + probe.edge_saved)


def at_length(a: LayerProbe, b: LayerProbe, seq: int) -> LayerProbe:
    """``a`` and ``b`` (two lengths) extended to ``seq`` tokens: bytes affine, FLOPs ``u s + v s^2``."""
    def affine(x, y):
        return x + (y - x) * (seq - a.seq) / (b.seq - a.seq) if b.seq != a.seq else y * seq / b.seq

    def quadratic(x, y):
        if b.seq == a.seq:
            return y * seq / b.seq
        v = (y / b.seq - x / a.seq) / (b.seq - a.seq)
        return (x / a.seq - v * a.seq) * seq + v * seq * seq

    return replace(b, seq=seq, kept={r: affine(a.kept[r], b.kept[r]) for r in MODES},
                   working={r: affine(a.working[r], b.working[r]) for r in MODES},
                   halved={r: affine(a.halved[r], b.halved[r]) for r in MODES},
                   floor={r: affine(a.floor[r], b.floor[r]) for r in MODES},
                   again_flops={r: quadratic(a.again_flops[r], b.again_flops[r]) for r in MODES},
                   fwd_flops=quadratic(a.fwd_flops, b.fwd_flops), bwd_flops=quadratic(a.bwd_flops, b.bwd_flops),
                   edge_saved=affine(a.edge_saved, b.edge_saved))


def mode_options(probe: LayerProbe, flops_per_s: float, host_bytes_per_s: float, mlp_chunks: int = 1) -> list[ModeCost]:
    """Every memory mode of the probed layer as a ``ModeCost`` (one rank's numbers). What a mode's backward needs
    beyond what it kept is the probe's measured working set; with the MLP in ``mlp_chunks`` chunks its backward
    rebuilds and differentiates one chunk at a time: ``a + b / chunks``, from the probes with the MLP whole and
    in two chunks, and never less than the probe with the MLP in ``MAX_MLP_CHUNKS`` chunks: the rest of the
    backward (the attention's) peaks on its own, which chunking the MLP does not shrink (without that floor, an
    NF4 1B at 65,536 tokens in 16 chunks was predicted at 5,470 MiB and measured at 5,892)."""
    def at_chunks(whole: float, two: float, floor: float) -> float:
        return max(2 * two - whole + 2 * (whole - two) / mlp_chunks, floor, 0.0)

    rebuilt = {r: at_chunks(probe.working[r], probe.halved[r], probe.floor[r]) for r in MODES}
    options = []
    for recompute in MODES:
        cost = ModeCost(recompute, probe.kept[recompute], 0.0, rebuilt[recompute],
                        probe.again_flops[recompute] / flops_per_s)
        options += [cost, with_offload(cost, host_bytes_per_s, probe.fwd_flops / flops_per_s,
                                       probe.bwd_flops / flops_per_s)]
    return options


def fixed_bytes(cfg: GalaxyConfig, probe: LayerProbe, layers: int) -> float:
    """What a rank holds beside its layers' activations: weights, trainable parameters' gradients and optimizer
    state (fp32 masters; a compute-dtype copy under autocast) and the embeddings', head's and loss's activations."""
    trainable = probe.edge_trainable + layers * probe.layer_trainable
    master = 8 if cfg.train.dtype == "float64" else 4
    low = 2 if cfg.train.dtype in ("bfloat16", "float16") else 0
    per_trainable = master + OPTIMIZER_BYTES[cfg.train.optimizer] * master / 4 + low
    return probe.edge_weight_bytes + layers * probe.layer_weight_bytes + trainable * per_trainable + probe.edge_saved


def device_rate(cfg: GalaxyConfig, device: torch.device) -> float:
    """FLOP/s a layer is priced at: ``peak_tflops``, or the device table's peak, at ``ACHIEVED_FRACTION``."""
    peak = cfg.train.peak_tflops
    if peak is None and device.type == "cuda":
        from galaxy.profiler.devices import lookup_peak_tflops

        peak = lookup_peak_tflops(torch.cuda.get_device_name(device), getattr(torch, cfg.train.dtype))
    return (peak if peak is not None else CPU_TFLOPS / ACHIEVED_FRACTION) * 1e12 * ACHIEVED_FRACTION


def chunk_counts(cfg: GalaxyConfig, rows: int) -> list[int]:
    """The MLP chunk counts ``auto`` weighs: the config's, and where the MLP can run in chunks (it draws no dropout
    mask) twice as many, again and again, while a chunk keeps ``MIN_CHUNK_TOKENS`` and up to ``MAX_MLP_CHUNKS``."""
    counts = [cfg.model.mlp_chunks]
    if cfg.model.hidden_dropout_prob > 0 or (cfg.peft.tuning == "lora" and cfg.peft.lora_dropout > 0):
        return counts
    tokens = rows * cfg.train.seq_length
    while counts[-1] * 2 <= MAX_MLP_CHUNKS and tokens // (counts[-1] * 2) >= MIN_CHUNK_TOKENS:
        counts.append(counts[-1] * 2)
    return counts


def plan_activation_memory(cfg: GalaxyConfig, device: torch.device, probe: LayerProbe, stage_layers: list[int],
                           rows: int, budget_bytes: float, host_bytes: float = float("inf")) -> tuple[list[str], int]:
    """The memory mode of every model layer and the MLP's sequence chunks: per pipeline stage (``stage_layers``),
    the fastest mix that fits ``budget_bytes`` on the device and ``host_bytes`` of pinned host memory, over every
    chunk count of ``chunk_counts`` (more chunks rebuild less of the MLP at once, so more mixes fit; among
    equally fast plans the fewest chunks, since a chunk's matmuls are smaller); ``probe``: the run's layer at
    its sequence length."""
    link = cfg.model.host_link_gb_per_s * 1e9 if cfg.model.host_link_gb_per_s else DEFAULT_HOST_LINK_BYTES_PER_S
    rate = device_rate(cfg, device)
    best, refusal = None, None
    for chunks in chunk_counts(cfg, rows):
        options = mode_options(probe, rate, link, chunks)
        cost = {o.mode: float(o.extra_s) for o in options}
        try:
            modes = [m for layers in stage_layers
                     for m in choose_layer_memory(options, layers, budget_bytes - fixed_bytes(cfg, probe, layers),
                                                  host_bytes)]
        except ConfigError as e:
            refusal = refusal or e
            continue
        extra = sum(cost[m] for m in modes)
        if best is None or extra < best[0] * (1 - 1e-9):
            best = (extra, modes, chunks)
    if best is None:
        raise refusal
    return best[1], best[2]


def usable_device_bytes(device: torch.device) -> int:
    """What this process can hold on a GPU: what is free and what its allocator has reserved (the card's memory
    less the CUDA context and other processes')."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def resolve_activation_memory(cfg: GalaxyConfig, ctx: ParallelContext) -> GalaxyConfig:
    """``cfg`` as it is, or with ``activation_memory: auto`` made into ``layer_memory`` for this run (the same
    plan on every rank: each measures the same serial layer)."""
    m = cfg.model
    if m.activation_memory != "auto":
        return cfg
    device = ctx.device
    if m.memory_budget_gib is not None:
        budget = m.memory_budget_gib * 2**30
    elif device.type == "cuda":
        budget = usable_device_bytes(device)
    else:
        raise ConfigError("config key 'activation_memory' is auto, which plans within a device's memory: set "
                          "memory_budget_gib (this device reports none)")
    host = m.host_memory_budget_gib * 2**30 if m.host_memory_budget_gib is not None else float("inf")
    p = cfg.parallel
    rows = max(cfg.train.global_batch_size // (p.dp_size * p.num_microbatches), 1)
    probe = at_length(*probe_layer(cfg, device, rows, budget), cfg.train.seq_length)
    modes, chunks = plan_activation_memory(cfg, device, probe, list(cfg.stage_layers()), rows, budget, host)
    logger.info("activation_memory auto (%.2f GiB): layer_memory %s, mlp_chunks %d", budget / 2**30, modes, chunks)
    return replace(cfg, model=replace(m, activation_memory="manual", layer_memory=modes, mlp_chunks=chunks,
                                      memory_budget_gib=None, host_memory_budget_gib=None, host_link_gb_per_s=None))
