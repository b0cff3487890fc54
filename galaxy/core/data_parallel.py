"""Data parallelism: gradients summed over the dp group in buckets that overlap with backward.

Why our own hooks and not ``torch.nn.parallel.DistributedDataParallel`` over the dp group:

* **Micro-batches and pipelines.** DDP decides at *forward* time whether the next backward
  reduces (``no_sync``), and expects that backward to follow. Under 1F1B a stage runs the last
  micro-batch's forward before the backward of earlier ones, so DDP would reduce on the wrong
  backward or need ``find_unused_parameters``/static-graph workarounds. Here the pipeline
  schedule says which backward is the last one (``arm()``), and only that one launches transfers.
* **Model-parallel gradient rules.** DDP all-reduces every parameter over its group and flags
  parameters that took no part in a forward (a row-parallel bias off mp rank 0 is never used;
  stage-local modules differ by rank) as errors unless ``find_unused_parameters`` walks the graph
  every step. The mp rules (``GradientSync``) and the pipeline's tied-embedding sum are separate
  linear steps that commute with the dp sum, so they stay where they are, after backward.
* **Exact global-batch loss.** The training loop weights each micro-batch loss by its share of
  the global batch's loss targets, so the dp reduction is a plain SUM; DDP always divides by the
  group size and would need a comm hook to undo it.

What DDP gives is kept: parameters are bucketed (``bucket_mb``, reverse registration order, which
is close to the order backward produces gradients); a ``register_post_accumulate_grad_hook`` on
each parameter counts it ready once its gradient is final; a full bucket is flattened and its
all-reduce launched asynchronously while backward goes on. Buckets launch strictly in index order,
so every dp rank issues the same collectives in the same order (NCCL and Gloo both need that).
``finish()`` launches what is left, waits, and copies the sums back into ``.grad``.

A parameter whose gradient is None on this rank took no part in this rank's forward; the model
structure is the same on every rank of a dp group (same stage, same mp rank), so it is None on all
of them, and it is left out of the bucket and keeps None (the optimizer skips it, as in serial).
After the first step such parameters are no longer waited for, so their bucket can launch during
backward (the models' graphs are static: the set of used parameters does not change by step).
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from galaxy.core.comm import Communicator

logger = logging.getLogger(__name__)


class DataParallelGradSync:
    """Sum gradients over the dp group; ``arm()`` before the step's last backward, ``finish()`` after it."""

    def __init__(self, params: Iterable[nn.Parameter], comm: Communicator, bucket_mb: float = 25.0,
                 reduce_dtype: Optional[torch.dtype] = None):
        """``reduce_dtype``: the precision the sums travel in (None: the gradients')."""
        self.comm, self.reduce_dtype = comm, reduce_dtype
        params = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        limit, size = bucket_mb * 2**20, 0.0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or size + nbytes > limit or p.dtype != self.buckets[-1][0].dtype:
                self.buckets.append([])
                size = 0.0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._armed = False
        self._ready = [0] * len(self.buckets)
        self._expected = [len(b) for b in self.buckets]
        self._launched = 0
        self._pending: list[tuple[list[nn.Parameter], torch.Tensor, object]] = []
        self.overlapped = 0  # buckets launched during backward in the last step (the rest in finish())
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params] \
            if comm.size > 1 else []

    def arm(self) -> None:
        """The next backward is the step's last one: each bucket is sent once its gradients are final."""
        if self.comm.size == 1:
            return
        self._armed = True
        self._ready = [0] * len(self.buckets)
        self._launched = 0
        self._pending = []

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        b = self._bucket_of[id(param)]
        self._ready[b] += 1
        while self._launched < len(self.buckets) and self._ready[self._launched] >= self._expected[self._launched]:
            self._launch(self._launched)

    def _launch(self, b: int) -> None:
        bucket = [p for p in self.buckets[b] if p.grad is not None]
        self._launched = b + 1
        if not bucket:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        self.comm.bytes_sent += flat.numel() * flat.element_size()
        work = dist.all_reduce(flat, group=self.comm.group, async_op=True)
        self._pending.append((bucket, flat, work))

    def finish(self) -> None:
        """Launch the buckets backward left incomplete, wait for all, write the sums into ``.grad``."""
        if self.comm.size == 1:
            return
        if not self._armed:
            raise RuntimeError("DataParallelGradSync.finish() without arm(): call arm() before the step's last "
                               "backward")
        self.overlapped = len(self._pending)
        while self._launched < len(self.buckets):
            self._launch(self._launched)
        # Parameters that got no gradient (unused by this rank's forward) are not waited for next time.
        self._expected = [sum(p.grad is not None for p in bucket) for bucket in self.buckets]
        for bucket, flat, work in self._pending:
            work.wait()
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(g.view_as(p))
        self._pending = []
        self._armed = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
