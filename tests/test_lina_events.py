"""Lina's pieces that need no process group: interval arithmetic of the event log, the
scheduler's flag checks and gate, and the notification points in an MoE layer's backward."""

import time

import pytest
import torch

from equivalence import tiny_config
from megatron_moe.distributed import observer as events
from megatron_moe.distributed.collectives import LOCAL_GROUP
from megatron_moe.distributed.observer import CommEvent
from megatron_moe.distributed.lina import LinaScheduler
from megatron_moe.model.gpt2 import GPT2MoE
from megatron_moe.parallel_state import local_state


def ev(seq, op, launch, finish, tag="", nbytes=0):
    return CommEvent(seq, op, "dp", nbytes, tag, "bwd", launch, finish)


def test_interval_union_and_intersection():
    u = events.union([(5, 7), (0, 2), (1, 3), (6, 9)])
    assert u == [(0, 3), (5, 9)]
    assert events.total_length(u) == 7
    assert events.intersection_length(u, [(2, 6), (8, 10)]) == 1 + 1 + 1
    assert events.intersection_length(u, [(3, 5)]) == 0


def test_launched_during_and_overlapping():
    a2a = ev(0, "all_to_all", 10.0, 20.0)
    before = ev(1, "all_reduce", 5.0, 12.0, "lina", 100)  # started before, still running
    inside = ev(2, "all_reduce", 15.0, 16.0, "lina", 200)
    after = ev(3, "all_reduce", 20.5, 30.0, "lina", 300)
    ops = [before, inside, after]
    assert events.launched_during(ops, [a2a]) == [inside]
    assert events.overlapping(ops, a2a) == [before, inside]


def test_summary_counts_overlap_of_gradient_all_reduce_only():
    log = events.CommLog()
    log.events.extend(
        [
            ev(0, "all_to_all", 0.0, 0.010),
            ev(1, "all_reduce", 0.005, 0.030, "grad", 64),
            ev(2, "all_reduce", 0.0, 0.010, "", 8),
        ]
    )  # an untagged (ESP) all-reduce
    s = log.summary()
    assert s["n_a2a"] == 1 and s["n_grad_allreduce"] == 1 and s["grad_allreduce_bytes"] == 64
    assert s["a2a_bwd_ms"] == pytest.approx(10.0)
    assert s["grad_allreduce_ms"] == pytest.approx(25.0)
    assert s["overlap_ms"] == pytest.approx(5.0)
    assert s["launched_during_a2a"] == 1  # launched at 5 ms, inside the all-to-all


def test_flags_are_validated():
    with pytest.raises(ValueError, match="--lina-partition-mb"):
        LinaScheduler(0.0, 10.0)
    with pytest.raises(ValueError, match="--comm-timeout"):
        LinaScheduler(1.0, -1.0)


def test_gate_closes_for_imminent_and_in_flight_all_to_all():
    s = LinaScheduler(1.0, 10.0)
    try:
        assert s._gate_open()
        s.a2a_imminent()
        assert not s._gate_open()
        s.a2a_start("ep")  # the imminent one arrives
        assert not s._gate_open()
        s.a2a_end("ep")
        assert s._gate_open()
        # an all-to-all ended on the host but not yet complete on the device (CUDA: enqueued only)
        # keeps the gate closed until its completion is observed
        ev = CommEvent(seq=0, op="all_to_all", group="ep", nbytes=0, tag="", phase="bwd", launch=0.0)
        s.a2a_start("ep")
        s.a2a_end("ep", ev)
        assert not s._gate_open()
        events.stamp_finish(ev)  # what the completion of its Work / end event gives
        assert s._gate_open()
        s.a2a_imminent()
        s.moe_backward_done()  # no all-to-all came (group of one): the gate reopens
        assert s._gate_open()
        h = s.submit("dp", torch.ones(10), LOCAL_GROUP)  # nothing to reduce: done at once
        h.wait()
        s.drain()
    finally:
        s.close()
    assert not events.ACTIVE or s not in events._A2A_LISTENERS


def test_attach_skips_layers_without_all_to_all():
    cfg = tiny_config()
    model = GPT2MoE(cfg, local_state())  # one process: tokens never leave the rank
    s = LinaScheduler(1.0, 10.0)
    try:
        s.attach(model)
        assert s._hooks == []
    finally:
        s.close()


def test_launch_budget_is_what_drains_before_the_next_all_to_all_plus_the_bound():
    from megatron_moe.distributed.lina import launch_budget

    assert launch_budget(None, 1.0, 0.1) == 0.0  # nothing measured yet
    assert launch_budget(1e6, 0.5, 0.01) == pytest.approx(1e6 * 0.51)
    assert launch_budget(1e6, -0.2, 0.01) == pytest.approx(1e4)  # overdue: only the bound
    assert launch_budget(1e6, float("inf"), 0.01) == float("inf")  # no all-to-all coming


def test_next_all_to_all_offset_is_the_earliest_seen_and_none_past_the_last():
    from megatron_moe.distributed.lina import next_a2a_offset

    hist = [[0.10, 0.30], [0.08, 0.35, 0.50]]
    assert next_a2a_offset(hist, 0) == 0.08
    assert next_a2a_offset(hist, 1) == 0.30
    assert next_a2a_offset(hist, 2) == 0.50
    assert next_a2a_offset(hist, 3) is None
    assert next_a2a_offset([], 0) is None


def test_budget_admits_a_second_micro_op_only_when_it_drains_in_time():
    from megatron_moe.distributed.lina import MicroOp

    s = LinaScheduler(1.0, 10.0, max_in_flight=3, drain_ms=10.0)
    try:

        def op(nbytes):
            return MicroOp(0, "dp", torch.zeros(nbytes // 4), None, 0, 1, 0.0)

        s._inflight.append(op(4000))
        s._inflight_bytes = 4000
        assert not s._may_launch(op(4000))  # no rate measured: one micro-op at a time
        s.rate_bps = 1e6  # 1 MB/s: 10 ms drain bound = 10 kB
        assert s._may_launch(op(4000))  # first iteration: only the bound
        assert not s._may_launch(op(8000))
        s._history.append([0.5])  # the all-to-all came 0.5 s after the first submit
        s._anchor = time.perf_counter()
        assert s._may_launch(op(400_000))  # ~0.5 s away: ~510 kB may be in flight
        s._offsets.append(0.5)  # it came; no other one this iteration
        assert s._may_launch(op(4_000_000))
        s._inflight.extend([op(4), op(4)])  # max_in_flight reached
        assert not s._may_launch(op(4))
        s._inflight.clear()
        s._inflight_bytes = 0
        s.a2a_imminent()
        assert not s._may_launch(op(4))  # the gate beats any budget
    finally:
        s._inflight.clear()
        s.close()
