"""LLaMA instruction fine-tuning with pipeline parallelism (GPipe or 1F1B) around any plan. A config that sets no
pp_size and no plan makes every rank a stage: ``finetune_pp_llama.py --world 2`` is
``galaxy finetune --plan none --override pp_size=2 --world 2`` (one rank per shell: --rank R --world W)."""

import sys

from galaxy.cli.finetune import main

if __name__ == "__main__":
    sys.exit(main(plan="none", fill="pp", description=__doc__))
