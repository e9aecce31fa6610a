"""`python -m moe_lc.train [recipe=NAME] [key=value ...]` (also what torchrun launches)."""

import sys

from moe_lc.train.main import run_train_cli

if __name__ == "__main__":
    sys.exit(run_train_cli())
