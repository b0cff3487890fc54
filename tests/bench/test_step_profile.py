"""``bench/step_profile.py``: a profiled step's kernels sorted into categories, and the idle and exposed
communication time computed from their intervals (a hand-made trace whose answer is known by construction)."""

import sys

import pytest

from tests import REPO

sys.path.insert(0, REPO)

from bench.step_profile import breakdown, category, union_length  # noqa: E402


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name}


def test_union_length_merges_overlaps():
    assert union_length([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert union_length([]) == 0


def test_categories():
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert category("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT") == "gemm"
    assert category("triton_tem_fused_mm_3") == "gemm"
    assert category("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "collective"
    assert category("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel") == "attention"
    assert category("void multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert category("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "fused"
    assert category("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>") == "elementwise"
    assert category("Memcpy DtoD (Device -> Device)") == "memcpy"


def test_breakdown_of_a_known_trace():
    events = [kernel("sm90_xmma_gemm", 0, 10),            # compute 0-10
              kernel("ncclDevKernel_AllGather", 5, 10),   # 5-15: 5 of it hidden, 5 exposed
              kernel("triton_poi_fused_add", 20, 5),      # gap 15-20: idle 5
              kernel("flash_fwd_kernel", 30, 5),          # gap 25-30: idle 5
              {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100, "name": "aten::mm"}]  # host events ignored
    b = breakdown(events)
    assert b["window_ms"] == pytest.approx(0.035) and b["busy_ms"] == pytest.approx(0.025)
    assert b["idle_ms"] == pytest.approx(0.010) and b["exposed_comm_ms"] == pytest.approx(0.005)
    assert (b["gemm_ms"], b["collective_ms"], b["fused_ms"], b["attention_ms"]) == pytest.approx(
        (0.010, 0.010, 0.005, 0.005))
    assert b["kernels"] == 4 and b["top"][0]["ms"] == pytest.approx(0.010)
    # the two idle stretches, each between the kernel that ended last and the one that started next
    assert [(g["after"], g["before"]) for g in b["gaps"]] == [("ncclDevKernel_AllGather", "triton_poi_fused_add"),
                                                              ("triton_poi_fused_add", "flash_fwd_kernel")]
    assert [g["ms"] for g in b["gaps"]] == pytest.approx([0.005, 0.005])
    assert "error" in breakdown([events[-1]])
