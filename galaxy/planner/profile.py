"""Measure a cluster on the ranks it runs on: each rank times the real ATT, CON and MLP blocks of
the model at the candidate shard sizes (``galaxy.planner.blocks``), its optimizer step by parameter
count, what a real training step takes beyond those, and its memory budget; every group a plan can
use times all-reduce, all-gather, reduce-scatter, all-to-all and a ring shift of point-to-point exchanges
(the SP attention flavours' collectives) by message size (alpha-beta fits).

All ranks measure at the same time, as they compute during training, so shared cores and links
are measured under the contention a run sees. Any backend works: CPU/Gloo, CUDA/NCCL, emulated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import statistics
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from galaxy.config import Method, ModelConfig, Plan
from galaxy.core.comm import Communicator
from galaxy.core.context import ParallelContext
from galaxy.planner.blocks import DeviceTimer, measure_blocks, synchronize, windowed
from galaxy.planner.cluster import (DEFAULT_HOST_LINK_BYTES_PER_S, OPS, AlphaBeta, ClusterProfile, RankProfile,
                                    candidate_groups)
from galaxy.planner.simulate import GRAD_BUCKET_BYTES, predict
from galaxy.planner.workload import Layout, Splits, Workload

logger = logging.getLogger(__name__)

MIN_COMPUTE_SCALE = 0.5  # a real run at less than half its pieces' time means a broken measurement
MAX_LAYER_SCALE = 2.0  # likewise a real layer at over twice its pieces' time
MIN_ACTIVATION_SCALE = 0.25  # likewise a real step holding under a quarter of the activations its pieces saved
COLLECTIVE_REPS = 5  # rounds over every message size: two slow rounds of a shaped link leave the median
# How late one member comes to each profiled collective: past the ~1 ms below which Gloo's members
# still leave an all-gather together (at 1 MiB over 50 Mbit: 0.5 ms late in 2 of 4 rounds, 2 ms in every one)
STAGGER_S = 0.005
GPU_OPS_PER_SAMPLE = 8  # a GPU collective sample: this many back to back, after one that lines the members up


def probe_groups(run_group, world: int) -> list[tuple[tuple[int, ...], Optional[dist.ProcessGroup]]]:
    """Every candidate group, created by every rank in the same order. Not with
    ``use_local_synchronization=True``: torch names such a group by its ranks and the number of
    groups the calling process already holds, so once one member has created a group the other
    has not (ranks 0 and 1 make [0, 1]; then [1, 2]), the members disagree on the name, wait on
    different rendezvous keys and time out: what hung three-rank profiles."""
    if any(len(g) < world for g in candidate_groups(world)) and dist.get_world_size() != world:
        raise ValueError(f"profiling {world} of {dist.get_world_size()} processes: run the profiler on the whole "
                         "world, it creates every subgroup a plan can use")
    global_ranks = [dist.get_global_rank(run_group, r) if run_group is not None else r for r in range(world)]
    return [(members, run_group if len(members) == world else dist.new_group([global_ranks[r] for r in members]))
            for members in candidate_groups(world)]


def measure_optimizer(device: torch.device, most_params: int, reps: int, barrier, window_s: float = 0.0,
                      timer: Optional[DeviceTimer] = None) -> AlphaBeta:
    """AdamW step seconds by parameter count (8 tensors each, as a model holds many)."""
    counts = sorted({c for c in (2**12, 2**15, 2**18, 2**20, most_params) if c <= max(most_params, 2**12)})
    samples = []
    for n in counts:
        params = [torch.zeros(max(1, n // 8), device=device, requires_grad=True) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))

        def once() -> tuple[float]:
            if timer is not None:
                return timer.time([opt.step])
            synchronize(device)
            t0 = time.perf_counter()
            opt.step()
            synchronize(device)
            return (time.perf_counter() - t0,)

        times = []
        for i in range(reps + 1):
            barrier()
            t = windowed(once, window_s if i else 0.0)[0]
            if i:
                times.append(t)
        samples.append((float(sum(p.numel() for p in params)), statistics.median(times)))
    return AlphaBeta.fit(samples)


def memory_budget(device: torch.device, local_ranks: int, override_gb: Optional[float]) -> int:
    if override_gb is not None:
        return int(override_gb * 2**30)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    available = int(info["MemAvailable"].split()[0]) * 1024
    return int(available * 0.9 / max(local_ranks, 1))


def measure_host_link(device: torch.device, nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Bytes per second of pinned host copies to and from ``device`` (the slower direction, the median of
    ``reps``; every rank of a host at once, as offloading layers copy during training). A CPU: the default
    (``cluster.DEFAULT_HOST_LINK_BYTES_PER_S``), its "host copy" being a copy in the same memory."""
    if device.type != "cuda":
        return DEFAULT_HOST_LINK_BYTES_PER_S
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = {"to_host": [], "to_device": []}
    for _ in range(reps + 1):  # the first warms up
        for direction, (dst, src) in (("to_host", (host, on_device)), ("to_device", (on_device, host))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds[direction].append(start.elapsed_time(end) / 1e3)
    return nbytes / max(statistics.median(t[1:]) for t in seconds.values())


def host_memory_share(local_ranks: int) -> int:
    """Pinned host memory one of ``local_ranks`` ranks may offload to: half the host's available memory, shared."""
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(int(info["MemAvailable"].split()[0]) * 1024 * 0.5 / max(local_ranks, 1))


# ----------------------------------------------------------------------------- the rest of a step


def measure_serial(m: ModelConfig, rows: int, seq: int, dtype: str, device: torch.device, reps: int,
                   window_s: float = 0.0, forwards: bool = True) -> tuple[list[float], list[float], Optional[int]]:
    """Seconds of ``reps`` whole serial training steps of ``rows`` rows, run by the training loop's own
    Trainer (data, masking, loss, grad norm, optimizer, Python between the blocks), and of ``reps``
    batch-1 forwards, and the bytes the steps held at their peak (a GPU's allocator; None on a CPU).
    It runs first, in a fresh process, as the CLIs do: the steps one after another
    (the first two untimed: allocation and first touch of the memory), then the forwards. Under
    the CLIs' autocast: without it a bfloat16 step ran in float32 (an H200's 2-layer LLaMA-7B step
    1.13 s instead of ~0.1, all of it read as overhead on every plan)."""
    from galaxy.config import GalaxyConfig
    from galaxy.models import build_model, family
    from galaxy.train.loop import autocast_context, make_trainer

    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0  # what the profile itself holds meanwhile
    cfg = GalaxyConfig.from_dict({"model": {k: v for k, v in vars(m).items() if k != "preset"},
                                  "train": {"global_batch_size": rows, "seq_length": seq, "dtype": dtype,
                                            "device": device.type}})
    ctx = ParallelContext.serial(device)
    model = build_model(cfg, Plan.serial(cfg), ctx)
    if not family(m.model_type).causal:  # a masked LM trains on masked batches
        from galaxy.data.pretraining import mlm_data

        batch_at = mlm_data(cfg)[0]
    else:
        def batch_at(step):
            ids = torch.randint(0, m.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(step))
            return {"input_ids": ids, "labels": ids}
    trainer = make_trainer(model, cfg, ctx)
    amp = lambda: autocast_context(cfg, device)  # noqa: E731
    ids = torch.randint(0, m.vocab_size, (1, seq), device=device)
    steps = []
    for i in range(reps + 2):
        synchronize(device)
        if cuda and i == 2:  # the peak of the timed steps (the first ones also compile and allocate the state)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loss = trainer.forward_backward(trainer.read_batch(batch_at, i), autocast=amp)
        trainer.optimizer_step(loss, i + 1)
        loss.item()
        if i >= 2:
            steps.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
    model.eval()

    def forward() -> tuple[float]:
        with torch.no_grad(), amp():
            synchronize(device)
            t = time.perf_counter()
            model(ids)
            synchronize(device)
            return (time.perf_counter() - t,)
    if not forwards:
        return steps, [], peak
    return steps, [windowed(forward, window_s if i else 0.0)[0] for i in range(reps + 1)][1:], peak


def measure_sustained(m: ModelConfig, rows: int, seq: int, dtype: str, device: torch.device,
                      burst_steps_s: Sequence[float], seconds: float) -> tuple[float, list[float]]:
    """(``sustained_scale``, the steps): serial training steps run back to back for about ``seconds``,
    the median of their last fifth over the median of ``burst_steps_s`` (the calibration's steps, the
    short runs the pieces match), at least 1. A training run holds a GPU at its power limit, where it
    clocks lower than in the profile's bursts (an H200 at 700 W: ~1,560 MHz against 1,980 for a burst;
    the 4-GPU plans it ran were predicted 14-17% fast, docs/benchmarks-log.md)."""
    reps = max(5, math.ceil(seconds / min(burst_steps_s)))
    steps, _, _ = measure_serial(m, rows, seq, dtype, device, reps, forwards=False)
    late = statistics.median(steps[-max(3, len(steps) // 5):])
    return max(1.0, late / statistics.median(burst_steps_s)), steps


def calibrated(me: RankProfile, m: ModelConfig, rows: int, seq: int, dtype: str, steps_s: Sequence[float],
               forwards_s: Sequence[float], peak_bytes: Optional[int] = None,
               shallower_peak_bytes: Optional[int] = None, shallower_steps_s: Sequence[float] = ()) -> RankProfile:
    """``me`` with the overheads or compute scales that make the cost model predict the serial
    training steps of ``rows`` rows ``steps_s`` and the batch-1 forwards ``forwards_s``
    (``measure_serial``, timed before and after the pieces; kept in the profile): where even the
    fastest run took longer than the pieces' prediction, the difference is an overhead every
    prediction adds (one that every run pays; a burst of load in some runs is not one); where the
    median run took less (blocks timed one by one run a little slower than inside the model, 5-15%
    on CPU), the pieces' compute is scaled down to match; in between, neither.

    ``peak_bytes`` and ``shallower_peak_bytes``: the steps' peak, where the device reports one, and
    the same step's with one layer less. Their difference is one layer's weights, gradients,
    optimizer state and saved activations; where it held fewer activations than the pieces saved (a
    compiled layer keeps less for backward than its pieces run eagerly), their saved bytes are scaled
    to match. One layer's difference, not the whole peak: the embeddings, head and loss of a shallow
    calibration model, whose transients the cost model does not place, made a 2-layer LLaMA-7B step's
    peak read as 0.37 of its activations, and 4-GPU plans then held 23-33% more than predicted
    (docs/benchmarks-log.md).

    ``shallower_steps_s``: that step's times (a GPU's; a CPU's are too noisy for a difference). A layer's
    time is then the two steps' difference, less the optimizer's share of one layer: the layer pieces are
    scaled to it (``layer_compute_scale``) and the rest of the step (embeddings, head, loss) is calibrated
    as above on what remains. Fitted as a whole, a 2-layer step spread its error over the layers and the
    head: on an H200 the pieces under-predicted a 7B layer by 7% and over-predicted the head, so that 32
    layers ran 6% slower than predicted (docs/benchmarks-log.md)."""
    me = dataclasses.replace(me, step_overhead_s=0.0, forward_overhead_s=0.0, step_compute_scale=1.0,
                             forward_compute_scale=1.0, activation_scale=1.0, sustained_scale=1.0,
                             layer_compute_scale=1.0)
    alone = ClusterProfile(1, "none", "cpu", m, tuple(me.pieces), seq, dtype, (me,), {})
    serial = Splits.balanced(m, seq, 1)
    none = (Method.NONE,) * 3
    train = Workload(m, "train", rows, seq, dtype)
    step = predict(alone, train, none, serial, Layout()).time_s[0]
    forward = predict(alone, Workload(m, "latency", rows, seq, dtype), none, serial).time_s[0]
    optimizer = float(me.optimizer(model_params(m)))

    def split(measured: Sequence[float], predicted: float, fixed: float) -> tuple[float, float]:
        """(overhead, compute scale) for runs measured against a prediction of which ``fixed`` is
        not the pieces' compute."""
        if min(measured) >= predicted:
            return min(measured) - predicted, 1.0
        typical = statistics.median(measured)
        if typical >= predicted:
            return 0.0, 1.0
        return 0.0, min(1.0, max(MIN_COMPUTE_SCALE, (typical - fixed) / max(predicted - fixed, 1e-12)))

    def memory(model: ModelConfig, activation_scale: float) -> float:
        """The predicted peak of ``model``'s serial step, its saved bytes scaled by ``activation_scale``."""
        ranks = (dataclasses.replace(me, activation_scale=activation_scale),)
        profile = dataclasses.replace(alone, model=model, ranks=ranks)
        return float(predict(profile, dataclasses.replace(train, model=model), none, Splits.balanced(model, seq, 1),
                             Layout()).memory_bytes[0, 0])

    step_overhead, step_scale = split(steps_s, step, optimizer)
    layer_scale = 1.0
    shallower = dataclasses.replace(m, num_hidden_layers=m.num_hidden_layers - 1) if m.num_hidden_layers > 1 else None
    if shallower_steps_s and shallower is not None:
        shallower_optimizer = float(me.optimizer(model_params(shallower)))
        shallower_step = predict(dataclasses.replace(alone, model=shallower),
                                 dataclasses.replace(train, model=shallower), none, Splits.balanced(shallower, seq, 1),
                                 Layout()).time_s[0]
        predicted_layer = (step - optimizer) - (shallower_step - shallower_optimizer)
        measured_layer = (statistics.median(steps_s) - optimizer) - (statistics.median(shallower_steps_s)
                                                                     - shallower_optimizer)
        if measured_layer > 0 and predicted_layer > 0:
            layer = min(MAX_LAYER_SCALE, max(MIN_COMPUTE_SCALE, measured_layer / predicted_layer))
            # the rest of the step (its edges) against what the layers now account for
            layers = m.num_hidden_layers * predicted_layer
            edges = step - layers
            step_overhead, step_scale = split([t - layers * layer for t in steps_s], edges, optimizer)
            layer_scale = layer / step_scale  # (the compute scale multiplies every piece)
    forward_overhead, forward_scale = split(forwards_s, forward, 0.0)
    activation_scale = 1.0
    if peak_bytes is not None and shallower_peak_bytes is not None and shallower is not None:
        def growth(scale: float) -> float:
            return memory(m, scale) - memory(shallower, scale)
        measured = peak_bytes - shallower_peak_bytes
        if measured < growth(1.0):  # the scale whose growth is the measured one (growth rises with it)
            low, high = MIN_ACTIVATION_SCALE, 1.0
            for _ in range(30):
                mid = (low + high) / 2
                low, high = (low, mid) if growth(mid) >= measured else (mid, high)
            activation_scale = high
    return dataclasses.replace(me, step_overhead_s=step_overhead, forward_overhead_s=forward_overhead,
                               step_compute_scale=step_scale, forward_compute_scale=forward_scale,
                               activation_scale=activation_scale, layer_compute_scale=layer_scale,
                               serial_steps_s=tuple(steps_s), serial_forwards_s=tuple(forwards_s),
                               serial_peak_bytes=peak_bytes, shallower_peak_bytes=shallower_peak_bytes,
                               shallower_steps_s=tuple(shallower_steps_s))


def model_params(m: ModelConfig) -> int:
    """Parameters of the whole serial model."""
    from galaxy.planner.workload import edge_params, layer_params

    H, F_ = m.num_attention_heads, m.intermediate_size
    return int(layer_params(m, Method.NONE, Method.NONE, Method.NONE, H, F_).total) * m.num_hidden_layers \
        + sum(edge_params(m))


# ----------------------------------------------------------------------------- collectives


def message_sizes(most_bytes: int) -> list[int]:
    """4 KiB, then x4 up to 256 KiB, then x2 (a shaped link's queue overflows somewhere up there, and
    the time bends) up to ``most_bytes``."""
    sizes, n = [], 4096
    while n < most_bytes:
        sizes.append(n)
        n *= 4 if n < 2**18 else 2
    return sizes + [most_bytes]


def collective_sizes(m: ModelConfig, rows: int, seq: int, world: int,
                     most_bytes: Optional[int] = None) -> dict[str, list[int]]:
    """The message sizes to time each op at: up to the largest activation collective of any plan
    (K and V gathered, padded to a shard that holds every token: world x the whole activation, twice),
    and for all-reduce up to a gradient sync's bucket: extrapolated to 25 MiB along the slope between
    2 and 4 MiB (237 ms/MiB at 50 Mbit, where 16-25 MiB run at 201), it put every replicated training
    step 13% high (docs/benchmarks-log.md).
    ``most_bytes``: one limit for every op instead."""
    largest = most_bytes or min(max(2 * world * rows * seq * m.hidden_size * 4, 2**20), 2**26)
    sizes = {op: message_sizes(largest) for op in OPS}
    bucket = min(GRAD_BUCKET_BYTES, model_params(m) * 4)
    if most_bytes is None and bucket > largest:
        sizes["all_reduce"] = message_sizes(bucket)
    return sizes


def measure_group(comm: Communicator, device: torch.device, sizes: dict[str, list[int]], reps: int,
                  timer: Optional[DeviceTimer] = None) -> tuple[dict[str, AlphaBeta], dict[str, AlphaBeta]]:
    """Each op's time at its message ``sizes`` on one group, with one member arriving ``STAGGER_S`` after
    the others (a different one each round): from its arrival until it leaves, and until the
    members that waited leave (``ClusterProfile.collective`` and ``waiting_leave``); per role the
    slowest member's median over ``reps`` rounds. Staggered because members of a real run never
    arrive together, and Gloo's all-gather lets the waiting members go well before the last one;
    timed after a barrier instead, the ranks leave it within a millisecond, some rounds staggered and
    some not, and the median mixed the two. A round times every size once (after an untimed round),
    so a burst of load or a slow spell of the link lands on one sample of several sizes, which the
    median drops, instead of on every sample of one size, which no fit can tell from the link.
    ``timer``: on GPUs (``DeviceTimer``) a sample is the mean of ``GPU_OPS_PER_SAMPLE`` ops queued back to
    back after one that lines the members up, by the GPU's events, for both roles: a member that
    comes late holds up the others' kernels, not their hosts, and a step's host queues its
    collectives ahead of the GPU."""
    last_fits, waited_fits = {}, {}
    for op in OPS:
        runs = []
        for nbytes in sizes[op]:
            piece = max(1, nbytes // 4 // comm.size)
            full = torch.randn(piece * comm.size, device=device)
            local = full[:piece].contiguous()
            even = [piece] * comm.size
            shift = torch.empty_like(full)  # a ring shift sends the whole buffer to the next member
            runs.append((float(full.numel() * 4), {
                "all_reduce": lambda full=full: comm.all_reduce(full),
                "all_gather": lambda local=local, even=even: comm.all_gather(local, 0, even),
                "reduce_scatter": lambda full=full, even=even: comm.reduce_scatter(full, 0, even),
                "all_to_all": lambda full=full, even=even: comm.all_to_all(full.split(even), [(n,) for n in even]),
                "send_recv": lambda full=full, shift=shift: comm.start_exchange(
                    full, shift, (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size).wait()}[op]))
        as_last, as_waiting = [[] for _ in runs], [[] for _ in runs]
        for i in range(reps + 1):
            late = comm.rank == i % comm.size
            for (_, run), last, waited in zip(runs, as_last, as_waiting):
                dist.barrier(group=comm.group)
                synchronize(device)
                if timer is not None:  # both roles alike: the late member holds up kernels, not hosts
                    took = timer.time([run, lambda run=run: [run() for _ in range(GPU_OPS_PER_SAMPLE)]],
                                      retry=False)[1] / GPU_OPS_PER_SAMPLE
                    if i:
                        last.append(took)
                        waited.append(took)
                    continue
                t0 = time.perf_counter()
                if late:
                    time.sleep(STAGGER_S)
                    t0 = time.perf_counter()
                run()
                synchronize(device)
                took = time.perf_counter() - t0
                if i:
                    (last if late else waited).append(took if late else max(took - STAGGER_S, 0.0))
        median = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731 (a member never last: 0)
        slowest = torch.tensor([[median(a), median(b)] for a, b in zip(as_last, as_waiting)], dtype=torch.float64,
                               device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=comm.group)
        sizes_b = [nbytes for nbytes, _ in runs]
        last_fits[op] = AlphaBeta.fit([(b, float(t)) for b, t in zip(sizes_b, slowest[:, 0].tolist())])
        waited_fits[op] = AlphaBeta.fit([(b, float(t)) for b, t in zip(sizes_b, slowest[:, 1].tolist())])
    return last_fits, waited_fits


# ----------------------------------------------------------------------------- one rank's run


def profile_rank(ctx: ParallelContext, m: ModelConfig, rows: Sequence[int], seq: int, dtype: str, reps: int = 3,
                 memory_gb: Optional[float] = None, ffn_unit: int = 1, most_bytes: Optional[int] = None,
                 window_s: float = 0.0, calibration_layers: Optional[int] = None,
                 sustain_s: float = 0.0) -> Optional[ClusterProfile]:
    """Measure this rank and its groups; every rank of ``ctx.mp`` (the whole run: profile with
    dp = pp = 1) must call it. Its rank 0 returns the ClusterProfile, the others None.
    ``calibration_layers``: the whole serial steps that calibrate the pieces (``measure_serial``,
    ``calibrated``) run a model of at most that many layers, for a model whose serial training step
    does not fit one device (LLaMA-7B's weights, gradients and AdamW state alone are 108 GB); the
    pieces are per layer, so the calibrated overheads and scales hold for the whole model.
    ``sustain_s``: on a GPU, that many seconds of those serial steps back to back, every rank at once as
    in training, give ``sustained_scale`` (``measure_sustained``); 0 (and on a CPU): 1."""
    if ctx.mp.size != ctx.world_size:
        raise ValueError("profile with dp_size = pp_size = 1: the profiler measures every group itself")
    world, run_group, rank = ctx.mp.size, ctx.mp.group, ctx.mp.rank
    barrier = (lambda: dist.barrier(group=run_group)) if world > 1 else (lambda: None)

    def agree(mine: list[int]) -> list[int]:
        """The union of every rank's ``mine``."""
        if world == 1:
            return sorted(mine)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=run_group)
        return sorted(set().union(*everyone))

    rows = tuple(sorted(set(rows)))
    timer = DeviceTimer(ctx.device) if ctx.device.type == "cuda" else None
    if timer is not None:
        window_s = 0.0  # the window averages over CPU-quota periods; a GPU's events time what they time
    calibration = m if calibration_layers is None else \
        dataclasses.replace(m, num_hidden_layers=min(m.num_hidden_layers, calibration_layers))
    # Stages at INFO: the CLI shows them on rank 0 (galaxy.cli.output.STAGE_LOGGERS).
    logger.info("profile: whole serial training steps of %d layers (calibration)", calibration.num_hidden_layers)
    before = measure_serial(calibration, max(rows), seq, dtype, ctx.device, reps, window_s)
    pieces = {}
    for n in rows:
        logger.info("profile: each block at %d row(s), every shard size", n)
        pieces[n] = measure_blocks(m, n, seq, ctx.device, dtype, reps, barrier, ffn_unit, window_s, agree, timer)
    logger.info("profile: the optimizer step")
    optimizer = measure_optimizer(ctx.device, min(model_params(m), 2**24), reps, barrier, window_s, timer)
    barrier()
    # timed again after the pieces: a burst of load during one timing is then one of two, not all
    logger.info("profile: the serial training steps again")
    after = measure_serial(calibration, max(rows), seq, dtype, ctx.device, reps, window_s)
    peaks = [p for p in (before[2], after[2]) if p is not None]
    serial = (before[0] + after[0], before[1] + after[1], min(peaks) if peaks else None)
    shallower_peak, shallower_steps = None, []  # the same step with one layer less: the difference is one layer's
    if peaks and calibration.num_hidden_layers > 1:
        shallower = dataclasses.replace(calibration, num_hidden_layers=calibration.num_hidden_layers - 1)
        # its times on a GPU only (a CPU's step times are too noisy for a difference of two)
        timed = measure_serial(shallower, max(rows), seq, dtype, ctx.device, 2 * reps if timer is not None else 1,
                               forwards=False)
        shallower_peak, shallower_steps = timed[2], (timed[0] if timer is not None else [])
    sustained = 1.0
    if timer is not None and sustain_s > 0:
        sustained, steps = measure_sustained(calibration, max(rows), seq, dtype, ctx.device, serial[0], sustain_s)
        logger.info("sustained load: %d serial steps back to back, the last at %.1f ms against %.1f in bursts: "
                    "sustained_scale %.3f", len(steps), statistics.median(steps[-max(3, len(steps) // 5):]) * 1e3,
                    statistics.median(serial[0]) * 1e3, sustained)
    barrier()
    host = socket.gethostname()
    hosts = [host]
    if world > 1:
        hosts = [None] * world
        dist.all_gather_object(hosts, host, group=run_group)
    memory = memory_budget(ctx.device, hosts.count(host), memory_gb)
    groups = {}
    if world > 1:
        sizes = collective_sizes(m, max(rows), seq, world, most_bytes)
        logger.info("profile: each collective by message size, on every group of the %d ranks", world)
        for members, group in probe_groups(run_group, world):
            if rank in members:
                comm = Communicator("probe", members.index(rank), len(members), group)
                groups[members] = measure_group(comm, ctx.device, sizes, max(reps, COLLECTIVE_REPS), timer)
            barrier()
    offload = {"host_link_bytes_per_s": measure_host_link(ctx.device),
               "host_memory_bytes": host_memory_share(hosts.count(host)) if ctx.device.type == "cuda" else None}
    mine = dataclasses.replace(calibrated(RankProfile(rank, host, memory, pieces, optimizer), calibration,
                                          max(rows), seq, dtype, *serial, shallower_peak, shallower_steps),
                               sustained_scale=sustained, **offload)
    everyone = [(mine, groups)]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, (mine, groups), group=run_group)
    if rank != 0:
        return None
    merged = {}
    for _, g in everyone:  # every member holds the same (reduced) fits
        merged.update(g)
    backend = dist.get_backend(run_group) if world > 1 else "none"
    groups = candidate_groups(world)
    return ClusterProfile(world, backend, ctx.device.type, m, rows, seq, dtype, tuple(p for p, _ in everyone),
                          {g: merged[g][0] for g in groups}, {g: merged[g][1] for g in groups})
