"""Profile a cluster and pick the best parallel plan for it (see galaxy/cli/plan.py)."""

import sys

from galaxy.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
