"""One GPU: what an all-ones attention mask costs galaxy.core.attention (causal, forward + backward, seq 4096,
head dim 128, bf16) against no mask; CUDA events over 10 calls after 3.

    PYTHONPATH=. python3 bench/device/attention_mask_cost.py
"""

import json

import torch

from galaxy.core.attention import attention

torch.manual_seed(0)
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
for rows, heads in ((1, 16), (4, 16), (1, 32)):
    q, k, v = (torch.randn(rows, heads, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    ones = torch.ones(rows, 4096, dtype=torch.long, device="cuda")
    for name, pad in (("no_mask", None), ("all_ones_mask", ones)):
        def step():
            attention(q, k, v, key_padding_mask=pad, causal=True).sum().backward()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        torch.cuda.synchronize()
        out[f"rows{rows}_heads{heads}_{name}_ms"] = start.elapsed_time(end) / 10
print(json.dumps(out, indent=1))
