"""PEFT on one rank and against HF: LoRA merge / unmerge / re-merge (fp32), merged export loading in
transformers, LoRA files crossing to and from HF ``peft`` with equal logits, the fused-QKV LoRA
and ``fan_in_fan_out`` against the serial formula, adapters (Houlsby / Pfeiffer) and side-tuning
(no backbone activation kept for backward, only side parameters train), method selection and
adapter-only checkpoints (``compare_tuning.py`` end to end: tests/cli/test_compare.py)."""

import json
import os

import pytest
import torch

from galaxy.config import ConfigError, GalaxyConfig
from galaxy.core.layers import GradRule, ParallelLinear, grad_rule, shard_spec
from galaxy.loralib.layers import LoRALinear, MergedLoRALinear
from galaxy.loralib.model import lora_modules, lora_state_dict, mark_only_lora_as_trainable, merge_lora, unmerge_lora
from galaxy.models.bert import BertForMaskedLM, BertForSequenceClassification
from galaxy.models.llama import LlamaForCausalLM
from galaxy.peft import apply_tuning, export_merged, load_tuning, save_tuning, side_config
from tests import REPO  # noqa: E402

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROOT = REPO
BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64)
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, bos_token_id=None,
             eos_token_id=None)
SEQ = 13


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def ids_and_mask(vocab):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, vocab, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 9:] = 0
    return ids, mask


def galaxy_cfg(model_type, tuning="lora", **extra):
    raw = dict(preset="llama-tiny") if model_type == "llama" else dict(preset="bert-tiny", vocab_size=99)
    return GalaxyConfig.from_dict(dict(raw, seq_length=SEQ, tuning=tuning, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, **extra))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny random HF checkpoints (BERT MLM, BERT classifier, LLaMA) saved to local directories."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf")
    models = {"bert": transformers.BertForMaskedLM(transformers.BertConfig(**BERT)),
              "bert_cls": transformers.BertForSequenceClassification(transformers.BertConfig(**BERT, num_labels=3)),
              "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))}
    for name, model in models.items():
        model.save_pretrained(root / name)
    return {name: str(root / name) for name in models}


HF_CLASSES = {"bert": transformers.BertForMaskedLM, "bert_cls": transformers.BertForSequenceClassification,
              "llama": transformers.LlamaForCausalLM}
GALAXY_CLASSES = {"bert": BertForMaskedLM, "bert_cls": BertForSequenceClassification, "llama": LlamaForCausalLM}


def hf_model(hf_dirs, kind):
    return HF_CLASSES[kind].from_pretrained(hf_dirs[kind]).eval()


def galaxy_model(hf_dirs, kind):
    return GALAXY_CLASSES[kind].from_pretrained(hf_dirs[kind]).eval()


# ----------------------------------------------------------------------------- LoRA merge (fp32)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_merge_unmerge_remerge_agree_and_differ_from_base(hf_dirs, kind):
    model = galaxy_model(hf_dirs, kind)
    ids, mask = ids_and_mask(96)
    with torch.no_grad():
        base = model(ids, attention_mask=mask).logits
        # every linear style of the model, non-zero B
        targets = ["query", "value", "dense"] if kind == "bert" else ["q_proj", "v_proj", "o_proj", "down_proj"]
        apply_tuning(model, galaxy_cfg(kind.split("_")[0]), targets=targets, init_std=0.2)
        unmerged = model(ids, attention_mask=mask).logits
        merge_lora(model)
        merged = model(ids, attention_mask=mask).logits
        unmerge_lora(model)
        back = model(ids, attention_mask=mask).logits
        merge_lora(model)
        remerged = model(ids, attention_mask=mask).logits
    assert (unmerged - base).abs().max() > 1e-2  # LoRA does change the model
    for other in (merged, back, remerged):  # fp32: W + s*BA rounds once per element
        assert rel_err(other, unmerged) < 1e-6, rel_err(other, unmerged)


def test_merge_weights_flag_merges_on_eval(hf_dirs):
    model = galaxy_model(hf_dirs, "bert")
    apply_tuning(model, galaxy_cfg("bert", merge_weights=True), init_std=0.2)
    layers = list(lora_modules(model).values())
    model.eval()
    assert all(m.merged for m in layers)
    model.train()
    assert not any(m.merged for m in layers)


def test_merged_export_loads_in_transformers(hf_dirs, tmp_path):
    model = galaxy_model(hf_dirs, "llama")
    apply_tuning(model, galaxy_cfg("llama"), init_std=0.2)
    ids, mask = ids_and_mask(96)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    export_merged(model, str(tmp_path / "merged"))
    assert not lora_modules(model) and type(model.model.layers[0].self_attn.q_proj) is ParallelLinear
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, attention_mask=mask).logits, want, rtol=1e-5, atol=1e-5)


def test_merging_a_tied_embedding_is_refused(hf_dirs):
    model = galaxy_model(hf_dirs, "bert")
    apply_tuning(model, galaxy_cfg("bert"), targets=["word_embeddings"], init_std=0.2)
    with pytest.raises(ValueError, match="tied"):
        merge_lora(model)


# ----------------------------------------------------------------------------- HF PEFT both ways


@pytest.mark.parametrize("kind,targets", [("bert", None), ("bert_cls", ["query", "key", "value", "dense"]),
                                          ("llama", ["q_proj", "v_proj", "gate_proj", "down_proj", "embed_tokens"])])
def test_galaxy_lora_loads_in_hf_peft(hf_dirs, tmp_path, kind, targets):
    ours = galaxy_model(hf_dirs, kind)
    cfg = galaxy_cfg(kind.split("_")[0], lora_dim=4, lora_alpha=12.0)
    apply_tuning(ours, cfg, targets=targets, init_std=0.3)
    if kind == "bert_cls":  # the task head trains along (PEFT's modules_to_save) and is saved with the adapter
        assert ours.classifier.weight.requires_grad
        with torch.no_grad():
            ours.classifier.weight.add_(0.5)
    save_tuning(ours, str(tmp_path / "adapter"))
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        assert json.load(f)["peft_type"] == "LORA"
    theirs = peft.PeftModel.from_pretrained(hf_model(hf_dirs, kind), str(tmp_path / "adapter")).eval()
    ids, mask = ids_and_mask(96)
    with torch.no_grad():
        want = ours(ids, attention_mask=mask).logits
        got = theirs(input_ids=ids, attention_mask=mask).logits
        base = hf_model(hf_dirs, kind)(input_ids=ids, attention_mask=mask).logits
    assert (want - base).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,targets", [("bert", ["query", "value", "output.dense"]),
                                          ("llama", ["q_proj", "k_proj", "up_proj", "o_proj", "embed_tokens"])])
@pytest.mark.parametrize("rslora", [False, True])
def test_hf_peft_lora_loads_in_galaxy(hf_dirs, tmp_path, kind, targets, rslora):
    torch.manual_seed(1)
    theirs = peft.get_peft_model(hf_model(hf_dirs, kind), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                          use_rslora=rslora))
    for name, p in theirs.named_parameters():
        if "lora_B" in name or "lora_embedding_A" in name:  # the zero-initialised factors
            torch.nn.init.normal_(p, std=0.2)
    theirs.save_pretrained(str(tmp_path / "peft"))
    ours = load_tuning(galaxy_model(hf_dirs, kind), str(tmp_path / "peft"))
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == set(lora_state_dict(ours))
    ids, mask = ids_and_mask(96)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits,
                                   theirs.eval()(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- LoRA layers on their own


def test_lora_linear_is_the_formula_and_inits_like_peft():
    torch.manual_seed(0)
    base = ParallelLinear(16, 12, bias=True, rule=GradRule.REPLICATED)
    torch.nn.init.normal_(base.weight)
    torch.nn.init.normal_(base.bias)
    lora = LoRALinear(base, r=4, lora_alpha=8.0)
    torch.nn.init.kaiming_uniform_(lora.lora_A.weight, a=5 ** 0.5)
    torch.nn.init.normal_(lora.lora_B.weight)
    x = torch.randn(2, 5, 16)
    want = x @ base.weight.T + base.bias + 2.0 * (x @ lora.lora_A.weight.T) @ lora.lora_B.weight.T
    torch.testing.assert_close(lora(x), want)
    assert lora.weight is base.weight and grad_rule(lora.lora_A.weight) == GradRule.REPLICATED
    # seeded init inside a model: A bounded by 1/sqrt(in) (kaiming a=sqrt(5)), B zero
    model = BertForMaskedLM(galaxy_cfg("bert").model, seed=1)
    apply_tuning(model, galaxy_cfg("bert"))
    q = model.bert.encoder.layer[0].attention.self.query
    assert q.lora_A.weight.abs().max() <= 1 / 128 ** 0.5 and q.lora_A.weight.abs().max() > 0.5 / 128 ** 0.5
    assert torch.all(q.lora_B.weight == 0)


def test_fan_in_fan_out_wraps_conv1d_weights():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    base = Conv1D(12, 16)  # weight [in=16, out=12]
    lora = LoRALinear(base, r=4, lora_alpha=4.0, fan_in_fan_out=True)
    torch.nn.init.normal_(lora.lora_A.weight)
    torch.nn.init.normal_(lora.lora_B.weight)
    x = torch.randn(3, 16)
    want = base(x) + (x @ lora.lora_A.weight.T) @ lora.lora_B.weight.T
    torch.testing.assert_close(lora(x), want)
    lora.merge()
    torch.testing.assert_close(base(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="fan_in_fan_out"):
        LoRALinear(ParallelLinear(4, 4, style="column", split=[2, 2]), r=2, fan_in_fan_out=True)


def _fused_qkv_serial(x, w, a, bs, parts, enable, r, scale):
    """The serial fused-QKV LoRA: each enabled part p adds scale * x A_p^T B_p^T to its rows."""
    y = x @ w.T
    out, j = [], 0
    for on, n in zip(enable, parts):
        out.append(scale * (x @ a[j * r:(j + 1) * r].T) @ bs[j].T if on else x.new_zeros(*x.shape[:-1], n))
        j += on
    return y + torch.cat(out, dim=-1)


# float64 is the exact check; float32 compares a slice of one matmul with a smaller matmul (and the
# merged W + B(sA)), whose sums a BLAS may block differently: equal to a few float32 ulps of the outputs.
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_merged_qkv_lora_whole_equals_serial_formula(dtype, tol):
    torch.manual_seed(0)
    parts, enable, r = (8, 4, 4), (True, False, True), 2
    base = ParallelLinear(8, 16, bias=False, dtype=dtype)
    torch.nn.init.normal_(base.weight)
    layer = MergedLoRALinear(base, parts, enable, r=r, lora_alpha=4.0).to(dtype)
    torch.nn.init.normal_(layer.lora_A.weight)
    for b in layer.lora_B:
        torch.nn.init.normal_(b.weight)
    x = torch.randn(2, 3, 8, dtype=dtype)
    want = _fused_qkv_serial(x, base.weight, layer.lora_A.weight, [b.weight for b in layer.lora_B], parts, enable,
                             r, 2.0)
    torch.testing.assert_close(layer(x), want, rtol=tol, atol=tol)
    # the disabled part is the base projection alone
    torch.testing.assert_close(layer(x)[..., 8:12], x @ base.weight[8:12].T, rtol=tol, atol=tol)
    layer.merge()
    torch.testing.assert_close(layer(x), want, rtol=tol, atol=tol)


def fused_qkv_column(ctx):
    """Column-parallel fused QKV over the mp group: each part split on its own; outputs and the
    gathered gradients equal the serial formula (A's gradient summed: rule PARTIAL)."""
    torch.manual_seed(0)
    parts, enable, r = (6, 4, 4), (True, False, True), 2
    splits = [[3, 3], [2, 2], [2, 2]] if ctx.mp.size == 2 else [[1, 2, 3], [2, 1, 1], [1, 1, 2]]
    w = torch.randn(sum(parts), 8, dtype=torch.float64)
    a = torch.randn(r * sum(enable), 8, dtype=torch.float64)
    bs = [torch.randn(n, r, dtype=torch.float64) for n, on in zip(parts, enable) if on]
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    rank = ctx.mp.rank
    offsets = [0, parts[0], parts[0] + parts[1]]
    local_rows = torch.cat([w[o + sum(s[:rank]): o + sum(s[:rank + 1])] for o, s in zip(offsets, splits)])
    base = ParallelLinear(8, sum(parts), False, "column", [sum(s[i] for s in splits) for i in range(ctx.mp.size)],
                          rank, dtype=torch.float64)
    layer = MergedLoRALinear(base, parts, enable, r=r, lora_alpha=4.0, part_splits=splits)
    with torch.no_grad():
        base.weight.copy_(local_rows)
        layer.lora_A.weight.copy_(a)
        for b, full in zip(layer.lora_B, bs):
            b.weight.copy_(shard_spec(b.weight).slice(full))
    for p in (base.weight,):
        p.requires_grad_(False)
    xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ws, As = w.clone(), a.clone().requires_grad_()
    Bs = [b.clone().requires_grad_() for b in bs]
    want = _fused_qkv_serial(xs, ws, As, Bs, parts, enable, r, 2.0)
    got = layer(xp)
    cols = torch.cat([torch.arange(o + sum(s[:rank]), o + sum(s[:rank + 1])) for o, s in zip(offsets, splits)])
    torch.testing.assert_close(got, want[..., cols])
    g = torch.randn_like(want)
    (want * g).sum().backward()
    (got * g[..., cols]).sum().backward()
    assert grad_rule(layer.lora_A.weight) == GradRule.PARTIAL
    torch.testing.assert_close(ctx.mp.all_reduce(layer.lora_A.weight.grad), As.grad)
    for b, ref in zip(layer.lora_B, Bs):
        torch.testing.assert_close(b.weight.grad, shard_spec(b.weight).slice(ref.grad))
    with torch.no_grad():
        layer.merge()
        torch.testing.assert_close(layer(x), want.detach()[..., cols])
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_merged_qkv_lora_column_parallel_equals_serial(dist_pool, world):
    dist_pool.run(fused_qkv_column, world)


def test_lora_bias_modes_and_state_dict():
    cfg = galaxy_cfg("bert")
    model = BertForMaskedLM(cfg.model, seed=1)
    apply_tuning(model, cfg)
    assert set(lora_state_dict(model)) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in lora_state_dict(model))
    trainable = mark_only_lora_as_trainable(model, bias="lora_only")
    assert {n for n in trainable if n.endswith("bias")} == {
        f"bert.encoder.layer.{i}.attention.self.{m}.bias" for i in range(2) for m in ("query", "value")}
    trainable = mark_only_lora_as_trainable(model, bias="all")
    assert "bert.embeddings.LayerNorm.bias" in trainable and "cls.predictions.bias" in trainable
    with pytest.raises(ValueError, match="bias"):
        mark_only_lora_as_trainable(model, bias="some")
    with pytest.raises(ValueError, match="match no module"):
        apply_tuning(BertForMaskedLM(cfg.model), cfg, targets=["qkv"])
    with pytest.raises(ValueError, match="LayerNorm"):
        apply_tuning(BertForMaskedLM(cfg.model), cfg, targets=["attention.output.LayerNorm"])


# ----------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("model_type", ["bert", "llama"])
@pytest.mark.parametrize("kind", ["houlsby", "pfeiffer"])
def test_adapters_start_as_identity_and_sit_where_they_should(model_type, kind):
    cfg = galaxy_cfg(model_type, tuning="adapter")
    cls = BertForMaskedLM if model_type == "bert" else LlamaForCausalLM
    model = cls(cfg.model, seed=1)
    ids, mask = ids_and_mask(96)
    with torch.no_grad():
        base = model(ids, attention_mask=mask).logits
        apply_tuning(model, cfg, adapter_type=kind, adapter_reduction_factor=8, adapter_non_linearity="gelu")
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, base, rtol=0, atol=0)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    per_layer = 2 if kind == "houlsby" else 1
    assert len(names) == 4 * per_layer * cfg.model.num_hidden_layers  # down/up weight/bias
    assert all(".adapter." in n for n in names)
    if model_type == "bert":
        assert any("attention.output.dropout.adapter" in n for n in names) == (kind == "houlsby")
        assert any(".output.dropout.adapter" in n and "attention" not in n for n in names)
    down = next(p for n, p in model.named_parameters() if n.endswith("down.weight"))
    assert down.shape == (cfg.model.hidden_size // 8, cfg.model.hidden_size)


def test_llama_adapters_route_attention_and_mlp_sites():
    """LLaMA's layers call one residual dropout module twice: the first call must get the
    attention adapter, the second the MLP adapter (checked by poisoning one of them)."""
    cfg = galaxy_cfg("llama", tuning="adapter")
    model = apply_tuning(LlamaForCausalLM(cfg.model, seed=1), cfg, adapter_type="houlsby")
    from galaxy.adapters.bottleneck import BottleneckAdapter

    seen = []
    # Named '...dropout.adapter.attn' (one shared dropout module) or '...attn_dropout.adapter' (one per site).
    for name, module in model.named_modules():
        if isinstance(module, BottleneckAdapter):
            site = "attn" if "attn" in name else "mlp"
            module.register_forward_hook(lambda m, i, o, site=site: seen.append(site))
    ids, _ = ids_and_mask(96)
    model(ids)
    model(ids)
    assert seen == ["attn", "mlp"] * 4


def test_adapter_residual_and_reduction():
    from galaxy.adapters.bottleneck import BottleneckAdapter

    a = BottleneckAdapter(32, reduction_factor=4, non_linearity="tanh", residual=False)
    torch.nn.init.normal_(a.down.weight)
    torch.nn.init.normal_(a.up.weight)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(a(x), a.up(torch.tanh(a.down(x))))
    with pytest.raises(ValueError, match="non_linearity"):
        BottleneckAdapter(32, non_linearity="cube")


# ----------------------------------------------------------------------------- side-tuning


def backbone_of(model):
    return model.bert if hasattr(model, "bert") else model.model


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_side_tuning_keeps_no_backbone_activation(model_type):
    cfg = galaxy_cfg(model_type, tuning="side")
    cls = BertForMaskedLM if model_type == "bert" else LlamaForCausalLM
    ids, mask = ids_and_mask(96)

    def saved_backbone_tensors(model):
        """Backbone activations autograd keeps: every backbone submodule's output, matched by storage."""
        # Outputs are held (not just their addresses) so no later tensor can reuse their memory.
        produced, taps = {}, set()
        for name, m in backbone_of(model).named_modules():
            m.register_forward_hook(lambda mod, i, o, name=name: produced.update(
                {o.untyped_storage().data_ptr(): (name, o)} if torch.is_tensor(o) else {}))
        layers = model.bert.encoder.layer if hasattr(model, "bert") else model.model.layers
        layers[0].register_forward_pre_hook(lambda mod, i: taps.add(i[0].untyped_storage().data_ptr()))
        for layer in layers:
            layer.register_forward_hook(lambda mod, i, o: taps.add(o.untyped_storage().data_ptr()))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            out = model(ids, attention_mask=mask, labels=ids)
        ptrs = {t.untyped_storage().data_ptr() for t in saved} - params
        kept = {produced[p][0] for p in ptrs if p in produced and p not in taps}
        return kept, len(ptrs & taps), out

    side = apply_tuning(cls(cfg.model, seed=1), cfg, init_std=0.1)
    kept, taps_kept, out = saved_backbone_tensors(side)
    assert kept == set(), f"side-tuning keeps backbone activations of {sorted(kept)}"
    assert taps_kept <= cfg.model.num_hidden_layers + 1  # only the ladder taps, for the down-projections' gradients
    out.loss.backward()
    trainable = [n for n, p in side.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("side.") for n in trainable)
    assert all(p.grad is None for n, p in side.named_parameters() if not n.startswith("side."))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in side.named_parameters()
               if n.startswith("side."))
    # The same probe on LoRA (which backpropagates through the backbone) does find its activations.
    lora_cfg = galaxy_cfg(model_type, tuning="lora")
    kept_lora, _, _ = saved_backbone_tensors(apply_tuning(cls(lora_cfg.model, seed=1), lora_cfg))
    assert len(kept_lora) > 5


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_side_network_starts_as_backbone_and_has_reduced_width(model_type):
    cfg = galaxy_cfg(model_type, tuning="side")
    cls = BertForMaskedLM if model_type == "bert" else LlamaForCausalLM
    model = cls(cfg.model, seed=1)
    ids, mask = ids_and_mask(96)
    with torch.no_grad():
        base = model(ids, attention_mask=mask).logits
        apply_tuning(model, cfg, side_reduction_factor=4)
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, base, rtol=0, atol=0)
    scfg = side_config(cfg.model, 4)
    assert scfg.hidden_size == cfg.model.hidden_size // 4 and scfg.hidden_size % scfg.num_attention_heads == 0
    layers = model.bert.encoder.layer if model_type == "bert" else model.model.layers
    assert type(model.side.layers[0]) is type(layers[0])  # the model's own layer class, narrower
    assert len(model.side.layers) == cfg.model.num_hidden_layers
    if model_type == "llama":
        with pytest.raises(ValueError, match="use_cache=False"):
            model(ids, use_cache=True)


# ----------------------------------------------------------------------------- selection and checkpoints


def test_method_selection_by_config():
    assert galaxy_cfg("bert", tuning="full").peft.tuning == "full"
    cfg = GalaxyConfig.from_dict(dict(preset="bert-tiny", use_adapter=True))
    assert cfg.peft.tuning == "adapter"
    with pytest.raises(ConfigError, match="more than one"):
        GalaxyConfig.from_dict(dict(preset="bert-tiny", use_lora=True, use_side=True))
    model = apply_tuning(BertForMaskedLM(cfg.model), galaxy_cfg("bert", tuning="full"))
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="already tuned"):
        apply_tuning(model, cfg)
    with pytest.raises(ValueError, match="unknown tuning option"):
        apply_tuning(BertForMaskedLM(cfg.model), cfg, adapter_size=3)


@pytest.mark.parametrize("method", ["adapter", "side"])
def test_adapter_only_checkpoint_round_trip(tmp_path, method):
    from safetensors.torch import load_file

    cfg = galaxy_cfg("bert", tuning=method)
    model = apply_tuning(BertForSequenceClassification(cfg.model, seed=1), cfg, init_std=0.1)
    save_tuning(model, str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(saved) == trainable and "classifier.weight" in trainable  # the task head trains along
    assert sum(v.numel() for v in saved.values()) < sum(p.numel() for p in model.parameters()) / 2
    other = load_tuning(BertForSequenceClassification(cfg.model, seed=1), str(tmp_path))
    ids, mask = ids_and_mask(96)
    with torch.no_grad():
        torch.testing.assert_close(other.eval()(ids, attention_mask=mask).logits,
                                   model.eval()(ids, attention_mask=mask).logits, rtol=0, atol=0)


CONFIGS = [f"bert/{d}{m}.json" for d in ("", "tp/", "sp/", "galaxy/") for m in ("lora", "adapter", "side")] + \
    ["llama/lora.json"]


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_tuning_configs_load(name):
    cfg = GalaxyConfig.from_file(os.path.join(ROOT, "train_config", name))
    assert cfg.peft.tuning == os.path.basename(name)[:-5]
    sibling = GalaxyConfig.from_file(os.path.join(ROOT, "train_config", os.path.dirname(name), "full.json"))
    assert cfg.methods() == sibling.methods() and cfg.model == sibling.model
    cfg.resolve_plan(2)


def test_shipped_config_applies(tmp_path):
    cfg = GalaxyConfig.from_file(os.path.join(ROOT, "train_config", "bert", "side.json"))
    model = apply_tuning(BertForMaskedLM(cfg.model, seed=1), cfg)
    assert model.side.layers[0].attention.self.query.weight.shape[0] == cfg.model.hidden_size // 8
