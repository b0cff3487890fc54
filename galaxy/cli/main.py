"""``galaxy <command> [flags]``: the one way in. Each command runs its module's ``main`` under its own name
(``galaxy pretrain --help`` says ``usage: galaxy pretrain ...``); the top-level scripts are shims that run the
same ``main``s (``python pretrain_galaxy.py --world 2`` is ``galaxy pretrain --world 2``; the BERT-named
variants are ``galaxy pretrain`` with a plan, dp or pp from flags or the config)."""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Optional


def _command(module: str) -> Callable[[list[str]], int]:
    """The runner of ``galaxy <module>``: its module's ``main`` under the name ``galaxy <module>``."""
    def run(argv: list[str]) -> int:
        return importlib.import_module(f"galaxy.cli.{module}").main(argv, prog=f"galaxy {module}")

    return run


# command -> (what it does, its runner, the script that runs it too)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int], str]] = {
    "pretrain": ("masked- and causal-LM pretraining on any plan (default galaxy), with dp and pp", _command("pretrain"),
                 "pretrain_galaxy.py"),
    "finetune": ("LLaMA instruction fine-tuning on any plan, full or PEFT, with dp and pp", _command("finetune"),
                 "finetune_llama.py"),
    "plan": ("profile a cluster, then search the plans for it and write the config", _command("plan"),
             "plan_galaxy.py"),
    "profile": ("FLOPs and communication profile of one step of a model and plan", _command("profile"),
                "profile_flops.py"),
    "infer": ("single-request latency and greedy generation on any plan", _command("infer"), "infer_galaxy.py"),
    "compare": ("full / LoRA / adapter / side tuning from one base on a held-out task", _command("compare"),
                "compare_tuning.py"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what} ({script})" for name, (what, _, script) in COMMANDS.items())
    return (f"usage: galaxy <command> [flags]\n\ncommands:\n{rows}\n\n"
            "'galaxy <command> --help' lists a command's flags; the script named beside it takes the same.")


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"galaxy: unknown command '{command}'; use one of {', '.join(COMMANDS)} (galaxy --help)",
              file=sys.stderr)
        return 2
    return COMMANDS[command][1](rest) or 0
