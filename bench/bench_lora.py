"""LoRA and QLoRA fine-tuning on one GPU: Galaxy against what a PEFT user runs, in one launch.

    python bench/bench_lora.py --preset llama-1b --seq 1024 --batch 8 --steps 10 --warmup 3 --json out.json
    python bench/bench_lora.py --preset llama-8b --batch 1 --max_seq --json longest.json

Contenders (each in a fresh process, so one's memory and Liger's patches never reach another):
``galaxy-lora`` (frozen base in bf16, fp32 LoRA factors and AdamW state, kernels auto), ``galaxy-lora-compiled``
(the same with ``compile: true``: each layer through torch.compile),
``galaxy-qlora`` (the same over an NF4 base), ``galaxy-qlora-compiled`` (QLoRA with ``compile: true``: each
layer's NF4 dequantize-and-matmul traced into its graph), ``galaxy-lora-fp8`` / ``galaxy-lora-fp8-compiled``
(the same over an fp8 base, ``quantize_base: fp8``: its products on the fp8 tensor cores, each activation
quantized per row, in the compiled layer fused into the op that makes it), ``galaxy-lora-fp8head*`` (the same with
the frozen output head's logits on fp8 too, ``quantize_head: true``), ``-cudagraphs`` for any (``compile_mode:
reduce-overhead``: each layer's kernels replayed as CUDA graphs), ``-autotune`` for either (``compile_mode:
max-autotune-no-cudagraphs``: inductor times Triton GEMM templates, with the pointwise ops after them fused
into their epilogues, against cuBLAS and keeps the fastest per product; ``-multikernel`` after any of these three
adds ``compile_options: {"triton.multi_kernel": 1}``, e.g. ``galaxy-lora-fp8-cudagraphs-multikernel``; a ``+<mode>[K]`` suffix on any Galaxy
contender recomputes, ``recompute: <mode>`` (full, selective or mlp) on the first K layers when K is given,
e.g. ``galaxy-lora-compiled+mlp8``), ``peft-bf16`` (transformers + peft, base loaded in bf16, bf16 autocast),
``peft-bf16-liger`` (the same with Liger-Kernel's LLaMA patches), ``peft-qlora-bnb``
(transformers + peft over a bitsandbytes NF4 base with double quantization, bf16 compute: the QLoRA
recipe), ``unsloth-lora`` / ``unsloth-qlora`` (unsloth's recipe: ``FastLanguageModel.from_pretrained`` with
``load_in_4bit`` False / True, its NF4 base being bitsandbytes' with double quantization, then
``FastLanguageModel.get_peft_model``, with ``use_gradient_checkpointing=False``: nothing recomputed, its
fastest setting where memory allows, as at these shapes (peft-bf16 runs them without checkpointing); a
``-gc`` suffix runs its recommended default ``"unsloth"`` instead (from seq 512 on: checkpointing that
offloads the saved activations to host memory), and a ``-sdpa`` suffix hides xformers so that its
attention is PyTorch's SDPA, e.g. ``unsloth-qlora-gc-sdpa``; each row names the ``attention`` it ran and
its checkpointing; the default launch runs both attention paths). ``+auto`` on a Galaxy contender sets
``activation_memory: auto`` with the card's memory (``--card_gib``) as ``memory_budget_gib`` (each layer's
memory mode and the MLP's sequence chunks chosen by the planner: the long-context recipe). Every contender:
LoRA r16 alpha 32 on q_proj / v_proj, dropout 0, random tokens with labels = inputs, fused AdamW lr 1e-4,
clipping at 1.0; a timed step is forward, backward, clipping and the optimizer step under bf16 autocast
(Galaxy: its own loop, whose steps go ahead: each read once the next is queued), ended by reading the loss
(a device sync; transformers' Trainer, unsloth's, tests every step's loss for NaN the same way); a row's
``step_ms`` is the timed steps' span over their count (``step_ms_median``, ``_min``, ``_max`` and ``times_ms``
beside it), and its rates follow from that. Galaxy's random weights are drawn on the GPU by
its generator, tensor by tensor, the frozen base stored in its format as it is made; its row's ``stages_s`` says
how long its plan, build and first step (with the compile) took. Peak memory is counted from the first
training step on (building the model is left out, for every contender alike). A contender whose package does
not import says so in its row; a contender that cannot run (out of memory among the reasons) says why in its
row's ``error`` (one line), and the launch goes on.
Each row states tokens/s and MFU both ways (``mfu``: 4 N + 12 L H S per token, LoRA computing no weight gradient
of the frozen base; ``mfu_causal``: 6 L H S, the scores a causal kernel computes), and the report's ``summary``
puts Galaxy's fastest row of each family (bf16, NF4, fp8 base) beside the fastest other row of that family,
whichever recipe or attention path it is.

``--max_seq``: the longest sequence each contender trains at (at ``--batch``), the same search for all: powers
of two from a start (up while they fit, down while they fail), then one bisection step between the last that
fit and the first that failed; a length counts when two whole training steps complete after a first one (the
compile's, not timed), each try in a fresh process (an out-of-memory is that try's row, and its memory goes
with the process), every search from
``--max_seq_start``. Rows: the longest length, its step time, tokens/s, MFU and peak, and every try's.
``--card_gib G`` emulates a smaller card for every contender alike (each process's caching allocator capped at
G GiB): on an H200 a 1B model's search would otherwise run to lengths whose steps take minutes.

unsloth patches transformers, peft and trl when imported, so it is imported first in its own process;
``--unsloth_path DIR`` puts DIR (its carried packages) first on that process's path only, so the other
contenders keep the image's packages. Its model is built as the peft contenders' (a random
``LlamaForCausalLM`` of the preset's shapes), saved with a small word-level tokenizer to a temporary
directory and loaded from there offline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# torch and the config alone here: the launch's own process and a contender that stops at its import (unsloth
# without a GPU) do without Galaxy's model and training code (over a second of CPU a process); a contender's
# process imports them where it runs.
from bench import exit_without_finalizing, line_buffered_output  # noqa: E402
from galaxy.config import MODEL_PRESETS, GalaxyConfig  # noqa: E402

# unsloth with both its attention paths (xformers where it loads, PyTorch's SDPA with -sdpa): its faster row is
# the anchor of its family (``best_per_family``).
CONTENDERS = ("galaxy-lora", "galaxy-lora-compiled", "galaxy-lora-cudagraphs", "galaxy-qlora",
              "galaxy-qlora-compiled", "galaxy-qlora-cudagraphs", "galaxy-lora-fp8",
              "galaxy-lora-fp8-compiled", "peft-bf16",
              "peft-bf16-liger", "peft-qlora-bnb", "unsloth-lora", "unsloth-lora-sdpa", "unsloth-qlora",
              "unsloth-qlora-sdpa")

# Each contender's family, by the frozen base's format (first match): Galaxy's best row of a family against the
# best of the others (``best_per_family``). The fp8 slot: fp8 contenders name "fp8" (issue 50's fp8 table).
FAMILIES = (("fp8 base", re.compile(r"fp8")), ("nf4 base", re.compile(r"^(galaxy-qlora|peft-qlora|unsloth-qlora)")),
            ("bf16 base", re.compile(r"^(galaxy-lora|peft-bf16|unsloth-lora)")))
# No other recipe trains LoRA over an fp8 base: its anchor is the fastest bf16-base row (issue 51's line).
ANCHOR_FAMILY = {"fp8 base": "bf16 base"}

# Every contender's LoRA (and bench_peft_mp's): r16, alpha 32 on q_proj / v_proj, no dropout.
LORA = {"tuning": "lora", "lora_dim": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "v_proj"]}

UNSLOTH = re.compile(r"^unsloth-(lora|qlora)(-gc)?(-sdpa)?$")
RECOMPUTE = re.compile(r"^(full|selective|mlp)(\d*)$")
AUTO = re.compile(r"^auto(\d+(?:\.\d+)?)?$")


def galaxy_recompute(name: str, budget_gib: Optional[float] = None) -> tuple[str, dict]:
    """A Galaxy contender's name without its ``+<mode>[K]`` suffix, and the model keys the suffix sets: a recompute
    mode on the first K layers, or ``+auto[G]`` (``activation_memory: auto``: the planner picks each layer's memory
    mode within ``memory_budget_gib``: G GiB where named, e.g. ``+auto5.5`` for another contender's peak, else
    ``budget_gib``, the card's memory where given)."""
    base, plus, suffix = name.partition("+")
    if not plus:
        return name, {}
    auto = AUTO.match(suffix)
    if auto:
        budget = float(auto[1]) if auto[1] else budget_gib
        return base, {"activation_memory": "auto", **({"memory_budget_gib": budget} if budget else {})}
    m = RECOMPUTE.match(suffix)
    if m is None:
        raise ValueError(f"contender '{name}': the suffix after '+' is a recompute mode and an optional layer "
                         "count, e.g. +mlp8 (modes: full, selective, mlp), or auto with an optional budget in GiB, "
                         "e.g. +auto5.5 "
                         "(activation_memory: auto)")
    return base, {"recompute": m[1], **({"recompute_num_layers": int(m[2])} if m[2] else {})}


def family_of(name: str) -> Optional[str]:
    return next((family for family, pattern in FAMILIES if pattern.search(name)), None)


def best_per_family(rows: list, by: str = "steps_per_s") -> dict:
    """For each family with a Galaxy row and another: Galaxy's best row against the best other (its anchor,
    whichever attention path or recipe that is), and the ratios of their ``by`` and peaks. ``by`` is
    ``steps_per_s`` for rows at one length, ``max_seq`` for ``--max_seq`` rows (their steps/s are at different
    lengths: the longest context is the figure). A family no other recipe trains takes ``ANCHOR_FAMILY``'s."""
    out = {}
    timed = [r for r in rows if r.get(by) and "step_ms" in r]
    for family, _ in FAMILIES:
        galaxy = [r for r in timed if r["contender"].startswith("galaxy") and family_of(r["contender"]) == family]
        anchors = [r for r in timed if not r["contender"].startswith("galaxy")
                   and family_of(r["contender"]) in (family, ANCHOR_FAMILY.get(family))]
        if galaxy and anchors:
            g, a = (max(rs, key=lambda r: (r[by], r["steps_per_s"])) for rs in (galaxy, anchors))
            out[family] = {"galaxy": g["contender"], "anchor": a["contender"], f"{by}_ratio": g[by] / a[by],
                           "peak_ratio": g["peak_mib"] / a["peak_mib"] if g.get("peak_mib") and a.get("peak_mib")
                           else None}
    return out


MULTI_KERNEL = "-multikernel"  # after a compile mode: compile_options {"triton.multi_kernel": 1}


def galaxy_compile_mode(name: str) -> Optional[str]:
    """A Galaxy contender's torch.compile mode: ``-compiled`` the default, ``-cudagraphs`` reduce-overhead,
    ``-autotune`` max-autotune-no-cudagraphs, each optionally followed by ``-multikernel``; None (eager) for any
    other name."""
    return {"compiled": "default", "cudagraphs": "reduce-overhead",
            "autotune": "max-autotune-no-cudagraphs"}.get(name.removesuffix(MULTI_KERNEL).rsplit("-", 1)[-1])


def galaxy_compile_options(name: str) -> Optional[dict]:
    """``-multikernel`` after a compile mode: inductor's multi-kernel (each reduction compiled persistent and
    looped, the faster picked per size when first run) in the layers' graphs."""
    if not name.endswith(MULTI_KERNEL):
        return None
    if galaxy_compile_mode(name) is None:
        raise ValueError(f"contender '{name}': -multikernel follows a compile mode (-compiled, -cudagraphs or "
                         "-autotune), e.g. galaxy-lora-fp8-cudagraphs-multikernel")
    return {"triton.multi_kernel": 1}


def galaxy_base_format(name: str) -> str:
    """The frozen base's ``quantize_base`` of a Galaxy contender: nf4 (``galaxy-qlora*``), fp8
    (``galaxy-lora-fp8*``), else none (bf16)."""
    return "nf4" if name.startswith("galaxy-qlora") else "fp8" if name.startswith("galaxy-lora-fp8") else "none"


def galaxy_head_on_fp8(name: str) -> bool:
    """``galaxy-lora-fp8head*``: the fp8 base with the frozen output head's logits on fp8 too (``quantize_head``)."""
    return name.startswith("galaxy-lora-fp8head")


def unsloth_variant(name: str):
    """``unsloth-lora`` / ``unsloth-qlora``, then optionally ``-gc`` (its default ``use_gradient_checkpointing=
    "unsloth"`` instead of False) and ``-sdpa`` (xformers hidden, so its attention is PyTorch's SDPA):
    (load_in_4bit, use_gradient_checkpointing, sdpa), or None for any other name."""
    m = UNSLOTH.match(name)
    return None if m is None else (m[1] == "qlora", "unsloth" if m[2] else False, bool(m[3]))


def hf_step(model, cfg):
    """One training step of a transformers model (peft's and unsloth's contenders): bf16 autocast,
    clip 1.0, fused AdamW on the trainable parameters; peak memory counted from here on."""
    from bench.bench_plans import causal_lm_data

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    batch_at = causal_lm_data(cfg)
    torch.cuda.reset_peak_memory_stats()

    def step(i):
        batch = {k: v.cuda(non_blocking=True) for k, v in batch_at(i).items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # as transformers' Trainer (unsloth's), whose logging_nan_inf_filter (on by default) tests each loss

    return step


def config(args, quantize: str = "none", compile_mode: Optional[str] = None,
           recompute: Optional[dict] = None, compile_options: Optional[dict] = None, head: bool = False
           ) -> GalaxyConfig:
    """``compile_mode``: None runs eagerly, else ``compile: true`` in that torch.compile mode (with inductor's
    ``compile_options``); ``recompute``:
    model keys (``galaxy_recompute``). Positions reach the sequence length wherever it is longer than the
    preset's."""
    shape = {"preset": args.preset}
    longest = MODEL_PRESETS.get(args.preset, {}).get("max_position_embeddings", 0)
    if args.seq > longest:
        shape["max_position_embeddings"] = args.seq
    return GalaxyConfig.from_dict({
        "model": {**shape, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                  "compile": compile_mode is not None, "compile_mode": compile_mode or "default",
                  "compile_options": compile_options, **(recompute or {})},
        "train": {"global_batch_size": args.batch, "seq_length": args.seq, "max_steps": args.warmup + args.steps,
                  "dtype": "bfloat16", "lr": 1e-4, "warmup_steps": 0, "grad_clip": 1.0, "log_every": 10**6},
        "peft": dict(LORA, quantize_base=quantize, quantize_head=head)})


def resident_mib() -> Optional[float]:
    """What the device holds now: called between steps, the weights, LoRA factors, optimizer state and caches
    (a row's ``peak_mib - resident_mib`` is what a step adds)."""
    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None


def timed_steps(step, args, tick) -> dict:
    """``times`` of the steps after the warm-up; ``resident_mib`` after the last, while the model lives."""
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        tick()
    return {"times": times, "resident_mib": resident_mib()}


PROFILED_STEPS = 3


def profiler(args):
    """With ``--profile DIR``: torch.profiler over ``PROFILED_STEPS`` steps after the warm-up (``tick`` after
    each step)."""
    if not args.profile:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=max(args.warmup - 1, 0), warmup=1, active=PROFILED_STEPS, repeat=1))


def write_profile(prof, args) -> dict:
    """The kernel table to DIR, and the profiled steps' GPU time by what it did (``bench.step_profile``:
    gemm, attention, fused, elementwise, idle ...), per step: the row's ``profile``."""
    from bench.step_profile import breakdown

    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    with open(os.path.join(args.profile, f"profile_{args.one}.txt"), "w") as f:
        f.write(f"{args.one}: {args.preset} seq {args.seq} batch {args.batch}, {PROFILED_STEPS} steps\n{table}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            figures = breakdown(json.load(f).get("traceEvents", []))
    return {k: (v / PROFILED_STEPS if k.endswith("_ms") else v) for k, v in figures.items()}


def galaxy_model(cfg: GalaxyConfig, ctx):
    """A Galaxy contender's model: its frozen base made tensor by tensor on ``ctx.device``, each tensor drawn there
    by the device's generator and stored in its format (bf16, NF4, fp8; ``build_base(init_on_device=True)``), then
    its LoRA. No fp32 copy of the model exists and the host draws nothing: an 8B drawn in fp32 by the host's
    generator (one core, about 250 M values a second) took over 30 s before its 32 GB were copied and cast."""
    from galaxy.peft import apply_tuning, build_base

    return apply_tuning(build_base(cfg, None, ctx, init_on_device=True), cfg)


def run_galaxy(args, quantize: str, compile_mode: Optional[str] = None, recompute: Optional[dict] = None,
               compile_options: Optional[dict] = None, head: bool = False) -> dict:
    """Galaxy's own training loop (``train``): step times from one step's end to the next (with the GPU's fused
    optimizer a step's loss is read once the next step's forward and backward are queued; the last warm-up step's
    and the last step's reads wait for nothing queued after them, so the timed steps' span is exact). The row's
    ``stages_s``: the seconds of each stage before the timed steps (imports, ``activation_memory: auto``'s plan,
    the model's build, the first step with its compile), each on stderr as it ends."""
    stages, last = {}, [time.perf_counter()]

    def stage_ends(name: str) -> None:
        now = time.perf_counter()
        stages[name], last[0] = now - last[0], now
        print(f"{args.one}: {name} took {stages[name]:.1f} s", file=sys.stderr)

    from bench.bench_plans import StepTimer, causal_lm_data
    from galaxy.core.context import ParallelContext
    from galaxy.loralib.quantized import frozen_bytes
    from galaxy.planner.activation import resolve_activation_memory
    from galaxy.train.loop import train
    from galaxy.train.options import Reporting

    ctx = ParallelContext.serial("cuda" if torch.cuda.is_available() else "cpu", seed=0)  # CPU: a smoke run
    stage_ends("imports")
    # as the CLIs: activation_memory auto becomes each layer's memory mode before the model is built
    cfg = resolve_activation_memory(config(args, quantize, compile_mode, recompute, compile_options, head), ctx)
    stage_ends("plan")
    model = galaxy_model(cfg, ctx)
    stage_ends("build")
    prof = profiler(args)
    resident = [None]

    def after_step():
        resident[0] = resident_mib()
        if "first step" not in stages:
            stage_ends("first step")  # the optimizer made, the layers compiled, one step
        if prof is not None:
            prof.step()

    # profiled: the queued work drains before the profiler's step, each step synchronous (as unsloth's rows)
    drain = torch.cuda.synchronize if prof is not None and torch.cuda.is_available() else None
    on_step = StepTimer(args.warmup, after_step, drain)
    reporting = Reporting(untimed_steps=args.warmup)  # the warm-up's last step ends before the timed ones begin
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    out = {}
    if prof is not None:
        with prof:
            train(model, causal_lm_data(cfg), cfg, ctx, reporting, on_step=on_step)
        out["profile"] = write_profile(prof, args)
    else:
        train(model, causal_lm_data(cfg), cfg, ctx, reporting, on_step=on_step)
    nbytes, count = frozen_bytes(model)
    return {"times": on_step.times, "resident_mib": resident[0], "frozen_bytes_per_param": nbytes / max(count, 1),
            "recompute": cfg.model.recompute, "recompute_num_layers": cfg.model.recompute_num_layers,
            "layer_memory": cfg.model.layer_memory, "mlp_chunks": cfg.model.mlp_chunks, "stages_s": stages, **out}


def run_peft(args, variant: str) -> dict:
    import peft
    import transformers

    from bench.bench_plans import hf_model

    cfg = config(args)
    if variant == "peft-bf16-liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    torch.manual_seed(0)
    if variant == "peft-qlora-bnb":
        with saved_model(args) as path:  # bitsandbytes quantizes on load
            quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                    bnb_4bit_use_double_quant=True,
                                                    bnb_4bit_compute_dtype=torch.bfloat16)
            base = transformers.LlamaForCausalLM.from_pretrained(path, quantization_config=quant,
                                                                 torch_dtype=torch.bfloat16, device_map={"": 0})
    else:
        base = hf_model("llama", _hf_config(cfg), torch.device("cuda")).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"])).cuda()
    step = hf_step(model, cfg)

    prof = profiler(args)
    if prof is None:
        return timed_steps(step, args, lambda: None)
    with prof:
        timed = timed_steps(step, args, prof.step)
    return {**timed, "profile": write_profile(prof, args)}


class Unavailable(RuntimeError):
    """A contender that cannot run here; its message is the row's ``error``."""


def versions(*names: str) -> dict:
    """The installed version of each distribution that this process would import, or None."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


@contextlib.contextmanager
def saved_model(args):
    """The preset's random LlamaForCausalLM (seed 0, bf16) with a small tokenizer in a directory, for the recipes
    that load a checkpoint (unsloth, bitsandbytes): ``--model_dir`` when the launch saved it once, else saved here."""
    if args.model_dir:
        yield args.model_dir
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_model(config(args), tmp)
        yield tmp


def save_model(cfg: GalaxyConfig, path: str) -> None:
    """The random model, drawn on the GPU where there is one (an 8B drawn on the host takes minutes), saved in bf16."""
    from bench.bench_plans import hf_model

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with device:
        base = hf_model("llama", _hf_config(cfg), device).to(torch.bfloat16)
    base.save_pretrained(path)
    del base
    _save_tokenizer(path)


def _save_tokenizer(path: str) -> None:
    """A small word-level tokenizer, enough for ``from_pretrained`` to load one (the bench feeds token ids)."""
    import tokenizers
    import transformers

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(252)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                         pad_token="<pad>").save_pretrained(path)


def run_unsloth(args, variant: str) -> dict:
    """unsloth's recipe (its README and docs): ``FastLanguageModel.from_pretrained(..., load_in_4bit=...)``,
    ``FastLanguageModel.get_peft_model(r, target_modules, lora_alpha, lora_dropout=0, bias="none",
    use_gradient_checkpointing=...)``; then the peft contenders' step (bf16 autocast, fused AdamW, clip 1.0)."""
    four_bit, checkpointing, sdpa = unsloth_variant(variant)
    if sdpa:  # unsloth then finds no xformers (ModuleNotFoundError) and runs PyTorch's SDPA
        sys.modules["xformers"] = None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is local; the GPU machine has no network
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")  # else it downloads a README to count users
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(tempfile.gettempdir(), "unsloth_compiled_cache"))
    import unsloth  # before transformers and peft: it patches them on import

    if getattr(unsloth, "_IS_CPU_BACKEND", False) or not torch.cuda.is_available():
        raise Unavailable(f"unsloth {getattr(unsloth, '__version__', '?')} found no CUDA device (it selected its CPU "
                          "backend: stock transformers + peft), so its GPU recipe cannot run here")
    from unsloth import FastLanguageModel

    cfg = config(args)
    with saved_model(args) as path:  # kept until the end: weights may be read lazily
        model, _ = FastLanguageModel.from_pretrained(
            model_name=path, max_seq_length=args.seq, dtype=torch.bfloat16, load_in_4bit=four_bit,
            use_gradient_checkpointing=checkpointing, local_files_only=True)
        model = FastLanguageModel.get_peft_model(
            model, r=16, target_modules=["q_proj", "v_proj"], lora_alpha=32, lora_dropout=0, bias="none",
            use_gradient_checkpointing=checkpointing, random_state=0, max_seq_length=args.seq)
        FastLanguageModel.for_training(model)
        step = hf_step(model, cfg)

        prof, profiled = profiler(args), {}
        if prof is None:
            timed = timed_steps(step, args, lambda: None)
        else:
            with prof:
                timed = timed_steps(step, args, prof.step)
            profiled["profile"] = write_profile(prof, args)
    try:
        from unsloth.utils.attention_dispatch import select_attention_backend

        attention = select_attention_backend()  # dense, no mask: the backend its layers ran
    except Exception as e:  # noqa: BLE001 -- a note, not the result
        attention = f"unknown ({type(e).__name__})"
    return {**timed, "attention": attention, "use_gradient_checkpointing": checkpointing,
            "checkpointing_in_effect": str(getattr(model, "_unsloth_gradient_checkpointing", "unknown")),
            "load_in_4bit": four_bit,
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "trainable_dtypes": sorted({str(p.dtype) for p in model.parameters() if p.requires_grad}),
            "versions": versions("unsloth", "unsloth_zoo", "transformers", "peft", "trl", "bitsandbytes",
                                 "xformers", "triton"), **profiled}


def _hf_config(cfg: GalaxyConfig) -> dict:
    """The HF config of ``cfg``'s model."""
    from galaxy.models.llama import LlamaForCausalLM

    return LlamaForCausalLM.hf_config(cfg.model)


def one_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:400]


NO_GPU = {"name": "cpu (no CUDA device)", "gib": None}


def card() -> dict:
    """This GPU's name and memory in GiB (``gib``: the budget of ``+auto`` contenders; ``NO_GPU`` without one). Asked
    in a child process by the launch's own process (``in_child``), which then holds no CUDA context of its own
    beside the contenders'."""
    if not torch.cuda.is_available():
        return NO_GPU
    return {"name": torch.cuda.get_device_name(0), "gib": torch.cuda.get_device_properties(0).total_memory / 2**30}


def in_child(*args: str) -> str:
    """This file run with ``args`` in a fresh process; its last line of output ("" where it printed none)."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                         check=True).stdout
    lines = out.strip().splitlines()
    return lines[-1] if lines else ""  # saving the model prints nothing


def run_one(args) -> dict:
    """One contender in this process: its row (step times, tokens/s, MFU both ways, peak memory), or its one-line
    ``error`` (an out-of-memory among them: ``--max_seq`` reads a length that fails so), or ``skipped`` where a
    package does not import."""
    name = args.one
    if args.card_gib and torch.cuda.is_available():  # the emulated card: the caching allocator refuses past it
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.card_gib * 2**30 / total)
    try:
        if unsloth_variant(name):
            out = run_unsloth(args, name)
        elif name.startswith("galaxy"):
            base, keys = galaxy_recompute(name, args.card_gib)
            out = run_galaxy(args, galaxy_base_format(base), galaxy_compile_mode(base), keys,
                             galaxy_compile_options(base), galaxy_head_on_fp8(base))
        else:
            out = run_peft(args, name)
    except ImportError as e:
        if unsloth_variant(name):  # unsloth's own imports failing is its row's reason
            return {"contender": name, "error": one_line(e)}
        return {"contender": name, "skipped": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001 -- a contender that cannot run is a row, not the end of the launch
        traceback.print_exc()  # the row keeps one line; the log keeps where it came from
        return {"contender": name, "error": one_line(e),
                "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}
    from galaxy.train.metrics import (PeakFlops, causal_flops_per_token, model_flops_per_token,
                                      peak_flops_per_device, throughput)

    # The rate is the timed span over its steps: where steps go ahead, one step's interval (from the step before's
    # end to its own) moves time between neighbours, and only their sum is the step (the median of intervals is
    # kept beside it, as every row's spread).
    times = out.pop("times")
    mean = sum(times) / len(times)
    tokens = args.batch * args.seq
    cfg = config(args)  # LoRA's FLOPs: forward and input gradients of the frozen base (any base format)
    peak = (peak_flops_per_device(torch.device("cuda", 0), "bfloat16") if torch.cuda.is_available()
            else PeakFlops(None, "no GPU"))
    rates = throughput(tokens, tokens * model_flops_per_token(cfg, args.seq), mean, 1, peak,
                       tokens * causal_flops_per_token(cfg, args.seq))
    return {"contender": name, "step_ms": mean * 1e3, "step_ms_median": statistics.median(times) * 1e3,
            "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
            "times_ms": [round(x * 1e3, 3) for x in times], "steps_per_s": 1 / mean,
            "tokens_per_s": rates["tokens_per_s"],
            "mfu": rates["mfu"], "mfu_causal": rates["mfu_causal"],
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None, **out}


CHILD_ARGS = ("preset", "seq", "batch", "steps", "warmup", "profile", "model_dir", "card_gib")


def run_child(args, name: str, **override) -> dict:
    """``name`` in a fresh process (``--one``), with ``override`` on this launch's arguments: its memory, Liger's
    patches and unsloth's imports end with it. Its stderr (a Galaxy contender's stages, each as it ends; warnings)
    is passed on line by line. A process that dies without a row (a crash, a kill) is a row whose ``error`` is its
    exit and last line."""
    values = {**{k: getattr(args, k) for k in CHILD_ARGS}, **override}
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name] + [
        f"--{k}={v}" for k, v in values.items() if v is not None]
    env = dict(os.environ)
    if unsloth_variant(name) and args.unsloth_path:
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(args.unsloth_path)] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    if args.alloc_conf:  # unsloth sets its own only where none is set: this one holds for every contender
        env["PYTORCH_ALLOC_CONF"] = args.alloc_conf
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
        tail = ""
        for line in proc.stderr:  # on to this launch's stderr as it comes: a killed launch shows how far it got
            sys.stderr.write(line)
            tail = line if line.strip() else tail
        proc.wait()
        out.seek(0)
        rows = [ln for ln in out.read().splitlines() if ln.startswith("{")]
    if rows:
        return json.loads(rows[-1])
    return {"contender": name, "error": f"exit {proc.returncode}: " + (" ".join(tail.split())[:400] or "no output")}


def search_lengths(start: int, floor: int, limit: int, fits: Callable[[int], bool]) -> tuple:
    """The search ``--max_seq`` runs for every contender: lengths doubling from ``start`` while they fit (or halving
    while they fail, down to ``floor``), then one bisection step between the last that fit and the first that
    failed. (longest that fit or None, first that failed or None when ``limit`` fit)."""
    seq = min(max(start, floor), limit)
    if fits(seq):
        while seq * 2 <= limit and fits(seq * 2):
            seq *= 2
        low, high = seq, (seq * 2 if seq * 2 <= limit else None)
    else:
        while seq // 2 >= floor and not fits(seq // 2):
            seq //= 2
        low, high = (seq // 2 if seq // 2 >= floor else None), seq
    if low is not None and high is not None and fits((low + high) // 2):
        low = (low + high) // 2
    return low, high


def longest_sequence(args, name: str) -> dict:
    """``--max_seq``: the longest sequence ``name`` trains at, a length counting when two whole training steps
    complete after the first in a fresh process (an out-of-memory, any failure, is that length's row). The same
    search for every contender: powers of two from its start (up while they fit, down while they fail), then one bisection step
    between the last that fit and the first that failed. The row: the longest length with its step time, tokens/s,
    MFU and peak, and every try."""
    tries: dict[int, dict] = {}

    def fits(seq: int) -> bool:
        if seq not in tries:
            # the first step (the compile's) is not timed: two timed steps after it
            row = run_child(args, name, seq=seq, steps=2, warmup=1, profile=None)
            tries[seq] = row
            print(json.dumps({"contender": name, "try_seq": seq, "fits": "step_ms" in row,
                              **{k: row[k] for k in ("step_ms", "peak_mib", "error") if k in row}}), flush=True)
        return "step_ms" in tries[seq]

    start = args.max_seq_start
    low, high = search_lengths(start, args.max_seq_floor, args.max_seq_limit, fits)
    failed = [n for n in tries if n > (low or 0) and "step_ms" not in tries[n]]
    row = {"contender": name, "max_seq": low, "first_failed": min(failed) if failed else None,
           "reached_limit": high is None, "start": start,
           "tries": [{"seq": n, **{k: r[k] for k in ("step_ms", "tokens_per_s", "mfu", "mfu_causal", "peak_mib",
                                                     "error") if k in r}} for n, r in sorted(tries.items())]}
    if low is not None:
        row.update({k: v for k, v in tries[low].items() if k != "contender"})
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b", choices=sorted(k for k, v in MODEL_PRESETS.items()
                                                                  if v.get("model_type") == "llama"),
                   help="a galaxy.config LLaMA preset")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None, metavar="DIR", help="write each contender's kernel table here")
    p.add_argument("--unsloth_path", default=None, metavar="DIR",
                   help="put DIR (unsloth and the packages carried for it) first on the unsloth contenders' path")
    p.add_argument("--max_seq", action="store_true",
                   help="instead of timing at --seq: each contender's longest sequence (at --batch), the same search "
                        "for all (powers of two, then one bisection step; a length counts when two whole training "
                        "steps complete, each try a process of its own)")
    p.add_argument("--max_seq_start", type=int, default=8192, help="with --max_seq: the first length tried")
    p.add_argument("--max_seq_floor", type=int, default=512, help="with --max_seq: the shortest length tried")
    p.add_argument("--max_seq_limit", type=int, default=262144, help="with --max_seq: the longest length tried")
    p.add_argument("--card_gib", type=float, default=None, metavar="G",
                   help="a card of G GiB (at most this GPU's): every contender's process caps its caching allocator "
                        "at G (torch.cuda.set_per_process_memory_fraction) and +auto plans within G; default: the "
                        "whole card")
    p.add_argument("--alloc_conf", default=None, metavar="CONF",
                   help="PYTORCH_ALLOC_CONF for every contender's process, e.g. expandable_segments:True (unsloth "
                        "sets that on import where none is set; default: each recipe its own)")
    p.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)  # the checkpoint saved once per launch
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=("save_model", "card"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return 0
    if args.child == "save_model":
        save_model(config(args), args.model_dir)
        return 0
    if args.child == "card":
        print(json.dumps(card()))
        return 0
    for name in args.contenders.split(","):
        if name.startswith("galaxy"):
            try:
                galaxy_compile_options(galaxy_recompute(name)[0])
            except ValueError as e:
                p.error(str(e))
    if args.max_seq and not 1 <= args.max_seq_floor <= args.max_seq_start <= args.max_seq_limit:
        p.error("--max_seq searches from --max_seq_start between --max_seq_floor and --max_seq_limit: give "
                "1 <= floor <= start <= limit")
    names = args.contenders.split(",")
    # asked in a child where there may be a GPU (this process then holds no CUDA context); a torch built without
    # CUDA has none to ask about
    gpu = json.loads(in_child("--child", "card")) if torch.backends.cuda.is_built() else NO_GPU
    if args.card_gib is not None and (gpu["gib"] is None or not 0 < args.card_gib <= gpu["gib"]):
        size = "no GPU here" if gpu["gib"] is None else f"{gpu['gib']:.1f} GiB"
        p.error(f"--card_gib {args.card_gib:g}: give a size in GiB above 0 and at most this GPU's ({size})")
    args.card_gib = args.card_gib or gpu["gib"]
    facts = {"device": gpu["name"], "memory_gib": args.card_gib, "torch": torch.__version__, "preset": args.preset,
             "seq": args.seq, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
             "max_seq": args.max_seq and {k: getattr(args, f"max_seq_{k}") for k in ("start", "floor", "limit")},
             "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("GALAXY_COMMIT", "unknown"),
             "versions": versions("transformers", "peft", "accelerate", "bitsandbytes", "liger_kernel", "triton"),
             "unsloth_path": args.unsloth_path, "alloc_conf": args.alloc_conf,
             "mfu": "mfu = (4*N + 12*L*H*S) * tokens / s / peak (LoRA: no weight gradients of the frozen base); "
                    "mfu_causal: 6*L*H*S (galaxy.train.metrics)"}
    print(json.dumps({"facts": facts}))  # first: a launch killed later still says what it ran
    rows = []
    with contextlib.ExitStack() as stack:
        if any(unsloth_variant(n) or n == "peft-qlora-bnb" for n in names):  # their checkpoint, saved once
            args.model_dir = stack.enter_context(tempfile.TemporaryDirectory())
            longest = max(args.seq, args.max_seq_limit if args.max_seq else 0)
            in_child("--child", "save_model", f"--model_dir={args.model_dir}", f"--preset={args.preset}",
                     f"--seq={longest}")
        for name in names:
            row = longest_sequence(args, name) if args.max_seq else run_child(args, name)
            rows.append(row)
            print(json.dumps(row))
    by = "max_seq" if args.max_seq else "steps_per_s"
    summary = best_per_family(rows, by)
    print(f"\n{'contender':<28} {'max seq':>8} {'step ms':>9} {'steps/s':>8} {'MFU':>6} {'causal':>6} "
          f"{'peak MiB':>9}")
    for r in rows:
        if "step_ms" in r:
            peak = f"{r['peak_mib']:9.0f}" if r["peak_mib"] is not None else f"{'-':>9}"
            mfu = " ".join(f"{r[k]:6.1%}" if r.get(k) is not None else f"{'-':>6}" for k in ("mfu", "mfu_causal"))
            print(f"{r['contender']:<28} {r.get('max_seq', args.seq):>8} {r['step_ms']:9.1f} {r['steps_per_s']:8.2f} "
                  f"{mfu} {peak}")
        else:
            print(f"{r['contender']:<28} {(r.get('error') or r.get('skipped') or '')[-200:]}")
    for family, best in summary.items():
        peak = f", {best['peak_ratio']:.3f}x its peak" if best["peak_ratio"] else ""
        figure = "the longest context of the longest other" if args.max_seq else "the steps/s of the fastest other"
        print(f"{family}: {best['galaxy']} {best[by + '_ratio']:.3f}x {figure}, {best['anchor']}{peak}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"facts": facts, "rows": rows, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    line_buffered_output()
    exit_without_finalizing(main() or 0)
