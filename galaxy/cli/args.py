"""The flags every training CLI shares, and the config they build (validated, one line per error)."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Optional

from galaxy.config import ConfigError, GalaxyConfig, parse_override
from galaxy.models import check_config

logger = logging.getLogger(__name__)


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config_file", "--config", dest="config_file", default=None,
                   help="JSON config (nested sections or flat Galaxy-LM keys); omitted: the embedded small default")
    p.add_argument("--world", type=int, default=None,
                   help="number of ranks; without --rank all of them start here as local processes")
    p.add_argument("--rank", type=int, default=None, help="run only this rank (others start elsewhere)")
    p.add_argument("--max_steps", type=int, default=None, help="optimizer steps (overrides the config)")
    p.add_argument("--eval_every", type=int, default=None, metavar="N",
                   help="evaluate on the held-out split every N steps and at the end (overrides the config)")
    p.add_argument("--seed", type=int, default=None, help="random seed (overrides the config)")
    p.add_argument("--metrics_file", default=None, help="append one JSON line per step here (rank 0)")
    p.add_argument("--model_path", default=None, help="start from a local HF checkpoint directory")
    p.add_argument("--data", default=None, help="a local .txt or .jsonl file; omitted: the synthetic corpus")
    p.add_argument("--tokenizer", default=None, help="a local HF tokenizer directory for --data")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="set any config key, flat names included (repeatable), e.g. hidden_dropout_prob=0")
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
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue from a checkpoint: a step_N directory, or (no PATH) the newest valid one in "
                        "--save_dir")
    p.add_argument("--keep_last", type=int, default=None, metavar="K",
                   help="with --save_dir: keep only the newest K checkpoints")
    p.add_argument("--emulate", default=None, metavar="CLUSTER_JSON",
                   help="start every rank here inside an emulated heterogeneous cluster: each rank in its own network "
                        "namespace behind a bandwidth-shaped link, with its own CPU quota (root; galaxy/emulate)")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--log_level", default="WARNING", help="python logging level")
    return p



def load_config(args: argparse.Namespace, default: dict) -> GalaxyConfig:
    overrides = dict(parse_override(o) for o in args.override)
    for flag, key in (("max_steps", "max_steps"), ("eval_every", "eval_every"), ("seed", "seed"), ("data", "data"), ("tokenizer", "tokenizer"),
                      ("model_path", "model_path")):
        if getattr(args, flag, None) is not None:  # a CLI may leave some of these flags out
            overrides[key] = getattr(args, flag)
    cfg = (GalaxyConfig.from_file(args.config_file, overrides) if args.config_file
           else GalaxyConfig.from_dict(default, overrides))
    check_config(cfg.model)
    return cfg



def check_profile_step(args: argparse.Namespace, cfg: GalaxyConfig) -> None:
    """``--profile_step K`` must name one of the steps that will run."""
    k = getattr(args, "profile_step", None)
    if k is not None and not 1 <= k <= cfg.train.max_steps:
        raise ConfigError(f"--profile_step {k} is outside the steps that run (1..{cfg.train.max_steps}); "
                          "pick one of them or raise --max_steps")
    if getattr(args, "profile_json", None) and k is None:
        raise ConfigError("--profile_json needs --profile_step K")



def check_checkpoint_flags(args: argparse.Namespace) -> None:
    """``--save_every`` / ``--keep_last`` need ``--save_dir``; ``--resume`` without PATH needs it too."""
    save_dir = getattr(args, "save_dir", None)
    if getattr(args, "save_every", 0) < 0:
        raise ConfigError(f"--save_every must be 0 or positive, got {args.save_every}")
    if getattr(args, "keep_last", None) is not None and args.keep_last < 1:
        raise ConfigError(f"--keep_last must be at least 1, got {args.keep_last}")
    if not save_dir and (getattr(args, "save_every", 0) or getattr(args, "keep_last", None) is not None):
        raise ConfigError("--save_every and --keep_last need --save_dir DIR")
    if getattr(args, "resume", None) == "latest" and not save_dir:
        raise ConfigError("--resume without a PATH resumes from --save_dir; pass --save_dir DIR or --resume PATH")
    check_resume(args)



def check_resume(args: argparse.Namespace) -> None:
    """What ``--resume`` names exists and holds a checkpoint that looks whole: its manifest, every file's
    size and the checksums of its small JSON files (cheap; the ranks check the checksums of the tensor
    files they read). Under a save directory one such checkpoint is enough: the ranks skip damaged newer
    ones. A bare ``--resume`` with no checkpoint in ``--save_dir`` yet starts afresh (``resume_path``)."""
    resume = getattr(args, "resume", None)
    if resume is None:
        return
    from galaxy.train.checkpoint.files import (CheckpointError, checkpoint_candidates, check_manifest_files,
                                               has_checkpoint)

    path = args.save_dir if resume == "latest" else resume
    flag = "--resume" if resume != "latest" else f"--resume (from --save_dir '{path}')"
    if resume == "latest" and not has_checkpoint(path):
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
    hold text and are UTF-8 (``galaxy.data.files``), the tokenizer and model directories exist."""
    from galaxy.data.files import check_text_file

    d = cfg.data
    for key, path in (("data", d.data), ("eval_data", d.eval_data)):
        if path:
            check_text_file(path, f"config key '{key}'" + (" (--data)" if key == "data" else ""))
    for key, path, flag in (("tokenizer", d.tokenizer, "--tokenizer"), ("model_path", d.model_path, "--model_path")):
        if path and not os.path.isdir(path):
            raise ConfigError(f"config key '{key}' ({flag}): '{path}' "
                              f"{'is not a directory' if os.path.exists(path) else 'does not exist'}; pass a local "
                              f"HF {'tokenizer' if key == 'tokenizer' else 'model'} directory")



def resume_path(args: argparse.Namespace) -> Optional[str]:
    """What to resume from: --resume PATH, or for a bare --resume --save_dir itself, whose newest valid
    checkpoint the load picks, each rank checking only the files it reads (None, starting afresh with a
    warning, when it holds no checkpoint yet)."""
    resume = getattr(args, "resume", None)
    if resume != "latest":
        return resume
    from galaxy.train.checkpoint import has_checkpoint

    if not has_checkpoint(args.save_dir):
        logger.warning("--resume: no checkpoint in '%s' yet; starting from step 0", args.save_dir)
        return None
    return args.save_dir
