"""Measure a cluster on the ranks it runs on: each rank times the real ATT, CON and MLP blocks of
the model (``galaxy.models``) at the candidate shard sizes, forward and backward, with the bytes
they save for backward; its optimizer step by parameter count; its memory budget; and every group
a plan can use times all-reduce, all-gather and reduce-scatter by message size (alpha-beta fits).

All ranks measure at the same time, as they compute during training, so shared cores and links
are measured under the contention a run sees. Any backend works: CPU/Gloo, CUDA/NCCL, emulated.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from galaxy.config import Method, ModelConfig, Plan
from galaxy.core.attention import attention
from galaxy.core.comm import Communicator
from galaxy.core.context import ParallelContext, rank_of
from galaxy.core.layers import Dropout
from galaxy.planner.cluster import OPS, AlphaBeta, Cluster, Curve, Piece, RankProfile

logger = logging.getLogger(__name__)

FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8, 1.0)
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


def grid(total: int, unit: int = 1, most: int = 16) -> list[int]:
    """Candidate shard sizes: multiples of ``unit`` up to ``total``, all of them when few, else
    the fractions of ``FRACTIONS`` rounded to the unit."""
    count = total // unit
    if count <= most:
        return [unit * k for k in range(1, count + 1)]
    return sorted({max(unit, round(total * f / unit) * unit) for f in FRACTIONS})


def candidate_groups(world: int) -> list[tuple[int, ...]]:
    """Every mp, dp, pp and adjacent-stage group of every factorisation world = dp x pp x mp."""
    found: list[tuple[int, ...]] = []
    for dp in range(1, world + 1):
        for pp in range(1, world // dp + 1):
            if world % (dp * pp):
                continue
            mp = world // (dp * pp)
            at = lambda d, p, m: rank_of(d, p, m, pp, mp)  # noqa: E731
            families = [[at(d, p, m) for m in range(mp)] for d in range(dp) for p in range(pp)]
            families += [[at(d, p, m) for d in range(dp)] for p in range(pp) for m in range(mp)]
            families += [[at(d, p, m) for p in range(pp)] for d in range(dp) for m in range(mp)]
            families += [[at(d, p, m), at(d, p + 1, m)] for d in range(dp) for p in range(pp - 1) for m in range(mp)]
            for g in families:
                if len(g) > 1 and tuple(g) not in found:
                    found.append(tuple(g))
    return found


# ----------------------------------------------------------------------------- the blocks, one rank


class BlockBench:
    """The model's own block modules on one rank, built with a one-rank plan whose TP shard is the
    size under test (the rank holds ``heads`` heads / ``ffn`` columns as rank 0 of a wider split)."""

    def __init__(self, m: ModelConfig, rows: int, seq: int, device: torch.device, dtype: str):
        self.m, self.rows, self.seq, self.device = m, rows, seq, device
        self.dtype = TORCH_DTYPES[dtype]
        self.ctx = ParallelContext.serial(device)
        self.bert = m.model_type == "bert"

    def plan(self, heads: int, ffn: int) -> Plan:
        m = self.m
        H, F_ = m.num_attention_heads, m.intermediate_size
        att = Method.TP if heads < H else Method.NONE
        mlp = Method.TP if ffn < F_ else Method.NONE
        return Plan(att, Method.NONE, mlp, (heads, H - heads) if heads < H else (H,),
                    (ffn, F_ - ffn) if ffn < F_ else (F_,), (self.seq,))

    def _ready(self, module: torch.nn.Module) -> torch.nn.Module:
        module = module.to(self.device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0 if name.endswith("weight") else 0.0)
        return module.to(self.dtype if self.dtype == torch.float64 else torch.float32)

    def _x(self, tokens: int, width: Optional[int] = None) -> torch.Tensor:
        return torch.randn(self.rows, tokens, width or self.m.hidden_size, device=self.device,
                           requires_grad=True)

    def att_proj(self, heads: int, tokens: int):
        m = self.m
        plan = self.plan(heads, m.intermediate_size)
        x = self._x(tokens)
        if self.bert:
            from galaxy.models.bert import BertSelfAttention

            a = self._ready(BertSelfAttention(m, plan, self.ctx))
            return [x], lambda x: (a.query(x), a.key(x), a.value(x))
        from galaxy.models.llama import LlamaAttention, LlamaRotaryEmbedding, RopeAt

        a = self._ready(LlamaAttention(m, plan, self.ctx, 0))
        cos, sin = LlamaRotaryEmbedding(m)(torch.arange(self.seq, device=self.device)[None], torch.float32)
        rope, idx = RopeAt(cos, sin, m.kernels), torch.arange(tokens, device=self.device)

        def run(x):
            b, s, _ = x.shape
            q = a.q_proj(x).view(b, s, a.num_heads, a.head_dim).transpose(1, 2)
            k = a.k_proj(x).view(b, s, a.num_kv_heads, a.head_dim).transpose(1, 2)
            q, k = rope(q, k, idx)
            return q, k, a.v_proj(x)
        return [x], run

    def att_core(self, heads: int, q_tokens: int, kv_tokens: int):
        m = self.m
        plan = self.plan(heads, m.intermediate_size)
        d, kv_heads = m.head_dim, heads // (m.num_attention_heads // m.kv_heads)
        if self.bert:
            from galaxy.models.bert import BertSelfOutput

            out = self._ready(BertSelfOutput(m, plan, self.ctx)).dense
        else:
            from galaxy.models.llama import LlamaAttention

            out = self._ready(LlamaAttention(m, plan, self.ctx, 0)).o_proj
        dropout = Dropout(m.attention_probs_dropout_prob, self.ctx.generator(sharded=True))
        q = torch.randn(self.rows, heads, q_tokens, d, device=self.device, requires_grad=True)
        k, v = (torch.randn(self.rows, kv_heads, kv_tokens, d, device=self.device, requires_grad=True)
                for _ in range(2))

        def run(q, k, v):
            o = attention(q, k, v, causal=not self.bert, q_offset=kv_tokens - q_tokens, dropout=dropout)
            return out(o.transpose(1, 2).reshape(self.rows, q_tokens, heads * d))
        return [q, k, v], run

    def mlp(self, ffn: int, tokens: int):
        m = self.m
        plan = self.plan(m.num_attention_heads, ffn)
        x = self._x(tokens)
        if self.bert:
            from galaxy.models.bert import BertIntermediate, BertOutput

            inter, out = self._ready(BertIntermediate(m, plan, self.ctx)), self._ready(BertOutput(m, plan, self.ctx))
            return [x], lambda x: out.dense(inter(x))
        from galaxy.models.llama import LlamaMLP

        mlp = self._ready(LlamaMLP(m, plan, self.ctx))
        return [x], mlp

    def con(self, tokens: int):
        m = self.m
        a, h = self._x(tokens), self._x(tokens)
        dropout = Dropout(m.hidden_dropout_prob, self.ctx.generator(sharded=True))
        if self.bert:
            from galaxy.models.bert import LayerNorm

            norm = self._ready(LayerNorm(m.hidden_size, m.layer_norm_eps, m.kernels))
            return [a, h], lambda a, h: norm(dropout(a) + h)
        from galaxy.models.llama import LlamaRMSNorm

        norm = self._ready(LlamaRMSNorm(m.hidden_size, m.rms_norm_eps, m.kernels))

        def run(a, h):
            h = h + dropout(a)
            return h, norm(h)
        return [a, h], run

    def head(self, tokens: int):
        """Embeddings, output head and the loss of ``tokens`` tokens."""
        m = self.m
        ids = torch.randint(0, m.vocab_size, (self.rows, tokens), device=self.device)
        plan = self.plan(m.num_attention_heads, m.intermediate_size)
        if self.bert:
            from galaxy.models.bert import BertEmbeddings, BertOnlyMLMHead

            emb = self._ready(BertEmbeddings(m, plan, self.ctx))
            head = self._ready(BertOnlyMLMHead(m, plan, emb.word_embeddings))
            types = torch.zeros_like(ids)
            logits = lambda: head(emb(ids, types, 0))  # noqa: E731
        else:
            from galaxy.models.llama import LlamaRMSNorm

            emb = self._ready(torch.nn.Embedding(m.vocab_size, m.hidden_size))
            norm = self._ready(LlamaRMSNorm(m.hidden_size, m.rms_norm_eps, m.kernels))
            lm_head = emb.weight if m.tie_word_embeddings else self._ready(
                torch.nn.Linear(m.hidden_size, m.vocab_size, bias=False)).weight
            logits = lambda: F.linear(norm(emb(ids)), lm_head)  # noqa: E731
        return [], lambda: F.cross_entropy(logits().float().reshape(-1, m.vocab_size), ids.reshape(-1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def saved_bytes(fn: Callable, inputs: list) -> int:
    """Bytes of the tensors autograd saves for backward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


class PieceRun:
    """One piece at one size, ready to run forward and backward again and again."""

    def __init__(self, bench: BlockBench, make: Callable):
        self.device = bench.device
        self.inputs, self.fn = make()
        self.autocast = (torch.autocast(bench.device.type, dtype=bench.dtype)
                         if bench.dtype in (torch.bfloat16, torch.float16)
                         else torch.autocast(bench.device.type, enabled=False))
        self.grads = None

    def forward(self) -> list[torch.Tensor]:
        with self.autocast:
            out = self.fn(*self.inputs)
        return [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]

    def once(self) -> tuple[float, float]:
        _sync(self.device)
        t0 = time.perf_counter()
        outs = self.forward()
        _sync(self.device)
        t1 = time.perf_counter()
        self.grads = self.grads or [torch.randn_like(o) for o in outs]
        torch.autograd.backward(outs, self.grads)
        _sync(self.device)
        t2 = time.perf_counter()
        for x in self.inputs:
            x.grad = None
        return t1 - t0, t2 - t1

    def saved(self) -> int:
        with self.autocast:
            return saved_bytes(self.fn, self.inputs)


def time_pieces(bench: BlockBench, makes: list[Callable], reps: int,
                barrier: Callable[[], None]) -> list[tuple[float, float, int]]:
    """Median forward and backward seconds, and saved bytes, of one piece at several sizes. The
    sizes take turns within each repetition, so a burst of load from elsewhere disturbs one
    sample of many sizes rather than every sample of one (the median then drops it)."""
    runs = [PieceRun(bench, make) for make in makes]
    samples: list[list[tuple[float, float]]] = [[] for _ in runs]
    for i in range(reps + 1):  # the first round warms up
        for run, taken in zip(runs, samples):
            barrier()
            t = run.once()
            if i:
                taken.append(t)
    return [(statistics.median(f for f, _ in taken), statistics.median(b for _, b in taken), run.saved())
            for run, taken in zip(runs, samples)]


def measure_blocks(m: ModelConfig, rows: int, seq: int, device: torch.device, dtype: str, reps: int,
                   barrier: Callable[[], None], ffn_unit: int = 1) -> dict[str, Piece]:
    bench = BlockBench(m, rows, seq, device, dtype)
    H, F_ = m.num_attention_heads, m.intermediate_size
    heads = grid(H, H // m.kv_heads)
    tokens = grid(seq)
    ffns = grid(F_, ffn_unit)
    plan = {
        "att_proj.heads": (heads, lambda n: bench.att_proj(n, seq)),
        "att_proj.tokens": (tokens, lambda n: bench.att_proj(H, n)),
        "att_core.heads": (heads, lambda n: bench.att_core(n, seq, seq)),
        "att_core.tokens": (tokens, lambda n: bench.att_core(H, n, seq)),
        "mlp.ffn": (ffns, lambda n: bench.mlp(n, seq)),
        "mlp.tokens": (tokens, lambda n: bench.mlp(F_, n)),
        "con.tokens": (tokens, bench.con),
        "head.tokens": (tokens, bench.head),
    }
    pieces = {}
    for name, (sizes, make) in plan.items():
        rows_ = time_pieces(bench, [lambda n=n: make(n) for n in sizes], reps, barrier)
        tsizes = tuple(sizes)
        pieces[name] = Piece(Curve(tsizes, tuple(r[0] for r in rows_)), Curve(tsizes, tuple(r[1] for r in rows_)),
                             Curve(tsizes, tuple(float(r[2]) for r in rows_)))
        logger.info("measured %s at %d sizes", name, len(sizes))
    return pieces


def measure_optimizer(device: torch.device, most_params: int, reps: int, barrier) -> AlphaBeta:
    """AdamW step seconds by parameter count (8 tensors each, as a model holds many)."""
    counts = sorted({c for c in (2**12, 2**15, 2**18, 2**20, most_params) if c <= max(most_params, 2**12)})
    samples = []
    for n in counts:
        params = [torch.zeros(max(1, n // 8), device=device, requires_grad=True) for _ in range(8)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
        times = []
        for i in range(reps + 1):
            barrier()
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        samples.append((float(sum(p.numel() for p in params)), statistics.median(times)))
    return AlphaBeta.fit(samples)


def memory_budget(device: torch.device, local_ranks: int, override_gb: Optional[float]) -> int:
    if override_gb is not None:
        return int(override_gb * 2**30)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    available = int(info["MemAvailable"].split()[0]) * 1024
    return int(available * 0.9 / max(local_ranks, 1))


# ----------------------------------------------------------------------------- the rest of a step


def measure_overheads(me: RankProfile, m: ModelConfig, rows: int, seq: int, dtype: str, device: torch.device,
                      reps: int, barrier) -> tuple[float, float]:
    """(training step, batch-1 forward) seconds that the pieces do not account for: the whole
    serial model run by the training loop's own Trainer (data, masking, loss, grad norm, optimizer,
    Python between the blocks), less what the cost model predicts for it from this rank's pieces.
    Never negative."""
    from galaxy.config import GalaxyConfig
    from galaxy.models import build_model
    from galaxy.planner.cost import Layout, Splits, Workload, predict
    from galaxy.train.loop import make_trainer

    cfg = GalaxyConfig.from_dict({"model": {k: v for k, v in vars(m).items() if k != "preset"},
                                  "train": {"global_batch_size": rows, "seq_length": seq, "dtype": dtype,
                                            "device": device.type}})
    ctx = ParallelContext.serial(device)
    model = build_model(cfg, Plan.serial(cfg), ctx)
    if m.model_type == "bert":
        from galaxy.train.pretrain import mlm_data

        batch_at = mlm_data(cfg)[0]
    else:
        def batch_at(step):
            ids = torch.randint(0, m.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(step))
            return {"input_ids": ids, "labels": ids}
    trainer = make_trainer(model, cfg, ctx)
    steps, forwards = [], []
    ids = torch.randint(0, m.vocab_size, (1, seq), device=device)
    for i in range(reps + 1):
        barrier()
        _sync(device)
        t0 = time.perf_counter()
        loss = trainer.forward_backward(trainer.read_batch(batch_at, i))
        trainer.optimizer_step(loss, i + 1)
        loss.item()
        t1 = time.perf_counter()
        barrier()
        model.eval()
        with torch.no_grad():
            t2 = time.perf_counter()
            model(ids)
            _sync(device)
            t3 = time.perf_counter()
        model.train()
        if i:
            steps.append(t1 - t0)
            forwards.append(t3 - t2)
    alone = Cluster(1, "none", device.type, m, tuple(me.pieces), seq, dtype, (me,), {})
    serial = Splits.balanced(m, seq, 1)
    none = (Method.NONE,) * 3
    step = predict(alone, Workload(m, "train", rows, seq, dtype), none, serial, Layout()).time_s[0]
    forward = predict(alone, Workload(m, "latency", rows, seq, dtype), none, serial).time_s[0]
    return max(0.0, statistics.median(steps) - step), max(0.0, statistics.median(forwards) - forward)


# ----------------------------------------------------------------------------- collectives


def message_sizes(most_bytes: int) -> list[int]:
    sizes, n = [], 4096
    while n < most_bytes:
        sizes.append(n)
        n *= 4
    return sizes + [most_bytes]


def measure_group(comm: Communicator, device: torch.device, sizes: list[int], reps: int) -> dict[str, AlphaBeta]:
    """Each op's alpha-beta on one group: the slowest member's time, median over ``reps``."""
    fits = {}
    for op in OPS:
        samples = []
        for nbytes in sizes:
            piece = max(1, nbytes // 4 // comm.size)
            full = torch.randn(piece * comm.size, device=device)
            local = full[:piece].contiguous()
            even = [piece] * comm.size
            run = {"all_reduce": lambda: comm.all_reduce(full),
                   "all_gather": lambda: comm.all_gather(local, 0, even),
                   "reduce_scatter": lambda: comm.reduce_scatter(full, 0, even)}[op]
            times = []
            for i in range(reps + 1):
                dist.barrier(group=comm.group)
                _sync(device)
                t0 = time.perf_counter()
                run()
                _sync(device)
                if i:
                    times.append(time.perf_counter() - t0)
            slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=comm.group)
            samples.append((float(full.numel() * 4), float(slowest.item())))
        fits[op] = AlphaBeta.fit(samples)
    return fits


# ----------------------------------------------------------------------------- one rank's run


def profile_rank(ctx: ParallelContext, m: ModelConfig, rows: Sequence[int], seq: int, dtype: str, reps: int = 3,
                 memory_gb: Optional[float] = None, ffn_unit: int = 1,
                 most_bytes: Optional[int] = None) -> Optional[Cluster]:
    """Measure this rank and its groups; every rank of ``ctx.mp`` (the whole run: profile with
    dp = pp = 1) must call it. Its rank 0 returns the Cluster, the others None."""
    if ctx.mp.size != ctx.world_size:
        raise ValueError("profile with dp_size = pp_size = 1: the profiler measures every group itself")
    world, run_group, rank = ctx.mp.size, ctx.mp.group, ctx.mp.rank
    barrier = (lambda: dist.barrier(group=run_group)) if world > 1 else (lambda: None)
    rows = tuple(sorted(set(rows)))
    pieces = {n: measure_blocks(m, n, seq, ctx.device, dtype, reps, barrier, ffn_unit) for n in rows}
    from galaxy.planner.workload import edge_params, layer_params

    H, F_ = m.num_attention_heads, m.intermediate_size
    model_params = int(layer_params(m, Method.NONE, Method.NONE, Method.NONE, H, F_).total) * m.num_hidden_layers \
        + sum(edge_params(m))
    optimizer = measure_optimizer(ctx.device, min(model_params, 2**24), reps, barrier)
    host = socket.gethostname()
    hosts = [host]
    if world > 1:
        hosts = [None] * world
        dist.all_gather_object(hosts, host, group=run_group)
    memory = memory_budget(ctx.device, hosts.count(host), memory_gb)
    groups = {}
    if world > 1:
        act = max(rows) * seq * m.hidden_size * 4
        sizes = message_sizes(most_bytes or min(max(act, 2**20), 2**26))
        global_ranks = [dist.get_global_rank(run_group, r) if run_group is not None else r for r in range(world)]
        for members in candidate_groups(world):
            if rank in members:
                # only the members create (and later use) a group: no rank waits on another's
                group = run_group if len(members) == world else dist.new_group(
                    [global_ranks[r] for r in members], use_local_synchronization=True)
                comm = Communicator("probe", members.index(rank), len(members), group)
                groups[members] = measure_group(comm, ctx.device, sizes, reps)
            barrier()
    mine = RankProfile(rank, host, memory, pieces, optimizer)
    step_overhead, forward_overhead = measure_overheads(mine, m, max(rows), seq, dtype, ctx.device, reps, barrier)
    mine = dataclasses.replace(mine, step_overhead_s=step_overhead, forward_overhead_s=forward_overhead)
    everyone = [(mine, groups)]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, (mine, groups), group=run_group)
    if rank != 0:
        return None
    merged = {}
    for _, g in everyone:  # every member holds the same (reduced) fits
        merged.update(g)
    backend = dist.get_backend(run_group) if world > 1 else "none"
    return Cluster(world, backend, ctx.device.type, m, rows, seq, dtype,
                   tuple(p for p, _ in everyone), {g: merged[g] for g in candidate_groups(world)})
