"""FlopsProfiler on tiny BERT/LLaMA: equality with torch's FlopCounterMode, attribution, windows,
uncounted ops, attention backends, causal halving, reports and the comm log."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from galaxy.profiler.comm import CommLog, CommRecord
from galaxy.profiler.devices import lookup_peak_tflops
from galaxy.profiler.flops_profiler import FlopsProfiler, get_model_profile
from galaxy.profiler.formulas import extra_flop_formulas

from tests.profiler.conftest import BATCH, SEQ, VOCAB

aten = torch.ops.aten


def _train_step(model, ids, backward=True):
    out = model(ids, labels=ids)
    if backward:
        out.loss.backward()
    return out


def _run_both(model, fn, custom_mapping=None):
    """Run ``fn`` once with the profiler and FlopCounterMode both active (the same ops)."""
    prof = FlopsProfiler(model)
    prof.start_profile()
    with FlopCounterMode(display=False, custom_mapping=custom_mapping) as fc:
        fn()
    prof.stop_profile()
    return prof, fc


# ----------------------------------------------------------------------------- vs FlopCounterMode


@pytest.mark.parametrize("backward", [False, True])
def test_llama_equals_flop_counter_mode(tiny_llama, ids, backward):
    # The CPU fused attention kernel has no formula in torch's registry: give FlopCounterMode ours.
    prof, fc = _run_both(tiny_llama, lambda: _train_step(tiny_llama, ids, backward), extra_flop_formulas())
    assert prof.get_total_flops() == fc.get_total_flops() > 0
    assert prof.get_total_flops(phase="fwd") + prof.get_total_flops(phase="bwd") == fc.get_total_flops()
    assert (prof.get_total_flops(phase="bwd") > 0) == backward
    assert prof.get_uncounted_ops() == {}


@pytest.mark.parametrize("backward", [False, True])
def test_bert_equals_plain_flop_counter_mode(tiny_bert, ids, backward):
    # Train mode (dropout) takes the math attention path: torch's registry alone covers it.
    tiny_bert.train()
    prof, fc = _run_both(tiny_bert, lambda: _train_step(tiny_bert, ids, backward))
    assert prof.get_total_flops() == fc.get_total_flops() > 0
    assert prof.get_uncounted_ops() == {}


def test_math_backend_equals_plain_flop_counter_mode(tiny_llama, ids):
    with sdpa_kernel(SDPBackend.MATH):
        prof, fc = _run_both(tiny_llama, lambda: _train_step(tiny_llama, ids))
    assert prof.get_total_flops() == fc.get_total_flops() > 0


def test_forward_attribution_equals_flop_counter_mode(tiny_llama, ids):
    # Forward attribution follows the module call stack, exactly as FlopCounterMode's tracker.
    with torch.no_grad():
        prof, fc = _run_both(tiny_llama, lambda: tiny_llama(ids), extra_flop_formulas())
    theirs = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    root = type(tiny_llama).__name__
    for name, flops in prof.get_flops_by_module("fwd").items():
        if name == "model.layers":  # a ModuleList is never called, torch does not list it
            continue
        assert flops == theirs.get(f"{root}.{name}" if name else root, 0), name


def test_checkpointed_recompute_is_measured(tiny_llama, ids):
    layer = tiny_llama.model.layers[0]

    class Checkpointed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    tiny_llama.model.layers[0] = Checkpointed(layer)
    prof, fc = _run_both(tiny_llama, lambda: _train_step(tiny_llama, ids), extra_flop_formulas())
    assert prof.get_total_flops() == fc.get_total_flops()
    by_module = prof.get_flops_by_module("bwd")
    # Layer 0's backward re-runs its forward: 1x recompute + 2x gradients, layer 1 only the 2x.
    fwd = prof.get_flops_by_module("fwd")
    lin0, lin1 = "model.layers.0.inner.mlp.up_proj", "model.layers.1.mlp.up_proj"
    assert by_module[lin0] == 3 * fwd[lin0]
    assert by_module[lin1] == 2 * fwd[lin1]


# ----------------------------------------------------------------------------- analytic, per module


def _linear_flops(tokens, d_in, d_out):
    return 2 * tokens * d_in * d_out


def test_llama_per_module_analytic(tiny_llama, ids):
    cfg = tiny_llama.config
    t, h = BATCH * SEQ, cfg.hidden_size
    hd = h // cfg.num_attention_heads
    kvd = cfg.num_key_value_heads * hd
    prof = FlopsProfiler(tiny_llama)
    prof.start_profile()
    _train_step(tiny_llama, ids)
    prof.stop_profile()
    fwd, bwd = prof.get_flops_by_module("fwd"), prof.get_flops_by_module("bwd")
    proj = {"q_proj": (h, h), "k_proj": (h, kvd), "v_proj": (h, kvd), "o_proj": (h, h)}
    attention_core = 4 * BATCH * cfg.num_attention_heads * SEQ * SEQ * hd
    for i in range(cfg.num_hidden_layers):
        base = f"model.layers.{i}.self_attn"
        for name, (din, dout) in proj.items():
            assert fwd[f"{base}.{name}"] == _linear_flops(t, din, dout)
            # All weights trainable: dX and dW, each as large as the forward matmul.
            assert bwd[f"{base}.{name}"] == 2 * fwd[f"{base}.{name}"]
        assert fwd[base] == sum(_linear_flops(t, *d) for d in proj.values()) + attention_core
        mlp = f"model.layers.{i}.mlp"
        assert fwd[mlp] == 3 * _linear_flops(t, h, cfg.intermediate_size)
    assert fwd["lm_head"] == _linear_flops(t, h, VOCAB)
    assert fwd[""] == prof.get_total_flops(phase="fwd")
    assert sum(fwd[f"model.layers.{i}"] for i in range(cfg.num_hidden_layers)) == fwd["model.layers"]


def test_frozen_weights_cost_no_weight_gradients(tiny_llama, ids):
    tiny_llama.requires_grad_(False)
    bias = nn.Parameter(torch.zeros(tiny_llama.config.hidden_size))  # the only trainable tensor
    prof = FlopsProfiler(tiny_llama)
    prof.start_profile()
    embeds = tiny_llama.get_input_embeddings()(ids) + bias
    tiny_llama(inputs_embeds=embeds, labels=ids).loss.backward()
    prof.stop_profile()
    fwd, bwd = prof.get_flops_by_module("fwd"), prof.get_flops_by_module("bwd")
    linears = [n for n, m in tiny_llama.named_modules() if isinstance(m, nn.Linear)]
    assert linears
    for name in linears:
        assert bwd[name] == fwd[name], name  # input gradient only
    assert bias.grad is not None


# ----------------------------------------------------------------------------- windows


def test_a_window_left_by_an_exception_is_closed(tiny_llama, ids):
    """``with profiler:`` closes the window on the way out of a failing step: no counting mode stays entered
    (it would count every later op of the process, and dynamo runs compiled code eagerly under it)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    prof = FlopsProfiler(tiny_llama)
    with pytest.raises(ValueError, match="the step failed"):
        with prof:
            _train_step(tiny_llama, ids)
            raise ValueError("the step failed")
    assert _get_current_dispatch_mode() is None and not prof.started
    counted = prof.get_total_flops()
    assert counted > 0
    _train_step(tiny_llama, ids)
    assert prof.get_total_flops() == counted  # nothing counted after the window


def test_repeated_windows_give_identical_numbers(tiny_llama, ids):
    prof = FlopsProfiler(tiny_llama)
    snapshots = []
    for _ in range(3):
        prof.start_profile()
        _train_step(tiny_llama, ids)
        prof.stop_profile()
        tiny_llama.zero_grad()
        data = prof.to_json()
        snapshots.append((data["flops"], data["macs"], data["flops_by_op"],
                          [(m["name"], m["fwd_flops"], m["bwd_flops"]) for m in data["modules"]]))
    assert snapshots[0] == snapshots[1] == snapshots[2]
    # Work outside a window is not seen, and numbers stay readable after stop.
    _train_step(tiny_llama, ids)
    assert prof.to_json()["flops"] == snapshots[0][0]
    # Two steps in one window count twice; start_profile restarts from zero.
    prof.start_profile()
    _train_step(tiny_llama, ids)
    _train_step(tiny_llama, ids)
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * snapshots[0][0]["total"]
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    prof.start_profile()
    _train_step(tiny_llama, ids)
    prof.end_profile()
    assert prof.get_total_flops() == 0 and not prof.started


# ----------------------------------------------------------------------------- uncounted ops


@torch.library.custom_op("galaxy_profiler_test::mystery_mix", mutates_args=())
def mystery_mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@mystery_mix.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


class _Mystery(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        x = self.lin(x)
        x = F.max_pool1d(x.unsqueeze(0), 2).squeeze(0).repeat(1, 2)  # aten op without a formula
        return mystery_mix(x, self.w)


def test_ops_without_formula_are_listed_not_silent():
    model = _Mystery()
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(5, 8))
    prof.stop_profile()
    uncounted = prof.get_uncounted_ops()
    assert uncounted["galaxy_profiler_test.mystery_mix"] == 3
    assert any("max_pool" in name for name in uncounted)
    assert prof.get_total_flops() == 3 * 2 * 5 * 8 * 8  # the Linear only
    text = prof.format_profile()
    assert "uncounted ops" in text and "galaxy_profiler_test.mystery_mix: 3 calls" in text
    assert "aten.addmm" not in prof.get_uncounted_ops()
    assert prof.to_json()["uncounted_ops"] == uncounted

    # A user formula makes it counted (shape-style, like torch's registry).
    def mystery_flop(x_shape, w_shape, *args, out_shape=None, **kwargs):
        return 2 * x_shape[0] * x_shape[1] * w_shape[1]

    prof = FlopsProfiler(model, custom_formulas={torch.ops.galaxy_profiler_test.mystery_mix: mystery_flop})
    prof.start_profile()
    with torch.no_grad():
        model(torch.randn(5, 8))
    prof.stop_profile()
    assert "galaxy_profiler_test.mystery_mix" not in prof.get_uncounted_ops()
    assert prof.get_total_flops() == 2 * 5 * 8 * 8 + 2 * 5 * 8 * 4


# ----------------------------------------------------------------------------- attention


B, H, S, D = 2, 4, 16, 8
ATT_FWD = 4 * B * H * S * S * D  # QK^T and PV
ATT_BWD = 10 * B * H * S * S * D  # recompute scores, dP, dV, dQ, dK


class _Attention(nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)


def _qkv(device="cpu", layout="bhsd", dtype=torch.float32):
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, dtype=dtype).to(device).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("halving", [False, True])
def test_causal_halving_on_cpu_sdpa(is_causal, halving):
    module = _Attention(is_causal)
    prof = FlopsProfiler(module, causal_halving=halving)
    prof.start_profile()
    module(*_qkv()).sum().backward()
    prof.stop_profile()
    factor = 2 if (halving and is_causal) else 1
    assert prof.get_total_flops(phase="fwd") == ATT_FWD // factor
    assert prof.get_total_flops(phase="bwd") == ATT_BWD // factor


# name -> (aten op, input layout, call(q, k, v, is_causal) -> output)
ATTENTION_KERNELS = {
    "flash": ("_scaled_dot_product_flash_attention", "bhsd",
              lambda op, q, k, v, c: op(q, k, v, 0.0, c)[0]),
    "efficient": ("_scaled_dot_product_efficient_attention", "bhsd",
                  lambda op, q, k, v, c: op(q, k, v, None, True, 0.0, c)[0]),
    "cudnn": ("_scaled_dot_product_cudnn_attention", "bhsd",
              lambda op, q, k, v, c: op(q, k, v, None, True, 0.0, c)[0]),
    "cpu_flash": ("_scaled_dot_product_flash_attention_for_cpu", "bhsd",
                  lambda op, q, k, v, c: op(q, k, v, 0.0, c)[0]),
    "overrideable": ("_scaled_dot_product_fused_attention_overrideable", "bhsd",
                     lambda op, q, k, v, c: op(q, k, v, None, 0.0, c)[0]),
    "flash_low_level": ("_flash_attention_forward", "bshd",
                        lambda op, q, k, v, c: op(q, k, v, None, None, S, S, 0.0, c, False)[0]),
    "efficient_low_level": ("_efficient_attention_forward", "bshd",
                            lambda op, q, k, v, c: op(q, k, v, None, None, None, S, S, 0.0, int(c), True)[0]),
}


@pytest.mark.parametrize("kernel", sorted(ATTENTION_KERNELS))
@pytest.mark.parametrize("halving", [False, True])
def test_every_attention_backend_forward_and_backward(kernel, halving):
    # GPU kernels have meta implementations: their forward and backward ops run shape-only here.
    op_name, layout, call = ATTENTION_KERNELS[kernel]
    if not hasattr(aten, op_name):
        pytest.skip(f"aten.{op_name} does not exist in torch {torch.__version__}")
    prof = FlopsProfiler(nn.Identity(), causal_halving=halving)
    for causal in (False, True):
        q, k, v = _qkv("meta", layout, torch.float16)
        with prof:
            try:
                call(getattr(aten, op_name).default, q, k, v, causal).sum().backward()
            except NotImplementedError as e:  # torch 2.11: no meta backward for the overrideable backend
                pytest.skip(f"aten.{op_name} cannot run forward and backward on meta in torch {torch.__version__}: "
                            f"{str(e).splitlines()[0][:120]}")
        factor = 2 if (halving and causal) else 1
        assert prof.get_total_flops(phase="fwd") == ATT_FWD // factor, kernel
        assert prof.get_total_flops(phase="bwd") == ATT_BWD // factor, kernel
        assert prof.get_uncounted_ops() == {}


# ----------------------------------------------------------------------------- reports


def test_report_json_and_logging(tiny_llama, ids, tmp_path, caplog):
    prof = FlopsProfiler(
        tiny_llama, world_size=2, rank=1, plan={"ATT": "tp", "CON": "sp", "MLP": "tp"},
        batch=BATCH, seq_len=SEQ, global_params=123, peak_tflops=0.5,
    )
    prof.start_profile()
    _train_step(tiny_llama, ids)
    prof.stop_profile()
    data = prof.to_json()
    json.dumps(data)  # plain types only
    assert data["run"] == {
        "world_size": 2, "rank": 1, "plan": {"ATT": "tp", "CON": "sp", "MLP": "tp"}, "batch": BATCH,
        "seq_len": SEQ, "device": "cpu", "device_name": None, "dtype": "fp32",
    }
    n_params = sum(p.numel() for p in tiny_llama.parameters())
    assert data["params"] == {"local": n_params, "total": n_params, "trainable": n_params, "global": 123}
    assert data["flops"]["total"] == data["flops"]["fwd"] + data["flops"]["bwd"] == prof.get_total_flops()
    assert data["macs"]["total"] * 2 == data["flops"]["total"] == 2 * prof.get_total_macs()
    assert data["mfu"] == pytest.approx(data["tflops"]["achieved"] / 0.5)
    assert data["latency_s"]["fwd"] == prof.get_total_duration() > 0
    root = data["modules"][0]
    assert root["name"] == "" and root["fwd_share"] == 1.0 and root["fwd_calls"] == 1

    text = prof.format_profile(profile_step=7, module_depth=2, top_modules=2)
    for needle in ("Profile Summary at step 7", "MFU", "bwd flops per rank", "Aggregated Profile",
                   "Detailed Profile", "(lm_head): Linear", "plan:", "ATT=tp"):
        assert needle in text
    assert "(q_proj)" not in text  # deeper than module_depth
    assert "(q_proj)" in prof.format_profile()

    out = tmp_path / "sub" / "profile.txt"
    prof.print_model_profile(output_file=str(out))
    assert "Galaxy Flops Profiler" in out.read_text()
    with caplog.at_level(logging.INFO, logger="galaxy.profiler"):
        prof.print_model_profile(detailed=False)
    assert "Galaxy Flops Profiler" in caplog.text and "Detailed Profile" not in caplog.text


def test_mfu_is_none_on_cpu_without_peak(tiny_llama, ids):
    prof = FlopsProfiler(tiny_llama)
    prof.start_profile()
    _train_step(tiny_llama, ids, backward=False)
    prof.stop_profile()
    assert prof.to_json()["peak_tflops"] is None and prof.to_json()["mfu"] is None


def test_peak_table():
    assert lookup_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert lookup_peak_tflops("NVIDIA H200", torch.bfloat16) == 989.4
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert lookup_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert lookup_peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert lookup_peak_tflops("Some CPU", "bf16") is None


def test_ignore_list_skips_module_types(tiny_llama, ids):
    prof = FlopsProfiler(tiny_llama)
    prof.start_profile()
    _train_step(tiny_llama, ids)
    prof.stop_profile()
    full, mlp = prof.get_total_flops(), sum(
        f for n, f in prof.get_flops_by_module().items() if n.endswith(".mlp"))
    prof.start_profile(ignore_list=[type(tiny_llama.model.layers[0].mlp)])
    _train_step(tiny_llama, ids)
    prof.stop_profile()
    assert prof.get_total_flops() == full - mlp


# ----------------------------------------------------------------------------- get_model_profile


def test_get_model_profile(tiny_llama, ids):
    tiny_llama.train()
    flops, macs, params = get_model_profile(tiny_llama, args=[ids], print_profile=False, as_string=False)
    assert tiny_llama.training  # mode restored
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=extra_flop_formulas()) as fc:
        tiny_llama(ids)
    assert flops == fc.get_total_flops() == 2 * macs
    assert params == sum(p.numel() for p in tiny_llama.parameters())
    f_str, m_str, p_str = get_model_profile(tiny_llama, args=[ids], print_profile=False)
    assert f_str.endswith(" M") and m_str.endswith("MACs") and p_str.endswith("K")

    total, _, _ = get_model_profile(tiny_llama, kwargs={"input_ids": ids, "labels": ids}, print_profile=False,
                                    as_string=False, backward=True)
    assert total > 2.9 * flops  # forward + measured backward
    assert all(p.grad is None for p in tiny_llama.parameters())


# ----------------------------------------------------------------------------- communication


def test_comm_log_aggregates_and_reports(tiny_llama, ids):
    log = CommLog(keep_records=True)
    prof = FlopsProfiler(tiny_llama, comm_log=log)
    log.record(CommRecord("all_reduce", "mp", 1000, 0.1, "fwd"))  # before the window: dropped at start
    prof.start_profile()
    for _ in range(2):
        _train_step(tiny_llama, ids, backward=False)
        log.record(CommRecord("all_reduce", "mp", 4096, 0.001, "fwd"))
        log(CommRecord("all_reduce", "mp", 4096, 0.001, "fwd"))  # the log itself is callable
        log.record(CommRecord("reduce_scatter", "mp", 2048, 0.002, "bwd"))
        log.mark_step()
    prof.stop_profile()
    log.record(CommRecord("all_gather", "mp", 1, 0.0, "fwd"))  # after the window: ignored
    assert log.steps == 2 and len(log.records) == 6
    assert log.bytes_per_step_by_op() == {"all_reduce": 8192.0, "reduce_scatter": 2048.0}
    rows = {(r["op"], r["phase"]): r for r in log.summary()}
    assert rows[("all_reduce", "fwd")]["calls"] == 4 and rows[("all_reduce", "fwd")]["bytes"] == 16384
    assert log.total_bytes("bwd") == 4096
    data = prof.to_json()
    assert data["comm"]["steps"] == 2 and len(data["comm"]["rows"]) == 2
    assert "reduce_scatter" in prof.format_profile()
    with pytest.raises(ValueError):
        CommRecord("all_reduce", "mp", 1, 0.0, "sideways")


def test_op_classes():
    from galaxy.profiler.formulas import is_zero_flop_op

    assert is_zero_flop_op(aten.add.Tensor) and is_zero_flop_op(aten.view.default)
    assert is_zero_flop_op(aten.native_layer_norm.default) and is_zero_flop_op(aten.sum.dim_IntList)
    assert is_zero_flop_op(torch.ops.c10d.allreduce_.default)  # collectives: bytes, not FLOPs
    assert not is_zero_flop_op(aten.max_pool2d_with_indices.default)
    assert not is_zero_flop_op(aten._linalg_svd.default)
    with pytest.raises(ValueError):
        FlopsProfiler(nn.Identity()).get_total_flops(phase="sideways")
