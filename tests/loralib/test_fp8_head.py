"""The frozen output head on fp8 (``peft.quantize_head`` beside ``quantize_base: fp8``,
galaxy.loralib.quantized.quantize_head, galaxy.kernels.fp8.logits_on_fp8):

- the logits are, in fp64 and exactly, the product of the hidden states rounded per row to e4m3 (the
  nearest e4m3 found by a search over every e4m3 number, written here) by the head's row-wise e4m3 copy, and
  the hidden states' gradient is the softmax gradient times the head's own weight: every LoRA gradient of the
  model equals that reference's; tied and untied heads;
- the Triton fused head-and-loss (chunks, gradients in forward) gives the reference's loss and gradient;
- every plan (TP, SP, Galaxy, uneven) equals serial in fp64;
- the copy is not saved, not counted as parameters, costs its bytes, and follows a loaded state dict;
- bad settings are refused in one line naming the key."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from galaxy.config import ConfigError  # noqa: E402
from galaxy.kernels import fused_linear_cross_entropy  # noqa: E402
from galaxy.kernels.fp8 import FP8Matrix, logits_on_fp8  # noqa: E402
from galaxy.loralib.quantized import frozen_bytes  # noqa: E402
from galaxy.loralib.quantized_layers import FP8HeadCopy  # noqa: E402
from galaxy.loralib.utils import count_parameters  # noqa: E402
from galaxy.models.bert import BertForMaskedLM  # noqa: E402
from galaxy.models.llama import LlamaForCausalLM  # noqa: E402
from galaxy.peft import apply_tuning  # noqa: E402
from tests.core.test_llama_equivalence import rel_err  # noqa: E402
from tests.loralib.test_fp8 import fake_quant_rows  # noqa: E402
from tests.loralib.test_qlora import TARGETS, batch, cfg_for, qlora_equals_serial  # noqa: E402

HEAD_FP8 = dict(quantize_base="fp8", quantize_head=True)


def tuned(tied: bool, **extra):
    cfg = cfg_for(**HEAD_FP8, lora_target_modules=TARGETS, tie_word_embeddings=tied, **extra)
    return apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, init_std=0.2), cfg


class ReferenceHead(torch.autograd.Function):
    """Forward: the hidden rows rounded to e4m3 over their amax, times the dequantized copy ``wq``; backward:
    the gradient times the head's weight ``w``."""

    @staticmethod
    def forward(ctx, h, wq, w):
        ctx.save_for_backward(w)
        return fake_quant_rows(h) @ wq.t()

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        return dy @ w, None, None


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_heads_logits_and_every_lora_gradient_are_the_fp8_products(tied):
    model, _ = tuned(tied)
    model = model.double()
    copy = model.lm_head_fp8
    assert isinstance(copy, FP8HeadCopy) and copy.scale.dtype == torch.float32  # the cast left the scales
    out = model(**batch())
    trained = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(out.loss, trained)

    data = batch()
    h = model.model(data["input_ids"], data["attention_mask"])
    logits = ReferenceHead.apply(h, copy.dequantize(torch.float64), model.lm_head.weight)
    targets = F.pad(data["labels"][:, 1:], (0, 1), value=-100)
    want_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    want = torch.autograd.grad(want_loss, trained)
    assert rel_err(out.logits.detach(), logits.detach()) < 1e-12
    assert abs(out.loss.item() - want_loss.item()) < 1e-12 * want_loss.item()
    assert len(got) == 2 * len(TARGETS) * model.config.num_hidden_layers
    for g_ours, g_ref in zip(got, want):
        assert rel_err(g_ours, g_ref) < 1e-12
    plain = model.lm_head(h.detach())  # the head in full precision: the fp8 rounding is there, and small
    assert 1e-3 < rel_err(out.logits.detach(), plain.detach()) < 2 ** -4


def test_the_fused_head_and_loss_give_the_reference_on_the_copy(triton_cpu):
    g = torch.Generator().manual_seed(2)
    n, hidden, vocab = 37, 32, 272  # 37 tokens: chunks of 8 leave a partial one
    weight = torch.randn(vocab, hidden, generator=g) * 0.3
    copy = FP8HeadCopy.quantize(weight, None, False, "torch")
    matrix = copy.matrix()
    assert isinstance(matrix, FP8Matrix) and not matrix.tensor_cores  # the CPU multiplies the fp8 values
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[5] = -100
    h0 = torch.randn(n, hidden, generator=g)
    runs = []
    for backend in ("torch", "triton"):
        h = h0.clone().requires_grad_()
        kwargs = dict(chunk_size=8) if backend == "triton" else {}
        loss = fused_linear_cross_entropy(h, weight, targets, backend=backend, weight_fp8=matrix, **kwargs)
        (loss * 1.7).backward()
        runs.append((loss.detach(), h.grad))
    (loss_t, grad_t), (loss_f, grad_f) = runs
    assert rel_err(loss_f, loss_t) < 1e-6 and rel_err(grad_f, grad_t) < 1e-5
    h = h0.clone().requires_grad_()
    plain = fused_linear_cross_entropy(h, weight, targets, backend="triton", chunk_size=8)
    assert 1e-4 < abs(plain.item() - loss_f.item()) / plain.item() < 2 ** -4  # the logits were rounded to fp8


def test_logits_on_fp8_under_autocast_take_its_dtype():
    weight = torch.randn(48, 32, dtype=torch.bfloat16)
    matrix = FP8HeadCopy.quantize(weight, None, False, "torch").matrix()
    h = torch.randn(2, 5, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = logits_on_fp8(h, weight, matrix)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 48)
    y.float().sum().backward()
    assert h.grad.shape == h.shape


@pytest.mark.parametrize("world,plan,uneven", [(2, "tp", False), (2, "sp", False), (3, "galaxy", True)])
def test_every_plan_equals_serial_with_the_head_on_fp8(dist_pool, world, plan, uneven):
    dist_pool.run(qlora_equals_serial, world, "llama", plan, uneven, "fp8", True)


def test_the_copy_is_not_saved_nor_counted_but_costs_its_bytes_and_follows_a_load():
    model, cfg = tuned(False)
    without = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg_for(quantize_base="fp8",
                                                                        lora_target_modules=TARGETS), init_std=0.2)
    assert not any(k.startswith("lm_head_fp8") for k in model.state_dict())
    assert model.state_dict().keys() == without.state_dict().keys()
    assert count_parameters(model) == count_parameters(without)
    vocab, hidden = model.lm_head.weight.shape
    assert frozen_bytes(model)[0] - frozen_bytes(without)[0] == vocab * hidden + 4 * vocab
    assert frozen_bytes(model)[1] == frozen_bytes(without)[1]

    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] * 2.0
    model.load_state_dict(state)
    fresh = FP8HeadCopy.quantize(model.lm_head.weight, None, False)
    assert torch.equal(model.lm_head_fp8.codes, fresh.codes) and torch.equal(model.lm_head_fp8.scale, fresh.scale)


def test_bad_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="'quantize_head'.*quantize_base is 'none'"):
        cfg_for(quantize_head=True)
    with pytest.raises(ConfigError, match="'quantize_head'.*modules_to_save"):
        cfg_for(**HEAD_FP8, modules_to_save=["lm_head"])
    cfg = cfg_for(**HEAD_FP8, lora_target_modules=["q_proj", "lm_head"])
    with pytest.raises(ConfigError, match="'quantize_head'.*lm_head is a LoRA target"):
        apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg)
    bert = cfg_for(**HEAD_FP8, preset="bert-tiny", lora_target_modules=["query", "value"])
    with pytest.raises(ConfigError, match="'quantize_head'.*BertForMaskedLM has not"):
        apply_tuning(BertForMaskedLM(bert.model, seed=1), bert)
