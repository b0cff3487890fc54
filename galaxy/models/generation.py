"""Autoregressive decoding for causal LMs: greedy, temperature / top-k / top-p sampling, KV cache.

Semantics follow ``transformers`` ``generate``: the logits processors run in the order
temperature -> top-k -> top-p (as ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``); with an attention mask (left padding) position ids are
``cumsum(mask) - 1``; a sequence that emitted EOS is padded with the (first) EOS id, and
decoding stops once every sequence has finished.

Every plan generates with the KV cache: every rank runs the same loop and one rank's token
choice is broadcast so the ranks can never drift apart (after the prefill of an SP plan, the rank
holding the prompt's last token; after that, rank 0). On SP plans the prompt is the prefill's
whole sequence (``seq_split`` must cover it: pad it to ``seq_length``) and the new tokens then run
replicated (see ``galaxy.models.llama``); ``use_cache=False`` re-runs a growing sequence, which
an SP split cannot follow, so it runs only on plans without SP.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import torch

from galaxy.config import Method

logger = logging.getLogger(__name__)


def _check_plan(model, use_cache: bool) -> None:
    plan, comm = model.plan, model.ctx.mp
    if not use_cache and comm.size > 1 and Method.SP in (plan.att, plan.con, plan.mlp):
        raise ValueError(f"generation with use_cache=False re-runs the whole sequence, whose length changes every "
                         f"step, but plan '{plan.name}' splits a fixed sequence (SP); use the KV cache "
                         "(use_cache=True) or a plan without SP")


def _prefill_token_rank(model) -> int:
    """The rank whose logits hold the prompt's last token after the prefill: under SP the last
    rank with tokens in the split, else any (rank 0)."""
    plan = model.plan
    if model.ctx.mp.size == 1 or Method.SP not in (plan.att, plan.con, plan.mlp):
        return 0
    return max(rank for rank, n in enumerate(plan.seq_split) if n > 0)


def top_k_top_p_filter(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top ``top_k`` and outside the smallest set whose
    probability reaches ``top_p`` (at least one token always survives), as HF's warpers do."""
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # keep the most probable token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float,
               generator: Optional[torch.Generator]) -> torch.Tensor:
    """``logits [b, vocab]`` (fp32) -> token ids ``[b]``."""
    if not do_sample:
        return logits.argmax(dim=-1)
    if temperature != 1.0:
        logits = logits / temperature
    probs = top_k_top_p_filter(logits, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, eos_token_id: Optional[Union[int, Sequence[int]]] = None,
             generator: Optional[torch.Generator] = None, attention_mask: Optional[torch.Tensor] = None,
             use_cache: bool = True) -> torch.Tensor:
    """Extend ``input_ids [b, s]`` by up to ``max_new_tokens`` tokens; returns ``[b, s + n]``.

    ``attention_mask`` (1 = token, 0 = padding) allows left-padded batches. ``generator`` seeds
    sampling (it must live on the model's device). ``use_cache=False`` re-runs the whole
    sequence each step (the reference the cache is tested against). The model runs in eval mode
    (dropout off) and is put back in its previous mode afterwards.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be non-negative, got {max_new_tokens}")
    if do_sample:
        if temperature <= 0:
            raise ValueError(f"temperature must be positive when sampling, got {temperature}; "
                             "use do_sample=False for greedy decoding")
        if top_k < 0 or not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_k must be >= 0 and top_p in (0, 1], got top_k={top_k}, top_p={top_p}")
    elif temperature != 1.0 or top_k or top_p < 1.0:
        logger.warning("temperature/top_k/top_p are ignored by greedy decoding; pass do_sample=True to sample")
    _check_plan(model, use_cache)
    comm = model.ctx.mp
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    eos_ids = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
    ids = input_ids
    mask = attention_mask.long() if attention_mask is not None else None
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
    cache = None
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            src = _prefill_token_rank(model) if use_cache and cache is None else 0
            positions = None
            if mask is not None:
                positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            if not use_cache:
                out = model(ids, attention_mask=mask, position_ids=positions)
            elif cache is None:  # prefill
                out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
            else:
                out = model(ids[:, -1:], attention_mask=mask,
                            position_ids=None if positions is None else positions[:, -1:], past_key_values=cache)
            cache = out.past_key_values if use_cache else None
            token = next_token(out.logits[:, -1].float(), do_sample, temperature, top_k, top_p, generator)
            if comm.size > 1:
                token = comm.broadcast(token, src=src)
            if eos:
                token = torch.where(unfinished, token, eos_ids[0])
                unfinished = unfinished & ~torch.isin(token, eos_ids)
            ids = torch.cat([ids, token[:, None]], dim=1)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            if eos and not unfinished.any():
                break
    finally:
        model.train(was_training)
    return ids
