"""Cross-entropy that writes the logits' gradient during forward, and the fused linear +
cross-entropy that never holds the full logits.

``TritonCrossEntropy``: logits already exist. When they need a gradient, forward computes it in the
same kernel that computes the loss, ``(softmax - onehot) / denominator`` per row, into a new buffer
or, with ``inplace``, into the logits themselves (Liger-Kernel's memory trade); backward then only
scales it by ``grad_output`` where that is not 1 (the usual ``loss.backward()`` costs one short
launch). The kernel reads a row in vocab blocks with an online softmax, keeps the last block (and its
exps) in registers and writes the gradient from there and from the other blocks, re-read last to
first (the most recently read, likeliest still in L2, first); a row of one block is read once. The
one-hot is one store at the row's end. Without a gradient (eval), forward is the online pass alone.
Other row designs, measured and dropped: ``bench/ce_designs.py``.

``FusedLinearCrossEntropy`` (the Liger-Kernel approach): tokens are processed in chunks;
each chunk's logits are computed by a torch matmul, the Triton kernel overwrites them in
place with the gradient ``(softmax - onehot) / denominator``, and that gradient is immediately
multiplied into d_hidden and d_weight. Only chunk-sized logits ever exist, and backward
scales the stored gradients by ``grad_output`` where it is not 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from galaxy.kernels._backend import device_class_of
from galaxy.kernels._triton_utils import persistent_programs

# Vocab block and warps, loss only and loss + gradient, chosen by bench/bench_kernels.py --variants
# (ce rows). With the gradient, many warps per row keep few rows in flight, so the blocks re-read in the
# second pass are still in L2 (a 128k-vocab row is 256 KB in bf16). A whole 32k row in registers (one
# read) ran slower than two blocks on H100: one 64 KB row per SM left its loads and stores unoverlapped.
FWD_BLOCK_V = 16384
FWD_WARPS = 8
# Per device class (``_backend.device_class_of``), (vocab up to, block, warps) with the gradient.
GRAD_TILES = {
    # docs/results/kernels_2026-11-24_5e02136_h100_ce_variants.json; confirmed after the one-hot change by
    # ..._2026-11-26_a17f7db_h100_ce.json: 32k 0.170 ms (8 warps 0.170, 8192 / 8 0.181), 128k 0.748
    # (16384 / 16 0.844).
    "H100": ((32768, 16384, 16), (None, 32768, 32)),
    # docs/results/kernels_2026-11-26_ebd212c_h200_ce_variants.json: 32k 0.167 ms against 0.181 with
    # H100's tile, 128k 0.701 against 0.734; confirmed by ..._a17f7db_h200_ce.json: 32k 0.132 (16384 / 16
    # 0.137), 128k 0.616 (32768 / 32 0.627).
    "H200": ((32768, 8192, 8), (None, 16384, 16)),
}
SCALE_BLOCK = 4096
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _ce_fwd_kernel(
    LOGITS, stride_l, GRAD, stride_g, TARGETS, LOSS, DENOM, n_cols, ignore_index,
    WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = LOGITS + row * stride_l
    grad_ptr = GRAD + row * stride_g
    target = tl.load(TARGETS + row)
    if target == ignore_index:
        tl.store(LOSS + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                tl.store(grad_ptr + cols, tl.zeros([BLOCK_V], dtype=GRAD.dtype.element_ty), mask=cols < n_cols)
        return

    # Online softmax over all blocks but the last: running max m and sum d of exp(x - m),
    # rescaled when m grows. The last block stays in registers for the gradient. Exponentials are
    # exp2(x * log2(e) - c): one fused multiply-add per element before the special-function unit.
    m = float("-inf")
    d = 0.0
    last = (tl.cdiv(n_cols, BLOCK_V) - 1) * BLOCK_V
    # With the gradient to write, the row is read again: ask L2 to keep it (evict_last), and to drop
    # what is read the second time and the gradient written (evict_first), which would otherwise push
    # the rows still to be re-read out of L2.
    keep: tl.constexpr = "evict_last" if WRITE_GRAD else ""
    for start in range(0, last, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, eviction_policy=keep).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp2((m - m_new) * LOG2E) + tl.sum(tl.exp2(x * LOG2E - m_new * LOG2E), axis=0)
        m = m_new
    last_cols = last + tl.arange(0, BLOCK_V)
    last_mask = last_cols < n_cols
    x_last = tl.load(row_ptr + last_cols, mask=last_mask, other=float("-inf")).to(tl.float32)
    m_new = tl.maximum(m, tl.max(x_last, axis=0))
    # Kept for the gradient: exp(x - lse) = e_last / d spares the last block a second exp.
    e_last = tl.exp2(x_last * LOG2E - m_new * LOG2E)
    d = d * tl.exp2((m - m_new) * LOG2E) + tl.sum(e_last, axis=0)
    lse = m_new + tl.log(d)
    # An out-of-range target cannot raise on the device: it yields a NaN loss instead.
    target_ok = (target >= 0) & (target < n_cols)
    x_target = tl.load(row_ptr + tl.where(target_ok, target, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(target_ok, lse - x_target, float("nan")))

    if WRITE_GRAD:
        # In place, the stores below overwrite the row: no warp may store before every warp has read
        # x_target (a warp that has passed the reductions runs ahead; without this barrier a slower
        # warp could read the target's gradient as its logit, seen as a wrong loss on H100).
        tl.debug_barrier()
        # softmax / denominator: the last block from registers, then the others from the last to the
        # first, the most recently read (likeliest still in L2) first. Every block is read before it
        # is written, so GRAD may be LOGITS (in place). The one-hot is subtracted at the end, by one
        # store: comparing every column with the target cost more than the exp (bench/ce_designs.py).
        inv_denom = 1.0 / tl.load(DENOM)
        grad = e_last * (inv_denom / d)
        tl.store(grad_ptr + last_cols, grad.to(GRAD.dtype.element_ty), mask=last_mask, eviction_policy="evict_first")
        lse2 = lse * LOG2E
        for i in range(BLOCK_V, last + BLOCK_V, BLOCK_V):
            cols = (last - i) + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + cols, eviction_policy="evict_first").to(tl.float32)
            grad = tl.exp2(x * LOG2E - lse2) * inv_denom
            tl.store(grad_ptr + cols, grad.to(GRAD.dtype.element_ty), eviction_policy="evict_first")
        # The program's threads wrote the row; after the barrier their stores are visible to the one
        # that overwrites the target's entry (the same address: without it the order is undefined).
        tl.debug_barrier()
        if target_ok:
            g_target = (tl.exp(x_target - lse) - 1.0) * inv_denom
            tl.store(grad_ptr + target, g_target.to(GRAD.dtype.element_ty))


@triton.jit
def _scale_rows_kernel(X, stride_x, G, stride_g, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr):
    # x[row] *= g[row] in place; a row whose g is exactly 1 (the usual loss.backward()) is skipped
    # without touching memory, so the common case costs one short launch and no host sync. A few
    # programs per SM loop over rows: one program per (row, block) made the skip itself cost 80 us.
    pid = tl.program_id(0).to(tl.int64)
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        if row < n_rows:
            g = tl.load(G + row * stride_g).to(tl.float32)
            if g != 1.0:
                for start in range(0, n_cols, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    mask = cols < n_cols
                    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                    tl.store(X + row * stride_x + cols, (x * g).to(X.dtype.element_ty), mask=mask)


def scale_rows_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``x [rows, cols] *= g`` in place, ``g`` one value per row or a single value (any float dtype)."""
    if x.numel():
        g = g.reshape(-1)
        n_rows, n_cols = x.shape
        programs = persistent_programs(x.device, n_rows, per_sm=4)
        _scale_rows_kernel[(programs,)](
            x, x.stride(0), g, g.stride(0) if g.numel() > 1 else 0, n_rows, n_cols, triton.cdiv(n_rows, programs),
            BLOCK=min(SCALE_BLOCK, triton.next_power_of_2(n_cols)), num_warps=4)
    return x


def ce_forward_rows(logits, targets, ignore_index, grad=None, denom=None, block_v=None, warps=None):
    """Per-row loss (fp32) of ``logits [N, V]``. With ``grad`` (a [N, V] tensor, which may be
    ``logits`` itself), also writes ``(softmax - onehot) / denom`` into it (``denom``: an fp32
    device scalar, default 1; ignored rows get zeros). ``block_v`` (a power of 2) and ``warps``
    override the launch settings."""
    n_rows, n_cols = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if not n_rows:
        return loss
    write_grad = grad is not None
    if write_grad:
        tiles = GRAD_TILES[device_class_of(logits.device)]
        block, default_warps = next((b, w) for v, b, w in tiles if v is None or n_cols <= v)
    else:
        block, default_warps = FWD_BLOCK_V, FWD_WARPS
    if block_v is not None:
        if block_v <= 0 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a positive power of 2, got {block_v}")
        block = block_v
    block = min(block, triton.next_power_of_2(n_cols))
    if write_grad and denom is None:
        denom = torch.ones((), dtype=torch.float32, device=logits.device)
    _ce_fwd_kernel[(n_rows,)](
        logits, logits.stride(0), grad if write_grad else logits, grad.stride(0) if write_grad else 0,
        targets, loss, denom if write_grad else loss, n_cols, ignore_index,
        WRITE_GRAD=write_grad, BLOCK_V=block,
        # Fewer warps for a small block: at least 4 elements per thread.
        num_warps=min(warps or default_warps, max(1, block // 128)),
    )
    return loss


def _denominator(targets, ignore_index, reduction, num_targets, device) -> torch.Tensor:
    """fp32 scalar the summed loss is divided by (stays on device: no host sync)."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if num_targets is None:
        return (targets != ignore_index).sum().to(torch.float32)
    return torch.as_tensor(num_targets, dtype=torch.float32, device=device)


def _check_targets(n_rows: int, targets: torch.Tensor) -> torch.Tensor:
    if targets.shape != (n_rows,):
        raise ValueError(f"targets must be [{n_rows}], got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be int32 or int64, got {targets.dtype}")
    return targets.contiguous()


class TritonCrossEntropy(torch.autograd.Function):
    """Cross-entropy of ``logits [N, V]`` (any float dtype) vs ``targets [N]``; loss in fp32.

    When the logits need a gradient, forward writes it (``(softmax - onehot) / denominator``; per
    row unscaled for 'none') into a new [N, V] buffer, or with ``inplace`` into the logits (no
    [N, V] buffer; the logits must not be used after the call). Backward scales it by the upstream
    gradient only where that is not 1, in place, so backward can run once.
    """

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, reduction: str, num_targets, block_v, inplace: bool):
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
        if logits.stride(-1) != 1:
            if inplace:
                raise ValueError("cross_entropy(inplace=True) needs logits with unit stride on the vocab dim")
            logits = logits.contiguous()
        targets = _check_targets(logits.shape[0], targets)
        denom = _denominator(targets, ignore_index, reduction, num_targets, logits.device)
        grad = None
        if ctx.needs_input_grad[0]:
            grad = logits if inplace else torch.empty_like(logits)
        # 'none' has no common denominator: its rows are scaled in backward.
        loss_rows = ce_forward_rows(logits, targets, ignore_index, grad,
                                    None if reduction == "none" else denom, block_v)
        if grad is not None:
            ctx.save_for_backward(grad)
        ctx.per_row = reduction == "none"
        ctx.consumed = False
        if reduction == "none":
            return loss_rows
        return loss_rows.sum() / denom

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.consumed:
            raise RuntimeError("cross_entropy's Triton backward scales the gradient it computed in forward in "
                               "place, so it can run only once (no retain_graph double backward)")
        ctx.consumed = True
        (grad,) = ctx.saved_tensors
        scale = grad_output.reshape(-1) if ctx.per_row else grad_output
        return scale_rows_(grad, scale), None, None, None, None, None, None


# Bytes of one chunk's logits. Every chunk adds its part into the [V, H] weight gradient, a
# read and a write of the whole gradient per chunk: small chunks (Liger's "chunk logits ~ hidden
# states", 128 tokens at 4096 x 128k) spend longer on that traffic than on the matmuls. Chosen by
# bench/bench_kernels.py --variants (fused_linear_cross_entropy rows).
CHUNK_LOGITS_BYTES = 512 * 2**20
# A frozen head (LoRA, QLoRA) has no weight gradient to amortize, and its chunk's logits come on top of every
# activation the step saved, at the end of forward: the step's peak. 128 MiB is 512 tokens of a 128k vocabulary
# (Llama-3.2-1B at 8 x 1024 tokens: 375 MiB off the peak), products still [512, H] x [H, 128k].
FROZEN_CHUNK_LOGITS_BYTES = 128 * 2**20


def default_chunk_size(n_tokens: int, vocab: int, itemsize: int, weight_grad: bool = True) -> int:
    """The most tokens (a power of two) whose logits fit CHUNK_LOGITS_BYTES (FROZEN_CHUNK_LOGITS_BYTES
    without a weight gradient), at most all of them."""
    budget = CHUNK_LOGITS_BYTES if weight_grad else FROZEN_CHUNK_LOGITS_BYTES
    rows = max(1, budget // max(1, vocab * itemsize))
    return min(1 << (rows.bit_length() - 1), triton.next_power_of_2(max(1, n_tokens)))


class FusedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T + bias, targets)`` with gradients computed during
    forward, chunk by chunk. Returns an fp32 scalar ('mean' or 'sum').

    The stored gradients are scaled in place by grad_output in backward, so backward can run once
    (no ``retain_graph`` double backward; this raises instead of returning wrong grads).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, ignore_index: int, reduction: str,
                num_targets, chunk_size, block_v, weight_fp8=None):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"fused_linear_cross_entropy supports reduction 'mean' or 'sum', got {reduction!r}")
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"need hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
        n_tokens, hidden_size = hidden.shape
        vocab = weight.shape[0]
        targets = _check_targets(n_tokens, targets)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if chunk_size is None:
            chunk_size = default_chunk_size(n_tokens, vocab, hidden.element_size(), weight_grad=need_w)
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        need_b = bias is not None and ctx.needs_input_grad[3]

        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # Accumulated over chunks with addmm_ in the weight dtype (as Liger does): an fp32
        # accumulator would cost a [V, H] fp32 buffer.
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if need_b else None
        loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)

        if need_w and n_tokens == 0:
            grad_w.zero_()
        # The chunk kernel writes (softmax - onehot) / denom, so backward only applies grad_output.
        denom = _denominator(targets, ignore_index, reduction, num_targets, hidden.device)
        for start in range(0, n_tokens, chunk_size):
            end = min(start + chunk_size, n_tokens)
            h_chunk = hidden[start:end]
            # A frozen head stored in fp8 too (weight_fp8): its logits on the fp8 tensor cores.
            logits = h_chunk @ weight.t() if weight_fp8 is None else weight_fp8.times_transposed(h_chunk)
            if bias is not None:
                logits += bias
            # Overwrites logits with the gradient (softmax - onehot) / denom (0 on ignored rows).
            loss_chunk = ce_forward_rows(logits, targets[start:end], ignore_index, logits, denom, block_v)
            loss_rows[start:end] = loss_chunk
            if need_h:
                torch.mm(logits, weight, out=grad_h[start:end])
            if need_w and start == 0:  # the first chunk writes, the others add
                torch.mm(logits.t(), h_chunk, out=grad_w)
            elif need_w:
                grad_w.addmm_(logits.t(), h_chunk)
            if need_b:
                grad_b += logits.sum(0, dtype=torch.float32)
            del logits

        ctx.save_for_backward(*(t for t in (grad_h, grad_w, grad_b) if t is not None))
        ctx.has = (need_h, need_w, need_b)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.consumed = False
        return loss_rows.sum() / denom

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.consumed:
            raise RuntimeError(
                "fused_linear_cross_entropy's backward scales its stored gradients in place and "
                "can run only once (retain_graph double backward is not supported)"
            )
        ctx.consumed = True
        saved = list(ctx.saved_tensors)
        need_h, need_w, need_b = ctx.has
        # The usual grad_output of 1 leaves the [V, H] weight gradient untouched (no extra pass over it).
        grad_h = scale_rows_(saved.pop(0), grad_output) if need_h else None
        grad_w = scale_rows_(saved.pop(0), grad_output) if need_w else None
        grad_b = saved.pop(0).mul_(grad_output).to(ctx.bias_dtype) if need_b else None
        return grad_h, grad_w, None, grad_b, None, None, None, None, None, None
