"""Single-request latency and greedy generation on any plan: ``galaxy infer``."""

import sys

from galaxy.cli.infer import main

if __name__ == "__main__":
    sys.exit(main())
