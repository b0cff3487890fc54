"""Pipeline stages on ``torch.distributed.pipelining`` (``pipeline_engine: torch``): torch's
``PipelineStage`` over the pp group and its ``ScheduleGPipe`` / ``Schedule1F1B`` run the step, while
every rank inside a stage still runs Galaxy's per-block model parallelism (the mp collectives are
inside the stage's forward and backward, which every mp rank of a stage runs in the same order).

What torch runs is ``StageModule``, one Galaxy stage as a tensor-in, tensor-out module: its positional
input is the previous stage's residual stream (none on the first stage), its keyword inputs are the
micro-batch, which every stage reads (the schedule splits the same keyword batch on every rank); it
returns the stream in the communication dtype (fp32 under bf16 autocast, as ``comm_dtype`` says), or
on the last stage the micro-batch's loss. Shapes are given to torch up front (its static mode: no
shape inference, which would run the model, and its collectives, on made-up inputs); a step whose
micro-batches have another shape builds the stage again.

Galaxy's semantics are kept:

* each micro-batch's loss is weighted by its share of the global batch's loss targets: the schedule's
  loss function gets the micro-batch's index as its "target" and multiplies by ``loss_weights[i]``,
  and torch's own gradient scaling is off (``scale_grads=False``);
* ``before_last_backward`` (the data-parallel sync arming itself) is called right before the backward
  that torch's schedule marks as the last (``last_backward``);
* ``PipelineStepResult`` is the same: the weighted loss sum, this stage's compute time (forward and
  backward of every micro-batch, timed around torch's per-micro-batch calls), the whole step's time,
  the most micro-batches in flight and the order the schedule ran. Bytes sent count on ``ctx.pp``;
  its observers get one record per send and receive torch posts, with bytes and no time (torch waits
  on its transfers itself).

Torch's ``Schedule1F1B`` needs at least one micro-batch per stage; with fewer, no stage can reach
1F1B's steady state and the step runs ``ScheduleGPipe`` (logged once). Forward-only passes
(evaluation, the replay that locates a non-finite value) need the whole model output on the last
stage, not a tensor torch can pass on: they run Galaxy's point-to-point forward (``PipelineRunner``'s).

Interleaved 1F1B needs several stages per rank (virtual stages), which Galaxy's stage layout does not
have: a process builds one ``StageSpec`` (one contiguous range of layers, the embeddings on stage 0,
the head on the last), and its model, checkpoints, tied-embedding group and the planner's cost model
all hold that one range.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from galaxy.core.comm import CommRecord
from galaxy.core.pipeline import ComputeClock, PipelineRunner, PipelineStepResult

logger = logging.getLogger(__name__)


class StageModule(nn.Module):
    """One Galaxy pipeline stage as torch's ``PipelineStage`` runs it: ``forward(*received, **micro_batch)``
    takes the previous stage's stream (nothing on the first stage) and the micro-batch, and returns the
    stream in ``stream_dtype`` or, on the last stage, the loss in ``loss_dtype``."""

    def __init__(self, model: nn.Module, stream_dtype: torch.dtype, loss_dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.stream_dtype, self.loss_dtype = stream_dtype, loss_dtype
        self.autocast: Callable = nullcontext  # set for each step

    def forward(self, *received: torch.Tensor, **micro_batch: torch.Tensor) -> torch.Tensor:
        x = received[0] if received else None
        with self.autocast():
            out = self.model(**micro_batch, hidden_states=x)
        if self.model.stage.is_last:
            return out.loss.to(self.loss_dtype)
        return out.hidden_states.to(self.stream_dtype).contiguous()


class MeasuredStage(PipelineStage):
    """torch's ``PipelineStage`` that also keeps what ``PipelineStepResult`` reports (the order of its
    forwards and backwards, their compute time, the micro-batches in flight), calls the step's
    ``before_last_backward`` before the last backward, and counts what it sends on the pp Communicator."""

    def __init__(self, module: StageModule, index: int, num_stages: int, device: torch.device,
                 input_args: tuple, output_args: torch.Tensor, pp):
        super().__init__(module, index, num_stages, device, input_args=input_args, output_args=output_args,
                         group=pp.group)
        self.pp = pp
        self.begin_step(ComputeClock(device, enabled=False), None)

    def begin_step(self, clock: ComputeClock, before_last_backward: Optional[Callable[[], None]]) -> None:
        self.clock, self.before_last_backward = clock, before_last_backward
        self.order: list[tuple[str, int]] = []
        self.in_flight = self.peak_in_flight = 0

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.order.append(("F", fwd_chunk_id))
        tick = self.clock.start()
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.clock.stop(tick)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self.order.append(("B", bwd_chunk_id))
        if last_backward and self.before_last_backward is not None:
            self.before_last_backward()
        tick = self.clock.start()
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        self.clock.stop(tick)
        self.in_flight -= 1

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._counted(super().get_fwd_recv_ops(fwd_chunk_id), "recv", "fwd")

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._counted(super().get_fwd_send_ops(fwd_chunk_id), "send", "fwd")

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._counted(super().get_bwd_recv_ops(bwd_chunk_id), "recv", "bwd")

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._counted(super().get_bwd_send_ops(bwd_chunk_id), "send", "bwd")

    def _counted(self, ops: list, op: str, phase: str) -> list:
        nbytes = sum(o.tensor.numel() * o.tensor.element_size() for o in ops)
        if op == "send":
            self.pp.bytes_sent += nbytes
        if ops and self.pp.observers:
            record = CommRecord(op, self.pp.name, nbytes, 0.0, phase)
            for observe in self.pp.observers:
                observe(record)
        return ops


class TorchPipelineRunner(PipelineRunner):
    """``PipelineRunner``'s interface, with each training step's schedule run by torch's
    ``ScheduleGPipe`` / ``Schedule1F1B`` over a ``MeasuredStage`` (see the module doc). Shapes,
    dtypes, the stage bookkeeping and ``forward_only`` are ``PipelineRunner``'s."""

    def __init__(self, model: nn.Module, ctx, schedule: str = "1f1b", comm_dtype: Optional[torch.dtype] = None):
        super().__init__(model, ctx, schedule, comm_dtype)
        if self.pp.size == 1:
            raise ValueError("TorchPipelineRunner needs a pipeline (pp > 1); one stage is gradient accumulation, "
                             "which PipelineRunner runs")
        self._built: Optional[tuple] = None  # (activation shape, micro-batches), stage, schedule
        self._weights: Optional[Sequence] = None
        self._grad_scale: Optional[float] = None
        self._losses: list[torch.Tensor] = []
        self._gpipe_logged = False

    def _loss_dtype(self) -> torch.dtype:
        return torch.promote_types(self._dtype(), torch.float32)

    def _weighted_loss(self, loss: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: micro-batch ``index``'s loss times its weight (recorded),
        times the float16 loss scale for backward."""
        if self._weights is not None:
            loss = loss * self._weights[int(index)]
        self._losses.append(loss.detach())
        return loss if self._grad_scale is None else loss * self._grad_scale

    def _pipeline(self, micro_batches: Sequence[dict]) -> tuple[MeasuredStage, object]:
        """The stage and schedule for micro-batches of this shape (built again when it changes)."""
        shape, m = self.activation_shape(micro_batches[0]), len(micro_batches)
        if self._built is not None and self._built[0] == (shape, m):
            return self._built[1], self._built[2]
        stage, p = self.stage, self.stage.num_stages
        stream = torch.empty(shape, dtype=self._dtype(), device="meta", requires_grad=True)
        loss = torch.empty((), dtype=self._loss_dtype(), device="meta", requires_grad=True)
        module = StageModule(self.model, self._dtype(), self._loss_dtype())
        torch_stage = MeasuredStage(module, stage.index, p, self.ctx.device, () if stage.is_first else (stream,),
                                    loss if stage.is_last else stream, self.pp)
        schedule_class = ScheduleGPipe if self.schedule == "gpipe" else Schedule1F1B
        if schedule_class is Schedule1F1B and m < p:
            schedule_class = ScheduleGPipe
            if not self._gpipe_logged:
                logger.warning("pipeline_schedule 1f1b with %d micro-batches on %d stages: torch's Schedule1F1B needs "
                               "at least one per stage, so these steps run ScheduleGPipe (raise num_microbatches to "
                               "%d or more for 1F1B)", m, p, p)
                self._gpipe_logged = True
        schedule = schedule_class(torch_stage, m, loss_fn=self._weighted_loss, scale_grads=False)
        logger.debug("stage %d of %d on torch's %s: %d micro-batches of stream shape %s", stage.index, p,
                     schedule_class.__name__, m, tuple(shape))
        self._built = ((shape, m), torch_stage, schedule)
        return torch_stage, schedule

    def run(self, micro_batches: Sequence[dict], loss_weights: Optional[Sequence] = None,
            autocast: Optional[Callable] = None, before_last_backward: Optional[Callable[[], None]] = None,
            grad_scale: Optional[float] = None) -> PipelineStepResult:
        """As ``PipelineRunner.run``: forward and backward of every micro-batch through torch's schedule;
        gradients accumulate in ``.grad``."""
        m = len(micro_batches)
        torch_stage, schedule = self._pipeline(micro_batches)
        # torch's schedule splits one keyword batch into the micro-batches again (equal rows: the same ones).
        batch = {k: torch.cat([mb[k] for mb in micro_batches]) for k in micro_batches[0]}
        clock = ComputeClock(self.ctx.device)
        torch_stage.submod.autocast = autocast or nullcontext
        torch_stage.begin_step(clock, before_last_backward)
        self._weights, self._grad_scale, self._losses = loss_weights, grad_scale, []
        cuda = self.ctx.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.ctx.device)
        t0 = time.perf_counter()
        try:
            schedule.step(target=torch.arange(m), return_outputs=False, **batch)
            loss = torch.stack(self._losses).sum() if self._losses else None
        finally:
            self._weights, self._grad_scale, self._losses = None, None, []
            torch_stage.submod.autocast = nullcontext
            torch_stage.before_last_backward = None
        if cuda:
            torch.cuda.synchronize(self.ctx.device)
        total = time.perf_counter() - t0
        return PipelineStepResult(loss, clock.seconds(), total, torch_stage.peak_in_flight, list(torch_stage.order))
