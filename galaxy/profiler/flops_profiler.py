"""A FLOPs profiler with DeepSpeed's API that counts at the aten dispatch level.

DeepSpeed's profiler patches ``torch.nn.functional``, counts only the forward and assumes the
backward costs 2x. Here every aten op that actually runs inside a profiling window goes through
a ``TorchDispatchMode`` and is priced with torch's own formula registry
(``torch.utils.flop_counter``), so totals equal ``FlopCounterMode`` on the same run, the backward
is measured (frozen weights cost no weight-gradient FLOPs because those matmuls never run), and
fused attention, ``@`` and einsum are seen as the kernels they become.

Window semantics (DeepSpeed-compatible):

* ``start_profile()`` opens a window: all counts, latencies, uncounted-op lists and the attached
  ``CommLog`` are zeroed, then module hooks and the dispatch mode are installed. Opening a window
  while one is open restarts it.
* ``stop_profile()`` closes the window: hooks and mode are removed, the numbers of that window stay
  readable (``get_total_flops``, ``print_model_profile``, ``to_json``) until the next
  ``start_profile``/``reset_profile``/``end_profile``. Counts never carry over between windows.
* ``reset_profile()`` zeroes the numbers without opening or closing anything.
* ``end_profile()`` closes the window and drops the numbers.

A window should cover whole forward+backward passes: ops outside it are not seen. The dispatch
mode is pushed on the calling thread's mode stack (autograd carries it to its worker threads),
so call start/stop on the same thread, properly nested with any other dispatch mode.

Module attribution: forward ops go to the modules whose forward is running (and their
ancestors); backward ops go to the modules that created the autograd node being executed
(see ``_tag_graph``).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .comm import CommLog
from .devices import dtype_key, lookup_peak_tflops
from .formulas import ATTENTION_OPS, extra_flop_formulas, is_causal_attention, is_zero_flop_op
from .report import (
    duration_to_string,
    format_report,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["FlopsProfiler", "RunInfo", "get_model_profile"]

logger = logging.getLogger(__name__)

GLOBAL = "__global__"  # key for everything counted in the window, inside the model or not
PHASES = ("fwd", "bwd")

_aten = torch.ops.aten
# Metadata queries that FlopCounterMode declines to handle (returns NotImplemented); mirrored so
# subclass tensors behave the same under both counters.
_METADATA_OPS = frozenset(
    op
    for op in (
        getattr(_aten, "sym_is_contiguous", None) and _aten.sym_is_contiguous.default,
        _aten.is_contiguous.default,
        _aten.is_contiguous.memory_format,
        _aten.is_strides_like_format.default,
        _aten.is_non_overlapping_and_dense.default,
        _aten.size.default,
        _aten.sym_size.default,
        _aten.stride.default,
        _aten.sym_stride.default,
        _aten.storage_offset.default,
        _aten.sym_storage_offset.default,
        _aten.numel.default,
        _aten.sym_numel.default,
        _aten.dim.default,
        torch.ops.prim.layout.default,
    )
    if op
)


_EMPTY: frozenset = frozenset()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _current_autograd_node() -> Any:
    # The autograd node whose backward is executing on this thread (None outside of one).
    fn = getattr(torch._C, "_current_autograd_node", None)
    return fn() if fn is not None else None


def _shape_wrapper(fn: Callable[..., int]) -> Callable[..., int]:
    """Let a user formula take shapes instead of tensors, as torch's registry does."""

    def wrapped(*args, out_val=None, **kwargs):
        def shape(x):
            return x.shape if isinstance(x, torch.Tensor) else x

        args, kwargs, out_shape = torch.utils._pytree.tree_map(shape, (args, kwargs, out_val))
        return fn(*args, out_shape=out_shape, **kwargs)

    return wrapped


def _grad_tensors(tree: Any) -> list[torch.Tensor]:
    """Tensors that require grad anywhere in nested tuples/lists/dicts (HF ModelOutput included)."""
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                found.append(obj)
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        else:
            leaves, _ = tree_flatten(obj)  # other registered pytrees
            if len(leaves) != 1 or leaves[0] is not obj:
                stack.extend(leaves)
    return found


class _CountingMode(TorchDispatchMode):
    """Sees every aten op; decomposes ops that have no formula (like FlopCounterMode)."""

    def __init__(self, registry: Mapping[Any, Any], on_op: Callable[..., None]) -> None:
        super().__init__()
        self._registry = registry
        self._on_op = on_op
        self._decomposable: dict[Any, bool] = {}  # op -> whether decompose() can do anything

    def _can_decompose(self, func: Any) -> bool:
        # The test OpOverload.decompose() makes before returning NotImplemented; asked once per op
        # so that ops without a decomposition (nearly all) skip re-entering the mode.
        can = self._decomposable.get(func)
        if can is None:
            key = torch._C.DispatchKey.CompositeImplicitAutograd
            can = key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
            self._decomposable[func] = can
        return can

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs if kwargs else {}
        if func in _METADATA_OPS:
            return NotImplemented
        # Same test as FlopCounterMode (an OpOverload looked up among packets) so both counters
        # take the same decomposition path and their totals agree exactly.
        if (func not in self._registry and func is not torch.ops.prim.device.default
                and self._can_decompose(func)):
            with self:
                r = func.decompose(*args, **kwargs)
                if r is not NotImplemented:
                    return r
        out = func(*args, **kwargs)
        self._on_op(func, out, args, kwargs)
        return out


class _NoOpMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _warm_dispatch_modes() -> None:
    """Pay torch's one-time cost of the first op under a Python dispatch mode (it imports
    ``torch._dynamo``, about 2 s) outside the window, so it is not booked as the latency of the
    first module profiled in a process. A no-op after the first call."""
    if "torch._dynamo" not in sys.modules:
        with _NoOpMode():
            torch.empty(0)


@dataclass
class RunInfo:
    """Context of the run, reported next to the numbers (the profiler does not infer it)."""

    world_size: int = 1
    rank: int = 0
    plan: dict[str, str] = field(default_factory=dict)
    batch: Optional[int] = None
    seq_len: Optional[int] = None
    global_params: Optional[int] = None  # params of the whole model over all ranks


class FlopsProfiler:
    """Measures FLOPs (forward and backward), latency and parameters of ``model``'s module tree.

    Args:
        model: the module to profile. Ops are attributed to the module whose forward (or whose
            backward) is running; ops outside all of its modules still count in the totals.
        recompute_fwd_factor: accepted for DeepSpeed signature compatibility and ignored:
            recomputation is measured, not assumed.
        causal_halving: count half of the attention FLOPs for fused attention kernels called
            with a causal mask (they skip the masked half). Off by default so totals equal
            ``FlopCounterMode``. The math backend really computes the full score matrix and is
            never halved.
        custom_formulas: extra ``{op packet: formula}``; formulas take shapes unless marked
            ``fn._get_raw = True`` (the ``FlopCounterMode(custom_mapping=...)`` convention).
            They override built-in ones.
        comm_log: a ``CommLog`` that the core feeds; reset and enabled with each window.
        peak_tflops: peak dense TFLOP/s per rank for MFU; looked up from the device name on
            CUDA when not given, None on CPU.
        dtype: compute dtype for the peak lookup (default: the model's dominant parameter dtype).
        sync_latency: synchronise the accelerator around each module's forward for honest
            latencies (costs some overlap, as in DeepSpeed).
        run_info: world size, rank, plan, batch, seq_len, global params; see ``set_run_info``.
    """

    def __init__(
        self,
        model: nn.Module,
        recompute_fwd_factor: Optional[float] = None,
        *,
        causal_halving: bool = False,
        custom_formulas: Optional[Mapping[Any, Callable[..., int]]] = None,
        comm_log: Optional[CommLog] = None,
        peak_tflops: Optional[float] = None,
        dtype: Optional[torch.dtype] = None,
        sync_latency: bool = True,
        **run_info: Any,
    ) -> None:
        if recompute_fwd_factor:
            logger.debug("recompute_fwd_factor=%s ignored: recomputation is measured", recompute_fwd_factor)
        self.model = model
        self.causal_halving = causal_halving
        self.comm_log = comm_log
        self.peak_tflops = peak_tflops
        self.dtype = dtype
        self.sync_latency = sync_latency
        self.run_info = RunInfo()
        self.set_run_info(**run_info)

        from torch.utils.flop_counter import flop_registry

        # Torch's formulas, ours for its gaps (and one layout fix), the user's over both.
        self._registry: dict[Any, Callable[..., int]] = {**flop_registry, **extra_flop_formulas(flop_registry)}
        for op, fn in (custom_formulas or {}).items():
            self._registry[op] = fn if getattr(fn, "_get_raw", False) else _shape_wrapper(fn)

        self.started = False
        self._mode: Optional[_CountingMode] = None
        self._handles: list[Any] = []
        self._ignored_names: frozenset[str] = frozenset()
        self._op_is_zero: dict[Any, bool] = {}  # per-instance cache of op classification
        self._op_names: dict[Any, str] = {}  # op packet -> its name (str() is slow on the hot path)
        self._failed_formulas: set[str] = set()
        self._tag_key = f"galaxy.profiler.{id(self)}"  # node metadata key, unique per profiler
        self._index_modules()
        self._clear_counts()

    # ------------------------------------------------------------------ configuration

    def set_run_info(self, **info: Any) -> None:
        """Set any of ``world_size, rank, plan, batch, seq_len, global_params``."""
        for key, value in info.items():
            if not hasattr(self.run_info, key):
                raise TypeError(f"unknown run info {key!r}; expected one of {list(vars(RunInfo()))}")
            if key == "plan":
                value = {str(k): str(v) for k, v in (value or {}).items()}
            setattr(self.run_info, key, value)

    # ------------------------------------------------------------------ window control

    def start_profile(self, ignore_list: Optional[Iterable[type]] = None) -> None:
        """Open a window (zeroing all numbers). Ops inside modules of ``ignore_list`` types are skipped."""
        if self.started:
            logger.info("start_profile() while a window is open: restarting the window")
            self._remove_hooks()
        self._clear_counts()
        self._index_modules()
        ignore = tuple(ignore_list or ())
        self._ignored_names = frozenset(n for m, n in self._names.items() if ignore and isinstance(m, ignore))
        self._device = self._model_device()
        self._do_sync = self.sync_latency and self._device.type not in ("cpu", "meta")
        for module in self._names:
            self._handles.append(module.register_forward_pre_hook(self._fwd_pre_hook, with_kwargs=True))
            self._handles.append(
                module.register_forward_hook(self._fwd_post_hook, with_kwargs=True, always_call=True)
            )
        if self.comm_log is not None:
            self.comm_log.reset()
            self.comm_log.enabled = True
        _warm_dispatch_modes()
        self._mode = _CountingMode(self._registry, self._on_op)
        self._mode.__enter__()
        self._sync()
        self._window_start = time.perf_counter()
        self.started = True
        logger.info("Flops profiler started")

    def __enter__(self) -> "FlopsProfiler":
        """``with profiler:`` opens a window and closes it on the way out, an exception's way included (an open
        window keeps its dispatch mode entered: every later op of the process would be counted, and dynamo
        runs compiled code eagerly under it)."""
        self.start_profile()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_profile()

    def stop_profile(self) -> None:
        """Close the window; its numbers stay readable."""
        if not self.started:
            return
        self._sync()
        self._window_seconds = time.perf_counter() - self._window_start
        self._window_start = None
        self._remove_hooks()
        if self.comm_log is not None:
            self.comm_log.enabled = False
        self.started = False

    def reset_profile(self) -> None:
        """Zero all numbers; an open window stays open and restarts its clock."""
        self._clear_counts()
        if self.started:
            self._window_start = time.perf_counter()
        if self.comm_log is not None:
            self.comm_log.reset()

    def end_profile(self) -> None:
        """Close the window and drop its numbers."""
        self.stop_profile()
        self._clear_counts()
        logger.info("Flops profiler finished")

    # ------------------------------------------------------------------ DeepSpeed-style getters

    def get_total_flops(self, as_string: bool = False, phase: str = "all") -> int | str:
        """FLOPs measured in the window: ``phase`` is "fwd", "bwd" or "all" (default).

        Unlike DeepSpeed (forward only), "all" includes the backward if it ran in the window.
        """
        flops = self._phase_total(self._flops[GLOBAL], phase)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False, phase: str = "all") -> int | str:
        """Multiply-accumulates (FLOPs / 2 per op) measured in the window."""
        macs = self._phase_total(self._flops[GLOBAL], phase, macs=True)
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters stored on this rank (trainable or not), as DeepSpeed reports."""
        params = sum(p.numel() for p in self.model.parameters())
        return params_to_string(params) if as_string else params

    def get_trainable_params(self, as_string: bool = False) -> int | str:
        params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward latency of the model: the sum of its forward calls in the window."""
        duration = self._latency("", self._children_index())
        return duration_to_string(duration) if as_string else duration

    def get_window_duration(self) -> float:
        """Wall time of the window (up to now if it is still open)."""
        if self._window_start is not None:
            return time.perf_counter() - self._window_start
        return self._window_seconds

    def get_uncounted_ops(self) -> dict[str, int]:
        """Compute ops that ran without a FLOP formula: name -> calls."""
        return dict(self._uncounted)

    def get_flops_by_module(self, phase: str = "all", exclusive: bool = False) -> dict[str, int]:
        """FLOPs per module (fully qualified name, "" is the model itself).

        Inclusive by default: a module's count holds its children's. ``exclusive=True`` gives the
        FLOPs of ops a module runs itself (functional ops in its ``forward``, and their backward):
        its inclusive count minus its children's. Exclusive counts add up to the root's inclusive
        count as long as modules only call their own descendants (true of every Galaxy model).
        """
        inclusive = {name: self._module_flops(name, phase) for name in self._names.values()}
        if not exclusive:
            return inclusive
        children = self._children_index()
        return {name: flops - sum(inclusive[c] for c in children.get(name, ())) for name, flops in inclusive.items()}

    def current_scope(self) -> frozenset:
        """Names of the modules an op issued right now would be booked to (with their ancestors).

        In the forward (or a recompute under backward) that is the modules whose forward is
        running; in the backward, the modules that created the autograd node being executed.
        Empty outside a window or outside the model. Observers of other events (the core's
        collectives) use it to attribute what they see to modules.
        """
        if not self.started:
            return _EMPTY
        if _in_backward() and not self._parents:
            node = _current_autograd_node()
            return node.metadata.get(self._tag_key, _EMPTY) if node is not None else _EMPTY
        return self._scope()

    # ------------------------------------------------------------------ reports

    def to_json(self) -> dict[str, Any]:
        """All numbers of the window as plain Python types."""
        children = self._children_index()
        g = self._flops[GLOBAL]
        fwd, bwd = self._phase_total(g, "fwd"), self._phase_total(g, "bwd")
        total = fwd + bwd
        model_total = self._module_flops("", "all")
        fwd_latency = self._latency("", children)
        window = self.get_window_duration()
        peak = self._peak_tflops()
        achieved = total / window / 1e12 if window > 0 else None
        run = self.run_info
        local_params = self.get_total_params()
        modules = []
        counts = self._params_by_module()
        for module, name in self._names.items():
            mf = self._module_flops(name, "fwd")
            mb = self._module_flops(name, "bwd")
            lat = self._latency(name, children)
            modules.append({
                "name": name,
                "class": type(module).__name__,
                "depth": 0 if not name else name.count(".") + 1,
                "params": counts[name][0],
                "trainable_params": counts[name][1],
                "fwd_flops": mf,
                "bwd_flops": mb,
                "fwd_macs": self._module_flops(name, "fwd", macs=True),
                "bwd_macs": self._module_flops(name, "bwd", macs=True),
                "fwd_share": mf / fwd if fwd else 0.0,
                "bwd_share": mb / bwd if bwd else 0.0,
                "fwd_latency_s": lat,
                "fwd_calls": self._fwd_calls.get(name, 0),
                "fwd_tflops": mf / lat / 1e12 if lat > 0 else None,
            })
        comm = None
        if self.comm_log is not None:
            comm = {
                "steps": self.comm_log.steps,
                "rows": self.comm_log.summary(),
                "bytes_per_step_by_op": self.comm_log.bytes_per_step_by_op(),
            }
        return {
            "model": type(self.model).__name__,
            "run": {
                "world_size": run.world_size,
                "rank": run.rank,
                "plan": dict(run.plan),
                "batch": run.batch,
                "seq_len": run.seq_len,
                "device": str(self._device),
                "device_name": self._device_name(),
                "dtype": self._dtype_key(),
            },
            "params": {
                "local": local_params,
                "total": local_params,
                "trainable": self.get_trainable_params(),
                "global": run.global_params if run.global_params is not None
                else (local_params if run.world_size == 1 else None),
            },
            "flops": {"fwd": fwd, "bwd": bwd, "total": total, "outside_model": total - model_total},
            "macs": {
                "fwd": self._phase_total(g, "fwd", macs=True),
                "bwd": self._phase_total(g, "bwd", macs=True),
                "total": self._phase_total(g, "all", macs=True),
            },
            "flops_by_op": {ph: dict(g[ph]) for ph in PHASES},
            "latency_s": {"fwd": fwd_latency, "window": window},
            "tflops": {
                "fwd": fwd / fwd_latency / 1e12 if fwd_latency > 0 else None,
                "achieved": achieved,
            },
            "peak_tflops": peak,
            "mfu": achieved / peak if (achieved is not None and peak) else None,
            "causal_halving": self.causal_halving,
            "uncounted_ops": dict(self._uncounted),
            "zero_flop_ops": dict(self._zero_ops),
            "modules": modules,
            "comm": comm,
        }

    def format_profile(
        self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1, detailed: bool = True
    ) -> str:
        """The DeepSpeed-style report as a string (for CLIs that print)."""
        return format_report(self.to_json(), profile_step, module_depth, top_modules, detailed)

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: Optional[str] = None,
    ) -> None:
        """Write the report to ``output_file``, or to this module's logger at INFO level."""
        text = self.format_profile(profile_step, module_depth, top_modules, detailed)
        if output_file:
            os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            logger.info("%s", text)

    # ------------------------------------------------------------------ hooks
    # Forward ops are attributed to the modules whose forward is running. Backward ops are
    # attributed through the autograd node that runs them: each node created in a module's
    # forward is tagged with that module set, and the backward asks which node is executing.
    # This is exact even when several modules consume the same tensor (q/k/v projections),
    # where ModuleTracker-style "all input grads are ready" hooks smear one module's weight
    # gradients into its siblings.

    def _fwd_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        name = self._names[module]
        # Untagged graph behind the inputs was built by whoever runs now (the caller's scope;
        # empty for the model's own inputs), not by this module: tag it before the module runs.
        self._tag_graph(_grad_tensors((args, kwargs)), self._scope())
        self._parents.append(name)
        if not _in_backward():  # a re-run forward under backward (recompute) is not fwd latency
            self._sync()
            self._starts[name].append(time.perf_counter())

    def _fwd_post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = self._names[module]
        # Everything new behind the outputs was built inside this module (children tagged theirs).
        self._tag_graph(_grad_tensors(output), self._scope())
        if name in self._parents:
            # remove the innermost occurrence (a module may be re-entered)
            del self._parents[len(self._parents) - 1 - self._parents[::-1].index(name)]
        if not _in_backward() and self._starts[name]:
            self._sync()
            self._fwd_time[name] += time.perf_counter() - self._starts[name].pop()
            self._fwd_calls[name] += 1

    def _scope(self) -> frozenset:
        """The running modules plus their ancestors in the module tree (ModuleList included)."""
        key = tuple(self._parents)
        scope = self._scope_cache.get(key)
        if scope is None:
            names = set()
            for name in key:
                names.update(self._ancestors[name])
            scope = self._scope_cache[key] = frozenset(names)
        return scope

    def _tag_graph(self, tensors: list[torch.Tensor], scope: frozenset) -> None:
        """Tag the not-yet-tagged autograd nodes behind ``tensors`` with ``scope``."""
        stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
        key = self._tag_key
        while stack:
            node = stack.pop()
            if node is None:
                continue
            meta = node.metadata
            if key in meta:
                continue
            meta[key] = scope
            stack.extend(n for n, _ in node.next_functions)

    # ------------------------------------------------------------------ counting

    def _on_op(self, func: Any, out: Any, args: tuple, kwargs: dict) -> None:
        packet = func._overloadpacket
        formula = self._registry.get(packet)
        if formula is None and not self._ignored_names:
            self._count_unpriced(func, packet)  # most ops: no FLOPs, no module lookup needed
            return
        in_bwd = _in_backward()
        if in_bwd and not self._parents:
            node = _current_autograd_node()
            scope = node.metadata.get(self._tag_key, _EMPTY) if node is not None else _EMPTY
        else:
            # Forward, or a forward re-run under backward (activation recompute): the modules
            # whose forward hooks are active own the op. (Inlined ``current_scope``: hot path.)
            scope = self._scope()
        if self._ignored_names and not self._ignored_names.isdisjoint(scope):
            return
        if formula is None:
            self._count_unpriced(func, packet)
            return
        name = self._op_name(packet)
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception as exc:  # a formula that rejects these shapes must not break training
            if name not in self._failed_formulas:
                logger.warning("FLOP formula for %s failed (%s); listed as uncounted", name, exc)
                self._failed_formulas.add(name)
            self._uncounted[f"{name} (formula failed)"] += 1
            return
        if self.causal_halving and packet in ATTENTION_OPS and is_causal_attention(func, args, kwargs):
            flops //= 2
        phase = "bwd" if in_bwd else "fwd"
        self._flops[GLOBAL][phase][name] += flops
        for module_name in scope:
            self._flops[module_name][phase][name] += flops

    def _op_name(self, packet: Any) -> str:
        name = self._op_names.get(packet)
        if name is None:
            name = self._op_names[packet] = str(packet)
        return name

    def _count_unpriced(self, func: Any, packet: Any) -> None:
        """An op without a formula: 0 FLOPs by convention, or listed as uncounted."""
        zero = self._op_is_zero.get(func)
        if zero is None:
            zero = self._op_is_zero[func] = is_zero_flop_op(func)
        (self._zero_ops if zero else self._uncounted)[self._op_name(packet)] += 1

    # ------------------------------------------------------------------ internals

    def _clear_counts(self) -> None:
        self._flops: defaultdict[str, dict[str, Counter]] = defaultdict(lambda: {p: Counter() for p in PHASES})
        self._uncounted: Counter = Counter()
        self._zero_ops: Counter = Counter()
        self._fwd_time: defaultdict[str, float] = defaultdict(float)
        self._fwd_calls: defaultdict[str, int] = defaultdict(int)
        self._starts: defaultdict[str, list[float]] = defaultdict(list)
        self._parents: list[str] = []  # forward call stack of module names
        self._scope_cache: dict[tuple, frozenset] = {}
        self._window_start: Optional[float] = None
        self._window_seconds = 0.0
        if not hasattr(self, "_device"):
            self._device = self._model_device()

    def _remove_hooks(self) -> None:
        if self._mode is not None:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is not self._mode:
                raise RuntimeError(
                    "stop_profile(): another dispatch mode was entered after start_profile() and is "
                    "still active; close it first (modes must nest)"
                )
            self._mode.__exit__(None, None, None)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._parents.clear()

    @staticmethod
    def _phase_total(counts: dict[str, Counter], phase: str, macs: bool = False) -> int:
        if phase not in ("all",) + PHASES:
            raise ValueError(f"phase must be 'fwd', 'bwd' or 'all', got {phase!r}")
        phases = PHASES if phase == "all" else (phase,)
        return sum((v // 2 if macs else v) for ph in phases for v in counts[ph].values())

    def _children_index(self) -> dict[str, list[str]]:
        children: dict[str, list[str]] = defaultdict(list)
        for module, name in self._names.items():
            for attr, child in module.named_children():
                full = f"{name}.{attr}" if name else attr
                if self._names.get(child) == full:  # a shared module is listed under its first name only
                    children[name].append(full)
        return children

    def _params_by_module(self) -> dict[str, list[int]]:
        """name -> [params, trainable params] of each module's subtree (each tensor once per
        subtree, as ``module.parameters()`` counts), in one pass over the model's parameters."""
        counts = {name: [0, 0] for name in self._names.values()}
        owners: dict[int, tuple[torch.Tensor, set[str]]] = {}
        for pname, p in self.model.named_parameters(remove_duplicate=False):
            parent = pname.rsplit(".", 1)[0] if "." in pname else ""
            if parent not in self._ancestors:  # below a module that is listed under another name
                parent = next((m for m in sorted(self._ancestors, key=len, reverse=True)
                               if parent.startswith(m + ".")), "")
            owners.setdefault(id(p), (p, set()))[1].update(self._ancestors[parent])
        for p, names in owners.values():
            for name in names:
                counts[name][0] += p.numel()
                if p.requires_grad:
                    counts[name][1] += p.numel()
        return counts

    def _module_flops(self, name: str, phase: str, macs: bool = False) -> int:
        # Inclusive: every op is booked on its module and all of that module's ancestors.
        return self._phase_total(self._flops[name], phase, macs) if name in self._flops else 0

    def _index_modules(self) -> None:
        self._names = {m: name for name, m in self.model.named_modules()}
        self._ancestors: dict[str, tuple[str, ...]] = {}
        for name in self._names.values():
            parts = name.split(".") if name else []
            self._ancestors[name] = ("",) + tuple(".".join(parts[: i + 1]) for i in range(len(parts)))

    def _latency(self, name: str, children: dict[str, list[str]]) -> float:
        if name in self._fwd_time:
            return self._fwd_time[name]
        return sum(self._latency(c, children) for c in children.get(name, ()))

    def _model_device(self) -> torch.device:
        first = next(itertools.chain(self.model.parameters(), self.model.buffers()), None)
        return first.device if first is not None else torch.device("cpu")

    def _sync(self) -> None:
        if getattr(self, "_do_sync", False):
            backend = getattr(torch, self._device.type, None)
            if backend is not None and hasattr(backend, "synchronize"):
                backend.synchronize()

    def _dtype_key(self) -> str:
        if self.dtype is not None:
            return dtype_key(self.dtype)
        sizes: Counter = Counter()
        for p in self.model.parameters():
            if p.is_floating_point():
                sizes[p.dtype] += p.numel()
        return dtype_key(sizes.most_common(1)[0][0] if sizes else torch.float32)

    def _device_name(self) -> Optional[str]:
        if self._device.type == "cuda" and torch.cuda.is_available():
            return torch.cuda.get_device_name(self._device)
        return None

    def _peak_tflops(self) -> Optional[float]:
        if self.peak_tflops is not None:
            return float(self.peak_tflops)
        name = self._device_name()
        return lookup_peak_tflops(name, self._dtype_key()) if name else None


def _backward_target(output: Any) -> torch.Tensor:
    """A scalar to call backward on: the output's ``loss`` if it has one, else a sum."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError("backward=True needs a model output (or .loss) that requires grad")
    return tensors[0].float().sum()


def get_model_profile(
    model: nn.Module,
    input_shape: Optional[tuple] = None,
    args: Sequence[Any] = [],  # noqa: B006 - DeepSpeed's signature; never mutated
    kwargs: Mapping[str, Any] = {},  # noqa: B006
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: Optional[str] = None,
    ignore_modules: Optional[Iterable[type]] = None,
    backward: bool = False,
    mode: str = "forward",
    **profiler_kwargs: Any,
) -> tuple[Any, Any, Any]:
    """One-shot profile, like DeepSpeed's: returns ``(flops, macs, params)``.

    Runs ``warm_up`` unprofiled passes, then one profiled pass. ``backward=True`` also runs the
    backward of the output's ``loss`` (or of the first output that requires grad) inside the
    window, so flops/macs include it; gradients are cleared afterwards. As in DeepSpeed the model
    is put in eval mode (its previous mode is restored) unless ``backward`` is set.
    ``profiler_kwargs`` go to ``FlopsProfiler`` (e.g. ``causal_halving``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError("model must be a torch.nn.Module")
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    args = list(args)
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError("input_shape must be a non-empty tuple")
        first = next(model.parameters(), None)
        like = {} if first is None else {"dtype": first.dtype, "device": first.device}
        args = [torch.ones(input_shape, **like)]
    if not args and not kwargs:
        raise ValueError("args and/or kwargs must be specified if input_shape is None")

    was_training = model.training
    if not backward:
        model.eval()
    call = model.generate if mode == "generate" else model

    def run_once() -> None:
        output = call(*args, **kwargs)
        if backward:
            _backward_target(output).backward()
            model.zero_grad(set_to_none=True)

    prof = FlopsProfiler(model, **profiler_kwargs)
    try:
        logger.info("Flops profiler warming up (%d passes)", warm_up)
        for _ in range(warm_up):
            run_once()
        prof.start_profile(ignore_list=ignore_modules)
        run_once()
        prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(
                profile_step=warm_up,
                module_depth=module_depth,
                top_modules=top_modules,
                detailed=detailed,
                output_file=output_file,
            )
    finally:
        prof.end_profile()
        model.train(was_training)
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
