"""Every tuning method (LoRA, adapters, side-tuning) on every plan equals the serial model with the
same method, in float64: loss, logits and every trainable gradient (gathered to full shape) to 1e-9
relative; frozen parameters get no gradient and do not move in an AdamW step, trainable ones take
the serial step. BERT and LLaMA (GQA), TP / SP / Galaxy / Galaxy2 at world 2, uneven splits at
world 3 and 4, mixed plans. LoRA targets every linear style (column, row, whole) and an embedding.
Plus: LoRA merged per shard equals the serial model, and LoRA / adapter files saved on a plan are
the serial model's files (plan-independent), loadable on any plan."""

import os

import pytest
import torch

from galaxy.config import GalaxyConfig
from galaxy.core.grad_sync import gather_full
from galaxy.loralib import lora_modules, merge_lora, unmerge_lora
from galaxy.models.bert import BertForMaskedLM
from galaxy.models.llama import LlamaForCausalLM
from galaxy.peft import apply_tuning, load_tuning, save_tuning
from tests.core.test_llama_equivalence import RTOL, backward_both, rel_err

BERT = dict(vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=6, intermediate_size=40,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LLAMA = dict(model_type="llama", vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, intermediate_size=40, hidden_act="silu", max_position_embeddings=32,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.1)
MODELS = {"bert": (BertForMaskedLM, BERT), "llama": (LlamaForCausalLM, LLAMA)}
# LoRA on column (q/v, intermediate, gate/up), row (attention output, down) and whole linears
# (head), and on the input embedding, so every rule of the table in loralib/layers.py is exercised.
LORA_TARGETS = {"bert": ["query", "value", "attention.output.dense", "intermediate.dense", "output.dense",
                         "word_embeddings"],
                "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                          "embed_tokens"]}
SEQ, BATCH = 11, 3
UNEVEN = {  # heads: BERT has 6, LLaMA 8 in GQA pairs
    "bert": {3: dict(tp_num_attention_heads_list=[1, 3, 2], tp_intermediate_size_list=[10, 20, 10],
                     seq_scatter_list=[2, 5, 4]),
             4: dict(tp_num_attention_heads_list=[2, 1, 2, 1], tp_intermediate_size_list=[5, 10, 15, 10],
                     seq_scatter_list=[3, 2, 4, 2])},
    "llama": {3: dict(tp_num_attention_heads_list=[2, 4, 2], tp_intermediate_size_list=[10, 20, 10],
                      seq_scatter_list=[2, 5, 4]),
              4: dict(tp_num_attention_heads_list=[2, 2, 2, 2], tp_intermediate_size_list=[5, 10, 15, 10],
                      seq_scatter_list=[3, 2, 4, 2])},
}
PRESETS = ("tp", "sp", "galaxy", "galaxy2")
MIXED = (("SP", "None", "TP"), ("None", "SP", "TP"))
OWN = {"lora": lambda n: "lora_" in n, "adapter": lambda n: ".adapter." in n, "side": lambda n: n.startswith("side.")}


def make_batch(model_type):
    g = torch.Generator().manual_seed(1000)
    ids = torch.randint(1, 50, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0
    if model_type == "llama":
        mask[2, :2] = 0
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    else:
        labels = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.4, ids, torch.full_like(ids, -100))
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def tuned_pair(ctx, model_type, method, plan, uneven, extra=None, **opts):
    cls, tiny = MODELS[model_type]
    raw = dict(tiny, seq_length=SEQ, tuning=method, **(extra or {}))
    if isinstance(plan, str):
        raw["plan"] = plan
    else:
        raw.update(att_parallel_method=plan[0], con_parallel_method=plan[1], mlp_parallel_method=plan[2])
    if uneven:
        raw.update(UNEVEN[model_type][ctx.mp.size])
    cfg = GalaxyConfig.from_dict(raw)
    # init_std: LoRA B / adapter up / side up start non-zero, so every factor has a gradient.
    opts = dict(dict(init_std=0.2, side_reduction_factor=4, targets=LORA_TARGETS[model_type]), **opts)
    serial = apply_tuning(cls(cfg.model, seed=7), cfg, **opts).double()
    par = apply_tuning(cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=7), cfg, **opts).double()
    return serial, par


def edges(model):
    return model.bert.stream if hasattr(model, "bert") else model.model.stream


def compare_with_serial(ctx, model_type, method, plan, uneven, extra=None):
    serial, par = tuned_pair(ctx, model_type, method, plan, uneven, extra)
    names = [n for n, p in par.named_parameters() if p.requires_grad]
    assert names and all(OWN[method](n) for n in names), names
    assert names == [n for n, p in serial.named_parameters() if p.requires_grad]
    frozen = {n: gather_full(p.detach(), p, ctx.mp).clone() for n, p in par.named_parameters() if not p.requires_grad}
    _, worst = backward_both(serial, par, make_batch(model_type), ctx, edges(par))
    grads_s = dict(serial.named_parameters())
    for name, p in par.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"frozen {name} got a gradient"
            continue
        assert grads_s[name].grad is not None and grads_s[name].grad.norm() > 0, f"serial {name} has no gradient"
        err = rel_err(gather_full(p.grad, p, ctx.mp), grads_s[name].grad)
        assert err < RTOL, f"{method} on {plan}: grad of {name}: relative error {err:.2e}"
        worst = max(worst, err)
    # One AdamW step: trainable parameters take the serial step, frozen ones stay put.
    for model in (serial, par):
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    for name, p in par.named_parameters():
        full = gather_full(p.detach(), p, ctx.mp)
        if name in frozen:
            assert torch.equal(full, frozen[name]), f"frozen {name} changed"
        else:
            err = rel_err(full, grads_s[name].detach(), floor=1e-2)
            assert err < RTOL, f"{name} after a step: relative error {err:.2e}"
    assert worst < RTOL, worst
    return worst


def run_cases(ctx, model_type, method, cases):
    return max(compare_with_serial(ctx, model_type, method, plan, uneven) for plan, uneven in cases)


METHODS = ("lora", "adapter", "side")
CASES = {
    1: [("none", False)],
    2: [(p, False) for p in PRESETS] + [(m, False) for m in MIXED],
    3: [(p, True) for p in PRESETS],
    4: [("galaxy", True), ("sp", True)],
}


@pytest.mark.parametrize("world", sorted(CASES))
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_method_on_every_plan_equals_serial(dist_pool, model_type, method, world):
    dist_pool.run(run_cases, world, model_type, method, CASES[world])


# ----------------------------------------------------------------------------- LoRA merge on a plan


def merged_on_plan(ctx, model_type, plan):
    # Embeddings left out: BERT's is tied to the MLM decoder, which merging would move (refused).
    targets = [t for t in LORA_TARGETS[model_type] if "embed" not in t]
    serial, par = tuned_pair(ctx, model_type, "lora", plan, ctx.mp.size in UNEVEN[model_type], targets=targets)
    batch = make_batch(model_type)
    with torch.no_grad():
        want = serial(**batch).logits
        unmerged = edges(par).to_replicated(par(**batch).logits)
        merge_lora(par)
        assert all(m.merged for m in lora_modules(par).values())
        merged = edges(par).to_replicated(par(**batch).logits)
        unmerge_lora(par)
        again = edges(par).to_replicated(par(**batch).logits)
    for got in (unmerged, merged, again):
        assert rel_err(got, want) < RTOL, rel_err(got, want)
    return rel_err(merged, want)


@pytest.mark.parametrize("model_type,plan,world", [("bert", "galaxy", 3), ("llama", "tp", 2)])
def test_lora_merge_per_shard_equals_serial(dist_pool, model_type, plan, world):
    dist_pool.run(merged_on_plan, world, model_type, plan)


# ----------------------------------------------------------------------------- plan-independent files


def save_on_plan(ctx, model_type, method, plan, directory):
    serial, par = tuned_pair(ctx, model_type, method, plan, False)
    save_tuning(par, os.path.join(directory, "par"))
    if ctx.rank == 0:
        save_tuning(serial, os.path.join(directory, "serial"))
    return True


def load_on_plan(ctx, model_type, method, plan, directory):
    from safetensors.torch import load_file

    par_file = load_file(os.path.join(directory, "par", "adapter_model.safetensors"))
    serial_file = load_file(os.path.join(directory, "serial", "adapter_model.safetensors"))
    assert par_file.keys() == serial_file.keys()
    assert all(torch.equal(par_file[k], serial_file[k]) for k in par_file)
    # Load into fresh, untuned models with another seed: the file alone defines the method.
    cls, tiny = MODELS[model_type]
    cfg = GalaxyConfig.from_dict(dict(tiny, seq_length=SEQ, plan=plan, **UNEVEN[model_type].get(ctx.mp.size, {})))
    serial = load_tuning(cls(cfg.model, seed=7), os.path.join(directory, "serial")).double()
    par = load_tuning(cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=7),
                      os.path.join(directory, "par")).double()
    batch = make_batch(model_type)
    with torch.no_grad():
        err = rel_err(edges(par).to_replicated(par(**batch).logits), serial(**batch).logits)
    assert err < RTOL, err
    return err


@pytest.mark.parametrize("model_type,method", [("bert", "lora"), ("llama", "lora"), ("bert", "adapter"),
                                               ("llama", "side")])
def test_saved_files_are_plan_independent(dist_pool, tmp_path, model_type, method):
    dist_pool.run(save_on_plan, 2, model_type, method, "galaxy", str(tmp_path))
    dist_pool.run(load_on_plan, 3, model_type, method, "galaxy2", str(tmp_path))


# ----------------------------------------------------------------------------- data and pipeline parallel

DPPP_TRAIN = dict(seq_length=12, global_batch_size=8, lr=1e-2, warmup_steps=0, weight_decay=0.01, grad_clip=0.5,
                  dtype="float64", seed=7)
DPPP_CASES = {
    "bert-lora-pp2-galaxy": ("bert", "lora", dict(pp_size=2, plan="galaxy", num_microbatches=2)),
    "llama-adapter-dp2-pp2": ("llama", "adapter", dict(dp_size=2, pp_size=2, num_microbatches=2)),
    "bert-adapter-dp2-galaxy": ("bert", "adapter", dict(dp_size=2, plan="galaxy")),
    "llama-lora-pp2-tp-tied": ("llama", "lora", dict(pp_size=2, plan="tp", tie_word_embeddings=True,
                                                     num_microbatches=2)),
}


def causal_batch_at(step):
    g = torch.Generator().manual_seed(500 + step)
    shape = (DPPP_TRAIN["global_batch_size"], DPPP_TRAIN["seq_length"])
    ids = torch.randint(0, 64, shape, generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = torch.where(mask.bool() & (torch.rand(shape, generator=g) < 0.7), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def dp_pp_with_method(ctx, model_type, method, extra):
    """One rank of a dp x pp x mp layout (a pipeline stage when pp > 1) with ``method`` applied by
    name to the layers it holds, against the serial model with the same method, through the
    training loop's own Trainer (micro-batches, dp and mp sync, clipping): 2 steps."""
    from galaxy.config import KEY_SECTION
    from galaxy.core.context import ParallelContext
    from galaxy.train.loop import Trainer
    from galaxy.data.pretraining import mlm_data

    cls, tiny = MODELS[model_type]
    tiny = dict(tiny, vocab_size=64, num_hidden_layers=4)
    cfg = GalaxyConfig.from_dict(dict(tiny, **DPPP_TRAIN, **extra, tuning=method))
    serial_cfg = GalaxyConfig.from_dict(dict(tiny, **DPPP_TRAIN, tuning=method,
                                             **{k: v for k, v in extra.items() if KEY_SECTION[k] == "model"}))
    ctx.stage_layers = cfg.stage_layers()
    opts = dict(init_std=0.2)
    model = apply_tuning(cls(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=11), cfg, **opts).double()
    serial = apply_tuning(cls(serial_cfg.model, seed=11), serial_cfg, **opts).double()
    par, ref = Trainer(model, cfg, ctx), Trainer(serial, serial_cfg, ParallelContext.serial())
    batch_at = mlm_data(cfg)[0] if model_type == "bert" else causal_batch_at
    params_s = dict(serial.named_parameters())
    frozen = {n: gather_full(p.detach(), p, ctx.mp).clone() for n, p in model.named_parameters() if not p.requires_grad}
    for step in range(2):
        loss_t, loss_st = par.forward_backward(par.read_batch(batch_at, step)), ref.forward_backward(batch_at(step))
        loss, loss_s = loss_t.item(), loss_st.item()
        assert abs(loss - loss_s) <= RTOL * abs(loss_s), (step, loss, loss_s)
        for name, p in model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, name
                continue
            assert OWN[method](name), name
            err = rel_err(gather_full(p.grad, p, ctx.mp), params_s[name].grad)
            assert err < RTOL, f"step {step}: grad of {name}: relative error {err:.2e}"
        par.optimizer_step(loss_t, step + 1)
        ref.optimizer_step(loss_st, step + 1)
    for name, p in model.named_parameters():
        full = gather_full(p.detach(), p, ctx.mp)
        if name in frozen:
            assert torch.equal(full, frozen[name]), f"frozen {name} changed"
        else:
            assert rel_err(full, params_s[name].detach(), floor=1e-2) < RTOL, name
    par.grad_sync.remove()
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("name", list(DPPP_CASES))
def test_method_under_dp_and_pp_equals_serial(dist_pool, name):
    model_type, method, extra = DPPP_CASES[name]
    out = dist_pool.run(dp_pp_with_method, 4, model_type, method, extra, dp=extra.get("dp_size", 1),
                        pp=extra.get("pp_size", 1))
    assert set().union(*map(set, out)), "some rank trains something"


def side_under_pp(ctx):
    cfg = GalaxyConfig.from_dict(dict(BERT, num_hidden_layers=2, seq_length=SEQ, pp_size=2, tuning="side"))
    ctx.stage_layers = cfg.stage_layers()
    with pytest.raises(ValueError, match="pipeline"):
        apply_tuning(BertForMaskedLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx), cfg)
    return True


def test_side_tuning_under_pp_is_refused(dist_pool):
    dist_pool.run(side_under_pp, 2, pp=2)
