"""Where a training run's step records go: the progress bar, the metrics file and TensorBoard (rank 0)."""

from __future__ import annotations

import json
from typing import Optional

from galaxy.train.metrics import TensorBoardWriter


class StepOutputs:
    """Rank 0's sinks for each step's record (``train``'s metrics: step, loss, lr, grad_norm, tokens/s,
    MFU, ...): a JSON line appended to ``metrics_file``, TensorBoard scalars in ``tensorboard_dir``, and
    a progress bar (``progress``) counting from ``start_step`` to ``max_steps`` that shows the loss,
    tokens/s and MFU every ``log_every`` steps and at the last. On other ranks it writes nothing."""

    def __init__(self, is_main: bool, start_step: int, max_steps: int, log_every: int, progress: bool = True,
                 metrics_file: Optional[str] = None, tensorboard_dir: Optional[str] = None):
        self.max_steps, self.log_every = max_steps, log_every
        self.metrics = open(metrics_file, "a") if (metrics_file and is_main) else None
        self.tensorboard = TensorBoardWriter(tensorboard_dir) if (tensorboard_dir and is_main) else None
        self.bar = None
        if progress and is_main:
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def write(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.bar is not None:
            self.bar.update(1)
            step = record["step"]
            if step % self.log_every == 0 or step == self.max_steps:
                shown = {"loss": f"{record['loss']:.4f}", "tok_s": f"{record['tokens_per_s']:.0f}",
                         "tok_s_gpu": f"{record['tokens_per_s_per_gpu']:.0f}"}
                if record["mfu"] is not None:
                    shown["mfu"] = f"{record['mfu']:.1%}"
                self.bar.set_postfix(shown)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
