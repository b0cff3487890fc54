"""Galaxy's tests, one folder per package of ``galaxy`` (``tests/core`` for ``galaxy/core``, ...)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: scripts, configs, bench/
