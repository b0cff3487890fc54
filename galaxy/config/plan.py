"""The resolved parallel plan: the methods the parallel section names, the pipeline stages' layers, and
``Plan``, one method per block with each rank's head, FFN and sequence splits checked against the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from galaxy.config.presets import PLAN_PRESETS
from galaxy.config.sections import COC_DEFAULT_CHUNKS, ConfigError, ConfigSections, Method


@dataclass(frozen=True)
class Plan:
    """The resolved parallel plan of one model-parallel group: a method per block and the splits."""

    att: Method
    con: Method
    mlp: Method
    heads_split: tuple[int, ...]
    ffn_split: tuple[int, ...]
    seq_split: tuple[int, ...]
    coc_parallel_num: Optional[int] = None  # as configured; galaxy.core.overlap.coc.coc_chunks resolves it
    tp_overlap: Optional[str] = None  # "async_tp" selects galaxy.core.overlap.async_tp at the TP edges
    sp_attention: str = "allgather"  # ATT.sp's flavour (galaxy.core.sp_attention); heads_split is Ulysses' split

    @property
    def size(self) -> int:
        return len(self.seq_split)

    @property
    def name(self) -> str:
        for name, preset in PLAN_PRESETS.items():
            if preset == (self.att, self.con, self.mlp):
                return name
        return f"att={self.att.value},con={self.con.value},mlp={self.mlp.value}"

    @staticmethod
    def serial(cfg: ConfigSections) -> Plan:
        m = cfg.model
        return Plan(Method.NONE, Method.NONE, Method.NONE, (m.num_attention_heads,),
                    (m.intermediate_size,), (cfg.train.seq_length,))


def balanced_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal positive pieces, larger pieces first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def stage_layers(cfg: ConfigSections) -> tuple[int, ...]:
    """Hidden layers held by each pipeline stage: ``stage_num_hidden_layers_list`` checked
    against ``pp_size`` and ``num_hidden_layers``, or a balanced split (larger stages first)."""
    p, layers = cfg.parallel, cfg.model.num_hidden_layers
    if p.stage_num_hidden_layers_list is None:
        if p.pp_size > layers:
            raise ConfigError(f"config key 'pp_size' ({p.pp_size}) exceeds num_hidden_layers ({layers}); "
                              "every pipeline stage needs at least one layer")
        return tuple(balanced_split(layers, p.pp_size))
    given = p.stage_num_hidden_layers_list
    if len(given) != p.pp_size:
        raise ConfigError(f"config key 'stage_num_hidden_layers_list' has {len(given)} entries but pp_size is "
                          f"{p.pp_size}; give one layer count per pipeline stage")
    if any(n <= 0 for n in given):
        raise ConfigError(f"config key 'stage_num_hidden_layers_list' must hold positive layer counts, "
                          f"got {given}")
    if sum(given) != layers:
        raise ConfigError(f"config key 'stage_num_hidden_layers_list' sums to {sum(given)} but "
                          f"num_hidden_layers is {layers}; make the stages add up to {layers}")
    return tuple(given)


def mp_size(cfg: ConfigSections, world_size: int) -> int:
    """The model-parallel size left when ``dp_size x pp_size`` ranks are taken from the world."""
    p = cfg.parallel
    if world_size % (p.dp_size * p.pp_size):
        raise ConfigError(f"world size {world_size} is not divisible by dp_size x pp_size = {p.dp_size} x "
                          f"{p.pp_size} = {p.dp_size * p.pp_size}; use a world that is a multiple of it")
    return world_size // (p.dp_size * p.pp_size)


def methods(cfg: ConfigSections) -> tuple[Method, Method, Method]:
    p = cfg.parallel
    explicit = [Method.parse(k, getattr(p, k)) if getattr(p, k) is not None else None
                for k in ("att_parallel_method", "con_parallel_method", "mlp_parallel_method")]
    preset = PLAN_PRESETS[p.plan.lower()] if p.plan else (Method.NONE,) * 3
    if p.plan:
        for key, given, wanted in zip(("att_parallel_method", "con_parallel_method", "mlp_parallel_method"),
                                      explicit, preset):
            if given is not None and given != wanted:
                raise ConfigError(f"config key '{key}' is {given.value} but plan '{p.plan}' needs "
                                  f"{wanted.value}; drop one of the two")
    att, con, mlp = (e if e is not None else d for e, d in zip(explicit, preset))
    if con == Method.TP:
        raise ConfigError("config key 'con_parallel_method': CON has no TP form (it holds no weight "
                          "matrix to split); use SP or None")
    return att, con, mlp


def resolve_plan(cfg: ConfigSections, mp_size: int) -> Plan:
    """The plan for a model-parallel group of ``mp_size`` ranks, with every split checked."""
    att, con, mlp = methods(cfg)
    m, p, seq = cfg.model, cfg.parallel, cfg.train.seq_length
    uses_seq = Method.SP in (att, con, mlp)

    def splits(key: str, given: Optional[list[int]], total: int, used: bool, what: str) -> tuple[int, ...]:
        if given is None:
            if used and total < mp_size:
                raise ConfigError(f"world size {mp_size} cannot be used: {what} ({total}) must be at least "
                                  f"the model-parallel size so every rank gets a share; use fewer ranks")
            return tuple(balanced_split(total, mp_size)) if total >= mp_size else (total,) + (0,) * (mp_size - 1)
        if len(given) != mp_size:
            raise ConfigError(f"config key '{key}' has {len(given)} entries but the model-parallel group has "
                              f"{mp_size} ranks; give one entry per rank")
        if any(v <= 0 for v in given):
            raise ConfigError(f"config key '{key}' must hold positive splits, got {given}")
        if sum(given) != total:
            raise ConfigError(f"config key '{key}' sums to {sum(given)} but {what} is {total}; "
                              f"make the splits add up to {total}")
        return tuple(given)

    ulysses = att == Method.SP and p.sp_attention == "ulysses" and mp_size > 1
    if ulysses and m.num_attention_heads < mp_size:
        raise ConfigError(f"config key 'sp_attention' ulysses splits the attention heads over the model-parallel "
                          f"ranks, but there are {m.num_attention_heads} heads for {mp_size} ranks; use "
                          "sp_attention ring or allgather, or at most as many ranks as heads")
    heads = splits("tp_num_attention_heads_list", p.tp_num_attention_heads_list, m.num_attention_heads,
                   att == Method.TP or ulysses, "num_attention_heads")
    ffn = splits("tp_intermediate_size_list", p.tp_intermediate_size_list, m.intermediate_size,
                 mlp == Method.TP, "intermediate_size")
    seqs = splits("seq_scatter_list", p.seq_scatter_list, seq, uses_seq, "seq_length")
    if att == Method.TP and m.kv_heads != m.num_attention_heads:
        group = m.num_attention_heads // m.kv_heads
        if any(h % group for h in heads):
            raise ConfigError(f"config key 'tp_num_attention_heads_list' {list(heads)} splits a group of "
                              f"{group} query heads that share one key/value head; make every entry a "
                              f"multiple of {group}")
    chunks = {"none": 1, "async_tp": 1, "coc": p.coc_parallel_num or COC_DEFAULT_CHUNKS}.get(
        p.tp_overlap, p.coc_parallel_num)
    if p.tp_overlap == "async_tp":
        _check_async_tp_plan(att, con, mlp, seqs)
    return Plan(att, con, mlp, heads, ffn, seqs, chunks, p.tp_overlap, p.sp_attention)


def _check_async_tp_plan(att: Method, con: Method, mlp: Method, seqs: tuple[int, ...]) -> None:
    """Async TP fuses the S -> T all-gather and the P -> S reduce-scatter around TP blocks, in
    equal shards (torch's symm_mem ops split evenly): the plan must have those edges."""
    if con != Method.SP or Method.TP not in (att, mlp):
        raise ConfigError(f"config key 'tp_overlap' async_tp fuses the all-gather/reduce-scatter between a "
                          f"sequence-sharded stream and TP blocks, which this plan (att={att.value}, "
                          f"con={con.value}, mlp={mlp.value}) does not have; use plan galaxy or galaxy2 "
                          f"(con SP, a TP block), or tp_overlap coc")
    if len(set(seqs)) > 1:
        raise ConfigError(f"config key 'tp_overlap' async_tp needs equal sequence shards (torch's fused "
                          f"symm_mem ops split evenly), but seq_scatter_list is {list(seqs)}; make the splits "
                          f"equal (seq_length divisible by the model-parallel size) or use tp_overlap coc")
