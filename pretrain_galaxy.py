"""Language-model pretraining on any Galaxy plan (default: ATT TP, CON SP, MLP TP): masked LMs (BERT) and causal
LMs (LLaMA, Qwen2), with dp and pp from the config."""

import sys

from galaxy.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(plan="galaxy", strict=False,
                  description="Masked- and causal-LM pretraining on any Galaxy plan (default: ATT TP, CON SP, MLP TP), "
                              "with dp and pp"))
