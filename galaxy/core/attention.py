"""The attention core shared by every model and plan: softmax(q k^T / sqrt(d) + mask) v.

Under SP the queries are this rank's tokens and the keys are the whole sequence, so causal
masking is done on global positions (``q_offset`` = position of the first local query).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from galaxy.core.layers import Dropout, drawing_from


def attention_mask(batch: int, q_len: int, k_len: int, device, key_padding_mask: Optional[torch.Tensor],
                   causal: bool, q_offset: int) -> Optional[torch.Tensor]:
    """Boolean ``[b, 1, q, k]`` mask (True = attend), or None when every key is visible."""
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask.bool()[:, None, None, :].expand(batch, 1, q_len, k_len)
    if causal:
        q_pos = torch.arange(q_offset, q_offset + q_len, device=device)[:, None]
        allowed = torch.arange(k_len, device=device)[None, :] <= q_pos
        mask = allowed[None, None] if mask is None else mask & allowed
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_padding_mask=None, causal: bool = False,
              q_offset: int = 0, dropout: Optional[Dropout] = None) -> torch.Tensor:
    """q: ``[b, hq, sq, d]``; k, v: ``[b, hkv, sk, d]`` with hq a multiple of hkv (GQA). Returns ``[b, hq, sq, d]``."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    # A plain causal square needs no mask tensor, which lets SDPA pick its flash kernel.
    plain_causal = causal and key_padding_mask is None and q_offset == 0 and sq == sk
    mask = None if plain_causal else attention_mask(b, sq, sk, q.device, key_padding_mask, causal, q_offset)
    # GQA: without a mask the flash kernel shares each K/V head across its query group itself;
    # with a mask the memory-efficient kernel needs the heads expanded.
    gqa = {}
    if hkv != hq:
        if mask is None:
            gqa = {"enable_gqa": True}
        else:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
    if dropout is None or not dropout.active:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=plain_causal, **gqa)
    # SDPA's fused kernels drop probabilities on the default RNG: point it at the block's own
    # stream for the call (backward regenerates the mask from the seed the kernel saved).
    with drawing_from(dropout.generator):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=plain_causal, dropout_p=dropout.p,
                                              **gqa)
