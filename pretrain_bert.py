"""Serial BERT masked-LM pretraining on one rank: ``galaxy pretrain --plan none``, for masked LMs only, refusing
a config that names another plan."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(plan="none", strict=True, masked_only=True, description=__doc__))
