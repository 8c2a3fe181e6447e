"""Streams and events: one API that orders work across lanes, on CUDA and on CPU.

On a GPU, work that should overlap runs on separate CUDA streams; the points
where one stream's result is used by another are `wait_stream` / events, and a
tensor allocated on one stream and used on another is `record_stream`-ed so the
caching allocator does not hand its memory out again while the other stream
still reads it. On the CPU every tensor op runs synchronously on the issuing
thread, in program order, so the same calls are no-ops there: an event is
complete as soon as it is recorded and waiting on it never reorders anything.

Two levels:

  * the stream calls (`side_stream`, `current_stream`, `use`, `wait_stream`,
    `record_event`, `wait_event`, `record_stream`) take `None` for "no CUDA
    stream" (what `side_stream` / `current_stream` return on the CPU) and then
    do nothing, so one code path serves both devices;
  * a `Lane` is an ordered side lane of work: `submit(fn)` returns a `Pending`
    whose `wait()` orders the caller after `fn` and returns its result. On CUDA
    `fn` is enqueued on the lane's side stream by the calling thread (after the
    side stream waited for the caller's stream, so `fn` sees its inputs); on the
    CPU it runs on the lane's one worker thread (gloo calls and large GEMMs
    release the GIL), which is the ordering-preserving CPU equivalent: `wait()`
    returns only once `fn` has finished.

Rules for code that claims overlap (the library's users of this module):

  1. Anything enqueued on the caller's stream *before* a NCCL collective is
     launched delays that collective (NCCL's stream waits for the caller's
     stream at launch). Work meant to overlap a collective either is enqueued
     after the launch, or goes to a side stream (`Lane`).
  2. Work on a side stream starts with `wait_stream(side, current)` (it reads
     tensors the caller produced); its results are used only after
     `wait_event(current, marker)` (`Pending.wait()` does both).
  3. Tensors produced on a side stream and used (or freed) on another get
     `record_stream(t, other)`; inputs read on a side stream are either kept
     alive by the caller until `wait()` returned, or `record_stream`-ed too.
  4. Whatever runs on a lane must not decide anything every rank must agree
     on from timing (grad-ready order, collective order): the lane only moves
     *when* kernels run, never *which* or in what order they are issued.

Who uses it and how:
  * SAA (`saa.py`): each chunk's local combine and its MP all-gather run on the
    "saa" side stream, which waits on the chunk's all-to-all (its `work.wait()`
    issued under `use(side)`), so the compute stream is never blocked by it;
    the caller's stream waits on the side stream once, before the results are
    assembled.
  * Lancet's deferred dW (`lancet/wgrad_runtime.py`): the dW GEMMs of a window
    that opens before its all-to-all is launched (S2's synchronous
    all-to-alls) run on the "lancet-dw" lane, never on the caller's stream
    ahead of the all-to-all (rule 1); windows opened after the launch (the
    dispatcher's async handles) enqueue dW on the caller's stream, which is
    after the launch by construction.
  * Lina (`lina.py`, `grad_sync.py`): the launcher issues every micro-op of a
    group on ONE dedicated communicator (`grad_sync.make_lina_groups`: a second
    process group over the same ranks, `ps.new_groups("lina_dp",
    ps.layout.dp_groups)` and likewise "lina_expert_dp", created by every rank
    in the same order when GradSync gets the scheduler) from one thread, in the
    submission order, which is identical on every rank; no other collective
    uses that communicator. Its gate reads completion, not enqueue: on CUDA an
    all-to-all is "over" when the end event the observer records for it
    (`observer.completed(event)`) has completed. Each communicator has its side
    stream ("lina-dp", "lina-expert_dp"): a micro-op records a marker on the
    submitter's current stream when it is queued (its gradient, or the
    coalesced copy, was produced there; the launcher thread's own current
    stream is not that stream, so `wait_stream` would be wrong there), the
    launcher makes the side stream `wait_event` that marker, issues the
    all-reduce under `use(side)` and `record_stream`s the chunk on it; the
    reaper waits for the work under `use(side)`, copies a coalesced buffer back
    there and records the micro-op's done marker; `drain()` (before GradSync
    scales the gradients and the optimizer steps) makes the consumer's stream
    `wait_event` the last done marker of each side stream.
  * Lancet's partitioned pipeline (`lancet/partitioned_moe.py`): each part's
    dispatch all-to-all is launched right after that part's own pre-ops, before
    the next part's are enqueued (rule 1); the experts of every part and the
    launches of their return all-to-alls run on the "lancet-parts" side stream,
    which first waits for the caller's stream; each part's expert input waits
    there for its own dispatch (`dispatch_finish` under `use(side)`), and a
    return launched with the side stream current waits for its part's experts
    only. The received rows (allocated on the caller's stream) are
    `record_stream`-ed on the side stream, the returned rows (allocated on the
    side stream) on the caller's; the caller's stream waits for each return
    where it combines that part, and for the side stream once after the post-ops.
  * Pro-Prophet's Trans / Agg: Trans (parameter prefetch) and Agg (gradient
    aggregation) run on a `Lane("pro-prophet-trans")` / `Lane(".. -agg")` and
    are waited (`Pending.wait()`) at the first use of the prefetched
    parameters / before the optimizer step.

Both Lina's scheduler and `PartitionedRange` take the stream calls as an argument
(`stream_api`, this module by default): `tests/test_streams_users.py` passes a recorder with
the same functions and checks, on the CPU, where the calls are made.
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

    Work submitted to one lane runs in submission order. `submit(fn)` on CUDA
    makes the side stream wait for the caller's current stream, runs `fn` with
    the side stream current (it only enqueues kernels) and records a marker;
    on the CPU it hands `fn` to the worker thread (`cpu_thread=False`: runs
    `fn` at once on the calling thread, the synchronous order).
    """

    def __init__(self, device: Union[torch.device, str, None], name: str, cpu_thread: bool = True):
        self.device, self.name = device, name
        self.stream = side_stream(device, name)
        self._cpu_thread = cpu_thread and self.stream is None
        self._pool: Optional[ThreadPoolExecutor] = None

    def submit(self, fn: Callable[[], Any]) -> Pending:
        """Run `fn` on the lane after everything the caller issued so far; see the class doc."""
        if self.stream is not None:
            wait_stream(self.stream, current_stream(self.device))
            with use(self.stream):
                value = fn()
            return Pending(record_event(self.stream), value, self.device)
        if not self._cpu_thread:
            return Pending(Marker(), fn(), self.device)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.name)
        return Pending(Marker(future=self._pool.submit(fn)), None, self.device)

    def after(self, marker: Marker) -> None:
        """Work submitted to the lane from now on starts after `marker` (another lane's point)."""
        if self.stream is not None:
            wait_event(self.stream, marker)
        elif marker.future is not None and self._cpu_thread:
            self.submit(marker.future.result)  # the worker blocks on it, in the lane's order
        else:
            wait_event(None, marker)

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
