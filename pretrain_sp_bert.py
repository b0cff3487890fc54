"""BERT pretraining with sequence parallelism (ATT SP, CON SP, MLP SP)."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(masked_only=True, plan="sp", strict=True, description="BERT pretraining with sequence parallelism (ATT SP, CON SP, MLP SP)"))
