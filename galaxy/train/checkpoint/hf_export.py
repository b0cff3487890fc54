"""A checkpoint's model as a HF directory (config.json + safetensors), streamed: full tensors are read
from the checkpoint one module at a time and written in files of at most ``max_shard_bytes``
(``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` with HF's ``model.safetensors.index.json``),
so the exporting process never holds the whole model."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict

from galaxy.config import GalaxyConfig
from galaxy.data.pretraining import TOKENIZER_DIR
from galaxy.train.checkpoint import legacy
from galaxy.train.checkpoint.files import STATE_FILE, CheckpointError, read_json, read_manifest, resolve_checkpoint
from galaxy.train.checkpoint.regions import MODEL, module_of, model_key
from galaxy.train.checkpoint.shards import ShardReader

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # transformers' long-standing default max_shard_size


def _model_tensors(path: str, manifest: dict):
    """(names, read): the checkpoint's parameter names and ``read(names) -> name -> full tensor``."""
    if int(manifest.get("format_version", 1)) == 1:
        return legacy.full_tensors(path, manifest)
    reader = ShardReader(path, manifest)
    names = [k[len(MODEL) + 1:] for k in reader.tensors if k.startswith(f"{MODEL}/")]

    def read(wanted: list[str]) -> dict:
        full = reader.read_full([model_key(n) for n in wanted])
        return {n: full[model_key(n)] for n in wanted}

    return names, read


def _model_class(state_json: dict, path: str):
    """The class of the checkpoint's model (from the registry, by the name the checkpoint records):
    its HF config (``hf_config``) and layout conversion (``state_to_hf``) are the class's, from the
    typed config; no model is built."""
    from galaxy.models import model_class_named

    try:
        cls = model_class_named(state_json.get("model_class"))
    except ValueError as e:
        raise CheckpointError(f"checkpoint file '{os.path.join(path, STATE_FILE)}' cannot be exported to HF: {e}") \
            from None
    if not state_json.get("config"):
        raise CheckpointError(f"checkpoint file '{os.path.join(path, STATE_FILE)}' records no model config, which "
                              "the export to HF needs")
    return cls


def export_hf(checkpoint: str, out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write a checkpoint's model (either format) as a HF directory, with the tokenizer the run trained
    when one sits beside the checkpoint (``<save_dir>/tokenizer``); returns ``out_dir``."""
    from safetensors.torch import save_file

    path = resolve_checkpoint(checkpoint)
    manifest = read_manifest(path)
    state_json = read_json(path, STATE_FILE, manifest)
    cls = _model_class(state_json, path)
    config = GalaxyConfig.from_dict(state_json["config"]).model
    names, read = _model_tensors(path, manifest)
    by_module = defaultdict(list)
    for name in names:
        by_module[module_of(name)].append(name)
    os.makedirs(out_dir, exist_ok=True)
    parts, current, size = [], {}, 0

    def flush():
        nonlocal current, size
        if current:
            part = os.path.join(out_dir, f".part-{len(parts)}.safetensors")
            save_file(current, part, metadata={"format": "pt"})
            parts.append((part, list(current)))
        current, size = {}, 0

    total, dtype = 0, None  # dtype: the first floating-point tensor's, as HF's save_pretrained records
    for module in by_module.values():
        for name, tensor in cls.state_to_hf(read(module)).items():
            if dtype is None and tensor.is_floating_point():
                dtype = tensor.dtype
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > max_shard_bytes:
                flush()
            current[name] = tensor.contiguous()
            size += nbytes
            total += nbytes
    flush()
    if len(parts) == 1:
        os.replace(parts[0][0], os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map = {}
        for i, (part, keys) in enumerate(parts):
            name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            os.replace(part, os.path.join(out_dir, name))
            weight_map.update(dict.fromkeys(keys, name))
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cls.hf_config(config, dtype), f, indent=2)
    tokenizer = os.path.join(os.path.dirname(os.path.abspath(path)), TOKENIZER_DIR)
    if os.path.isdir(tokenizer):  # the WordPiece the run trained, kept beside its checkpoints
        for name in os.listdir(tokenizer):
            shutil.copy2(os.path.join(tokenizer, name), os.path.join(out_dir, name))
    return out_dir
