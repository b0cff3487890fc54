"""Full / LoRA / adapter / side tuning from one base on a held-out task: ``galaxy compare``."""

import sys

from galaxy.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
