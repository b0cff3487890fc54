"""An ATT block's attention on one rank (``galaxy.core.blocks.self_attention`` with no sequence shard)
against softmax(q k^T / sqrt(d) + mask) v written out per head in fp64: GQA head sharing, causal and
key-padding masks, and RoPE applied at the block's positions."""

import math

import pytest
import torch

from galaxy.core.blocks import merge_heads, self_attention, split_heads

B, S, HEADS, KV_HEADS, D = 2, 7, 4, 2, 8


def reference(q, k, v, *, causal, keep, rope):
    """Per batch row and head, the attention a textbook writes, over ``[b, s, heads * d]`` projections."""
    out = torch.zeros(B, S, HEADS * D, dtype=torch.float64)
    pos = torch.arange(S, dtype=torch.float64)
    for b in range(B):
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)  # the K/V head query head h shares
            qh, kh, vh = q[b, :, h * D:(h + 1) * D], k[b, :, g * D:(g + 1) * D], v[b, :, g * D:(g + 1) * D]
            if rope:
                qh, kh = qh * (1 + pos)[:, None], kh * (2 - pos / S)[:, None]
            scores = qh @ kh.T / math.sqrt(D)
            allowed = keep[b][None, :].expand(S, S).clone()
            if causal:
                allowed &= torch.ones(S, S, dtype=torch.bool).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[b, :, h * D:(h + 1) * D] = scores.softmax(-1) @ vh
    return out


def position_scaling(q, k, positions):
    """A stand-in rotation that depends on the positions it is given, so a wrong offset shows."""
    p = positions.to(q.dtype)[:, None]
    return q * (1 + p), k * (2 - p / S)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("rope", [False, True])
def test_self_attention_equals_the_written_out_attention(causal, padded, rope):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, HEADS * D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, S, KV_HEADS * D, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.ones(B, S, dtype=torch.bool)
    if padded:
        keep[1, 5:] = False  # row 1 ends with two padding tokens
    got = self_attention(q, k, v, shard=None, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                         key_padding_mask=keep.long() if padded else None, causal=causal,
                         rope=position_scaling if rope else None)
    want = reference(q, k, v, causal=causal, keep=keep, rope=rope)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_merge_heads_undoes_split_heads():
    t = torch.arange(B * S * HEADS * D, dtype=torch.float64).view(B, S, HEADS * D)
    heads = split_heads(t, HEADS, D)
    assert heads.shape == (B, HEADS, S, D)
    assert torch.equal(heads[1, 2, 3], t[1, 3, 2 * D:3 * D])  # head 2 of token 3 is its own slice of features
    assert torch.equal(merge_heads(heads), t)
