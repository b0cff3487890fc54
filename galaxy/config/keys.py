"""From a raw JSON object to canonical config keys: aliases, the seed's tuning flags and legacy keys,
each value checked against its field's type; config files and ``--override`` values."""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
from typing import Any, get_args, get_origin, get_type_hints

from galaxy.config.sections import KEY_SECTION, SECTIONS, ConfigError

logger = logging.getLogger(__name__)

# Flat names used by the original Galaxy-LM configs and common CLI habits.
ALIASES = {
    "pad_size": "seq_length",
    "seq_len": "seq_length",
    "batch_size": "global_batch_size",
    "learning_rate": "lr",
    "train_path": "data",
    "dev_path": "eval_data",
    "vocab_path": "tokenizer",
    "lora_r": "lora_dim",
    "lora_att_dim": "lora_dim",
    "timeout": "timeout_s",
    "backend": "distributed_backend",
    "parallel_plan": "plan",
    "target_modules": "lora_target_modules",
    "num_micro_batches": "num_microbatches",
    "recompute_granularity": "recompute",  # Megatron-LM's name
}

# Galaxy-LM keys that have no meaning here: accepted, with a warning naming why.
IGNORED_LEGACY_KEYS = {
    "directionality": "BERT is always bidirectional",
    "train": "training is selected by the CLI you run",
    "test_path": "evaluation uses eval_data",
    "num_epochs": "training length is max_steps",
    "att_head_size": "derived from hidden_size / num_attention_heads",
    "class_list": "classification labels come from the data",
}

# Seed-style tuning flags, mapped onto peft.tuning.
TUNING_FLAGS = {"full_model": "full", "use_lora": "lora", "use_adapter": "adapter", "use_side": "side"}


def _suggest(key: str) -> str:
    candidates = list(KEY_SECTION) + list(ALIASES) + list(SECTIONS) + list(TUNING_FLAGS)
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


@functools.cache
def _field_types(section_cls) -> dict[str, Any]:
    """A section's resolved annotations, read only: resolving them (``get_type_hints`` evaluates every string
    annotation) costs more than checking a value, and a config checks each of its keys."""
    return get_type_hints(section_cls)


def coerce(section_cls, key: str, value: Any) -> Any:
    """Check ``value`` against the field's annotation, converting the safe cases (int -> float)."""
    hint = _field_types(section_cls)[key]
    optional = get_origin(hint) is not None and type(None) in get_args(hint)
    if optional:
        if value is None:
            return None
        hint = next(a for a in get_args(hint) if a is not type(None))
    origin = get_origin(hint)
    if origin is list:
        (item,) = get_args(hint)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, item) and not isinstance(v, bool)
                                                           for v in value):
            raise ConfigError(f"config key '{key}' must be a list of {item.__name__}, got {value!r}")
        return list(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if hint is dict and isinstance(value, dict):
        return value
    if not isinstance(value, hint) or (hint in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"config key '{key}' must be {hint.__name__}, got {value!r}")
    return value


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """Nested or flat JSON -> {canonical key: value}, with aliases, tuning flags and legacy keys handled."""
    flat: dict[str, Any] = {}
    tuning_flags = []

    def put(key: str, value: Any, where: str) -> None:
        if key in TUNING_FLAGS:
            if not isinstance(value, bool):
                raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
            if value:
                tuning_flags.append(key)
            return
        if key in IGNORED_LEGACY_KEYS:
            logger.warning("config key '%s' is ignored: %s", key, IGNORED_LEGACY_KEYS[key])
            return
        canonical = ALIASES.get(key, key)
        if canonical not in KEY_SECTION:
            raise ConfigError(f"unknown config key '{key}'{where}{_suggest(key)}")
        if canonical in flat and flat[canonical] != value:
            raise ConfigError(f"config key '{canonical}' is given twice with different values "
                              f"({flat[canonical]!r} and {value!r}); keep one")
        flat[canonical] = value

    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            for inner, v in value.items():
                put(inner, v, f" in section '{key}'")
        else:
            put(key, value, "")
    if len(tuning_flags) > 1:
        raise ConfigError(f"config keys {', '.join(tuning_flags)} select more than one tuning method; "
                          "set only one (or use 'tuning')")
    if tuning_flags:
        chosen = TUNING_FLAGS[tuning_flags[0]]
        if "tuning" in flat and flat["tuning"] != chosen:
            raise ConfigError(f"config key '{tuning_flags[0]}' selects '{chosen}' but 'tuning' is "
                              f"'{flat['tuning']}'; keep one")
        flat["tuning"] = chosen
    return flat


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """The JSON object in the file ``path`` (``what`` names it in the one-line error of a file that is not one)."""
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} '{path}' is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} '{path}' must hold a JSON object")
    return raw


def read_config_file(path: str) -> dict[str, Any]:
    """A config file's raw JSON object (nested or flat; ``GalaxyConfig.from_dict`` reads it)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist; pass --config_file with a JSON file "
                          "(see train_config/)")
    return read_json_object(path, "config file")


def canonical_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A raw config, nested or flat, as {canonical key: value} (aliases and tuning flags resolved, a preset
    left as its name), checked as ``GalaxyConfig.from_dict`` checks it: what the CLIs merge configs by."""
    return _flatten(raw)


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line; VALUE is read as JSON when it parses, else as a string."""
    if "=" not in text:
        raise ConfigError(f"--override '{text}' must look like KEY=VALUE, e.g. --override hidden_dropout_prob=0")
    key, value = text.split("=", 1)
    key = key.strip()
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key, parsed
