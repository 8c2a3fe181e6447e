"""`UnevenDispatcher.plan_parts` (Lancet's partitions): the plans of several parts from one count
exchange equal the plans each part gets from its own exchange, and only one count message travels."""

import torch

from megatron_moe.distributed.observer import CommLog
from megatron_moe.moe.dispatcher import UnevenDispatcher
from megatron_moe.moe.router import route
from megatron_moe.parallel_state import initialize_model_parallel
from megatron_moe.testing import spawn

E, PARTS = 4, (5, 9, 3)  # experts; tokens of each part (uneven, as a batch split can leave them)


def _plans(rank: int, world: int) -> dict:
    ps = initialize_model_parallel(1, world, 1, "gloo", device=torch.device("cpu"))
    g = torch.Generator().manual_seed(10 + rank)
    routes = [route(torch.randn(s, E, generator=g), 2, 1.0, 1) for s in PARTS]  # capacity 1.0: some dropped
    d = UnevenDispatcher(ps, E, 0)
    one_by_one = [d.plan([r]) for r in routes]
    with CommLog() as log:
        together = d.plan_parts([[r] for r in routes])
    counts_msgs = [e for e in log.snapshot() if e.op == "all_to_all"]
    fields = ("token", "weight", "dump", "recv_row", "recv_order")
    return {
        "same_tensors": all(
            torch.equal(getattr(a, f), getattr(b, f)) for a, b in zip(one_by_one, together) for f in fields
        ),
        "same_sizes": [(a.expert_rows, a.tokens, a.out.send_splits, a.out.recv_splits) for a in one_by_one]
        == [(b.expert_rows, b.tokens, b.out.send_splits, b.out.recv_splits) for b in together],
        "dropped": sum(r.num_dropped for r in routes),
        "count_messages": len(counts_msgs),
    }


def test_parts_planned_together_equal_parts_planned_alone_with_one_count_message():
    for r in spawn(_plans, 2):
        assert r["same_tensors"] and r["same_sizes"], r
        assert r["dropped"] > 0  # the capacity matters: slots differ from plain token order
        assert r["count_messages"] == 1, r
