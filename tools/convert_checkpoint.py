"""Convert checkpoints between layouts and formats: same as `mmoe-convert` (megatron_moe/cli/convert.py)."""

import os
import sys

from megatron_moe.cli.convert import main

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
