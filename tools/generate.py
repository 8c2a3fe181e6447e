"""Sample text from a checkpoint: same as `mmoe-generate` (megatron_moe/cli/generate.py)."""

import os
import sys

from megatron_moe.cli.generate import main

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
