"""Pipeline parallelism: stages, micro-batches, and the GPipe and 1F1B schedules over
point-to-point send/recv.

A stage is a model that holds a contiguous range of hidden layers (``StageSpec``): the first
stage also holds the embeddings, the last the head and the loss. Layers keep their global index
as their name (``bert.encoder.layer.5`` stays 5 on whichever stage holds it), so the union of the
stages' state dicts is the serial model's. The stage of a process follows from ``ctx.pp.rank``
and ``ctx.stage_layers`` (None: balanced, larger stages first).

Stages exchange the residual stream in its own layout over the pp group, which joins the same
mp rank of consecutive stages: when the stream is sequence-sharded (CON.sp) each mp rank sends
and receives only its ``seq_split[mp_rank]`` tokens, when it is replicated each sends the whole.
Shapes are not sent: every stage reads the same micro-batch, so each side knows the shape, and
activations travel in the parameters' dtype (``comm_dtype``; fp32 under bf16 autocast).

Schedules (``schedule_actions`` gives the order of one stage, for ``m`` micro-batches on ``p`` stages):

* **GPipe**: all forwards, then all backwards; a stage holds the activations of all ``m``
  micro-batches before its first backward.
* **1F1B** (PipeDream-flush, Megatron's non-interleaved schedule): stage ``s`` runs
  ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one backward, then
  drains; it never holds more than ``p - s`` micro-batches of activations.

Both have the bubble ``(p - 1) / (m + p - 1)``; the runner measures it as the fraction of the
schedule's time a stage spends outside its own forward and backward compute.

This runner is ``pipeline_engine: galaxy``; ``pipeline_engine: torch`` (the default) runs the same
step on torch.distributed.pipelining's schedules (``galaxy.core.pipeline_torch``, a subclass that
keeps this one's stages, shapes and forward-only pass). With one stage the Trainer runs this
runner's plain gradient accumulation, whatever the engine.

Communication follows Megatron's pattern: each exchange is one ``batch_isend_irecv`` whose
requests are all waited for, and in 1F1B's steady state a send and the matching opposite-
direction receive go in one batch (``send_forward_recv_backward``), so NCCL never sees two
blocking operations ordered differently on the two sides of a link.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from galaxy.config import ConfigError, balanced_split
from galaxy.core.edges import LAYOUTS
from galaxy.core.comm import CommRecord, Communicator
from galaxy.core.transitions import Layout

logger = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b")


# ----------------------------------------------------------------------------- stages


@dataclass(frozen=True)
class StageSpec:
    """Stage ``index`` of ``num_stages`` holds hidden layers ``first_layer .. first_layer + num_layers - 1``."""

    index: int
    num_stages: int
    first_layer: int
    num_layers: int

    @classmethod
    def whole(cls, num_layers: int) -> "StageSpec":
        return cls(0, 1, 0, num_layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def is_whole(self) -> bool:
        return self.num_stages == 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)


def stage_of(num_hidden_layers: int, ctx) -> StageSpec:
    """This process's stage: ``ctx.pp.rank`` of ``ctx.pp.size``, layers from ``ctx.stage_layers``."""
    pp = ctx.pp
    if pp.size == 1:
        return StageSpec.whole(num_hidden_layers)
    counts = ctx.stage_layers
    if counts is None:
        if pp.size > num_hidden_layers:
            raise ConfigError(f"config key 'pp_size' ({pp.size}) exceeds num_hidden_layers ({num_hidden_layers}); "
                              "every pipeline stage needs at least one layer")
        counts = balanced_split(num_hidden_layers, pp.size)
    if len(counts) != pp.size or sum(counts) != num_hidden_layers or min(counts) <= 0:
        raise ConfigError(f"config key 'stage_num_hidden_layers_list' {list(counts)} must hold {pp.size} positive "
                          f"layer counts (one per stage) that sum to num_hidden_layers ({num_hidden_layers})")
    return StageSpec(pp.rank, pp.size, sum(counts[: pp.rank]), counts[pp.rank])


class StageLayers(nn.ModuleList):
    """The layers of a stage that does not start at layer 0, each named and indexed by its global
    index, so ``encoder.layer.5`` is ``encoder.layer[5]`` on any stage that holds it."""

    def __init__(self, layers: Iterable[nn.Module], first: int):
        super().__init__()
        self.first = first
        for i, layer in enumerate(layers):
            self.add_module(str(first + i), layer)

    def _key(self, idx: int) -> str:
        if idx < 0:
            idx += self.first + len(self)
        if not self.first <= idx < self.first + len(self):
            raise IndexError(f"this stage holds layers {self.first}..{self.first + len(self) - 1}, not {idx}")
        return str(idx)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return self._modules[self._key(idx)]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        setattr(self, self._key(idx), module)

    def __delitem__(self, idx) -> None:
        raise TypeError("the layers of a pipeline stage cannot be removed")


_LAYER_STACK_ATTR = "_galaxy_layer_stack"


def layer_stack(layers: Iterable[nn.Module], first: int) -> nn.ModuleList:
    """A plain ``nn.ModuleList`` for a stack starting at layer 0 (the whole model, or stage 0),
    marked as a model's transformer layers (``layer_stacks``)."""
    stack = nn.ModuleList(layers) if first == 0 else StageLayers(layers, first)
    setattr(stack, _LAYER_STACK_ATTR, True)
    return stack


def layer_stacks(model: nn.Module) -> list[nn.ModuleList]:
    """The transformer layer stacks of ``model`` (made by ``layer_stack``), in module order."""
    return [m for m in model.modules() if getattr(m, _LAYER_STACK_ATTR, False)]


def gather_stage_states(state: dict, ctx) -> dict:
    """The union of every stage's (mp-gathered, CPU) state dict, on every rank of the pipeline: a
    collective over ``ctx.pp``. A weight two stages hold (a tied embedding) appears once."""
    if ctx.pp.size == 1:
        return state
    parts = [None] * ctx.pp.size
    dist.all_gather_object(parts, state, group=ctx.pp.group)
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


# ----------------------------------------------------------------------------- schedules


def schedule_actions(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The order of forward ('F', i) and backward ('B', i) steps of one stage."""
    m = num_microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ConfigError(f"config key 'pipeline_schedule': '{schedule}' is not one of {', '.join(SCHEDULES)}")
    warmup = min(num_stages - stage - 1, m)
    actions = [("F", i) for i in range(warmup)]
    for k in range(m - warmup):
        actions += [("F", warmup + k), ("B", k)]
    actions += [("B", i) for i in range(m - warmup, m)]
    return actions


def analytic_bubble(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a GPipe/1F1B step with equal stages: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


# ----------------------------------------------------------------------------- the runner


@dataclass
class PipelineStepResult:
    loss: Optional[torch.Tensor]  # the sum of the weighted micro-batch losses, on the last stage
    busy_s: float  # this stage's forward + backward compute
    total_s: float  # the whole schedule, communication and waiting included
    peak_in_flight: int  # most micro-batches whose activations this stage held at once
    order: list[tuple[str, int]] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        return max(0.0, 1.0 - self.busy_s / self.total_s) if self.total_s > 0 else 0.0


class ComputeClock:
    """Compute time of one stage: CUDA events on the device (host timers would see only the
    launch of asynchronous kernels), ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.spans: list = []
        self.host_s = 0.0

    def start(self):
        if not self.enabled:
            return None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, token) -> None:
        if not self.enabled:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((token, end))
        else:
            self.host_s += time.perf_counter() - token

    def seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.spans) / 1e3
        return self.host_s


class PipelineRunner:
    """Runs one step's micro-batches through this stage with the configured schedule.

    ``model(**micro_batch, hidden_states=x)`` is this stage: on the first stage ``x`` is None and
    the model embeds ``input_ids``; on the last it returns ``.loss``, elsewhere ``.hidden_states``
    in the stream's layout. With one stage this is plain gradient accumulation.
    """

    def __init__(self, model: nn.Module, ctx, schedule: str = "1f1b", comm_dtype: Optional[torch.dtype] = None):
        if schedule not in SCHEDULES:
            raise ConfigError(f"config key 'pipeline_schedule': '{schedule}' is not one of {', '.join(SCHEDULES)}")
        self.model, self.ctx, self.schedule = model, ctx, schedule
        self.pp: Communicator = ctx.pp
        self.stage: StageSpec = getattr(model, "stage", StageSpec.whole(0))
        if self.stage.num_stages != self.pp.size:
            raise ValueError(f"the model is stage {self.stage.index} of {self.stage.num_stages} but the pp group has "
                             f"{self.pp.size} ranks; build the model with this context")
        self.comm_dtype = comm_dtype
        group = self.pp.group
        to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.prev_rank = to_global(self.pp.rank - 1) if not self.stage.is_first else None
        self.next_rank = to_global(self.pp.rank + 1) if not self.stage.is_last else None
        if self.pp.size > 1:
            # A collective first, so every rank of the pp group has set up its communicator before the
            # first (not group-wide) batch_isend_irecv, as torch asks of NCCL.
            self.pp.all_reduce(torch.zeros(1, device=ctx.device))

    # -- shapes

    def activation_shape(self, micro_batch: dict) -> tuple[int, ...]:
        """Shape of the stream tensor between stages for ``micro_batch`` on this mp rank."""
        rows, seq = micro_batch["input_ids"].shape[:2]
        plan, mp = self.model.plan, self.ctx.mp
        if LAYOUTS[plan.con][1] == Layout.S and mp.size > 1:
            seq = plan.seq_split[mp.rank]
        return rows, seq, self.model.config.hidden_size

    def _dtype(self) -> torch.dtype:
        return self.comm_dtype or next(self.model.parameters()).dtype

    # -- point to point

    def _exchange(self, send_next=None, send_prev=None, recv_prev=None, recv_next=None, phase="fwd"):
        """One batch of sends/receives to the neighbour stages, all waited for. ``recv_*`` are shapes."""
        ops, out_prev, out_next = [], None, None
        dtype, device = self._dtype(), self.ctx.device
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev, self.prev_rank, self.pp.group))
        if recv_prev is not None:
            out_prev = torch.empty(recv_prev, dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, out_prev, self.prev_rank, self.pp.group))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next, self.next_rank, self.pp.group))
        if recv_next is not None:
            out_next = torch.empty(recv_next, dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, out_next, self.next_rank, self.pp.group))
        if not ops:
            return None, None
        sent = [t for t in (send_next, send_prev) if t is not None]
        received = [t for t in (out_prev, out_next) if t is not None]
        self.pp.bytes_sent += sum(t.numel() * t.element_size() for t in sent)
        start = time.perf_counter() if self.pp.observers else 0.0
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        if device.type == "cuda":
            # As Megatron's batch_p2p_sync: the buffers must not be reused before the transfer is done.
            torch.cuda.synchronize(device)
        if self.pp.observers:
            op = "send_recv" if sent and received else ("send" if sent else "recv")
            nbytes = sum(t.numel() * t.element_size() for t in sent + received)
            record = CommRecord(op, self.pp.name, nbytes, time.perf_counter() - start, phase)
            for observe in self.pp.observers:
                observe(record)
        return out_prev, out_next

    def _to_send(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.detach().to(self._dtype()).contiguous()

    # -- the step

    def run(self, micro_batches: Sequence[dict], loss_weights: Optional[Sequence] = None,
            autocast: Optional[Callable] = None, before_last_backward: Optional[Callable[[], None]] = None,
            grad_scale: Optional[float] = None) -> PipelineStepResult:
        """Forward and backward of every micro-batch; gradients accumulate in ``.grad``.

        ``loss_weights[i]`` scales micro-batch i's loss (its share of the global batch), so the
        accumulated gradient is that of the global-batch loss; ``before_last_backward`` is called
        once, just before this stage's last backward (data-parallel sync arms itself there);
        ``grad_scale`` multiplies the loss for backward only (float16 loss scaling).
        """
        m = len(micro_batches)
        stage, model = self.stage, self.model
        actions = schedule_actions(self.schedule, stage.index, stage.num_stages, m)
        last_b = max(k for k, (kind, _) in enumerate(actions) if kind == "B")
        shapes = [self.activation_shape(mb) for mb in micro_batches] if self.pp.size > 1 else [None] * m
        stash: dict[int, tuple] = {}
        # Bubbles exist only between stages: one stage measures nothing, so it never waits for the device.
        measure = self.pp.size > 1
        clock = ComputeClock(self.ctx.device, enabled=measure)
        losses: list[torch.Tensor] = []
        peak = 0
        amp = autocast or nullcontext
        if measure and self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        t0 = time.perf_counter()

        def forward(i: int, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            nonlocal peak
            if x is not None:
                x.requires_grad_()
            tick = clock.start()
            with amp():
                out = model(**micro_batches[i], hidden_states=x)
            if stage.is_last:
                loss = out.loss if loss_weights is None else out.loss * loss_weights[i]
                losses.append(loss.detach())
                stash[i] = (x, loss)
                y = None
            else:
                stash[i] = (x, out.hidden_states)
                y = self._to_send(out.hidden_states)
            clock.stop(tick)
            peak = max(peak, len(stash))
            return y

        def backward(i: int, grad: Optional[torch.Tensor], is_last: bool) -> Optional[torch.Tensor]:
            x, y = stash.pop(i)
            if is_last and before_last_backward is not None:
                before_last_backward()
            tick = clock.start()
            if stage.is_last:
                (y if grad_scale is None else y * grad_scale).backward()
            else:
                y.backward(grad.to(y.dtype))
            gx = self._to_send(x.grad) if x is not None else None
            clock.stop(tick)
            return gx

        order = []
        if self.pp.size == 1 or self.schedule == "gpipe":
            for k, (kind, i) in enumerate(actions):
                order.append((kind, i))
                if kind == "F":
                    x, _ = self._exchange(recv_prev=shapes[i] if not stage.is_first else None)
                    y = forward(i, x)
                    self._exchange(send_next=y)
                else:
                    _, g = self._exchange(recv_next=shapes[i] if not stage.is_last else None, phase="bwd")
                    gx = backward(i, g, k == last_b)
                    self._exchange(send_prev=gx, phase="bwd")
        else:
            self._one_f_one_b(actions, shapes, forward, backward, last_b, order)
        loss = torch.stack(losses).sum() if losses else None
        if measure and self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        total = time.perf_counter() - t0
        return PipelineStepResult(loss, clock.seconds() if measure else total, total, peak, order)

    @torch.no_grad()
    def forward_only(self, micro_batches: Sequence[dict], autocast: Optional[Callable] = None) -> list:
        """Every micro-batch's forward through the pipeline, no backward (evaluation, replays):
        the last stage returns the model outputs, the other stages an empty list."""
        stage, amp = self.stage, autocast or nullcontext
        outputs = []
        for mb in micro_batches:
            x, _ = self._exchange(recv_prev=None if stage.is_first else self.activation_shape(mb))
            with amp():
                out = self.model(**mb, hidden_states=x)
            if stage.is_last:
                outputs.append(out)
            else:
                self._exchange(send_next=self._to_send(out.hidden_states))
        return outputs

    def _one_f_one_b(self, actions, shapes, forward, backward, last_b, order) -> None:
        """Megatron's non-interleaved 1F1B, with the steady state's paired exchanges."""
        stage = self.stage
        m = len(shapes)
        warmup = min(stage.num_stages - stage.index - 1, m)
        remaining = m - warmup
        first, last = stage.is_first, stage.is_last
        recv_fwd = lambda i: None if first else shapes[i]  # noqa: E731
        recv_bwd = lambda i: None if last else shapes[i]  # noqa: E731
        k = 0  # index into actions, for the last-backward marker
        for i in range(warmup):
            x, _ = self._exchange(recv_prev=recv_fwd(i))
            order.append(("F", i))
            self._exchange(send_next=forward(i, x))
            k += 1
        x = self._exchange(recv_prev=recv_fwd(warmup))[0] if remaining > 0 else None
        for j in range(remaining):
            i = warmup + j
            order.append(("F", i))
            y = forward(i, x)
            k += 1
            _, g = self._exchange(send_next=y, recv_next=recv_bwd(j))
            order.append(("B", j))
            gx = backward(j, g, k == last_b)
            k += 1
            if j == remaining - 1:
                x = None
                self._exchange(send_prev=gx, phase="bwd")
            else:
                x, _ = self._exchange(send_prev=gx, recv_prev=recv_fwd(i + 1), phase="bwd")
        for j in range(remaining, m):
            _, g = self._exchange(recv_next=recv_bwd(j), phase="bwd")
            order.append(("B", j))
            gx = backward(j, g, k == last_b)
            k += 1
            self._exchange(send_prev=gx, phase="bwd")
        assert order == actions, (order, actions)
