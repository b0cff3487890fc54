"""Training checkpoints: sharded (every rank writes its own shards, in parallel), resharded on load to
any plan, world size, dp/pp layout and ZeRO state; atomic, checksummed, pickle-free to read.

One directory per step, ``<save_dir>/step_000005/`` (format 2)::

    __<rank>_<i>.distcp    the tensors each rank wrote, through torch.distributed.checkpoint (DCP):
                           its parameter shards and optimizer states as chunks of the full tensors
    state.json             step, data position, LR schedule, optimizer hyper-parameters, config, extra
    rng.json               every rank's RNG states (torch CPU, CUDA, ParallelContext dropout streams)
    .metadata              DCP's index of the chunks, for DCP's own tools (never read here: a pickle)
    manifest.json          written last: size and sha256 of every file above, step, world, plan, and
                           every full tensor's dtype, shape and chunks (file, offset, length) as JSON

How tensors become chunks and back: ``shards`` (DCP) and ``regions`` (model and optimizer; the flat
pieces of ``mp_grad_reduce: sharded`` weights, their masters and states, as regions of the full
parameters, so they load under any plan or mode). Format 1 checkpoints (everything full on rank 0,
``legacy``) still load and export.

Atomicity: the ranks write into ``step_000005.tmp-<nonce>/``; when every rank has written and
fsynced its files, global rank 0 writes the JSON files, renames the directory to ``step_000005/`` and
then writes ``manifest.json`` through a temporary file + fsync + rename. A checkpoint is valid only with
a manifest whose sizes and checksums match, so a crash (or ``kill -9``) at any point of a save leaves
the previous checkpoint the newest valid one. Loading checks the sizes of all files and the checksums
of the files each rank reads (no rank hashes the whole checkpoint); from a save directory, a checkpoint
that any rank finds damaged is skipped by all for the next older one. Loading assumes every rank sees
the checkpoint directory (a shared file system); saving assumes every rank writes into the same one.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import uuid
from concurrent.futures import Future
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from galaxy.core.context import ParallelContext
from galaxy.train.checkpoint import legacy
from galaxy.train.checkpoint.files import (RNG_FILE, STATE_FILE, CheckpointError, InvalidCheckpointError,
                                           ResumeError, check_sizes, checkpoint_bytes, checkpoint_candidates,
                                           has_checkpoint, json_bytes, latest_valid_checkpoint, newest_complete,
                                           prune, publish, read_json, resolve_checkpoint, step_dir_name,
                                           verify_checkpoint, write_bytes)
from galaxy.train.checkpoint.state import (check_optimizer, gather_world_json, install_optimizer_state, jsonable,
                                           layout, param_groups, restore_rng, restore_scheduler, rng_record, run_record,
                                           state_record)

if TYPE_CHECKING:
    from galaxy.train.checkpoint.shards import WritePlan

__all__ = ["CheckpointError", "CheckpointState", "PendingCheckpoint", "ResumeError", "export_hf",
           "has_checkpoint", "latest_valid_checkpoint", "load_checkpoint", "prune", "resolve_checkpoint",
           "save_checkpoint", "step_dir_name", "verify_checkpoint"]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2


# The tensor files go through torch.distributed.checkpoint (``shards``; ``regions`` and ``hf_export`` build on it),
# imported where a checkpoint is saved, loaded or exported: importing it costs about 0.5-1 s of CPU, which every
# launcher paid for nothing (it imports ``lock`` from this package; the files, lock and state modules need no DCP).
def __getattr__(name: str):
    if name == "export_hf":
        from galaxy.train.checkpoint.hf_export import export_hf

        return export_hf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass
class CheckpointState:
    """What ``load_checkpoint`` returns: the step the checkpoint was taken after (the next step to
    run is ``step``, 0-based, so ``train`` continues with ``range(step, max_steps)``) and ``extra``."""

    step: int
    path: str
    extra: dict = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- save


class PendingCheckpoint:
    """A save whose shards are being written in the background (``save_checkpoint(..., async_save=True)``).
    ``result()`` is a collective: every rank calls it (before the next save, and before exiting); it
    waits for this rank's files, commits the checkpoint and returns its path, or raises
    ``CheckpointError`` on every rank if any rank failed (one line, the same on every rank, once the
    temporary directory is removed: the checkpoints saved before are untouched)."""

    def __init__(self, ctx: ParallelContext, directory: str, final: str, tmp: str, plan: WritePlan,
                 writing: Future, files: dict[str, bytes], keep_last: Optional[int]):
        self.ctx, self.directory, self.final, self.tmp = ctx, directory, final, tmp
        self.plan, self.writing, self.files, self.keep_last = plan, writing, files, keep_last
        # What this rank writes, for a failure's "needs N bytes": its shards' tensors and its JSON files.
        self.nbytes = sum(c.tensor.numel() * c.tensor.element_size() for c in plan.mine) + \
            sum(len(data) for data in files.values())
        self.path: Optional[str] = None

    def done(self) -> bool:
        """Whether this rank's shards are written (the commit still needs ``result()``)."""
        return self.writing.done()

    def result(self) -> str:
        if self.path is not None:
            return self.path
        ctx, failure, written = self.ctx, None, {"chunks": {}, "files": {}}
        try:
            written = self.writing.result()
        except Exception as e:  # every rank must learn of it, or the others would commit without its shards
            failure = self._failure(e)
        records = gather_world_json(ctx, {"failure": failure, "written": written, "bytes": self.nbytes})
        verdict = ""
        if ctx.rank == 0:
            failures = [r["failure"] for r in records if r["failure"]]
            if not failures:
                try:
                    self._commit([r["written"] for r in records])
                except Exception as e:
                    failures.append(self._failure(e))
            if failures:
                shutil.rmtree(self.tmp, ignore_errors=True)
                verdict = self._failure_line(failures[0], sum(r["bytes"] for r in records))
        verdict = gather_world_json(ctx, verdict)[0]  # rank 0's, once the temporary directory is gone
        if verdict:
            raise CheckpointError(verdict)
        if self.keep_last is not None and ctx.rank == 0:
            prune(self.directory, self.keep_last)
        self.path = self.final
        return self.final

    def _failure(self, error: Exception) -> dict:
        """This rank's failed write, for rank 0's report: the error, the file, and the space left then."""
        return {"rank": self.ctx.rank, "errno": getattr(error, "errno", None),
                "path": getattr(error, "filename", None) or self.tmp, "bytes": self.nbytes,
                "free": free_space(self.directory),
                "text": f"{type(error).__name__}: {' '.join(str(error).split())}"}

    def _failure_line(self, failure: dict, needed: int) -> str:
        """Rank 0's one line for a failed save: what failed where, the space it needs, what is kept. A full
        disk is known by its errno, or (torch.save's zip writer loses the errno of a short write) by a free
        space below what the failed rank had to write."""
        rank, code, path = failure["rank"], failure["errno"], failure["path"]
        kept = newest_complete(self.directory)
        # The shards' serialized size exceeds their tensors' bytes: the last checkpoint's size says it better.
        size = f"about {checkpoint_bytes(kept)} bytes (the last one's size)" if kept else f"at least {needed} bytes"
        full = code is None and failure["free"] is not None and failure["free"] < failure["bytes"]
        if code in (errno.ENOSPC, errno.EDQUOT) or full:
            what = (f": no space left on the device (rank {rank} writing '{path}'); a checkpoint needs {size}, and "
                    f"{free_space(self.directory)} bytes are free")
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
            what = f": {os.strerror(code).lower()} (rank {rank} writing '{path}'); a checkpoint needs {size}"
        else:
            what = f" on rank {rank}: {failure['text']}"
        return (f"saving checkpoint '{self.final}' failed{what}; "
                + (f"the last good checkpoint '{kept}' is kept" if kept else "there is no earlier checkpoint"))

    def _commit(self, written: list[dict]) -> None:
        """Rank 0, once every rank's shards are written: the JSON files, DCP's index, the manifest."""
        from galaxy.train.checkpoint.shards import DCP_METADATA_FILE, dcp_metadata_bytes, manifest_tensors

        tensors = manifest_tensors(self.plan, written)
        entries = {}
        for record in written:
            entries.update(record["files"])
        files = dict(self.files, **{DCP_METADATA_FILE: dcp_metadata_bytes(tensors)})
        for name, data in files.items():
            entries[name] = write_bytes(os.path.join(self.tmp, name), data)
        step = self.plan.records[0]["payload"]["step"]
        publish(self.tmp, self.final, {"format_version": FORMAT_VERSION, "step": step, "files": entries,
                                       **self.plan.records[0]["payload"]["run"], "tensors": tensors})
        logger.info("saved checkpoint %s (step %d, %d tensors, %d files)", self.final, step, len(tensors),
                    len(entries))


def free_space(path: str) -> Optional[int]:
    """Bytes free for writing on the file system of ``path`` (None where it cannot be asked)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def save_checkpoint(directory: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, ctx: ParallelContext, cfg, extra: Optional[dict] = None,
                    keep_last: Optional[int] = None, async_save: bool = False, grad_reducer=None):
    """Save the state after ``step`` optimizer steps to ``directory/step_<step>/``; returns its path.

    A collective: every rank of ``ctx`` must call it. Every rank writes its own shards (a tensor held
    by several ranks is written by one of them); every rank returns only after the checkpoint is
    complete (or raises ``CheckpointError`` on every rank if a write failed). ``keep_last``: then keep
    only the newest K complete checkpoints. ``async_save``: return a :class:`PendingCheckpoint` as soon
    as this rank's tensors are copied to CPU memory; its ``result()`` finishes the save.
    ``grad_reducer`` (the trainer's ``GradReducer``; needed with ``mp_grad_reduce: sharded``): the
    sharded weights' masters and optimizer states are saved from its pieces, as regions of the full
    parameters."""
    from galaxy.train.checkpoint.regions import model_chunks, optimizer_chunks
    from galaxy.train.checkpoint.shards import plan_writes, write_chunks

    check_optimizer(optimizer)
    final = os.path.join(os.path.abspath(directory), step_dir_name(step))
    pieces = grad_reducer.shard_layout() if grad_reducer is not None else []
    chunks, problem = optimizer_chunks(model, optimizer, pieces)
    chunks = model_chunks(model, pieces) + chunks
    payload = {"rng": rng_record(ctx)}
    if ctx.rank == 0:
        payload.update(nonce=uuid.uuid4().hex[:8], step=step, run=run_record(model, ctx))
    plan = plan_writes(ctx, chunks, problem, payload)
    tmp = f"{final}.tmp-{plan.records[0]['payload']['nonce']}"
    files = {}
    if ctx.rank == 0:
        files = {STATE_FILE: json_bytes(state_record(FORMAT_VERSION, step, model, param_groups(model, optimizer),
                                                     scheduler, cfg, extra)),
                 RNG_FILE: json_bytes({"layout": layout(ctx), "ranks": [r["payload"]["rng"] for r in plan.records]})}
    try:
        os.makedirs(tmp, exist_ok=True)
        writing = write_chunks(tmp, ctx.rank, plan.mine, async_save)
    except Exception as e:  # reported at the commit, on every rank
        writing = Future()
        writing.set_exception(e)
    pending = PendingCheckpoint(ctx, directory, final, tmp, plan, writing, files, keep_last)
    return pending if async_save else pending.result()


# ----------------------------------------------------------------------------- load


def _load_tensors(path: str, manifest: dict, state_json: dict, model: nn.Module, optimizer,
                  pieces: list[dict]) -> None:
    from galaxy.train.checkpoint.regions import load_model, read_optimizer_state
    from galaxy.train.checkpoint.shards import ShardReader

    if optimizer is not None:
        check_optimizer(optimizer)
    if int(manifest.get("format_version", 1)) == 1:
        if pieces:
            raise CheckpointError(f"checkpoint '{path}' has format 1, which mp_grad_reduce 'sharded' cannot load; "
                                  "resume it with mp_grad_reduce 'after_backward' and save a new checkpoint")
        legacy.load_model(path, manifest, model)
        if optimizer is not None:
            legacy.load_optimizer(path, manifest, state_json, model, optimizer)
        return
    reader = ShardReader(path, manifest)
    load_model(reader, model, pieces)
    if optimizer is not None:
        local, state = read_optimizer_state(reader, model, optimizer, pieces)
        install_optimizer_state(optimizer, local, state, state_json.get("param_groups") or [],
                                os.path.join(path, STATE_FILE))


def _load_one(path: str, model: nn.Module, optimizer, scheduler, ctx: ParallelContext, pieces: list[dict]):
    """Load one step directory on this rank: (error, whether it is an invalid checkpoint, step, state, manifest)."""
    try:
        manifest = check_sizes(path)
        state_json = read_json(path, STATE_FILE, manifest)
        step = int(state_json["step"])
        _load_tensors(path, manifest, state_json, model, optimizer, pieces)
        if scheduler is not None and state_json.get("scheduler") is not None:
            restore_scheduler(scheduler, state_json["scheduler"], os.path.join(path, STATE_FILE))
        restore_rng(path, manifest, ctx, step)
    except CheckpointError as e:
        return str(e), isinstance(e, InvalidCheckpointError), -1, {}, {}
    return "", False, step, state_json, manifest


def load_checkpoint(path_or_dir: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                    scheduler, ctx: ParallelContext, cfg=None, grad_reducer=None) -> CheckpointState:
    """Restore model, optimizer, LR schedule and RNG states from a step directory, or from the
    newest valid checkpoint under a save directory. Works across plans, world sizes, dp/pp layouts,
    ZeRO states and ``mp_grad_reduce`` modes (``grad_reducer``: the trainer's ``GradReducer``, whose
    ``sharded`` pieces are filled too), and for both checkpoint formats. Every rank calls it (it ends
    with a check that all ranks loaded the same step). No rank hashes the whole checkpoint: each checks
    the files' sizes against the manifest and the checksums of the files it reads; under a save
    directory, a checkpoint any rank finds damaged is skipped by every rank for the next older one.
    ``cfg`` is only compared: a different model section is logged."""
    pieces = grad_reducer.shard_layout() if grad_reducer is not None else []
    candidates = checkpoint_candidates(path_or_dir)
    first_error = ""
    for path in candidates:
        error, invalid, step, state_json, manifest = _load_one(path, model, optimizer, scheduler, ctx, pieces)
        results = gather_world_json(ctx, [error, invalid, step])
        errors = [(e, bad) for e, bad, _ in results if e]
        if not errors:
            break
        if path == path_or_dir or not all(bad for _, bad in errors):
            raise ResumeError(errors[0][0])
        if ctx.rank == 0 and path != candidates[-1]:  # after the last, the error says it
            logger.warning("skipping invalid checkpoint: %s", errors[0][0])
        first_error = first_error or errors[0][0]
    else:
        if not first_error:
            raise ResumeError(f"no valid checkpoint under '{path_or_dir}' (it holds no step_N/ directory); pass a "
                              "step_N checkpoint directory or a save directory holding one")
        raise ResumeError(f"no valid checkpoint under '{path_or_dir}', the newest is damaged ({first_error}); pass "
                          "another checkpoint or start without resuming")
    if any(s != step for _, _, s in results):
        raise ResumeError(f"ranks loaded different checkpoints (this rank: '{path}'); pass --resume PATH "
                          "or make the save directory the same on every rank")
    saved_cfg = state_json.get("config") or {}
    if cfg is not None and saved_cfg.get("model") and saved_cfg["model"] != jsonable(cfg.to_dict()["model"]) \
            and ctx.rank == 0:
        logger.warning("checkpoint '%s' was saved with another model config section; the weights fit, going on",
                       path)
    logger.info("loaded checkpoint %s (step %d, saved by %s)", path, step,
                {k: manifest.get(k) for k in ("world_size", "dp", "pp", "mp", "plan")})
    return CheckpointState(step=step, path=path, extra=state_json.get("extra") or {}, config=saved_cfg)
