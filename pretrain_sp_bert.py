"""BERT pretraining with sequence parallelism (ATT SP, CON SP, MLP SP): ``galaxy pretrain --plan sp``, for masked
LMs only, refusing a config that names another plan."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(plan="sp", strict=True, masked_only=True, description=__doc__))
