"""Where the planner's GPU profile goes wrong, on one GPU (issue 31 item 6): one calibration step of
the serial model under torch.profiler (where its wall time goes, host and device), a few pieces
timed both ways (host clock with a synchronize around each part, and ``DeviceTimer``'s events), and
one piece in bursts against back to back for ``--sustain_s`` (does a sustained load run slower?).

    PYTHONPATH=. python3 bench/device/planner_probe.py --model llama-7b --layers 2 --rows 4 --out probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Optional

import torch

from galaxy.config import GalaxyConfig
from galaxy.planner.blocks import BlockBench, DeviceTimer, PieceRun
from galaxy.planner.profile import measure_serial


def top_ops(prof, key: str, count: int = 15) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:count]
    return [{"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
             "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3)} for e in rows]


def sm_clock_mhz() -> Optional[int]:
    try:
        return int(torch.cuda.clock_rate())  # pynvml, where the image has it
    except Exception:  # noqa: BLE001 (no pynvml, no permission: the clock is then read from nvidia-smi's log)
        return None


def sustained(bench: BlockBench, make, seconds: float) -> dict:
    """A piece's forward + backward as the profile times it (a burst after an idle GPU) against the same run
    back to back for ``seconds`` (as a training step keeps the GPU busy): does the card slow down under a
    sustained load (power limit, clocks)?"""
    run = PieceRun(bench, make)

    def step() -> None:
        outs = run.forward()
        run.grads = run.grads or [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, run.grads)
        for x in run.inputs:
            x.grad = None
    burst = []
    for _ in range(5):
        torch.cuda.synchronize()
        time.sleep(0.2)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        burst.append(start.elapsed_time(end))
    events, begun = [], time.perf_counter()
    clocks = [sm_clock_mhz()]
    while time.perf_counter() - begun < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
        if len(events) % 50 == 0:
            end.synchronize()
            clocks.append(sm_clock_mhz())
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in events]
    last = times[-max(1, len(times) // 5):]
    return {"burst_ms": round(statistics.median(burst), 4), "first_ms": round(times[0], 4),
            "last_fifth_ms": round(statistics.median(last), 4), "runs": len(times),
            "slowdown": round(statistics.median(last) / statistics.median(burst), 4), "sm_clock_mhz": clocks}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--sustain_s", type=float, default=10.0, help="seconds of back-to-back runs (sustained)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cuda")
    m = GalaxyConfig.from_dict({"model": {"preset": args.model, "compile": args.compile}}).model
    small = dataclasses.replace(m, num_hidden_layers=args.layers)
    out = {"model": args.model, "layers": args.layers, "rows": args.rows, "seq": args.seq, "compile": args.compile}

    steps, forwards = measure_serial(small, args.rows, args.seq, "bfloat16", device, reps=2)
    out["serial_steps_s"], out["serial_forwards_s"] = steps, forwards
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        steps_profiled, _ = measure_serial(small, args.rows, args.seq, "bfloat16", device, reps=1)
    out["profiled_steps_s"] = steps_profiled
    out["top_by_cpu"] = top_ops(prof, "self_cpu_time_total")
    out["top_by_device"] = top_ops(prof, "self_device_time_total")

    timer = DeviceTimer(device)
    bench = BlockBench(m, 1, args.seq, device, "bfloat16")
    H, F_ = m.num_attention_heads, m.intermediate_size
    pieces = {"mlp.ffn=full": lambda: bench.mlp(F_, args.seq), "mlp.ffn=1/4": lambda: bench.mlp(F_ // 4, args.seq),
              "att_proj.heads=1/4": lambda: bench.att_proj(H // 4, args.seq),
              "att_core.heads=1/4": lambda: bench.att_core(H // 4, args.seq, args.seq),
              "con.tokens=full": lambda: bench.con(args.seq), "head.tokens=full": lambda: bench.head(args.seq)}
    out["pieces"] = {}
    for name, make in pieces.items():
        timed = {}
        for how, t in (("host_sync", None), ("events", timer)):
            run = PieceRun(bench, make, t)
            samples = [run.once() for _ in range(6)][1:]
            timed[how] = [round(statistics.median(s[q] for s in samples) * 1e3, 4) for q in range(3)]
        out["pieces"][name] = timed
        print(name, timed, flush=True)
    out["timer_lead_s"] = timer.lead_s
    out["sustained"] = sustained(bench, lambda: bench.mlp(F_, args.seq), args.sustain_s)
    print("sustained", out["sustained"], flush=True)
    print(json.dumps({k: out[k] for k in ("serial_steps_s", "serial_forwards_s", "profiled_steps_s")}))
    for row in out["top_by_cpu"] + out["top_by_device"]:
        print(row)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
