"""NF4 dequantize-and-matmul on CUDA: correctness and speed of Galaxy's backends (torch reference,
Triton fused kernel, bitsandbytes dequantize + cuBLAS) beside bitsandbytes' own ``matmul_4bit``
and a plain bf16 ``F.linear``, on LLaMA-7B linear shapes, forward and forward + input gradient
(the frozen base of QLoRA gets no weight gradient). Writes JSON to ``--out`` and prints a table.

    python bench/bench_nf4.py --out /tmp/nf4.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from galaxy.loralib.nf4 import dequantize_nf4, nf4_linear, quantize_nf4  # noqa: E402

# name: (out, in, stored transposed) as Galaxy stores them (row-parallel linears as W^T).
SHAPES = {"q_proj": (4096, 4096, False), "o_proj": (4096, 4096, True), "gate_proj": (11008, 4096, False),
          "down_proj": (4096, 11008, True)}


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def dequantize_rows(dev) -> list[dict]:
    """The dequantization alone (what each backend adds before cuBLAS), per stored matrix."""
    import bitsandbytes.functional as bnbf

    from galaxy.loralib.nf4 import _bnb_dequantize
    from galaxy.loralib.nf4 import triton_dequantize

    rows = []
    for name, (out_f, in_f, transposed) in SHAPES.items():
        w = torch.randn(out_f, in_f, device=dev) * 0.02
        q = quantize_nf4(w.t() if transposed else w)
        packed, state = bnbf.quantize_4bit(w.bfloat16(), blocksize=64, compress_statistics=True, quant_type="nf4")
        want = dequantize_nf4(q, torch.bfloat16)
        for label, fn in {"torch": lambda: dequantize_nf4(q, torch.bfloat16),
                          "triton": lambda: triton_dequantize(q, torch.bfloat16),
                          "bnb": lambda: _bnb_dequantize(q, torch.bfloat16),
                          "bnb.dequantize_4bit (own state)": lambda: bnbf.dequantize_4bit(packed, state)}.items():
            same = None if "own" in label else bool(torch.equal(fn(), want))
            rows.append(dict(shape=name, impl=f"dequant {label}", equal_to_reference=same, ms=bench(fn),
                             gb_per_s=out_f * in_f * 2.5 / bench(fn) / 1e6))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def layer_rows(dev, layers: int) -> list[dict]:
    """A LLaMA-7B-shaped model of ``layers`` layers, LoRA r16 on q/v, seq 1024 x batch 4, bf16 autocast:
    one training step (fwd, bwd, AdamW) with the frozen base in fp32 (the old path), bf16, and NF4."""
    from galaxy.config import GalaxyConfig
    from galaxy.core.context import ParallelContext
    from galaxy.models.llama import LlamaForCausalLM
    from galaxy.peft import apply_tuning, frozen_bytes

    rows = []
    for label, extra in {"fp32 base + autocast": dict(frozen_dtype="float32"), "bf16 base": {},
                         "nf4 base (QLoRA)": dict(quantize_base="nf4")}.items():
        cfg = GalaxyConfig.from_dict(dict(preset="llama-7b", num_hidden_layers=layers, seq_length=1024,
                                          tuning="lora", lora_dim=16, lora_alpha=32.0, dtype="bfloat16", **extra))
        torch.cuda.empty_cache()
        model = apply_tuning(LlamaForCausalLM(cfg.model, None, ParallelContext.serial(dev), seed=0), cfg)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
        ids = torch.randint(0, 32000, (4, 1024), device=dev)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = bench(step)
        nbytes, count = frozen_bytes(model)
        rows.append(dict(model=f"llama-7b shapes, {layers} layers", impl=label, step_ms=ms,
                         peak_mib=torch.cuda.max_memory_allocated() / 2**20, frozen_bytes_per_param=nbytes / count))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="nf4_bench.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 4096])
    parser.add_argument("--layers", type=int, default=2, help="layers of the LLaMA-7B-shaped step (0: skip)")
    args = parser.parse_args()
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, (out_f, in_f, transposed) in SHAPES.items():
        w = torch.randn(out_f, in_f, device=dev) * 0.02
        q = quantize_nf4(w.t() if transposed else w)
        w_nf4 = dequantize_nf4(q, torch.bfloat16)
        w_nf4 = w_nf4.t() if transposed else w_nf4  # [out, in]
        w_bf16 = w.bfloat16()
        packed, state = bnbf.quantize_4bit(w.bfloat16(), blocksize=64, compress_statistics=True, quant_type="nf4")
        for m in args.tokens:
            x = torch.randn(m, in_f, device=dev, dtype=torch.bfloat16)
            dy = torch.randn(m, out_f, device=dev, dtype=torch.bfloat16)
            want = x.double() @ w_nf4.double().t()
            want_dx = dy.double() @ w_nf4.double()
            cases = {f"galaxy-{b}": (lambda xx, b=b: nf4_linear(xx, q, transposed=transposed, backend=b))
                     for b in ("torch", "triton", "bnb")}
            cases["bnb.matmul_4bit"] = lambda xx: bnb.matmul_4bit(xx, packed.t(), quant_state=state)
            cases["bf16 F.linear"] = lambda xx: F.linear(xx, w_bf16)
            for label, fn in cases.items():
                xg = x.clone().requires_grad_()
                y = fn(xg)
                (dx,) = torch.autograd.grad(y, xg, dy)
                galaxy = label.startswith("galaxy")
                row = dict(shape=name, out=out_f, inp=in_f, tokens=m, impl=label,
                           err_fwd=rel(y, want) if galaxy else None, err_dx=rel(dx, want_dx) if galaxy else None,
                           fwd_ms=bench(lambda: fn(x)),
                           fwd_bwd_ms=bench(lambda: torch.autograd.grad(fn(xg), xg, dy)))
                rows.append(row)
                print(json.dumps(row), flush=True)
    commit = os.environ.get("GALAXY_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                               capture_output=True, text=True).stdout.strip()
    facts = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, bitsandbytes=bnb.__version__,
                 date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=commit or None)
    dequant = dequantize_rows(dev)
    try:
        steps = layer_rows(dev, args.layers) if args.layers else []
    except Exception:  # keep the kernel numbers when the model step fails
        import traceback

        traceback.print_exc()
        steps = []
    with open(args.out, "w") as f:
        json.dump(dict(facts, rows=rows, dequantize=dequant, steps=steps), f, indent=1)
    print(f"\n{facts}")
    print(f"{'shape':10} {'tokens':>6} {'impl':18} {'fwd ms':>8} {'fwd+dx ms':>10} {'err fwd':>9} {'err dx':>9}")
    for r in rows:
        err = (f"{r['err_fwd']:9.2e} {r['err_dx']:9.2e}" if r["err_fwd"] is not None else "")
        print(f"{r['shape']:10} {r['tokens']:6d} {r['impl']:18} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:10.3f} {err}")
    for r in dequant:
        print(f"{r['shape']:10} {r['impl']:34} {r['ms']:8.4f} ms {r['gb_per_s']:7.0f} GB/s "
              f"equal={r['equal_to_reference']}")
    for r in steps:
        print(f"{r['model']:28} {r['impl']:22} {r['step_ms']:8.2f} ms/step {r['peak_mib']:9.0f} MiB peak "
              f"{r['frozen_bytes_per_param']:.3f} B/frozen param")


if __name__ == "__main__":
    main()
