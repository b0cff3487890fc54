"""Rotary position embedding (HF ``rotate_half`` convention) as a Triton kernel.

Each program rotates every q head and every k head at one or two (batch, position) rows, so
cos/sin are read once per position and shared by all heads (GQA: q and k head counts differ).
cos/sin are given per position by the caller, which lets sequence-parallel ranks pass the
rows for their global positions. They are full ``rotate_half`` tables (``head_dim`` wide) or, as
flash-attn's rotary takes them, only their first half (``head_dim / 2``: the halves of such a table
are equal), which the kernel then reads once per position instead of twice (a position's cos/sin are
3-5% of the bytes it reads; measured: 2% off the 7B kernel, within noise at 1B).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rope_tiles(block_qh: int, block_kh: int, block_d: int) -> tuple[int, int]:
    """(positions per program, warps) for heads padded to ``block_qh``/``block_kh`` and half-dims
    padded to ``block_d``: about 1024 elements per warp, and two positions per program when one
    position holds fewer than 2048 elements (small heads, TP shards), so that small tiles are not
    spread over more threads than they have 16-byte pieces. Between two powers of 2 a one-position
    program takes the larger warp count, two positions the smaller. Measured forward + backward on
    H100 with inputs beyond L2 (bench/bench_kernels.py --variants rope,
    docs/results/kernels_2026-11-26_e63c9a2_h100_rope_variants.json): 1B (q 32 / k 8 heads of 64,
    2560 elements) 1 x 4: 30.2 us against 31.7 with 1 x 2. 1B TP/2 (q 16 / k 4) keeps 2 x 2 (17.3 us;
    2 x 4 ran 21.1 against 18.9 in ..._1ef1e3d_h100.json / ..._faeb9f3_h100.json, after a forward-only
    sweep had favoured it; 4 positions x 4 warps: 24.5 us, ..._0da1c3d_h100.json). 7B shapes moved
    less than 1% between these rules."""
    elems = (block_qh + block_kh) * 2 * block_d
    if elems < 2048:  # two positions; warps rounded down to a power of 2
        warps = max(1, 2 * elems // 1024)
        return 2, 1 << (warps.bit_length() - 1)
    return 1, min(8, triton.next_power_of_2(triton.cdiv(elems, 1024)))


@triton.jit
def _load_halves(X, base, stride_h, n_heads, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < half)
    ptr = X + base + heads * stride_h + dims
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32), tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rotated(
    OUT, base, stride_h, n_heads, half, x1, x2, c1, c2, s1, s2,
    INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < n_heads) & (dims < half)
    ptr = OUT + base + heads * stride_h + dims
    if INVERSE:
        # Transpose of the forward map (the backward pass): with cos=[c1,c2], sin=[s1,s2],
        # forward is o1 = x1*c1 - x2*s1, o2 = x2*c2 + x1*s2.
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(ptr, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(ptr + half, o2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, QO, KO,
    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s,
    sqo_b, sqo_h, sqo_s, sko_b, sko_h, sko_s,
    sc_b, sc_s, ss_b, ss_s,
    seq_len, n_positions, n_q_heads, n_k_heads, half,
    INVERSE: tl.constexpr, POSITIONS: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr, HALF_TABLE: tl.constexpr,
):
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < half
    for i in tl.static_range(POSITIONS):  # several (batch, position) rows per program
        pid = tl.program_id(0).to(tl.int64) * POSITIONS + i
        if pid < n_positions:
            b = pid // seq_len
            s = pid % seq_len
            # q and k are both loaded before either is stored: a store may alias a later load as far
            # as the compiler knows, so storing q first would hold k's loads back (a small head's
            # position is a few KB, too little in flight to hide the latency of two round trips).
            q1, q2 = _load_halves(Q, b * sq_b + s * sq_s, sq_h, n_q_heads, half, BLOCK_QH, BLOCK_D)
            k1, k2 = _load_halves(K, b * sk_b + s * sk_s, sk_h, n_k_heads, half, BLOCK_KH, BLOCK_D)
            cos_ptr = COS + b * sc_b + s * sc_s + dims
            sin_ptr = SIN + b * ss_b + s * ss_s + dims
            c1 = tl.load(cos_ptr, mask=dmask, other=0.0).to(tl.float32)[None, :]
            s1 = tl.load(sin_ptr, mask=dmask, other=0.0).to(tl.float32)[None, :]
            if HALF_TABLE:
                c2 = c1
                s2 = s1
            else:  # a full table: no assumption that its halves are equal
                c2 = tl.load(cos_ptr + half, mask=dmask, other=0.0).to(tl.float32)[None, :]
                s2 = tl.load(sin_ptr + half, mask=dmask, other=0.0).to(tl.float32)[None, :]
            _store_rotated(QO, b * sqo_b + s * sqo_s, sqo_h, n_q_heads, half, q1, q2, c1, c2, s1, s2,
                           INVERSE, BLOCK_QH, BLOCK_D)
            _store_rotated(KO, b * sko_b + s * sko_s, sko_h, n_k_heads, half, k1, k2, c1, c2, s1, s2,
                           INVERSE, BLOCK_KH, BLOCK_D)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_launch(q, k, cos, sin, inverse: bool, positions: int | None = None, warps: int | None = None):
    """Rotate q [b, hq, s, d] and k [b, hk, s, d] into new tensors of the same layout, ``positions``
    (batch, position) rows per program with ``warps`` warps (default: ``rope_tiles``). Arbitrary
    batch/head/seq strides are read directly (e.g. q from a transposed view). cos/sin [b or 1, s, d]
    or their first halves [b or 1, s, d / 2]."""
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    # Outputs keep the inputs' layout (a transposed [b, s, h, d] view stays one): each position's
    # heads are then written as one contiguous run, like they were read.
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    block_qh = triton.next_power_of_2(n_q_heads)
    block_kh = triton.next_power_of_2(n_k_heads)
    tile_positions, tile_warps = rope_tiles(block_qh, block_kh, block_d)
    positions, warps = positions or tile_positions, warps or tile_warps
    # A batch-1 cos/sin broadcasts over the batch through a zero stride.
    sc_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    ss_b = 0 if sin.shape[0] == 1 else sin.stride(0)
    _rope_kernel[(triton.cdiv(batch * seq_len, positions),)](
        q, k, cos, sin, qo, ko,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        sc_b, cos.stride(1), ss_b, sin.stride(1),
        seq_len, batch * seq_len, n_q_heads, n_k_heads, half,
        INVERSE=inverse, POSITIONS=positions, BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_D=block_d,
        HALF_TABLE=cos.shape[-1] == half, num_warps=warps,
    )
    return qo, ko


def _check_rope_shapes(q, k, cos, sin):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be [batch, heads, seq, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, _, seq_len, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2] != seq_len or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch/seq/head_dim")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate_half, got {head_dim}")
    widths = (head_dim, head_dim // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, batch) or t.shape[1] != seq_len or t.shape[2] not in widths:
            raise ValueError(
                f"{name} must be [batch or 1, seq, head_dim or head_dim / 2] = [{batch} or 1, {seq_len}, "
                f"{head_dim} or {head_dim // 2}], got {tuple(t.shape)}"
            )
    if cos.shape[2] != sin.shape[2]:
        raise ValueError(f"cos and sin must have the same width, got {cos.shape[2]} and {sin.shape[2]}")


class TritonRoPE(torch.autograd.Function):
    """``q*cos + rotate_half(q)*sin`` (and the same for k). No gradient flows to cos/sin:
    they are position tables, not parameters."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        if cos.dim() == 2:  # [s, d] -> [1, s, d]
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        _check_rope_shapes(q, k, cos, sin)
        cos, sin = _unit_last_stride(cos), _unit_last_stride(sin)
        ctx.save_for_backward(cos, sin)
        return rope_launch(q, k, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        # Autograd materializes zeros for an unused output, so dq/dk are never None here.
        return (*rope_launch(dq, dk, cos, sin, inverse=True), None, None)
