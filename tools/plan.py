"""Choose the layout and the optimizations for a cluster: same as `mmoe-plan` (megatron_moe/cli/plan.py)."""

import os
import sys

from megatron_moe.cli.plan import main

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
