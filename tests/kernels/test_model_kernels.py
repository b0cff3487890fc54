"""The models on the Triton kernels (config key ``kernels``): a tiny LLaMA (RMSNorm, RoPE, SwiGLU,
fused linear + cross-entropy; the fused gate/up layout's packed SwiGLU) and BERT (LayerNorm, fused
MLM decoder + cross-entropy) with ``kernels: triton`` give the loss and every gradient of
``kernels: torch`` to fp32 tolerance, serially and on a 2-rank plan; evaluation returns equal
logits; ``auto`` is torch on CPU; ``triton`` on CPU without the interpreter is a clear error.

The Triton kernels run on CPU through TRITON_INTERPRET=1 (set in conftest.py before any kernel is
imported; the test pool's workers inherit it)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import pytest  # noqa: E402
import torch  # noqa: E402

from galaxy.config import ConfigError, GalaxyConfig  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.core.grad_sync import GradientSync, gather_full  # noqa: E402
from galaxy.models.bert import BertForMaskedLM  # noqa: E402
from galaxy.models.llama import LlamaForCausalLM  # noqa: E402
from tests.core.test_recompute import make_batch as padded_batch  # noqa: E402

SEQ, BATCH = 9, 2
LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, hidden_act="silu", max_position_embeddings=32,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.1, pad_token_id=None,
             seq_length=SEQ)
BERT = dict(model_type="bert", vocab_size=64, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=40, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, initializer_range=0.1, seq_length=SEQ)
TOL = dict(rtol=1e-4, atol=1e-5)


def make_batch():
    return padded_batch(BATCH, seed=3, seq=SEQ, vocab=64)


def step(ctx, raw, kernels, train=True):
    """Loss, logits and full-shape gradients (gathered over the mp group) of one forward/backward."""
    cfg = GalaxyConfig.from_dict(dict(raw, kernels=kernels))
    cls = LlamaForCausalLM if raw["model_type"] == "llama" else BertForMaskedLM
    model = cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=4).train(train)
    out = model(**make_batch())
    out.loss.backward()
    GradientSync(model.parameters(), ctx.mp)()
    return out.loss.detach(), out.logits, {n: gather_full(p.grad, p, ctx.mp) for n, p in model.named_parameters()}


def compare_backends(ctx, raw):
    loss_t, logits_t, grads_t = step(ctx, raw, "triton")
    loss_r, _, grads_r = step(ctx, raw, "torch")
    assert logits_t is None  # training with labels: the head and loss are one kernel, no logits kept
    torch.testing.assert_close(loss_t, loss_r, **TOL)
    assert set(grads_t) == set(grads_r)
    for name, g in grads_r.items():
        torch.testing.assert_close(grads_t[name], g, **TOL, msg=lambda m, name=name: f"grad of {name}: {m}")
    # Evaluation keeps the logits: the head runs as a linear, the loss on the Triton cross-entropy.
    loss_e, logits_e, _ = step(ctx, raw, "triton", train=False)
    loss_f, logits_f, _ = step(ctx, raw, "torch", train=False)
    torch.testing.assert_close(logits_e.detach(), logits_f.detach(), **TOL)
    torch.testing.assert_close(loss_e, loss_f, **TOL)
    return loss_t.item()


@pytest.mark.parametrize("raw", [LLAMA, dict(LLAMA, fused_gate_up=True, tie_word_embeddings=True), BERT],
                         ids=["llama", "llama-fused-tied", "bert"])
def test_triton_kernels_equal_torch_serial(triton_cpu, raw):
    compare_backends(ParallelContext.serial(), raw)


@pytest.mark.parametrize("raw", [dict(LLAMA, plan="galaxy"), dict(BERT, plan="tp")], ids=["llama-galaxy", "bert-tp"])
def test_triton_kernels_equal_torch_on_two_ranks(triton_cpu, dist_pool, raw):
    dist_pool.run(compare_backends, 2, raw)


def test_swiglu_packed_reads_and_returns_the_fused_layout(triton_cpu):
    """The fused gate/up output [gate | up] through the Triton SwiGLU, read in place (a row-strided
    half, too) and its gradient returned packed, equals the reference on the split halves."""
    import galaxy.kernels as K
    from galaxy.kernels import reference as R

    gate_up = torch.randn(3, 7, 2 * 37, dtype=torch.float64).float().requires_grad_()
    dy = torch.randn(3, 7, 37)
    got = K.swiglu_packed(gate_up, backend="triton")
    want = R.swiglu(*gate_up.chunk(2, dim=-1))
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(torch.autograd.grad(got, gate_up, dy)[0], torch.autograd.grad(want, gate_up, dy)[0],
                               **TOL)
    gate, up = gate_up.chunk(2, dim=-1)  # non-contiguous halves through the two-input kernel
    torch.testing.assert_close(K.swiglu(gate, up, backend="triton"), want, **TOL)


def test_auto_is_torch_on_cpu():
    ctx = ParallelContext.serial()
    loss_a, _, grads_a = step(ctx, LLAMA, "auto")
    loss_r, _, grads_r = step(ctx, LLAMA, "torch")
    assert torch.equal(loss_a, loss_r) and all(torch.equal(grads_a[n], g) for n, g in grads_r.items())


def test_triton_on_cpu_without_interpreter_is_a_config_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = GalaxyConfig.from_dict(dict(LLAMA, kernels="triton"))
    with pytest.raises(ConfigError, match="config key 'kernels' is 'triton'.*(TRITON_INTERPRET|triton package)"):
        LlamaForCausalLM(cfg.model)
    with pytest.raises(ConfigError, match="'kernels': 'cuda' is not one of auto, triton, torch"):
        GalaxyConfig.from_dict(dict(LLAMA, kernels="cuda"))
