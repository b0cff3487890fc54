"""What every model shares (``galaxy.models.base``): the token loss summed over one rank's tokens and divided
by the global target count adds up, over sequence shards, to the serial mean cross-entropy; padding targets
are ignored; half-precision logits are scored in fp32."""

import torch
import torch.nn.functional as F

from galaxy.models.base import at_least_fp32, token_loss_sum


def test_shard_losses_add_up_to_the_serial_mean():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 9), generator=g)
    targets[1, 6:] = -100  # padding
    serial = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=-100)
    count = (targets != -100).sum()
    shards = [slice(0, 4), slice(4, 7), slice(7, 9)]  # uneven sequence shards
    total = sum(token_loss_sum(logits[:, s], targets[:, s], count, "torch") for s in shards)
    torch.testing.assert_close(total, serial, rtol=1e-14, atol=0)


def test_half_precision_logits_are_scored_in_fp32():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 5, 7, generator=g).bfloat16()
    targets = torch.randint(0, 7, (1, 5), generator=g)
    loss = token_loss_sum(logits, targets, torch.tensor(5), "torch")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits[0].float(), targets[0]), rtol=1e-6, atol=0)
    assert at_least_fp32(logits).dtype == torch.float32 and at_least_fp32(logits.double()).dtype == torch.float64
