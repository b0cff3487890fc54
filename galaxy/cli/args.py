"""The flags of the commands, the config they build (a checkpoint's own model section included) and the
typed options the ranks are given instead of the parsed flags; every bad value is one line.

Flag groups: ``add_launch_flags`` (where the ranks start), ``add_config_flags`` (what the run is),
``add_training_flags`` (what a training run writes and how long it runs); ``build_parser`` adds all
three, as the training commands take them. ``load_config`` builds the config: the config file (or the
command's embedded default), then the flags and ``--override``; with ``model_path`` the model section is
the checkpoint's own ``config.json`` (``checkpoint_model``), which a config file's model keys must agree
with. ``RunOptions`` is what the ranks are told besides the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from galaxy.config import (COMPUTE_KEYS, KEY_SECTION, MODEL_PRESETS, PLAN_PRESETS, ConfigError, GalaxyConfig,
                           ModelConfig, canonical_keys, parse_override, read_config_file, read_json_object)
from galaxy.models import check_config, hf_model_class
from galaxy.train.options import Checkpointing, Reporting

logger = logging.getLogger(__name__)

RESUME_LATEST = "latest"  # --resume without a PATH: the newest valid checkpoint in --save_dir


# ----------------------------------------------------------------------------- parsers


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default said once: appended where the help text does not say it already, and left out
    where there is none to say (no value, a switch that is off). Descriptions and epilogs keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is argparse.SUPPRESS
                or action.default is None or action.default is False or action.default == []):
            return text
        return f"{text} (default: %(default)s)"


def new_parser(prog: Optional[str], description: str) -> argparse.ArgumentParser:
    """A command's parser; ``prog`` names it in the usage line (``galaxy pretrain``; None: the script's name)."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def add_launch_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Where the ranks start: here, one per shell, under torchrun, or inside an emulated cluster."""
    p.add_argument("--world", type=int, default=None,
                   help="number of ranks; without --rank all of them start here as local processes (default: 1, "
                        "or WORLD_SIZE under torchrun)")
    p.add_argument("--rank", type=int, default=None, help="run only this rank (the others start elsewhere)")
    p.add_argument("--emulate", default=None, metavar="CLUSTER_JSON",
                   help="start every rank here inside an emulated heterogeneous cluster: each rank in its own network "
                        "namespace behind a bandwidth-shaped link, with its own CPU quota (root; galaxy/emulate)")
    p.add_argument("--log_level", default="WARNING", help="python logging level")
    return p


def add_config_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What the run is: the config, any key set on the command line, a checkpoint to start from."""
    p.add_argument("--config_file", "--config", dest="config_file", default=None,
                   help="JSON config (nested sections or flat Galaxy-LM keys); omitted: the embedded small default")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="set any config key, flat names included (repeatable), e.g. hidden_dropout_prob=0")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: the config's)")
    p.add_argument("--model_path", default=None,
                   help="start from a local HF checkpoint directory; its config.json sets the model (family and "
                        "sizes), which the config's model section must agree with")
    return p


def add_training_flags(p: argparse.ArgumentParser, plan: str = "galaxy") -> argparse.ArgumentParser:
    """How long a training run runs, what it reads and what it writes; ``plan``: the command's plan."""
    p.add_argument("--plan", choices=sorted(PLAN_PRESETS), default=None,
                   help=f"parallel plan (default: the config's, else {plan})")
    p.add_argument("--max_steps", type=int, default=None, help="optimizer steps (default: the config's)")
    p.add_argument("--eval_every", type=int, default=None, metavar="N",
                   help="evaluate on the held-out split every N steps and at the end (default: the config's)")
    p.add_argument("--data", default=None, help="a local .txt or .jsonl file (default: the synthetic corpus)")
    p.add_argument("--tokenizer", default=None, help="a local HF tokenizer directory for --data")
    p.add_argument("--metrics_file", default=None, help="append one JSON line per step here (rank 0)")
    p.add_argument("--summary_json", default=None, help="write the final summary as JSON here (rank 0)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard event files here (rank 0): loss, lr, grad norm, tokens/s, tokens/s per "
                        "GPU, MFU, peak memory (needs the tensorboard package)")
    p.add_argument("--peak_tflops", type=float, default=None,
                   help="peak dense TFLOP/s of one device, for MFU (default: config key peak_tflops, else looked up "
                        "for known GPUs; on CPU MFU is not reported without it)")
    p.add_argument("--profile_step", type=int, default=None, metavar="K",
                   help="profile training step K (1-based): rank 0 prints its FLOPs/communication report")
    p.add_argument("--profile_json", default=None, help="with --profile_step: write the profile as JSON here (rank 0)")
    p.add_argument("--save_dir", default=None, help="write checkpoints (step_N/ directories) here")
    p.add_argument("--save_every", type=int, default=0, metavar="N",
                   help="with --save_dir: a checkpoint after every N-th step and after the last (0: the last only)")
    p.add_argument("--resume", nargs="?", const=RESUME_LATEST, default=None, metavar="PATH",
                   help="continue from a checkpoint: a step_N directory, or (no PATH) the newest valid one in "
                        "--save_dir")
    p.add_argument("--keep_last", type=int, default=None, metavar="K",
                   help="with --save_dir: keep only the newest K checkpoints")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def build_parser(description: str, prog: Optional[str] = None, plan: str = "galaxy") -> argparse.ArgumentParser:
    """The flags of the training commands (pretrain, finetune); ``plan``: the one a config that names none gets."""
    p = new_parser(prog, description)
    add_config_flags(p)
    add_launch_flags(p)
    return add_training_flags(p, plan)


# ----------------------------------------------------------------------------- the config

# flag -> the config key it sets (over the config file and --override), for the flags a command has
FLAG_KEYS = {"max_steps": "max_steps", "eval_every": "eval_every", "seed": "seed", "data": "data",
             "tokenizer": "tokenizer", "model_path": "model_path", "plan": "plan", "seq_length": "seq_length",
             "global_batch_size": "global_batch_size"}
# Model keys a run chooses for itself over a checkpoint's: how it computes, and the task's own head
# (an MLM checkpoint has no classifier; its config.json still names two labels).
RUN_MODEL_KEYS = COMPUTE_KEYS + ("num_labels", "classifier_pooling")


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """``--override KEY=VALUE`` pairs, then the flags that set a config key (they win)."""
    overrides = dict(parse_override(o) for o in getattr(args, "override", []))
    for flag, key in FLAG_KEYS.items():
        if getattr(args, flag, None) is not None:  # a command may lack some of these flags
            overrides[key] = getattr(args, flag)
    return overrides


def checkpoint_model(path: str) -> ModelConfig:
    """The model section of the local HF checkpoint in ``path``: its ``config.json`` read by the family its
    ``model_type`` names (the model registry), with the weights checked to be there."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        where = "is not a directory" if os.path.exists(path) and not os.path.isdir(path) else \
            "does not exist" if not os.path.exists(path) else "holds none"
        raise ConfigError(f"config key 'model_path' (--model_path): '{path}' has no config.json (the path {where}); "
                          "pass a local HF model directory")
    if not any(f.endswith(".safetensors") or (f.startswith("pytorch_model") and f.endswith(".bin"))
               for f in os.listdir(path)):
        raise ConfigError(f"config key 'model_path' (--model_path): '{path}' holds no *.safetensors or "
                          "pytorch_model*.bin weights; pass a local HF model directory")
    hf = read_json_object(config_file, "config key 'model_path' (--model_path): the checkpoint's config")
    try:
        return hf_model_class(hf, f"model_path '{path}'").config_from_hf(hf)
    except ValueError as e:  # ConfigError included: the family cannot read this config.json
        raise ConfigError(f"config key 'model_path' (--model_path): {e}") from None


def with_checkpoint_model(raw: dict, checkpoint: ModelConfig, path: str, given: Optional[str], overrides: dict
                          ) -> dict:
    """``raw`` (a config, nested or flat) with its model section replaced by ``checkpoint``'s (the model of
    the checkpoint in ``path``); the keys a run chooses itself (``RUN_MODEL_KEYS``) stay ``raw``'s. A model
    key that ``given`` (what named ``raw``'s model section, e.g. "config file 'x.json'"; None: the command's
    embedded default, which the checkpoint replaces) sets to another value than the checkpoint is one line
    naming the key, unless an override sets it."""
    flat = canonical_keys(raw)
    chosen = {k: v for k, v in flat.items() if KEY_SECTION[k] != "model" or k in RUN_MODEL_KEYS}
    if given is not None:
        model = dict(MODEL_PRESETS.get(flat.get("preset"), {}))
        model.update({k: v for k, v in flat.items() if KEY_SECTION[k] == "model" and k != "preset"})
        overridden = canonical_keys(overrides)
        for key, value in model.items():
            if key not in RUN_MODEL_KEYS and key not in overridden and getattr(checkpoint, key) != value:
                raise ConfigError(f"config key '{key}' is {value!r} in {given} but {getattr(checkpoint, key)!r} in "
                                  f"the checkpoint '{path}' (its config.json sets the model); drop '{key}' from the "
                                  f"config, or --override {key}=... to change it")
    return {**chosen, **architecture(checkpoint)}


def architecture(model: ModelConfig) -> dict[str, Any]:
    """The keys of ``model`` that a checkpoint fixes (all but the run's own, ``RUN_MODEL_KEYS``)."""
    return {k: v for k, v in dataclasses.asdict(model).items() if k not in RUN_MODEL_KEYS and k != "preset"}


def build_config(config_file: Optional[str], default: dict, overrides: dict, given: Optional[str] = None
                 ) -> GalaxyConfig:
    """The config: ``config_file`` (else ``default``, whose model section ``given`` names when a flag chose
    it, e.g. "--model bert-base"), the checkpoint's model section where one is given, then ``overrides``."""
    raw = read_config_file(config_file) if config_file else default
    given = f"config file '{config_file}'" if config_file else given
    path = overrides.get("model_path") or canonical_keys(raw).get("model_path")
    checkpoint = checkpoint_model(path) if path else None
    if checkpoint is not None:
        raw = with_checkpoint_model(raw, checkpoint, path, given, overrides)
    cfg = GalaxyConfig.from_dict(raw, overrides)
    check_config(cfg.model)
    return cfg


def load_config(args: argparse.Namespace, default: dict, given: Optional[str] = None) -> GalaxyConfig:
    """The config of a command's flags: ``--config_file`` or ``default``, ``--model_path``'s model section,
    then ``--override`` and the flags that set a key (``build_config``)."""
    return build_config(getattr(args, "config_file", None), default, flag_overrides(args), given)


def model_flag_config(args: argparse.Namespace, default_preset: Optional[str], fixed: Optional[dict] = None
                      ) -> GalaxyConfig:
    """The config of a command whose ``--model`` names a preset or a JSON config file (``--config_file``
    too; neither: ``default_preset``); ``fixed``: keys the command sets over every flag."""
    name = args.model
    if name and getattr(args, "config_file", None):
        raise ConfigError("give the model as --model or as --config_file, not both")
    overrides = {**flag_overrides(args), **(fixed or {})}
    if name is None or name in MODEL_PRESETS:
        preset = name or default_preset
        return build_config(getattr(args, "config_file", None), {"model": {"preset": preset}} if preset else {},
                            overrides, f"--model {name}" if name else None)
    if not os.path.isfile(name):
        raise ConfigError(f"--model '{name}' is neither a preset ({', '.join(MODEL_PRESETS)}) nor a config file")
    return build_config(name, {}, overrides)


# ----------------------------------------------------------------------------- what the ranks are told


@dataclass(frozen=True)
class RunOptions:
    """What every rank of a run is told besides the config, typed; a bad value is one ``ConfigError`` line
    when it is made (before any rank starts). Commands without a training loop leave the loop's fields unset."""

    log_level: str = "WARNING"
    no_progress: bool = False
    metrics_file: Optional[str] = None
    summary_json: Optional[str] = None
    tensorboard: Optional[str] = None
    peak_tflops: Optional[float] = None
    profile_step: Optional[int] = None
    profile_json: Optional[str] = None
    save_dir: Optional[str] = None
    save_every: int = 0
    keep_last: Optional[int] = None
    resume: Optional[str] = None  # a checkpoint path, or RESUME_LATEST
    launcher_pid: Optional[int] = None  # set on a rank the local launcher started: the process it must not outlive

    def __post_init__(self) -> None:
        if not isinstance(getattr(logging, str(self.log_level).upper(), None), int):
            raise ConfigError(f"--log_level '{self.log_level}' is not a logging level; use DEBUG, INFO, WARNING or "
                              "ERROR")
        if self.resume == RESUME_LATEST and not self.save_dir:
            raise ConfigError("--resume without a PATH resumes from --save_dir; pass --save_dir DIR or --resume PATH")
        self.reporting(), self.checkpointing()  # their checks, before any rank starts

    def reporting(self) -> Reporting:
        return Reporting(progress=not self.no_progress, metrics_file=self.metrics_file,
                         tensorboard_dir=self.tensorboard, peak_tflops=self.peak_tflops,
                         profile_step=self.profile_step, profile_json=self.profile_json)

    def checkpointing(self, resume: Optional[str] = None) -> Checkpointing:
        """``resume``: the checkpoint ``--resume`` stands for (``resume_path``), None to start afresh."""
        return Checkpointing(save_dir=self.save_dir, save_every=self.save_every, keep_last=self.keep_last,
                             resume=resume)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunOptions":
        """The options a command's flags give (its flags of these names; the rest keep their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


# ----------------------------------------------------------------------------- checks before any rank starts


def check_profile_step(options: RunOptions, cfg: GalaxyConfig) -> None:
    """``--profile_step K`` must name one of the steps that will run."""
    k = options.profile_step
    if k is not None and not 1 <= k <= cfg.train.max_steps:
        raise ConfigError(f"--profile_step {k} is outside the steps that run (1..{cfg.train.max_steps}); "
                          "pick one of them or raise --max_steps")


def check_resume(options: RunOptions) -> None:
    """What ``--resume`` names exists and holds a checkpoint that looks whole: its manifest, every file's
    size and the checksums of its small JSON files (cheap; the ranks check the checksums of the tensor
    files they read). Under a save directory one such checkpoint is enough: the ranks skip damaged newer
    ones. A bare ``--resume`` with no checkpoint in ``--save_dir`` yet starts afresh (``resume_path``)."""
    resume = options.resume
    if resume is None:
        return
    from galaxy.train.checkpoint.files import (CheckpointError, checkpoint_candidates, check_manifest_files,
                                               has_checkpoint)

    path = options.save_dir if resume == RESUME_LATEST else resume
    flag = "--resume" if resume != RESUME_LATEST else f"--resume (from --save_dir '{path}')"
    if resume == RESUME_LATEST and not has_checkpoint(path):
        return
    if not os.path.exists(path):
        raise ConfigError(f"--resume '{path}' does not exist; pass a step_N checkpoint directory or the --save_dir "
                          "of an earlier run")
    if not os.path.isdir(path):
        raise ConfigError(f"--resume '{path}' is a file; pass a step_N checkpoint directory or the --save_dir of "
                          "an earlier run")
    candidates = checkpoint_candidates(path)
    if not candidates:
        raise ConfigError(f"--resume '{path}' holds no checkpoint (no step_N directory); pass a step_N checkpoint "
                          "directory or the --save_dir of an earlier run")
    problems = []
    for candidate in candidates:
        try:
            check_manifest_files(candidate)
            return
        except CheckpointError as e:
            problems.append(str(e))
    if len(candidates) == 1:
        raise ConfigError(f"{flag}: {problems[0]}")
    raise ConfigError(f"{flag}: none of its {len(candidates)} checkpoints is whole; the newest: {problems[0]}")


def check_input_files(cfg: GalaxyConfig) -> None:
    """The files and directories the config names, checked before any rank starts: the data files exist,
    hold text and are UTF-8 (``galaxy.data.files``), the tokenizer directory exists (``model_path`` is read
    with the config: ``checkpoint_model``)."""
    from galaxy.data.files import check_text_file

    d = cfg.data
    for key, path in (("data", d.data), ("eval_data", d.eval_data)):
        if path:
            check_text_file(path, f"config key '{key}'" + (" (--data)" if key == "data" else ""))
    if d.tokenizer and not os.path.isdir(d.tokenizer):
        raise ConfigError(f"config key 'tokenizer' (--tokenizer): '{d.tokenizer}' "
                          f"{'is not a directory' if os.path.exists(d.tokenizer) else 'does not exist'}; pass a local "
                          "HF tokenizer directory")


def resume_path(options) -> Optional[str]:
    """What to resume from: --resume PATH, or for a bare --resume --save_dir itself, whose newest valid
    checkpoint the load picks, each rank checking only the files it reads (None, starting afresh with a
    warning, when it holds no checkpoint yet)."""
    resume = options.resume
    if resume != RESUME_LATEST:
        return resume
    from galaxy.train.checkpoint import has_checkpoint

    if not has_checkpoint(options.save_dir):
        logger.warning("--resume: no checkpoint in '%s' yet; starting from step 0", options.save_dir)
        return None
    return options.save_dir
