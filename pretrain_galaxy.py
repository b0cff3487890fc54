"""Masked- and causal-LM pretraining on any plan (default galaxy: ATT TP, CON SP, MLP TP), with dp and pp from
the config: ``galaxy pretrain``."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
