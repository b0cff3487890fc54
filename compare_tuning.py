"""Compare tuning methods (full, LoRA, adapters, side-tuning) on one model and plan: same data, same

The command lives in ``galaxy.cli.compare``; ``--help`` lists its flags."""

import sys

from galaxy.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
