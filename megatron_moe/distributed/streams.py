"""Streams and events: one API that orders work across lanes, on CUDA and on CPU.

On a GPU, work that should overlap runs on separate CUDA streams, ordered by `wait_stream` and
events; a tensor used on a stream other than its allocation's is `record_stream`-ed so the caching
allocator does not reuse its memory too early. On the CPU every op runs synchronously in program
order, so the same calls are no-ops: an event is complete when recorded.

  * the stream calls (`side_stream`, `current_stream`, `use`, `wait_stream`, `record_event`,
    `wait_event`, `record_stream`) take `None` for "no CUDA stream" (what `side_stream` /
    `current_stream` return on the CPU) and then do nothing, so one code path serves both devices;
  * a `Lane` is an ordered side lane: `submit(fn)` returns a `Pending` whose `wait()` orders the
    caller after `fn` and returns its result. CUDA: `fn` is enqueued on the lane's side stream after
    it waited for the caller's stream; CPU: it runs on the lane's one worker thread.

Rules for code that claims overlap:

  1. Anything enqueued on the caller's stream before a NCCL collective is launched delays it
     (NCCL's stream waits for the caller's stream at launch): work meant to overlap a collective
     is enqueued after the launch, or goes to a side stream.
  2. Work on a side stream starts with `wait_stream(side, current)` (or `wait_event` on a marker
     recorded where its inputs were produced); its results are used only after
     `wait_event(current, marker)` (`Pending.wait()` does both).
  3. Tensors produced on a side stream and used or freed on another get `record_stream(t, other)`;
     inputs read on a side stream are kept alive by the caller until `wait()`, or recorded too.
  4. Nothing on a lane decides from timing what every rank must agree on (grad-ready order,
     collective order): a lane moves *when* kernels run, never *which* or in what order.

Lina's scheduler and `PartitionedRange` take these calls as `stream_api` (this module by
default); `tests/test_streams_users.py` passes a recorder and checks where the calls are made.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

_SIDE: dict[tuple[int, str], "torch.cuda.Stream"] = {}


def _is_cuda(device: Union[torch.device, str, None]) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def side_stream(device: Union[torch.device, str, None], name: str) -> Optional["torch.cuda.Stream"]:
    """The side stream `name` of a CUDA device (one per (device, name), created on first use);
    None on any other device."""
    if device is None or not _is_cuda(device):
        return None
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    key = (index, name)
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=index)
    return _SIDE[key]


def current_stream(device: Union[torch.device, str, None]) -> Optional["torch.cuda.Stream"]:
    """The calling thread's current stream on a CUDA device; None on any other device."""
    if device is None or not _is_cuda(device):
        return None
    return torch.cuda.current_stream(torch.device(device))


def use(stream: Optional["torch.cuda.Stream"]):
    """Context manager: kernels issued inside go to `stream` (no-op for None)."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def wait_stream(waiter: Optional["torch.cuda.Stream"], producer: Optional["torch.cuda.Stream"]) -> None:
    """Work issued on `waiter` from now on starts after all work issued on `producer` so far."""
    if waiter is not None and producer is not None and waiter is not producer:
        waiter.wait_stream(producer)


@dataclass
class Marker:
    """A point in a lane's order: a CUDA event, a CPU future, or nothing (already complete)."""

    cuda: Optional["torch.cuda.Event"] = None
    future: Optional[Future] = None

    def query(self) -> bool:
        """True when everything before the marker has completed (never blocks)."""
        if self.cuda is not None:
            return bool(self.cuda.query())
        return self.future is None or self.future.done()

    def synchronize(self) -> None:
        """Block the host until everything before the marker has completed."""
        if self.cuda is not None:
            self.cuda.synchronize()
        elif self.future is not None:
            self.future.result()


def record_event(stream: Optional["torch.cuda.Stream"], timing: bool = False) -> Marker:
    """A marker after all work issued on `stream` so far (CPU: complete at once, since host ops
    run synchronously in program order). `timing=True`: the CUDA event can be timed."""
    if stream is None:
        return Marker()
    ev = torch.cuda.Event(enable_timing=timing)
    ev.record(stream)
    return Marker(cuda=ev)


def wait_event(stream: Optional["torch.cuda.Stream"], marker: Marker) -> None:
    """Work issued on `stream` from now on starts after `marker` (CUDA: no host block; a CPU
    future marker blocks the host, which is the CPU's only order)."""
    if marker.cuda is not None:
        if stream is not None:
            stream.wait_event(marker.cuda)
        else:
            marker.cuda.synchronize()
    elif marker.future is not None:
        marker.future.result()


def record_stream(tensors: Union[torch.Tensor, Iterable[Any], None], stream: Optional["torch.cuda.Stream"]) -> None:
    """Tell the caching allocator that CUDA tensors among `tensors` (nested lists / tuples allowed)
    are used on `stream`, so their memory is not reused before `stream`'s work on them is done."""
    if stream is None or tensors is None:
        return
    if isinstance(tensors, torch.Tensor):
        if tensors.is_cuda:
            tensors.record_stream(stream)
        return
    if isinstance(tensors, (list, tuple)):
        for t in tensors:
            record_stream(t, stream)


class Pending:
    """The result of `Lane.submit`: `wait()` orders the caller after the submitted work and
    returns its result; `marker` is the lane's point after it."""

    def __init__(self, marker: Marker, value: Any = None, device: Union[torch.device, str, None] = None):
        self.marker, self._value, self._device = marker, value, device
        self._waited = False

    def wait(self) -> Any:
        """CUDA: the caller's stream waits on the marker (the host does not block) and every
        tensor of the result is record_stream-ed on it; CPU: blocks until the work finished."""
        if self.marker.future is not None:
            return self.marker.future.result()
        if not self._waited:
            cur = current_stream(self._device)
            wait_event(cur, self.marker)
            record_stream(self._value, cur)
            self._waited = True
        return self._value


class Lane:
    """An ordered lane of work beside the caller's: a CUDA side stream, or one CPU worker thread.

    Work submitted to one lane runs in submission order. `submit(fn)` on CUDA makes the side
    stream wait for the caller's current stream, runs `fn` with the side stream current (it only
    enqueues kernels) and records a marker; on the CPU it hands `fn` to the worker thread.
    """

    def __init__(self, device: Union[torch.device, str, None], name: str):
        self.device, self.name = device, name
        self.stream = side_stream(device, name)
        self._pool: Optional[ThreadPoolExecutor] = None

    def submit(self, fn: Callable[[], Any]) -> Pending:
        """Run `fn` on the lane after everything the caller issued so far; see the class doc."""
        if self.stream is not None:
            wait_stream(self.stream, current_stream(self.device))
            with use(self.stream):
                value = fn()
            return Pending(record_event(self.stream), value, self.device)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        return Pending(Marker(future=self._pool.submit(fn)), None, self.device)

    def close(self) -> None:
        """Stop the CPU worker thread, if one was started (after the work it holds)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@contextmanager
def on_side(device: Union[torch.device, str, None], name: str) -> Iterator[Optional["torch.cuda.Stream"]]:
    """`with on_side(dev, "saa") as side:` work inside goes to the side stream `name`, which first
    waits for the caller's stream; yields the side stream (None on the CPU: a no-op block)."""
    side = side_stream(device, name)
    wait_stream(side, current_stream(device))
    with use(side):
        yield side
