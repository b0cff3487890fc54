"""What a run asks of ``train`` besides the model, its data and its config: where each step's record goes
(``Reporting``) and which checkpoints it reads and writes (``Checkpointing``). Both are typed and checked
when made; the CLIs make them from their flags (``galaxy.cli.args.RunOptions``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from galaxy.config import ConfigError
from galaxy.train.metrics import WARMUP_STEPS


@dataclass(frozen=True)
class Reporting:
    """Rank 0's outputs: a ``progress`` bar, one JSON line a step in ``metrics_file``, TensorBoard events in
    ``tensorboard_dir``; MFU against ``peak_tflops`` (else the config's, else the device table's). With
    ``profile_step`` K (1-based) step K is profiled (FLOPs, communication; JSON to ``profile_json``) and left
    out of the throughput figures. The steady state leaves out the first ``untimed_steps`` (not the learning rate's
    ``warmup_steps``); the last of them ends
    before the next step is queued, even where steps go ahead, so that the steady state's clock starts on an idle
    device. The default reports nothing: library callers stay quiet."""

    progress: bool = False
    metrics_file: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    peak_tflops: Optional[float] = None
    profile_step: Optional[int] = None
    profile_json: Optional[str] = None
    untimed_steps: int = WARMUP_STEPS

    def __post_init__(self) -> None:
        if self.untimed_steps < 0:
            raise ConfigError(f"untimed_steps counts the steps before the steady state (0 or more), "
                              f"got {self.untimed_steps}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"peak_tflops must be positive, got {self.peak_tflops}")
        if self.profile_step is not None and self.profile_step < 1:
            raise ConfigError(f"profile_step counts steps from 1, got {self.profile_step}")
        if self.profile_json and self.profile_step is None:
            raise ConfigError("profile_json needs profile_step K (the step to profile)")


@dataclass(frozen=True)
class Checkpointing:
    """``resume``: a step directory, or a save directory for its newest valid checkpoint; training continues
    after its step. ``save_dir``: checkpoints after every ``save_every``-th step (0: only the last) and at the
    last step, keeping the newest ``keep_last`` (None: all)."""

    save_dir: Optional[str] = None
    save_every: int = 0
    keep_last: Optional[int] = None
    resume: Optional[str] = None

    def __post_init__(self) -> None:
        if self.save_every < 0:
            raise ConfigError(f"save_every must be 0 or positive, got {self.save_every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"keep_last must be at least 1, got {self.keep_last}")
        if not self.save_dir and (self.save_every or self.keep_last is not None):
            raise ConfigError("save_every and keep_last need a save_dir")
