"""Bytes a transformer layer saves for backward per token, eager against compiled, on this machine.

What the planner's activation calibration measures on a GPU by peak memory (a compiled layer keeps less
for backward than its pieces run eagerly), counted here exactly: every storage autograd saves during a
training forward (``saved_tensors_hooks``, unique storages), under the run's autocast. The layer's share is
the difference between a model of two layers and one (the embeddings, head and loss cancel), and its
per-token part the difference between two sequence lengths (the weights and their autocast copies, which
do not grow with tokens, cancel).

    python bench/saved_activations.py --model llama-7b --seqs 256 512 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from galaxy.config import GalaxyConfig, Plan
from galaxy.core.context import ParallelContext
from galaxy.models import build_model


def saved_bytes(preset: str, layers: int, rows: int, seq: int, dtype: str, compile_: bool) -> int:
    """Bytes of the unique storages a training forward saves for backward (the second run: the first compiles)."""
    cfg = GalaxyConfig.from_dict({"model": {"preset": preset, "num_hidden_layers": layers, "vocab_size": 512,
                                            "compile": compile_}},
                                 {"global_batch_size": rows, "seq_length": seq, "dtype": dtype})
    model = build_model(cfg, Plan.serial(cfg), ParallelContext.serial("cpu"))
    ids = torch.randint(0, 512, (rows, seq), generator=torch.Generator().manual_seed(0))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    low = dtype in ("bfloat16", "float16")
    for _ in range(2):
        storages.clear()
        with torch.autocast("cpu", dtype=getattr(torch, dtype), enabled=low), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        loss.backward()
    return sum(storages.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-7b", help="a preset (its layer shapes; the vocabulary is made small)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seqs", type=int, nargs=2, default=[256, 512], help="two sequence lengths")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    short, long = sorted(args.seqs)
    out = {"model": args.model, "rows": args.rows, "seqs": [short, long], "dtype": args.dtype,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    for compiled in (False, True):
        layer = {s: saved_bytes(args.model, 2, args.rows, s, args.dtype, compiled)
                 - saved_bytes(args.model, 1, args.rows, s, args.dtype, compiled) for s in (short, long)}
        per_token = (layer[long] - layer[short]) / (args.rows * (long - short))
        out["compiled" if compiled else "eager"] = {"layer_bytes_per_token": per_token,
                                                    "layer_bytes_fixed": layer[short] - per_token * args.rows * short}
        print(f"{'compiled' if compiled else 'eager'}: a layer saves {per_token:,.0f} bytes per token "
              f"(+ {out['compiled' if compiled else 'eager']['layer_bytes_fixed']:,.0f} that do not grow with "
              f"tokens: weights' autocast copies)", flush=True)
    out["compiled_over_eager"] = out["compiled"]["layer_bytes_per_token"] / out["eager"]["layer_bytes_per_token"]
    print(f"compiled / eager: {out['compiled_over_eager']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
