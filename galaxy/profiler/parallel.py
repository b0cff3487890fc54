"""Parallel awareness: one step of a Galaxy model profiled on every rank of its model-parallel group.

``ParallelProfiler`` wraps a ``FlopsProfiler`` and a ``CommLog`` and adds what only a parallel
run has:

* **Per-rank and summed numbers.** Each rank measures its own FLOPs (forward and backward) and
  parameters; ``stop_profile()`` all-gathers the per-rank summaries over the mp group, so every
  rank can report the table and the sums.
* **Local and global parameters.** Local: what this rank holds. Global: the full model, each
  tensor counted once at its full shape (``galaxy.core.layers.shard_spec`` gives the full shape
  of a TP shard). The sum of the local counts over ranks is ``global + (N - 1) x`` the
  parameters every rank holds whole (replicated or seq-partial weights).
* **Replicated compute**: the FLOPs several ranks repeat. See ``replicated_module_map`` for the
  rule. With ``R_i`` the replicated FLOPs of rank i, the work done more than once over the group
  is ``redundant = sum(R_i) - max(R_i)`` (= ``(N - 1) x R`` since replicated work is the same on
  every rank), so ``sum over ranks of FLOPs == serial FLOPs + redundant``.
* **Communication.** Every collective the core's ``Communicator`` runs is handed to its
  ``observers``; the profiler appends one for the window. Records are aggregated per
  (op, group, phase), named by the layout transition(s) of the plan that issue that op in that phase,
  and attributed to the module that issued them (forward: the module running; backward: the
  module whose forward created the autograd node), which gives bytes per layer.

The profiler only reads the model, the plan and the parameters' metadata; it changes nothing in
the core. ``galaxy.core`` is imported lazily inside functions (the core imports
``galaxy.profiler.comm`` for its records, so the profiler must not import the core at load time).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, defaultdict
from typing import Any, Callable, Optional

import torch.distributed as dist
from torch import nn

from galaxy.config import Method, Plan
from galaxy.core.transitions import TRANSITION_OPS

from .comm import CommLog
from .flops_profiler import FlopsProfiler
from .report import format_parallel_report

__all__ = [
    "OUTSIDE_MODEL",
    "ParallelProfiler",
    "TRANSITION_OPS",
    "param_counts",
    "partial_grad_bytes",
    "replicated_module_map",
    "transition_label",
    "transitions_of_plan",
]

logger = logging.getLogger(__name__)

PHASES = ("fwd", "bwd")
OUTSIDE_MODEL = "<outside model>"  # comm issued by no module of the model (e.g. a grad-norm all-reduce)

# ----------------------------------------------------------------------------- static analysis


def _method_layouts() -> dict[Method, tuple[str, str]]:
    from galaxy.core.edges import LAYOUTS  # lazy: see the module docstring

    return {m: (lin.value, lout.value) for m, (lin, lout) in LAYOUTS.items()}


def stream_layout(plan: Plan) -> str:
    """Layout of the residual stream: CON's output layout (R or S)."""
    return _method_layouts()[plan.con][1]


def transitions_of_plan(plan: Plan) -> list[tuple[str, str, str]]:
    """``(src, dst, where)`` for every transition a model on ``plan`` runs (per layer, plus the
    model-level ones), e.g. ``("S", "T", "into ATT.tp")``."""
    layouts = _method_layouts()
    stream = layouts[plan.con][1]
    out = []
    for block, method in (("ATT", plan.att), ("MLP", plan.mlp)):
        lin, lout = layouts[method]
        tag = f"{block}.{method.value.lower()}"
        out.append((stream, lin, f"into {tag}"))
        out.append((lout, stream, f"out of {tag}"))
    if plan.att == Method.SP and plan.sp_attention == "allgather":
        out.append(("S", "T", "ATT.sp K/V gather"))
    if stream == "S":
        out.append(("P", "R", "loss / [CLS] reduce"))
    return out


def transition_label(op: str, phase: str, plan: Optional[Plan], group: str = "mp") -> str:
    """The transition(s) of ``plan`` that issue collective ``op`` in ``phase``, e.g.
    ``"S->T (into ATT.tp, into MLP.tp)"``; several kinds are joined with " | ". Layout
    transitions run on the model-parallel group; other groups are named as such."""
    if group != "mp":
        return f"{group} group"
    if phase not in PHASES:
        return "outside forward/backward (e.g. grad-norm all-reduce)"
    if plan is None:
        return "unknown (no plan)"
    if plan.att == Method.SP and (plan.sp_attention, op) in (("ring", "send_recv"), ("ulysses", "all_to_all")):
        return f"ATT.sp {plan.sp_attention} attention"
    idx = PHASES.index(phase)
    kinds: dict[tuple[str, str], list[str]] = {}
    for src, dst, where in transitions_of_plan(plan):
        if TRANSITION_OPS[(src, dst)][idx] == op:
            places = kinds.setdefault((src, dst), [])
            if where not in places:
                places.append(where)
    if not kinds:
        return "not a transition of this plan"
    return " | ".join(f"{src}->{dst} ({', '.join(w)})" for (src, dst), w in kinds.items())


def param_counts(model: nn.Module) -> dict[str, int]:
    """Parameters of this rank and of the whole model.

    ``local``/``trainable``: held on this rank. ``global``/``global_trainable``: the full model,
    each tensor once at its full shape. ``whole_local``: parameters this rank holds whole
    (not TP shards), i.e. the copies every rank of the group holds.
    """
    from galaxy.core.layers import shard_spec  # lazy: see the module docstring

    out = dict(local=0, trainable=0, whole_local=0, sharded_local=0)
    out["global"] = out["global_trainable"] = 0
    for p in model.parameters():  # tied parameters are yielded once
        n = p.numel()
        spec = shard_spec(p)
        full = math.prod(spec.full_shape(p.shape)) if spec is not None else n
        out["local"] += n
        out["global"] += full
        out["sharded_local" if spec is not None else "whole_local"] += n
        if p.requires_grad:
            out["trainable"] += n
            out["global_trainable"] += full
    return out


def partial_grad_bytes(model: nn.Module) -> int:
    """Bytes the gradient sync all-reduces per step: every trainable PARTIAL parameter's gradient
    (``GradientSync`` sums them over the mp group)."""
    from galaxy.core.layers import GradRule, grad_rule  # lazy

    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p.requires_grad and grad_rule(p) == GradRule.PARTIAL)


def replicated_module_map(model: nn.Module, plan: Optional[Plan]) -> dict[str, bool]:
    """Module name -> whether the FLOPs the module runs itself are repeated on every rank.

    The rule (static, from the parameters' gradient rules and the plan):

    * a module that holds parameters directly is replicated when all of them have gradient rule
      REPLICATED: every rank holds the same weight *and* applies it to the same (replicated)
      input. SHARDED weights split the work over ranks; PARTIAL weights are whole but see a
      sequence shard (or are a row-parallel bias added once), so their work is split too;
    * a module without direct parameters (a layer running the attention core in its own
      ``forward``, a container) follows all the parameters under it: replicated when all are
      REPLICATED (e.g. every block ``None``), split as soon as one is sharded or partial;
    * a module with no parameters anywhere under it (a tied LM head holding the embedding
      through a list) runs on the residual stream: replicated when the stream layout is R
      (CON=None), i.e. under TP.

    Limits (conservative, it can under-report, never invent): a module mixing replicated and
    split work in its own ``forward`` is booked as split (e.g. a LoRA linear that keeps A
    replicated inside a sharded layer, or the attention core of an ``ATT=None`` block in a layer
    whose MLP is sharded). ``profile_flops.py --check_serial`` measures the serial model to check.
    """
    from galaxy.core.layers import GradRule, grad_rule  # lazy

    stream_replicated = plan is not None and stream_layout(plan) == "R"
    out = {}
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False)) or list(module.parameters())
        if params:
            out[name] = all(grad_rule(p) == GradRule.REPLICATED for p in params)
        else:
            out[name] = stream_replicated
    return out


def _phase_dict(fwd: int, bwd: int) -> dict[str, int]:
    return {"fwd": int(fwd), "bwd": int(bwd), "total": int(fwd + bwd)}


# ----------------------------------------------------------------------------- the profiler


class ParallelProfiler:
    """Profile a step of a Galaxy model on every rank of its model-parallel group.

    Args:
        model: the model of this rank (a ``GalaxyModel`` has ``.ctx`` and ``.plan``).
        ctx: its ``ParallelContext`` (default ``model.ctx``); ``ctx.mp`` is the group.
        plan: the resolved ``Plan`` (default ``model.plan``).
        batch, seq_len: reported with the numbers.
        grad_sync: the profiled step runs ``GradientSync``; its all-reduce bypasses the
            ``Communicator`` observers, so its volume is reported from the parameters
            (``partial_grad_bytes``), marked "analytic" and kept out of the measured totals.
        timed: False for runs whose wall time means nothing (fake/meta tensors): latencies are
            reported as 0 and rates/MFU as None, and the report says so.
        Other keyword arguments go to ``FlopsProfiler`` (``peak_tflops``, ``causal_halving``,
        ``dtype``, ``sync_latency``).

    ``start_profile()`` / ``stop_profile()`` open and close a window on every rank;
    ``stop_profile()`` is a collective (it all-gathers the per-rank summaries), so every rank
    of the group must call it. ``profile(step_fn)`` does both around one call of ``step_fn``.
    Each window starts from zero, so profiling twice gives the same numbers.
    """

    def __init__(
        self,
        model: nn.Module,
        ctx: Any = None,
        plan: Optional[Plan] = None,
        *,
        batch: Optional[int] = None,
        seq_len: Optional[int] = None,
        grad_sync: bool = False,
        timed: bool = True,
        **flops_kwargs: Any,
    ) -> None:
        self.model = model
        self.ctx = ctx if ctx is not None else getattr(model, "ctx", None)
        if self.ctx is None:
            raise ValueError("ParallelProfiler needs a ParallelContext: pass ctx= or profile a Galaxy model")
        self.plan = plan if plan is not None else getattr(model, "plan", None)
        self.comm = self.ctx.mp
        self.world, self.rank = self.comm.size, self.comm.rank
        # Every group of the context is observed (bytes of dp/pp collectives too); the per-rank
        # table and the sums are over the mp group.
        self._comms = [c for c in (getattr(self.ctx, n, None) for n in ("mp", "dp", "pp", "pp_ends"))
                       if c is not None and hasattr(c, "observers")]
        self.batch, self.seq_len, self.grad_sync, self.timed = batch, seq_len, grad_sync, timed
        self.params = param_counts(model)
        self.comm_log = CommLog()
        plan_info = {}
        if self.plan is not None:
            plan_info = {"ATT": self.plan.att.value, "CON": self.plan.con.value, "MLP": self.plan.mlp.value}
        self.flops = FlopsProfiler(model, comm_log=self.comm_log, world_size=self.world, rank=self.rank,
                                   plan=plan_info, batch=batch, seq_len=seq_len,
                                   global_params=self.params["global"], **flops_kwargs)
        self._observer = self._observe  # one bound method, so it can be found and removed again
        self._lock = threading.Lock()
        self._comm_by_module: defaultdict[str, dict[str, list]] = defaultdict(dict)
        self._ranks: Optional[list[dict[str, Any]]] = None
        self._mine: Optional[dict[str, Any]] = None  # this rank's summary, computed when the window closes

    # ------------------------------------------------------------------ window

    def start_profile(self) -> None:
        """Open a window on this rank (every number zeroed, the comm observer attached)."""
        self._detach()
        with self._lock:
            self._comm_by_module.clear()
        self._ranks = self._mine = None
        self.params = param_counts(self.model)  # requires_grad may have changed (PEFT freezing)
        self.flops.set_run_info(global_params=self.params["global"])
        for comm in self._comms:
            comm.observers.append(self._observer)
        self.flops.start_profile()

    def mark_step(self) -> None:
        """Count one step in the window (communication is reported per step)."""
        self.comm_log.mark_step()

    def stop_profile(self, gather: bool = True) -> None:
        """Close the window. With ``gather`` (default) this is a collective over the mp group:
        the per-rank summaries are all-gathered so that ``to_json`` holds every rank."""
        self.flops.stop_profile()
        self._detach()
        self._mine = self._rank_summary()
        if gather:
            self._ranks = self._all_gather(self._mine)

    def end_profile(self) -> None:
        """Close the window (without gathering) and drop its numbers."""
        self.flops.end_profile()
        self._detach()
        self._ranks = self._mine = None
        with self._lock:
            self._comm_by_module.clear()

    def profile(self, step_fn: Callable[[], Any], warm_up: int = 0) -> dict[str, Any]:
        """Run ``step_fn`` ``warm_up`` times unprofiled, then once in a window; returns ``to_json()``.

        A collective: every rank of the group calls it with its own ``step_fn``. If ``step_fn``
        raises, the window is closed without the gather and the error propagates.
        """
        for _ in range(warm_up):
            step_fn()
        self.start_profile()
        try:
            step_fn()
            self.mark_step()
        except BaseException:
            self.stop_profile(gather=False)
            raise
        self.stop_profile()
        return self.to_json()

    # ------------------------------------------------------------------ results

    def to_json(self) -> dict[str, Any]:
        """Every number of the window as plain Python types (no collective)."""
        local = self.flops.to_json()
        local["run"]["timed"] = self.timed
        if not self.timed:
            _drop_timings(local)
        mine = self._mine if self._mine is not None else self._rank_summary()
        ranks = self._ranks if self._ranks is not None else [mine]
        steps = max(self.comm_log.steps, 1)
        rows = []
        for row in self.comm_log.summary():
            row = dict(row, transition=transition_label(row["op"], row["phase"], self.plan, row["group"]))
            if not self.timed:
                row["seconds"], row["GBps"] = 0.0, None
            rows.append(row)
        by_transition: dict[str, dict[str, Any]] = {}
        for row in rows:
            entry = by_transition.setdefault(row["transition"], {"bytes_per_step": 0.0, "calls_per_step": 0.0,
                                                                  "ops": []})
            entry["bytes_per_step"] += row["bytes_per_step"]
            entry["calls_per_step"] += row["calls_per_step"]
            entry["ops"].append(f"{row['op']}/{row['phase']}")
        with self._lock:
            by_module = {
                name: {key: {"bytes_per_step": b / steps, "calls_per_step": c / steps} for key, (b, c) in ops.items()}
                for name, ops in self._comm_by_module.items()
            }
        layers = [n for n, m in self.model.named_modules() if _is_layer(n, self.model) and n in by_module]
        sums = self._sums(ranks)
        return {
            "run": self._run_info(),
            "gathered": self._ranks is not None,
            "params": dict(self.params, sum_over_ranks=sum(r["params"]["local"] for r in ranks)
                           if self._ranks is not None else None),
            "ranks": ranks,
            "sum": sums,
            "replicated": mine["replicated"],
            "comm": {
                "steps": self.comm_log.steps,
                "rows": rows,
                "by_transition": by_transition,
                "by_module": by_module,
                "layers": layers,
                "grad_sync": self._grad_sync_info(),
            },
            "local": local,
        }

    def format_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                       detailed: bool = True) -> str:
        """This rank's DeepSpeed-style report followed by the parallel section."""
        return format_parallel_report(self.to_json(), profile_step, module_depth, top_modules, detailed)

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None) -> None:
        """Write the report to ``output_file``, or log it at INFO level."""
        text = self.format_profile(profile_step, module_depth, top_modules, detailed)
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            logger.info("%s", text)

    # ------------------------------------------------------------------ internals

    def _detach(self) -> None:
        for comm in self._comms:
            obs = comm.observers
            for i in range(len(obs) - 1, -1, -1):
                if obs[i] is self._observer:
                    del obs[i]

    def _observe(self, rec: Any) -> None:
        if not self.flops.started:
            return
        self.comm_log.record(rec)
        scope = self.flops.current_scope() or frozenset((OUTSIDE_MODEL,))
        key = f"{rec.op}/{rec.phase}" if rec.group == self.comm.name else f"{rec.group}:{rec.op}/{rec.phase}"
        nbytes = int(rec.nbytes)
        with self._lock:
            for name in scope:
                agg = self._comm_by_module[name].setdefault(key, [0, 0])
                agg[0] += nbytes
                agg[1] += 1

    def _all_gather(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        # Straight through torch.distributed, so the gather is not one of the recorded collectives.
        dist.all_gather_object(out, obj, group=self.comm.group)
        return out

    def _run_info(self) -> dict[str, Any]:
        plan = self.plan
        info = {"world_size": self.world, "rank": self.rank, "batch": self.batch, "seq_len": self.seq_len,
                "timed": self.timed,
                "model": type(self.model).__name__, "device": str(self.flops._model_device())}
        if plan is not None:
            info.update(plan=plan.name, att=plan.att.value, con=plan.con.value, mlp=plan.mlp.value,
                        stream=stream_layout(plan), heads_split=list(plan.heads_split),
                        ffn_split=list(plan.ffn_split), seq_split=list(plan.seq_split))
        return info

    def _replicated(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "method": "one rank: nothing is repeated",
            "attribution_nests": True,
            "per_rank": _phase_dict(0, 0),
            "modules": [],
            "zero_flop_modules": {},
        }
        if self.world == 1:
            return info
        prof = self.flops
        total = {ph: prof.get_total_flops(phase=ph) for ph in PHASES}
        root = {ph: prof.get_flops_by_module(ph)[""] for ph in PHASES}
        excl = {ph: prof.get_flops_by_module(ph, exclusive=True) for ph in PHASES}
        exact = all(sum(excl[ph].values()) == root[ph] for ph in PHASES)
        if not exact:
            logger.warning("module FLOPs do not nest (a module calls a module outside its subtree); "
                           "replicated compute may be counted twice for those ops")
        outside = {ph: total[ph] - root[ph] for ph in PHASES}
        info["method"] = ("module rule: a module's own FLOPs are replicated when every parameter it holds "
                          "(holding none: every parameter under it) has gradient rule REPLICATED; "
                          "modules without any parameter, and FLOPs outside the model, follow the stream "
                          "layout (R under CON=None)")
        info["attribution_nests"] = exact
        is_rep = replicated_module_map(self.model, self.plan)
        stream_rep = self.plan is not None and stream_layout(self.plan) == "R"
        fwd = sum(excl["fwd"][n] for n, r in is_rep.items() if r) + (outside["fwd"] if stream_rep else 0)
        bwd = sum(excl["bwd"][n] for n, r in is_rep.items() if r) + (outside["bwd"] if stream_rep else 0)
        info["per_rank"] = _phase_dict(fwd, bwd)
        zero = Counter()
        for name, module in self.model.named_modules():
            if not is_rep.get(name):
                continue
            f, b = excl["fwd"].get(name, 0), excl["bwd"].get(name, 0)
            if f or b:
                info["modules"].append({"name": name, "class": type(module).__name__, "fwd_flops": f,
                                        "bwd_flops": b})
            elif any(True for _ in module.parameters(recurse=False)):
                zero[type(module).__name__] += 1
        if stream_rep and (outside["fwd"] or outside["bwd"]):
            info["modules"].append({"name": OUTSIDE_MODEL, "class": "", "fwd_flops": outside["fwd"],
                                    "bwd_flops": outside["bwd"]})
        info["zero_flop_modules"] = dict(zero)
        return info

    def _rank_summary(self) -> dict[str, Any]:
        prof = self.flops
        fwd, bwd = prof.get_total_flops(phase="fwd"), prof.get_total_flops(phase="bwd")
        comm_bytes = {ph: self.comm_log.total_bytes(ph) for ph in ("fwd", "bwd", "other")}
        comm_bytes["total"] = sum(comm_bytes.values())
        window = prof.get_window_duration() if self.timed else 0.0
        rows = self.comm_log.summary()
        return {
            "rank": self.rank,
            "params": {"local": self.params["local"], "trainable": self.params["trainable"]},
            "flops": _phase_dict(fwd, bwd),
            "macs": _phase_dict(prof.get_total_macs(phase="fwd"), prof.get_total_macs(phase="bwd")),
            "replicated": self._replicated(),
            "comm_bytes": comm_bytes,
            "comm_calls": sum(r["calls"] for r in rows),
            "comm_seconds": sum(r["seconds"] for r in rows) if self.timed else 0.0,
            "window_s": window,
            "fwd_latency_s": prof.get_total_duration() if self.timed else 0.0,
            "achieved_tflops": (fwd + bwd) / window / 1e12 if window > 0 else None,
            "uncounted_ops": prof.get_uncounted_ops(),
        }

    def _sums(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        def total(key: str, ph: str) -> int:
            return sum(r[key][ph] for r in ranks)

        flops = _phase_dict(total("flops", "fwd"), total("flops", "bwd"))
        rep = [r["replicated"]["per_rank"] for r in ranks]
        rep_sum = _phase_dict(sum(x["fwd"] for x in rep), sum(x["bwd"] for x in rep))
        redundant = _phase_dict(rep_sum["fwd"] - max(x["fwd"] for x in rep),
                                rep_sum["bwd"] - max(x["bwd"] for x in rep))
        if len({(x["fwd"], x["bwd"]) for x in rep}) > 1:
            logger.warning("replicated FLOPs differ between ranks (%s); 'redundant' counts the largest once",
                           [x["total"] for x in rep])
        window = max(r["window_s"] for r in ranks)
        peak = self.flops._peak_tflops() if self.timed else None
        achieved = flops["total"] / window / 1e12 if window > 0 else None
        serial_eq = _phase_dict(flops["fwd"] - redundant["fwd"], flops["bwd"] - redundant["bwd"])
        denom = peak * len(ranks) if peak else None
        return {
            "ranks": len(ranks),
            "flops": flops,
            "macs": _phase_dict(total("macs", "fwd"), total("macs", "bwd")),
            "replicated": rep_sum,
            "redundant": redundant,
            "serial_equivalent": serial_eq,
            "params_local": sum(r["params"]["local"] for r in ranks),
            "params_trainable": sum(r["params"]["trainable"] for r in ranks),
            "comm_bytes": {ph: sum(r["comm_bytes"][ph] for r in ranks) for ph in ("fwd", "bwd", "other", "total")},
            "window_s_max": window,
            "achieved_tflops": achieved,
            "peak_tflops_per_rank": peak,
            "mfu": achieved / denom if (achieved is not None and denom) else None,
            "useful_mfu": serial_eq["total"] / window / 1e12 / denom if (window > 0 and denom) else None,
        }

    def _grad_sync_info(self) -> Optional[dict[str, Any]]:
        if not self.grad_sync or self.world == 1:
            return None
        return {
            "op": "all_reduce",
            "bytes_per_step": partial_grad_bytes(self.model),
            "observed": False,
            "note": "GradientSync calls torch.distributed directly, not the Communicator, so its "
                    "all-reduce is not recorded; this is the summed size of the trainable PARTIAL "
                    "gradients (seq-partial weights, row-parallel biases), not in the measured totals",
        }


def _drop_timings(local: dict[str, Any]) -> None:
    """Zero the latencies and drop the rates of a ``FlopsProfiler.to_json()`` dict (untimed runs)."""
    local["latency_s"] = {k: 0.0 for k in local["latency_s"]}
    local["tflops"] = {k: None for k in local["tflops"]}
    local["peak_tflops"] = local["mfu"] = None
    for m in local["modules"]:
        m["fwd_latency_s"], m["fwd_tflops"] = 0.0, None
    if local.get("comm"):
        for row in local["comm"]["rows"]:
            row["seconds"], row["GBps"] = 0.0, None


def _is_layer(name: str, model: nn.Module) -> bool:
    """A direct child of a ``ModuleList`` (a transformer layer in every Galaxy model)."""
    if not name or "." not in name:
        return False
    parent = model.get_submodule(name.rsplit(".", 1)[0])
    return isinstance(parent, nn.ModuleList)
