"""Bytes each cross-entropy kernel moves through DRAM and L2, under Nsight Compute: whether the second
pass of a two-pass row kernel re-reads the row from L2 or from memory (the roofline question of issue 17).

    ncu --clock-control none --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,\
gpu__time_duration.sum python3 bench/device/ncu_cross_entropy.py

Runs each kernel once, bf16 logits [4096, V] with 10% ignored targets, after one warm-up call.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from galaxy.kernels import triton_cross_entropy as ce  # noqa: E402


def main() -> None:
    try:
        from liger_kernel.ops.cross_entropy import cross_entropy_forward
    except ImportError:
        cross_entropy_forward = None
    for vocab in (32000, 128256):
        z = torch.randn(4096, vocab, device="cuda").mul_(2).to(torch.bfloat16)
        t = torch.randint(0, vocab, (4096,), device="cuda")
        t[:409] = -100
        grad, denom = torch.empty_like(z), torch.full((), 3687.0, device="cuda")
        for _ in range(2):  # warm-up (compile), then the profiled launch
            ce.ce_forward_rows(z, t, -100, grad, denom)
            ce.ce_forward_rows(z, t, -100, None)
            if cross_entropy_forward is not None:
                zl = z.clone().requires_grad_()  # Liger writes the gradient only for such logits
                cross_entropy_forward(zl, t, None, -100, 0.0, 0.0, "mean", None, False)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
