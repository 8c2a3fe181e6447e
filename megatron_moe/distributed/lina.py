"""Lina: gradient all-reduce in fixed-size micro-ops that never start during an all-to-all.

Lina (Li et al., USENIX ATC 2023): backward all-to-alls slow down when they share the network with
the data-parallel all-reduce, so the all-reduce is split into small micro-ops and an all-to-all
always goes first.

  * `submit(kind, flat, group)` splits a gradient into `partition_mb` MB chunks onto a FIFO queue;
    with `coalesce` micro-ops are equal slices of a group's concatenated gradients (as in the paper);
  * the queue head is launched (async all-reduce) when the gate is open and the launch budget
    allows, by `submit` or a launcher thread (no CPU polling except while awaiting a CUDA
    all-to-all's end event); a reaper thread waits for micro-ops in launch order;
  * the gate is closed while an all-to-all of this rank is in flight (`a2a_start` / `a2a_end`; on
    CUDA until its end event completed) or imminent (`a2a_imminent()`). Gate check and launch
    share the lock `a2a_start` takes, so no micro-op launches between an all-to-all's start and end;
  * launch budget: bytes in flight must drain, at the measured link rate (EWMA), within the time to
    the next all-to-all (predicted from earlier iterations) plus `drain_ms` (0: a tenth of the
    backward all-to-all time); after the last one, `max_in_flight` micro-ops. One micro-op may
    always be in flight while the gate is open; before anything is measured, only one;
  * the queue is never reordered, so every rank issues micro-ops in the same order (gloo and NCCL
    need it);
  * `drain()` opens the gate and waits for every micro-op; one not done within `timeout_s`
    (--comm-timeout) raises `CommTimeoutError`.

Streams (no-ops on the CPU): each communicator has its side stream ("lina-dp", "lina-expert_dp"),
which waits for the submitter's marker before the all-reduce; the reaper blocks until the `done`
marker completed, so in-flight counts and the link rate are completion times. `drain()` ends with
the consumer's stream waiting for every side stream.

Launches and finishes go into the collective observer; `summary()` returns the backward all-to-all
time and the all-reduce time overlapping an all-to-all. Values equal a bucketed all-reduce's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch

from megatron_moe.distributed import observer, streams
from megatron_moe.distributed.collectives import all_reduce_raw, group_size
from megatron_moe.distributed.comm_errors import CommPeerLostError, CommTimeoutError, describe_group, translate
from megatron_moe.distributed.observer import group_name
from megatron_moe.profiling import annotate

log = logging.getLogger("megatron_moe.lina")
MB = 2**20
HISTORY = 3  # iterations whose all-to-all offsets predict the next one's
RATE_ALPHA = 0.3  # decay of the link-rate and all-to-all-time averages per new sample
AUTO_DRAIN_FRACTION = 0.1  # drain_ms = 0: this fraction of the measured backward all-to-all time
DEVICE_POLL_S = 2e-4  # how often the launcher polls a CUDA all-to-all's end event while it gates


def launch_budget(rate_bps: Optional[float], horizon_s: float, drain_s: float) -> float:
    """Bytes that may be in flight: what drains at `rate_bps` (bytes/s) within `horizon_s` (time to
    the next all-to-all, inf: none coming) plus `drain_s`; 0 before the rate is measured."""
    if rate_bps is None or rate_bps <= 0:
        return 0.0
    if math.isinf(horizon_s):
        return math.inf
    return rate_bps * (max(0.0, horizon_s) + max(0.0, drain_s))


def next_a2a_offset(history: list[list[float]], seen: int) -> Optional[float]:
    """Predicted offset (s after the first submit) of all-to-all number `seen`: the earliest in
    `history`; None when no earlier iteration had that many."""
    offs = [h[seen] for h in history if len(h) > seen]
    return min(offs) if offs else None


@dataclass
class MicroOp:
    """`chunk` all-reduced over `group`: one slice of one gradient tensor (a view, reduced in
    place), or with coalescing several consecutive slices copied into one buffer (`pieces`:
    (view, handle) of each, copied back when the op finished)."""

    index: int  # position in this iteration's queue (= launch order)
    kind: str  # 'dp' or 'expert_dp'
    chunk: torch.Tensor  # a contiguous 1-D view into the gradient, or the coalesced buffer
    group: object
    part: int  # chunk number of its first piece within that piece's tensor
    parts: int  # chunks of that tensor
    queued: float  # perf_counter when submitted
    pieces: list = field(default_factory=list)
    work: object = None
    event: Optional[observer.CommEvent] = None
    launched: float = 0.0
    # CUDA: submitter's stream marker when queued, side stream marker when reduced; CPU: complete
    ready: streams.Marker = field(default_factory=streams.Marker)
    done: streams.Marker = field(default_factory=streams.Marker)

    @property
    def nbytes(self) -> int:
        return self.chunk.numel() * self.chunk.element_size()


@dataclass
class GradHandle:
    """Completion of every micro-op of one submitted tensor; `wait()` returns once they are done."""

    scheduler: "LinaScheduler"
    remaining: int
    done_event: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> None:
        while not self.done_event.wait(0.5):
            self.scheduler._raise_if_failed()
        self.scheduler._raise_if_failed()


class LinaScheduler:
    """Lina's gradient all-reduce scheduler. `partition_mb`: micro-op size in MB (2**20 bytes).
    `timeout_s`: per micro-op before `drain()` raises CommTimeoutError. `max_in_flight`: launched and
    unfinished micro-ops at most (1: the original Lina). `drain_ms`: the budget's drain bound (0:
    auto). `coalesce`: slice a group's concatenated gradients; False: one tensor per micro-op.
    `prioritize=False` ignores all-to-alls (ablation). A CommLog runs until `close()`.
    """

    def __init__(
        self,
        partition_mb: float = 30.0,
        timeout_s: float = 600.0,
        *,
        prioritize: bool = True,
        log_events: Optional[observer.CommLog] = None,
        max_in_flight: int = 4,
        drain_ms: float = 0.0,
        coalesce: bool = False,
        stream_api: Any = streams,
    ):
        if not partition_mb > 0:
            raise ValueError(f"--lina-partition-mb must be positive, got {partition_mb}")
        if not timeout_s > 0:
            raise ValueError(f"--comm-timeout must be positive, got {timeout_s}")
        if int(max_in_flight) < 1:
            raise ValueError(f"LinaScheduler: max_in_flight must be at least 1, got {max_in_flight}")
        if not drain_ms >= 0:
            raise ValueError(f"LinaScheduler: drain_ms must be >= 0 (0: auto), got {drain_ms}")
        self.partition_mb, self.timeout_s, self.prioritize = float(partition_mb), float(timeout_s), prioritize
        self.max_in_flight, self.drain_ms, self.coalesce = int(max_in_flight), float(drain_ms), coalesce
        self.partition_bytes = max(1, int(partition_mb * MB))
        # the stream calls (the `streams` module; a test passes a recorder with the same functions)
        self.sx = stream_api
        self._last_done: dict[str, tuple[torch.device, streams.Marker]] = {}  # kind -> its side's last point
        # one lock, three conditions: _cv drain(), _launch_cv the launcher, _reap_cv the reaper
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._launch_cv = threading.Condition(self._lock)
        self._reap_cv = threading.Condition(self._lock)
        self._queue: deque[MicroOp] = deque()
        self._open_kind: tuple = ("", None)
        self._open: list = []  # coalescing: (view, handle, part, parts) of the micro-op being filled
        self._inflight: deque[MicroOp] = deque()
        self._inflight_bytes = 0
        self._a2a_in_flight = 0
        self._imminent = False
        # all-to-alls ended on the host whose completion the device has not reported yet (CUDA:
        # the host-side end is only the enqueue; `observer.completed` reads their end events)
        self._device_pending: list[observer.CommEvent] = []
        self._draining = False
        self._pending = 0  # micro-ops submitted and not finished
        self._count = 0  # micro-ops submitted this iteration
        self._error: Optional[BaseException] = None
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._hooks: list = []
        # the measured link and this rank's schedule (module docstring: the launch budget)
        self.rate_bps: Optional[float] = None
        self._last_finish = 0.0
        self._rate_bytes = self._rate_time = 0.0
        self._a2a_busy_since: Optional[float] = None
        self.a2a_ms: Optional[float] = None  # EWMA of backward all-to-all busy periods
        self._anchor: Optional[float] = None  # first submit of this iteration
        self._offsets: list[float] = []  # all-to-all starts after the anchor, this iteration
        self._history: deque[list[float]] = deque(maxlen=HISTORY)
        self.max_concurrent = 0  # most micro-ops in flight at once (reporting)
        self.log = (log_events or observer.CommLog(max_events=20_000)).start()
        self._totals: dict = {}
        self._folded_seq = -1  # events up to this seq are in _totals
        self.iterations = 0
        observer.add_a2a_listener(self)

    # ------------------------------------------------------------------ model hooks
    def attach(self, model: torch.nn.Module) -> None:
        """Listen to every token-exchanging MoE dispatcher of `model` (`a2a_imminent`,
        `moe_backward_done`)."""
        for layer in model.moe_layers():
            # a layer whose token exchange stays inside one rank has no all-to-all to wait for
            if layer.dispatcher.crosses_ranks:
                self._hooks.append(layer.dispatcher.add_listener(self))

    # ------------------------------------------------------------------ all-to-all notifications
    def a2a_imminent(self) -> None:
        """An all-to-all is about to be issued: launch no new micro-op until it has run."""
        with self._cv:
            self._imminent = True

    def moe_backward_done(self) -> None:
        """An MoE layer's backward finished: an imminent flag it left (no all-to-all came) is void."""
        with self._cv:
            self._imminent = False
            self._wake_launcher()

    def a2a_start(self, group: str) -> None:
        """Listener hook (collectives): an all-to-all starts now. Holds the lock every launch
        happens under, so a launch is either before this or after the matching a2a_end."""
        with self._cv:
            now = time.perf_counter()
            if self._a2a_in_flight == 0:
                self._a2a_busy_since = now
            self._a2a_in_flight += 1
            self._imminent = False
            if self._anchor is not None:
                self._offsets.append(now - self._anchor)

    def a2a_end(self, group: str, event: Optional[observer.CommEvent] = None) -> None:
        """Listener hook (collectives): the all-to-all finished on the host; micro-ops may go again
        once `event` has completed (`observer.completed`: on CUDA its end event, which the
        launcher polls; on CPU it has, when this is called)."""
        with self._cv:
            if event is not None and not observer.completed(event):
                self._device_pending.append(event)
            self._a2a_in_flight = max(0, self._a2a_in_flight - 1)
            if self._a2a_in_flight == 0 and self._a2a_busy_since is not None and self._anchor is not None:
                ms = 1e3 * (time.perf_counter() - self._a2a_busy_since)
                self.a2a_ms = ms if self.a2a_ms is None else (1 - RATE_ALPHA) * self.a2a_ms + RATE_ALPHA * ms
            # not launched here: this may run on a communication library's callback thread
            self._wake_launcher()

    def _gate_open(self) -> bool:
        if self._device_pending:  # drop the all-to-alls the device has completed
            self._device_pending = [e for e in self._device_pending if not observer.completed(e)]
        return (
            self._draining
            or not self.prioritize
            or (self._a2a_in_flight == 0 and not self._imminent and not self._device_pending)
        )

    def drain_s(self) -> float:
        """The drain bound in seconds: `drain_ms`, or a tenth of the measured all-to-all time."""
        if self.drain_ms > 0:
            return self.drain_ms / 1e3
        return 0.0 if self.a2a_ms is None else AUTO_DRAIN_FRACTION * self.a2a_ms / 1e3

    def horizon_s(self, now: float) -> float:
        """Seconds until this rank's next all-to-all, from its own schedule (inf: none coming;
        0: unknown or overdue)."""
        if self._anchor is None or not self._history:
            return 0.0
        off = next_a2a_offset(list(self._history), len(self._offsets))
        return math.inf if off is None else max(0.0, self._anchor + off - now)

    def _may_launch(self, op: MicroOp) -> bool:
        """Gate open and the head fits the budget (called under the lock)."""
        if not self._gate_open():
            return False
        if not self._inflight:
            return True  # one micro-op may always be on the wire
        if len(self._inflight) >= self.max_in_flight:
            return False
        if self._draining or not self.prioritize:
            return True  # no all-to-all is coming / the ablation
        budget = launch_budget(self.rate_bps, self.horizon_s(time.perf_counter()), self.drain_s())
        return self._inflight_bytes + op.nbytes <= budget

    # ------------------------------------------------------------------ queue
    def submit(self, kind: str, flat: torch.Tensor, group) -> GradHandle:
        """Queue `flat` (contiguous 1-D, reduced in place) as `partition_mb` MB micro-ops over
        `group`; the handle completes with its last chunk. With `coalesce`, a run's last slice is
        queued when another group's gradient comes, or at `drain()`."""
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("LinaScheduler.submit needs a contiguous 1-D tensor")
        self._raise_if_failed()
        per = max(1, self.partition_bytes // flat.element_size())
        n = flat.numel()
        parts = -(-n // per) if group_size(group) > 1 else 0
        handle = GradHandle(self, 0)
        if parts == 0:  # nothing to reduce (group of one, empty tensor)
            handle.done_event.set()
            return handle
        now = time.perf_counter()
        with self._cv:
            if self._anchor is None:
                self._anchor, self._offsets = now, []
            if self._open and (self._open[0][0].dtype != flat.dtype or self._open_kind != (kind, group)):
                self._close_open(now)
            self._open_kind = (kind, group)
            off, j = 0, 0
            while off < n:
                room = per - sum(v.numel() for v, *_ in self._open)
                take = min(room, n - off)
                self._open.append((flat[off : off + take], handle, j, parts))
                handle.remaining += 1
                off, j = off + take, j + 1
                if take == room:
                    self._close_open(now)
            if not self.coalesce:
                self._close_open(now)
            if not self._threads:
                self._threads = [
                    threading.Thread(target=self._run, name="lina-launcher", daemon=True),
                    threading.Thread(target=self._reap, name="lina-reaper", daemon=True),
                ]
                for t in self._threads:
                    t.start()
            self._pump()  # from the hook, when the gate and the budget let the head go now
        return handle

    def _close_open(self, now: float) -> None:
        """Queue the micro-op being filled (under the lock)."""
        if not self._open:
            return
        views = [v for v, *_ in self._open]
        chunk = views[0] if len(views) == 1 else torch.cat(views)
        _, _, part, parts = self._open[0]
        kind, group = self._open_kind
        op = MicroOp(self._count, kind, chunk, group, part, parts, now, [(v, h) for v, h, *_ in self._open])
        # the gradients (and the coalesced copy) were produced on the submitter's stream up to here
        op.ready = self.sx.record_event(self.sx.current_stream(chunk.device))
        self._queue.append(op)
        self._count += 1
        self._pending += 1
        self._open = []

    def side(self, op: MicroOp) -> Any:
        """The side stream of `op`'s communicator ("lina-dp" / "lina-expert_dp": one per dedicated
        communicator, so dp and expert-dp micro-ops never queue behind each other); None on the CPU."""
        return self.sx.side_stream(op.chunk.device, f"lina-{op.kind}")

    def _notify_all(self) -> None:
        """Wake every waiting thread (an error, close; under the lock)."""
        for cv in (self._cv, self._launch_cv, self._reap_cv):
            cv.notify_all()

    def _fail(self, err: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = err
            self._notify_all()

    def _launchable(self) -> bool:
        """The queue head may be launched now (under the lock)."""
        return not self._closed and self._error is None and bool(self._queue) and self._may_launch(self._queue[0])

    def _wake_launcher(self) -> None:
        """Wake the launcher only when it can launch (under the lock; CUDA: also while it polls)."""
        if self._launchable() or self._device_pending:
            self._launch_cv.notify()

    def _pump(self) -> None:
        """Launch queue heads, in order, while the gate and the budget allow (under the lock, by whichever
        thread holds it: a2a_start cannot slip between a gate check and its launch)."""
        while self._launchable():
            op = self._queue.popleft()
            if not self._launch(op):
                return

    def _run(self) -> None:
        """Launcher thread: sleep until the queue head may go (nothing to poll on the CPU), launch it."""
        while True:
            with self._cv:
                while not self._closed and self._error is None and not self._launchable():
                    # a device-side completion notifies nobody: poll while one is awaited
                    self._launch_cv.wait(DEVICE_POLL_S if self._device_pending else None)
                if self._closed or self._error is not None:
                    return
                self._pump()

    def _launch(self, op: MicroOp) -> bool:
        """Launch `op` (the queue head just taken, under the lock); False (and the error kept for drain)
        when the launch failed."""
        info = {"queued": op.queued, "index": op.index, "part": op.part, "parts": op.parts, "pieces": len(op.pieces)}
        try:
            with annotate("lina/micro_op"), observer.tagged("lina", self_timed=True, **info):
                op.launched = time.perf_counter()
                side = self.side(op)
                # the side stream starts after the gradient was produced (rule 2 of streams.py);
                # the all-reduce is issued on it, never on the compute stream
                self.sx.wait_event(side, op.ready)
                with self.sx.use(side):
                    op.work = all_reduce_raw(op.chunk, op.group, async_op=True)
                op.event = observer.last_event()
                self.sx.record_stream(op.chunk, side)  # read there; the caller may free it
        except Exception as e:  # noqa: BLE001  (reported by drain on the main thread)
            self._error = RuntimeError(f"Lina: launching micro-op #{op.index} failed: {e!r}")
            self._notify_all()
            return False
        self._inflight.append(op)
        self._inflight_bytes += op.nbytes
        self.max_concurrent = max(self.max_concurrent, len(self._inflight))
        self._reap_cv.notify()
        return True

    def _reap(self) -> None:
        """Reaper thread: wait for the launched micro-ops in launch order; measure the link rate."""
        while True:
            with self._cv:
                while not self._closed and self._error is None and not self._inflight:
                    self._reap_cv.wait()
                if self._closed or self._error is not None:
                    return
                op = self._inflight[0]
            side = self.side(op)
            try:
                with self.sx.use(side):
                    # CUDA: the side stream waits for the all-reduce (the host does not); gloo: blocks
                    op.work.wait(timeout=timedelta(seconds=self.timeout_s))
                    observer.stamp_finish(op.event)
                    if len(op.pieces) > 1:  # a coalesced buffer: back into the gradients, on the side stream
                        off = 0
                        for view, _ in op.pieces:
                            view.copy_(op.chunk[off : off + view.numel()])
                            off += view.numel()
                    op.done = self.sx.record_event(side)
                self._await_device(op)
            except Exception as e:  # noqa: BLE001  (gloo raises RuntimeError on timeout)
                what = (
                    f"Lina: gradient all_reduce micro-op #{op.index} on {describe_group(op.group)} "
                    f"({op.nbytes} bytes, chunk {op.part + 1}/{op.parts} of its tensor)"
                )
                lost = translate(e, "all_reduce", op.group)
                if isinstance(lost, CommPeerLostError):
                    self._fail(CommPeerLostError(f"{what}: {lost}", "all_reduce", group_name(op.group)))
                else:  # the wait above has the scheduler's own limit
                    self._fail(
                        CommTimeoutError(
                            f"{what} did not finish within --comm-timeout {self.timeout_s:g} s: a peer rank is "
                            f"stalled or dead, or the ranks issued collectives in different orders ({e})",
                            "all_reduce",
                            group_name(op.group),
                        )
                    )
                return
            now = time.perf_counter()
            with self._cv:
                self._inflight.popleft()
                self._inflight_bytes -= op.nbytes
                # service time: from when the link could start on this op to its finish; the rate
                # is decayed bytes over decayed busy time, not an average of per-op rates
                busy = max(0.0, now - max(op.launched, self._last_finish))
                self._last_finish = now
                self._rate_bytes = (1 - RATE_ALPHA) * self._rate_bytes + op.nbytes
                self._rate_time = (1 - RATE_ALPHA) * self._rate_time + busy
                if self._rate_time > 0:
                    self.rate_bps = self._rate_bytes / self._rate_time
                self._pending -= 1
                self._last_done[op.kind] = (op.chunk.device, op.done)
                for _, handle in op.pieces:
                    handle.remaining -= 1
                    if handle.remaining == 0:
                        handle.done_event.set()
                self._cv.notify_all()  # drain(), if it waits
                self._wake_launcher()  # budget freed

    def _await_device(self, op: MicroOp) -> None:
        """Block the reaper (not the caller) until the device completed `op` (CUDA: its `done` event;
        CPU: at once), so in-flight counts and the link rate see completion, not enqueue; a
        TimeoutError after `timeout_s`."""
        deadline = time.perf_counter() + self.timeout_s
        while not op.done.query():
            if time.perf_counter() > deadline:
                raise TimeoutError(f"its completion event did not complete in {self.timeout_s:g} s")
            time.sleep(DEVICE_POLL_S)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def drain(self) -> None:
        """Open the gate and wait until every queued micro-op has finished (call before the
        optimizer step). Raises CommTimeoutError when one did not finish in time."""
        with self._cv:
            self._close_open(time.perf_counter())
            self._draining = True
            self._pump()  # the gate is open now
            self._wake_launcher()
            try:
                while self._pending and self._error is None:
                    # the reaper's own wait times out first; this bounds a wedged launcher
                    before = self._pending
                    if (
                        not self._cv.wait(timeout=self.timeout_s + 5.0)
                        and self._pending == before
                        and self._error is None
                    ):
                        head = self._queue[0] if self._queue else None
                        where = f" on {describe_group(head.group)}" if head is not None else ""
                        self._error = CommTimeoutError(
                            f"Lina: {self._pending} gradient all_reduce micro-ops{where} made no progress in "
                            f"--comm-timeout {self.timeout_s:g} s",
                            "all_reduce",
                            group_name(head.group) if head is not None else "other",
                        )
            finally:
                self._draining = False
                self._imminent = False
                self._count = 0
                if self._anchor is not None:  # this iteration's schedule predicts the next ones
                    self._history.append(list(self._offsets))
                self._anchor, self._offsets = None, []
        self._raise_if_failed()
        # the consumer reads the gradients on its own stream: wait for every side stream's last point
        for kind, (dev, done) in sorted(self._last_done.items()):
            self.sx.wait_event(self.sx.current_stream(dev), done)
        self._last_done.clear()
        self._fold()

    def _fold(self) -> None:
        """Add the events since the last fold to the running totals."""
        new = [e for e in self.log.snapshot() if e.seq > self._folded_seq]
        if new:
            self._folded_seq = max(e.seq for e in new)
            for k, v in observer.summarize(new).items():
                self._totals[k] = self._totals.get(k, 0) + v
        self.iterations += 1

    @property
    def idle(self) -> bool:
        """No micro-op queued, being filled or in flight (true after every `drain()`)."""
        with self._cv:
            return not self._pending and not self._queue and not self._inflight and not self._open

    # ------------------------------------------------------------------ reporting, teardown
    def summary(self) -> dict:
        """`observer.summarize` totals (ms) over every drained iteration, plus the partition
        size, the number of iterations, the most micro-ops in flight at once and the measured
        link rate (MB/s, None before a micro-op finished)."""
        base = observer.summarize([])
        return {
            "partition_mb": self.partition_mb,
            "iterations": self.iterations,
            "max_in_flight_seen": self.max_concurrent,
            "link_mb_s": None if self.rate_bps is None else self.rate_bps / MB,
            **{k: self._totals.get(k, v) for k, v in base.items()},
        }

    def close(self) -> dict:
        """Stop the threads, remove hooks and listeners, log and return the summary."""
        with self._cv:
            self._closed = True
            self._notify_all()
        for t in self._threads:  # idle, they exit at once; in a wait, within the timeout
            t.join(timeout=self.timeout_s + 5.0)
            if t.is_alive():
                log.warning(f"lina: the {t.name} thread did not stop within --comm-timeout {self.timeout_s:g} s")
        self._threads = []
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        observer.remove_a2a_listener(self)
        self.log.stop()
        s = self.summary()
        log.info(
            f"lina (micro-ops of {self.partition_mb:g} MB, up to {self.max_in_flight} in flight): "
            f"{observer.format_summary(s)}"
        )
        return s
