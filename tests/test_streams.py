"""The stream abstraction on the CPU: the order it enforces (an operation waited on is complete
before its consumer runs), and the CUDA-only calls are no-ops on the CPU."""

import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist

from megatron_moe.distributed import streams
from megatron_moe.distributed.collectives import all_gather_raw, all_to_all_raw
from megatron_moe.distributed.observer import (
    CommEvent,
    CommLog,
    CudaTiming,
    completed,
    launched_during,
    resolve,
    resolve_times,
    stamp_finish,
)
from megatron_moe.testing import spawn


def test_cpu_stream_calls_are_no_ops_and_markers_are_complete():
    cpu = torch.device("cpu")
    assert streams.side_stream(cpu, "x") is None and streams.current_stream(cpu) is None
    marker = streams.record_event(None)
    assert marker.query()
    t = torch.ones(3, device=cpu)
    with streams.use(None):
        streams.wait_stream(None, None)
        streams.wait_event(None, marker)
        streams.record_stream([t, (t, 1.0)], None)
    with streams.on_side(cpu, "x") as side:
        assert side is None
    assert torch.equal(t, torch.ones(3, device=cpu))


def _slow_fill(out: torch.Tensor, gate: threading.Event, order: list) -> torch.Tensor:
    """Fill `out` element by element, once the gate opens (the consumer would see zeros if it ran early)."""
    gate.wait()
    for i in range(out.numel()):
        out[i] = (
            torch.mm(
                torch.full((32, 32), 1.0 / 32, device=out.device), torch.full((32, 32), float(i + 1), device=out.device)
            ).sum()
            / 32
        )
    order.append("produced")
    return out


def test_lane_consumer_sees_the_complete_result_after_wait():
    cpu = torch.device("cpu")
    lane = streams.Lane(cpu, "test-lane")
    try:
        order: list = []
        gate = threading.Event()
        out = torch.zeros(64, device=cpu)
        pending = lane.submit(lambda: _slow_fill(out, gate, order))
        order.append("submitted")  # the lane's work has not started: the gate is shut
        gate.set()
        result = pending.wait()
        order.append("consumed")
        assert order == ["submitted", "produced", "consumed"]
        assert result is out and torch.equal(out, torch.arange(1, 65, device=cpu, dtype=out.dtype) * 32)
        assert pending.marker.query()
    finally:
        lane.close()


def _collective_on_lane(rank, world):
    """An all-to-all run on a lane, then a consumer's all-gather of its output after `wait()`:
    the observer sees the all-to-all finished before the all-gather is launched."""
    cpu = torch.device("cpu")
    lane = streams.Lane(cpu, "comm")
    try:
        send = torch.arange(4, device=cpu, dtype=torch.float32) + 10 * rank
        with CommLog() as log:
            pending = lane.submit(lambda: all_to_all_raw(send, dist.group.WORLD))
            recv = pending.wait()
            gathered = all_gather_raw(recv, dist.group.WORLD)
        evs = {e.op: e for e in log.snapshot()}
        a2a, ag = evs["all_to_all"], evs["all_gather"]
        return recv.tolist(), gathered.tolist(), a2a.finish is not None and a2a.finish <= ag.launch
    finally:
        lane.close()


def test_collective_waited_on_a_lane_finishes_before_its_consumer_launches():
    res = spawn(_collective_on_lane, 2, timeout=120)
    assert res[0][0] == [0.0, 1.0, 10.0, 11.0] and res[1][0] == [2.0, 3.0, 12.0, 13.0]
    assert res[0][1] == res[1][1] == [0.0, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0]
    assert all(r[2] for r in res)


# ---------------------------------------------------------------- the observer: completion, not enqueue
def _timing(end_done: bool) -> CudaTiming:
    done, end = Future(), Future()
    done.set_result(None)
    if end_done:
        end.set_result(None)
    return CudaTiming(streams.Marker(future=done), streams.Marker(future=end))


def test_cuda_timed_events_take_launch_and_finish_from_their_markers_once_complete():
    """The CUDA path's arithmetic with CPU markers: an event is finished only when its end marker has
    completed, at anchor + elapsed; until then it stays in flight (and a host stamp does not finish it)."""
    t_done, t_run = _timing(True), _timing(False)
    ev_done = CommEvent(0, "all_to_all", "ep", 8, "", "bwd", 100.0, info={"cuda": t_done})
    ev_run = CommEvent(1, "all_to_all", "ep", 8, "", "bwd", 100.5, info={"cuda": t_run})
    ev_cpu = CommEvent(2, "all_reduce", "dp", 4, "grad", "bwd", 3.0, finish=4.0)
    ms = {id(t_done.start): 2.0, id(t_done.end): 5.0, id(t_run.start): 6.0, id(t_run.end): 9.0}
    stamp_finish(ev_run)  # the host-side end: enqueue, not completion
    assert ev_run.finish is None and "host_end" in ev_run.info
    assert resolve_times([ev_done, ev_run, ev_cpu], 50.0, lambda m: ms[id(m)]) == 1
    assert (ev_done.launch, ev_done.finish, ev_done.info["enqueued"]) == (50.0 + 2e-3, 50.0 + 5e-3, 100.0)
    assert ev_run.finish is None and ev_run.launch == 100.5 and (ev_cpu.launch, ev_cpu.finish) == (3.0, 4.0)
    assert [completed(e) for e in (ev_done, ev_run, ev_cpu, None)] == [True, False, True, False]
    grad = CommEvent(3, "all_reduce", "dp", 4, "lina", "bwd", 1e6, finish=1e6 + 1)
    assert launched_during([grad], [ev_done, ev_run]) == [grad]  # ev_run is still in flight
    t_run.end.future.set_result(None)
    assert resolve_times([ev_done, ev_run], 50.0, lambda m: ms[id(m)]) == 1  # ev_done is not redone
    assert (ev_run.launch, ev_run.finish) == (50.0 + 6e-3, 50.0 + 9e-3)
    assert launched_during([grad], [ev_done, ev_run]) == []


def test_cpu_collectives_are_not_cuda_timed():
    assert resolve([CommEvent(0, "all_reduce", "dp", 4, "", "fwd", 1.0)]) == 0 or torch.cuda.is_available()
    log = CommLog()
    assert log.finish_step() == []
