"""``compile: true``: each transformer layer computes through ``torch.compile`` (per layer,
``dynamic=False``, as torchtitan compiles each block).

What is traced: the layer's ``compute``, with the transitions at its plain block edges (their
collectives are torch's functional ones, ``galaxy.core.comm``) and the parallel linears, so a
layer of any plan, even or uneven splits, is one graph forward and one backward. ``parallelize``
(``galaxy.core.parallelize``) sets it in the layer's place, under the layer's memory mode. Over a frozen
base kept quantized (QLoRA's NF4, int8) each linear's dequantization (the format's torch reference,
which inductor fuses) and matmul are in the graph too, the dequantization a checkpointed region, so
the compiled backward recomputes the weight instead of keeping it (``galaxy.loralib.quantized_linear``).

What runs eagerly instead, by rule:
* a call while any dropout of the layer is active (training with ``hidden_dropout_prob``,
  ``attention_probs_dropout_prob`` or ``lora_dropout`` > 0): Galaxy's dropouts draw from explicit
  per-layer ``torch.Generator`` streams (``layers.drawing_from``), which a compiled graph does not
  honour (inductor draws its own random numbers). Evaluation of such a model is compiled.
* a call with a KV cache (generation): its sequence grows every step, a new shape each time.
* the fused calls of the overlapped edges (CoC, async TP, CCLoRA: ``galaxy.core.overlap``): they schedule
  their own async collectives, so they run eagerly between the compiled parts of the layer.
* FSDP's hooks (``mp_grad_reduce: fsdp``, whose units are modules inside a layer, the SP MLP): torch
  marks them not to be traced, so the layer compiles as a graph per stretch between them, the gathers and
  the reduce-scatters' registration eager in between (``dp_engine: fsdp2`` alone shards whole layers,
  whose hooks run outside the compiled ``compute``).
* Triton kernels (``kernels``) are not called inside a graph: there the torch references are traced
  and inductor generates the fused kernels; outside the layers (the head and its loss) the kernels
  run as configured.
``compile_backend`` is torch.compile's backend (inductor unless set; ``aot_eager_decomp_partition`` traces each
layer with inductor's decompositions, partitions it with inductor's min-cut partitioner, then runs its ops eagerly,
no kernel built: the tests that check which tensors a compiled layer saves, or how it meets hooks, use it).
``compile_mode`` is torch.compile's mode for every layer, ``compile_options`` inductor options over the mode's
(e.g. ``{"triton.multi_kernel": 1}``). ``reduce-overhead`` replays each layer's forward
and backward kernels as CUDA graphs (inductor's CUDA graph trees; the Trainer marks each step's start,
``step_begins``), for steps whose GPU waits on the host launching kernels; on a CPU it compiles as the default.
A communication observer (the profiler's per-collective timing) cannot time a traced collective,
so a compiled layer refuses to run while one is attached; ``bytes_sent`` counts either way. Under a
dispatch mode (the FLOP profiler) dynamo itself runs the layer eagerly, so FLOPs are counted from
the eager ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from galaxy.config import ConfigError
from galaxy.core.comm import Communicator
from galaxy.core.layers import Dropout


def step_begins(model_cfg) -> None:
    """A training step starts: under CUDA graphs, the previous step's graph outputs may be overwritten."""
    if model_cfg.captures_cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()


def compile_kwargs(mode: str, options: Optional[dict]) -> dict:
    """torch.compile's ``mode`` or, with inductor ``options``, the mode's own options beneath them (torch
    takes one of the two, not both)."""
    if not options:
        return {"mode": None if mode == "default" else mode}
    from torch._inductor import list_mode_options

    if options.get("triton.multi_kernel") and "fx_graph_cache" not in options:
        # A multi-kernel graph loaded from inductor's FX graph cache fails to build (torch 2.11 + triton 3.6:
        # MultiKernelCall hashes a reloaded Triton function whose lock is None, "'NoneType' object does not
        # support the context manager protocol"); a second layer graph in one process is such a load (a few
        # layers recomputed, the rest not), so multi-kernel graphs are compiled, never loaded.
        options = {**options, "fx_graph_cache": False}
    return {"options": {**list_mode_options(mode, dynamic=False), **options}}


def draws_random(module: nn.Module) -> bool:
    """Whether a call of ``module`` now would draw dropout masks."""
    return any(isinstance(m, Dropout) and m.active for m in module.modules())


class CompiledLayer:
    """``layer.compute`` compiled, called in its place; a call while the layer's dropout is active
    runs the eager ``compute`` (see the module docstring)."""

    def __init__(self, layer: nn.Module, comm: Communicator, mode: str = "default", options: Optional[dict] = None,
                 backend: str = "inductor"):
        self.layer, self.comm = layer, comm  # the layer is not a submodule: this is no nn.Module
        self.compiled = torch.compile(layer.compute, dynamic=False, backend=backend, **compile_kwargs(mode, options))

    def __call__(self, *args):
        if self.comm.observers:
            raise ConfigError(f"config key 'compile' is true, but a communication profiler observes group "
                              f"'{self.comm.name}': it times each collective, which a compiled layer cannot "
                              "do; profile with compile: false")
        return self.layer.compute(*args) if draws_random(self.layer) else self.compiled(*args)
