"""The block edges (galaxy.core.edges) and the one factory that picks them (galaxy.core.parallelize):
each TP block of a plan gets the overlapped edge its settings ask for (CoC's chunks, CCLoRA with
lora_fusion) and every other block the plain one; a layer in ``recompute: mlp`` keeps its MLP's edges
plain; switching CCLoRA on and off picks the edges again through the model's public method, and the
fused model then equals the plain one; no module under galaxy/models names the overlapped edges."""

import os
import re

import torch

from galaxy.config import GalaxyConfig, Method
from galaxy.core.edges import PlainEdge
from galaxy.core.parallelize import RecomputedEdge
from galaxy.models.llama import LlamaForCausalLM
from galaxy.peft import apply_tuning
from tests import REPO
from tests.core.test_llama_equivalence import TINY, make_batch


def edge_types(model):
    return [(type(layer.edges.att).__name__, type(layer.edges.mlp).__name__) for layer in model.model.layers]


def factory_case(ctx):
    from galaxy.core.overlap.edges import CcloraEdge, CocEdge

    def build(**extra):
        cfg = GalaxyConfig.from_dict(dict(TINY, seq_length=11, **extra))
        return LlamaForCausalLM(cfg.model, cfg.resolve_plan(ctx.mp.size), ctx, seed=3).double(), cfg

    plain, _ = build(plan="galaxy2")
    assert edge_types(plain) == [("PlainEdge", "PlainEdge")] * 2
    coc, _ = build(plan="galaxy2", coc_parallel_num=2)  # ATT is TP, MLP is SP: only ATT overlaps
    assert edge_types(coc) == [("CocEdge", "PlainEdge")] * 2 and coc.model.layers[0].edges.att.chunks == 2
    mlp, _ = build(plan="tp", coc_parallel_num=4, recompute="mlp", recompute_num_layers=1)
    assert edge_types(mlp) == [("CocEdge", "RecomputedEdge"), ("CocEdge", "CocEdge")]
    assert isinstance(mlp.model.layers[0].edges.mlp, RecomputedEdge)
    # CCLoRA is a PEFT setting: the edges are picked again when the LoRA layers switch it.
    tuned, cfg = build(plan="galaxy", tuning="lora", lora_fusion=True, lora_dropout=0.0)
    fused = apply_tuning(tuned, cfg, init_std=0.2)
    assert all(isinstance(e, CcloraEdge) for layer in fused.model.layers for e in layer.edges)
    batch = make_batch()
    with torch.no_grad():
        want = fused(**batch).loss
    from galaxy.loralib import set_lora_fusion
    set_lora_fusion(fused, False)
    assert edge_types(fused) == [("PlainEdge", "PlainEdge")] * 2
    with torch.no_grad():
        got = fused(**batch).loss
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    set_lora_fusion(fused, True)
    assert all(isinstance(e, CcloraEdge) and isinstance(e, CocEdge) for layer in fused.model.layers
               for e in layer.edges)
    return True


def test_the_factory_picks_each_blocks_edge(dist_pool):
    assert all(dist_pool.run(factory_case, 2))


def test_a_single_rank_has_plain_edges_only():
    cfg = GalaxyConfig.from_dict(dict(TINY, seq_length=11, coc_parallel_num=2, plan="tp"))
    model = LlamaForCausalLM(cfg.model, cfg.resolve_plan(1), seed=3)
    assert all(type(e) is PlainEdge and e.method == Method.TP for layer in model.model.layers for e in layer.edges)


def python_files(root, *parts):
    for folder, _, files in os.walk(os.path.join(root, *parts)):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                yield os.path.relpath(path, root), f.read()


def monkey_patches(root: str) -> list[str]:
    """Names of the overlapped edges under galaxy/models; attribute swaps through ``vars()`` and attributes
    rebound to a wrapper of themselves (``x.enter = torch.compiler.disable(x.enter)``) anywhere in galaxy."""
    named = re.compile(r"overlap|\bcoc\b|cclora|async.?tp|coc_parallel_num|tp_overlap", re.I)
    found = [f"{path}:{i} names {named.search(line).group(0)}" for path, text in python_files(root, "galaxy", "models")
             for i, line in enumerate(text.splitlines(), 1) if named.search(line)]
    swap = re.compile(r"for [^\n]* in [^\n]*vars\([^\n]*\n(?:[^\n]*\n){0,4}?[^\n]*setattr\(")
    wrap = re.compile(r"^([^=\n]*)=[^\n]*(?:torch\.compiler\.disable|torch\.compile|types\.MethodType)\((\w+\.\w+)\)",
                      re.M)
    for path, text in python_files(root, "galaxy"):
        found += [f"{path}: swaps through vars()" for _ in swap.finditer(text)]
        found += [f"{path}: rebinds {m.group(2)}" for m in wrap.finditer(text) if m.group(2) in m.group(1)]
    return found


def test_no_model_names_the_overlapped_edges_and_nothing_is_monkey_patched():
    """The models call the edges they are given: none imports galaxy.core.overlap or names CoC, CCLoRA or
    async TP (nor the keys that select them); nothing in galaxy swaps an attribute found through vars()
    or rebinds a method on an instance."""
    assert monkey_patches(REPO) == []


def test_an_fsdp_unit_is_a_module_an_edge_calls(dist_pool):
    """``mp_grad_reduce: fsdp`` shards the whole weights of SP blocks over mp with FSDP, whose gathers run
    in the forward hooks of the modules called: the SP attention's projections (its edge calls them, the
    attention module has no forward), equal to serial over training steps (seen to fail while LLaMA's
    attention had a forward: its weights stayed sharded when the edge called its projections)."""
    from tests.core.test_fsdp import fsdp_equals_serial

    case = dict(model="llama", att_parallel_method="SP", con_parallel_method="SP", mlp_parallel_method="TP",
                mp_grad_reduce="fsdp", seq_scatter_list=[7, 5])
    dist_pool.run(fsdp_equals_serial, 2, case)
