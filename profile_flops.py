"""FLOPs, parameters and communication of one step of a model on a plan: ``galaxy profile``."""

import sys

from galaxy.cli.profile import main

if __name__ == "__main__":
    sys.exit(main())
