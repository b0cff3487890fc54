"""Evaluation on a held-out split, on any plan, pipeline and dp layout.

``evaluate`` runs ``eval_iters`` global batches forward only (through the pipeline when there is
one, dropout off) and returns the loss averaged over every prediction target of those batches and
the head's accuracy: masked tokens for a masked LM (BERT), next tokens for a causal LM
(its family's ``causal``, e.g. LLaMA; plus perplexity, exp of the loss), examples for sequence
classification. Logits stay in the stream's layout: under sequence parallelism each rank scores its
own tokens and the counts are summed over the group.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from galaxy.core.sp_attention import stream_order
from galaxy.data.batching import IGNORE_INDEX
from galaxy.train.microbatch import split_rows


def _local_targets(trainer, logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """The labels each logit row predicts, in the logits' layout (this rank's tokens under SP)."""
    ctx, plan = trainer.ctx, trainer.model.plan
    if causal:  # position t predicts token t + 1
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    labels = stream_order(plan, causal).to_stream_order(labels)  # causal ring attention: the zigzag order
    if logits.shape[1] != labels.shape[1]:
        labels = ctx.mp.split(labels, 1, plan.seq_split)
    return labels


def _batch_counts(trainer, micro_batch: dict, out) -> torch.Tensor:
    """[loss x targets, correct, targets] of one micro-batch on the last stage."""
    model, labels = trainer.model, micro_batch["labels"]
    logits = out.logits
    device = logits.device
    if logits.dim() == 2:  # sequence classification: one prediction per row
        targets = torch.tensor(float(labels.shape[0]), device=device, dtype=torch.float64)
        correct = (logits.argmax(-1) == labels).sum().double() if logits.shape[-1] > 1 else targets * 0
    else:
        local = _local_targets(trainer, logits, labels, trainer.causal)
        targets = model.num_loss_targets(labels).double()
        correct = ((logits.argmax(-1) == local) & (local != IGNORE_INDEX)).sum().double()
        if local.shape[1] != labels.shape[1]:  # sequence-sharded logits: counts are partial
            correct = trainer.ctx.mp.all_reduce(correct)
    return torch.stack([out.loss.detach().double() * targets, correct, targets])


@torch.no_grad()
def evaluate(trainer, eval_at: Callable[..., dict], iters: int, autocast: Optional[Callable] = None) -> dict:
    """Loss and accuracy over ``iters`` held-out global batches; the same numbers on every rank."""
    model, ctx = trainer.model, trainer.ctx
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    model.eval()
    try:
        for i in range(iters):
            micro = split_rows(trainer.read_batch(eval_at, i), trainer.num_microbatches)
            micro = [{k: v.to(ctx.device) for k, v in mb.items()} for mb in micro]
            for mb, out in zip(micro, trainer.runner.forward_only(micro, autocast)):
                totals += _batch_counts(trainer, mb, out)
    finally:
        model.train()
    if ctx.dp.size > 1:
        totals = ctx.dp.all_reduce(totals)
    if ctx.pp.size > 1:  # only the last stage saw outputs
        totals = ctx.pp.broadcast(totals, src=ctx.pp.size - 1)
    loss_sum, correct, targets = totals.tolist()
    loss = loss_sum / max(targets, 1.0)
    result = {"eval_loss": loss, "eval_accuracy": correct / max(targets, 1.0), "eval_targets": int(targets)}
    if trainer.causal:
        result["eval_perplexity"] = math.exp(min(loss, 700.0))
    return result
