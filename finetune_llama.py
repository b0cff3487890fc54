"""LLaMA instruction fine-tuning (Alpaca JSON/JSONL) on any Galaxy plan; default plan when the
config names none: galaxy (ATT TP, CON SP, MLP TP). ``--prompt TEXT`` prints the trained model's
greedy answer."""

import sys

from galaxy.cli.finetune import main

if __name__ == "__main__":
    sys.exit(main(plan="galaxy", strict=False,
                  description="LLaMA instruction fine-tuning on any Galaxy plan (default: ATT TP, CON SP, MLP TP)"))
