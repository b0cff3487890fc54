"""Tensors of a checkpoint as chunks of full tensors, written by every rank in parallel and read back in
any other sharding, through ``torch.distributed.checkpoint`` (DCP).

A rank describes what it holds as :class:`Chunk` s: a piece of a full tensor given by its offsets (DCP's
``ChunkStorageMetadata``). Galaxy's uneven splits are described as they are (DTensor's ``Shard``
placement assumes ``torch.chunk`` sizes and cannot). The ranks exchange these descriptions as JSON,
every chunk gets exactly one writer (a tensor held by several ranks, replicated weights or a pipeline's
tied embedding copy, is written once, writers balanced by bytes), and each rank writes its chunks with
DCP's ``FileSystemWriter`` into files of its own (``__<rank>_<i>.distcp``), all ranks at once.

DCP runs on each rank alone (``no_dist``): a ParallelContext has no process group spanning its world,
and DCP's plan exchange would carry no more than the JSON exchange above. Loading asks DCP for the
region of each full tensor a rank holds under its own plan; DCP's resharding reads the overlapping
parts of the saved chunks, so any plan, world size, dp/pp layout or ZeRO state loads any checkpoint.

No pickle of untrusted data: DCP's own ``.metadata`` is a pickle, so the checkpoint's DCP ``Metadata``
is kept as JSON in ``manifest.json`` (dtype, shape and chunks of every tensor, each chunk's file, offset
and length) and rebuilt from it here; a file's sha256 is checked against the manifest before DCP reads
it, and DCP turns each chunk's bytes into a tensor with ``torch.load(weights_only=True)``, the restricted
loader that builds tensors only. Rank 0 also writes DCP's ``.metadata`` so DCP's own tools
(``dcp_to_torch_save``, ``dcp.load``) can open the checkpoint; Galaxy never reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pickle
import warnings
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, SavePlan, SavePlanner, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from galaxy.core.context import ParallelContext
from galaxy.train.checkpoint.files import CheckpointError, InvalidCheckpointError, file_entry, verify_file
from galaxy.train.checkpoint.state import gather_world_json, parse_dtype

DCP_METADATA_FILE = ".metadata"


@contextlib.contextmanager
def _per_rank():
    """DCP warns that it saves or loads 'in a single process' when no process group is initialized (a
    serial run): that is what every rank does here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``tensor`` is the piece of the full tensor ``key`` (shape ``shape``) starting at ``offsets``."""

    key: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def ident(self) -> str:
        """Unique among the chunks of one rank (a rank may hold several pieces of one tensor)."""
        return f"{self.key}@{','.join(map(str, self.offsets))}"

    def describe(self) -> list:
        t = self.tensor
        return [self.key, list(self.shape), list(self.offsets), list(t.shape), dtype_name(t.dtype),
                t.numel() * t.element_size()]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def narrow(tensor: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        tensor = tensor.narrow(dim, offset, size)
    return tensor


def _overlap(a_offsets, a_sizes, b_offsets, b_sizes) -> int:
    """Elements two blocks of one tensor have in common."""
    return math.prod(max(0, min(ao + as_, bo + bs) - max(ao, bo))
                     for ao, as_, bo, bs in zip(a_offsets, a_sizes, b_offsets, b_sizes))


# ----------------------------------------------------------------------------- who writes what


@dataclasses.dataclass
class WritePlan:
    mine: list[Chunk]               # the chunks this rank writes
    tensors: dict[str, dict]        # key -> {"shape", "dtype"} of every full tensor in the checkpoint
    records: list                   # every rank's record (what it holds, its extra payload), in rank order


def plan_writes(ctx: ParallelContext, chunks: list[Chunk], problem: Optional[str], payload) -> WritePlan:
    """Exchange what every rank holds (a collective over the ctx world) and give each chunk one writer.
    ``problem`` (a rank's reason not to save) and ``payload`` (JSON) travel with the exchange, so a
    problem on any rank is raised on every rank alike."""
    records = gather_world_json(ctx, {"chunks": [c.describe() for c in chunks], "problem": problem,
                                      "payload": payload})
    problems = [r["problem"] for r in records if r["problem"]]
    if problems:
        raise CheckpointError(problems[0])
    tensors: dict[str, dict] = {}
    holders: dict[tuple, tuple] = {}  # (key, offsets) -> (sizes, bytes, ranks)
    for rank, record in enumerate(records):
        for key, shape, offsets, sizes, dtype, nbytes in record["chunks"]:
            if tensors.setdefault(key, {"shape": shape, "dtype": dtype}) != {"shape": shape, "dtype": dtype}:
                raise CheckpointError(f"ranks disagree on tensor '{key}': {tensors[key]} and shape {shape} dtype "
                                      f"{dtype} on rank {rank}; every rank must build the same model")
            entry = holders.setdefault((key, tuple(offsets)), (tuple(sizes), nbytes, []))
            if entry[0] != tuple(sizes):
                raise CheckpointError(f"ranks hold pieces of '{key}' at {offsets} of sizes {list(entry[0])} and "
                                      f"{sizes}; every rank must build the same plan")
            entry[2].append(rank)
    covered = dict.fromkeys(tensors, 0)
    for (key, _), (sizes, _, _) in holders.items():
        covered[key] += math.prod(sizes)
    for key, meta in tensors.items():
        if covered[key] != math.prod(meta["shape"]):
            raise CheckpointError(f"the ranks hold {covered[key]} of the {math.prod(meta['shape'])} elements of "
                                  f"'{key}'; save after a complete optimizer step (every rank must hold its part)")
    written = [0] * len(records)
    mine = set()
    # largest first, each to the least loaded holder: the same choice on every rank
    for ident in sorted(holders, key=lambda i: (-holders[i][1], i)):
        _, nbytes, ranks = holders[ident]
        writer = min(ranks, key=lambda r: (written[r], r))
        written[writer] += nbytes
        if writer == ctx.rank:
            mine.add(ident)
    return WritePlan([c for c in chunks if (c.key, c.offsets) in mine], tensors, records)


# ----------------------------------------------------------------------------- writing with DCP


class _ChunkSavePlanner(SavePlanner):
    """One DCP write item per chunk, placed in its full tensor by its offsets."""

    def __init__(self, chunks: list[Chunk]):
        self.chunks = chunks
        self.idents = {(c.key, c.offsets): c.ident for c in chunks}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict  # chunk ident -> its tensor, or its staged copy under async_save

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(c.key, torch.Size(c.offsets)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.tensor.shape),
                               properties=TensorProperties.create_from_tensor(c.tensor), size=torch.Size(c.shape)))
                 for c in self.chunks]
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]):
        entries: dict[str, TensorStorageMetadata] = {}
        for plan in all_plans:
            for item in plan.items:
                data = item.tensor_data
                entries.setdefault(item.index.fqn, TensorStorageMetadata(data.properties, data.size, [])) \
                    .chunks.append(data.chunk)
        return all_plans, Metadata(state_dict_metadata=entries)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        index = write_item.index
        return self.state_dict[self.idents[(index.fqn, tuple(index.offset))]].detach()


class _RankWriter(FileSystemWriter):
    """DCP's file writer with this rank's file prefix. ``finish`` only collects where each chunk went
    (returned by ``dcp.save``); the per-rank pickled ``.metadata`` is not written."""

    def __init__(self, path: str, rank: int):
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.prefix = f"__{rank}_"

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(self.prefix)) for plan in plans]

    def finish(self, metadata: Metadata, results) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}


def _written(tmp: str, chunks: list[Chunk], metadata: Optional[Metadata]) -> dict:
    """Where each chunk went (JSON for the manifest) and the entries of this rank's files."""
    out, files = {}, set()
    for c in chunks:
        info = metadata.storage_data[MetadataIndex(c.key, torch.Size(c.offsets))]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"DCP stored '{c.key}' with stream transforms {info.transform_descriptors}, which "
                                  "Galaxy's manifest does not describe")
        out.setdefault(c.key, []).append({"offsets": list(c.offsets), "sizes": list(c.tensor.shape),
                                          "file": info.relative_path, "offset": info.offset, "length": info.length})
        files.add(info.relative_path)
    return {"chunks": out, "files": {f: file_entry(os.path.join(tmp, f)) for f in sorted(files)}}


def dcp_failure(error: CheckpointException) -> Exception:
    """The error behind DCP's ``CheckpointException``, a BaseException whose text is every failed rank's
    whole traceback: this rank's own error (an ``OSError`` naming the file, where DCP's writer raised
    one), for a one-line report."""
    for cause, _ in error.failures.values():
        if isinstance(cause, Exception):
            return cause
    return RuntimeError(f"DCP failed on ranks {sorted(error.failures)}")


def write_chunks(tmp: str, rank: int, chunks: list[Chunk], async_save: bool = False) -> Future:
    """Write this rank's chunks into ``tmp`` with DCP; a Future of what ``_written`` returns. With
    ``async_save`` the tensors are staged (copied to CPU) before this returns and written in the
    background by ``dcp.async_save``."""
    state_dict = {c.ident: c.tensor for c in chunks}
    done: Future = Future()
    if not chunks:
        done.set_result({"chunks": {}, "files": {}})
        return done
    kwargs = dict(storage_writer=_RankWriter(tmp, rank), planner=_ChunkSavePlanner(chunks), no_dist=True)
    if not async_save:
        with _per_rank():
            try:
                metadata = dcp.save(state_dict, **kwargs)
            except CheckpointException as e:
                raise dcp_failure(e) from None
        done.set_result(_written(tmp, chunks, metadata))
        return done
    try:
        with _per_rank():
            upload = dcp.async_save(state_dict, **kwargs)
    except AssertionError:  # a default process group without a CPU backend (NCCL only): DCP's stager, a thread
        staged = kwargs["storage_writer"].stage(state_dict)
        pool = ThreadPoolExecutor(max_workers=1)
        upload = pool.submit(dcp.save, staged, **kwargs)
        pool.shutdown(wait=False)
    upload = getattr(upload, "upload_completion", upload)  # AsyncSaveResponse on newer torch

    def finished(future: Future) -> None:
        try:
            done.set_result(_written(tmp, chunks, future.result()))
        except BaseException as e:  # handed to the commit, which tells every rank
            done.set_exception(dcp_failure(e) if isinstance(e, CheckpointException) else e)

    upload.add_done_callback(finished)
    return done


# ----------------------------------------------------------------------------- the manifest's DCP metadata


def manifest_tensors(plan: WritePlan, written: list[dict]) -> dict:
    """The manifest's ``tensors`` section: every full tensor's dtype, shape and chunks (with the files
    that hold them), from the write plan and every rank's ``_written`` record."""
    tensors = {key: {**meta, "chunks": []} for key, meta in sorted(plan.tensors.items())}
    for record in written:
        for key, chunks in record["chunks"].items():
            tensors[key]["chunks"].extend(chunks)
    return tensors


def dcp_metadata(tensors: dict) -> Metadata:
    """DCP's ``Metadata`` of a checkpoint, built from its manifest's ``tensors`` section (JSON)."""
    entries, storage = {}, {}
    for key, t in tensors.items():
        chunks = []
        for c in t["chunks"]:
            offsets = torch.Size(c["offsets"])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(c["sizes"])))
            storage[MetadataIndex(key, offsets)] = _StorageInfo(c["file"], int(c["offset"]), int(c["length"]))
        entries[key] = TensorStorageMetadata(TensorProperties(dtype=parse_dtype(t["dtype"])), torch.Size(t["shape"]),
                                             chunks)
    return Metadata(state_dict_metadata=entries, storage_data=storage)


def dcp_metadata_bytes(tensors: dict) -> bytes:
    """DCP's ``.metadata`` file for DCP's own tools (Galaxy reads the manifest instead)."""
    return pickle.dumps(dcp_metadata(tensors))


# ----------------------------------------------------------------------------- reading with DCP


class _ManifestReader(FileSystemReader):
    """DCP's file reader, given the Metadata rebuilt from the verified JSON manifest instead of
    unpickling ``.metadata``."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata


class _RegionLoadPlanner(LoadPlanner):
    """Reads into each target chunk (a tensor and its offsets in full tensor ``key``) its region."""

    def __init__(self, targets: list[Chunk]):
        self.targets = {(c.key, c.offsets): c.tensor for c in targets}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        regions = defaultdict(list)
        for (key, offsets), tensor in self.targets.items():
            regions[key].append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape))
        items = []
        for key, chunks in regions.items():
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry '{read_item.dest_index.fqn}' is bytes, not a tensor")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        index = read_item.dest_index
        return narrow(self.targets[(index.fqn, tuple(index.offset))], read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        pass  # read in place


class ShardReader:
    """Reads regions of a checkpoint's full tensors, checking each file it touches against the manifest
    first (once)."""

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest, self.tensors = path, manifest, manifest["tensors"]
        try:
            self.metadata = dcp_metadata(self.tensors)
        except (ValueError, TypeError, RuntimeError) as e:
            raise InvalidCheckpointError(f"checkpoint manifest '{os.path.join(path, 'manifest.json')}' describes "
                                         f"unusable tensors ({type(e).__name__}: {e})") from None
        self.verified: set[str] = set()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return parse_dtype(self.tensors[key]["dtype"])

    def read(self, targets: list[Chunk]) -> None:
        """Fill each target chunk's tensor with its region of its full tensor."""
        if not targets:
            return
        for target in targets:
            found = 0
            for c in self.tensors[target.key]["chunks"]:
                common = _overlap(c["offsets"], c["sizes"], target.offsets, target.tensor.shape)
                found += common
                if common and c["file"] not in self.verified:
                    verify_file(self.path, c["file"], self.manifest)
                    self.verified.add(c["file"])
            if found < target.tensor.numel():
                raise InvalidCheckpointError(
                    f"checkpoint '{self.path}' holds {found} of the {target.tensor.numel()} elements of '{target.key}' "
                    f"at offsets {list(target.offsets)} that this rank reads: its manifest lists too few chunks; "
                    "resume from an older checkpoint")
        # DCP places what it reads by (tensor, offsets): a region wanted twice is read once and copied, and
        # pieces of one tensor at the same offsets but of other sizes go to separate reads.
        first: dict[tuple, Chunk] = {}
        copies, reads, placed = [], [], []  # placed[i]: the (key, offsets) of reads[i]
        for target in targets:
            same = first.setdefault((target.key, target.offsets, tuple(target.tensor.shape), target.tensor.dtype),
                                    target)
            if same is not target:
                copies.append((same, target))
                continue
            i = next((i for i, p in enumerate(placed) if (target.key, target.offsets) not in p), len(reads))
            if i == len(reads):
                reads.append([])
                placed.append(set())
            reads[i].append(target)
            placed[i].add((target.key, target.offsets))
        try:
            for read in reads:
                with _per_rank():
                    dcp.load({c.ident: c.tensor for c in read}, planner=_RegionLoadPlanner(read), no_dist=True,
                             storage_reader=_ManifestReader(self.path, self.metadata))
        except (Exception, CheckpointException) as e:  # the files matched their checksums: a manifest that misfits
            cause = dcp_failure(e) if isinstance(e, CheckpointException) else e
            raise InvalidCheckpointError(f"checkpoint '{self.path}' cannot be read: {type(cause).__name__}: "
                                         f"{cause}") from None
        for same, target in copies:
            target.tensor.copy_(same.tensor)

    def read_full(self, keys) -> dict[str, torch.Tensor]:
        out = {key: torch.empty(self.shape(key), dtype=self.dtype(key)) for key in keys}
        self.read([Chunk(key, tuple(t.shape), (0,) * t.dim(), t) for key, t in out.items()])
        return out
