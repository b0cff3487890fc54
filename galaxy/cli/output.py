"""What a CLI shows people: logging set-up, the one-line bad-input error, the final summary (and its JSON)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Optional


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")



def bad_input(error: Exception) -> int:
    """The one line a CLI prints for bad config, flags or files before any rank starts; exit code 2."""
    print(f"error: {error}", file=sys.stderr)
    return 2



def check_metrics_flags(args) -> None:
    """``--tensorboard`` needs the tensorboard package; ``--peak_tflops`` must be positive (ConfigError)."""
    from galaxy.config import ConfigError
    from galaxy.train.metrics import check_tensorboard_installed

    if getattr(args, "tensorboard", None):
        check_tensorboard_installed()
    peak = getattr(args, "peak_tflops", None)
    if peak is not None and not peak > 0:
        raise ConfigError(f"--peak_tflops must be positive (dense TFLOP/s of one device), got {peak}")



def print_summary(title: str, fields: dict, path: Optional[str]) -> None:
    width = max(len(k) for k in fields)
    print(f"\n== {title} ==")
    for k, v in fields.items():
        print(f"  {k:<{width}}  {v}")
    if path:
        with open(path, "w") as f:
            json.dump(fields, f, indent=2)
