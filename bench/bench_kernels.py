"""Benchmark galaxy's Triton kernels against torch (op by op, its fused op, torch.compile) and Liger.

Per op and shape (LLaMA-7B, Llama-3.2-1B, and the shard sizes TP/SP plans run, e.g. an MLP
intermediate of 5504 = 11008 / 2), every contender

1. is checked against the torch reference: outputs and input gradients, normalized max error,
2. is timed forward + backward, two ways, each repeated ``--repeats`` times in this launch
   (interleaved with the other contenders) and reported as median and [min, max]:
   ``wall``   ``triton.testing.do_bench`` median: the host's launch overhead included when it is
              longer than the GPU work (small kernels), as an eager step on an idle GPU sees it;
   ``gpu``    the same steps queued behind a GPU sleep so the host runs ahead (as it does inside a
              training step), timed with CUDA events: device time, without launch gaps. Inputs
              and upstream gradients rotate over several copies so repeated steps do not hit L2
              (in training both are fresh tensors at every layer). A contender that syncs
              with the host (Liger's cross-entropy reads ``.item()``) pays for it here too,
3. has its peak extra memory over one forward + backward measured.

A memory-bound op also gets a ``copy-floor`` row, not a contender: per launch of the op, the
tensors it must read and write at the least, moved by the device's memcpy (as many bytes) and by a
pointwise kernel that reads and writes as many tensors of that size, into new tensors or over its
inputs (Inductor's, compiled; eager on CPU), timed the same way; the fastest is the floor. Liger's
time over the floor bounds how far ahead of Liger a kernel that moves those bytes once can get.

``--variants`` first sweeps the launch settings of the Galaxy kernels (block sizes, warps,
programs, fused-linear-CE chunk size) with the same GPU-time method. ``--profile`` stores the
per-kernel device times (torch.profiler) of every contender. The JSON holds everything; the table
printed last is the summary. Usage::

    python bench/bench_kernels.py --variants --profile --json results.json   # on a CUDA GPU
    TRITON_INTERPRET=1 python bench/bench_kernels.py --smoke                  # tiny shapes, CPU ok

On CPU (``--smoke`` only) Triton runs through its interpreter; times then show the script works,
not how fast anything is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Normalized max error (max|a - b| / max|b|) allowed vs the torch reference. In fp32 the errors are
# taken against a float64 truth instead, and twice torch's own fp32 error is allowed where that is
# larger: fp32 results of differently shaped matmuls differ by more than rounding.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# Rotate input copies until they span this many bytes (several times any L2).
ROTATE_BYTES = 512 * 2**20
# Contenders that are not Galaxy's; auto may use Triton for an op only if it is at least as fast.
RIVALS = ("torch", "torch-fused", "torch-compile", "liger")
# Not a contender: the bytes a memory-bound op must move, moved without arithmetic (``floor_steps``).
FLOOR = "copy-floor"


@dataclass
class Case:
    op: str
    shape: str
    model: str  # which model / shard the shape comes from
    make_args: Callable[[], list]  # fresh inputs; tensors that need grad are leaves
    impls: dict[str, Callable]  # name -> fn(*args) -> Tensor | tuple[Tensor, ...]
    # What any implementation must read and write in DRAM, from the inputs: (bytes of one tensor,
    # ((tensors read, tensors written) per launch: forward, then backward if it moves any)); None
    # where the op is bound by compute, not memory (fused linear + CE, LoRA).
    traffic: Callable[[list], tuple[int, tuple]] | None = None


@dataclass
class Result:
    op: str
    shape: str
    model: str
    impl: str
    wall_ms: list = field(default_factory=list)
    gpu_ms: list = field(default_factory=list)
    peak_mib: float | None = None
    max_err: float | None = None
    ok: bool | None = None
    note: str = ""
    kernels: list = field(default_factory=list)  # (name, device ms per step) from --profile
    moved_bytes: list | None = None  # copy-floor rows: bytes read + written per launch (forward, backward)

    @property
    def gpu(self) -> float | None:
        return statistics.median(self.gpu_ms) if self.gpu_ms else None

    @property
    def wall(self) -> float | None:
        return statistics.median(self.wall_ms) if self.wall_ms else None


@dataclass
class Report:
    device: str
    date: str
    commit: str
    torch: str
    triton: str | None
    liger: str | None
    dtype: str
    smoke: bool
    repeats: int
    results: list = field(default_factory=list)
    variants: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)
    notes: list = field(default_factory=list)


# ----------------------------------------------------------------------------- shapes

# tokens per rank: one 4096-token sequence (7B / 1B), or its half on an SP rank.
FULL = {
    "7B": dict(tokens=4096, hidden=4096, heads=32, kv_heads=32, head_dim=128, intermediate=11008, vocab=32000),
    "1B": dict(tokens=4096, hidden=2048, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256),
}
SMOKE = {"tiny": dict(tokens=48, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=257)}


def shape_grid(smoke: bool) -> list[tuple[str, dict]]:
    """(label, sizes): the full models, their TP-2 shards (heads and intermediate halved) and
    SP-2 shards (tokens halved)."""
    grid = []
    for name, s in (SMOKE if smoke else FULL).items():
        grid.append((name, s))
        grid.append((f"{name} TP/2", dict(s, heads=s["heads"] // 2, kv_heads=max(1, s["kv_heads"] // 2),
                                          intermediate=s["intermediate"] // 2)))
        grid.append((f"{name} SP/2", dict(s, tokens=s["tokens"] // 2)))
    return grid


# ----------------------------------------------------------------------------- cases


def _leaf(t: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    return t.detach().requires_grad_(requires_grad)


def rope_tables(seq: int, head_dim: int, device, dtype, base: float = 10000.0):
    """HF LLaMA cos/sin for positions 0..seq-1: [1, seq, head_dim], halves duplicated."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None].to(dtype), emb.sin()[None].to(dtype)


def _first_halves(*tables: torch.Tensor) -> list[torch.Tensor]:
    """The first halves of ``rotate_half`` tables (their halves are equal), as Galaxy's model passes them."""
    return [t[..., : t.shape[-1] // 2] for t in tables]


def _targets(n: int, vocab: int, device) -> torch.Tensor:
    t = torch.randint(0, vocab, (n,), device=device)
    t[: n // 10] = -100  # a prompt-like prefix of ignored tokens
    return t


def _compiled(fn):
    """torch.compile of a reference (compiles at the first call, in the correctness check)."""
    return torch.compile(fn, dynamic=False)


def build_cases(dtype: torch.dtype, device: torch.device, liger, smoke: bool) -> list[Case]:
    import galaxy.kernels as K
    from galaxy.kernels import reference as R

    def randn(*s, scale=1.0):
        return torch.randn(*s, device=device, dtype=torch.float32).mul_(scale).to(dtype)

    L = liger  # liger_kernel.transformers.functional, or None
    cases = []
    grid = shape_grid(smoke)
    by_label = dict(grid)

    def add(op, shape, model, make_args, impls, traffic=None):
        cases.append(Case(op, shape, model, make_args, {k: v for k, v in impls.items() if v is not None}, traffic))

    # RMSNorm: every model's hidden size, full sequence and SP shard.
    for label in [g for g in by_label if "TP" not in g]:
        s = by_label[label]
        n, h = s["tokens"], s["hidden"]
        add("rms_norm", f"[{n}, {h}]", label,
            lambda n=n, h=h: [_leaf(randn(n, h)), _leaf(1 + randn(h, scale=0.1))],
            {"galaxy-triton": lambda x, w: K.rms_norm(x, w, 1e-6, backend="triton"),
             "torch": lambda x, w: R.rms_norm(x, w, 1e-6),
             "torch-fused": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
             "torch-compile": _compiled(lambda x, w: R.rms_norm(x, w, 1e-6)),
             "liger": L and (lambda x, w: L.liger_rms_norm(x, w, 1e-6, in_place=False))},
            _norm_traffic)

    # LayerNorm (BERT): BERT-large hidden 1024 over 8 x 512 tokens.
    n, h = (48, 64) if smoke else (4096, 1024)
    add("layer_norm", f"[{n}, {h}]", "BERT-large",
        lambda n=n, h=h: [_leaf(randn(n, h)), _leaf(1 + randn(h, scale=0.1)), _leaf(randn(h, scale=0.1))],
        {"galaxy-triton": lambda x, w, b: K.layer_norm(x, w, b, 1e-5, backend="triton"),
         "torch": lambda x, w, b: R.layer_norm(x, w, b, 1e-5),
         "torch-fused": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
         "torch-compile": _compiled(lambda x, w, b: R.layer_norm(x, w, b, 1e-5)),
         "liger": L and (lambda x, w, b: L.liger_layer_norm(x, w, b, 1e-5))},
        _norm_traffic)

    # RoPE: q, k as the attention block makes them, [b, s, h, d] projections viewed [b, h, s, d].
    for label in [g for g in by_label if "SP" not in g]:
        s = by_label[label]
        n, hq, hk, d = s["tokens"], s["heads"], s["kv_heads"], s["head_dim"]

        def rope_args(n=n, hq=hq, hk=hk, d=d):
            cos, sin = rope_tables(n, d, device, dtype)
            q = randn(1, n, hq, d).transpose(1, 2)
            k = randn(1, n, hk, d).transpose(1, 2)
            return [_leaf(q), _leaf(k), cos, sin]

        add("rope", f"q [1, {hq}, {n}, {d}] k [1, {hk}, {n}, {d}]", label, rope_args,
            # Galaxy's model passes the tables' first halves (RopeAt), Liger reads only those too.
            {"galaxy-triton": lambda q, k, c, s: K.apply_rope(q, k, *_first_halves(c, s), backend="triton"),
             "torch": R.apply_rope,
             "torch-compile": _compiled(R.apply_rope),
             "liger": L and (lambda q, k, c, s: L.liger_rope(q, k, c, s))},
            # q, k read and their rotations written, forward and backward alike.
            lambda a: (_tensor_bytes(a[:2]), ((1, 1), (1, 1))))

    # SwiGLU: separate gate/up and the packed [gate | up] of a fused projection; full and TP/2.
    for label in [g for g in by_label if "SP" not in g]:
        s = by_label[label]
        n, w = s["tokens"], s["intermediate"]
        add("swiglu", f"[{n}, {w}]", label, lambda n=n, w=w: [_leaf(randn(n, w)), _leaf(randn(n, w))],
            {"galaxy-triton": lambda g, u: K.swiglu(g, u, backend="triton"),
             "torch": R.swiglu,
             "torch-compile": _compiled(R.swiglu),
             "liger": L and (lambda g, u: L.liger_swiglu(g, u))},
            _swiglu_traffic)
        packed_ref = lambda gu: R.swiglu(*gu.chunk(2, dim=-1))  # noqa: E731
        add("swiglu_packed", f"[{n}, 2 x {w}]", label, lambda n=n, w=w: [_leaf(randn(n, 2 * w))],
            {"galaxy-triton": lambda gu: K.swiglu_packed(gu, backend="triton"),
             "torch": packed_ref,
             "torch-compile": _compiled(packed_ref),
             "liger": L and _liger_packed_swiglu()},
            _swiglu_traffic)

    # Cross-entropy over existing logits and the fused head + loss, at each vocabulary.
    for label in [g for g in by_label if "TP" not in g and "SP" not in g]:
        s = by_label[label]
        n, h, v = s["tokens"], s["hidden"], s["vocab"]
        add("cross_entropy", f"logits [{n}, {v}]", label,
            lambda n=n, v=v: [_leaf(randn(n, v, scale=2.0)), _targets(n, v, device)],
            {"galaxy-triton": lambda z, t: K.cross_entropy(z, t, backend="triton"),
             # The gradient written into the logits in forward, as Liger does.
             "galaxy-inplace": lambda z, t: K.cross_entropy(z, t, backend="triton", inplace=True),
             "torch": lambda z, t: R.cross_entropy(z, t),
             "torch-fused": lambda z, t: F.cross_entropy(z.float(), t),
             "torch-compile": _compiled(lambda z, t: R.cross_entropy(z, t)),
             # Liger writes the gradient into the logits in place (its memory saving).
             "liger": L and (lambda z, t: L.liger_cross_entropy(z, t, ignore_index=-100, reduction="mean"))},
            # The logits read once and their gradient written once, both in forward (the gradient
            # of a scalar loss is known there up to grad_output's scale).
            lambda a: (_tensor_bytes(a[:1]), ((1, 1),)))
    flce_shapes = [(label, by_label[label]["tokens"], by_label[label]["hidden"], by_label[label]["vocab"])
                   for label in by_label if "TP" not in label and "SP" not in label]
    if not smoke:  # the 128k vocabulary at 7B's hidden size (LLaMA-3-8B's head)
        flce_shapes.append(("8B head", 4096, 4096, 128256))
    for label, n, h, v in flce_shapes:
        add("fused_linear_cross_entropy", f"h [{n}, {h}] W [{v}, {h}]", label,
            lambda n=n, h=h, v=v: [_leaf(randn(n, h)), _leaf(randn(v, h, scale=0.02)), _targets(n, v, device)],
            {"galaxy-triton": lambda h_, w, t: K.fused_linear_cross_entropy(h_, w, t, backend="triton"),
             "torch": lambda h_, w, t: R.fused_linear_cross_entropy(h_, w, t),
             "torch-fused": lambda h_, w, t: F.cross_entropy(F.linear(h_, w).float(), t),
             "torch-compile": _compiled(lambda h_, w, t: R.fused_linear_cross_entropy(h_, w, t)),
             "liger": L and (lambda h_, w, t: L.liger_fused_linear_cross_entropy(h_, w, t, ignore_index=-100,
                                                                                reduction="mean"))})
    # LoRA linear (plain torch matmuls with a bracketed backward, no Triton): 7B q-projection, r=16.
    s = grid[0][1]
    n, h, rank = s["tokens"], s["hidden"], (4 if smoke else 16)
    add("lora_linear", f"x [{n}, {h}] W [{h}, {h}] r={rank}", grid[0][0],
        lambda n=n, h=h, rank=rank: [
            _leaf(randn(n, h)),
            randn(h, h, scale=h ** -0.5),  # frozen base weight
            _leaf(randn(rank, h, scale=h ** -0.5)),
            _leaf(randn(h, rank, scale=0.1)),
        ],
        {"galaxy-triton": lambda x, w, a, b: K.lora_linear(x, w, a, b, 2.0),
         "torch": lambda x, w, a, b: K.lora_linear(x, w, a, b, 2.0, backend="torch")})
    return cases


def _norm_traffic(args) -> tuple[int, tuple]:
    """x read and y written in forward; dy and x read and dx written in backward (the weights and
    per-row statistics are a row's worth, left out)."""
    return _tensor_bytes(args[:1]), ((1, 1), (2, 1))


def _swiglu_traffic(args) -> tuple[int, tuple]:
    """gate and up read, h written in forward; dh, gate and up read, dgate and dup written in backward."""
    return _tensor_bytes(args) // 2, ((2, 1), (3, 2))  # gate and up, separate or packed, are twice h


def _liger_packed_swiglu():
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction

    return lambda gu: LigerFusedGateUpSiLUMulFunction.apply(gu)


# ----------------------------------------------------------------------------- measurement


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _fwd_bwd(fn, args, grad_outs):
    """One forward + backward; returns outputs and the gradients of the grad-requiring args."""
    outs = _as_tuple(fn(*args))
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return outs, torch.autograd.grad(outs, wrt, grad_outs)


def _clone_args(args):
    """Fresh copies with the same strides (some kernels, Liger's, reuse inputs as scratch)."""
    def clone(a):
        if not isinstance(a, torch.Tensor):
            return a
        c = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a.detach())
        return _leaf(c, a.requires_grad) if a.requires_grad else c
    return [clone(a) for a in args]


def _float64_truth(fn, args, grad_outs) -> list[torch.Tensor]:
    """Outputs and input gradients of ``fn`` on the floating inputs upcast to float64."""
    def up(a):
        if not isinstance(a, torch.Tensor) or not a.is_floating_point():
            return a
        return _leaf(a.double(), a.requires_grad) if a.requires_grad else a.detach().double()
    outs, grads = _fwd_bwd(fn, [up(a) for a in args], tuple(g.double() for g in grad_outs))
    return [t.detach() for t in (*outs, *grads)]


def _normalized_err(got, want) -> float:
    got, want = got.double(), want.double()
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def wall_ms(fn, on_cuda: bool, warmup: int = 10, rep: int = 40) -> float:
    """Median ms of ``fn`` as triton's do_bench times it (host overhead included when larger)."""
    if on_cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def gpu_ms(steps: list[Callable], on_cuda: bool, host_ms: float, budget_ms: float = 25.0, tries: int = 4) -> float:
    """Device ms per step with the host running ahead: the steps (cycling over ``steps``) are queued
    behind a GPU sleep longer than the host needs to launch them, then timed with events. Where the
    sleep ended before the host had queued every step (a host stall: the GPU then waited, and the
    time would be the host's), the measurement is taken again behind a sleep twice as long."""
    if not on_cuda:
        return wall_ms(steps[0], False)
    count = max(len(steps), min(200, int(budget_ms / max(host_ms, 1e-3))))
    for attempt in range(tries):
        torch.cuda.synchronize()
        # ~1.9e6 cycles per ms at Hopper clocks; twice the host's launch time, at least 5 ms.
        torch.cuda._sleep(int(max(5.0, 2.0 * count * host_ms) * 2e6 * 2**attempt))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(count):
            steps[i % len(steps)]()
        queued_in_time = not start.query()  # the start event still waits behind the sleep
        end.record()
        end.synchronize()
        if queued_in_time:
            break
    return start.elapsed_time(end) / count


def peak_mib(fn, on_cuda: bool) -> float | None:
    if not on_cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / 2**20


def profile_kernels(fns: list[Callable], on_cuda: bool, steps: int = 3, top: int = 6) -> list:
    """The ``top`` device kernels of one step: (name, ms per step), the steps taken in turn over
    ``fns`` (copies of the inputs, as ``gpu_ms`` takes them)."""
    if not on_cuda:
        return []
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 1e3 / steps) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return [(name[:80], round(ms, 4)) for name, ms in rows[:top]]


def _tensor_bytes(args) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _pointwise(reads: int, writes: int, in_place: bool) -> Callable:
    """``writes`` outputs from ``reads`` inputs of one size, one add per input: no arithmetic to speak
    of. ``in_place`` writes them over the first inputs (as Liger's kernels write their results)."""
    def move(*inputs):
        total = inputs[0]
        for x in inputs[1:]:
            total = total + x
        outs = [total + float(j) for j in range(writes)]
        if not in_place:
            return outs
        for x, out in zip(inputs, outs):  # nothing returned: a returned input is written twice
            x.copy_(out)
    return move


def floor_steps(traffic: tuple[int, tuple], n_copies: int, device, how: str, compiled: bool) -> list[Callable]:
    """Steps that move an op's ``traffic`` (``Case.traffic``) with no arithmetic, one launch per launch
    of the op, over ``n_copies`` rotating buffers: the device's memcpy of as many bytes
    (``how="memcpy"``), or a pointwise kernel reading and writing as many bf16 tensors (``"pointwise"``,
    or ``"in place"`` over its inputs where it writes no more than it reads; Inductor's when
    ``compiled``): reads and writes need not cost the same, nor writes to new and to read addresses."""
    unit, launches = traffic
    if how == "memcpy":
        def pair(nbytes):
            src = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return src, torch.empty_like(src)
        copies = [[pair((r + w) * unit // 2) for r, w in launches] for _ in range(n_copies)]
        return [lambda pairs=pairs: [dst.copy_(src) for src, dst in pairs] for pairs in copies]
    moves = [_pointwise(r, w, how == "in place") for r, w in launches]
    kernels = [torch.compile(move, dynamic=False) if compiled else move for move in moves]
    inputs = [[[torch.zeros(unit // 2, dtype=torch.bfloat16, device=device) for _ in range(r)] for r, _ in launches]
              for _ in range(n_copies)]
    return [lambda xs=xs: [kernel(*x) for kernel, x in zip(kernels, xs)] for xs in inputs]


def run_case(case: Case, dtype, on_cuda: bool, repeats: int, profile: bool) -> list[Result]:
    args = case.make_args()
    torch_fn = case.impls["torch"]
    with torch.no_grad():
        ref_outs = _as_tuple(torch_fn(*_clone_args(args)))
    # Fixed random upstream gradients (ones for scalar losses), shared by every impl.
    grad_outs = tuple(torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in ref_outs)
    ref_outs, ref_grads = _fwd_bwd(torch_fn, _clone_args(args), grad_outs)
    expected = [t.detach() for t in (*ref_outs, *ref_grads)]
    del ref_outs, ref_grads
    bound = TOLERANCE[dtype]
    if dtype == torch.float32:
        truth = _float64_truth(torch_fn, _clone_args(args), grad_outs)
        bound = max(bound, 2 * max(_normalized_err(g, e) for g, e in zip(expected, truth)))
        expected = truth
    n_copies = 1 + min(7, ROTATE_BYTES // max(1, _tensor_bytes(args) + _tensor_bytes(grad_outs)))

    results, steps = [], {}
    for name, fn in case.impls.items():
        res = Result(case.op, case.shape, case.model, name)
        results.append(res)
        try:
            outs, grads = _fwd_bwd(fn, _clone_args(args), tuple(g.clone() for g in grad_outs))
            got = [*outs, *grads]
            if len(got) != len(expected):
                raise RuntimeError(f"returned {len(got)} outputs+grads, expected {len(expected)}")
            res.max_err = max(_normalized_err(g, e) for g, e in zip(got, expected))
            res.ok = res.max_err <= bound
            del outs, grads, got
            # Each contender times its own copies of the inputs and of the upstream gradients, both
            # rotated: in-place kernels (Liger's, galaxy-inplace) overwrite theirs, and in a training step
            # the upstream gradient is a fresh tensor, not one that stays in L2 from the last step.
            steps[name] = [lambda fn=fn, a=_clone_args(args), g=tuple(g.clone() for g in grad_outs): _fwd_bwd(fn, a, g)
                           for _ in range(n_copies)]
            res.peak_mib = peak_mib(steps[name][0], on_cuda)
            if profile:
                res.kernels = profile_kernels(steps[name], on_cuda)
        except Exception as err:  # noqa: BLE001 - one failing impl must not stop the table
            res.ok = False
            res.note = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
    floors, floor_by_way = {}, {}
    if case.traffic:
        unit, launches = case.traffic(args)
        moved = [unit * (r + w) for r, w in launches]
        floor = Result(case.op, case.shape, case.model, FLOOR, moved_bytes=moved,
                       note="the op's fewest bytes moved without arithmetic: "
                            + ", ".join(f"{r} read + {w} written x {unit / 1e6:.1f} MB" for r, w in launches))
        results.append(floor)
        # Inductor on CUDA (the Triton interpreter would time Python, not memory), even with the
        # torch-compile contender skipped.
        floors = {how: floor_steps((unit, launches), n_copies, args[0].device, how, compiled=on_cuda)
                  for how in ("memcpy", "pointwise", "in place")}
        for fs in floors.values():
            fs[0]()  # compiles the pointwise kernels before any timing
        if profile:
            floor.kernels = {how: profile_kernels(fs, on_cuda) for how, fs in floors.items()}
    # Repeats interleave the contenders, so a drift of the device shows in every spread.
    for _ in range(repeats):
        for res in results:
            if res.impl in steps:
                res.wall_ms.append(wall_ms(steps[res.impl][0], on_cuda))
                res.gpu_ms.append(gpu_ms(steps[res.impl], on_cuda, res.wall_ms[-1]))
        if floors:  # the fastest way, per repeat
            walls = {how: wall_ms(fs[0], on_cuda) for how, fs in floors.items()}
            gpus = {how: gpu_ms(fs, on_cuda, walls[how]) for how, fs in floors.items()}
            floor.wall_ms.append(min(walls.values()))
            floor.gpu_ms.append(min(gpus.values()))
            for how, ms in gpus.items():
                floor_by_way.setdefault(how, []).append(ms)
    if floors:
        floor.note += "; gpu ms " + ", ".join(f"{how} {statistics.median(ms):.4f}" for how, ms in floor_by_way.items())
    del steps, floors
    if on_cuda:
        torch.cuda.empty_cache()
    return results


# ----------------------------------------------------------------------------- variants


def variant_sweeps(dtype, device, on_cuda: bool, smoke: bool, kernels: list[str] | None = None) -> list[dict]:
    """GPU ms of the Galaxy kernels' launch settings (the module defaults come from these);
    ``kernels`` (any of swiglu, rope, ce, rms_norm, flce) limits the sweep."""
    import galaxy.kernels as K
    from galaxy.kernels import triton_cross_entropy as ce, triton_norms as norms, triton_rope as rope
    from galaxy.kernels import triton_swiglu as sw

    def randn(*s, scale=1.0):
        return torch.randn(*s, device=device, dtype=torch.float32).mul_(scale).to(dtype)

    def timed(name, setting, fn, **extra):
        """``fn``: one step, or a list of steps on different copies of the inputs, taken in turn so
        that inputs smaller than L2 are not read from it (as in the main bench)."""
        fns = fn if isinstance(fn, list) else [fn]
        host = wall_ms(fns[0], on_cuda)
        ms = [gpu_ms(fns, on_cuda, host) for _ in range(3)]
        row = dict(kernel=name, setting=setting, gpu_ms=ms, **extra)
        rows.append(row)
        print(f"variant {name:<34} {setting:<28} {statistics.median(ms):8.4f} ms", file=sys.stderr, flush=True)

    def want(kernel):
        return not kernels or kernel in kernels

    rows: list[dict] = []
    n = 48 if smoke else 4096
    widths = ([96] if smoke else [11008, 5504]) if want("swiglu") else []
    for w in widths:
        g, u, dy = randn(n, w), randn(n, w), randn(n, w)
        gu = randn(n, 2 * w)
        dg, du, dgu = torch.empty_like(g), torch.empty_like(u), torch.empty_like(gu)
        for block in (1024, 2048, 4096):
            for warps in (4, 8, 16):
                s = f"block={block} warps={warps}"
                timed(f"swiglu fwd [{n},{w}]", s, lambda: sw.swiglu_forward(g, u, block, warps))
                timed(f"swiglu bwd [{n},{w}]", s, lambda: sw.swiglu_backward(dy, g, u, dg, du, block, warps))
                timed(f"swiglu_packed fwd [{n},2x{w}]", s,
                      lambda: sw.swiglu_forward(gu[:, :w], gu[:, w:], block, warps))
                timed(f"swiglu_packed bwd [{n},2x{w}]", s,
                      lambda: sw.swiglu_backward(dy, gu[:, :w], gu[:, w:], dgu[:, :w], dgu[:, w:], block, warps))
    heads = ([(4, 2, 16)] if smoke else [(32, 32, 128), (32, 8, 64), (16, 16, 128), (16, 4, 64)]) if want("rope") else []
    for hq, hk, d in heads:
        cos, sin = _first_halves(*rope_tables(n, d, device, dtype))
        # The attention block's layout: [b, s, h, d] projections viewed as [b, h, s, d]; copies in turn.
        # Forward and backward (the gradients in the same layout): forward alone picked two tile rules
        # that the step did not confirm (triton_rope.rope_tiles).
        copies = 1 + min(7, ROTATE_BYTES // (2 * n * (hq + hk) * d * dtype.itemsize))
        qks = [[randn(1, n, h, d).transpose(1, 2) for h in (hq, hk, hq, hk)] for _ in range(copies)]

        def step(q, k, dq, dk, p=None, w=None):
            rope.rope_launch(q, k, cos, sin, False, p, w)
            rope.rope_launch(dq, dk, cos, sin, True, p, w)

        timed(f"rope fwd+bwd q[{hq},{d}] k[{hk}]", "default (rope_tiles)", [lambda a=a: step(*a) for a in qks])
        for positions in (1, 2, 4):
            for warps in (1, 2, 4, 8):
                timed(f"rope fwd+bwd q[{hq},{d}] k[{hk}]", f"positions={positions} warps={warps}",
                      [lambda a=a, p=positions, w=warps: step(*a, p, w) for a in qks])
        del qks
    vocabs = ([257] if smoke else [32000, 128256]) if want("ce") else []
    for v in vocabs:
        z, t = randn(n, v, scale=2.0), _targets(n, v, device)
        grad, denom = torch.empty_like(z), torch.full((), float(n), device=device)
        for block in (8192, 16384):
            for warps in (4, 8, 16):
                timed(f"ce loss [{n},{v}]", f"block={block} warps={warps}",
                      lambda: ce.ce_forward_rows(z, t, -100, None, None, block, warps))
        for block in (8192, 16384, 32768):
            for warps in (8, 16, 32):
                timed(f"ce loss+grad [{n},{v}]", f"block={block} warps={warps}",
                      lambda: ce.ce_forward_rows(z, t, -100, grad, denom, block, warps))
        for g in (1.0, 2.0):
            timed(f"scale_rows_ [{n},{v}]", f"g={g}", lambda: ce.scale_rows_(grad, torch.full((), g, device=device)))
    hidden = ([64] if smoke else [4096, 2048]) if want("rms_norm") else []
    for h in hidden:
        w = 1 + randn(h, scale=0.1)
        rstd = torch.rand(n, device=device) + 0.5
        xdys = [(randn(n, h), randn(n, h)) for _ in range(1 + min(7, ROTATE_BYTES // (2 * n * h * dtype.itemsize)))]
        for per_sm in (1, 2, 4, 8):
            for stages in (None, 3, 4, 5):  # None: Triton's default for the row loop
                def bwd(x, dy, per_sm=per_sm, stages=stages):
                    _, partial = norms.rms_norm_backward(dy, x, w, rstd, per_sm, stages)
                    return norms.sum_partials(partial, (w.dtype,))
                timed(f"rms_norm bwd + dw sum [{n},{h}]", f"programs_per_sm={per_sm} stages={stages}",
                      [lambda x=x, dy=dy, bwd=bwd: bwd(x, dy) for x, dy in xdys])
        _, partial = norms.rms_norm_backward(xdys[0][1], xdys[0][0], w, rstd)
        if h == hidden[-1]:  # LayerNorm at BERT-large's hidden size
            lh = min(h, 1024)
            lw, mean = w[:lh], torch.randn(n, device=device)
            xdys_ln = [(x[:, :lh].contiguous(), dy[:, :lh].contiguous()) for x, dy in xdys]
            for per_sm in (2, 4, 8):
                for stages in (None, 3, 4, 5):
                    def ln_bwd(x, dy, per_sm=per_sm, stages=stages):
                        _, partials = norms.layer_norm_backward(dy, x, lw, mean, rstd, per_sm, stages)
                        return norms.sum_partials(partials, (lw.dtype, lw.dtype))
                    timed(f"layer_norm bwd + dw, db sum [{n},{lh}]", f"programs_per_sm={per_sm} stages={stages}",
                          [lambda x=x, dy=dy, f=ln_bwd: f(x, dy) for x, dy in xdys_ln])
        del xdys
        timed(f"rms_norm dw sum [{partial.shape[0]},{h}]", "torch sum(0).to", lambda: partial.sum(0).to(w.dtype))
        for block_c in (8, 16, 32):
            for block_p in (32, 64, 128):
                timed(f"rms_norm dw sum [{partial.shape[0]},{h}]", f"block_c={block_c} block_p={block_p}",
                      lambda: norms.sum_partials(partial, (w.dtype,), block_c, block_p))
    flce = (([(48, 64, 257)] if smoke else [(4096, 4096, 32000), (4096, 4096, 128256), (4096, 2048, 128256)])
            if want("flce") else [])
    for n_, h, v in flce:
        hh, w, t = _leaf(randn(n_, h)), _leaf(randn(v, h, scale=0.02)), _targets(n_, v, device)
        for chunk in ((8, 16, 48) if smoke else (256, 512, 1024, 2048, 4096)):
            def step(chunk=chunk):
                loss = K.fused_linear_cross_entropy(hh, w, t, chunk_size=chunk, backend="triton")
                return torch.autograd.grad(loss, [hh, w])
            timed(f"flce h[{n_},{h}] W[{v}]", f"chunk={chunk}", step, peak_mib=peak_mib(step, on_cuda))
    return rows


# ----------------------------------------------------------------------------- verdicts and output


def verdicts(results: list[Result]) -> list[dict]:
    """Per op and shape: Galaxy's GPU ms against the fastest rival and against Liger. ``wins``
    means Galaxy's median is at most the fastest rival's, or their [min, max] ranges overlap.
    For memory-bound ops, ``liger_over_floor`` is Liger's time over the floor's: the most a kernel
    moving the op's fewest bytes at the floor's speed could lead Liger by (1.1 or more for a 10%
    lead to be possible)."""
    rows = []
    keys = sorted({(r.op, r.shape, r.model) for r in results}, key=lambda k: [r.op for r in results].index(k[0]))
    for op, shape, model in keys:
        group = {r.impl: r for r in results if (r.op, r.shape, r.model) == (op, shape, model) and r.ok and r.gpu_ms}
        rivals = {k: v for k, v in group.items() if k in RIVALS}
        if not rivals:
            continue
        best_name, best = min(rivals.items(), key=lambda kv: kv[1].gpu)
        liger = group.get("liger")
        floor = next((r for r in results if (r.op, r.shape, r.model, r.impl) == (op, shape, model, FLOOR)
                      and r.gpu_ms), None)
        for impl, ours in group.items():
            if not impl.startswith("galaxy"):
                continue
            rows.append(dict(
                op=op, shape=shape, model=model, impl=impl, galaxy_ms=ours.gpu, best_rival=best_name,
                best_rival_ms=best.gpu, wins=ours.gpu <= best.gpu or min(ours.gpu_ms) <= max(best.gpu_ms),
                vs_liger=(liger.gpu / ours.gpu) if liger else None,
                floor_ms=floor.gpu if floor else None,
                liger_over_floor=(liger.gpu / floor.gpu) if liger and floor else None,
            ))
    return rows


def _fmt(v, width: int, spec: str) -> str:
    text = "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
    return text.rjust(width)


def _spread(values: list) -> str:
    return f"[{min(values):.3f}, {max(values):.3f}]" if values else "-"


def print_table(results: list[Result], verdict_rows: list[dict]) -> None:
    header = (f"{'op':<26} {'model':<10} {'impl':<14} {'gpu ms':>8} {'[min, max]':>18} {'wall ms':>8} "
              f"{'[min, max]':>18} {'peak MiB':>9} {'max err':>9}  status")
    print(header)
    print("-" * len(header))
    for r in results:
        status = "ok" if r.ok else ("FAIL" if r.ok is False else "")
        print(f"{r.op:<26} {r.model:<10} {r.impl:<14} {_fmt(r.gpu, 8, '.3f')} {_spread(r.gpu_ms):>18} "
              f"{_fmt(r.wall, 8, '.3f')} {_spread(r.wall_ms):>18} {_fmt(r.peak_mib, 9, '.1f')} "
              f"{_fmt(r.max_err, 9, '.1e')}  {status} {r.note}")
    print()
    print(f"{'op':<26} {'model':<10} {'impl':<14} {'gpu ms':>8} {'best rival':>14} {'ms':>8} {'x liger':>8} "
          f"{'floor ms':>9} {'liger/floor':>11}  wins")
    for v in verdict_rows:
        print(f"{v['op']:<26} {v['model']:<10} {v['impl']:<14} {v['galaxy_ms']:8.3f} {v['best_rival']:>14} "
              f"{v['best_rival_ms']:8.3f} {_fmt(v['vs_liger'], 8, '.2f')} {_fmt(v['floor_ms'], 9, '.4f')} "
              f"{_fmt(v['liger_over_floor'], 11, '.2f')}  {'yes' if v['wins'] else 'no'}")


def _load_liger(on_cuda: bool, notes: list):
    try:
        import liger_kernel  # noqa: F401
        from liger_kernel.transformers import functional as liger_functional
    except ImportError as err:
        notes.append(f"Liger-Kernel not importable ({err}): its columns are skipped (pip install liger-kernel)")
        return None, None
    from importlib.metadata import PackageNotFoundError, version

    try:
        liger_version = version("liger_kernel")
    except PackageNotFoundError:
        liger_version = "unknown"
    if not on_cuda:
        notes.append("Liger-Kernel needs CUDA tensors: skipped on this device")
        return None, liger_version
    return liger_functional, liger_version


def _write(path: str | None, report: Report) -> None:
    if path:
        data = asdict(report)
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU with TRITON_INTERPRET=1")
    parser.add_argument("--json", help="write results to this JSON file (rewritten after every case)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--only", nargs="*", help="ops to run (default: all; the flag alone: none, e.g. "
                        "with --variants)")
    parser.add_argument("--skip", nargs="*", default=[], help="contenders to leave out (e.g. torch-compile)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per contender, interleaved")
    parser.add_argument("--variants", nargs="*", help="first sweep the Galaxy kernels' launch settings "
                        "(optionally only these: swiglu rope ce rms_norm flce)")
    parser.add_argument("--profile", action="store_true", help="store each contender's per-kernel device times")
    parser.add_argument("--commit", default=os.environ.get("GALAXY_COMMIT", "unknown"), help="recorded in the JSON")
    args = parser.parse_args(argv)

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        if not args.smoke:
            parser.error("no CUDA device: only --smoke runs on CPU (with the Triton interpreter)")
        # Must be set before the first Triton kernel module is imported (kernels load lazily).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = DTYPES[args.dtype]
    try:
        import triton
    except ImportError:
        print("triton is not installed: `pip install triton`", file=sys.stderr)
        return 2

    report = Report(
        device=torch.cuda.get_device_name(device) if on_cuda else f"cpu ({platform.machine()}, Triton interpreter)",
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=args.commit,
        torch=torch.__version__, triton=triton.__version__, liger=None, dtype=args.dtype, smoke=args.smoke,
        repeats=args.repeats,
    )
    liger, report.liger = _load_liger(on_cuda, report.notes)
    if not on_cuda:
        report.notes.append("CPU run: no peak-memory numbers, times are the interpreter's")

    torch.manual_seed(0)
    if args.variants is not None:
        report.variants = variant_sweeps(dtype, device, on_cuda, args.smoke, args.variants)
        _write(args.json, report)
    compile_ok = on_cuda and "torch-compile" not in args.skip  # inductor on the CPU interpreter: not a measure
    cases = build_cases(dtype, device, liger, args.smoke)
    for case in cases:
        for skipped in [*args.skip, *([] if compile_ok else ["torch-compile"])]:
            case.impls.pop(skipped, None)
    if args.only is not None:
        unknown = set(args.only) - {c.op for c in cases}
        if unknown:
            parser.error(f"unknown ops {sorted(unknown)}; choose from {sorted({c.op for c in cases})}")
        cases = [c for c in cases if c.op in args.only]

    # The floors compile one pointwise function per shape, more recompiles of it than dynamo's
    # default limit (past which it would run eager without saying so in the numbers).
    with torch._dynamo.config.patch(recompile_limit=256):
        for case in cases:
            print(f"running {case.op} {case.model} {case.shape} ...", file=sys.stderr, flush=True)
            report.results.extend(run_case(case, dtype, on_cuda, args.repeats, args.profile))
            _write(args.json, report)
    report.verdicts = verdicts(report.results)

    print(f"device: {report.device} | {report.date} | commit {report.commit} | torch {report.torch} | "
          f"triton {report.triton} | liger {report.liger} | {report.dtype} | {args.repeats} repeats")
    print_table(report.results, report.verdicts)
    for note in report.notes:
        print(f"note: {note}")
    _write(args.json, report)
    if args.json:
        print(f"wrote {args.json}")
    failed = [r for r in report.results if r.ok is False]
    if failed:
        print(f"{len(failed)} implementation(s) failed the correctness check or errored", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
