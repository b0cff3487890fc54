"""Profile a cluster, then search the plans for it and write the best as a config: ``galaxy plan``."""

import sys

from galaxy.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
