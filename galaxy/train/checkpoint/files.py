"""Checkpoint directories on disk: atomic writes, the manifest that makes a checkpoint valid, verification,
finding the newest valid checkpoint and pruning old ones. Shared by every format version."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from typing import Any, Optional

from galaxy.errors import UserError

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"
RNG_FILE = "rng.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_DIR = re.compile(r"^step_\d+\.(tmp|old)-[0-9a-f]+$")
HASH_BLOCK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the fix."""


class ResumeError(CheckpointError, UserError):
    """A checkpoint that cannot be resumed from: the path does not exist or holds none, its files are
    damaged, or they do not fit the model. Bad input: the CLI prints it as one line, exit code 2."""


class InvalidCheckpointError(ResumeError):
    """A checkpoint whose files do not match its manifest (or that has none): an incomplete or damaged
    save, which resuming from a save directory skips for the next older one."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str, data: bytes) -> dict:
    """Write, flush and fsync ``data``; returns its manifest entry. A failed write's ``OSError`` names ``path``."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, path) from None
        raise
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def file_entry(path: str) -> dict:
    """The manifest entry (size, sha256) of a file on disk, read in blocks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
            size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def new_tmp_dir(final: str) -> str:
    return f"{final}.tmp-{uuid.uuid4().hex[:8]}"


def publish(tmp: str, final: str, manifest: dict) -> None:
    """Rename the finished temporary directory to its final name, then write the manifest (through a
    temporary file + fsync + rename): a checkpoint without its manifest is not valid."""
    parent = os.path.dirname(final)
    fsync_dir(tmp)
    aside = None
    if os.path.exists(final):  # re-saving a step (e.g. after resuming from an older one)
        aside = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(parent)
    part = os.path.join(final, f"{MANIFEST_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_bytes(part, json_bytes(manifest))
        os.rename(part, os.path.join(final, MANIFEST_FILE))
        fsync_dir(final)
    except OSError:  # no manifest, no checkpoint: leave the directory as it was before this save
        shutil.rmtree(final, ignore_errors=True)
        if aside is not None:
            os.rename(aside, final)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


# ----------------------------------------------------------------------------- validation


def read_manifest(path: str) -> dict:
    """The manifest of a checkpoint directory, its structure checked (not yet the files it lists)."""
    mpath = os.path.join(path, MANIFEST_FILE)
    if not os.path.isfile(mpath):
        raise InvalidCheckpointError(f"checkpoint '{path}' has no {MANIFEST_FILE}: the save did not complete; "
                                     "resume from an older checkpoint")
    try:
        with open(mpath, "rb") as f:
            manifest = json.loads(f.read())
        files = manifest["files"]
        int(manifest["step"])
        version = int(manifest.get("format_version", 1))
        for name, entry in files.items():
            if os.path.isabs(name) or ".." in name.split("/"):
                raise ValueError(f"file name '{name}' leaves the checkpoint directory")
            int(entry["size"]), str(entry["sha256"])
        for name in (STATE_FILE, RNG_FILE):
            files[name]
        if version >= 2:
            for key, tensor in manifest["tensors"].items():
                len(tensor["shape"]), str(tensor["dtype"])
                for chunk in tensor["chunks"]:
                    files[chunk["file"]]
                    len(chunk["offsets"]), len(chunk["sizes"]), int(chunk["offset"]), int(chunk["length"])
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidCheckpointError(f"checkpoint manifest '{mpath}' is corrupt ({type(e).__name__}: {e}); "
                                     "resume from an older checkpoint") from None
    return manifest


def verify_file(path: str, name: str, manifest: dict) -> None:
    """Check ``path/name``'s size and sha256 against the manifest."""
    fpath = os.path.join(path, name)
    entry = manifest["files"][name]
    try:
        found = file_entry(fpath)
    except OSError as e:
        raise InvalidCheckpointError(f"checkpoint file '{fpath}' cannot be read ({e})") from None
    if found["size"] != int(entry["size"]):
        raise InvalidCheckpointError(f"checkpoint file '{fpath}' is truncated or altered: {found['size']} bytes, "
                                     f"the manifest says {entry['size']}")
    if found["sha256"] != entry["sha256"]:
        raise InvalidCheckpointError(f"checkpoint file '{fpath}' fails its sha256 checksum: the file is corrupt")


def read_verified(path: str, name: str, manifest: dict) -> bytes:
    """The bytes of ``path/name`` after checking size and sha256 against the manifest."""
    verify_file(path, name, manifest)
    with open(os.path.join(path, name), "rb") as f:
        return f.read()


def read_json(path: str, name: str, manifest: dict) -> dict:
    try:
        return json.loads(read_verified(path, name, manifest))
    except ValueError as e:
        raise InvalidCheckpointError(f"checkpoint file '{os.path.join(path, name)}' is not valid JSON "
                                     f"({e})") from None


def verify_checkpoint(path: str) -> dict:
    """Check a checkpoint directory (manifest, sizes, checksums of every file); returns its manifest or
    raises ``CheckpointError`` naming the offending file."""
    manifest = read_manifest(path)
    for name in manifest["files"]:
        verify_file(path, name, manifest)
    return manifest


def check_sizes(path: str) -> dict:
    """The manifest of a checkpoint directory, after checking that every file it lists exists with its
    size (cheap: no file is read; each rank checks the checksums of what it reads)."""
    manifest = read_manifest(path)
    for name, entry in manifest["files"].items():
        fpath = os.path.join(path, name)
        try:
            size = os.path.getsize(fpath)
        except OSError as e:
            raise InvalidCheckpointError(f"checkpoint file '{fpath}' cannot be read ({e})") from None
        if size != int(entry["size"]):
            raise InvalidCheckpointError(f"checkpoint file '{fpath}' is truncated or altered: {size} bytes, the "
                                         f"manifest says {entry['size']}")
    return manifest


def check_manifest_files(path: str) -> dict:
    """``check_sizes``, and the checksums of the small JSON files (step, schedule, RNG states): what can
    be checked of a checkpoint before a run starts without reading its tensors."""
    manifest = check_sizes(path)
    for name in (STATE_FILE, RNG_FILE):
        read_json(path, name, manifest)
    return manifest


def is_step_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_FILE)) or bool(STEP_DIR.match(os.path.basename(
        os.path.normpath(path))))


def checkpoint_candidates(path_or_dir: str) -> list[str]:
    """A step directory as it is; for a save directory its ``step_N`` directories, newest first."""
    _check_exists(path_or_dir)
    return [path_or_dir] if is_step_dir(path_or_dir) else [path for _, path in _step_dirs(path_or_dir)]


def _check_exists(path: str) -> None:
    if not os.path.exists(path):
        raise ResumeError(f"checkpoint path '{path}' does not exist; pass a step_N checkpoint directory or a save "
                          "directory holding one")


def has_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a step directory with a manifest (not yet whether it verifies)."""
    return any(os.path.isfile(os.path.join(path, MANIFEST_FILE)) for _, path in _step_dirs(directory))


def _step_dirs(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every ``step_N`` directory, newest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for entry in os.listdir(directory):
        m = STEP_DIR.match(entry)
        if m and os.path.isdir(os.path.join(directory, entry)):
            found.append((int(m.group(1)), os.path.join(directory, entry)))
    return sorted(found, reverse=True)


def latest_valid_checkpoint(directory: str) -> Optional[str]:
    """The newest checkpoint under ``directory`` that verifies (every file hashed: a check for one
    process, e.g. a tool; resuming hands the save directory to ``load_checkpoint``, where each rank
    checks only what it reads); invalid newer ones are skipped with a warning. None when there is none."""
    for _, path in _step_dirs(directory):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            logger.warning("skipping invalid checkpoint: %s", e)
    return None


def resolve_checkpoint(path_or_dir: str) -> str:
    """A step directory as it is, or the newest valid checkpoint under a save directory."""
    if is_step_dir(path_or_dir):
        return path_or_dir
    _check_exists(path_or_dir)
    found = latest_valid_checkpoint(path_or_dir)
    if found is None:
        raise ResumeError(f"no valid checkpoint under '{path_or_dir}' (looked for step_N/ directories "
                          "with a matching manifest)")
    return found


def is_complete(path: str) -> bool:
    """Whether a step directory has its manifest and every file it lists, at its size (``check_sizes``)."""
    try:
        check_sizes(path)
        return True
    except CheckpointError:
        return False


def checkpoint_bytes(path: str) -> int:
    """The bytes of a checkpoint directory's files."""
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def newest_complete(directory: str) -> Optional[str]:
    """The newest complete checkpoint under ``directory`` (``is_complete``; not hashed), or None."""
    return next((path for _, path in _step_dirs(directory) if is_complete(path)), None)


def prune(directory: str, keep_last: int) -> list[str]:
    """Remove all but the newest ``keep_last`` complete checkpoints (a manifest whose file sizes
    match; incomplete ones newer than those are kept for inspection) and leftover temporary
    directories of interrupted saves. Returns the removed paths. Call it from one rank."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    removed, kept = [], 0
    for _, path in _step_dirs(directory):
        if kept >= keep_last:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        if is_complete(path):
            kept += 1
    for entry in os.listdir(directory) if os.path.isdir(directory) else []:
        if TMP_DIR.match(entry):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
            removed.append(os.path.join(directory, entry))
    if removed:
        logger.info("pruned %d old checkpoint(s) under %s", len(removed), directory)
    return removed
