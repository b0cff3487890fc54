"""When a training run saves: after every N-th step and the last, on an interrupt, keeping the newest K."""

from __future__ import annotations

from typing import Callable, Optional

from galaxy.train.checkpoint import PendingCheckpoint, save_checkpoint


class CheckpointSchedule:
    """The checkpoints ``train`` writes into ``directory``: after every ``every``-th step
    (0: none but the last) and after step ``last``, keeping the newest ``keep_last``; ``on_interrupt``
    saves the step a run stopped at. ``asynchronous`` (``checkpoint_async_mode: async``): each save is
    written while the next steps run, one in flight at a time; the next save and ``finish`` wait for it,
    and a failed write stops the run with one line. ``before_write`` runs before each save and may raise
    to forbid it (a rank whose launcher died). The saves are collectives: every rank follows the schedule."""

    def __init__(self, directory: str, every: int, keep_last: Optional[int], last: int,
                 asynchronous: bool = False, before_write: Optional[Callable[[], None]] = None):
        self.directory, self.every, self.keep_last, self.last = directory, every, keep_last, last
        self.asynchronous, self.before_write = asynchronous, before_write
        self.pending: Optional[PendingCheckpoint] = None
        self.latest: Optional[tuple[int, str]] = None  # the newest save's step and path (complete or being written)

    def due(self, step: int) -> bool:
        """Whether the schedule saves after ``step`` (1-based)."""
        return bool(self.every and step % self.every == 0) or step == self.last

    def after_step(self, step: int, trainer) -> None:
        """The scheduled save after ``step``, if one is due."""
        if self.due(step):
            self.save(step, trainer, asynchronous=self.asynchronous)

    def on_interrupt(self, step: int, trainer) -> str:
        """Save the state after ``step`` (the step every rank stopped at) unless a save of it is there
        already; returns its path once it is complete."""
        if self.latest is None or self.latest[0] != step:
            self.save(step, trainer, asynchronous=False)
        self.finish()
        return self.latest[1]

    def save(self, step: int, trainer, asynchronous: bool) -> None:
        """Save the state after ``step`` from ``trainer`` (its model, optimizer, LR schedule, loss scaler
        and gradient reducer)."""
        if self.before_write is not None:
            self.before_write()
        self.finish()  # one save in flight at a time
        if trainer.sharding is not None:  # an evaluation may have left gathered FSDP weights
            trainer.sharding.reshard()
        extra = {"loss_scaler": trainer.scaler.state_dict()} if trainer.scaler is not None else None
        saved = save_checkpoint(self.directory, step, trainer.model, trainer.optimizer, trainer.schedule, trainer.ctx,
                                trainer.cfg, extra=extra, keep_last=self.keep_last, grad_reducer=trainer.grad_sync,
                                async_save=asynchronous)
        if asynchronous:
            self.pending, saved = saved, saved.final
        self.latest = (step, saved)

    def finish(self) -> None:
        """Wait for the save in flight, if any (a collective: every rank calls it)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
