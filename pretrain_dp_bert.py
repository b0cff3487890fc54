"""BERT pretraining with data parallelism (each dp rank a shard of the global batch), around any plan.

A config that sets no dp_size and no plan makes every rank a dp rank: ``--world 4`` is dp 4.
"""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(masked_only=True, plan="none", strict=False, fill="dp",
                  description="BERT pretraining with data parallelism (dp_size x pp_size x mp ranks)"))
