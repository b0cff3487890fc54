"""Single-request (batch 1) forward and generation latency of BERT or LLaMA on any plan (see galaxy/cli/infer.py)."""

import sys

from galaxy.cli.infer import main

if __name__ == "__main__":
    sys.exit(main())
