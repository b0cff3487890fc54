"""BERT pretraining with pipeline parallelism (GPipe or 1F1B) around any plan (dp_size x pp_size x mp ranks). A
config that sets no pp_size and no plan makes every rank a stage: ``pretrain_pp_bert.py --world 4`` is
``galaxy pretrain --plan none --override pp_size=4 --world 4``."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(plan="none", fill="pp", masked_only=True, description=__doc__))
