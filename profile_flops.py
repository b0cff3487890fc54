"""Profile one step of a Galaxy BERT or LLaMA: FLOPs (forward and backward measured), parameters,

The command lives in ``galaxy.cli.profile``; ``--help`` lists its flags."""

import sys

from galaxy.cli.profile import main

if __name__ == "__main__":
    sys.exit(main())
