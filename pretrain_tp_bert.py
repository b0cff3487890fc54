"""BERT pretraining with tensor parallelism (ATT TP, CON None, MLP TP): ``galaxy pretrain --plan tp``, for masked
LMs only, refusing a config that names another plan."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(plan="tp", strict=True, masked_only=True, description=__doc__))
