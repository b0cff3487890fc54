"""BERT pretraining with pipeline parallelism (GPipe or 1F1B over micro-batches), around any plan.

A config that sets no pp_size and no plan makes every rank a stage: ``--world 4`` is 4 stages.
"""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(masked_only=True, plan="none", strict=False, fill="pp",
                  description="BERT pretraining with pipeline parallelism (dp_size x pp_size x mp ranks)"))
