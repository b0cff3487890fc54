"""Where a long-context LoRA step's memory goes, per layer memory mode (``layer_memory``, ``mlp_chunks``).

The memory model (``galaxy.planner.activation``: a probe of the run's own layer, eager, on this device): per
layer and mode the bytes kept on the device and on the host, what its backward rebuilds and the seconds it adds;
what the rest of the step holds (weights, trainable states, the embeddings', head's and loss's activations); the
predicted peak with every layer in one mode; with ``--budget_gib`` the fastest per-layer mix that fits. With
``--measure`` (a GPU): each ``--modes`` entry trained a few steps (``galaxy.train.loop.train``, as bench_lora's
Galaxy contenders) at each length: peak allocated memory, step time and loss, beside the prediction, a row saying
OOM where it did not fit; the largest tensors one eager step creates, by op and shape (what grows as [seq, seq],
[seq, vocab] or [seq, ffn]); and with ``--memory_history DIR`` a ``torch.cuda.memory`` snapshot of each measured
step (open it in https://pytorch.org/memory_viz to see which allocations make the peak).

    python bench/long_context_memory.py --preset llama-1b --seqs 32768 65536 131072 [--quantize nf4] \\
        [--budget_gib 5.7] [--measure --modes full+offload mlp+offload auto --memory_history DIR] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from galaxy.config import LAYER_MEMORY_MODES, MODEL_PRESETS, GalaxyConfig  # noqa: E402
from galaxy.planner.activation import (at_length, device_rate, fixed_bytes,  # noqa: E402
                                       mode_options, probe_layer)
from galaxy.planner.cluster import DEFAULT_HOST_LINK_BYTES_PER_S  # noqa: E402
from galaxy.planner.memory import choose_layer_memory, stack_bytes  # noqa: E402
from galaxy.planner.profile import measure_host_link  # noqa: E402

MIB, GIB = 2**20, 2**30
LORA = {"tuning": "lora", "lora_dim": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"]}  # bench_lora's


def config(args, seq: int, **model) -> GalaxyConfig:
    """bench_lora's Galaxy contender at ``seq`` tokens (``model``: more model keys)."""
    positions = max(seq, MODEL_PRESETS[args.preset].get("max_position_embeddings", seq))
    return GalaxyConfig.from_dict({
        "model": {"preset": args.preset, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                  "compile": args.compile, "max_position_embeddings": positions, "mlp_chunks": args.mlp_chunks,
                  **model},
        "train": {"global_batch_size": args.batch, "seq_length": seq, "max_steps": args.warmup + args.steps,
                  "dtype": args.dtype, "lr": 1e-4, "warmup_steps": 0, "grad_clip": 1.0, "log_every": 10**6},
        "peft": dict(LORA, quantize_base=args.quantize)})


def model_rows(args, device: torch.device) -> dict:
    """The memory model at every length: per mode, per layer, and the predicted peak of a uniform stack."""
    base = config(args, max(args.seqs))
    short, long = probe_layer(base, device, args.batch, args.budget_gib * GIB if args.budget_gib else None)
    rate = device_rate(base, device)
    link = args.host_link_gb_per_s * 1e9 if args.host_link_gb_per_s else DEFAULT_HOST_LINK_BYTES_PER_S
    layers = base.model.num_hidden_layers
    out = {}
    for seq in args.seqs:
        cfg = config(args, seq)
        probe = at_length(short, long, seq)
        options = mode_options(probe, rate, link, args.mlp_chunks)
        fixed = fixed_bytes(cfg, probe, layers)
        rows = {}
        print(f"\n{args.preset} {args.quantize} seq {seq}: beside the layers {fixed / GIB:.2f} GiB (weights, trainable "
              f"states, embeddings/head/loss activations {probe.edge_saved / GIB:.2f} GiB)")
        print(f"{'mode':<18}{'kept MiB':>10}{'host MiB':>10}{'rebuilt MiB':>12}{'+ms/layer':>10}{'peak GiB':>10}"
              f"{'host GiB':>10}")
        for o in options:
            device_bytes, host_bytes = stack_bytes([o], [layers])
            rows[o.mode] = {"kept_bytes": float(o.kept), "host_bytes": float(o.host), "rebuilt_bytes": float(o.rebuilt),
                            "extra_s": float(o.extra_s), "peak_bytes": fixed + float(device_bytes),
                            "host_total_bytes": float(host_bytes)}
            print(f"{o.mode:<18}{o.kept / MIB:>10.0f}{o.host / MIB:>10.0f}{o.rebuilt / MIB:>12.0f}"
                  f"{o.extra_s * 1e3:>10.2f}{(fixed + device_bytes) / GIB:>10.2f}{host_bytes / GIB:>10.2f}")
        entry = {"fixed_bytes": fixed, "modes": rows}
        if args.budget_gib:
            try:
                entry["auto"] = choose_layer_memory(options, layers, args.budget_gib * GIB - fixed)
            except Exception as e:  # nothing fits: say so and go on
                entry["auto"] = str(e)
            print(f"auto within {args.budget_gib} GiB: {entry['auto']}")
        out[str(seq)] = entry
    return out


class LargestTensors(TorchDispatchMode):
    """The ``most`` largest tensors ops create, one per (op, shape, dtype), by bytes."""

    def __init__(self, most: int = 12):
        super().__init__()
        self.most, self.seen = most, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = (str(func.overloadpacket.__name__), tuple(t.shape), str(t.dtype).replace("torch.", ""))
                self.seen[key] = t.numel() * t.element_size()
        return out

    def table(self) -> list:
        return [{"op": k[0], "shape": list(k[1]), "dtype": k[2], "bytes": b}
                for k, b in sorted(self.seen.items(), key=lambda kv: -kv[1])[: self.most]]


def largest_tensors(args, seq: int, mode: str, device: torch.device) -> list:
    """One eager training step's largest tensors (dispatch modes run compiled layers eagerly anyway)."""
    from galaxy.core.context import ParallelContext
    from galaxy.peft import apply_tuning, build_base

    cfg = config(args, seq, compile=False, layer_memory=[mode] * config(args, seq).model.num_hidden_layers)
    model = apply_tuning(build_base(cfg, None, ParallelContext.serial(device)), cfg).train()
    ids = torch.randint(0, cfg.model.vocab_size, (args.batch, seq), device=device)
    low = args.dtype in ("bfloat16", "float16")
    watch = LargestTensors()
    with watch, torch.autocast(device.type, dtype=getattr(torch, args.dtype), enabled=low):
        loss = model(input_ids=ids, labels=ids).loss
    with watch:
        loss.backward()
    return watch.table()


def _site(frames: list) -> str:
    """Where an allocation came from: its innermost frame in galaxy's or bench's code, else its innermost frame."""
    for f in frames:
        name = f.get("filename", "")
        if "/galaxy/" in name or "/bench/" in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    f = frames[0] if frames else {}
    return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"


def live_at_peak(snapshot: dict, before: int, most: int = 15) -> dict:
    """Replay a ``torch.cuda.memory._snapshot()`` trace as the caching allocator counts allocated bytes (a block
    counts from its ``alloc`` to its ``free_requested``, as ``max_memory_allocated`` does): the bytes alive at the
    highest point and at the trace's end (after an OOM: what was held when it failed, and the failed request),
    grouped by allocation site. Beside them the most bytes an allocation found freed but not yet reusable (between
    ``free_requested`` and ``free_completed``: a block used on another stream, e.g. an offload copy's source, waits
    for that stream). ``before``: bytes allocated when recording began (weights and the like; the trace does not
    see them)."""
    live, pending, total, peak, at_peak, most_pending, oom = {}, {}, before, before, {}, 0, None
    for trace in snapshot.get("device_traces", []):
        for e in trace:
            if e["action"] == "alloc":  # what is pending now is memory this allocation cannot reuse
                most_pending = max(most_pending, sum(b["size"] for b in pending.values()))
                live[e["addr"]] = e
                total += e["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif e["action"] == "free_requested" and e["addr"] in live:
                pending[e["addr"]] = live.pop(e["addr"])
                total -= e["size"]
            elif e["action"] == "free_completed":
                pending.pop(e["addr"], None)
            elif e["action"] == "oom":  # the allocation that failed
                oom = {"bytes": e["size"], "site": _site(e.get("frames", []))}

    def grouped(blocks: dict) -> list:
        sites = {}
        for e in blocks.values():
            s = sites.setdefault(_site(e.get("frames", [])), {"bytes": 0, "count": 0})
            s["bytes"] += e["size"]
            s["count"] += 1
        return [{"site": k, **v} for k, v in sorted(sites.items(), key=lambda kv: -kv[1]["bytes"])[:most]]

    return {"before_bytes": before, "peak_bytes": peak, "at_peak": grouped(at_peak), "end_bytes": total,
            "at_end": grouped(live), "most_pending_bytes": most_pending, "oom": oom}


def predicted_peak(args, cfg: GalaxyConfig, device: torch.device) -> float:
    """The memory model's peak for ``cfg``'s per-layer modes and MLP chunks (what ``auto`` planned against)."""
    budget = args.budget_gib * GIB if args.budget_gib else None
    probe = at_length(*probe_layer(cfg, device, args.batch, budget), cfg.train.seq_length)
    link = args.host_link_gb_per_s * 1e9 if args.host_link_gb_per_s else DEFAULT_HOST_LINK_BYTES_PER_S
    options = {o.mode: o for o in mode_options(probe, device_rate(cfg, device), link, cfg.model.mlp_chunks)}
    modes = list(cfg.model.layer_memory)
    distinct = sorted(set(modes))
    device_bytes, _ = stack_bytes([options[m] for m in distinct], [modes.count(m) for m in distinct])
    return fixed_bytes(cfg, probe, len(modes)) + float(device_bytes)


def measure(args, seq: int, mode: str, device: torch.device) -> dict:
    """``mode`` (a layer memory mode for every layer, or ``auto`` within ``--budget_gib``) trained at ``seq``."""
    from bench.bench_plans import StepTimer, causal_lm_data
    from galaxy.core.context import ParallelContext
    from galaxy.peft import apply_tuning, build_base
    from galaxy.planner.activation import resolve_activation_memory
    from galaxy.train.loop import train

    ctx = ParallelContext.serial(device, seed=0)
    if mode == "auto":
        cfg = resolve_activation_memory(config(args, seq, activation_memory="auto", memory_budget_gib=args.budget_gib,
                                               host_link_gb_per_s=args.host_link_gb_per_s), ctx)
    else:
        cfg = config(args, seq, layer_memory=[mode] * config(args, seq).model.num_hidden_layers)
    row = {"seq": seq, "mode": mode, "layer_memory": cfg.model.layer_memory, "mlp_chunks": cfg.model.mlp_chunks,
           "predicted_peak_mib": predicted_peak(args, cfg, device) / MIB}
    timer = StepTimer(args.warmup)
    times, losses = timer.times, timer.losses
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = 0
    try:
        model = apply_tuning(build_base(cfg, None, ctx), cfg)
        if args.memory_history:
            before = torch.cuda.memory_allocated(device)
            torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        try:
            train(model, causal_lm_data(cfg), cfg, ctx, on_step=timer)
        finally:
            if args.memory_history:  # kept after an OOM too: what was held when it failed
                os.makedirs(args.memory_history, exist_ok=True)
                path = os.path.join(args.memory_history, f"{args.quantize}_{seq}_{mode}.pickle")
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                with open(path, "wb") as f:
                    pickle.dump(snapshot, f)
                row.update(snapshot=path, allocations=live_at_peak(snapshot, before))
        row.update(peak_mib=torch.cuda.max_memory_allocated() / MIB, step_ms=1e3 * min(times) if times else None,
                   tokens_per_s=args.batch * seq / min(times) if times else None, losses=losses)
    except torch.OutOfMemoryError:
        row.update(peak_mib=None, oom=True)
    finally:
        if args.memory_history:
            torch.cuda.memory._record_memory_history(enabled=None)
        model = None
        torch._dynamo.reset()  # its compiled graphs hold the model: the next length starts from an empty card
        torch.cuda.empty_cache()
    failed = row.get("allocations", {}).get("oom")
    if row.get("oom"):
        outcome = "OOM" + (f" asking {failed['bytes'] / MIB:,.0f} MiB at {failed['site']}" if failed else "")
    else:
        outcome = (f"peak {row['peak_mib']:,.0f} MiB, step {row['step_ms']:.1f} ms, {row['tokens_per_s']:,.0f} "
                   f"tokens/s, loss {losses[-1]:.4f}")
    print(f"  measured {mode:<18} seq {seq} (predicted {row['predicted_peak_mib']:,.0f} MiB): {outcome}", flush=True)
    for when in ("at_peak", "at_end") if "allocations" in row else ():
        print(f"    alive {when[3:]} ({row['allocations'][when[3:] + '_bytes'] / MIB:,.0f} MiB, "
              f"{before / MIB:,.0f} of them before the first step; freed but not yet reusable at most "
              f"{row['allocations']['most_pending_bytes'] / MIB:,.0f} MiB):")
        for s in row["allocations"][when][:8]:
            print(f"      {s['bytes'] / MIB:>9,.0f} MiB {s['count']:>6}x  {s['site']}")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", default="none", choices=["none", "nf4", "int8"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--mlp_chunks", type=int, default=1)
    p.add_argument("--host_link_gb_per_s", type=float, default=None, help="unset: measured on a GPU")
    p.add_argument("--budget_gib", type=float, default=None, help="the auto plan within this device memory")
    p.add_argument("--measure", action="store_true", help="train each --modes entry (a GPU)")
    p.add_argument("--modes", nargs="+", default=["full+offload", "mlp+offload"],
                   help=f"layer memory modes ({', '.join(LAYER_MEMORY_MODES)}) or auto (needs --budget_gib)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--memory_history", default=None, help="a torch.cuda.memory snapshot per measured step here")
    p.add_argument("--largest", default=None, metavar="MODE",
                   help="the largest tensors of one eager step with every layer in this memory mode")
    p.add_argument("--card_gib", type=float, default=None, metavar="G",
                   help="cap the caching allocator at G GiB (a smaller card, as bench_lora's --card_gib)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.card_gib is not None:
        if device.type != "cuda":
            p.error("--card_gib caps a GPU's caching allocator: give it with --device cuda")
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.card_gib * GIB / total, device)
    if args.host_link_gb_per_s is None and device.type == "cuda":  # what plan_galaxy.py profile measures
        args.host_link_gb_per_s = measure_host_link(device) / 1e9
        print(f"host link: {args.host_link_gb_per_s:.1f} GB/s (pinned copies, the slower direction)")
    out = {"args": vars(args), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "model": model_rows(args, device), "measured": [], "largest": {}}
    for seq in args.seqs:
        if args.largest:
            out["largest"][str(seq)] = largest_tensors(args, seq, args.largest, device)
            print(f"largest tensors of one eager step at {seq} ({args.largest}):")
            for t in out["largest"][str(seq)]:
                print(f"  {t['bytes'] / MIB:>10,.0f} MiB  {t['op']:<40} {t['shape']} {t['dtype']}")
        if args.measure:
            out["measured"] += [measure(args, seq, mode, device) for mode in args.modes]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
