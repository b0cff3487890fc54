"""A step's batch as the model reads it: an attention mask that changes nothing the loss sees is left out
(attention then runs SDPA's unmasked causal kernel), and the step trains exactly what the masked model would."""

from __future__ import annotations

import pytest
import torch

import galaxy.core.attention as attention_module
from galaxy.config import GalaxyConfig
from galaxy.core.context import ParallelContext
from galaxy.data.pretraining import causal_lm_data
from galaxy.models import build_model
from galaxy.train.loop import Trainer
from galaxy.train.microbatch import split_rows, without_needless_mask

CFG = {"model": {"preset": "llama-tiny", "num_hidden_layers": 2},
       "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 16, "dtype": "float64"}}


def batch(pad: str = "none") -> dict:
    """Four rows of 16 tokens; ``pad``: none | right (rows 0 and 2 end in padding) | left (row 1 starts with it)."""
    ids = torch.randint(0, 100, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if pad == "right":
        mask[0, 12:] = 0
        mask[2, 5:] = 0
    elif pad == "left":
        mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("causal", (True, False))
def test_a_mask_of_all_ones_is_left_out(causal):
    full = batch()
    kept = without_needless_mask(full, causal)
    assert set(kept) == {"input_ids", "labels"}
    assert all(kept[k] is full[k] for k in kept)


def test_right_padding_without_labels_is_left_out_of_a_causal_lm_only():
    padded = batch("right")
    assert "attention_mask" not in without_needless_mask(padded, causal=True)
    assert without_needless_mask(padded, causal=False) is padded  # bidirectional: every token sees the padding


@pytest.mark.parametrize("case", ("left padding", "a padded position with a label", "no labels", "a label per row"))
def test_a_mask_that_some_loss_bearing_output_depends_on_stays(case):
    b = batch("left" if case == "left padding" else "right")
    if case == "a padded position with a label":
        b["labels"][0, 13] = 7
    elif case == "no labels":
        del b["labels"]
    elif case == "a label per row":
        b["labels"] = torch.tensor([0, 1, 0, 1])
    assert without_needless_mask(b, causal=True) is b


def test_split_rows_keeps_every_key():
    padded = batch("left")
    micro = split_rows(padded, 2)
    assert all(set(mb) == set(padded) for mb in micro)
    assert torch.equal(torch.cat([mb["attention_mask"] for mb in micro]), padded["attention_mask"])


def trainer_against_masked_model(monkeypatch, batch_at):
    """One Trainer step on ``batch_at(0)`` and the serial model's masked loss on the same batch, float64:
    (whether the Trainer's attention built a mask, its loss and gradients, the reference's)."""
    cfg = GalaxyConfig.from_dict(CFG)
    ctx = ParallelContext.serial(torch.device("cpu"))
    model = build_model(cfg, cfg.resolve_plan(1), ctx).double()
    reference = build_model(cfg, cfg.resolve_plan(1), ctx).double()
    reference.load_state_dict(model.state_dict())
    built = []
    real_builder = attention_module.attention_mask
    monkeypatch.setattr(attention_module, "attention_mask", lambda *a, **k: built.append(1) or real_builder(*a, **k))
    trainer = Trainer(model, cfg, ctx)
    loss = trainer.forward_backward(trainer.read_batch(batch_at, 0)).item()
    trainer.grad_sync.remove()
    trainer_built = bool(built)
    masked = reference(**batch_at(0)).loss
    masked.backward()
    assert len(built) > int(trainer_built), "the reference ran with its mask"
    assert abs(loss - masked.item()) <= 1e-12 * abs(loss)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12, msg=name)
    return trainer_built


def test_the_clis_packed_windows_train_unmasked_and_as_the_masked_model(monkeypatch):
    """The pretraining CLI's causal batches (packed: every token real, an all-ones mask) reach attention
    without a mask tensor; the step's loss and gradients equal the serial model's with the mask."""
    batch_at = causal_lm_data(GalaxyConfig.from_dict(CFG))[0]
    assert bool(batch_at(0)["attention_mask"].all()), "the synthetic windows are packed: no padding"
    assert not trainer_against_masked_model(monkeypatch, batch_at), "an all-ones mask reached attention"


def test_right_padded_rows_train_unmasked_and_as_the_masked_model(monkeypatch):
    """Instruction data's right padding (labels -100 there): the same loss and gradients without the mask."""
    assert not trainer_against_masked_model(monkeypatch, lambda step: batch("right"))


def test_left_padded_rows_keep_their_mask(monkeypatch):
    assert trainer_against_masked_model(monkeypatch, lambda step: batch("left"))
