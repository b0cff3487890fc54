"""Other designs of the cross-entropy loss + gradient row kernel, measured against Galaxy's and Liger's.

Galaxy's kernel (``galaxy/kernels/triton_cross_entropy.py``) gives one program a row: an online
softmax over vocab blocks, the last block kept in registers, the others re-read from L2 last to
first to write the gradient. At 128k vocab it trails the copy floor by ~25% on H100 (0.85 against
0.66 ms). Each design here tests one explanation of that gap; all were slower or level (numbers and
the Nsight Compute profile: docs/benchmarks-log.md, issue 17). Kept so they are not tried again blind.

``lane``        the online softmax kept per lane (a running max and sum per element slot, one exp per
                element: ``exp(-|x - m|)`` serves both the rescale and the new term), reduced across
                the program once per row: no block reductions and barriers inside the loop.
``persistent``  the library kernel's body over rows ``pid, pid + P, ...`` with fewer programs P than
                rows in flight now: fewer rows sharing L2 between their two reads.
``tail``        the row's last ``TAIL`` columns held in registers in the logits' dtype (bf16: half
                the registers of fp32), so only the head is re-read.
``ablation``    the library kernel with its exps removed from one pass or both (wrong numbers, timing
                only: how much of the time the special-function unit costs) or with the next block's
                load issued before the current block is reduced (``prefetch``).

Kernel time is the profiler's device time of the design's kernel per call, over copies of the logits.
Usage::

    python bench/ce_designs.py --json out.json          # on a CUDA GPU (Liger compared if importable)
    TRITON_INTERPRET=1 python bench/ce_designs.py --smoke   # numerics of every design on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if __package__ in (None, ""):  # run as a script from anywhere: make the repo importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from galaxy.kernels import triton_cross_entropy as ce  # noqa: E402

IGNORE = -100


@triton.jit
def _row(LOGITS, stride_l, GRAD, stride_g, TARGETS, row):
    """A row's logits and gradient pointers and its target."""
    return LOGITS + row * stride_l, GRAD + row * stride_g, tl.load(TARGETS + row)


@triton.jit
def _ignored_row(LOSS, grad_ptr, row, n_cols, BLOCK_V: tl.constexpr):
    tl.store(LOSS + row, 0.0)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(grad_ptr + cols, tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _finish_row(LOSS, DENOM, row, row_ptr, grad_ptr, target, n_cols, lse, x_last, last_cols, last_mask, head,
                BLOCK_V: tl.constexpr):
    """Loss, then the gradient: the kept block from registers, the head's blocks re-read last to first."""
    target_ok = (target >= 0) & (target < n_cols)
    x_target = tl.load(row_ptr + tl.where(target_ok, target, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(target_ok, lse - x_target, float("nan")))
    inv_denom = 1.0 / tl.load(DENOM)
    g_last = (tl.exp(x_last - lse) - tl.where(last_cols == target, 1.0, 0.0)) * inv_denom
    tl.store(grad_ptr + last_cols, g_last.to(grad_ptr.dtype.element_ty), mask=last_mask, eviction_policy="evict_first")
    for i in range(BLOCK_V, head + BLOCK_V, BLOCK_V):
        cols = (head - i) + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, eviction_policy="evict_first").to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * inv_denom
        tl.store(grad_ptr + cols, g.to(grad_ptr.dtype.element_ty), eviction_policy="evict_first")


@triton.jit
def _lane_kernel(LOGITS, stride_l, GRAD, stride_g, TARGETS, LOSS, DENOM, n_cols, ignore_index,
                 BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr, grad_ptr, target = _row(LOGITS, stride_l, GRAD, stride_g, TARGETS, row)
    if target == ignore_index:
        _ignored_row(LOSS, grad_ptr, row, n_cols, BLOCK_V)
    else:
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        d = tl.zeros([BLOCK_V], tl.float32)
        last = (tl.cdiv(n_cols, BLOCK_V) - 1) * BLOCK_V
        for start in range(0, last, BLOCK_V):
            x = tl.load(row_ptr + start + tl.arange(0, BLOCK_V), eviction_policy="evict_last").to(tl.float32)
            e = tl.exp(-tl.abs(x - m))  # exp(m - x) where x is the new max, exp(x - m) otherwise
            d = tl.where(x > m, d * e + 1.0, d + e)
            m = tl.maximum(m, x)
        last_cols = last + tl.arange(0, BLOCK_V)
        last_mask = last_cols < n_cols
        x_last = tl.load(row_ptr + last_cols, mask=last_mask, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(tl.max(m, axis=0), tl.max(x_last, axis=0))
        lse = mx + tl.log(tl.sum(d * tl.exp(m - mx), axis=0) + tl.sum(tl.exp(x_last - mx), axis=0))
        _finish_row(LOSS, DENOM, row, row_ptr, grad_ptr, target, n_cols, lse, x_last, last_cols, last_mask, last,
                    BLOCK_V)


@triton.jit
def _online_row(row_ptr, n_cols, BLOCK_V: tl.constexpr, EXP: tl.constexpr, PREFETCH: tl.constexpr):
    """The library kernel's first pass: (lse, last block, its columns, its mask, head end)."""
    m = float("-inf")
    d = 0.0
    last = (tl.cdiv(n_cols, BLOCK_V) - 1) * BLOCK_V
    x_next = tl.load(row_ptr + tl.arange(0, BLOCK_V), mask=(tl.arange(0, BLOCK_V) < last) & PREFETCH,
                     other=float("-inf"), eviction_policy="evict_last")
    for start in range(0, last, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        if PREFETCH:
            x = x_next.to(tl.float32)
            x_next = tl.load(row_ptr + cols + BLOCK_V, mask=cols + BLOCK_V < last, other=float("-inf"),
                             eviction_policy="evict_last")
        else:
            x = tl.load(row_ptr + cols, eviction_policy="evict_last").to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        if EXP:
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        else:  # ablation: the same reductions without the exps (a wrong sum)
            d = d + tl.sum(x - m_new, axis=0)
        m = m_new
    last_cols = last + tl.arange(0, BLOCK_V)
    last_mask = last_cols < n_cols
    x_last = tl.load(row_ptr + last_cols, mask=last_mask, other=float("-inf")).to(tl.float32)
    m_new = tl.maximum(m, tl.max(x_last, axis=0))
    d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x_last - m_new), axis=0)
    return m_new + tl.log(d), x_last, last_cols, last_mask, last


@triton.jit
def _persistent_kernel(LOGITS, stride_l, GRAD, stride_g, TARGETS, LOSS, DENOM, n_rows, n_cols, ignore_index,
                       BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(0, tl.cdiv(n_rows - pid, tl.num_programs(0))):
        row = (pid + i * tl.num_programs(0)).to(tl.int64)
        row_ptr, grad_ptr, target = _row(LOGITS, stride_l, GRAD, stride_g, TARGETS, row)
        if target == ignore_index:
            _ignored_row(LOSS, grad_ptr, row, n_cols, BLOCK_V)
        else:
            lse, x_last, last_cols, last_mask, last = _online_row(row_ptr, n_cols, BLOCK_V, True, False)
            _finish_row(LOSS, DENOM, row, row_ptr, grad_ptr, target, n_cols, lse, x_last, last_cols, last_mask,
                        last, BLOCK_V)


@triton.jit
def _ablation_kernel(LOGITS, stride_l, GRAD, stride_g, TARGETS, LOSS, DENOM, n_cols, ignore_index,
                     BLOCK_V: tl.constexpr, EXP1: tl.constexpr, EXP2: tl.constexpr, PREFETCH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr, grad_ptr, target = _row(LOGITS, stride_l, GRAD, stride_g, TARGETS, row)
    if target == ignore_index:
        _ignored_row(LOSS, grad_ptr, row, n_cols, BLOCK_V)
    else:
        lse, x_last, last_cols, last_mask, last = _online_row(row_ptr, n_cols, BLOCK_V, EXP1, PREFETCH)
        if EXP2:
            _finish_row(LOSS, DENOM, row, row_ptr, grad_ptr, target, n_cols, lse, x_last, last_cols, last_mask,
                        last, BLOCK_V)
        else:  # ablation: the second pass without its exps (wrong numbers)
            tl.store(LOSS + row, lse)
            for i in range(0, last + BLOCK_V, BLOCK_V):
                cols = (last - i) + tl.arange(0, BLOCK_V)
                mask = cols < n_cols
                x = tl.load(row_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                tl.store(grad_ptr + cols, (x - lse).to(GRAD.dtype.element_ty), mask=mask,
                         eviction_policy="evict_first")


@triton.jit
def _tail_kernel(LOGITS, stride_l, GRAD, stride_g, TARGETS, LOSS, DENOM, n_cols, ignore_index,
                 BLOCK_V: tl.constexpr, TAIL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr, grad_ptr, target = _row(LOGITS, stride_l, GRAD, stride_g, TARGETS, row)
    if target == ignore_index:
        _ignored_row(LOSS, grad_ptr, row, n_cols, BLOCK_V)
    else:
        # The tail starts at a multiple of BLOCK_V (aligned loads); the head before it is streamed.
        head = tl.maximum(tl.cdiv(n_cols - TAIL, BLOCK_V), 0) * BLOCK_V
        tail_cols = head + tl.arange(0, TAIL)
        tail_mask = tail_cols < n_cols
        x_tail = tl.load(row_ptr + tail_cols, mask=tail_mask, other=float("-inf"), eviction_policy="evict_first")
        m = tl.max(x_tail, axis=0).to(tl.float32)
        d = tl.sum(tl.exp(x_tail.to(tl.float32) - m), axis=0)
        for start in range(0, head, BLOCK_V):
            x = tl.load(row_ptr + start + tl.arange(0, BLOCK_V), eviction_policy="evict_last").to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        _finish_row(LOSS, DENOM, row, row_ptr, grad_ptr, target, n_cols, m + tl.log(d), x_tail.to(tl.float32),
                    tail_cols, tail_mask, head, BLOCK_V)


def run_design(design: str, z, t, grad, denom, block: int, warps: int, **opt) -> torch.Tensor:
    """Per-row losses; the gradient written into ``grad``. ``opt``: programs (persistent), tail (tail),
    exp1 / exp2 / prefetch (ablation)."""
    n, v = z.shape
    loss = torch.empty(n, dtype=torch.float32, device=z.device)
    if design == "galaxy":
        return ce.ce_forward_rows(z, t, IGNORE, grad, denom, block, warps)
    block = min(block, triton.next_power_of_2(v))
    common = (z, z.stride(0), grad, grad.stride(0), t, loss, denom)
    if design == "lane":
        _lane_kernel[(n,)](*common, v, IGNORE, BLOCK_V=block, num_warps=warps)
    elif design == "persistent":
        _persistent_kernel[(min(n, opt["programs"]),)](*common, n, v, IGNORE, BLOCK_V=block, num_warps=warps)
    elif design == "ablation":
        _ablation_kernel[(n,)](*common, v, IGNORE, BLOCK_V=block, EXP1=opt.get("exp1", True),
                               EXP2=opt.get("exp2", True), PREFETCH=opt.get("prefetch", False), num_warps=warps)
    elif design == "tail":
        tail = min(opt["tail"], triton.next_power_of_2(v))
        _tail_kernel[(n,)](*common, v, IGNORE, BLOCK_V=min(block, tail), TAIL=tail, num_warps=warps)
    else:
        raise ValueError(f"unknown design {design!r}")
    return loss


def designs(smoke: bool, sms: int, vocab: int) -> list[tuple[str, int, int, dict]]:
    """(design, block, warps, options): the settings measured on 2026-11-26."""
    if smoke:
        return [("galaxy", 64, 4, {}), ("lane", 64, 4, {}), ("persistent", 64, 4, dict(programs=3)),
                ("ablation", 64, 4, dict(prefetch=True)), ("tail", 32, 4, dict(tail=64)),
                ("tail", 64, 4, dict(tail=256))]
    rows = [("galaxy", b, w, {}) for b, w in ((8192, 8), (16384, 16), (32768, 32))]
    rows += [("lane", b, w, {}) for b, w in ((4096, 8), (8192, 16), (16384, 16), (16384, 32))]
    rows += [("persistent", b, w, dict(programs=int(sms * per_sm * f)))
             for b, w, per_sm in ((32768, 32, 1), (16384, 16, 2)) for f in (0.5, 0.75, 1.0)]
    rows += [("ablation", b, w, opt) for b, w in ((32768, 32), (16384, 16))
             for opt in (dict(exp2=False), dict(exp1=False), dict(exp1=False, exp2=False), dict(prefetch=True))]
    tails = (32768, 16384) if vocab <= 32768 else (65536, 32768)
    rows += [("tail", 8192, w, dict(tail=tail)) for tail in tails for w in (16, 32)]
    return rows


def kernel_ms(fn, steps: int = 30) -> float:
    """Device ms per call of the call's longest kernel (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return max(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / steps / 1000.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, numerics only (CPU with TRITON_INTERPRET=1)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--commit", default=os.environ.get("GALAXY_COMMIT", "unknown"))
    args = parser.parse_args(argv)
    on_cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if on_cuda else "cpu")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_cuda else 4
    torch.manual_seed(0)
    rows, failures = [], 0
    for n, v in ([(5, 257), (4, 1000)] if args.smoke else [(4096, 32000), (4096, 128256)]):
        z = torch.randn(n, v, device=device).mul_(2).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), device=device)
        t[: max(1, n // 10)] = IGNORE
        denom = (t != IGNORE).sum().float()
        ref = F.cross_entropy(z.float(), t, reduction="none", ignore_index=IGNORE)
        zr = z.float().requires_grad_()
        F.cross_entropy(zr, t, ignore_index=IGNORE).backward()
        grad = torch.empty_like(z)
        for design, block, warps, opt in designs(args.smoke, sms, v):
            grad.fill_(float("nan"))
            loss = run_design(design, z, t, grad, denom, block, warps, **opt)
            exact = design != "ablation" or opt.get("exp1", True) and opt.get("exp2", True)
            loss_err = (loss - ref).abs().max().item()
            grad_err = ((grad.float() - zr.grad).abs().max() / zr.grad.abs().max()).item()
            ok = not exact or (loss_err < 1e-4 and grad_err < 1e-2)
            failures += not ok
            row = dict(vocab=v, design=design, block=block, warps=warps, **opt, loss_err=loss_err, grad_err=grad_err,
                       exact=exact, ok=ok)
            if on_cuda:
                row["kernel_ms"] = kernel_ms(lambda: run_design(design, z, t, grad, denom, block, warps, **opt))
            rows.append(row)
            print(f"{v:>7} {design:<10} block={block:<6} warps={warps:<3} {opt!s:<36} "
                  f"{row.get('kernel_ms', float('nan')):8.4f} ms  loss err {loss_err:.1e} grad err {grad_err:.1e}"
                  f"{'' if ok else '  WRONG'}", flush=True)
        if on_cuda:
            try:
                from liger_kernel.transformers.functional import liger_cross_entropy
            except ImportError as exc:
                print(f"Liger not importable ({exc}): no Liger row", flush=True)
            else:
                zz = z.clone().requires_grad_()

                def liger_step():
                    zz.grad = None
                    liger_cross_entropy(zz, t, ignore_index=IGNORE, reduction="mean").backward()

                rows.append(dict(vocab=v, design="liger", kernel_ms=kernel_ms(liger_step)))
                print(f"{v:>7} liger {rows[-1]['kernel_ms']:.4f} ms", flush=True)
    if args.json:
        meta = dict(device=torch.cuda.get_device_name() if on_cuda else "cpu", commit=args.commit,
                    torch=torch.__version__, triton=triton.__version__)
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
