"""BERT pretraining with tensor parallelism (ATT TP, CON None, MLP TP)."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(masked_only=True, plan="tp", strict=True, description="BERT pretraining with tensor parallelism (ATT TP, CON None, MLP TP)"))
