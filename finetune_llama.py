"""LLaMA instruction fine-tuning (Alpaca JSON/JSONL) on any plan (default galaxy), full or PEFT, with dp and pp
from the config: ``galaxy finetune``; --prompt TEXT prints the trained model's greedy answer."""

import sys

from galaxy.cli.finetune import main

if __name__ == "__main__":
    sys.exit(main())
