"""Pretrain GPT-2 MoE: the repository's entry point, same as `mmoe-pretrain` (megatron_moe/cli/pretrain.py)."""

import sys

from megatron_moe.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
