"""One model-parallel group's step as events: each layer's pieces (compute at each rank's measured speed,
``Compute``) and collectives (``Collective``), in the order a rank runs them, with the clock primitives the
simulation (``simulate``), the memory model (``memory``) and the bounds (``bounds``) share: a collective is
a sync point of its group (the slowest member sets when it starts), a repeated layer or micro-batch is
simulated until its clocks repeat (``GroupModel.repeat``), and ``Segments`` records the stretches between
sync points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from galaxy.config import Method
from galaxy.core.transitions import TRANSITION_OPS
from galaxy.models import family
from galaxy.planner.cluster import WHOLE_SIZES, ClusterProfile
from galaxy.planner.workload import LAYOUTS, Splits, Workload, stream_layout

# recompute modes that run some of a layer's pieces again in backward: the pieces' name prefix
RECOMPUTED = {"selective": "att_core", "mlp": "mlp"}


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
    nbytes: int  # the full tensor (what galaxy.core.comm records; an all-to-all: rank 0's input, [C])
    wire: np.ndarray  # [C] bytes charged (uneven pieces are padded to the largest)
    name: str = ""
    bwd_nbytes: Optional[np.ndarray] = None  # the backward's record where it differs (an all-to-all's)
    least_wire: Optional[np.ndarray] = None  # [C] what no split charges less (None: the even split's ``wire``)


@dataclass
class Ring(Compute):
    """ATT.sp's ring attention (``sp_attention: ring``): the attention core (``fwd``/``bwd``: every step's
    block together) in N steps, each overlapped with the transfer of the next K/V block to the next rank, and
    in backward of the next block and of the dK/dV accumulator. The members enter together (a step needs the
    neighbour's block) and go at the pace of the slowest: per step the larger of the slowest member's share of
    the compute and the transfer, the last step's compute alone (backward: and the accumulators' last hop
    home). ``kv``/``dkv``: ``[C, mp]`` bytes of each rank's K/V block and of its accumulator."""

    kv: Optional[np.ndarray] = None
    dkv: Optional[np.ndarray] = None

    def seconds(self, group: "GroupModel", backward: bool) -> np.ndarray:
        n = self.kv.shape[1]
        link = group.cluster.collective(group.ranks, "send_recv")
        block = link(self.kv.max(axis=1))
        step = (self.bwd if backward else self.fwd).max(axis=1) / n
        if not backward:
            return (n - 1) * np.maximum(step, block) + step
        home = link(self.dkv.max(axis=1))
        return (n - 1) * np.maximum(step, block + home) + step + home

    def records(self, rank: int) -> list[tuple[str, np.ndarray, str]]:
        """(op, bytes [C], phase) of every exchange rank ``rank`` makes, in order (``galaxy.core.sp_attention``):
        forward the blocks of ranks r, r-1, ... (every one but r+1's); backward the blocks of r, r+1, ... (every
        one but r-1's) each followed by its accumulator, and the last accumulator (r-1's block)."""
        n = self.kv.shape[1]
        out = [("send_recv", self.kv[:, (rank - t) % n], "fwd") for t in range(n - 1)]
        for t in range(n):
            if t < n - 1:
                out.append(("send_recv", self.kv[:, (rank + t) % n], "bwd"))
            out.append(("send_recv", self.dkv[:, (rank + t) % n], "bwd"))
        return out


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
        self.mode_costs: dict = {}  # memory mode -> its memory.ModeCost (memory.stage_mode_costs fills it)

    def piece(self, name: str, sizes: np.ndarray, var: Optional[str] = None) -> Compute:
        """Piece ``name`` at each rank's ``sizes`` (``[C, mp]``), which come from split ``var``."""
        latency = self.work.objective == "latency"
        out = [np.empty(sizes.shape) for _ in range(3)]
        if sizes.dtype.kind in "iu" and sizes.size and 0 <= sizes.min() and sizes.max() < WHOLE_SIZES:
            most = int(sizes.max())
            for i, r in enumerate(self.ranks):
                column = sizes[:, i]
                for o, table in zip(out, self.cluster.ranks[r].whole_sizes(name, self.rows, most, latency)):
                    o[:, i] = table[column]
        else:
            for i, r in enumerate(self.ranks):
                for o, values in zip(out, self.cluster.ranks[r].piece(name, self.rows, sizes[:, i], latency)):
                    o[:, i] = values
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
            events += [self.piece("att_proj.tokens", s.seq, "seq")] + self._sequence_parallel_attention()
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

    def _sequence_parallel_attention(self) -> list:
        """ATT.sp's core and collectives in the workload's ``sp_attention`` flavour (``galaxy.core.sp_attention``),
        bytes as galaxy.core.comm records them. allgather: K and V gathered (each rank then holds all of
        them: the core piece keeps the whole K/V). ring: the core piece's compute (a causal model's zigzag
        steps skip the blocks the mask hides: about half the dense core the piece times, whose output
        projection is in that half too) overlapped with N-1 point-to-point blocks; it keeps this rank's K/V
        only. ulysses: q, k and v to head shards in one all-to-all (a GQA kv head to every rank whose query
        heads read it), the core of this rank's heads over every token, the output back in another; each
        charged at the larger of its forward and backward inputs of the most loaded rank."""
        m, s, work, rows = self.work.model, self.splits, self.work, self.rows
        S, d = work.seq_length, m.head_dim
        kv_token = 2 * m.kv_heads * d * work.elem  # one token's K and V
        if work.sp_attention == "ulysses":
            H, group = m.num_attention_heads, m.num_attention_heads // m.kv_heads
            first = np.cumsum(s.heads, axis=1) - s.heads
            kv_heads = (first + s.heads - 1) // group - first // group + 1  # the kv heads each rank's queries read
            qkv = rows * s.seq * d * (H + 2 * kv_heads.sum(axis=1, keepdims=True)) * work.elem
            qkv_back = rows * S * d * (s.heads + 2 * kv_heads) * work.elem
            out, out_back = rows * s.heads * S * d * work.elem, rows * H * s.seq * d * work.elem
            # no split does better than the most tokens and heads a rank must take, each kv head sent once
            tokens, heads = -(-S // self.mp), -(-H // self.mp)
            least_qkv = rows * d * max(tokens * (H + 2 * m.kv_heads), S * (heads + 2 * -(-heads // group))) * work.elem
            least_out = rows * d * max(heads * S, H * tokens) * work.elem
            C = len(s.seq)
            return [Collective("all_to_all", "all_to_all", qkv[:, 0], np.maximum(qkv, qkv_back).max(axis=1),
                               "q,k,v to heads", qkv_back[:, 0], np.full(C, least_qkv)),
                    self.piece("att_core.heads", s.heads, "heads"),
                    Collective("all_to_all", "all_to_all", out[:, 0], np.maximum(out, out_back).max(axis=1),
                               "output to tokens", out_back[:, 0], np.full(C, least_out))]
        core = self.piece("att_core.tokens", s.seq, "seq")
        if work.sp_attention == "ring":
            share = (S + 1) / (2 * S) if family(m.model_type).causal else 1.0
            accumulated = 2 * m.kv_heads * d * max(work.elem, 4)  # dK/dV accumulate in fp32 at least
            return [Ring(core.fwd * share, core.bwd * share, np.maximum(core.act - rows * (S - s.seq) * kv_token, 0),
                         "ring attention", "seq", rows * s.seq * kv_token, rows * s.seq * accumulated)]
        kv_wire = self.padded / self.h * 2 * m.kv_heads * m.head_dim
        return [Collective("all_gather", "reduce_scatter", rows * S * kv_token, kv_wire, "K,V gather"), core]

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
        latest = clock.argmax(axis=1)  # ties: one of them is last in a real run
        C, mp = clock.shape
        at = latest + np.arange(0, C * mp, mp)  # flat positions (a search calls this a lot: few numpy calls)
        last = clock.ravel()[at]  # (a row's maximum: one pass over the clocks, not two)
        leave = np.repeat(last + waited, mp).reshape(C, mp)
        leave.ravel()[at] = last + slowest
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
                    and all(a.shape == b.shape and (a == b).all() for a, b in zip(seen, previous)):
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
        if isinstance(e, Ring):
            seconds = e.seconds(group, backward)
            clock = group.leave("send_recv", None, clock, (seconds, seconds))
        elif isinstance(e, Compute):
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

    def records(e, backward: bool) -> list:
        if isinstance(e, Ring):
            return [(op, int(n[0]), phase) for op, n, phase in e.records(0) if (phase == "bwd") == backward]
        if not isinstance(e, Collective) or (e.bwd_op if backward else e.fwd_op) is None:
            return []
        nbytes = e.bwd_nbytes if backward and e.bwd_nbytes is not None else e.nbytes
        return [(e.bwd_op if backward else e.fwd_op, int(np.asarray(nbytes).flat[0]), "bwd" if backward else "fwd")]
    return [r for e in events for r in records(e, False)] + [r for e in reversed(events) for r in records(e, True)]
