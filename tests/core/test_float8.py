"""Float8 training of the layers' linears (``float8_training``, galaxy.core.float8) against torchao itself:

- a ``ParallelLinear`` with float8 is torchao's ``Float8Linear`` on the same weights and input: output and
  every gradient bit for bit, both recipes (and under bf16 autocast, fed what Float8Linear's CUDA autocast
  feeds it);
- a Galaxy LLaMA trained in float8 is ``transformers``' LLaMA on the same weights converted by torchao's
  ``convert_to_float8_training`` (its layer linears): loss and every layer gradient to FP32_RTOL (seen:
  identical; a value that crossed an fp8 rounding boundary would move by an e4m3 step), while float8 itself
  moves them (seen: loss 0.05-0.15%, gradients 13-23%);
- every plan (TP, SP, Galaxy; uneven splits) equals the serial float8 model whose linears run torchao's matmul
  on the same pieces (``PiecewiseFloat8``): a TP shard quantizes with its own scales (tensorwise: its amax;
  rowwise: a row-parallel input's rows over its columns), a sequence shard its own tokens' (the weight
  gradient's per-column scales), so the plain serial float8 model differs by fp8 rounding steps (seen:
  10-24% in a gradient at this size) where the piecewise one agrees to fp32 summation order (FP8_PLAN_RTOL,
  the loss and every gradient);
- a few AdamW steps in float8 (both recipes, compiled layers too) lower the loss as bf16 does;
- under dp_engine fsdp2 with float8_fsdp_all_gather the weights gather as fp8 (torchao's wrapper) and the
  run equals the un-gathered float8 run;
- the config refuses what float8 training cannot do."""

import pytest
import torch

torchao = pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")

from torchao.float8 import convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from galaxy.config import KEY_SECTION, ConfigError, GalaxyConfig  # noqa: E402
from galaxy.core.context import ParallelContext  # noqa: E402
from galaxy.core.float8 import Float8Matmul, enable_float8_training  # noqa: E402
from galaxy.core.grad_sync import GradientSync, gather_full  # noqa: E402
from galaxy.core.layers import GradRule, ParallelLinear, grad_rule, shard_spec  # noqa: E402
from galaxy.models.llama import LlamaForCausalLM  # noqa: E402
from galaxy.train.loop import Trainer  # noqa: E402
from tests.core.test_llama_equivalence import rel_err  # noqa: E402
from tests.loralib.test_fp8 import scaled_mm_rowwise_on_cpu  # noqa: E402

# torchao's rowwise recipe runs torch._scaled_mm with row-wise scales, which torch 2.11's CPU kernel refuses
# ("only supports per-tensor scaling for CPU backend"; 2.13's takes them): there it runs on GPUs only.
RECIPES = ["tensorwise", pytest.param("rowwise", marks=pytest.mark.skipif(
    not scaled_mm_rowwise_on_cpu(), reason="this torch's CPU _scaled_mm has no row-wise scaling (torch 2.11)"))]

FP32_RTOL = 1e-6
FP8_PLAN_RTOL = 1e-5  # fp32 summation order (seen: 1.4e-8 to 4.2e-7)
# Dims multiples of 16 (torch._scaled_mm's need): every layer linear runs in float8.
LLAMA16 = dict(model_type="llama", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, hidden_act="silu", max_position_embeddings=64,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.1, pad_token_id=None,
               tie_word_embeddings=False)
HF16 = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
            eos_token_id=None, tie_word_embeddings=False)
SEQ, ROWS = 16, 4


def ids_batch(step=0, rows=ROWS):
    g = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, LLAMA16["vocab_size"], (rows, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_float8_parallel_linear_is_torchaos_float8_linear(recipe, autocast):
    g = torch.Generator().manual_seed(0)
    ours = ParallelLinear(64, 48, bias=True)
    with torch.no_grad():
        ours.weight.normal_(generator=g)
        ours.bias.normal_(generator=g)
    linear = torch.nn.Linear(64, 48)
    linear.load_state_dict(ours.state_dict())
    ours.float8 = Float8Matmul(recipe)
    theirs = Float8Linear.from_float(linear, config=ours.float8.config)
    x = torch.randn(3, 5, 64, generator=g)
    runs = []
    for module in (ours, theirs):
        xb = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and module is ours):
            # Float8Linear casts its input under CUDA's autocast only; on the CPU it is handed the cast input.
            y = module(xb if module is ours or not autocast else xb.to(torch.bfloat16))
        y.float().square().sum().backward()
        runs.append((y.detach(), xb.grad, module.weight.grad, module.bias.grad))
    assert runs[0][0].dtype == (torch.bfloat16 if autocast else torch.float32)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    plain = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert rel_err(runs[0][0].float(), plain) > 1e-3  # float8 did round


def _hf_and_ours(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF16))
    hf.save_pretrained(str(tmp_path))
    return transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)), LlamaForCausalLM.from_pretrained(str(tmp_path))


def _loss_and_grads(model, batch):
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    out.loss.backward()
    layers = model.model.layers
    grads = {f"{i}.{n}": p.grad for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    return out.loss.detach(), grads


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_float8_llama_is_transformers_llama_under_torchaos_conversion(tmp_path, recipe):
    hf, ours = _hf_and_ours(tmp_path)
    batch = ids_batch()
    loss_plain, _ = _loss_and_grads(ours, batch)
    ours.zero_grad()
    names = enable_float8_training(ours, recipe)
    assert len(names) == 7 * 2
    config = ours.model.layers[0].mlp.down_proj.float8.config
    convert_to_float8_training(hf.model.layers, config=config)
    assert sum(isinstance(m, Float8Linear) for m in hf.modules()) == 7 * 2 and not isinstance(hf.lm_head, Float8Linear)
    loss_ours, grads_ours = _loss_and_grads(ours, batch)
    loss_hf, grads_hf = _loss_and_grads(hf, batch)
    assert set(grads_ours) == set(grads_hf)
    assert abs(loss_ours - loss_hf) <= FP32_RTOL * loss_hf, (loss_ours, loss_hf)
    for name, g in grads_ours.items():
        assert rel_err(g, grads_hf[name]) < FP32_RTOL, name
    assert abs(loss_ours - loss_plain) > 1e-4 * loss_plain  # float8 moved the loss


class PiecewiseFloat8:
    """torchao's float8 matmul run, in one process, on the pieces a plan gives its ranks: a column-parallel
    weight's row blocks (outputs concatenated), a row-parallel weight's column blocks (partial outputs
    summed), or a whole weight under SP on each rank's tokens. Each piece is quantized on its own, as on its
    rank: the serial reference a plan's float8 model equals to fp32 summation order."""

    def __init__(self, matmul: Float8Matmul, how: str, sizes):
        self.matmul, self.how, self.sizes = matmul, how, list(sizes)

    def __call__(self, x, weight, bias):
        if self.how == "column":
            return torch.cat([self.matmul(x, w, None) for w in weight.split(self.sizes, 0)], -1)
        if self.how == "row":
            pieces = [self.matmul(xi, w, None) for xi, w in zip(x.split(self.sizes, -1), weight.split(self.sizes, 1))]
            return sum(pieces[1:], pieces[0])
        return torch.cat([self.matmul(xi, weight, None) for xi in x.split(self.sizes, 1)], 1)  # tokens (dim 1)


def float8_plan_equals_serial(ctx, recipe, raw):
    cfg = GalaxyConfig.from_dict(dict(LLAMA16, seq_length=SEQ, float8_training=recipe, **raw))
    sizes = {k: v for k, v in raw.items() if KEY_SECTION[k] == "model"}
    serial_cfg = GalaxyConfig.from_dict(dict(LLAMA16, seq_length=SEQ, float8_training=recipe, **sizes))
    plan = cfg.resolve_plan(ctx.mp.size)
    par = LlamaForCausalLM(cfg.model, plan, ctx, seed=3)
    serial = LlamaForCausalLM(serial_cfg.model, seed=3)
    names = enable_float8_training(par, recipe)
    assert names == enable_float8_training(serial, recipe) and len(names) == 7 * 2
    pieces = dict(serial.named_modules())
    for name in names:
        w = dict(par.named_modules())[name].weight
        spec = shard_spec(w)
        if spec is not None:
            how, split = ("column" if spec.dim == 0 else "row"), spec.sizes
        else:  # a whole weight: under SP (PARTIAL) each rank multiplies its own tokens
            how, split = ("tokens", plan.seq_split) if grad_rule(w) == GradRule.PARTIAL else ("column", [w.shape[0]])
        pieces[name].float8 = PiecewiseFloat8(pieces[name].float8, how, split)
    sync = GradientSync(par.parameters(), ctx.mp)
    batch = ids_batch()
    out_p, out_s = par(**batch), serial(**batch)
    out_p.loss.backward()
    out_s.loss.backward()
    sync()
    errors = {"loss": abs(out_p.loss.item() - out_s.loss.item()) / out_s.loss.item()}
    params_s = dict(serial.named_parameters())
    for name, p in par.named_parameters():
        errors[name] = rel_err(gather_full(p.grad, p, ctx.mp), params_s[name].grad)
    worst = max(errors, key=errors.get)
    assert errors[worst] < FP8_PLAN_RTOL, (worst, errors[worst])
    return errors[worst]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("world,raw", [
    (2, dict(plan="tp")), (2, dict(plan="sp")),
    (3, dict(plan="galaxy", num_attention_heads=6, num_key_value_heads=6, hidden_size=96,
             tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[32, 64, 32],
             seq_scatter_list=[4, 7, 5]))], ids=["tp2", "sp2", "galaxy3-uneven"])
def test_every_plan_equals_serial_float8(dist_pool, recipe, world, raw):
    dist_pool.run(float8_plan_equals_serial, world, recipe, raw)


def _train_losses(raw, steps=12):
    cfg = GalaxyConfig.from_dict(dict(LLAMA16, seq_length=SEQ, global_batch_size=ROWS, lr=3e-3, warmup_steps=0,
                                      dtype="bfloat16", seed=1, max_steps=steps, **raw))
    model = LlamaForCausalLM(cfg.model, seed=5)
    trainer = Trainer(model, cfg, ParallelContext.serial())
    from galaxy.train.loop import autocast_context

    losses = []
    for step in range(steps):
        loss = trainer.forward_backward(ids_batch(step % 3), lambda: autocast_context(cfg, torch.device("cpu")))
        trainer.optimizer_step(loss, step + 1)
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("raw", [dict(float8_training="tensorwise"), dict(float8_training="tensorwise", compile=True),
                                 pytest.param(dict(float8_training="rowwise"), marks=RECIPES[1].marks)],
                         ids=["tensorwise", "tensorwise-compiled", "rowwise"])
def test_a_few_float8_steps_lower_the_loss(raw):
    torch._dynamo.reset()
    model, losses = _train_losses(raw)
    assert model.model.layers[0].self_attn.q_proj.float8 is not None  # the Trainer turned float8 on
    _, reference = _train_losses({})
    assert losses[-1] < 0.8 * losses[0], losses
    assert abs(losses[-1] - reference[-1]) < 0.05 * reference[-1], (losses, reference)


def test_config_refuses_what_float8_training_cannot_do():
    base = dict(preset="llama-tiny", seq_length=16)
    for extra, match in [(dict(float8_training="rowwise", tuning="lora"), "quantize_base to fp8"),
                         (dict(float8_training="rowwise", dtype="float64"), "float64"),
                         (dict(float8_training="rowwise", fused_gate_up=True), "fused_gate_up"),
                         (dict(float8_training="tensorwise", tp_overlap="coc", plan="tp"), "tp_overlap"),
                         (dict(float8_training="rowwise", dp_engine="deepspeed"), "deepspeed"),
                         (dict(float8_training="rowwise", dp_engine="fsdp2", float8_fsdp_all_gather=True),
                          "float8_fsdp_all_gather"),
                         (dict(float8_training="tensorwise", float8_fsdp_all_gather=True), "fsdp2"),
                         (dict(float8_training="blockwise"), "none, tensorwise, rowwise")]:
        with pytest.raises(ConfigError, match=match):
            GalaxyConfig.from_dict(dict(base, **extra))
    assert GalaxyConfig.from_dict(dict(base, float8_training="tensorwise", dp_engine="fsdp2",
                                       float8_fsdp_all_gather=True)).train.float8_fsdp_all_gather


def fsdp_float8_weights(ctx):
    """Galaxy's Trainer under fsdp2 over 2 dp ranks with tensorwise float8 and float8_fsdp_all_gather: which
    parameters FSDP holds as torchao's fp8-gathered wrapper, and their Galaxy metadata."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from galaxy.core.fsdp import fsdp_axes, local

    cfg = GalaxyConfig.from_dict(dict(LLAMA16, seq_length=SEQ, global_batch_size=ROWS, seed=1, dp_size=2,
                                      plan="none", dp_engine="fsdp2", float8_training="tensorwise",
                                      float8_fsdp_all_gather=True))
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=5)
    rules = {n: grad_rule(p) for n, p in model.named_parameters()}
    Trainer(model, cfg, ctx)
    wrapped = sorted(n for n, p in model.named_parameters()
                     if isinstance(local(p), WeightWithDynamicFloat8CastTensor))
    assert all(fsdp_axes(p) == ("dp",) and grad_rule(p) == rules[n] for n, p in model.named_parameters()
               if p.dim() == 2)
    return wrapped


def test_fsdp2_wraps_the_float8_weights_for_an_fp8_gather(dist_pool):
    """The layer linears' weights (not the embeddings or the head) become torchao's
    ``WeightWithDynamicFloat8CastTensor`` inside FSDP's DTensors, Galaxy's metadata carried over. Gloo has no
    float8 collectives ("Invalid scalar type" at FSDP's all-gather), so the gather itself runs on NCCL only:
    the GPU bench (bench_train --float8 tensorwise under fsdp2) runs it."""
    for wrapped in dist_pool.run(fsdp_float8_weights, 2, dp=2):
        assert len(wrapped) == 7 * 2 and all(".layers." in n for n in wrapped), wrapped
