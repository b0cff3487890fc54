"""The GPU's matmul throughput in a burst and sustained, with its SM clock and power: where a training step
runs at the card's power limit, the burst peak is not what a step can reach.

    python3 bench/device/sustained_gemm.py --seconds 30 --out sustained_gemm.json

Shapes: a square 8192 bf16 GEMM, and the LLaMA-7B MLP's gate/up product at 4 x 4096 tokens
(16384 x 4096 -> 22016). Each shape: 1 s of warm-up at rest, then back-to-back GEMMs timed by CUDA events in
windows of ~0.5 s for ``--seconds``; nvidia-smi reads clock and power during each window (NVML)."""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch


def read_clock_power() -> tuple[float, float]:
    out = subprocess.run(["nvidia-smi", "-i", str(torch.cuda.current_device()), "--query-gpu=clocks.sm,power.draw",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    clock, power = out.strip().split(",")
    return float(clock), float(power)


def run(m: int, k: int, n: int, seconds: float) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * k * n
    per = 8
    time.sleep(1.0)  # start from a rested card
    windows, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(per):
            a @ b
        e.record()
        clock, power = read_clock_power()
        e.synchronize()
        ms = s.elapsed_time(e)
        windows.append({"t_s": round(time.perf_counter() - start, 2), "tflops": flops * per / ms / 1e9,
                        "sm_mhz": clock, "power_w": power})
        per = max(8, int(per * 500 / max(ms, 1e-3)))  # ~0.5 s windows
    first, last = windows[0], windows[len(windows) // 2:]
    return {"shape": [m, k, n], "burst_tflops": first["tflops"], "burst_sm_mhz": first["sm_mhz"],
            "sustained_tflops": sum(w["tflops"] for w in last) / len(last),
            "sustained_sm_mhz": sum(w["sm_mhz"] for w in last) / len(last),
            "sustained_power_w": sum(w["power_w"] for w in last) / len(last),
            "windows": windows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    limit = subprocess.run(["nvidia-smi", "-i", str(torch.cuda.current_device()), "--query-gpu=power.limit",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": "sustained_gemm", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "power_limit_w": float(limit), "date": time.strftime("%Y-%m-%d"),
              "runs": [run(8192, 8192, 8192, args.seconds), run(16384, 4096, 22016, args.seconds)]}
    for r in result["runs"]:
        print(r["shape"], {k: round(v, 1) for k, v in r.items() if k not in ("shape", "windows")})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
