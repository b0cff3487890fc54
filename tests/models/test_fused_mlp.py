"""The fused gate/up LLaMA MLP (``fused_gate_up``): one ``mlp.gate_up_proj.weight`` [2, I, H]
sharded along dim 1. HF weights load into it and give transformers' logits; ``save_pretrained``
writes HF's separate gate_proj/up_proj, which transformers loads; under TP and Galaxy with
uneven splits, with and without CoC, it equals the serial unfused model in float64 (gradients
split back into gate and up); checkpoints move it across plans and into the unfused layout (and
back); LoRA on gate/up is refused."""

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.grad_sync import GradientSync, gather_full
from galaxy.models import check_config
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.peft import apply_tuning
from tests.core.test_llama_equivalence import RTOL, UNEVEN, backward_both, make_batch, rel_err

transformers = pytest.importorskip("transformers")

TINY = dict(model_type="llama", vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, intermediate_size=40, hidden_act="silu", max_position_embeddings=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.1, pad_token_id=None,
            seq_length=11)
# ----------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.2, bos_token_id=None, eos_token_id=None)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = str(tmp_path_factory.mktemp("hf_llama"))
    hf.save_pretrained(path)
    return hf, path


def test_hf_weights_load_fused_and_equal_transformers(hf_dir, tmp_path):
    hf, path = hf_dir
    ours = LlamaForCausalLM.from_pretrained(path, config_overrides=dict(fused_gate_up=True)).eval()
    names = {n for n, _ in ours.named_parameters()}
    assert "model.layers.1.mlp.gate_up_proj.weight" in names and not any("gate_proj" in n for n in names)
    fused = ours.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(fused[0], hf.model.layers[0].mlp.gate_proj.weight)  # gate first
    assert torch.equal(fused[1], hf.model.layers[0].mlp.up_proj.weight)
    ids = make_batch()["input_ids"] % 96
    with torch.no_grad():
        want = hf(ids, labels=ids)
        got = ours(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    assert abs(got.loss.item() - want.loss.item()) < 1e-5

    # save_pretrained writes HF's separate projections, which transformers loads
    ours.save_pretrained(str(tmp_path))
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert torch.equal(back.model.layers[1].mlp.up_proj.weight, hf.model.layers[1].mlp.up_proj.weight)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want.logits)
    # and both layouts of ours read it
    unfused = LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(unfused(ids).logits, got.logits, atol=1e-6, rtol=0)


def test_fused_and_unfused_start_from_the_same_weights():
    unfused = LlamaForCausalLM(GalaxyConfig.from_dict(TINY).model, seed=5)
    cfg = GalaxyConfig.from_dict(dict(TINY, fused_gate_up=True))
    fused = LlamaForCausalLM(cfg.model, seed=5)
    want = unfused.full_state_dict()
    got = fused.state_to_hf(fused.full_state_dict())
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # a fused model also loads an unfused model's state dict (and the reverse)
    other = LlamaForCausalLM(cfg.model, seed=6)
    other.load_full_state_dict(want)
    assert torch.equal(other.model.layers[0].mlp.gate_up_proj.weight, fused.model.layers[0].mlp.gate_up_proj.weight)
    unfused.load_full_state_dict(fused.full_state_dict())


# ----------------------------------------------------------------------------- parallel plans


def fused_equals_serial_unfused(ctx, plan, extra):
    raw = dict(TINY, plan=plan, **UNEVEN[ctx.mp.size], **extra)
    cfg = GalaxyConfig.from_dict(dict(raw, fused_gate_up=True))
    serial = LlamaForCausalLM(GalaxyConfig.from_dict(TINY).model, seed=3).double()
    par = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).double()
    layer, plan = par.model.layers[0], par.plan
    if cfg.parallel.coc_parallel_num:  # the CoC path is the one exercised
        from galaxy.core.overlap.edges import CocEdge, plain_operands
        assert isinstance(layer.edges.mlp, CocEdge) and layer.edges.mlp.chunks > 1
        assert plain_operands([layer.mlp.gate_up_proj, layer.mlp.down_proj]) is not None
    rows = plan.ffn_split[ctx.mp.rank] if plan.mlp.value == "TP" else TINY["intermediate_size"]
    assert layer.mlp.gate_up_proj.weight.shape == (2, rows, TINY["hidden_size"])
    loss, logits_err = backward_both(serial, par, make_batch(), ctx, par.model.stream)
    assert logits_err < RTOL
    grads = {n: gather_full(p.grad, p, ctx.mp) for n, p in par.named_parameters()}
    grads = par.state_to_hf(grads)  # [2, I, H] -> gate_proj / up_proj
    ref = {n: p.grad for n, p in serial.named_parameters()}
    assert set(grads) == set(ref)
    for name, g in grads.items():
        assert rel_err(g, ref[name]) < RTOL, name
    return loss


@pytest.mark.parametrize("world,plan,extra", [(3, "tp", {}), (3, "galaxy", {}), (2, "galaxy2", {}),
                                              (2, "tp", dict(coc_parallel_num=2)),
                                              (3, "galaxy", dict(coc_parallel_num=4))])
def test_fused_plan_equals_serial_unfused(dist_pool, world, plan, extra):
    dist_pool.run(fused_equals_serial_unfused, world, plan, extra)


def fused_model_and_optimizer(ctx, plan, seed, fused=True):
    cfg = GalaxyConfig.from_dict(dict(TINY, plan=plan, **UNEVEN[ctx.mp.size], fused_gate_up=fused))
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=seed).double()
    return cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def gate_up_moments(model, optimizer, ctx):
    """Layer 1's full gate/up AdamW first moment as [2, I, H] and the step count, either layout."""
    mlp = model.model.layers[1].mlp
    params = [mlp.gate_up_proj.weight] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj.weight, mlp.up_proj.weight]
    moments = [gather_full(optimizer.state[p]["exp_avg"], p, ctx.mp) for p in params]
    return (moments[0] if len(moments) == 1 else torch.stack(moments)), optimizer.state[params[0]]["step"]


def save_gate_up_checkpoint(ctx, directory, plan, fused):
    from galaxy.train.checkpoint import save_checkpoint

    cfg, model, optimizer = fused_model_and_optimizer(ctx, plan, seed=3, fused=fused)
    model(**make_batch()).loss.backward()
    GradientSync(model.parameters(), ctx.mp)()
    optimizer.step()
    save_checkpoint(directory, 1, model, optimizer, None, ctx, cfg)
    return model.state_to_hf(model.full_state_dict()), gate_up_moments(model, optimizer, ctx)


def load_gate_up_checkpoint(ctx, directory, plan, fused):
    from galaxy.train.checkpoint import load_checkpoint

    cfg, model, optimizer = fused_model_and_optimizer(ctx, plan, seed=9, fused=fused)
    load_checkpoint(directory, model, optimizer, None, ctx, cfg)
    return model.state_to_hf(model.full_state_dict()), gate_up_moments(model, optimizer, ctx)


@pytest.mark.parametrize("saved_fused,loaded_fused", [(True, True), (True, False), (False, True)])
def test_gate_up_checkpoint_moves_across_plans_and_layouts(dist_pool, tmp_path, saved_fused, loaded_fused):
    """Checkpoints store the full [2, I, H] tensor by its dim-1 shard spec, so a TP run on 2 ranks
    resumes as Galaxy on 3 with other splits (weights, AdamW moments and step), also into a model
    with the other ``fused_gate_up`` setting."""
    saved, (moment, step) = dist_pool.run(save_gate_up_checkpoint, 2, str(tmp_path), "tp", saved_fused)[0]
    loaded, (moment_back, step_back) = dist_pool.run(load_gate_up_checkpoint, 3, str(tmp_path), "galaxy",
                                                     loaded_fused)[0]
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert torch.equal(moment_back, moment) and torch.equal(step_back, step) and step.item() == 1


# ----------------------------------------------------------------------------- LoRA


def test_lora_on_fused_gate_up_is_a_config_error():
    with pytest.raises(ConfigError, match="lora_target_modules.*fused_gate_up"):
        GalaxyConfig.from_dict(dict(TINY, fused_gate_up=True, tuning="lora", lora_target_modules=["q_proj", "up_proj"]))
    bert = GalaxyConfig.from_dict(dict(fused_gate_up=True))  # the family knows it has no gated MLP
    with pytest.raises(ConfigError, match="fused_gate_up.*model_type is 'bert'"):
        check_config(bert.model)
    with pytest.raises(ConfigError, match="fused_gate_up.*BertForMaskedLM has none"):
        BertForMaskedLM(bert.model)
    # Targets given in Python (a regex, or names) meet the same check on the built model.
    cfg = GalaxyConfig.from_dict(dict(TINY, fused_gate_up=True, tuning="lora"))
    for targets in (r".*\.(q_proj|gate_proj)", ["v_proj", "gate_up_proj"]):
        with pytest.raises(ConfigError, match="fused_gate_up"):
            apply_tuning(LlamaForCausalLM(cfg.model), cfg, targets=targets)
    apply_tuning(LlamaForCausalLM(cfg.model), cfg, targets=["q_proj", "down_proj"])  # the rest of the MLP is fine


def test_fuse_and_split_gate_up_are_inverse_on_hf_state(hf_dir):
    """``galaxy.models.llama.hf``: HF's gate/up pairs stack gate first into [2, I, H] and split back to the
    same tensors; a 0-dim optimizer state (a step count) is the gate's and goes to both."""
    from galaxy.models.llama.hf import fuse_gate_up, split_gate_up

    hf, _ = hf_dir
    state = dict(hf.state_dict())
    fused = fuse_gate_up(state)
    stem = "model.layers.1."
    assert torch.equal(fused[stem + "mlp.gate_up_proj.weight"],
                       torch.stack([state[stem + "mlp.gate_proj.weight"], state[stem + "mlp.up_proj.weight"]]))
    assert not any(k.endswith(("gate_proj.weight", "up_proj.weight")) and "gate_up" not in k for k in fused)
    back = split_gate_up(fused)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    steps = {stem + "mlp.gate_proj.weight": torch.tensor(7.0), stem + "mlp.up_proj.weight": torch.tensor(7.0)}
    assert split_gate_up(fuse_gate_up(steps)) == steps
    lone = {stem + "mlp.gate_proj.weight": state[stem + "mlp.gate_proj.weight"]}
    assert fuse_gate_up(lone) == lone  # not a complete pair: left for the loader to name
