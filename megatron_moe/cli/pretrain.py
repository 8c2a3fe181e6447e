"""Pretrain GPT-2 Mixture-of-Experts on WikiText.

Installed as `mmoe-pretrain`; `python pretrain_gpt_moe.py` in the repository runs the same.

  python pretrain_gpt_moe.py                      # tiny model on the bundled sample corpus, CPU
  torchrun --nproc-per-node 4 pretrain_gpt_moe.py --tensor-model-parallel-size 2 \\
      --expert-model-parallel-size 2 ...          # any layout; see README for every flag group
"""
import os
import sys

import torch.distributed as dist

from megatron_moe.arguments import parse_args
from megatron_moe.training import pretrain


def main(argv=None) -> None:
    os.environ.setdefault("WANDB_MODE", "offline")
    cfg = parse_args(argv)
    try:
        pretrain(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
