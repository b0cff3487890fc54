"""BERT pretraining with data parallelism around any plan (dp_size x pp_size x mp ranks). A config that sets no
dp_size and no plan makes every rank a dp rank: ``pretrain_dp_bert.py --world 4`` is
``galaxy pretrain --plan none --override dp_size=4 --world 4``."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(plan="none", fill="dp", masked_only=True, description=__doc__))
