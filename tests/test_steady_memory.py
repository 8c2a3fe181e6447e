"""A training run holds steady memory: once warm, the tensors Python can reach do not grow from one
iteration to the next, with each system that keeps state between forward and backward switched on
(Pro-Prophet's replicas, Lina's micro-ops, Lancet's deferred dW and partitions, Parm's S1).

Each iteration's Pro-Prophet Trans buffers once leaked through a reference cycle (16 MB a step on
a replica rank of the paper-sized benchmark); `test_pro_prophet_placement` checks that layer alone.
"""

from megatron_moe.arguments import parse_args
from megatron_moe.testing import live_cpu_tensors, spawn
from megatron_moe.training import Trainer
from tiny_run import tiny_args

ITERS = 12
STEADY = 4  # the last iterations, whose live tensors must not grow
PLAN = {0: [1], 3: [0]}  # Pro-Prophet's fixed placement (every rank holds a replica)
TRANSIENT = 16 * 1024  # bytes that may come and go (a 4 KB tensor in flight was seen at some iterations)
FEATURES = {
    "pro_prophet": ["--moe-dropless", "--pro-prophet"],  # with PLAN
    "lina": ["--lina", "--measure-iters", "0"],
    "lancet": ["--lancet-wgrad", "--lancet-partition"],
    "s1": ["--moe-schedule", "s1"],
}


class CountingTrainer(Trainer):
    """The trainer, recording the live tensors after every training step."""

    def __init__(self, cfg, pro_prophet_plan=None):
        super().__init__(cfg, pro_prophet_plan)
        self.live: list[tuple[int, int]] = []

    def train_step(self, batches) -> dict:
        rec = super().train_step(batches)
        self.live.append(live_cpu_tensors())
        return rec


def _live_per_feature(rank, world, data):
    out = {}
    for name, extra in FEATURES.items():
        cfg = parse_args(tiny_args(data, ITERS, "--expert-model-parallel-size", "2", *extra))
        trainer = CountingTrainer(cfg, PLAN if name == "pro_prophet" else None)
        try:
            trainer.train()
        finally:
            trainer.stop.restore()
        out[name] = trainer.live
    return out


def test_live_tensors_stay_flat_once_warm(sample_data):
    per_rank = spawn(_live_per_feature, 2, sample_data, timeout=600)
    for rank, out in enumerate(per_rank):
        for name, live in out.items():
            assert len(live) == ITERS, (rank, name, live)
            steady = [b for _, b in live[-STEADY:]]
            assert max(steady) - min(steady) < TRANSIENT, (rank, name, live)
