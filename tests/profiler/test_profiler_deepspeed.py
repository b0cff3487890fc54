"""Forward FLOPs against DeepSpeed's own flops profiler, when DeepSpeed is installed."""

import pytest
import torch

from galaxy.profiler.flops_profiler import get_model_profile

from tests.profiler.conftest import tiny_bert_config


def _deepspeed_get_model_profile():
    try:
        from deepspeed.profiling.flops_profiler import get_model_profile as ds_get_model_profile
    except Exception as exc:  # ImportError, or a broken install (missing CUDA toolkit, ...)
        pytest.skip(f"deepspeed not importable: {type(exc).__name__}: {exc}")
    return ds_get_model_profile


def test_forward_flops_match_deepspeed():
    ds_get_model_profile = _deepspeed_get_model_profile()
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    vocab, seq = 1000, 128
    model = BertForMaskedLM(tiny_bert_config(vocab_size=vocab, max_position_embeddings=seq))
    ids = torch.randint(0, vocab, (2, seq))
    ds_flops, ds_macs, ds_params = ds_get_model_profile(model, args=[ids], print_profile=False, as_string=False)
    flops, macs, params = get_model_profile(model, args=[ids], print_profile=False, as_string=False)
    # DeepSpeed also charges elementwise ops (GELU, softmax, LayerNorm, adds) a few FLOPs each;
    # its MACs are matmul-only like ours.
    assert flops == pytest.approx(ds_flops, rel=0.01)
    assert macs == pytest.approx(ds_macs, rel=0.01)
    assert params == ds_params
