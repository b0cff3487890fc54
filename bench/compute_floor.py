"""The compute floor of a training step on one GPU: the time its matmuls and its attention alone take,
timed kernel by kernel at the step's own shapes, and the MFU that floor allows.

    python bench/compute_floor.py --scenario llama7b --global_batch 16 --gpus 4 --json floor.json
    python bench/compute_floor.py --preset llama-1b --seq 1024 --micro_batch 8 --gpus 1 --mp 1 --lora_rank 16

Per micro-batch of ``--micro_batch`` sequences, every layer runs, forward and backward, the matmuls
of its weights (q, k, v, o, gate, up, down; each: the forward product, the input's gradient and the
weight's gradient) and SDPA's causal attention; the head runs its three products once. Under TP
degree ``mp`` a GPU runs each product with the weight's columns (q, k, v, gate, up, head) or rows
(o, down) split ``mp`` ways and ``mp`` times the micro-batches (the same FLOPs per GPU: dp x mp =
gpus). Attention is timed with each SDPA backend that runs here (flash, cuDNN, memory-efficient);
the floor takes the fastest. With ``--lora_rank R`` the base is frozen, as bench_lora's: its products run
forward and input gradient only, and LoRA's A (r x H) and B products on q and v run all three. Nothing else
is in the floor: no norms, rotary, activations, casts, optimizer, collectives or host gaps. ``mfu_ceiling`` is the model FLOPs (bench_train's formula) over
that time and the GPU's peak: what a step could reach if every other cost were hidden.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_train import SCENARIOS  # noqa: E402


def cuda_ms(fn, repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def matmul_ms(tokens: int, n_in: int, n_out: int, dtype) -> dict:
    """Forward (x W^T), input gradient (dy W) and weight gradient (dy^T x) of one linear, each timed."""
    x = torch.randn(tokens, n_in, device="cuda", dtype=dtype)
    w = torch.randn(n_out, n_in, device="cuda", dtype=dtype)
    dy = torch.randn(tokens, n_out, device="cuda", dtype=dtype)
    return {"forward": cuda_ms(lambda: x @ w.t()), "grad_input": cuda_ms(lambda: dy @ w),
            "grad_weight": cuda_ms(lambda: dy.t() @ x)}


def attention_ms(batch: int, heads: int, seq: int, head_dim: int, dtype) -> dict:
    """Forward + backward of causal SDPA per backend (ms), or the backend's one-line refusal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype)
    out = {}
    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run():
            with sdpa_kernel([backend]):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.backward(y, grad)
        try:
            out[label] = cuda_ms(run, repeat=10)
        except RuntimeError as e:
            out[label] = " ".join(str(e).split())[:200]
    return out


def preset_shape(preset: str, seq: int, global_batch: int) -> dict:
    """A Galaxy model preset's shapes in the scenario's keys."""
    from galaxy.config import MODEL_PRESETS

    m = MODEL_PRESETS[preset]
    return dict(hidden=m["hidden_size"], ffn=m["intermediate_size"], heads=m["num_attention_heads"],
                kv_heads=m.get("num_key_value_heads") or m["num_attention_heads"], layers=m["num_hidden_layers"],
                seq=seq, global_batch=global_batch, vocab=m["vocab_size"])


def layer_products(h: int, f: int, kv: int, mp: int, lora_rank: int) -> dict:
    """(products of this shape per layer, in features, out features) on one GPU of a TP-``mp`` group;
    with LoRA, its A and B on q and v too."""
    shapes = {"q": (1, h, h // mp), "kv": (2, h, kv // mp), "o": (1, h // mp, h), "gate_up": (2, h, f // mp),
              "down": (1, f // mp, h)}
    if lora_rank:
        shapes.update({"lora_a": (2, h, lora_rank), "lora_b_q": (1, lora_rank, h // mp),
                       "lora_b_v": (1, lora_rank, kv // mp)})
    return shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="llama7b")
    p.add_argument("--preset", default=None, help="a Galaxy model preset's shapes instead of --scenario (with --seq)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (with --preset; default 1024)")
    p.add_argument("--global_batch", type=int, default=None)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--gpus", type=int, default=4, help="GPUs the step runs on (sequences per GPU = global / gpus)")
    p.add_argument("--mp", default="1,2,4", help="TP degrees to time the shards of")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="LoRA on q and v over a frozen base: no weight gradients of the frozen products")
    p.add_argument("--peak_tflops", type=float, default=989.4)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a GPU: the floor is the GPU's kernels")
    if args.preset:
        s = preset_shape(args.preset, args.seq or 1024, args.global_batch or args.micro_batch)
    else:
        s = dict(SCENARIOS[args.scenario])
    s.setdefault("kv_heads", s["heads"])
    if args.global_batch:
        s["global_batch"] = args.global_batch
    dtype = torch.bfloat16
    h, f, L, seq, vocab, heads = s["hidden"], s["ffn"], s["layers"], s["seq"], s["vocab"], s["heads"]
    kv = h // heads * s["kv_heads"]
    tokens = args.micro_batch * seq
    per_gpu_sequences = s["global_batch"] / args.gpus
    # FLOPs as bench_train counts them: 6 N + 12 L H S per token (LoRA, as bench_peft_mp: 4 N + 12 L H S, the
    # frozen weights get no gradient)
    n_weights = L * (2 * h * h + 2 * h * kv + 3 * h * f) + h * vocab
    flops_per_token = (4 if args.lora_rank else 6) * n_weights + 12 * L * h * seq
    frozen = ("forward", "grad_input")  # the products a frozen weight runs
    big = 8192
    a, b = torch.randn(big, big, device="cuda", dtype=dtype), torch.randn(big, big, device="cuda", dtype=dtype)
    square_tflops = 2 * big**3 / cuda_ms(lambda: a @ b) / 1e9
    attn = attention_ms(args.micro_batch, heads, seq, h // heads, dtype)
    report = {"benchmark": "compute_floor", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "commit": os.environ.get("GALAXY_COMMIT", "unknown"),
              "scenario": args.preset or args.scenario, "shape": s, "micro_batch": args.micro_batch,
              "gpus": args.gpus, "lora_rank": args.lora_rank, "peak_tflops": args.peak_tflops,
              "square_gemm_tflops_8192": square_tflops, "attention_fwd_bwd_ms": attn, "rows": []}
    for mp in (int(m) for m in args.mp.split(",")):
        layer = {}
        for name, (times, n_in, n_out) in layer_products(h, f, kv, mp, args.lora_rank).items():
            m = matmul_ms(tokens, n_in, n_out, dtype)
            kept = m if (not args.lora_rank or name.startswith("lora")) else {k: m[k] for k in frozen}
            layer[name] = {k: v * times for k, v in kept.items()}
        head = matmul_ms(tokens, h, vocab // mp, dtype)
        if args.lora_rank:
            head = {k: head[k] for k in frozen}
        layer_ms = sum(sum(v.values()) for v in layer.values())
        attn_mp = attention_ms(args.micro_batch, heads // mp, seq, h // heads, dtype) if mp > 1 else attn
        attn_mp_best = min(v for v in attn_mp.values() if isinstance(v, float))
        micro_per_gpu = per_gpu_sequences * mp / args.micro_batch  # dp = gpus / mp ranks, each global / dp sequences
        step_ms = micro_per_gpu * (L * (layer_ms + attn_mp_best) + sum(head.values()))
        step_flops_per_gpu = flops_per_token * s["global_batch"] * seq / args.gpus
        report["rows"].append({
            "mp": mp, "micro_batches_per_gpu": micro_per_gpu, "layer_matmul_ms": layer, "head_ms": head,
            "attention_ms": attn_mp, "attention_best_ms": attn_mp_best,
            "floor_step_ms": step_ms, "matmul_share": L * layer_ms / (L * (layer_ms + attn_mp_best)),
            "mfu_ceiling": step_flops_per_gpu / (step_ms / 1e3) / (args.peak_tflops * 1e12)})
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
