"""A step's batch into micro-batches: an attention mask that masks nothing is left out (attention then
runs SDPA's unmasked causal kernel), and the step trains exactly what the masked model would."""

from __future__ import annotations

import torch

import galaxy.core.attention as attention_module
from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.data.pretraining import causal_lm_data
from galaxy.models import build_model
from galaxy.train.loop import Trainer
from galaxy.train.microbatch import split_rows

CFG = {"model": {"preset": "llama-tiny", "num_hidden_layers": 2},
       "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 16, "dtype": "float64"}}


def batch(padded_rows: int = 0) -> dict:
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:padded_rows, 12:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_a_mask_that_masks_nothing_is_left_out():
    full = batch()
    micro = split_rows(full, 2)
    assert [set(mb) for mb in micro] == [{"input_ids", "labels"}] * 2
    assert torch.equal(torch.cat([mb["input_ids"] for mb in micro]), full["input_ids"])


def test_a_mask_that_pads_a_row_stays_in_every_micro_batch():
    padded = batch(padded_rows=1)
    micro = split_rows(padded, 2)
    assert all(set(mb) == {"input_ids", "attention_mask", "labels"} for mb in micro)
    assert torch.equal(torch.cat([mb["attention_mask"] for mb in micro]), padded["attention_mask"])


def test_the_clis_packed_windows_train_unmasked_and_as_the_masked_model(monkeypatch):
    """The pretraining CLI's causal batches (packed, every token real) reach attention without a mask
    tensor; the step's loss and gradients equal the serial model's with the batch's all-ones mask."""
    cfg = GalaxyConfig.from_dict(CFG)
    ctx = ParallelContext.serial(torch.device("cpu"))
    model = build_model(cfg, cfg.resolve_plan(1), ctx).double()
    reference = build_model(cfg, cfg.resolve_plan(1), ctx).double()
    reference.load_state_dict(model.state_dict())
    batch_at = causal_lm_data(cfg)[0]
    data = batch_at(0)
    assert bool(data["attention_mask"].all()), "the synthetic windows are packed: no padding"

    built = []
    real_builder = attention_module.attention_mask
    monkeypatch.setattr(attention_module, "attention_mask", lambda *a, **k: built.append(1) or real_builder(*a, **k))
    trainer = Trainer(model, cfg, ctx)
    loss = trainer.forward_backward(trainer.read_batch(batch_at, 0)).item()
    trainer.grad_sync.remove()
    assert not built, "an all-ones mask reached attention"

    masked = reference(**data).loss
    masked.backward()
    assert built, "the reference ran with its mask"
    assert abs(loss - masked.item()) <= 1e-12 * abs(loss)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12, msg=name)
