"""``python -m galaxy <command>``: the ``galaxy`` console script without installing it."""

import sys

from galaxy.cli.main import main

sys.exit(main())
