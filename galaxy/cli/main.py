"""``galaxy <command> [flags]``: one entry point for the commands the top-level scripts run.

Each command takes exactly the flags of its script (``galaxy pretrain --world 2`` is
``python pretrain_galaxy.py --world 2``); ``galaxy <command> --help`` lists them."""

from __future__ import annotations

import sys
from typing import Callable, Optional


def _pretrain(argv: list[str]) -> int:
    from galaxy.cli.pretrain import main

    return main(argv, plan="galaxy", strict=False, description=COMMANDS["pretrain"][0])


def _finetune(argv: list[str]) -> int:
    from galaxy.cli.finetune import main

    return main(argv, plan="galaxy", strict=False, description=COMMANDS["finetune"][0])


def _module_main(module: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(f"galaxy.cli.{module}").main(argv)

    return run


# command -> (what it does, its runner, the script that runs it too)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int], str]] = {
    "pretrain": ("masked- and causal-LM pretraining on any plan (default galaxy: ATT TP, CON SP, MLP TP), with dp "
                 "and pp", _pretrain, "pretrain_galaxy.py"),
    "finetune": ("LLaMA instruction fine-tuning on any plan, full or PEFT (default galaxy)", _finetune,
                 "finetune_llama.py"),
    "plan": ("profile a cluster, then search the plans for it and write the config", _module_main("plan"),
             "plan_galaxy.py"),
    "profile": ("FLOPs and communication profile of a model and plan", _module_main("profile"), "profile_flops.py"),
    "infer": ("single-request latency and greedy generation on any plan", _module_main("infer"), "infer_galaxy.py"),
    "compare": ("full / LoRA / adapter / side tuning from one base on a held-out task", _module_main("compare"),
                "compare_tuning.py"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what} ({script})" for name, (what, _, script) in COMMANDS.items())
    return (f"usage: galaxy <command> [flags]\n\ncommands:\n{rows}\n\n"
            "'galaxy <command> --help' lists a command's flags; they are its script's.")


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
