"""Lina's gate, seen from the event log: once an all-to-all is announced (`a2a_imminent`, what the
backward of an MoE layer's output calls), no gradient micro-op is launched until that all-to-all
has completed; then every queued micro-op runs. With the gate open and nothing in flight, `submit`
launches the micro-op itself (from the grad-ready hook), before it returns: no thread hand-off."""

import time

import torch
import torch.distributed as dist

from megatron_moe.distributed.collectives import all_to_all_raw
from megatron_moe.distributed.observer import CommLog
from megatron_moe.distributed.lina import LinaScheduler
from megatron_moe.testing import spawn

PARTS = 4


def _announce_then_all_to_all(rank, world):
    grad_group = dist.new_group(list(range(world)))  # micro-ops on their own group
    grad = torch.full((PARTS * 256,), float(rank + 1))
    log = CommLog().start()
    sched = LinaScheduler(partition_mb=256 * 4 / 2**20, timeout_s=60.0, log_events=log)
    try:
        announced = time.perf_counter()
        sched.a2a_imminent()  # the all-to-all is imminent
        sched.submit("dense", grad, grad_group)
        # give a launcher whose gate ignored the announcement the chance to launch (the correct
        # scheduler launches nothing here, however long this takes)
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline and not log.of("all_reduce", tags=("lina",)):
            time.sleep(0.01)
        out = all_to_all_raw(torch.arange(4.0) + 10 * rank, None)
        sched.drain()
        a2a = log.of("all_to_all")
        lina = log.of("all_reduce", tags=("lina",))
        one = torch.full((256,), float(rank + 1))
        sched.submit("dense", one, grad_group)  # gate open, nothing in flight: launched by submit itself
        launched_by_submit = len(log.of("all_reduce", tags=("lina",))) - len(lina)
        sched.drain()
        return (
            announced,
            [(e.launch, e.finish) for e in a2a],
            [e.launch for e in lina],
            grad,
            out,
            launched_by_submit,
            one,
        )
    finally:
        sched.close()
        log.stop()


def test_no_micro_op_launches_between_the_announcement_and_the_all_to_all_end():
    for rank, (announced, a2a, launches, grad, out, direct, one) in enumerate(spawn(_announce_then_all_to_all, 2)):
        assert len(a2a) == 1 and a2a[0][1] is not None
        a2a_launch, a2a_finish = a2a[0]
        assert announced < a2a_launch
        assert len(launches) == PARTS  # every micro-op ran in the end
        early = [t for t in launches if announced <= t <= a2a_finish]
        assert not early, f"rank {rank}: {len(early)} micro-ops launched while the all-to-all was imminent"
        assert torch.equal(grad, torch.full_like(grad, 3.0))  # summed over both ranks
        assert out.tolist() == [2 * rank, 2 * rank + 1, 10 + 2 * rank, 11 + 2 * rank]
        assert direct == 1, f"rank {rank}: submit with the gate open launched {direct} micro-ops before returning"
        assert torch.equal(one, torch.full_like(one, 3.0))
