"""One GPU: what an all-ones attention mask costs galaxy.core.attention (causal, forward + backward, seq 4096,
head dim 128, bf16) against no mask: the median of 10 calls after 3 (compute_floor's ``cuda_ms``; the JSON of
2026-11-27 took the mean of 10 back-to-back calls, before the script shared that timer).

    PYTHONPATH=. python3 bench/device/attention_mask_cost.py
"""

import json

import torch

from bench.compute_floor import cuda_ms
from galaxy.core.attention import attention

torch.manual_seed(0)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
for rows, heads in ((1, 16), (4, 16), (1, 32)):
    q, k, v = (torch.randn(rows, heads, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    ones = torch.ones(rows, 4096, dtype=torch.long, device="cuda")
    for name, pad in (("no_mask", None), ("all_ones_mask", ones)):
        out[f"rows{rows}_heads{heads}_{name}_ms"] = cuda_ms(
            lambda: attention(q, k, v, key_padding_mask=pad, causal=True).sum().backward(), repeat=10, warmup=3)
print(json.dumps(out, indent=1))
