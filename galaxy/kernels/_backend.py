"""Choosing which implementation of a kernel runs: Triton or plain PyTorch.

Triton is an optional dependency: nothing here imports it at module import time, so
``galaxy.kernels`` loads on machines without it (CPU-only CI, Ascend NPU).
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``import triton`` succeeds (cached: a failed import is slow to retry)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        logger.info("triton is not importable (%s): galaxy.kernels will use the torch references", err)
        return False
    return True


def triton_interpret_enabled() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on CPU with its interpreter."""
    # Same truthy spellings as triton's own env parsing.
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# The kernels compute in fp32: ``auto`` leaves float64 (the exactness tests' dtype) to torch.
AUTO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_backend(backend: str, tensor: torch.Tensor) -> str:
    """Map a requested backend to the one that will run: ``"triton"`` or ``"torch"``.

    ``auto`` picks Triton only for CUDA tensors of fp32/bf16/fp16 when triton imports;
    ``triton`` insists and raises a clear error when it cannot run (not installed, or CPU
    tensors without the interpreter, or a device Triton does not target).
    """
    return resolve_backend_for(backend, tensor.device, tensor.dtype)


def resolve_backend_for(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``resolve_backend`` for tensors on ``device`` (of ``dtype``, when known): a model checks its
    ``kernels`` setting with this once it knows its device, before any tensor exists."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    device = torch.device(device).type
    if backend == "auto":
        fits = dtype is None or dtype in AUTO_DTYPES
        return "triton" if device == "cuda" and fits and triton_available() else "torch"
    if not triton_available():
        raise ImportError(
            "backend='triton' needs the triton package, which is not installed: "
            "`pip install triton` (or use backend='torch' / 'auto')"
        )
    if device == "cuda":
        return "triton"
    if device == "cpu":
        if triton_interpret_enabled():
            utils = sys.modules.get("galaxy.kernels._triton_utils")
            if utils is not None and not utils.KERNELS_INTERPRETED:
                raise ValueError(
                    "backend='triton' got CPU tensors, but the Triton kernels were already compiled "
                    "for GPU: TRITON_INTERPRET=1 was set after they were first imported; set it "
                    "before the first call (e.g. at process start)"
                )
            return "triton"
        raise ValueError(
            "backend='triton' got CPU tensors: Triton runs on CPU only through its interpreter, "
            "so set TRITON_INTERPRET=1 in the environment before the kernels are first used "
            "(or use backend='torch' / 'auto')"
        )
    raise ValueError(
        f"backend='triton' does not support tensors on device {device}; "
        "use backend='torch' or 'auto'"
    )
