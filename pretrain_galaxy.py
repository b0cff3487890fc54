"""BERT pretraining on any Galaxy plan (default: ATT TP, CON SP, MLP TP)."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(plan="galaxy", strict=False, description="BERT pretraining on any Galaxy plan (default: ATT TP, CON SP, MLP TP)"))
