"""Predicted step time (training) or single-request latency (batch-1 forward) and per-rank memory
of a plan, from a cluster profile: each rank runs its pieces at its own measured speed, and every
collective is a sync point of its group (the slowest member sets when it starts).

All predictions are vectorised over candidate splits: ``Splits`` holds ``[candidates, mp]`` arrays,
so the search scores thousands of splits in one pass. A step is simulated as the training loop runs
it: optimizer (each rank's own), the micro-batches' forward and backward, the data-parallel and
model-parallel gradient sums and the global grad-norm all-reduce (the step's last sync point).
Pipelines (pp > 1) use the usual schedule bound: the sum of the stages' times plus (micro-batches
- 1) times the slowest stage. CoC overlap is not modelled (plans are scored with one chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from galaxy.config import Method, ModelConfig, balanced_split
from galaxy.core.context import rank_of
from galaxy.core.transitions import TRANSITION_OPS
from galaxy.planner.cluster import ClusterProfile
from galaxy.planner.workload import LAYOUTS, edge_params, layer_params, stream_layout, tied_params

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
GRAD_BUCKET_BYTES = 25 * 2**20  # GradientSync's bucket size
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4}
# bytes the profile's fused AdamW step moves per fp32 parameter (reads the weight, gradient and both moments,
# writes three): its seconds per parameter over this are the device's seconds per byte of a memory-bound copy
ADAMW_BYTES_PER_PARAM = 28
# recompute modes that run some of a layer's pieces again in backward: the pieces' name prefix
RECOMPUTED = {"selective": "att_core", "mlp": "mlp"}


@dataclass(frozen=True)
class Layout:
    """How a world is used around the model-parallel group (training); latency uses the default."""

    dp: int = 1
    pp: int = 1
    microbatches: int = 1
    recompute: str = "none"  # none | full | selective | mlp (config key recompute)
    schedule: str = "1f1b"


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    objective: str  # train | latency
    global_batch: int
    seq_length: int
    dtype: str = "float32"
    optimizer: str = "adamw"
    mp_grad_reduce: str = "after_backward"  # config key of the same name
    dp_engine: str = "ddp"  # ddp | zero1 | deepspeed (pure dp: the search keeps mp = pp = 1) | fsdp2
    zero_stage: int = 1  # deepspeed: 1 shards the optimizer state over dp, 2 the gradients too
    # fsdp2, config keys of the same names: gathered weights freed after forward (default: without a pipeline) or
    # kept to backward; gradients reduce-scattered every micro-batch or once, unsharded ones accumulating
    reshard_after_forward: str = "default"
    fsdp_grad_sync: str = "every_micro_batch"

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]


def fsdp_reshards(reshard_after_forward: str, pp: int) -> bool:
    """Whether FSDP2 gathers each layer again in backward (its weights freed after forward)."""
    return reshard_after_forward == "always" or (reshard_after_forward == "default" and pp == 1)


def fsdp_syncs_once(fsdp_grad_sync: str, microbatches: int) -> bool:
    """Whether FSDP2 reduce-scatters the gradients once a step (unsharded ones held between)."""
    return fsdp_grad_sync == "last_micro_batch" and microbatches > 1


def fsdp_sharded(work: Workload, dp: int, mp: int) -> tuple[bool, bool]:
    """Whether FSDP shards (every weight over dp: ``dp_engine: fsdp2``; the replicated weights of SP blocks
    over mp, over dp x mp with fsdp2: ``mp_grad_reduce: fsdp``)."""
    return dp > 1 and work.dp_engine == "fsdp2", mp > 1 and work.mp_grad_reduce == "fsdp"


def bytes_per_parameter(work: Workload, dp: int, mp: int, microbatches: int,
                        gradients: bool = True) -> tuple[float, float]:
    """What a rank holds per trainable parameter it has, in bytes: (a parameter of any rule, a PARTIAL one
    under ``mp_grad_reduce: sharded``, or a replicated one of an SP block under ``mp_grad_reduce: fsdp``),
    parameters, gradients and optimizer state (activations apart);
    ``gradients=False``: before the step's first backward has made any (``training_memory``).

    Weights, gradients and optimizer state are in the master precision (float32, float64 for float64
    runs); under bfloat16/float16 autocast keeps a compute-dtype copy of every weight from its first use
    in the forward to the end of the backward (its cache; the backward reads it). ``zero1`` (and
    DeepSpeed) keep 1/dp of the optimizer state, DeepSpeed's ZeRO-2 1/dp of the gradients too.
    ``sharded`` PARTIAL weights: the model holds them once (in the compute dtype under autocast, no
    master there), their gradients only while micro-batches accumulate (the last backward buckets and
    drops them), and 1/mp of them as pieces with master, gradient and optimizer state (ZeRO-2 over mp).
    ``fsdp2`` (and ``fsdp`` over mp): master, gradient and optimizer state as a 1/dp block (1/mp, 1/(dp mp))
    (the gradient whole where it is reduce-scattered once a step); the compute-dtype weights are the ones
    FSDP gathers (``FsdpUnits.gathered_bytes``), not autocast's copies."""
    master = 8 if work.dtype == "float64" else 4
    grad = master if gradients else 0
    low = work.dtype in ("bfloat16", "float16")
    state = OPTIMIZER_STATE_BYTES[work.optimizer] * master / 4
    whole_grads = fsdp_syncs_once(work.fsdp_grad_sync, microbatches)

    def block(shards: int) -> float:
        return (master + grad + state) / shards + (grad * (1 - 1 / shards) if whole_grads else 0)
    over_dp, over_mp = fsdp_sharded(work, dp, mp)
    if over_dp:  # (the config refuses mp_grad_reduce sharded with it)
        return block(dp), block(dp * mp) if over_mp else block(dp)
    split_state = dp if dp > 1 and work.dp_engine in ("zero1", "deepspeed") else 1
    split_grad = dp if dp > 1 and work.dp_engine == "deepspeed" and work.zero_stage == 2 else 1
    whole = master + grad / split_grad + state / split_state + (work.elem if low else 0)
    if over_mp:
        return whole, block(mp)
    if mp == 1 or work.mp_grad_reduce != "sharded":
        return whole, whole
    weight = work.elem if low else master
    accumulating = weight if microbatches > 1 and gradients else 0
    return whole, weight + accumulating + (master + grad + state / split_state) / mp


@dataclass
class Splits:
    """Per-rank shares, each ``[candidates, mp]``: query heads (ATT.tp), FFN columns (MLP.tp), tokens (SP)."""

    heads: np.ndarray
    ffn: np.ndarray
    seq: np.ndarray

    @classmethod
    def one(cls, heads, ffn, seq) -> "Splits":
        return cls(*(np.atleast_2d(np.asarray(x, dtype=np.int64)) for x in (heads, ffn, seq)))

    @classmethod
    def balanced(cls, m: ModelConfig, seq_length: int, mp: int) -> "Splits":
        return cls.one(balanced_split(m.num_attention_heads, mp), balanced_split(m.intermediate_size, mp),
                       balanced_split(seq_length, mp))


@dataclass
class Prediction:
    time_s: np.ndarray  # [candidates]
    memory_bytes: np.ndarray  # [candidates, world]
    fits: np.ndarray  # [candidates]: every rank within its memory budget
    detail: dict = field(default_factory=dict)


@dataclass
class Compute:
    fwd: np.ndarray  # [C, mp] seconds
    bwd: np.ndarray
    act: np.ndarray  # bytes saved for backward
    name: str = ""
    var: Optional[str] = None  # the split that sizes it (heads, ffn, seq), None: the same on every split


@dataclass
class Collective:
    fwd_op: Optional[str]
    bwd_op: Optional[str]
    nbytes: int  # the full tensor (what galaxy.core.comm records)
    wire: np.ndarray  # [C] bytes charged (uneven pieces are padded to the largest)
    name: str = ""


class Segments:
    """The stretches between a group's sync points, as the simulation passes them: each rank's
    compute since it left the last sync (``parts``, ``[C, mp]``) and each sync's time from the last
    arrival until the first member leaves (``comm``, ``[C, 1]``). The step is at least the sum of
    each part's maximum over ranks and of the comms (equal where every member leaves together).

    A stretch of syncs that repeats unchanged (a layer's, a micro-batch's: ``GroupModel.repeat``) is
    stored once: ``unique_parts`` / ``unique_comm`` hold each distinct sync's values and ``order``
    the sync each position of the step is; ``parts`` and ``comm`` are the step in full."""

    def __init__(self):
        self.base = 0.0
        self.unique_parts: list[np.ndarray] = []  # one per distinct sync, then the stretch after the last
        self.unique_comm: list[np.ndarray] = []
        self.order: list[int] = []  # the step's syncs, as indices into the two lists above
        self.finished = False

    def sync(self, clock: np.ndarray, first_out: np.ndarray, leave: np.ndarray) -> None:
        self.order.append(len(self.unique_comm))
        self.unique_parts.append(clock - self.base)
        self.unique_comm.append(first_out)
        self.base = leave.copy()  # the caller may advance its clocks in place

    def repeat(self, since: int, more: int, shift: np.ndarray) -> None:
        """The syncs from position ``since`` on happen ``more`` times again, each time ``shift`` later
        (none: the stretch since the last sync goes on)."""
        if len(self.order) > since:
            self.order += self.order[since:] * more
            self.base = self.base + more * shift

    def finish(self, clock: np.ndarray) -> None:
        self.unique_parts.append(clock - self.base)
        self.finished = True

    def positions(self) -> list[int]:
        """The step's stretches in order, as indices into ``unique_parts``."""
        return self.order + ([len(self.unique_parts) - 1] if self.finished else [])

    @property
    def parts(self) -> list[np.ndarray]:
        return [self.unique_parts[i] for i in self.positions()]

    @property
    def comm(self) -> list[np.ndarray]:
        return [self.unique_comm[i] for i in self.order]


class GroupModel:
    """The pieces and collectives of one model-parallel group (``ranks``) under one plan."""

    def __init__(self, cluster: ClusterProfile, work: Workload, methods: tuple[Method, Method, Method],
                 splits: Splits, ranks: list[int], rows: int):
        self.cluster, self.work, self.splits, self.ranks, self.rows = cluster, work, splits, ranks, rows
        self.att, self.con, self.mlp = methods
        self.stream = stream_layout(self.con)
        m = work.model
        self.mp = len(ranks)
        S, self.h = work.seq_length, m.hidden_size
        full = lambda n: np.full_like(splits.seq, n)  # noqa: E731
        self.tokens = splits.seq if self.stream == "S" else full(S)
        self.tokens_var = "seq" if self.stream == "S" else None
        self.act_bytes = rows * S * self.h * work.elem
        if self.mp > 1 and (self.stream == "S" or Method.SP in (self.att, self.mlp)):
            self.padded = rows * splits.seq.max(axis=1) * self.mp * self.h * work.elem
        else:
            self.padded = np.full(splits.seq.shape[0], self.act_bytes)
        self.full = full
        self.segments: Optional[Segments] = None  # recorded when a lower bound is wanted
        self.trace: Optional[list] = None  # the last member of each collective left, while ``repeat`` watches
        self._layer: Optional[list] = None
        self._head: Optional[list] = None
        self._seconds: dict = {}  # (id(collective), op) -> (the collective, its link_seconds)

    def piece(self, name: str, sizes: np.ndarray, var: Optional[str] = None) -> Compute:
        """Piece ``name`` at each rank's ``sizes`` (``[C, mp]``), which come from split ``var``."""
        out = [np.empty(sizes.shape) for _ in range(3)]
        for i, r in enumerate(self.ranks):
            for k, values in enumerate(self.cluster.ranks[r].piece(name, self.rows, sizes[:, i],
                                                                   self.work.objective == "latency")):
                out[k][:, i] = values
        return Compute(*out, name=name, var=var)

    def transition(self, src: str, dst: str, name: str) -> Optional[Collective]:
        if self.mp == 1:
            return None
        fwd, bwd = TRANSITION_OPS[(src, dst)]
        if fwd is None and bwd is None:
            return None
        seq_side = "S" in (src, dst)
        return Collective(fwd, bwd, self.act_bytes, self.padded if seq_side else np.full(len(self.padded),
                                                                                        self.act_bytes), name)

    def layer(self) -> list:
        """One layer's events in forward order: ATT, CON, MLP, CON with the transitions between
        (built once: every layer of the group runs the same)."""
        if self._layer is None:
            self._layer = self._build_layer()
        return self._layer

    def _build_layer(self) -> list:
        m, s = self.work.model, self.splits
        H, F = m.num_attention_heads, m.intermediate_size
        events = [self.transition(self.stream, LAYOUTS[self.att][0], "enter ATT")]
        if self.att == Method.SP and self.mp > 1:
            kv = self.rows * self.work.seq_length * 2 * m.kv_heads * m.head_dim * self.work.elem
            kv_wire = self.padded / self.h * 2 * m.kv_heads * m.head_dim
            events += [self.piece("att_proj.tokens", s.seq, "seq"),
                       Collective("all_gather", "reduce_scatter", kv, kv_wire, "K,V gather"),
                       self.piece("att_core.tokens", s.seq, "seq")]
        else:
            heads, var = (s.heads, "heads") if self.att == Method.TP else (self.full(H), None)
            events += [self.piece("att_proj.heads", heads, var), self.piece("att_core.heads", heads, var)]
        events += [self.transition(LAYOUTS[self.att][1], self.stream, "leave ATT"),
                   self.piece("con.tokens", self.tokens, self.tokens_var),
                   self.transition(self.stream, LAYOUTS[self.mlp][0], "enter MLP")]
        if self.mlp == Method.TP:
            events.append(self.piece("mlp.ffn", s.ffn, "ffn"))
        elif self.mlp == Method.SP:
            events.append(self.piece("mlp.tokens", s.seq, "seq"))
        else:
            events.append(self.piece("mlp.ffn", self.full(F)))
        events += [self.transition(LAYOUTS[self.mlp][1], self.stream, "leave MLP"),
                   self.piece("con.tokens", self.tokens, self.tokens_var)]
        return [e for e in events if e is not None]

    def head(self) -> list:
        if self._head is None:
            self._head = [self.piece("head.tokens", self.tokens, self.tokens_var)]
            if self.stream == "S" and self.mp > 1 and self.work.objective == "train":
                loss = max(4, self.work.elem)  # the loss, in float32 at least
                self._head.append(Collective("all_reduce", None, loss, np.full(len(self.padded), loss), "loss"))
        return self._head

    def link_seconds(self, op: str, wire) -> tuple[np.ndarray, np.ndarray]:
        """Seconds of collective ``op`` over ``wire`` bytes from the last arrival until the members
        that waited leave (``waiting_leave``: earlier over Gloo's all-gather; the same where the
        profile has no difference), and until the last to arrive leaves (``collective``)."""
        waited = self.cluster.waiting_leave(self.ranks, op)(wire)
        return waited, np.maximum(self.cluster.collective(self.ranks, op)(wire), waited)

    def collective_seconds(self, e: Collective, op: str) -> tuple[np.ndarray, np.ndarray]:
        """``link_seconds`` of collective ``e``'s ``op``, looked up once: each layer and micro-batch
        runs it again. The entry holds ``e``, so its id stays its own while cached."""
        key = (id(e), op)
        if key not in self._seconds:
            self._seconds[key] = (e, self.link_seconds(op, e.wire))
        return self._seconds[key][1]

    def leave(self, op: str, wire, clock: np.ndarray,
              seconds: Optional[tuple[np.ndarray, np.ndarray]] = None) -> np.ndarray:
        """When each rank leaves collective ``op`` that it entered at ``clock`` ``[C, mp]``: the last
        to arrive after the collective's time, the ranks that waited for it after the waiting time
        (``link_seconds``, or ``seconds`` already looked up)."""
        waited, slowest = seconds if seconds is not None else self.link_seconds(op, wire)
        last = clock.max(axis=1, keepdims=True)
        leave = np.repeat(last + waited[:, None], clock.shape[1], axis=1)
        latest = clock.argmax(axis=1)  # ties: one of them is last in a real run
        rows = np.arange(clock.shape[0])
        leave[rows, latest] = last[:, 0] + slowest
        if self.trace is not None:
            self.trace.append(latest)
        if self.segments is not None:
            self.segments.sync(clock, waited[:, None], leave)
        return leave

    def repeat(self, step: Callable[[np.ndarray], np.ndarray], clock: np.ndarray, times: int) -> np.ndarray:
        """``clock`` after ``step`` (a layer, a micro-batch: the same events each time) ``times`` times,
        simulating only until two steps in a row see the same rank last at every collective.

        Why that is exact: leaving a collective, each rank's clock is the last arrival plus a time
        that depends only on which rank arrived last; so a step's clocks on leaving, less their
        maximum, are fixed by who was last at its final collective. Two steps in a row with the same
        last ranks leave the next step the clocks the previous one started from, up to one shift, and
        every step after repeats the last one. A step without collectives adds the same compute
        whatever the clocks. Recorded segments repeat with it."""
        outer = self.trace
        previous = None
        for k in range(times):
            since = len(self.segments.order) if self.segments is not None else 0
            self.trace = []
            after = step(clock)
            seen, self.trace = self.trace, outer
            if outer is not None:
                outer.extend(seen)
            if previous is not None and len(seen) == len(previous) \
                    and all(np.array_equal(a, b) for a, b in zip(seen, previous)):
                more = times - k - 1
                shift = after - clock
                if more and self.segments is not None:
                    self.segments.repeat(since, more, shift)
                if more and outer is not None:
                    outer.append(np.array([-more]))  # a caller comparing traces sees the repeats
                return after + more * shift
            previous, clock = seen, after
        return clock


def run(group: GroupModel, events: list, clock: np.ndarray, backward: bool = False) -> np.ndarray:
    """Advance per-rank clocks ``[C, mp]`` through ``events`` (in backward order when ``backward``)."""
    for e in (reversed(events) if backward else events):
        if isinstance(e, Compute):
            clock = clock + (e.bwd if backward else e.fwd)
        else:
            op = e.bwd_op if backward else e.fwd_op
            if op is not None:
                clock = group.leave(op, e.wire, clock, group.collective_seconds(e, op))
    return clock


def collectives(group: GroupModel, layers: int) -> list[tuple[str, int, str]]:
    """(op, bytes, phase) of every activation collective of one forward and backward, in the
    order a rank issues them (the backward's in reverse), as galaxy.core.comm records them."""
    events = [e for _ in range(layers) for e in group.layer()] + group.head()
    fwd = [(e.fwd_op, e.nbytes, "fwd") for e in events if isinstance(e, Collective) and e.fwd_op]
    bwd = [(e.bwd_op, e.nbytes, "bwd") for e in reversed(events) if isinstance(e, Collective) and e.bwd_op]
    return fwd + bwd


def stage_parameters(work: Workload, methods: tuple[Method, Method, Method], splits: Splits, layout: Layout,
                     mp: int) -> tuple[dict, dict, dict, dict]:
    """Per pipeline stage, ``[C, mp]`` parameters of each mp rank (the same in every dp replica): all it
    holds, those whose gradient Galaxy sums over the mp group after the backward (PARTIAL), those its
    optimizer steps (sharded PARTIAL weights as 1/mp pieces, 1/dp under ZeRO), and the replicated weights
    of SP blocks FSDP shards over mp (``mp_grad_reduce: fsdp``: their gradients reduce-scattered by FSDP,
    so not among the PARTIAL ones; zero otherwise)."""
    m, pp, dp = work.model, layout.pp, layout.dp
    stage_layers = balanced_split(m.num_hidden_layers, pp)
    emb, head = edge_params(m)
    per_layer = layer_params(m, methods[0], methods[2], methods[1], splits.heads, splits.ffn)
    sharded = mp > 1 and work.mp_grad_reduce == "sharded"
    over_mp = fsdp_sharded(work, dp, mp)[1]
    params, partial, stepped, replicated = {}, {}, {}, {}
    for p in range(pp):
        params[p] = per_layer.total * stage_layers[p] + (emb if p == 0 else 0) + (head if p == pp - 1 else 0)
        edge_partial = (emb if p == 0 else 0) + (head if p == pp - 1 else 0)
        replicated[p] = per_layer.replicated * stage_layers[p] * (1 if over_mp else 0)
        partial[p] = per_layer.partial * stage_layers[p] + (edge_partial if methods[1] == Method.SP else 0) \
            - replicated[p]
        own = params[p] - (partial[p] * (1 - 1 / mp) if sharded else 0) - replicated[p] * (1 - 1 / mp)
        stepped[p] = own / dp if dp > 1 and work.dp_engine in ("zero1", "deepspeed", "fsdp2") else own
    return params, partial, stepped, replicated


def training_memory(g: GroupModel, layout: Layout, p: int, params: np.ndarray, partial: np.ndarray,
                    replicated: np.ndarray) -> np.ndarray:
    """``[C, mp]`` bytes each rank of group ``g`` (pipeline stage ``p`` of ``layout``) holds in training:
    parameters and optimizer state (``params``, of which ``partial`` summed over mp after the backward and
    ``replicated`` sharded over mp by FSDP; ``stage_parameters``), plus the activations held at once. Every
    term is sized by one split variable (or none)."""
    work, m = g.work, g.work.model
    mp, pp, M = g.mp, layout.pp, layout.microbatches
    layers = balanced_split(m.num_hidden_layers, pp)[p]
    layer = g.layer()
    edge = g.head() if p == pp - 1 else []
    C = g.splits.seq.shape[0]
    acts_layer = sum(e.act for e in layer if isinstance(e, Compute))
    acts_edge = sum((e.act for e in edge if isinstance(e, Compute)), np.zeros((C, mp)))
    in_flight = 1 if pp == 1 else (M if layout.schedule == "gpipe" else min(M, pp - p))
    if layout.recompute == "full":  # each layer keeps its input; one layer's activations live in its backward
        held = layers * g.rows * g.tokens * m.hidden_size * work.elem + acts_layer
    elif layout.recompute == "selective":  # the attention cores' activations are rebuilt, one at a time
        core = sum((e.act for e in layer if isinstance(e, Compute) and e.name.startswith("att_core")),
                   np.zeros((C, mp)))
        held = layers * (acts_layer - core) + core
    elif layout.recompute == "mlp":  # the MLPs' activations rebuilt one at a time, each keeping its input
        mlp = sum((e.act for e in layer if isinstance(e, Compute) and e.name.startswith("mlp")), np.zeros((C, mp)))
        tokens = g.splits.seq if g.mlp == Method.SP else g.full(work.seq_length)
        held = layers * (acts_layer - mlp + g.rows * tokens * m.hidden_size * work.elem) + mlp
    else:
        held = layers * acts_layer
    own_sharded = partial if mp > 1 and work.mp_grad_reduce == "sharded" else replicated

    def states(gradients: bool) -> np.ndarray:
        per_param, per_sharded = bytes_per_parameter(work, layout.dp, mp, M, gradients)
        return (params - own_sharded) * per_param + own_sharded * per_sharded

    activations = in_flight * (held + acts_edge)
    gathered = sum(u.gathered_bytes(work, layout) for u in FsdpUnits.of(work, layout, p, params, replicated))
    if M > 1 or (layout.dp > 1 and work.dp_engine == "deepspeed"):  # (DeepSpeed's buffers: kept throughout)
        return states(True) + activations + gathered
    # One micro-batch: its backward makes the gradients as it frees the activations (a step starts with
    # none: zero_grad sets them to None), so the forward's end holds no gradient, the optimizer step no
    # activation. A 7B layer's growth of the peak on an H200 was its states less its gradients plus its
    # saved activations (docs/benchmarks.md).
    return np.maximum(states(False) + activations, states(True)) + gathered


@dataclass(frozen=True)
class FsdpUnits:
    """One kind of FSDP unit of pipeline stage ``p``: ``edge`` root weights (embeddings, head; kept in the
    master precision) and ``layers`` layers of ``per_layer`` weights each (``[C, mp]``; gathered in the
    compute dtype), their bytes per parameter, and per mp rank ``i`` the ranks ``groups[i]`` its shards
    lie over. FSDP2 over dp (``dp_engine: fsdp2``) shards each layer and the root over the dp ranks of
    its mp rank; ``mp_grad_reduce: fsdp`` the replicated weights of SP blocks in each layer over the mp
    group (over the stage's dp x mp ranks with fsdp2)."""

    edge: int
    layers: int
    per_layer: np.ndarray
    master: int
    compute: int
    groups: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, work: Workload, layout: Layout, p: int, params: np.ndarray,
           replicated: Optional[np.ndarray] = None, d: int = 0) -> list["FsdpUnits"]:
        """The kinds of units (none without FSDP) of dp replica ``d``'s stage ``p``, whose mp ranks hold
        ``params``, of which ``replicated`` are sharded over mp (``stage_parameters``)."""
        mp = params.shape[1]
        over_dp, over_mp = fsdp_sharded(work, layout.dp, mp)
        if not (over_dp or over_mp):
            return []
        emb, head = edge_params(work.model)
        edge = (emb if p == 0 else 0) + (head if p == layout.pp - 1 else 0)
        layers = balanced_split(work.model.num_hidden_layers, layout.pp)[p]
        master = 8 if work.dtype == "float64" else 4
        compute = work.elem if work.dtype in ("bfloat16", "float16") else master
        replicated = np.zeros_like(params) if replicated is None else replicated
        dp_ranks = [[rank_of(e, p, i, layout.pp, mp) for e in range(layout.dp)] for i in range(mp)]
        kinds = []
        if over_dp:
            kinds.append(cls(edge, layers, (params - edge - replicated) / layers, master, compute,
                             tuple(tuple(r) for r in dp_ranks)))
        if over_mp:
            group = sorted(r for ranks in dp_ranks for r in ranks) if over_dp else \
                [rank_of(d, p, i, layout.pp, mp) for i in range(mp)]
            kinds.append(cls(0, layers, replicated / layers, master, compute, (tuple(group),) * mp))
        return kinds

    def gathered_bytes(self, work: Workload, layout: Layout) -> np.ndarray:
        """Bytes of these units held gathered: the root's in the master precision for the step, the layers'
        in the compute dtype, two at a time where they are resharded after forward (FSDP's default without
        a pipeline: the running layer and the prefetched next), else all of them."""
        held = min(2, self.layers) if fsdp_reshards(work.reshard_after_forward, layout.pp) else self.layers
        return self.edge * self.master + self.per_layer * self.compute * held

    def step_bytes(self, work: Workload, layout: Layout) -> np.ndarray:
        """A step's bytes of these units' collectives as ``galaxy.core.fsdp.Sharding.count_traffic`` records
        them on a rank: every micro-batch the layers' whole weights gathered (twice where resharded) and the
        root's once; each reduction (every micro-batch, or once a step) every weight's gradient."""
        M = layout.microbatches
        gathers = 2 if fsdp_reshards(work.reshard_after_forward, layout.pp) else 1
        reductions = 1 if fsdp_syncs_once(work.fsdp_grad_sync, M) else M
        layers = self.layers * self.per_layer
        return M * (layers * self.compute * gathers + self.edge * self.master) \
            + reductions * (layers + self.edge) * self.master


def fsdp_exposed(cluster: ClusterProfile, work: Workload, layout: Layout, kinds: list[FsdpUnits],
                 compute_s: np.ndarray) -> np.ndarray:
    """``[C, mp]`` seconds FSDP adds to a step's micro-batches of a stage's ranks, whose units are
    ``kinds`` (``FsdpUnits.of``), against each micro-batch's ``compute_s``. Each layer's weights are
    all-gathered in the compute dtype before it runs (again in backward where resharded after forward:
    FSDP2's default without a pipeline) and its gradients reduce-scattered in the master precision after
    its backward (in the last micro-batch only with ``fsdp_grad_sync: last_micro_batch``); the root
    (embeddings, head) gathers in the master precision and reduce-scatters likewise. FSDP issues a
    unit's collectives behind its neighbours' compute, so a micro-batch waits for the root's and the
    first layer's gathers, the last reduce-scatters, and whatever of the rest its compute cannot cover:
    on NVLink a few milliseconds, on a slow link most of the traffic. Its copies around them
    (``fsdp_copy_bytes``) run on the device beside the compute and cost their bytes at the slowest
    member's memory-bound rate."""
    M = layout.microbatches
    gathers = 2 if fsdp_reshards(work.reshard_after_forward, layout.pp) else 1
    once = fsdp_syncs_once(work.fsdp_grad_sync, M)
    out = np.zeros_like(compute_s, dtype=float)
    for i in range(compute_s.shape[1]):
        # per micro-batch, with and without its gradient reduce-scatters: what it waits for, all it moves
        waited, traffic, copies = {True: 0.0, False: 0.0}, {True: 0.0, False: 0.0}, 0.0
        for u in kinds:
            ranks = list(u.groups[i])
            ag, rs = cluster.collective(ranks, "all_gather"), cluster.collective(ranks, "reduce_scatter")
            per_layer, edge = u.per_layer[:, i], np.full_like(u.per_layer[:, i], u.edge * u.master)
            gather, reduce = ag(per_layer * u.compute), rs(per_layer * u.master)
            root_gather, root_reduce = (ag(edge), rs(edge)) if u.edge else (0.0, 0.0)
            for reduces in (True, False):
                r = 1.0 if reduces else 0.0
                waited[reduces] = waited[reduces] + root_gather + gather + r * (root_reduce + reduce)
                traffic[reduces] = traffic[reduces] + u.layers * (gathers * gather + r * reduce) + root_gather \
                    + r * root_reduce
            copy_s_per_byte = max(cluster.ranks[r].optimizer.beta_s_per_byte for r in ranks) / ADAMW_BYTES_PER_PARAM
            copies = copies + copy_s_per_byte * sum(
                u.layers * fsdp_copy_bytes(per_layer, u.compute, u.master, len(ranks), gathers, k, M, once)
                + fsdp_copy_bytes(np.full_like(per_layer, u.edge), u.master, u.master, len(ranks), 1, k, M, once)
                for k in range(M))

        def micro_batch(reduces: bool) -> np.ndarray:
            return waited[reduces] + np.maximum(0.0, traffic[reduces] - waited[reduces] - compute_s[:, i])
        out[:, i] = micro_batch(True) + (M - 1) * micro_batch(not once) + copies
    return out


def fsdp_copy_bytes(n: np.ndarray, held: int, master: int, dp: int, gathers: int, k: int, M: int,
                    once: bool) -> np.ndarray:
    """Bytes FSDP2 reads and writes around the collectives of ``n`` weights (``held`` bytes each gathered,
    ``master`` bytes each sharded, over ``dp`` ranks) in micro-batch ``k`` of ``M``: per gather the shard
    cast to the compute dtype where that differs and copied into the gather's input buffer, and the
    gathered buffer split into the weights; the gradients cast into the master precision, into the
    reduce-scatter's input, and after the first micro-batch the reduced shard added to the sharded
    gradient (the first keeps it as it is). ``once`` (``fsdp_grad_sync: last_micro_batch``): the
    gradients cast into an unsharded accumulator in the master precision, added to it from the second
    micro-batch on (a gradient in that precision already, autograd accumulates itself), and the
    accumulator copied into the reduce-scatter's input in the last."""
    cast = n / dp * (master + held) if held != master else 0
    gathered = gathers * (cast + n / dp * 2 * held + 2 * n * held)
    if not once:
        return gathered + n * (held + master) + (3 * n / dp * master if k else 0)
    accumulated = n * (held + master) + (n * master if k else 0) if held != master else 0
    return gathered + accumulated + (2 * n * master if k == M - 1 else 0)


def partial_gradient_bytes(work: Workload, partial: np.ndarray, dp: int) -> np.ndarray:
    """Bytes a rank sums over its mp group of ``partial`` PARTIAL gradients (the same on every rank of a
    group): in the master weights' precision, under FSDP2 its dp shard only."""
    grad_bytes = 8 if work.dtype == "float64" else 4
    return partial * grad_bytes / (dp if dp > 1 and work.dp_engine == "fsdp2" else 1)


def predict(cluster: ClusterProfile, work: Workload, methods: tuple[Method, Method, Method], splits: Splits,
            layout: Layout = Layout(), segments: Optional[Segments] = None) -> Prediction:
    """Step time (objective 'train') or batch-1 forward latency ('latency'), and memory per rank.
    ``segments`` (dp = pp = 1 only) records the stretches between sync points."""
    m = work.model
    dp, pp, M = layout.dp, layout.pp, layout.microbatches
    world = cluster.world
    if world % (dp * pp):
        raise ValueError(f"dp x pp = {dp * pp} does not divide the world of {world}")
    mp = world // (dp * pp)
    latency = work.objective == "latency"
    rows = 1 if latency else work.global_batch // (dp * M)
    C = splits.seq.shape[0]
    stage_layers = balanced_split(m.num_hidden_layers, pp)
    groups = {(d, p): GroupModel(cluster, work, methods, splits,
                                 [rank_of(d, p, i, pp, mp) for i in range(mp)], rows)
              for d in range(dp) for p in range(pp)}
    if segments is not None:
        if dp * pp != 1:
            raise ValueError("segments are recorded for dp = pp = 1 only")
        groups[(0, 0)].segments = segments
    params, partial, stepped, replicated = stage_parameters(work, methods, splits, layout, mp)

    memory = np.zeros((C, world))
    detail = {}
    if latency:
        g = groups[(0, 0)]
        layer, head_ev = g.layer(), g.head()
        clock = np.tile([cluster.ranks[r].forward_overhead_s for r in g.ranks], (C, 1))
        clock = g.repeat(lambda c: run(g, layer, c), clock, m.num_hidden_layers)
        clock = run(g, head_ev, clock)
        if segments is not None:
            segments.finish(clock)
        time = clock.max(axis=1)
        working = max((e.act for e in layer + head_ev if isinstance(e, Compute)), key=lambda a: a.sum())
        memory[:, g.ranks] = params[0] * work.elem + working
        return _finish(cluster, time, memory, detail)

    opt = {r: cluster.ranks[r].optimizer for r in range(world)}
    grad_bytes = 8 if work.dtype == "float64" else 4  # gradients are reduced in the master weights' precision
    zero1 = dp > 1 and work.dp_engine == "zero1"  # optimizer state and step split over dp
    fsdp = dp > 1 and work.dp_engine == "fsdp2"
    sharded = mp > 1 and work.mp_grad_reduce == "sharded"
    stage_f, stage_b = np.zeros((pp, C)), np.zeros((pp, C))
    clocks = {}
    for (d, p), g in groups.items():
        layer, head_ev = g.layer(), g.head()
        edge = head_ev if p == pp - 1 else []
        memory[:, g.ranks] = training_memory(g, layout, p, params[p], partial[p], replicated[p])
        fsdp_units = FsdpUnits.of(work, layout, p, params[p], replicated[p], d)

        def layer_backward(clock, g=g, layer=layer):
            if layout.recompute == "full":
                clock = run(g, layer, clock)
            elif layout.recompute in RECOMPUTED:
                clock = clock + sum(e.fwd for e in layer if isinstance(e, Compute)
                                    and e.name.startswith(RECOMPUTED[layout.recompute]))
            return run(g, layer, clock, backward=True)

        def fwd_bwd(clock, g=g, layer=layer, edge=edge, layers=stage_layers[p]):
            clock = g.repeat(lambda c: run(g, layer, c), clock, layers)
            clock = run(g, edge, clock)
            f_end = clock
            clock = run(g, edge, clock, backward=True)
            return f_end, g.repeat(layer_backward, clock, layers)

        if pp == 1:
            start = np.stack([opt[r](stepped[0][:, i]) + cluster.ranks[r].step_overhead_s
                              for i, r in enumerate(g.ranks)], axis=1)
            clock = g.repeat(lambda c: fwd_bwd(c)[1], start, M)
            if fsdp_units:
                clock = clock + fsdp_exposed(cluster, work, layout, fsdp_units, (clock - start) / M)
            clocks[(d, p)] = clock
        else:
            f_end, b_end = fwd_bwd(np.zeros((C, mp)))
            if fsdp_units:  # the pipeline runs each micro-batch's share
                b_end = b_end + fsdp_exposed(cluster, work, layout, fsdp_units, b_end) / M
            f = f_end.max(axis=1)
            stage_f[p] = np.maximum(stage_f[p], f)
            stage_b[p] = np.maximum(stage_b[p], b_end.max(axis=1) - f)

    if pp > 1:
        for p in range(pp - 1):  # each boundary sends the stream forward and its gradient back
            for d in range(dp):
                a, b = groups[(d, p)], groups[(d, p + 1)]
                send = np.stack([cluster.p2p(a.ranks[i], b.ranks[i])(rows * a.tokens[:, i] * m.hidden_size * work.elem)
                                 for i in range(mp)], axis=1).max(axis=1)
                stage_f[p] = stage_f[p] + send
                stage_b[p + 1] = stage_b[p + 1] + send
        per_stage = stage_f + stage_b
        pipe = per_stage.sum(axis=0) + (M - 1) * per_stage.max(axis=0)
        opt_max = np.zeros(C)
        for (d, p), g in groups.items():
            for i, r in enumerate(g.ranks):
                opt_max = np.maximum(opt_max, opt[r](stepped[p][:, i]) + cluster.ranks[r].step_overhead_s)
        clocks = {k: np.repeat((opt_max + pipe)[:, None], mp, axis=1) for k in groups}
        detail["bubble"] = 1 - per_stage.sum(axis=0) * M / pp / np.maximum(pipe, 1e-30)

    # After the backward, in the order a step issues them (galaxy.train.loop): the dp sum of every
    # gradient, the mp sum of PARTIAL gradients (per mp_grad_reduce), the tied-embedding sum between
    # the pipeline's ends, the loss (dp sum, pp broadcast), the gradient norm (mp, then pp), and
    # after the optimizer ZeRO-1's broadcasts over dp / sharded mode's all-gather over mp.
    sent = np.zeros(C)  # global rank 0's bytes of a step, as galaxy.core.comm records them
    g0 = groups[(0, 0)]
    for events, times in ((g0.layer(), stage_layers[0]), (g0.head() if pp == 1 else [], 1)):
        for e in events:
            if isinstance(e, Collective):
                sent += times * M * e.nbytes * ((e.fwd_op is not None) + (e.bwd_op is not None))
    if pp > 1:  # stage 0 sends each micro-batch's stream forward (what it receives is not counted)
        sent += M * rows * g0.tokens[:, 0] * m.hidden_size * work.elem
    sent += sum((u.step_bytes(work, layout)[:, 0] for u in FsdpUnits.of(work, layout, 0, params[0], replicated[0])),
                np.zeros(C))

    def sync(keys: list[tuple[int, int, int]], op: str, nbytes, buckets=1) -> None:
        """One collective over the ranks ``(d, p, i)`` of ``keys``: all leave when the last arrives."""
        nonlocal sent
        if len(keys) < 2:
            return
        ranks = [groups[(d, p)].ranks[i] for d, p, i in keys]
        ab = cluster.collective(ranks, op)
        cost = np.broadcast_to(buckets * ab(np.asarray(nbytes, dtype=float) / buckets), (C,))
        start = np.max([clocks[(d, p)][:, i] for d, p, i in keys], axis=0)
        d0, p0, _ = keys[0]
        g = groups[(d0, p0)]
        record = g.segments is not None and len(keys) == mp and all((d, p) == (d0, p0) for d, p, _ in keys)
        before = clocks[(d0, p0)].copy() if record else None
        for d, p, i in keys:
            clocks[(d, p)][:, i] = start + cost
        if record:
            g.segments.sync(before, cost[:, None], clocks[(d0, p0)])
        if (0, 0, 0) in keys:
            sent = sent + nbytes

    def mp_keys(d, p):
        return [(d, p, i) for i in range(mp)]

    partial_bytes = {p: partial_gradient_bytes(work, partial[p][:, 0], dp) for p in range(pp)}
    buckets = {p: np.maximum(np.ceil(partial_bytes[p] / GRAD_BUCKET_BYTES), 1) for p in range(pp)}
    # FSDP2's gathers and reduce-scatters over dp ran inside the micro-batches (``fsdp_exposed``)
    if dp > 1 and not fsdp:
        for p in range(pp):
            for i in range(mp):  # a sharded PARTIAL bucket's dp sum moves this rank's piece only, as an FSDP shard's
                local = params[p][:, i] - (partial[p][:, i] * (1 - 1 / mp) if sharded else 0) \
                    - replicated[p][:, i] * (1 - 1 / mp)
                sync([(d, p, i) for d in range(dp)], "all_reduce", local * grad_bytes)
    for (d, p) in groups:
        if mp > 1 and partial_bytes[p].max() > 0:
            sync(mp_keys(d, p), "reduce_scatter" if sharded else "all_reduce", partial_bytes[p], buckets[p])
    tied = tied_params(m) if pp > 1 else 0
    for d in range(dp):
        for i in range(mp):
            if tied:
                sync([(d, 0, i), (d, pp - 1, i)], "all_reduce", tied * grad_bytes)
    for i in range(mp):
        for _ in range(2):  # the loss-target count and the loss, summed over dp on the last stage
            sync([(d, pp - 1, i) for d in range(dp)], "all_reduce", 8)
        for d in range(dp):  # the loss, broadcast from the last stage
            sync([(d, p, i) for p in range(pp)], "all_reduce", 8)
    for (d, p) in groups:  # the squared gradient norm: over mp, then over pp (FSDP2: over dp first)
        if fsdp and d == 0:
            for i in range(mp):
                sync([(e, p, i) for e in range(dp)], "all_reduce", 8)
        if mp > 1:
            sync(mp_keys(d, p), "all_reduce", 8)
    for d in range(dp):
        for i in range(mp):
            sync([(d, p, i) for p in range(pp)], "all_reduce", 8)
    for (d, p) in groups:  # after the optimizer: the updated weights gathered back
        if sharded and partial_bytes[p].max() > 0:
            sync(mp_keys(d, p), "all_gather", partial_bytes[p], buckets[p])
    if zero1:
        for p in range(pp):
            for i in range(mp):
                sync([(d, p, i) for d in range(dp)], "all_gather", params[p][:, i] * grad_bytes)
    end = np.zeros(C)
    for (d, p), g in groups.items():
        if g.segments is not None:
            g.segments.finish(clocks[(d, p)])
        end = np.maximum(end, clocks[(d, p)].max(axis=1))
    detail["comm_bytes"] = sent
    return _finish(cluster, end, memory, detail)


def _finish(cluster: ClusterProfile, time: np.ndarray, memory: np.ndarray, detail: dict) -> Prediction:
    budget = np.array([r.memory_bytes for r in cluster.ranks], dtype=float)
    return Prediction(time, memory, (memory <= budget).all(axis=1), detail)


# ----------------------------------------------------------------------------- a lower bound over every split

BOUND_POINTS = 256  # shares of a split variable at which the bound evaluates its pieces (every share when fewer)
SIZED_BY = {"heads": ("att_proj.heads", "att_core.heads"), "ffn": ("mlp.ffn",),
            "seq": ("att_proj.tokens", "att_core.tokens", "mlp.tokens", "con.tokens", "head.tokens")}


def bound_points(cluster: ClusterProfile, var: str, unit: int, count: int, most: int = BOUND_POINTS,
                 memory: bool = False) -> np.ndarray:
    """Shares (in units, ascending, from 1 to ``count``) at which ``lower_bound`` evaluates the pieces
    that ``var`` sizes (their saved bytes, for ``memory``): every share when at most ``most``; else
    ``most`` evenly spaced ones and both neighbours of every knot of those pieces' curves, so that each
    piece is linear between two consecutive points (up to its clamp at zero) and its least value
    between them is at one of the two."""
    if count <= most:
        return np.arange(1, count + 1)
    knots = set()
    for rank in cluster.ranks:
        for size in rank.knots(SIZED_BY[var], memory):
            knots.update((math.floor(size / unit), math.ceil(size / unit)))
    inside = [k for k in knots if 1 <= k <= count]
    return np.unique(np.concatenate([np.linspace(1, count, most).round(), inside])).astype(np.int64)


def least_makespan(table: np.ndarray, weights: np.ndarray, units: int) -> float:
    """A lower bound on ``min over splits x of max_i cost_i(x_i)`` (each rank at least one unit, ``units``
    in all), where ``table[k, i]`` is at most rank i's cost at any share of bucket k and bucket k holds
    ``weights[k]`` consecutive shares, the buckets in ascending order and covering 1..units. Each
    column is replaced by its running minimum from the end (non-decreasing, still below the costs);
    then a makespan T lets rank i take every share of the buckets up to T, and the least T that lets
    the ranks take ``units`` between them is the ``units``-th smallest share cost."""
    env = np.minimum.accumulate(table[::-1], axis=0)[::-1]
    values = env.ravel()
    order = np.argsort(values, kind="stable")
    taken = np.cumsum(np.repeat(weights, table.shape[1])[order])
    kth = values[order[min(int(np.searchsorted(taken, units)), len(order) - 1)]]
    return float(max(env[0].max(), kth))


class _Program:
    """One group's step as the bound walks it: compute items (a key and its per-rank table over the
    bound's points), sync items (a key, seconds until the waiting members leave, until the last to
    arrive leaves) and repeated blocks."""

    def __init__(self, probe: GroupModel, balanced: GroupModel, buckets: dict[str, np.ndarray],
                 recompute: str, edge: bool):
        self.tables: dict[tuple, tuple[Optional[str], np.ndarray]] = {}
        self.buckets = buckets
        layer, bal_layer = probe.layer(), balanced.layer()
        head, bal_head = (probe.head(), balanced.head()) if edge else ([], [])
        forward = self.items("L", layer, balanced, bal_layer, False)
        back = self.items("L", layer, balanced, bal_layer, True)
        if recompute == "full":
            back = forward + back
        elif recompute in RECOMPUTED:
            back = [it for it in forward
                    if it[0] == "c" and layer[it[1][1]].name.startswith(RECOMPUTED[recompute])] + back
        self.layer_forward, self.layer_backward = forward, back
        self.edge_forward = self.items("H", head, balanced, bal_head, False)
        self.edge_backward = self.items("H", head, balanced, bal_head, True)

    def items(self, where: str, events: list, balanced: GroupModel, balanced_events: list, backward: bool) -> list:
        """``events`` (the probe's) as items; collectives timed at ``balanced``'s bytes."""
        out = []
        for k, (e, b) in enumerate(zip(events, balanced_events)):
            if isinstance(e, Compute):
                key = (where, k, "b" if backward else "f")
                if key not in self.tables:
                    values = e.bwd if backward else e.fwd
                    if e.var in self.buckets:
                        points = values[:len(self.buckets[e.var])]
                        self.tables[key] = (e.var, np.concatenate([np.minimum(points[:-1], points[1:]),
                                                                   points[-1:]]))
                    else:
                        self.tables[key] = (None, values[0])
                out.append(("c", key))
            else:
                op = b.bwd_op if backward else b.fwd_op
                if op is not None:
                    waited, slowest = (float(t[0]) for t in balanced.link_seconds(op, b.wire))
                    out.append(("s", (where, k, "b" if backward else "f"), waited, slowest))
        return out[::-1] if backward else out


def _has_sync(items: list) -> bool:
    return any(it[0] == "s" or (it[0] == "rep" and it[2] > 0 and _has_sync(it[1])) for it in items)


class _Walk:
    """Walks a program through the barrier relaxation of the simulation. At a sync the last member
    to arrive leaves ``slowest`` after its arrival and the others ``waited`` after it; so the next
    sync's last arrival comes at least ``waited`` + the largest compute between, and at least
    ``slowest`` + the smallest (the last member's own) after this one's. Minimising each stretch over
    the splits on its own (``least_makespan`` per variable, every other variable at its least
    cost) bounds every split's step from below. Stretches of repeated blocks are scored once."""

    def __init__(self, program: _Program, units: dict[str, tuple[int, int]], weights: dict[str, np.ndarray],
                 start: np.ndarray):
        self.program, self.units, self.weights, self.start = program, units, weights, start
        self.memo: dict = {}

    def stretch(self, open_: dict, prev: Optional[tuple], first: bool) -> float:
        key = (frozenset(open_.items()), prev[0] if prev else None, first)
        if key in self.memo:
            return self.memo[key]
        by_var: dict[str, np.ndarray] = {}
        const = self.start.copy() if first else np.zeros_like(self.start)
        for item, count in open_.items():
            var, table = self.program.tables[item]
            if var is None:
                const = const + count * table
            else:
                by_var[var] = by_var.get(var, 0) + count * table
        least = {v: np.minimum.accumulate(t[::-1], axis=0)[-1] for v, t in by_var.items()}  # per rank, any share
        base = const + sum(least.values(), np.zeros_like(const))
        makespan = max([least_makespan(t + (base - least[v])[None, :], self.weights[v], self.units[v][1])
                        for v, t in by_var.items()] or [float(base.max())])
        value = makespan if prev is None else max(prev[1] + makespan, prev[2] + float(base.min()))
        self.memo[key] = value
        return value

    def run(self, items: list, state: tuple) -> tuple[float, tuple]:
        """(the bound's seconds of ``items``, the state after): state = (open stretch as item -> count,
        the last sync item, whether the stretch holds the step's start)."""
        total = 0.0
        open_, prev, first = state
        for item in items:
            if item[0] == "c":
                open_ = {**open_, item[1]: open_.get(item[1], 0) + 1}
            elif item[0] == "s":
                total += self.stretch(open_, prev, first)
                open_, prev, first = {}, item[1:], False
            else:
                _, block, times = item
                if times == 0:
                    continue
                once, after = self.run(block, (open_, prev, first))
                if times > 1 and _has_sync(block):  # every pass after the first starts where the second did
                    again, after = self.run(block, after)
                    once += (times - 1) * again
                elif times > 1:  # compute only: the open stretch grows by the same each pass
                    grown = after[0]
                    after = ({k: open_.get(k, 0) + times * (grown.get(k, 0) - open_.get(k, 0)) for k in grown},
                             prev, first)
                total += once
                open_, prev, first = after
        return total, (open_, prev, first)

    def finish(self, items: list) -> float:
        total, (open_, prev, first) = self.run(items, ({}, None, True))
        return total + self.stretch(open_, prev, first)


def lower_bound(cluster: ClusterProfile, work: Workload, methods: tuple[Method, Method, Method], layout: Layout,
                units: dict[str, tuple[int, int]], uses: tuple[str, ...]) -> float:
    """Seconds that no split of ``methods`` under ``layout`` beats in ``predict`` (memory budgets
    ignored). ``units``: per split variable (heads, ffn, seq) its unit and count of units; ``uses``:
    the variables the split search varies (the others balanced).

    Each group's step is bounded by ``_Walk`` from below (its compute at its least over the shares,
    the collectives at the balanced split's bytes, which no split lowers: uneven pieces are padded
    to the largest). With one stage the step is at least any group's clocks after its micro-batches
    (the syncs after only add); with a pipeline at least the optimizer, the sum of the stages' bounds
    and (micro-batches - 1) times the largest (the sends add). Of the syncs after the backward it
    counts a group's own (``predict``'s mp-group sums of PARTIAL gradients, the norm, sharded mode's
    gather), whose bytes no split changes; the others only add."""
    m = work.model
    dp, pp, M = layout.dp, layout.pp, layout.microbatches
    mp = cluster.world // (dp * pp)
    latency = work.objective == "latency"
    rows = 1 if latency else work.global_batch // (dp * M)
    points = {v: bound_points(cluster, v, *units[v]) for v in uses}
    weights = {v: np.append(np.diff(p), 1) for v, p in points.items()}
    C = max((len(p) for p in points.values()), default=1)

    def column(var: str) -> np.ndarray:
        unit, count = units[var]
        if var in points:
            shares = np.pad(points[var], (0, C - len(points[var])), mode="edge")
            return np.repeat(shares[:, None] * unit, mp, axis=1)
        return np.tile(balanced_split(count * unit, mp), (C, 1))

    probe = Splits(column("heads"), column("ffn"), column("seq"))
    even = Splits.one(*(balanced_split(units[v][0] * units[v][1], mp) for v in ("heads", "ffn", "seq")))
    stage_layers = balanced_split(m.num_hidden_layers, pp)
    partial = stage_parameters(work, methods, even, layout, mp)[1]  # PARTIAL weights: the same on every split
    stepped = stage_parameters(work, methods, probe, layout, mp)[2]  # row 0: every share at its least
    sharded = mp > 1 and work.mp_grad_reduce == "sharded"

    def tail(ranks: list[int], p: int) -> list:
        """The group's own syncs after the backward, as sync items (every member leaves together)."""
        if mp == 1 or latency:
            return []
        nbytes = float(partial_gradient_bytes(work, partial[p][0, 0], dp))
        buckets = max(math.ceil(nbytes / GRAD_BUCKET_BYTES), 1)
        syncs = [("reduce_scatter" if sharded else "all_reduce", nbytes)] if nbytes > 0 else []
        syncs += [("all_reduce", 8.0)] + ([("all_gather", nbytes)] if sharded and nbytes > 0 else [])
        out = []
        for k, (op, size) in enumerate(syncs):
            n = buckets if size == nbytes else 1
            cost = float(n * cluster.collective(ranks, op)(size / n))
            out.append(("s", ("T", k, op), cost, cost))
        return out

    def group_bound(d: int, p: int, start: np.ndarray, micro_batches: int) -> float:
        ranks = [rank_of(d, p, i, pp, mp) for i in range(mp)]
        prog = _Program(GroupModel(cluster, work, methods, probe, ranks, rows),
                        GroupModel(cluster, work, methods, even, ranks, rows), points,
                        "none" if latency else layout.recompute, latency or p == pp - 1)
        L = stage_layers[p]
        if latency:
            items = [("rep", prog.layer_forward, L)] + prog.edge_forward
        else:
            items = [("rep", [("rep", prog.layer_forward, L)] + prog.edge_forward + prog.edge_backward
                      + [("rep", prog.layer_backward, L)], micro_batches)]
        return _Walk(prog, units, weights, start).finish(items + (tail(ranks, p) if pp == 1 else []))

    if latency:
        return group_bound(0, 0, np.array([cluster.ranks[r].forward_overhead_s for r in range(mp)]), 1)
    def optimizer(d: int, p: int) -> np.ndarray:
        """Each rank's optimizer step and overhead, at its least parameters (the optimizer's time grows with them)."""
        return np.array([float(cluster.ranks[r].optimizer(stepped[p][0, i])) + cluster.ranks[r].step_overhead_s
                         for i, r in enumerate(rank_of(d, p, i, pp, mp) for i in range(mp))])

    if pp == 1:
        return max(group_bound(d, 0, optimizer(d, 0), M) for d in range(dp))
    stages = [max(group_bound(d, p, np.zeros(mp), 1) for d in range(dp)) for p in range(pp)]
    optimizer = max(optimizer(d, p).max() for d in range(dp) for p in range(pp))
    after = max(sum(item[2] for item in tail([rank_of(0, p, i, pp, mp) for i in range(mp)], p)) for p in range(pp))
    return optimizer + sum(stages) + (M - 1) * max(stages) + after


def convex_hull_slopes(x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """The lower convex hull of the points (``x`` ascending): its value at ``x[0]``, and the slopes
    and widths of its segments (slopes ascending)."""
    hull: list[int] = []
    for k in range(len(x)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (y[b] - y[a]) * (x[k] - x[a]) >= (y[k] - y[a]) * (x[b] - x[a]):  # b on or above the chord a-k
                hull.pop()
            else:
                break
        hull.append(k)
    xs, ys = x[hull].astype(float), y[hull]
    return float(ys[0]), np.diff(ys) / np.diff(xs), np.diff(xs)


def might_fit(cluster: ClusterProfile, work: Workload, methods: tuple[Method, Method, Method], layout: Layout,
              units: dict[str, tuple[int, int]], uses: tuple[str, ...]) -> bool:
    """False only where no split of ``methods`` under ``layout`` fits every rank's memory budget
    (training). A rank's memory (``training_memory``) is a sum of terms each sized by one split
    variable, each linear between the ``bound_points`` of its variable (where a saved-bytes curve is
    clamped at zero between two of them, nothing is claimed); so for each group and each variable the
    shares are scored at those points with every other variable at one unit. No split
    fits where some rank's least memory over its shares is above its budget, where every split of one
    variable (the others at their least) leaves a rank above its budget (``least_makespan`` of the
    overruns), or where the group's least total is above the group's budgets together: the least
    total gives each rank the lower convex hull of its own terms and hands out the units by
    increasing marginal cost, which no split's total undercuts."""
    if work.objective != "train":
        return True
    dp, pp = layout.dp, layout.pp
    mp = cluster.world // (dp * pp)
    rows = work.global_batch // (dp * layout.microbatches)
    points = {v: bound_points(cluster, v, *units[v], memory=True) for v in uses}
    blocks, at = {}, 1
    for v in uses:
        blocks[v] = slice(at, at + len(points[v]))
        at += len(points[v])

    def column(var: str) -> np.ndarray:
        unit, count = units[var]
        if var not in points:
            return np.tile(balanced_split(count * unit, mp), (at, 1))
        shares = np.ones(at, dtype=np.int64)
        shares[blocks[var]] = points[var]
        return np.repeat(shares[:, None] * unit, mp, axis=1)

    probe = Splits(column("heads"), column("ffn"), column("seq"))
    params, partial, _, replicated = stage_parameters(work, methods, probe, layout, mp)
    budget = np.array([r.memory_bytes for r in cluster.ranks], dtype=float)
    for d in range(dp):
        for p in range(pp):
            ranks = [rank_of(d, p, i, pp, mp) for i in range(mp)]
            g = GroupModel(cluster, work, methods, probe, ranks, rows)
            for e in g.layer() + g.head():  # a saved-bytes curve clamped at zero between two points bends there
                if isinstance(e, Compute) and e.var in points and len(points[e.var]) < units[e.var][1]:
                    positive = e.act[blocks[e.var]] > 0
                    if (positive[1:] != positive[:-1]).any():
                        return True
            memory = training_memory(g, layout, p, params[p], partial[p], replicated[p])
            ones = memory[0]
            terms = {v: memory[blocks[v]] - ones for v in uses}  # [points, mp]: each variable's own part
            least = ones + sum((t.min(axis=0) for t in terms.values()), np.zeros(mp))
            if (least > budget[ranks]).any():
                return False
            for v, t in terms.items():  # the least over v's splits of the largest overrun, the others at their least
                over = t + (least - t.min(axis=0) - budget[ranks])[None, :]
                buckets = np.concatenate([np.minimum(over[:-1], over[1:]), over[-1:]])
                if least_makespan(buckets, np.append(np.diff(points[v]), 1), units[v][1]) > 0:
                    return False
            total = ones.sum()
            for v, t in terms.items():
                start, slopes, widths = zip(*(convex_hull_slopes(points[v], t[:, i]) for i in range(mp)))
                total += sum(start)
                slopes, widths = np.concatenate(slopes), np.concatenate(widths)
                order = np.argsort(slopes, kind="stable")
                left = units[v][1] - mp  # every rank holds one unit already
                before = np.concatenate([[0], np.cumsum(widths[order])[:-1]])  # units handed out before each
                taken = np.minimum(widths[order], np.maximum(left - before, 0))
                total += float((slopes[order] * taken).sum())
            if total > budget[ranks].sum():
                return False
    return True
