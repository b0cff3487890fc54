"""The text of a profile (``galaxy.profiler.report``): DeepSpeed's number format (``22.35 G``), and a
report whose every number is the JSON's, module shares included, cut at the asked module depth."""

from galaxy.profiler.report import (bytes_to_string, duration_to_string, flops_to_string, format_report,
                                    number_to_string, params_to_string)


def test_numbers_take_the_unit_of_their_magnitude():
    assert number_to_string(22_345_678_901) == "22.35 G"
    assert number_to_string(1.5e12) == "1.5 T" and number_to_string(999.0) == "999 " and number_to_string(0) == "0 "
    assert number_to_string(0.0042) == "4.2 m" and number_to_string(3e-7) == "0.3 u"
    assert number_to_string(2e9, units="M") == "2000 M" and number_to_string(1234.5678, precision=3) == "1.235 K"
    assert params_to_string(1.5e9) == "1.5 B" and params_to_string(7e9, units="B") == "7 B"
    assert flops_to_string(3e12) == "3 TFLOPS" and duration_to_string(0.25) == "250 ms"
    assert bytes_to_string(4096) == "4.1 KB"


def module(name, cls, depth, params, fwd, bwd, latency):
    return {"name": name, "class": cls, "depth": depth, "params": params, "trainable_params": params,
            "fwd_flops": fwd, "bwd_flops": bwd, "fwd_latency_s": latency, "fwd_tflops": fwd / latency / 1e12}


PROFILE = {
    "run": {"world_size": 2, "rank": 1, "plan": {"ATT": "tp", "MLP": "sp"}, "batch": 4, "seq_len": 128,
            "device": "cpu", "device_name": None},
    "params": {"local": 3_000_000, "trainable": 1_000_000, "global": 6_000_000},
    "flops": {"fwd": 8e9, "bwd": 16e9, "total": 24e9, "outside_model": 0},
    "macs": {"fwd": 4e9, "bwd": 8e9},
    "latency_s": {"fwd": 0.5, "window": 2.0},
    "tflops": {"fwd": 0.016, "achieved": 0.012},
    "peak_tflops": None, "mfu": None, "causal_halving": True, "uncounted_ops": {"aten.cumsum": 3},
    "modules": [module("", "Model", 0, 3_000_000, 8e9, 16e9, 0.5),
                module("layers.0", "Block", 1, 2_250_000, 6e9, 12e9, 0.25),
                module("layers.0.mlp", "MLP", 2, 750_000, 2e9, 4e9, 0.125)],
}


def test_the_report_states_the_json_numbers_and_shares():
    text = format_report(PROFILE, profile_step=3)
    lines = text.splitlines()
    for label, value in (("params per rank (total):", "3 M"), ("params of model (all ranks):", "6 M"),
                         ("bwd flops / fwd flops:", "2.000"), ("total flops per rank (fwd + bwd):", "24 G"),
                         ("achieved FLOPS per rank = total flops / window time:", "12 GFLOPS"),
                         ("MFU = achieved / peak:", "n/a"), ("plan:", "ATT=tp, MLP=sp")):
        assert f"{label:<64}  {value}" in lines, label
    assert "Profile Summary at step 3:" in lines and "    aten.cumsum: 3 calls" in lines
    block = next(line for line in lines if line.startswith("  (0): Block"))
    assert "2.25 M = 75% params, 6 GFLOPs = 75% fwd, 12 GFLOPs = 75% bwd, 250 ms = 50% latency, 24 GFLOPS" in block
    assert "    (mlp): MLP  750 K = 25% params" in text
    shallow = format_report(PROFILE, module_depth=1)
    assert "(mlp): MLP" not in shallow and "depth 2:" not in shallow and "depth 1:" in shallow
    assert "Detailed Profile" not in format_report(PROFILE, detailed=False)
