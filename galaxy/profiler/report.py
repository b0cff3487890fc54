"""Text rendering of a profile (DeepSpeed-style) and the number formatting it uses.

Works on the plain dict produced by ``FlopsProfiler.to_json()``, so the text and the JSON cannot
disagree.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "number_to_string",
    "flops_to_string",
    "macs_to_string",
    "params_to_string",
    "duration_to_string",
    "bytes_to_string",
    "format_report",
    "format_parallel_report",
    "format_parallel_section",
]

DEFAULT_PRECISION = 2

_MAGNITUDES = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


def number_to_string(num: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """Same format as DeepSpeed's helper: ``22.35 G``."""
    if units is None:
        if num >= 1e12:
            units = "T"
        elif num >= 1e9:
            units = "G"
        elif num >= 1e6:
            units = "M"
        elif num >= 1e3:
            units = "K"
        elif num >= 1 or num == 0:
            units = ""
        elif num >= 1e-3:
            units = "m"
        else:
            units = "u"
    magnitude = _MAGNITUDES.get(units, 1.0)
    return f"{round(num / magnitude, precision):g} {units}"


def flops_to_string(flops: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    """A FLOP/s rate, DeepSpeed style (``1.2 TFLOPS``)."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def macs_to_string(macs: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def params_to_string(params: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


def bytes_to_string(nbytes: float, units: Optional[str] = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(nbytes, units, precision)}B"


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, DEFAULT_PRECISION):g}%" if whole else "0%"


def _opt(value: Any, fmt) -> str:
    return "n/a" if value is None else fmt(value)


def _summary(data: dict[str, Any], profile_step: int) -> list[str]:
    line = "{:<64}  {}".format
    run, params, flops, macs = data["run"], data["params"], data["flops"], data["macs"]
    lat, rate = data["latency_s"], data["tflops"]
    out = [
        "",
        "-------------------------- Galaxy Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        "Notes: FLOPs are counted per aten op as it runs (forward and backward measured, not",
        "assumed), 1 MAC = 2 FLOPs, only matmul-class ops (mm, bmm, conv, attention) cost FLOPs;",
        "elementwise/norm/softmax ops count 0 as in torch.utils.flop_counter. Work re-run during",
        "backward (activation recompute) is counted as backward.",
        "",
        line("world size:", run["world_size"]),
        line("rank:", run["rank"]),
    ]
    if run.get("plan"):
        out.append(line("plan:", ", ".join(f"{k}={v}" for k, v in run["plan"].items())))
    if run.get("batch") is not None or run.get("seq_len") is not None:
        out.append(line("batch size per rank / sequence length:", f"{run.get('batch')} / {run.get('seq_len')}"))
    out += [
        line("device:", run.get("device_name") or run.get("device")),
        line("params per rank (total):", params_to_string(params["local"])),
        line("params per rank (trainable):", params_to_string(params["trainable"])),
        line("params of model (all ranks):", _opt(params["global"], params_to_string)),
        line("fwd MACs per rank:", macs_to_string(macs["fwd"])),
        line("fwd flops per rank:", number_to_string(flops["fwd"])),
        line("bwd MACs per rank:", macs_to_string(macs["bwd"])),
        line("bwd flops per rank:", number_to_string(flops["bwd"])),
        line("bwd flops / fwd flops:", f"{flops['bwd'] / flops['fwd']:.3f}" if flops["fwd"] else "n/a"),
        line("total flops per rank (fwd + bwd):", number_to_string(flops["total"])),
    ]
    if flops["outside_model"]:
        out.append(line("  of which outside the model's modules:", number_to_string(flops["outside_model"])))
    if run.get("timed") is False:
        out.append(line("timings:", "not measured (shapes-only run: fake/meta tensors)"))
    out += [
        line("fwd latency (sum of the model's forward calls):", duration_to_string(lat["fwd"])),
        line("fwd FLOPS per rank = fwd flops / fwd latency:",
             _opt(rate["fwd"], lambda v: flops_to_string(v * 1e12))),
        line("window wall time (start_profile .. stop_profile):", duration_to_string(lat["window"])),
        line("achieved FLOPS per rank = total flops / window time:",
             _opt(rate["achieved"], lambda v: flops_to_string(v * 1e12))),
        line("peak FLOPS per rank:", _opt(data["peak_tflops"], lambda v: flops_to_string(v * 1e12))),
        line("MFU = achieved / peak:", _opt(data["mfu"], lambda v: f"{100 * v:.2f}%")),
        line("causal attention halving:", "on" if data["causal_halving"] else "off"),
    ]
    unc = data["uncounted_ops"]
    if unc:
        out.append("uncounted ops (compute with no FLOP formula, counted as 0 here):")
        out += [f"    {name}: {calls} calls" for name, calls in sorted(unc.items(), key=lambda kv: -kv[1])]
    else:
        out.append(line("uncounted ops:", "none"))
    comm = data.get("comm")
    if comm is not None:
        out.append(f"communication per step ({comm['steps']} step(s) marked; 0 counts as 1):")
        if not comm["rows"]:
            out.append("    no collectives recorded")
        for row in comm["rows"]:
            bw = _opt(row["GBps"], lambda v: f"{v:.2f} GB/s")
            out.append(
                f"    {row['op']:<16} group={row['group']:<8} {row['phase']:<5} "
                f"{bytes_to_string(row['bytes_per_step']):>10}/step  {row['calls_per_step']:g} calls/step  "
                f"{duration_to_string(row['seconds'])} total  {bw}"
            )
    return out


def _aggregated(data: dict[str, Any], module_depth: int, top_modules: int) -> list[str]:
    info: dict[int, dict[str, list[float]]] = {}
    for m in data["modules"]:
        per_class = info.setdefault(m["depth"], {}).setdefault(m["class"], [0, 0, 0, 0.0])
        per_class[0] += m["params"]
        per_class[1] += m["fwd_flops"]
        per_class[2] += m["bwd_flops"]
        per_class[3] += m["fwd_latency_s"]
    max_depth = max(info) if info else 0
    depth = max_depth if module_depth == -1 else min(module_depth, max_depth)
    out = [
        "",
        "----------------------------- Aggregated Profile per rank -----------------------------",
        f"Top {top_modules} modules in terms of params, fwd FLOPs, bwd FLOPs or fwd latency at different model depths:",
    ]
    metrics = (("params     ", 0, params_to_string), ("fwd FLOPs  ", 1, number_to_string),
               ("bwd FLOPs  ", 2, number_to_string), ("fwd latency", 3, duration_to_string))
    for d in range(depth + 1):
        out.append(f"depth {d}:")
        for label, idx, fmt in metrics:
            top = sorted(info[d].items(), key=lambda kv: kv[1][idx], reverse=True)[:top_modules]
            out.append(f"    {label} - {{{', '.join(f'{k!r}: {fmt(v[idx])!r}' for k, v in top)}}}")
    return out


def _detailed(data: dict[str, Any], module_depth: int) -> list[str]:
    total_params = data["params"]["local"]
    fwd_total, bwd_total = data["flops"]["fwd"], data["flops"]["bwd"]
    root_latency = data["latency_s"]["fwd"]
    out = [
        "",
        "------------------------------ Detailed Profile per rank ------------------------------",
        "Each module: params (% of total), fwd FLOPs (% of fwd total), bwd FLOPs (% of bwd total),",
        "fwd latency (% of the model's), fwd FLOPS. A parent's numbers include its children and any",
        "functional ops it calls directly.",
        "",
    ]
    for m in data["modules"]:
        if module_depth != -1 and m["depth"] > module_depth:
            continue
        label = m["class"] if not m["name"] else f"({m['name'].rsplit('.', 1)[-1]}): {m['class']}"
        rate = _opt(m["fwd_tflops"], lambda v: flops_to_string(v * 1e12))
        out.append(
            "  " * m["depth"] + f"{label}  "
            f"{params_to_string(m['params'])} = {_pct(m['params'], total_params)} params, "
            f"{number_to_string(m['fwd_flops'])}FLOPs = {_pct(m['fwd_flops'], fwd_total)} fwd, "
            f"{number_to_string(m['bwd_flops'])}FLOPs = {_pct(m['bwd_flops'], bwd_total)} bwd, "
            f"{duration_to_string(m['fwd_latency_s'])} = {_pct(m['fwd_latency_s'], root_latency)} latency, "
            f"{rate}"
        )
    return out


_RULE = "------------------------------------------------------------------------------"


def _report_lines(data: dict[str, Any], profile_step: int, module_depth: int, top_modules: int,
                  detailed: bool) -> list[str]:
    lines = _summary(data, profile_step)
    lines += _aggregated(data, module_depth, top_modules)
    if detailed:
        lines += _detailed(data, module_depth)
    return lines


def format_report(
    data: dict[str, Any],
    profile_step: int = 1,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
) -> str:
    return "\n".join(_report_lines(data, profile_step, module_depth, top_modules, detailed) + [_RULE])


# ----------------------------------------------------------------------------- parallel section


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def _table(header: list[str], rows: list[list[str]], indent: str = "    ") -> list[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    return [indent + _row(header, widths)] + [indent + _row(r, widths) for r in rows]


def format_parallel_section(data: dict[str, Any]) -> list[str]:
    """The parallel part of a report, from ``ParallelProfiler.to_json()``."""
    run, params, sums, ranks = data["run"], data["params"], data["sum"], data["ranks"]
    world = run["world_size"]
    line = "{:<64}  {}".format
    out = [
        "",
        f"---------------------- Parallel Profile (model-parallel group of {world}) ----------------------",
    ]
    if run.get("plan"):
        out.append(line("plan:", f"{run['plan']} (ATT={run['att']}, CON={run['con']}, MLP={run['mlp']}; "
                                  f"stream layout {run['stream']})"))
        out.append(line("splits (heads / ffn / seq):",
                        f"{run['heads_split']} / {run['ffn_split']} / {run['seq_split']}"))
    out += [
        line("params of the full model (each tensor once, full shape):", params_to_string(params["global"])),
        line("trainable params of the full model:", params_to_string(params["global_trainable"])),
        line("params this rank holds whole (copied on every rank):", params_to_string(params["whole_local"])),
    ]
    if params.get("sum_over_ranks") is not None:
        out.append(line("params summed over ranks (global + (N-1) x whole copies):",
                        params_to_string(params["sum_over_ranks"])))
    if not data["gathered"]:
        out.append("(per-rank numbers of the other ranks were not gathered: this rank only)")
    header = ["rank", "params", "fwd FLOPs", "bwd FLOPs", "total FLOPs", "replicated", "comm bytes", "window",
              "TFLOP/s"]
    rows = []
    for r in ranks:
        rows.append([str(r["rank"]), params_to_string(r["params"]["local"]), number_to_string(r["flops"]["fwd"]),
                     number_to_string(r["flops"]["bwd"]), number_to_string(r["flops"]["total"]),
                     number_to_string(r["replicated"]["per_rank"]["total"]),
                     bytes_to_string(r["comm_bytes"]["total"]), duration_to_string(r["window_s"]),
                     _opt(r["achieved_tflops"], lambda v: f"{v:.4g}")])
    rows.append(["sum", params_to_string(sums["params_local"]), number_to_string(sums["flops"]["fwd"]),
                 number_to_string(sums["flops"]["bwd"]), number_to_string(sums["flops"]["total"]),
                 number_to_string(sums["replicated"]["total"]), bytes_to_string(sums["comm_bytes"]["total"]),
                 duration_to_string(sums["window_s_max"]) + " (max)",
                 _opt(sums["achieved_tflops"], lambda v: f"{v:.4g}")])
    out.append("per rank (one step; 'replicated' = FLOPs that every rank repeats):")
    out += _table(header, rows)
    red, ser = sums["redundant"], sums["serial_equivalent"]
    out += [
        line("redundant FLOPs over the group (sum(R_i) - max(R_i)):",
             f"{number_to_string(red['total'])} (fwd {number_to_string(red['fwd'])}, bwd "
             f"{number_to_string(red['bwd'])}) = {_pct(red['total'], sums['flops']['total'])} of the sum"),
        line("serial-equivalent FLOPs (sum over ranks - redundant):",
             f"{number_to_string(ser['total'])} (fwd {number_to_string(ser['fwd'])}, bwd "
             f"{number_to_string(ser['bwd'])})"),
        line("MFU of the group (sum / max window / (N x peak)):", _opt(sums["mfu"], lambda v: f"{100 * v:.2f}%")),
        line("useful MFU (serial-equivalent FLOPs only):", _opt(sums["useful_mfu"], lambda v: f"{100 * v:.2f}%")),
    ]
    rep = data["replicated"]
    out.append(f"replicated compute on this rank ({rep['method']}):")
    if rep["modules"]:
        out += _table(["module", "class", "fwd FLOPs", "bwd FLOPs"],
                      [[m["name"] or "(model)", m["class"], number_to_string(m["fwd_flops"]),
                        number_to_string(m["bwd_flops"])] for m in rep["modules"]])
    else:
        out.append("    none with FLOPs")
    if rep["zero_flop_modules"]:
        zero = ", ".join(f"{cls} x{n}" for cls, n in sorted(rep["zero_flop_modules"].items()))
        out.append(f"    also repeated, 0 FLOPs by convention (elementwise/norm work): {zero}")
    comm = data["comm"]
    out.append(f"communication per step on this rank, by transition ({comm['steps']} step(s) marked; 0 counts as 1):")
    if comm["rows"]:
        out += _table(["transition", "op", "phase", "bytes/step", "calls/step", "time", "GB/s"],
                      [[r["transition"], r["op"], r["phase"], bytes_to_string(r["bytes_per_step"]),
                        f"{r['calls_per_step']:g}", duration_to_string(r["seconds"]),
                        _opt(r["GBps"], lambda v: f"{v:.2f}")] for r in comm["rows"]])
    else:
        out.append("    no collectives recorded")
    gs = comm.get("grad_sync")
    if gs:
        out.append(line("gradient sync all-reduce (analytic, not observed):",
                        f"{bytes_to_string(gs['bytes_per_step'])}/step"))
    layers = comm["layers"]
    if layers:
        out.append("communication per step by layer (this rank):")
        rows = []
        for name in layers:
            ops = comm["by_module"][name]
            total = sum(v["bytes_per_step"] for v in ops.values())
            detail = ", ".join(f"{k} {bytes_to_string(v['bytes_per_step'])}" for k, v in sorted(ops.items()))
            rows.append([name, bytes_to_string(total), detail])
        out += _table(["layer", "bytes/step", "by op/phase"], rows)
        rest = {k: v for k, v in comm["by_module"].items() if k == "" or k.startswith("<")}
        for name, ops in sorted(rest.items()):
            total = sum(v["bytes_per_step"] for v in ops.values())
            out.append(f"    {name or '(whole model)'}: {bytes_to_string(total)}/step")
    return out


def format_parallel_report(
    data: dict[str, Any],
    profile_step: int = 1,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
) -> str:
    """This rank's report (``data['local']``) followed by the parallel section."""
    lines = _report_lines(data["local"], profile_step, module_depth, top_modules, detailed)
    return "\n".join(lines + format_parallel_section(data) + [_RULE])
