"""Where one training step's GPU time goes: the step under torch.profiler, its kernels sorted into what
they do, and how much of the step the GPU sat idle or waited on a collective nothing hid.

    breakdown = profile_step(prepared.step, device)       # bench_train.py --profile: one row's "profile"

Categories (by kernel name; the first pattern that matches):

    gemm        cuBLAS / CUTLASS / nvjet / inductor's mm templates (the matmuls)
    attention   flash, memory-efficient, cuDNN fused attention (SDPA's kernels), forward and backward
    collective  NCCL kernels (all-gather, reduce-scatter, all-reduce, send/recv)
    optimizer   the fused AdamW and the multi-tensor kernels (foreach norms, scales, AdamW)
    fused       inductor's generated Triton kernels (norms, rotary, activations, casts fused by compile)
    elementwise every other ATen kernel (casts, adds, copies, reductions outside a compiled graph)
    memcpy      copies and memsets

The figures (milliseconds of the profiled step, this rank):

    window_ms          first kernel start to last kernel end
    busy_ms            time any kernel ran (union over streams)
    idle_ms            window_ms - busy_ms: the GPU waiting on the host (launch gaps, Python, syncs)
    compute_ms         time a non-collective kernel ran (union)
    exposed_comm_ms    time only collectives ran: communication nothing hid
    <category>_ms      the kernels' summed durations (overlapping kernels both count)
    top                the ten longest kernel names by total time, with counts
    gaps               the five longest idle stretches, with the kernels before and after each
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import tempfile
from collections import Counter, defaultdict
from typing import Callable, Optional

import torch

CATEGORIES = (
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|attention|attn", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|sm\d+_xmma|cublas|wgmma|triton_tem_|splitk|matmul", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|multitensor", re.I)),
    ("fused", re.compile(r"^triton_", re.I)),
    ("memcpy", re.compile(r"memcpy|memset", re.I)),
)
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "elementwise"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (start, end)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def breakdown(events: list[dict]) -> dict:
    """The step's figures from a chrome trace's device events (``ts``/``dur`` in microseconds)."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS and e.get("dur", 0) > 0]
    if not kernels:
        return {"error": "the trace holds no device kernels (no CUDA activity recorded)"}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?")) for e in kernels]
    start, end = min(s for s, _, _ in spans), max(e for _, e, _ in spans)
    busy = union_length([(s, e) for s, e, _ in spans])
    compute = union_length([(s, e) for s, e, n in spans if category(n) != "collective"])
    per_cat, per_name, count = defaultdict(float), defaultdict(float), Counter()
    for s, e, n in spans:
        per_cat[category(n)] += e - s
        per_name[n] += e - s
        count[n] += 1
    out = {"window_ms": (end - start) / 1e3, "busy_ms": busy / 1e3, "idle_ms": (end - start - busy) / 1e3,
           "compute_ms": compute / 1e3, "exposed_comm_ms": (busy - compute) / 1e3, "kernels": len(spans)}
    out.update({f"{label}_ms": per_cat.get(label, 0.0) / 1e3 for label, _ in CATEGORIES})
    out["elementwise_ms"] = per_cat.get("elementwise", 0.0) / 1e3
    out["top"] = [{"name": n[:120], "category": category(n), "ms": t / 1e3, "count": count[n]}
                  for n, t in sorted(per_name.items(), key=lambda kv: -kv[1])[:10]]
    out["gaps"] = idle_gaps(spans)
    return out


def idle_gaps(spans: list[tuple[float, float, str]], most: int = 5) -> list[dict]:
    """The ``most`` longest stretches with no kernel running, each with the kernels before and after it:
    where the GPU waited on the host."""
    gaps, end, last = [], float("-inf"), None
    for s, e, n in sorted(spans):
        if last is not None and s > end:
            gaps.append({"ms": (s - end) / 1e3, "after": last[:80], "before": n[:80]})
        if e > end:
            end, last = e, n
    return sorted(gaps, key=lambda g: -g["ms"])[:most]


def profile_step(step: Callable[[], None], device: torch.device, keep_trace: Optional[str] = None) -> dict:
    """Run ``step`` once under torch.profiler (CUDA kernels) and return its ``breakdown``. ``keep_trace``:
    a path where the gzipped chrome trace is kept (for chrome://tracing or Perfetto)."""
    if device.type != "cuda":
        return {"error": "profiled on GPUs only (the breakdown reads CUDA kernels)"}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
        if keep_trace:
            with open(path, "rb") as src, gzip.open(keep_trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return breakdown(events)
