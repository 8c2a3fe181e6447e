"""Tokenize WikiText or jsonl into indexed datasets: same as `mmoe-preprocess` (megatron_moe/cli/preprocess.py)."""

import sys

from megatron_moe.cli.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
