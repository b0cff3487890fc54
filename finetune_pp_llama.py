"""LLaMA instruction fine-tuning with pipeline parallelism (GPipe or 1F1B over micro-batches), around any plan.

A config that sets no pp_size and no plan makes every rank a stage: ``--world 2`` is 2 stages.
Run one rank per shell with ``--rank R --world W`` (rendezvous via MASTER_ADDR/MASTER_PORT or
init_method), or all of them here with ``--world W``.
"""

import sys

from galaxy.cli.finetune import main

if __name__ == "__main__":
    sys.exit(main(plan="none", strict=False, fill="pp",
                  description="LLaMA instruction fine-tuning with pipeline parallelism (dp_size x pp_size x mp ranks)"))
