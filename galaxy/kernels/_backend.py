"""Choosing which implementation of a kernel runs: Triton or plain PyTorch.

``auto`` on a CUDA device picks, per op, what ``bench/bench_kernels.py`` measured fastest on that
device class (``AUTO_PICKS``): Triton only where it was at least as fast as torch's fused op and
``torch.compile`` of the reference at every measured shape (Liger-Kernel is measured beside them, but
auto cannot run it).

Triton is an optional dependency: nothing here imports it at module import time, so
``galaxy.kernels`` loads on machines without it (CPU-only CI, Ascend NPU).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import NamedTuple

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

OPS = ("rms_norm", "layer_norm", "rope", "swiglu", "swiglu_packed", "cross_entropy",
       "fused_linear_cross_entropy")


class Pick(NamedTuple):
    """What ``auto`` runs for one op: ``backend`` for inputs of at least ``min_numel`` elements
    (smaller ones, launch-bound, run on torch), and the measurement that decided it."""

    backend: str
    min_numel: int
    measured: str


# Per device class, per op, from bench/bench_kernels.py: forward + backward, bf16, GPU time per step
# (median of 4 repeats in one launch; inputs and upstream gradients beyond L2); raw JSON under
# docs/results/. Triton only where it was at least as fast as torch's fused op and torch.compile of
# the reference at every measured shape. One stated exception: RoPE keeps Triton at the 1B shape where
# Liger's in-place kernel is 1% faster on H100 (level on H200; auto cannot run Liger, and torch's path,
# compiled or not, is 2-10x slower). An op missing here runs on torch.
_H100 = "H100 80GB HBM3, 2026-11-26, commit faeb9f3, docs/results/kernels_2026-11-26_faeb9f3_h100.json: ms"
_H200 = "NVIDIA H200 (143771 MiB), 2026-11-26, commit 500cf42, docs/results/kernels_2026-11-26_500cf42_h200.json: ms"
# RoPE (half-width tables) and cross-entropy (one-hot by one store) re-measured after their changes,
# every contender again, in later launches.
_H100_ROPE = "H100 80GB HBM3, 2026-11-26, commit f82ca54, docs/results/kernels_2026-11-26_f82ca54_h100_rope.json: ms"
_H100_CE = "H100 80GB HBM3, 2026-11-26, commit 08646d3, docs/results/kernels_2026-11-26_08646d3_h100_ce.json: ms"
_H200_ROPE = "NVIDIA H200, 2026-11-26, commit f82ca54, docs/results/kernels_2026-11-26_f82ca54_h200_rope.json: ms"
_H200_CE = "NVIDIA H200, 2026-11-26, commit 08646d3, docs/results/kernels_2026-11-26_08646d3_h200_ce.json: ms"
# The norms re-measured after their backward's row loop was pipelined (every contender again).
_H100_NORMS = "H100 80GB HBM3, 2026-11-26, commit 998cee7, docs/results/kernels_2026-11-26_998cee7_h100_norms.json: ms"
_H200_NORMS = "NVIDIA H200, 2026-11-26, commit 998cee7, docs/results/kernels_2026-11-26_998cee7_h200_norms.json: ms"
AUTO_PICKS: dict[str, dict[str, Pick]] = {
    "H100": {
        "rms_norm": Pick("triton", 0, f"{_H100_NORMS} 7B galaxy 0.069, torch-compile 0.095, F.rms_norm 0.114; "
                         "7B SP/2 0.039 vs F.rms_norm 0.059; 1B 0.040 vs torch-compile 0.051; 1B SP/2 0.023 vs "
                         "F.rms_norm 0.030"),
        "layer_norm": Pick("triton", 0, f"{_H100_NORMS} BERT-large galaxy 0.027, torch-compile 0.040, F.layer_norm 0.041"),
        "rope": Pick("triton", 0, f"{_H100_ROPE} 7B galaxy 0.097, torch-compile 0.190; 1B 0.0355 vs 0.075; "
                     "TP/2: 0.053 vs 0.102, 0.019 vs 0.047 (Liger 0.100 / 0.0352 / 0.053 / 0.021)"),
        "swiglu": Pick("triton", 0, f"{_H100} 7B galaxy 0.243, torch-compile 0.244; 7B TP/2 0.125 vs 0.125; "
                       "1B 0.183 vs 0.183; 1B TP/2 0.095 vs 0.099"),
        "swiglu_packed": Pick("triton", 0, f"{_H100} 7B galaxy 0.244, torch-compile 0.265; 7B TP/2 0.125 vs 0.136; "
                              "1B 0.183 vs 0.198; 1B TP/2 0.095 vs 0.109"),
        "cross_entropy": Pick("triton", 0, f"{_H100_CE} 32k galaxy 0.194, torch-compile 0.637, F.cross_entropy 2.224; "
                              "128k 0.772 vs 2.690, 8.967 (Liger 0.955 / 1.510)"),
        "fused_linear_cross_entropy": Pick("triton", 0, f"{_H100_CE} 7B (32k) galaxy 4.186, torch-compile 4.608; "
                                           "1B (128k) 8.781 vs 10.530; 8B head 17.172 vs 18.576"),
    },
    "H200": {
        "rms_norm": Pick("triton", 0, f"{_H200_NORMS} 7B galaxy 0.055, torch-compile 0.080, F.rms_norm 0.088; "
                         "7B SP/2 0.033 vs F.rms_norm 0.047; 1B 0.033 vs torch-compile 0.047; 1B SP/2 0.021 vs "
                         "F.rms_norm 0.027"),
        "layer_norm": Pick("triton", 0, f"{_H200_NORMS} BERT-large galaxy 0.026, torch-compile 0.036, F.layer_norm 0.040"),
        "rope": Pick("triton", 0, f"{_H200_ROPE} 7B galaxy 0.073, torch-compile 0.164; 1B 0.0270 vs 0.068; "
                     "TP/2: 0.040 vs 0.089, 0.0155 vs 0.042 (Liger 0.076 / 0.0271 / 0.040 / 0.017)"),
        "swiglu": Pick("triton", 0, f"{_H200} 7B galaxy 0.172, torch-compile 0.172; 7B TP/2 0.090 vs 0.090; "
                       "1B 0.130 vs 0.130; 1B TP/2 0.069 vs 0.073"),
        "swiglu_packed": Pick("triton", 0, f"{_H200} 7B galaxy 0.172, torch-compile 0.238; 7B TP/2 0.090 vs 0.135; "
                              "1B 0.130 vs 0.179; 1B TP/2 0.069 vs 0.093"),
        "cross_entropy": Pick("triton", 0, f"{_H200_CE} 32k galaxy 0.154, torch-compile 0.484, F.cross_entropy 1.654; "
                              "128k 0.638 vs 1.984, 6.806 (Liger 1.040 / 1.343)"),
        "fused_linear_cross_entropy": Pick("triton", 0, f"{_H200_CE} 7B (32k) galaxy 4.125, torch-compile 4.416; "
                                           "1B (128k) 9.207 vs 9.830; 8B head 16.712 vs 17.912"),
    },
}
# A CUDA device of a class not measured yet runs the picks of this one (logged once per device).
FALLBACK_CLASS = "H100"


def device_class(device_name: str) -> str | None:
    """The measured device class a CUDA device name belongs to (``NVIDIA H100 80GB HBM3`` -> H100)."""
    return next((cls for cls in AUTO_PICKS if cls in device_name.upper()), None)


def auto_pick(op: str, device_name: str, numel: int | None = None) -> str:
    """``"triton"`` or ``"torch"``: what ``auto`` runs for ``op`` on a CUDA device of this name, for an
    input of ``numel`` elements (None: the op's choice at the sizes it was measured at)."""
    if op not in OPS:
        raise ValueError(f"unknown kernel op {op!r}; one of {OPS}")
    cls = device_class(device_name)
    if cls is None:
        _log_fallback(device_name)
        cls = FALLBACK_CLASS
    pick = AUTO_PICKS[cls].get(op)
    if pick is None or (numel is not None and numel < pick.min_numel):
        return "torch"
    return pick.backend


def device_class_of(device: torch.device) -> str:
    """The measured device class whose launch settings a kernel on ``device`` uses: the class of a CUDA
    device, else (an unmeasured GPU, the CPU interpreter) ``FALLBACK_CLASS``."""
    device = torch.device(device)
    if device.type != "cuda":
        return FALLBACK_CLASS
    return device_class(_name_of(device)) or FALLBACK_CLASS


def _name_of(device: torch.device) -> str:
    """The name of a CUDA device (the current one where ``device`` has no index)."""
    return _cuda_device_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _log_fallback(device_name: str) -> None:
    logger.info("kernels 'auto': no measurement for %s; using the %s picks", device_name, FALLBACK_CLASS)


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def resolve_backend(backend: str, tensor: torch.Tensor, op: str | None = None) -> str:
    """Map a requested backend to the one that will run: ``"triton"`` or ``"torch"``.

    ``auto`` picks Triton only for CUDA tensors of fp32/bf16/fp16 when triton imports, and, given
    the ``op``, only where ``AUTO_PICKS`` says it measured fastest on this device class;
    ``triton`` insists and raises a clear error when it cannot run (not installed, or CPU
    tensors without the interpreter, or a device Triton does not target).
    """
    return resolve_backend_for(backend, tensor.device, tensor.dtype, op, tensor.numel())


def resolve_backend_for(backend: str, device: torch.device, dtype: torch.dtype | None = None,
                        op: str | None = None, numel: int | None = None) -> str:
    """``resolve_backend`` for tensors on ``device`` (of ``dtype``, when known): a model checks its
    ``kernels`` setting with this once it knows its device, before any tensor exists."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    device = torch.device(device)
    if backend == "auto":
        fits = dtype is None or dtype in AUTO_DTYPES
        if not (device.type == "cuda" and fits and triton_available()):
            return "torch"
        if op is None:
            return "triton"
        return auto_pick(op, _name_of(device), numel)
    device = device.type
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
