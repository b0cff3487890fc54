"""The one training loop every CLI shares: optimizer, schedule, gradient sync, metrics, progress.

One step (``Trainer``): read this dp rank's shard of the global batch, split it into micro-batches,
run them through this pipeline stage (``TorchPipelineRunner`` on torch's schedules, or Galaxy's own
``PipelineRunner``, as ``pipeline_engine`` says; with one stage, gradient accumulation),
then make the gradients the serial model's: the dp sum and the mp rules (``GradReducer``: bucketed,
overlapping the last backward; ``mp_grad_reduce: sharded`` keeps the PARTIAL weights' optimizer
state in pieces over mp), the tied-embedding sum between first and last stage; clip by the global
norm (every parameter once across mp, pp and dp) and step the optimizer (AdamW, or ZeRO-1 over the
dp group). Each micro-batch loss is weighted by its share of the global batch's loss
targets, so the gradients and the reported loss are those of the serial model on the global batch.
``dp_engine: fsdp2`` and ``mp_grad_reduce: fsdp`` shard the model with torch's ``fully_shard`` first
(``galaxy.core.fsdp``); the optimizer then steps the sharded (DTensor) parameters.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.compile import step_begins
from galaxy.core.context import ParallelContext
from galaxy.core.grad_sync import GradReducer, check_replicated, clip_grads_with_norm_, global_grad_norm, \
    sync_pipeline_ties, takes_weight_decay
from galaxy.core.pipeline import PipelineRunner, PipelineStepResult, StageSpec, analytic_bubble
from galaxy.models import family
from galaxy.train.evaluate import evaluate
from galaxy.train.interrupts import Interrupts, TrainingInterrupted
from galaxy.train.metrics import PeakFlops, SteadyState, peak_flops_per_device
from galaxy.train.microbatch import split_rows, without_needless_mask
from galaxy.train.options import Checkpointing, Reporting
from galaxy.train.outputs import StepOutputs
from galaxy.train.precision import LossScaler, first_nonfinite_module, first_nonfinite_parameter

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainResult:
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0  # tokens_per_s over the world size (galaxy.train.metrics)
    mfu: Optional[float] = None  # model FLOPs utilisation; None without a known peak (then ``peak`` says why)
    mfu_causal: Optional[float] = None  # the same with causal attention's FLOPs (galaxy.train.metrics)
    timed_steps: int = 0  # the steady-state steps the rates are over (galaxy.train.metrics.SteadyState)
    peak: Optional[PeakFlops] = None
    step_time_s: float = 0.0
    peak_mem_mb: float = 0.0
    comm_bytes_per_step: float = 0.0
    # Pipeline (pp > 1): measured idle fraction of each stage's schedule time, and (p-1)/(m+p-1).
    bubble_measured: Optional[list[float]] = None
    bubble_analytic: Optional[float] = None
    # --profile_step K: every number of step K (galaxy.profiler.ParallelProfiler.to_json) and its report.
    profile: Optional[dict] = None
    profile_report: Optional[str] = None
    skipped_steps: int = 0  # float16 overflows and (skip_nonfinite) non-finite steps: no update was made
    eval: Optional[dict] = None  # the last evaluation (galaxy.train.evaluate), with eval_every

    def summary(self) -> dict:
        fields = {
            "steps": self.steps,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
            "mfu": None if self.mfu is None else round(self.mfu, 4),
            "mfu_causal": None if self.mfu_causal is None else round(self.mfu_causal, 4),
            "timed_steps": self.timed_steps,
        }
        if self.mfu is None and self.peak is not None:
            fields["mfu_note"] = self.peak.source  # why there is none
        fields.update({
            "peak_tflops": self.peak.tflops if self.peak else None,
            "step_time_s": round(self.step_time_s, 4),
            "peak_mem_mb": round(self.peak_mem_mb, 1),
            "comm_mb_per_step": round(self.comm_bytes_per_step / 2**20, 3),
        })
        if self.skipped_steps:
            fields["skipped_steps"] = self.skipped_steps
        if self.eval:
            fields.update({k: round(v, 4) if isinstance(v, float) else v for k, v in self.eval.items()})
        if self.bubble_measured is not None:
            fields["bubble_measured_per_stage"] = [round(b, 4) for b in self.bubble_measured]
            fields["bubble_measured"] = round(sum(self.bubble_measured) / len(self.bubble_measured), 4)
            fields["bubble_analytic"] = round(self.bubble_analytic, 4)
        return fields


def build_optimizer(model: nn.Module, cfg: GalaxyConfig, ctx: Optional[ParallelContext] = None,
                    params: Optional[list[nn.Parameter]] = None) -> torch.optim.Optimizer:
    """AdamW (``optimizer: adamw``) or SGD with momentum (``optimizer: sgd``), torch's fused kernels on GPU
    (``optimizer_implementation``), over
    ``params`` (default: the model's trainable parameters); no weight decay on biases and norm
    scales (``takes_weight_decay``), as in HF and Megatron. With ``dp_engine: zero1`` and a dp group,
    ``ZeroRedundancyOptimizer`` shards the optimizer states over the dp group (each rank steps its
    share of the parameters and broadcasts them)."""
    t = cfg.train
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    # One group per (decay, DTensor or not): the fused and foreach kernels take a group's tensors together,
    # and cannot mix FSDP's DTensor shards with plain tensors (torch 2.11 on CUDA: "got mixed torch.Tensor
    # and DTensor").
    groups = [{"params": [p for p in params if takes_weight_decay(p) == decays and isinstance(p, DTensor) == sharded],
               "weight_decay": t.weight_decay if decays else 0.0}
              for decays in (True, False) for sharded in (False, True)]
    groups = [g for g in groups if g["params"]]
    impl = t.optimizer_implementation
    if impl == "auto":
        impl = "fused" if params and all(p.is_cuda for p in params) else None
    kernels = {impl: True} if impl else {}
    if t.optimizer == "sgd":
        optimizer_class, kwargs = torch.optim.SGD, dict(lr=t.lr, momentum=t.sgd_momentum, **kernels)
    else:
        optimizer_class, kwargs = torch.optim.AdamW, dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                                          **kernels)
    if ctx is not None and cfg.parallel.dp_engine == "zero1" and ctx.dp.size > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, process_group=ctx.dp.group,
                                       **kwargs)
    return optimizer_class(groups, **kwargs)


def lr_lambda(cfg: GalaxyConfig) -> Callable[[int], float]:
    t = cfg.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if t.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress

    return factor


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux: the process's resident peak, the closest CPU analogue.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def autocast_context(cfg: GalaxyConfig, device: torch.device):
    """bfloat16 / float16 compute over fp32 master weights (the parameters stay fp32)."""
    dtype = cfg.train.dtype
    if dtype in ("float32", "float64"):
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def reduce_dtype(cfg: GalaxyConfig) -> Optional[torch.dtype]:
    """The dtype gradient all-reduces travel in: None keeps the master gradients' own (fp32, or fp64)."""
    name = cfg.train.grad_reduce_dtype
    return None if name in ("float32", "float64") else DTYPES[name]


class NonFiniteError(FloatingPointError):
    """A step's loss or gradient is not finite (and ``skip_nonfinite`` is off)."""


class Readout:
    """Device scalars on their way to the host: the copy is queued behind the work that makes them, and
    ``values`` waits for that copy alone, not for work queued after it (the next step's)."""

    def __init__(self, values: torch.Tensor):
        self.event = None
        if values.is_cuda:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def values(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class StepOutcome:
    grad_norm: torch.Tensor  # global, before clipping (every shard once)
    skipped: Optional[str] = None  # "overflow" (float16 loss scale lowered) or "nonfinite" (skip_nonfinite)
    loss_scale: Optional[float] = None  # float16: the scale this step's backward used
    # deferred (Trainer.settle): [loss, gradient norm, loss finite, gradients finite] on their way to the host
    readout: Optional[Readout] = None
    # ahead (optimizer_step(ahead=True)): the step's gradients are gone (the next step's backward fills them);
    # its batch, for replaying it should the step turn out non-finite
    replay_batch: Optional[dict] = None
    grad_norm_value: Optional[float] = None  # read by settle


@dataclass
class QueuedStep:
    """A step whose work is queued on the device: what ``train`` reads and records when it ends."""
    step: int  # 1-based
    loss: torch.Tensor
    outcome: StepOutcome
    batch: dict
    start: float  # perf_counter when it began
    comm_bytes: int
    bubble: float


def _accepts_shard(batch_at: Callable) -> bool:
    try:
        return "shard" in inspect.signature(batch_at).parameters
    except (TypeError, ValueError):
        return False


class Trainer:
    """One optimizer step at a time on this rank's stage, dp shard and mp shard (see module doc)."""

    sharding = None  # galaxy.core.fsdp.Sharding: what FSDP sharded (dp_engine fsdp2, mp_grad_reduce fsdp)
    norm_dp = None  # the dp group when FSDP shards over it (the norm sums over it)

    def __init__(self, model: nn.Module, cfg: GalaxyConfig, ctx: ParallelContext):
        t, par = cfg.train, cfg.parallel
        self.model, self.cfg, self.ctx = model, cfg, ctx
        if t.dtype == "float64":
            model.double()
        check_replicated(model, ctx.mp)
        self.stage: StageSpec = getattr(model, "stage", None) or StageSpec.whole(0)
        if par.dp_engine == "deepspeed":
            raise ConfigError("config key 'dp_engine' is 'deepspeed': build the trainer with make_trainer()")
        low = DTYPES[t.dtype] if t.dtype in ("bfloat16", "float16") else None  # autocast's compute dtype
        if t.float8_training != "none":  # before FSDP, which gathers float8-cast weights with float8_fsdp_all_gather
            from galaxy.core.float8 import enable_float8_training

            enable_float8_training(model, t.float8_training, t.float8_fsdp_all_gather)
        if par.dp_engine == "fsdp2" or par.mp_grad_reduce == "fsdp":
            from galaxy.core.fsdp import shard_model

            reshard = {"always": True, "never": False}.get(par.reshard_after_forward, ctx.pp.size == 1)
            self.sharding = shard_model(model, ctx, over_dp=par.dp_engine == "fsdp2",
                                        replicated_over_mp=par.mp_grad_reduce == "fsdp", reshard_after_forward=reshard,
                                        param_dtype=low, reduce_dtype=reduce_dtype(cfg) or (low and torch.float32),
                                        float8_all_gather=t.float8_fsdp_all_gather)
        # With FSDP over dp, the norm sums the squares of the dp shards over dp.
        self.norm_dp = ctx.dp if self.sharding is not None and self.sharding.over_dp else None
        trainable = [p for p in model.parameters() if p.requires_grad]
        # FSDP-sharded weights are left out of the dp sums they had (``fsdp_axes``); vectors FSDP left whole are in.
        self.grad_sync = GradReducer(trainable, ctx.mp, ctx.dp, par.mp_grad_reduce, par.dp_bucket_mb,
                                     reduce_dtype(cfg), mp_grad=ctx.mp_grad, compute_dtype=low)
        # What the optimizer steps, clips and unscales: ``sharded`` weights are replaced by this rank's pieces.
        self.params = self.grad_sync.optimizer_params(trainable)
        self.scaler = LossScaler(t) if t.dtype == "float16" else None
        self.optimizer = build_optimizer(model, cfg, ctx, self.params)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        # A base stored in bf16/fp16 (galaxy.peft frozen_dtype) makes that the stream's dtype on every stage.
        frozen = getattr(getattr(model, "peft_config", None), "frozen_dtype", None)
        # A pipeline runs on torch's schedules (pipeline_engine torch) or Galaxy's; one stage is accumulation.
        runner_class = PipelineRunner
        if par.pipeline_engine == "torch" and ctx.pp.size > 1:
            # imported here: torch.distributed.pipelining imports torch._dynamo (~1 s of CPU per process)
            from galaxy.core.pipeline_torch import TorchPipelineRunner as runner_class
        self.runner = runner_class(model, ctx, par.pipeline_schedule,
                                   comm_dtype=getattr(torch, frozen) if frozen else None)
        self.num_microbatches = par.num_microbatches
        self.last_step: Optional[PipelineStepResult] = None
        self._last_micro: list[dict] = []  # the step's micro-batches, replayed to locate a non-finite value
        self._last_batch: dict = {}  # and its batch, kept by a step that goes ahead (optimizer_step)
        self._autocast: Optional[Callable] = None

    # -- data

    @property
    def causal(self) -> bool:
        """Whether the model is a causal LM (where right padding's mask may be left out, ``read_batch``)."""
        return family(self.cfg.model.model_type).causal

    def read_batch(self, batch_at: Callable, step: int) -> dict:
        """This dp rank's rows of the step's global batch, on CPU, without an attention mask the loss does not
        need (``without_needless_mask``): ``batch_at(step, shard=...)`` when the batcher takes a shard (only
        those rows are built), else a slice of the global batch."""
        dp = self.ctx.dp
        if dp.size == 1:
            batch = batch_at(step)
        elif _accepts_shard(batch_at):
            batch = batch_at(step, shard=(dp.rank, dp.size))
        else:
            batch = batch_at(step)
            rows = next(iter(batch.values())).shape[0]
            if rows % dp.size:
                raise ConfigError(f"config key 'global_batch_size' ({rows}) is not divisible into dp_size="
                                  f"{dp.size} data-parallel shards")
            per = rows // dp.size
            batch = {k: v[dp.rank * per:(dp.rank + 1) * per] for k, v in batch.items()}
        return without_needless_mask(batch, self.causal)

    def loss_weights(self, micro_batches: list[dict]) -> Optional[list[float]]:
        """Each micro-batch's share of the global batch's loss targets (None: a single whole batch)."""
        ctx = self.ctx
        if len(micro_batches) == 1 and ctx.dp.size == 1:
            return None
        count = getattr(self.model, "num_loss_targets", None)
        if count is None or "labels" not in micro_batches[0]:
            counts = [float(next(iter(mb.values())).shape[0]) for mb in micro_batches]
        else:
            counts = [float(count(mb["labels"])) for mb in micro_batches]
        total = sum(counts)
        if ctx.dp.size > 1:
            total = ctx.dp.all_reduce(torch.tensor(total, dtype=torch.float64, device=ctx.device)).item()
        # A micro-batch without targets has a zero loss (its sum over nothing, divided by 1).
        return [max(c, 1.0) / max(total, 1.0) for c in counts]

    # -- one step

    def forward_backward(self, batch: dict, autocast: Optional[Callable] = None) -> torch.Tensor:
        """Forward and backward of this rank's batch; leaves the serial model's gradients in
        ``.grad`` and returns the global-batch loss (the same value on every rank, a 0-d tensor)."""
        ctx = self.ctx
        if self.cfg.model.compile:
            step_begins(self.cfg.model)
        micro = split_rows(batch, self.num_microbatches)
        weights = self.loss_weights(micro) if self.stage.is_last else None
        micro = [{k: v.to(ctx.device, non_blocking=True) for k, v in mb.items()} for mb in micro]
        self._last_batch, self._last_micro, self._autocast = batch, micro, autocast
        # fsdp_grad_sync last_micro_batch: FSDP reduce-scatters in the last backward only
        once = self.sharding is not None and self.cfg.parallel.fsdp_grad_sync == "last_micro_batch" and len(micro) > 1
        if once:
            self.sharding.sync_gradients(False)

        def arm():
            if once:
                self.sharding.sync_gradients(True)
            self.grad_sync.arm()
        result = self.runner.run(micro, weights, autocast=autocast, before_last_backward=arm,
                                 grad_scale=self.scaler.scale if self.scaler else None)
        self.grad_sync.finish()
        if self.sharding is not None:
            self.sharding.count_traffic(len(micro), 1 if once else None)
        sync_pipeline_ties(self.params, ctx.pp_ends)
        self.last_step = result
        return self.report_loss(result.loss)

    def report_loss(self, loss: Optional[torch.Tensor]) -> torch.Tensor:
        """The global-batch loss: summed over dp on the last stage, then sent from the last stage
        to the others (global rank 0 among them) by a broadcast over the pp group."""
        ctx = self.ctx
        if loss is not None:
            loss = loss.detach().to(torch.float64)
            if ctx.dp.size > 1:
                loss = ctx.dp.all_reduce(loss)
        if ctx.pp.size > 1:
            if loss is None:
                loss = torch.zeros((), dtype=torch.float64, device=ctx.device)
            loss = ctx.pp.broadcast(loss, src=ctx.pp.size - 1)
        return loss.detach()

    def skips_on_device(self) -> bool:
        """Whether a non-finite step's update can be skipped by the optimizer's own kernels (torch's fused AdamW
        and SGD take a ``found_inf`` tensor, as ``GradScaler`` gives them), so that the host need not wait for the
        backward to decide: not under float16's loss scaler, ZeRO or FSDP's sharded parameters."""
        return (self.scaler is None and self.sharding is None and bool(self.optimizer.defaults.get("fused"))
                and getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def optimizer_step(self, loss: torch.Tensor, step: int, defer: bool = False, ahead: bool = False) -> StepOutcome:
        """Unscale (float16), take the global gradient norm, then either clip, step and advance the
        schedule, or skip the update: a float16 overflow lowers the loss scale; a non-finite loss or
        gradient stops the run naming where it came from (``skip_nonfinite``: skips the step).
        Every rank decides alike: the loss and the norm are the same on every rank.
        ``defer`` (where ``skips_on_device``): no device sync here; the optimizer skips a non-finite update
        on the device and ``settle`` does the rest once the step's values reach the host. ``ahead`` (with
        ``defer``): the gradients are released now, so that the next step's forward and backward can be
        queued before this step is settled (its settle must come before the next ``optimizer_step``)."""
        t = self.cfg.train
        scale = self.scaler.scale if self.scaler else None
        if self.scaler is not None:
            self.scaler.unscale_(self.params)
        norm = global_grad_norm(self.params, self.ctx.mp, self.ctx.pp, self.norm_dp)
        finite = torch.stack([torch.isfinite(loss), torch.isfinite(norm)])
        outcome = StepOutcome(norm, loss_scale=scale)
        if defer and self.skips_on_device():
            ok = finite.all()
            if t.grad_clip > 0:  # a non-finite norm would scale the gradients settle's diagnosis reads
                clip_grads_with_norm_(self.params, t.grad_clip, torch.where(ok, norm.float(), 0.0))
            self.optimizer.found_inf = (~ok).float()  # the fused kernels leave every state as it was where set
            self.optimizer.step()
            self.optimizer.found_inf = None  # read when the step launched; a later synchronous step has none
            self.grad_sync.gather_weights()
            outcome.readout = Readout(torch.cat([torch.stack([loss.double(), norm.double()]), finite.double()]))
            if ahead:
                outcome.replay_batch = self._last_batch
                self.optimizer.zero_grad(set_to_none=True)
            return outcome
        loss_ok, grads_ok = finite.tolist()  # one device sync
        if loss_ok and not grads_ok and self.scaler is not None:
            outcome.skipped = "overflow"
            self.scaler.update(overflow=True)
            logger.info("step %d: gradients overflowed at loss scale %g; skipped, scale now %g", step, scale,
                        self.scaler.scale)
        elif not (loss_ok and grads_ok):
            self.skip_nonfinite(outcome, loss, step, loss_ok)
        else:
            if t.grad_clip > 0:
                clip_grads_with_norm_(self.params, t.grad_clip, norm.float())
            self.optimizer.step()
            self.count_zero_broadcasts()
            self.grad_sync.gather_weights()
            self.schedule.step()
            if self.scaler is not None:
                self.scaler.update(overflow=False)
        self.optimizer.zero_grad(set_to_none=True)
        return outcome

    def settle(self, outcome: StepOutcome, loss: torch.Tensor, step: int) -> float:
        """The step's loss on the host; for a deferred ``optimizer_step`` (waiting for its values alone), the
        host's half: advance the schedule after an update, or name the non-finite value as the synchronous step
        does (the update was skipped on the device)."""
        if outcome.readout is None:
            return loss.item()
        value, outcome.grad_norm_value, loss_ok, grads_ok = outcome.readout.values()
        outcome.readout = None
        if loss_ok and grads_ok:
            self.schedule.step()
        else:
            self.skip_nonfinite(outcome, loss, step, loss_ok)
        if outcome.replay_batch is None:
            self.optimizer.zero_grad(set_to_none=True)
        outcome.replay_batch = None
        return value

    def skip_nonfinite(self, outcome: StepOutcome, loss: torch.Tensor, step: int, loss_ok: bool) -> None:
        """A step whose loss or gradient is not finite (no update made): stop naming where it came from, or
        under ``skip_nonfinite`` mark it skipped."""
        if outcome.replay_batch is not None:  # gone ahead: the next step's gradients are in .grad
            problem = self.replayed(outcome.replay_batch, lambda: self.locate_nonfinite(loss, step, loss_ok))
        else:
            problem = self.locate_nonfinite(loss, step, loss_ok)
        if not self.cfg.train.skip_nonfinite:
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"{problem}; lower the learning rate or check the data, or set "
                                 "skip_nonfinite: true to skip such steps")
        outcome.skipped = "nonfinite"
        logger.warning("%s; step skipped (skip_nonfinite)", problem)

    def replayed(self, batch: dict, locate: Callable[[], str]) -> str:
        """``locate()`` over a step that went ahead (``optimizer_step(ahead=True)``): its forward and backward
        replayed without dropout (the parameters are the step's own: its update was skipped), the next step's
        gradients, last step and batch put back afterwards."""
        held = [(p, p.grad) for p in self.params]
        last = self.last_step, self._last_batch, self._last_micro
        for p in self.params:
            p.grad = None
        self.model.eval()
        try:
            self.forward_backward(batch, self._autocast)
            return locate()
        finally:
            self.model.train()
            for p, grad in held:
                p.grad = grad
            self.last_step, self._last_batch, self._last_micro = last

    def locate_nonfinite(self, loss: torch.Tensor, step: int, loss_ok: bool) -> str:
        """Where a non-finite value came from, as one line: a parameter that is itself non-finite,
        else (non-finite loss) the first module whose output is non-finite when the step's batch is
        replayed without dropout through the same ranks, else the first non-finite gradient. Every
        rank of the step's mp and pp groups takes the same path (the replay runs their collectives),
        and what one rank found is shared with the others."""
        ctx, model = self.ctx, self.model
        module = None
        if not loss_ok:
            model.eval()
            try:
                module = first_nonfinite_module(model, lambda: self.runner.forward_only(self._last_micro,
                                                                                         self._autocast))
            finally:
                model.train()
        param, grad = first_nonfinite_parameter(model, grads=False), first_nonfinite_parameter(model, grads=True)
        # (priority, text): a bad parameter explains the most, a bad gradient the least.
        where = ((0, f"parameter '{param}' is itself non-finite") if param else
                 (1, f"the first non-finite output is from module '{module}'") if module else
                 (2, f"the first non-finite gradient is that of '{grad}'") if grad else None)
        for comm, label in ((ctx.mp, "mp rank"), (ctx.pp, "pipeline stage")):
            if comm.size > 1:  # the rank that found the most telling cause tells the others
                found = [None] * comm.size
                dist.all_gather_object(found, where, group=comm.group)
                ranked = sorted((w[0], i, w[1]) for i, w in enumerate(found) if w is not None)
                where = (ranked[0][0], f"{ranked[0][2]} ({label} {ranked[0][1]})") if ranked else None
        what = f"non-finite loss ({loss.item()})" if not loss_ok else "non-finite gradient"
        return f"{what} at step {step}: " + (where[1] if where else "no parameter, module output or gradient is "
                                             "non-finite in a replay of the step (a transient, e.g. a dropout draw)")

    def count_zero_broadcasts(self) -> None:
        """ZeroRedundancyOptimizer's step broadcasts every parameter from its owner over dp, outside
        the Communicator: count those bytes on it."""
        # Looked up, not imported: a ZeRO run has imported it already, and importing it after
        # init_process_group binds the live WORLD group as a default argument (_broadcast_object), so
        # the Gloo group and its threads outlive destroy_process_group.
        zero = sys.modules.get("torch.distributed.optim")
        if zero is not None and isinstance(self.optimizer, zero.ZeroRedundancyOptimizer):
            self.ctx.dp.bytes_sent += sum(p.numel() * p.element_size() for p in self.params)

    def comm_bytes(self) -> int:
        """Payload bytes of every collective this rank has run (all groups, the gradient reductions' own)."""
        ctx = self.ctx
        fsdp = self.sharding.comms() if self.sharding is not None else []
        comms = {id(c): c for c in (ctx.mp, ctx.dp, ctx.pp, ctx.pp_ends, *self.grad_sync.comms(), *fsdp)}
        return sum(c.bytes_sent for c in comms.values())

    def gather_over_stages(self, value: float) -> list[float]:
        """``value`` of every stage of this pipeline, in stage order."""
        pp = self.ctx.pp
        if pp.size == 1:
            return [value]
        local = torch.tensor([value], dtype=torch.float64, device=self.ctx.device)
        out = [torch.empty_like(local) for _ in range(pp.size)]
        dist.all_gather(out, local, group=pp.group)
        return [o.item() for o in out]


class DeepSpeedTrainer(Trainer):
    """``dp_engine: deepspeed``: DeepSpeed ZeRO stage 1 or 2 (``zero_stage``) over the whole world
    as the dp group, for pure data parallelism (mp = pp = 1).

    DeepSpeed's engine owns backward, the bucketed gradient reduction (overlapping backward with
    ``overlap_comm``), clipping and the optimizer step, so it cannot also apply the mp gradient
    rules or run the pipeline schedule: composites are refused with a clear error. DeepSpeed
    divides the loss by the accumulation steps and averages gradients over dp; each micro-batch
    loss is pre-scaled by ``weight x dp x micro-batches`` so the result is still the gradient of the
    global-batch loss. ``bfloat16`` uses DeepSpeed's bf16 mode (bf16 weights, fp32 master copy in
    the optimizer) instead of autocast. ``require_cuda=False`` lets tests run it on CPU/Gloo, which
    DeepSpeed's CPU accelerator manages for ZeRO 1/2; the CLIs and ``train`` refuse CPU, as asked.
    """

    def __init__(self, model: nn.Module, cfg: GalaxyConfig, ctx: ParallelContext, require_cuda: bool = True):
        t, par = cfg.train, cfg.parallel
        try:
            import deepspeed
        except ImportError:
            raise ConfigError("config key 'dp_engine' is 'deepspeed' but deepspeed is not installed; "
                              "pip install deepspeed, or use dp_engine 'zero1'") from None
        if require_cuda and ctx.device.type != "cuda":
            raise ConfigError(f"config key 'dp_engine' is 'deepspeed' but this rank runs on {ctx.device.type}: "
                              "DeepSpeed ZeRO needs CUDA GPUs; use dp_engine 'zero1' (torch ZeroRedundancyOptimizer) "
                              "or 'ddp' here")
        if ctx.mp.size > 1 or ctx.pp.size > 1 or ctx.dp.size != ctx.world_size:
            raise ConfigError(f"config key 'dp_engine' 'deepspeed' runs pure data parallelism (every rank a dp rank), "
                              f"but this run is dp {ctx.dp.size} x pp {ctx.pp.size} x mp {ctx.mp.size}; use dp_engine "
                              "'zero1' or 'ddp' with pipeline or model parallelism")
        if t.dtype == "float16":
            raise ConfigError("config key 'dtype': float16 is not supported; use bfloat16")
        if t.dtype == "float64":
            model.double()
        self.model, self.cfg, self.ctx = model, cfg, ctx
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stage = StageSpec.whole(0)
        self.runner = PipelineRunner(model, ctx)  # forward-only passes (evaluation, replays)
        self.grad_sync = GradReducer([], ctx.mp)  # DeepSpeed's engine reduces; nothing to do here
        self.num_microbatches = m = par.num_microbatches
        self.last_step = None
        rows = t.global_batch_size // ctx.dp.size
        bucket = int(par.dp_bucket_mb * 2**20 / next(model.parameters()).element_size())
        ds_config = {
            "train_batch_size": t.global_batch_size,
            "train_micro_batch_size_per_gpu": rows // m,
            "gradient_accumulation_steps": m,
            "gradient_clipping": t.grad_clip,
            "zero_optimization": {"stage": par.zero_stage, "overlap_comm": ctx.device.type == "cuda",
                                  "contiguous_gradients": True, "reduce_bucket_size": bucket,
                                  "allgather_bucket_size": bucket},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": t.dtype == "bfloat16"},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        optimizer = build_optimizer(model, cfg)
        # DeepSpeed insists on its launcher's LOCAL_RANK; our launch modes may not set it.
        os.environ.setdefault("LOCAL_RANK", str(ctx.device.index if ctx.device.index is not None else 0))
        self.engine, self.optimizer, _, self.schedule = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)))
        self._norm = None

    def forward_backward(self, batch: dict, autocast: Optional[Callable] = None) -> torch.Tensor:
        ctx, m = self.ctx, self.num_microbatches
        micro = split_rows(batch, m)
        weights = self.loss_weights(micro) or [1.0]
        scale = ctx.dp.size * m
        total = torch.zeros((), dtype=torch.float64, device=ctx.device)
        start = time.perf_counter()
        for i, mb in enumerate(micro):
            out = self.engine(**{k: v.to(ctx.device, non_blocking=True) for k, v in mb.items()})
            loss = out.loss * weights[i]
            total += loss.detach().to(torch.float64)
            self.engine.backward(loss * scale)
            if i < m - 1:
                self.engine.step()  # inside the accumulation window: DeepSpeed only counts the micro-step
        self.last_step = PipelineStepResult(total, 0.0, time.perf_counter() - start, 1)
        return self.report_loss(total)

    def skips_on_device(self) -> bool:
        return False  # DeepSpeed's engine steps the optimizer itself

    def optimizer_step(self, loss: torch.Tensor, step: int, defer: bool = False, ahead: bool = False) -> StepOutcome:
        self.engine.step()  # the accumulation boundary: reduce, clip, step, schedule, zero grads
        if not torch.isfinite(loss).item():  # DeepSpeed's engine has stepped already: nothing to skip
            raise NonFiniteError(f"non-finite loss ({loss.item()}) at step {step}; lower the learning rate or "
                                 "check the data")
        norm = self.engine.get_global_grad_norm()
        return StepOutcome(torch.as_tensor(float("nan") if norm is None else float(norm), dtype=torch.float64))


def make_trainer(model: nn.Module, cfg: GalaxyConfig, ctx: ParallelContext) -> Trainer:
    """The ``Trainer`` for ``cfg.parallel.dp_engine``."""
    if cfg.parallel.dp_engine == "deepspeed":
        return DeepSpeedTrainer(model, cfg, ctx)
    return Trainer(model, cfg, ctx)


def step_record(step: int, loss: float, trainer: Trainer, outcome: StepOutcome, rates: dict, elapsed: float,
                comm_bytes: int, bubble: float) -> dict:
    """The metrics of one step, as the outputs write them (1-based ``step``)."""
    ctx = trainer.ctx
    grad_norm = outcome.grad_norm.item() if outcome.grad_norm_value is None else outcome.grad_norm_value
    record = {"step": step, "loss": loss, "lr": trainer.schedule.get_last_lr()[0],
              "grad_norm": grad_norm if math.isfinite(grad_norm) else None,  # JSON has no NaN
              **rates, "step_time_s": elapsed,
              "peak_mem_mb": peak_memory_mb(ctx.device), "comm_bytes": comm_bytes}
    if ctx.pp.size > 1:
        record["bubble"] = bubble  # this rank's stage (rank 0: the first)
    if outcome.loss_scale is not None:
        record["loss_scale"] = outcome.loss_scale
    if outcome.skipped:
        record["skipped"] = outcome.skipped
    return record


def resume_training(trainer: Trainer, resume: str, on_resume: Optional[Callable[[str, int], None]]) -> int:
    """Restore ``trainer``'s model, optimizer, LR schedule, RNG states and loss scale from ``resume``;
    returns the step it continues after."""
    from galaxy.train.checkpoint import load_checkpoint

    state = load_checkpoint(resume, trainer.model, trainer.optimizer, trainer.schedule, trainer.ctx, trainer.cfg,
                            grad_reducer=trainer.grad_sync)
    if on_resume is not None:
        on_resume(state.path, state.step)
    if trainer.scaler is not None and "loss_scaler" in state.extra:
        trainer.scaler.load_state_dict(state.extra["loss_scaler"])
    if state.step >= trainer.cfg.train.max_steps:
        logger.warning("the checkpoint is at step %d, max_steps is %d: nothing to train", state.step,
                       trainer.cfg.train.max_steps)
    return state.step


def train(model: nn.Module, batch_at: Callable[[int], dict], cfg: GalaxyConfig, ctx: ParallelContext,
          reporting: Reporting = Reporting(), checkpointing: Checkpointing = Checkpointing(),
          eval_at: Optional[Callable[..., dict]] = None, on_step: Optional[Callable[[int, float], None]] = None,
          on_resume: Optional[Callable[[str, int], None]] = None,
          interrupts: Optional[Interrupts] = None) -> TrainResult:
    """Run ``cfg.train.max_steps`` optimizer steps; ``batch_at(step)`` returns the step's global batch
    (a batcher that also takes ``shard=(dp_rank, dp_size)`` is asked for this dp rank's rows only).
    ``model`` is this rank's pipeline stage when ``ctx.pp.size > 1``.
    ``reporting`` (``galaxy.train.options``): every step's record (loss, tokens/s, tokens/s per device, MFU:
    ``galaxy.train.metrics``) goes to rank 0's ``StepOutputs`` (progress bar, metrics file, TensorBoard), the
    steady state (the steps after the warm-up, ``SteadyState``) into the result; its ``profile_step`` K is
    profiled (``result.profile`` / ``result.profile_report``) and left out of the throughput.
    ``checkpointing``: its ``resume`` restores everything (``galaxy.train.checkpoint``) and training continues
    after that step (``on_resume(path, step)`` is told which checkpoint, on every rank); with its ``save_dir``
    the ``CheckpointSchedule`` checkpointing.
    ``eval_at(i)``: the held-out split's i-th global batch; with ``eval_every`` N, ``eval_iters`` of
    them are evaluated after every N-th step and the last (``galaxy.train.evaluate``).
    ``on_step(step, loss)`` is called after each step.
    ``interrupts`` (``galaxy.train.interrupts``): SIGINT / SIGTERM stop every rank after the same step,
    which is saved (with a ``save_dir``) before ``TrainingInterrupted`` is raised; no save is written once
    the rank's launcher is gone."""
    t = cfg.train
    if (checkpointing.save_dir or checkpointing.resume) and cfg.parallel.dp_engine == "deepspeed":
        raise ConfigError("config key 'dp_engine' is 'deepspeed', whose engine keeps the optimizer state in its own "
                          "format, which checkpoints do not read; use dp_engine 'zero1' or 'ddp' to save or resume")
    with interrupts or nullcontext():
        trainer = make_trainer(model, cfg, ctx)
        start_step = 0
        if checkpointing.resume is not None:
            start_step = resume_training(trainer, checkpointing.resume, on_resume)
        checkpoints = None
        if checkpointing.save_dir:
            from galaxy.train.checkpoint.schedule import CheckpointSchedule

            checkpoints = CheckpointSchedule(checkpointing.save_dir, checkpointing.save_every, checkpointing.keep_last,
                                             t.max_steps, asynchronous=t.checkpoint_async_mode == "async",
                                             before_write=interrupts.check_launcher if interrupts else None)
        profiler = None
        if reporting.profile_step is not None:
            from galaxy.profiler import StepProfiler

            profiler = StepProfiler(model, ctx, reporting.profile_step, json_file=reporting.profile_json,
                                    batch=t.global_batch_size, seq_len=t.seq_length)
        amp = lambda: autocast_context(cfg, ctx.device)  # noqa: E731
        amp()  # refuse an unsupported dtype before the first step
        peak_tflops = reporting.peak_tflops if reporting.peak_tflops is not None else t.peak_tflops
        peak = peak_flops_per_device(ctx.device, t.dtype, peak_tflops)
        outputs = StepOutputs(ctx.rank == 0, start_step, t.max_steps, t.log_every, reporting.progress,
                              reporting.metrics_file, reporting.tensorboard_dir)
        result, steady = TrainResult(), SteadyState(cfg, ctx.world_size, peak, reporting.untimed_steps)
        model.train()
        evaluates = lambda s: eval_at is not None and t.eval_every and (s % t.eval_every == 0 or s == t.max_steps)  # noqa: E731
        # A step goes ahead (its loss read and its settle after the next step's forward and backward are queued, so
        # that the device never waits for the host between steps) where the update needs no device sync
        # (``skips_on_device``) and nothing reads the state right after it: not the last step, nor one evaluated,
        # saved or profiled after, nor the warm-up's last (the steady state is timed from its end: were it read
        # after the next step is queued, part of that step would fall before the clock starts).
        may_go_ahead = trainer.skips_on_device() and profiler is None
        goes_ahead = lambda s: (may_go_ahead and s < t.max_steps and not evaluates(s)  # noqa: E731
                                and s != start_step + reporting.untimed_steps
                                and not (checkpoints is not None and checkpoints.due(s)))
        interrupted = lambda s: interrupts is not None and s < t.max_steps and interrupts.agreed(ctx)  # noqa: E731
        last_end = 0.0  # when the step before ended

        def ends(q: QueuedStep) -> None:
            """Read step ``q.step``'s values (waiting for them alone), settle it, and record it."""
            nonlocal last_end
            loss = trainer.settle(q.outcome, q.loss, q.step)
            now = time.perf_counter()
            elapsed, last_end = now - max(q.start, last_end), now  # gone ahead: from the step before's end
            if profiler is not None and profiler.after_step(q.step) is not None:  # a collective at step K
                result.profile, result.profile_report = profiler.result, profiler.report
            ids = q.batch["input_ids"]
            profiled = q.step == reporting.profile_step and t.max_steps > 1  # its hooks slow it down
            rates = steady.add(elapsed, ids.numel() * ctx.dp.size, ids.shape[-1], skip=profiled, bubble=q.bubble)
            result.losses.append(loss)
            result.comm_bytes_per_step = q.comm_bytes
            record = step_record(q.step, loss, trainer, q.outcome, rates, elapsed, q.comm_bytes, q.bubble)
            if q.outcome.skipped:
                result.skipped_steps += 1
            if evaluates(q.step):
                result.eval = evaluate(trainer, eval_at, t.eval_iters, amp)
                record.update(result.eval)
            outputs.write(record)
            if on_step:
                on_step(q.step, loss)
            if checkpoints is not None:
                checkpoints.after_step(q.step, trainer)

        def stop(s: int) -> None:
            if checkpoints is None:
                raise TrainingInterrupted(s, None, "no save directory")
            raise TrainingInterrupted(s, checkpoints.on_interrupt(s, trainer))

        batch = None  # the step's rows, read during the step before it
        queued: Optional[QueuedStep] = None  # a step gone ahead, not yet ended
        try:
            for step in range(start_step, t.max_steps):
                if queued is not None and interrupted(queued.step):  # before the next step draws or changes anything
                    ends(queued)
                    stop(queued.step)
                bytes_before = trainer.comm_bytes()
                if profiler is not None:
                    profiler.before_step(step + 1)
                start = time.perf_counter()
                if batch is None:
                    batch = trainer.read_batch(batch_at, step)
                loss_t = trainer.forward_backward(batch, amp)
                if queued is not None:
                    ends(queued)  # its update is settled before this step's
                    queued = None
                ahead = goes_ahead(step + 1)
                outcome = trainer.optimizer_step(loss_t, step + 1, defer=True, ahead=ahead)
                this = QueuedStep(step + 1, loss_t, outcome, batch, start, trainer.comm_bytes() - bytes_before,
                                  trainer.last_step.bubble)
                # the next step's rows are made on the host while the device runs this step's backward and optimizer
                upcoming = trainer.read_batch(batch_at, step + 1) if step + 1 < t.max_steps else None
                if ahead:
                    queued = this
                else:
                    ends(this)
                    if interrupted(step + 1):
                        stop(step + 1)
                batch = upcoming
            if checkpoints is not None:
                checkpoints.finish()  # the last save is complete before train returns
        except Exception as e:
            # A collective that failed because a peer died says only "Connection closed by peer [addr]":
            # name the peer (ParallelContext's heartbeats know which one stopped).
            failure = ctx.peer_failure(e)
            if failure is None:
                raise
            raise failure from e
        finally:
            if profiler is not None:
                profiler.close()
            outputs.close()
            trainer.grad_sync.remove()
    return finished(result, steady, trainer, peak)


def finished(result: TrainResult, steady: SteadyState, trainer: Trainer, peak: PeakFlops) -> TrainResult:
    """``result`` with the run's totals: throughput at the steady state (the steps after the warm-up, as
    bench_train times them), peak memory, the pipeline bubble."""
    ctx = trainer.ctx
    result.steps = trainer.cfg.train.max_steps
    totals = steady.summary()
    for key in ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "mfu_causal", "timed_steps"):
        setattr(result, key, totals[key])
    result.peak = peak
    result.peak_mem_mb = peak_memory_mb(ctx.device)
    if ctx.pp.size > 1:
        result.bubble_measured = trainer.gather_over_stages(steady.mean("bubble"))
        result.bubble_analytic = analytic_bubble(ctx.pp.size, trainer.num_microbatches)
    return result
