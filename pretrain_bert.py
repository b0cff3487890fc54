"""Serial BERT masked-LM pretraining (one rank)."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(masked_only=True, plan="none", strict=True, description="Serial BERT masked-LM pretraining (one rank)"))
