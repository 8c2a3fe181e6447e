"""Pretrain GPT-2 Mixture-of-Experts on WikiText.

  python pretrain_gpt_moe.py                      # tiny model on the bundled sample corpus, CPU
  torchrun --nproc-per-node 4 pretrain_gpt_moe.py --tensor-model-parallel-size 2 \\
      --expert-model-parallel-size 2 ...          # any layout; see README for every flag group
"""
import os
import sys

import torch.distributed as dist

from megatron_moe.arguments import parse_args
from megatron_moe.distributed.comm_errors import exit_on_comm_error
from megatron_moe.parallel_state import shutdown
from megatron_moe.training import pretrain


def main(argv=None) -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    cfg = parse_args(argv)
    try:
        # a collective stuck past --comm-timeout (or a lost peer): `error: ...` once, exit 1
        with exit_on_comm_error():
            pretrain(cfg)      # returns with Lina's thread joined and the logger closed
            shutdown()         # barrier, destroy every group, join the backends' threads
    finally:
        if dist.is_initialized():      # an error left the groups up
            shutdown(barrier=False)


if __name__ == "__main__":
    main(sys.argv[1:])
