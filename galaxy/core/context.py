"""ParallelContext: who this process is, which device it drives, and its process groups.

No global state: one context object is built at start-up and passed to everything that needs it.
World = dp x pp x mp with the mp ranks adjacent and dp outermost:

    rank = (dp_rank * pp_size + pp_rank) * mp_size + mp_rank

so an mp group is a block of adjacent ranks (one node's GPUs when mp <= GPUs per node), a
pipeline joins the same mp rank of consecutive stages, and a dp group joins the same (stage,
mp rank) of every replica. ``ctx.mp``, ``ctx.pp`` and ``ctx.dp`` are the groups this rank belongs
to (size 1 when that dimension is unused); ``ctx.pp_ends`` joins the first and last stage of a
pipeline, for the embedding weights that both of them hold when input and output embeddings are tied.

A multi-rank context built by ``initialize`` runs a heartbeat (``galaxy.core.heartbeat``) through
the rendezvous store: when a rank dies, the others name it (``peer_failure`` turns the anonymous
error of a failed collective into that message) and exit within the collective timeout.
"""

from __future__ import annotations

import dataclasses

import datetime
import importlib
import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from galaxy.config import ConfigError, DistributedConfig
from galaxy.core.comm import Communicator
from galaxy.core.heartbeat import ALIVE_KEY, DONE, FAILED, Heartbeat, RankFailure
from galaxy.errors import UserError

logger = logging.getLogger(__name__)

# torch modules that bind ``group.WORLD`` as a default argument when they are imported: imported after
# init_process_group, they hold the live WORLD group for good, past destroy_process_group, and its Gloo
# threads run into the interpreter's exit. torch._dynamo (a compiled layer, torch.compiler.disable) and the
# first eager functional collective bring torch.distributed.nn.functional and torch.distributed._shard;
# torch.distributed.optim is ZeRO's (_broadcast_object). ``initialize`` imports them before it creates the
# group (not torch._dynamo itself: ~1 s of CPU per rank, and it imports no further WORLD binder after these).
_BIND_WORLD_ON_IMPORT = ("torch.distributed.nn.functional", "torch.distributed._shard", "torch.distributed.optim")


def import_world_binders() -> None:
    """Import the modules of ``_BIND_WORLD_ON_IMPORT``: call before ``init_process_group`` in any
    process that creates its group itself (``ParallelContext.initialize`` does)."""
    for name in _BIND_WORLD_ON_IMPORT:
        importlib.import_module(name)


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


def pick_device(preference: str, local_rank: int) -> torch.device:
    """auto: CUDA if present, else Ascend NPU if torch_npu imports, else CPU."""
    if preference == "auto":
        preference = "cuda" if torch.cuda.is_available() else ("npu" if _npu_available() else "cpu")
    if preference == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("config key 'device' is 'cuda' but no CUDA GPU is visible; use device=cpu or auto")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if preference == "npu":
        if not _npu_available():
            raise ConfigError("config key 'device' is 'npu' but torch_npu does not import; use device=cpu or auto")
        return torch.device("npu", local_rank % torch.npu.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device, requested: str) -> str:
    natural = {"cuda": "nccl", "npu": "hccl"}.get(device.type, "gloo")
    if requested == "auto":
        return natural
    if requested in ("nccl", "hccl") and requested != natural:
        raise ConfigError(f"config key 'distributed_backend' is '{requested}' but the device is {device.type}; "
                          f"use '{natural}' or 'auto'")
    return requested


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    device: torch.device
    seed: int
    mp: Communicator
    backend: Optional[str] = None
    dp: Communicator = field(default_factory=lambda: Communicator("dp"))
    pp: Communicator = field(default_factory=lambda: Communicator("pp"))
    pp_ends: Communicator = field(default_factory=lambda: Communicator("pp_ends"))
    # The mp ranks' second process group: gradient reductions that overlap backward run on it, since
    # their order relative to backward's transitions (on ``mp``) differs between ranks.
    mp_grad: Optional[Communicator] = None
    # The dp x mp ranks of this pipeline stage (an own process group; None unless dp and mp both exceed 1):
    # FSDP shards the replicated weights of SP blocks over it (``mp_grad_reduce: fsdp`` with ``dp_engine: fsdp2``).
    dp_mp: Optional[Communicator] = None
    # Hidden layers per pipeline stage (``stage_num_hidden_layers_list``); None: balanced.
    stage_layers: Optional[tuple[int, ...]] = None
    _generators: dict = field(default_factory=dict, repr=False)
    # Set by ``initialize`` for a multi-rank world: names a peer that dies (galaxy.core.heartbeat).
    heartbeat: Optional[Heartbeat] = field(default=None, repr=False, compare=False)
    # Set by ``initialize`` for a multi-rank world: every rank over Gloo (the world itself where the world is Gloo),
    # for the host's agreements (an interrupt): a flag reduced on it waits for no work queued on a device.
    host_group: Optional[object] = field(default=None, repr=False, compare=False)

    @classmethod
    def serial(cls, device: str | torch.device = "cpu", seed: int = 0) -> "ParallelContext":
        return cls(rank=0, world_size=1, device=torch.device(device), seed=seed, mp=Communicator("mp"))

    @classmethod
    def initialize(cls, dist_cfg: DistributedConfig, rank: int, world_size: int, device_pref: str = "auto",
                   seed: int = 0, local_rank: Optional[int] = None, dp_size: int = 1, pp_size: int = 1,
                   stage_layers: Optional[tuple[int, ...]] = None) -> "ParallelContext":
        """Join the process group (rendezvous through ``init_method``) and build the mp, pp and dp
        groups (mp = world / (dp_size x pp_size))."""
        if world_size % (dp_size * pp_size):
            raise ConfigError(f"world size {world_size} is not divisible by dp_size x pp_size = {dp_size} x "
                              f"{pp_size} = {dp_size * pp_size}; use a world that is a multiple of it")
        local_rank = rank if local_rank is None else local_rank
        device = pick_device(device_pref, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        stage_layers = tuple(stage_layers) if stage_layers is not None else None
        if world_size == 1:
            return cls(rank=0, world_size=1, device=device, seed=seed, mp=Communicator("mp"),
                       stage_layers=stage_layers)
        backend = backend_for(device, dist_cfg.distributed_backend)
        import_world_binders()
        store = rendezvous(dist_cfg.init_method, rank, world_size, dist_cfg.timeout_s)
        heartbeat = Heartbeat(*store_address(dist_cfg.init_method), rank, world_size, dist_cfg.timeout_s)
        try:
            timeout = datetime.timedelta(seconds=dist_cfg.timeout_s)
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
            groups = build_groups(rank, world_size, dp_size, pp_size)
            host_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        except BaseException:
            heartbeat.stop(FAILED)
            raise
        return cls(rank=rank, world_size=world_size, device=device, seed=seed, backend=backend,
                   stage_layers=stage_layers, heartbeat=heartbeat, host_group=host_group, **groups)

    @property
    def coords(self) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, mp_rank) of this process."""
        return self.dp.rank, self.pp.rank, self.mp.rank

    @property
    def generators(self) -> dict[str, torch.Generator]:
        """The dropout streams made so far, by key ("replicated", "sharded"): the live generators, in a new
        dict (checkpoints save and restore their states)."""
        return dict(self._generators)

    def with_fresh_streams(self) -> "ParallelContext":
        """This context with no dropout stream drawn yet: a second model built on it draws the same masks."""
        return dataclasses.replace(self, _generators={})

    def generator(self, sharded: bool) -> torch.Generator:
        """Dropout stream: the same on every mp rank for replicated regions, per-rank for sharded ones."""
        key = "sharded" if sharded else "replicated"
        if key not in self._generators:
            g = torch.Generator(device=self.device)
            g.manual_seed(self.seed * 1_000_003 + (self.mp.rank + 1 if sharded else 0))
            self._generators[key] = g
        return self._generators[key]

    def from_rank0(self, make: Callable[[], str]) -> str:
        """``make()`` run on global rank 0 only, its string returned on every rank (work done once
        per run, such as training the tokenizer). An exception on rank 0 is raised on every rank
        (as ValueError with rank 0's message) instead of leaving the others waiting; bad input
        (``UserError``) as ``ConfigError`` with the same message, so every rank reports the same line."""
        if self.world_size == 1 or not dist.is_initialized():
            return make()
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"from_rank0 broadcasts over the whole world ({dist.get_world_size()} ranks) but this "
                               f"context spans {self.world_size}")
        payload = b""
        if self.rank == 0:
            try:
                payload = b"\x00" + make().encode("utf-8")
            except UserError as e:  # every rank must leave the broadcast, then all raise
                payload = b"\x02" + str(e).encode("utf-8")
            except Exception as e:
                payload = b"\x01" + f"rank 0: {e}".encode("utf-8")
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        dist.broadcast(data, src=0)
        raw = data.cpu().numpy().tobytes() if self.rank != 0 else payload
        if raw[:1] == b"\x02":
            raise ConfigError(raw[1:].decode("utf-8"))
        if raw[:1] == b"\x01":
            raise ValueError(raw[1:].decode("utf-8"))
        return raw[1:].decode("utf-8")

    def peer_failure(self, error: Optional[BaseException] = None) -> Optional[RankFailure]:
        """The dead or failed peer behind ``error`` (a collective that failed), naming its rank; None
        when no peer failed (or this is not a multi-rank context built by ``initialize``)."""
        return self.heartbeat.explain(error) if self.heartbeat is not None else None

    def shutdown(self, wait_for_peers: bool = True) -> None:
        """Leave the process group, after every rank is done unless this rank failed: a rank that
        tears down while a peer's last point-to-point transfer is in flight can abort the peer (seen
        with Gloo), but a failed rank must not wait for peers stuck in another collective."""
        if self.heartbeat is not None:
            # Before the barrier: rank 0, which hosts the store, cannot have left yet.
            self.heartbeat.stop(DONE if wait_for_peers else FAILED)
        if dist.is_initialized():
            if wait_for_peers:
                dist.barrier()
            dist.destroy_process_group()
        if wait_for_peers:
            # destroy_process_group drops only torch's references. A Gloo group joins its worker threads
            # (and rank 0's store its server thread) when the last reference goes, so the groups our
            # Communicators (and the host group) hold kept them running as long as this context lived, up to the
            # interpreter's exit in a rank that keeps it, where a worker freeing a finished work needs
            # the GIL and aborts the process ("terminate called without an active exception"). Dropped
            # here, they end now. Not after a failure: the group's destructor waits for the collectives
            # in flight, which may be waiting for a peer.
            for comm in (self.mp, self.dp, self.pp, self.pp_ends, self.mp_grad):
                if comm is not None:
                    comm.group = None
            self.host_group = None

    def __enter__(self) -> "ParallelContext":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving a ``with`` block shuts the process group down (``shutdown``): after every rank is done, or
        at once when the block raised. A process that exits with its Gloo group alive can abort there."""
        self.shutdown(wait_for_peers=exc_type is None)


def rank_of(dp_rank: int, pp_rank: int, mp_rank: int, pp_size: int, mp_size: int) -> int:
    """Global rank of a (dp, pp, mp) coordinate: mp innermost (adjacent), then pp, then dp."""
    return (dp_rank * pp_size + pp_rank) * mp_size + mp_rank


def build_groups(rank: int, world_size: int, dp_size: int, pp_size: int) -> dict[str, Communicator]:
    """The mp, pp, dp and pp_ends Communicators of ``rank`` in a world of ``world_size`` ranks.

    ``dist.new_group`` must be entered by every process of the default group, in the same order,
    members or not, so every process walks every group of every family here (processes of the
    default group beyond ``world_size``, as in the test pool, only take part in the creation).
    A one-rank group needs no process group; one that spans the default group reuses it.
    """
    if world_size % (dp_size * pp_size):
        raise ConfigError(f"world size {world_size} is not divisible by dp_size x pp_size = {dp_size} x "
                          f"{pp_size} = {dp_size * pp_size}; use a world that is a multiple of it")
    mp_size = world_size // (dp_size * pp_size)
    default_size = dist.get_world_size() if dist.is_initialized() else 1

    def family(name: str, members: list[list[int]], own: bool = False) -> Communicator:
        mine = Communicator(name)
        for ranks in members:
            if len(ranks) == 1:
                continue
            group = dist.group.WORLD if len(ranks) == default_size and not own else dist.new_group(ranks)
            if rank in ranks:
                mine = Communicator(name, rank=ranks.index(rank), size=len(ranks), group=group)
        return mine

    at = lambda d, p, m: rank_of(d, p, m, pp_size, mp_size)  # noqa: E731
    mp_members = [[at(d, p, m) for m in range(mp_size)] for d in range(dp_size) for p in range(pp_size)]
    mp, mp_grad = family("mp", mp_members), family("mp_grad", mp_members, own=True)
    pp = family("pp", [[at(d, p, m) for p in range(pp_size)] for d in range(dp_size) for m in range(mp_size)])
    dp = family("dp", [[at(d, p, m) for d in range(dp_size)] for p in range(pp_size) for m in range(mp_size)])
    if pp_size <= 2:
        ends = Communicator("pp_ends", pp.rank, pp.size, pp.group)
    else:
        ends = family("pp_ends", [[at(d, 0, m), at(d, pp_size - 1, m)] for d in range(dp_size)
                                  for m in range(mp_size)])
    dp_mp = None
    if dp_size > 1 and mp_size > 1:  # dp-major, so rank d * mp_size + m of it is (d, m): FSDP's flattened order
        dp_mp = family("dp_mp", [[at(d, p, m) for d in range(dp_size) for m in range(mp_size)]
                                 for p in range(pp_size)], own=True)
    return {"mp": mp, "pp": pp, "dp": dp, "pp_ends": ends, "mp_grad": mp_grad, "dp_mp": dp_mp}


def param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed (Python's hash() is salted per process, crc32 is not)."""
    return (seed * 2_654_435_761 + zlib.crc32(name.encode())) % (2**63)


def store_address(init_method: str) -> tuple[str, int]:
    """(host, port) of the rendezvous store that rank 0 hosts."""
    if init_method.startswith("env://"):
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    if init_method.startswith("tcp://"):
        parsed = urlparse(init_method)
        if parsed.hostname is None or parsed.port is None:
            raise ConfigError(f"config key 'init_method' '{init_method}' needs a host and port, e.g. tcp://10.0.0.1:29500")
        return parsed.hostname, parsed.port
    raise ConfigError(f"config key 'init_method' '{init_method}' is not supported; use env:// or tcp://HOST:PORT")


def rendezvous(init_method: str, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """A TCP store where every rank announces itself, so a missing rank is named, not waited on forever."""
    host, port = store_address(init_method)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                              wait_for_workers=False)
    except Exception as e:  # the master never came up, or the port is taken
        who = "could not open the rendezvous port" if rank == 0 else "rank 0 (the master) did not answer"
        raise RuntimeError(f"rank {rank}: {who} at {host}:{port} within {timeout_s:.0f}s ({e}); "
                           "start rank 0 or fix init_method / MASTER_ADDR / MASTER_PORT") from None
    store.set(ALIVE_KEY.format(rank), "0")  # before joining: the peers' heartbeats read it from then on
    store.set(f"galaxy/joined/{rank}", "1")
    deadline = time.monotonic() + timeout_s
    missing = list(range(world_size))
    while True:
        missing = [r for r in missing if not store.check([f"galaxy/joined/{r}"])]
        if not missing:
            return store
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: rank(s) {missing} did not join the rendezvous at {host}:{port} "
                               f"within {timeout_s:.0f}s; start them (--rank R) or raise timeout_s")
        time.sleep(0.05)
