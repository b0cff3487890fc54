"""``GalaxyConfig``: a run's configuration, loaded from JSON (nested or flat, with overrides), a preset
expanded, every key checked (``galaxy.config.checks``), and its parallel plan resolved
(``galaxy.config.plan``) once the world size is known."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from galaxy.config import checks, plan
from galaxy.config.keys import canonical_keys, coerce, read_config_file
from galaxy.config.presets import MODEL_PRESETS
from galaxy.config.sections import KEY_SECTION, ConfigError, ConfigSections, Method


@dataclass
class GalaxyConfig(ConfigSections):
    """The six sections (``ConfigSections``), with their loading, checks and plan."""

    # -- loading

    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: Optional[dict[str, Any]] = None) -> "GalaxyConfig":
        flat = canonical_keys(raw)
        flat.update(canonical_keys(overrides or {}))
        cfg = cls()
        preset = flat.pop("preset", None)
        if preset is not None:
            if preset not in MODEL_PRESETS:
                raise ConfigError(f"config key 'preset': unknown model preset '{preset}'; "
                                  f"use one of {', '.join(MODEL_PRESETS)}")
            cfg.model.preset = preset
            for key, value in MODEL_PRESETS[preset].items():
                setattr(cfg.model, key, dict(value) if isinstance(value, dict) else value)  # the preset's own stays
        for key, value in flat.items():
            section = getattr(cfg, KEY_SECTION[key])
            setattr(section, key, coerce(type(section), key, value))
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str, overrides: Optional[dict[str, Any]] = None) -> "GalaxyConfig":
        return cls.from_dict(read_config_file(path), overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- checks and plan

    def validate(self) -> None:
        checks.validate(self)

    def stage_layers(self) -> tuple[int, ...]:
        return plan.stage_layers(self)

    def mp_size(self, world_size: int) -> int:
        return plan.mp_size(self, world_size)

    def methods(self) -> tuple[Method, Method, Method]:
        return plan.methods(self)

    def resolve_plan(self, mp_size: int) -> plan.Plan:
        return plan.resolve_plan(self, mp_size)
